"""What the demo measures beside the losses: updates lost to rounding, and bytes of training state.

What the demo measures beside the losses: the updates lost to rounding, and the bytes of
training state a recipe holds.

**Updates lost** (:class:`LostUpdates`): the share of weight elements a step taken left
unchanged. "The weights" are the tensors the torch optimizer steps: the fp32 masters where a
recipe keeps them, else the model's own params (16-bit ones without masters). A step hook on
that optimizer counts, over every step it takes (a skipped step takes none)::

    before step:  copy of each param the optimizer steps
    after step:   lost += number of elements equal to their copy;   total += number of elements
    fraction   =  lost / total

An element's update is lost when ``w + u`` rounds back to ``w``: in fp32 about
``|u| < 2**-24 |w|``, in fp16 ``2**-11 |w|``, in bf16 ``2**-8 |w|``. The counts stay on the
device (no host sync per step) and the hooks run wherever the step runs (the optimizer thread,
for asynchronous steps).

**State bytes** (:func:`state_bytes`): after a step, the distinct storages (a flat buffer's
views count once) of the model's params, their grads, the optimizer's state tensors, and the
masters with their grads (the tensors the optimizer steps that are not model params).
Activations are not counted: they depend on the batch, not on the recipe's state.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

__all__ = ["LostUpdates", "STATE_PARTS", "state_bytes", "storage_bytes"]

STATE_PARTS = ("weights", "grads", "optimizer state", "masters")


def _stepped(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


class LostUpdates:
    """Counts the elements each step of ``optimizer`` leaves unchanged.

    See the module docstring; :meth:`remove` takes the hooks off."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._before: list[torch.Tensor] = []
        self._lost: torch.Tensor | None = None
        self._total = 0
        self._handles = [
            optimizer.register_step_pre_hook(self._pre_step),
            optimizer.register_step_post_hook(self._post_step),
        ]

    def _pre_step(self, optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        # the optimizer passed in: for an asynchronous step, the view that steps (same params)
        self._before = [p.detach().clone() for p in _stepped(optimizer)]

    def _post_step(self, optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        params = _stepped(optimizer)
        unchanged = torch.stack([(p.detach() == b).sum() for p, b in zip(params, self._before)]).sum()
        self._lost = unchanged if self._lost is None else self._lost + unchanged
        self._total += sum(p.numel() for p in params)
        self._before = []

    def counts(self) -> tuple[int, int]:
        """(elements left unchanged, elements stepped) over the steps so far.

        A host read; with steps on another thread, read after they landed."""
        return (0 if self._lost is None else int(self._lost.item())), self._total

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def storage_bytes(tensors: Iterable[torch.Tensor], seen: set[tuple[str, int]]) -> int:
    """Bytes of the storages behind ``tensors`` not in ``seen`` yet (adds them)."""
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes held by each of :data:`STATE_PARTS` (see the module docstring).

    ``optimizer`` being the torch optimizer that steps the weights (the inner one of a
    wrapper)."""
    params = list(model.parameters())
    seen: set[tuple[str, int]] = set()
    weights = storage_bytes(params, seen)
    grads = storage_bytes([p.grad for p in params if p.grad is not None], seen)
    state = storage_bytes(
        [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)], seen
    )
    masters = _stepped(optimizer)  # what the optimizer steps: model params among them are counted already
    master_bytes = storage_bytes(masters, seen) + storage_bytes([m.grad for m in masters if m.grad is not None], seen)
    return dict(zip(STATE_PARTS, (weights, grads, state, master_bytes)))
