"""fp32 master copies of low-precision model parameters.

A :class:`MasterParams` pairs each fp16/bf16 model param with a master tensor (fp32 by
default, on the param's device or on ``master_device``, e.g. the CPU for a CUDA model).
Gradients flow model -> master and weights master -> model only through
:mod:`fp16kit.core.kernels`, grouped by (device, dtype)::

    grads_to_masters(inv_scale, found_inf):       # after backward
        for each pair whose model grad exists:
            master.grad = float(model.grad) * inv_scale     # found_inf set on inf/NaN
        pairs without a model grad: master.grad = None      # the optimizer skips them
    masters_to_model():                           # after the optimizer step
        model.data = round_to_model_dtype(master)

Flat storage (``flat=True``): the masters of each device live in one contiguous buffer and
each master is a view of it (so is each master grad, in a second buffer). The optimizer still
sees one tensor per param (same state dict, same per-tensor semantics), while the unscale
runs as one op over the flat grad buffer.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from . import kernels

__all__ = ["LOW_PRECISION", "MasterParams", "SPARSE_GRADS", "needs_master"]

LOW_PRECISION: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)


SPARSE_GRADS = (
    "Sparse gradients cannot be unscaled into dense masters. A param gets a master when it is "
    "fp16/bf16 -- and every trainable param does with async_step=True or a master_device. Keep "
    "params with sparse grads (e.g. nn.Embedding(sparse=True)) in float32, in an optimizer "
    "built without async_step/master_device."
)


def _refs(t: torch.Tensor) -> int:
    return sys.getrefcount(t)


def _storage_refs(t: torch.Tensor) -> int:
    storage = t.untyped_storage()  # (the storage's own Python object, when one was made before)
    return sys.getrefcount(storage)


def _alone() -> tuple[int, int]:
    """What :func:`_refs` and :func:`_storage_refs` read for a tensor held by a dict and a caller's local only,
    its storage's Python object made once and dropped (the interpreter's own counts)."""
    held = {0: torch.empty(1)}
    spare = held.get(0)
    assert spare is not None
    spare.untyped_storage()
    return _refs(spare), _storage_refs(spare)


_ALONE, _STORAGE_ALONE = _alone()
_SPARE_MIN_NUMEL = 1 << 15  # (128 KiB of fp32: glibc's default mmap threshold)
_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _unshared(t: torch.Tensor) -> bool:
    """Nothing but the caller's dict holds ``t``: no Python reference (weak ones included) to it or to its storage,
    no C++ one (a ``.grad`` slot, a view, a tensor saved for backward: its own and its storage's use counts), and
    its memory is not shared with another process (sent through a torch.multiprocessing queue). False when this
    torch cannot tell."""
    if _storage_use_count is None or not hasattr(t, "_use_count") or t.is_shared() or weakref.getweakrefcount(t):
        return False  # (a weak reference would find the old grad alive again, with new values)
    return (
        _refs(t) <= _ALONE + 1
        and t._use_count() == 1
        and _storage_refs(t) <= _STORAGE_ALONE
        and _storage_use_count(t.untyped_storage()._cdata) == 2
    )


def needs_master(param: torch.Tensor) -> bool:
    """A trainable fp16/bf16 param gets a master; everything else is optimized as it is."""
    return param.requires_grad and param.dtype in LOW_PRECISION


class _FlatBlock:
    """One contiguous master buffer (and its grad buffer) on one device, with per-param views."""

    def __init__(self, masters: list[torch.Tensor], buffer: torch.Tensor) -> None:
        self.masters = masters
        self.buffer = buffer
        self.grad_buffer: torch.Tensor | None = None
        self.grad_views: list[torch.Tensor] = []

    def grad_view(self, i: int) -> torch.Tensor:
        if self.grad_buffer is None:
            self.grad_buffer = torch.zeros_like(self.buffer)
            self.grad_views = kernels.flat_views(self.grad_buffer, self.masters)
        return self.grad_views[i]


class MasterParams:
    """Masters for a list of low-precision params (see the module docstring).

    ``model_params[i]`` is paired with ``masters[i]``. Masters are leaf tensors with
    ``requires_grad=True``: an optimizer can own them in place of the model params.
    """

    def __init__(
        self,
        model_params: Iterable[torch.Tensor],
        *,
        master_dtype: torch.dtype = torch.float32,
        master_device: torch.device | str | None = None,
        flat: bool = False,
    ) -> None:
        if not master_dtype.is_floating_point:
            raise TypeError(f"master_dtype must be a floating dtype, got {master_dtype}.")
        self.master_dtype = master_dtype
        self.master_device = None if master_device is None else torch.device(master_device)
        self.flat = flat
        self.model_params: list[torch.Tensor] = []
        self.masters: list[torch.Tensor] = []
        self._blocks: list[tuple[_FlatBlock, int]] = []  # per master, when flat
        self._flat_blocks: list[_FlatBlock] = []  # each block once
        self._spare_grads: dict[int, torch.Tensor] = {}  # per master, the CPU grad given last (_new_grad)
        self._grads_left_out = False  # see grads_left_out()
        self._sparable: list[bool] = []  # per master: large and on the CPU (_new_grad)
        self.add(model_params)

    def __len__(self) -> int:
        return len(self.masters)

    def add(self, model_params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """Create masters for more params (e.g. a new param group); return the new masters."""
        params = list(model_params)
        for p in params:
            if not isinstance(p, torch.Tensor) or not p.is_floating_point():
                raise TypeError(
                    f"Masters are made for floating-point tensors, got "
                    f"{p.type() if isinstance(p, torch.Tensor) else type(p).__name__}."
                )
            if p.is_sparse:
                raise TypeError(
                    "Masters cannot be made for sparse params; keep them out of the "
                    "low-precision set (give them dtype float32)."
                )
        if self.flat:
            new = self._add_flat(params)
        else:
            new = [self._new_master(p) for p in params]
        self.model_params.extend(params)
        self.masters.extend(new)
        self._sparable.extend(m.device.type == "cpu" and m.numel() >= _SPARE_MIN_NUMEL for m in new)
        return new

    def _target_device(self, p: torch.Tensor) -> torch.device:
        return p.device if self.master_device is None else self.master_device

    def _new_master(self, p: torch.Tensor) -> torch.Tensor:
        m = p.detach().to(device=self._target_device(p), dtype=self.master_dtype, copy=True)
        if m.device.type == "cpu" and p.device.type == "cuda":
            m = m.pin_memory()  # host <-> device copies of offloaded masters can overlap
        return m.requires_grad_(True)

    def _add_flat(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        by_device: dict[torch.device, list[int]] = {}
        for i, p in enumerate(params):
            by_device.setdefault(self._target_device(p), []).append(i)
        new: list[torch.Tensor | None] = [None] * len(params)
        blocks: list[tuple[_FlatBlock, int] | None] = [None] * len(params)
        for device, idx in by_device.items():
            group = [params[i] for i in idx]
            pin = device.type == "cpu" and any(p.device.type == "cuda" for p in group)
            buffer = kernels.flatten(group, dtype=self.master_dtype, device=device, pin_memory=pin)
            # Views of a buffer that does not require grad are leaves: they can be params.
            views = kernels.flat_views(buffer, group)
            block = _FlatBlock(views, buffer)
            self._flat_blocks.append(block)
            for j, (i, v) in enumerate(zip(idx, views)):
                v.requires_grad_(True)
                new[i] = v
                blocks[i] = (block, j)
        self._blocks.extend(b for b in blocks if b is not None)
        return [m for m in new if m is not None]

    # ------------------------------------------------------------------ grads
    def grads_to_masters(
        self,
        inv_scale: torch.Tensor | None,
        found_inf: torch.Tensor | None,
        *,
        clear_missing: bool = True,
        grads: Sequence[torch.Tensor | None] | None = None,
        unscale: bool = True,
    ) -> dict[torch.device, torch.Tensor]:
        """Set ``master.grad = float(model.grad) * inv_scale`` for every pair with a model grad.

        Master grads are allocated on first use. Pairs without a model grad get ``master.grad = None`` (the optimizer then
        skips them), or keep their master grad with ``clear_missing=False`` (apex's FP16_Optimizer did).
        ``grads`` replaces the model params' ``.grad`` (grads handed off to another thread). Returns
        ``{device: found_inf}`` for the master devices (see kernels.unscale_to_). ``unscale=False`` only
        copies (for a fused optimizer that unscales in its kernel; the grads were checked already) and returns
        ``{}``."""
        if unscale and (inv_scale is None or found_inf is None):
            raise TypeError("grads_to_masters needs inv_scale and found_inf unless unscale=False.")
        srcs: list[torch.Tensor] = []
        dsts: list[torch.Tensor] = []
        if grads is None:
            grads = [p.grad for p in self.model_params]
        for i, (g, m) in enumerate(zip(grads, self.masters)):
            if g is None:
                if clear_missing:
                    m.grad = None
                continue
            if g.is_sparse:
                raise TypeError(SPARSE_GRADS)
            if m.grad is None:
                if self.flat:
                    m.grad = self._blocks[i][0].grad_view(self._blocks[i][1])
                else:
                    m.grad = self._new_grad(i, m) if self._sparable[i] else torch.empty_like(m)
            srcs.append(g)
            dsts.append(m.grad)
        self._grads_left_out = False
        if not srcs:
            return {}
        if not unscale:
            kernels.copy_to_(srcs, dsts)
            return {}
        assert inv_scale is not None and found_inf is not None  # checked on entry
        if not self.flat:
            return kernels.unscale_to_(srcs, dsts, inv_scale, found_inf)
        flags = kernels.unscale_to_one_pass_(srcs, dsts, inv_scale, found_inf)
        if flags is not None:
            return flags
        # Flat: copy per param, then check-and-unscale each block whose every master grad is
        # its view as one tensor (one op over the buffer), the rest per tensor.
        kernels.copy_to_(srcs, dsts)
        return kernels.unscale_(self._flat_unscale_targets(), inv_scale, found_inf)

    def _new_grad(self, i: int, master: torch.Tensor) -> torch.Tensor:
        """A master grad to write: on the CPU, the one given last time when nothing else holds it any more.

        apex's faces set the master grads to None at every step (amp after it, FP16_Optimizer at
        ``zero_grad(set_grads_to_None=True)``); a fresh CPU allocation of that size comes from the OS and
        costs a page fault per 4 KiB (measured: 24.6M elements unscaled into fresh memory 32 ms, into
        memory written before 4.3 ms). CUDA's caching allocator has no such cost, and there memory
        between steps matters more: a fresh grad each time. So does a small one: malloc serves it from
        memory it keeps (below its mmap threshold, 128 KiB by default). Called for the others only."""
        if master.device.type != "cpu":  # (moved since it was added)
            return torch.empty_like(master)
        spare = self._spare_grads.get(i)
        if (
            spare is not None
            and _unshared(spare)
            and spare.shape == master.shape
            and spare.dtype == master.dtype
            and spare.stride() == master.stride()
        ):
            return spare
        grad = torch.empty_like(master)
        self._spare_grads[i] = grad
        return grad

    def release_grad_memory(self) -> None:
        """Let go of the memory kept for master grads: the spare CPU grads and the flat grad buffers.

        For a step that reads no master grads (the fused kernel's, from the 16-bit grads): kept, they would hold
        4 B/param that nothing reads. The next step that makes master grads allocates them again. A flat grad
        buffer stays while one of its masters still has a grad (its view holds the memory anyway)."""
        if self._spare_grads:
            self._spare_grads.clear()
        for block in self._flat_blocks:
            if block.grad_buffer is not None and all(m.grad is None for m in block.masters):
                block.grad_buffer, block.grad_views = None, []

    def _flat_unscale_targets(self) -> list[torch.Tensor]:
        per_block: dict[int, tuple[_FlatBlock, list[torch.Tensor], bool]] = {}
        for m, (block, j) in zip(self.masters, self._blocks):
            entry = per_block.setdefault(id(block), (block, [], True))
            whole = entry[2] and m.grad is not None and m.grad is block.grad_views[j]
            if m.grad is not None:
                entry[1].append(m.grad)
            per_block[id(block)] = (block, entry[1], whole)
        targets: list[torch.Tensor] = []
        for block, grads, whole in per_block.values():
            if whole and block.grad_buffer is not None:
                targets.append(block.grad_buffer)
            else:
                targets.extend(grads)
        return targets

    def masters_to_model(self, *, non_blocking: bool = False) -> None:
        """Copy the masters into the model params (rounding to the params' dtype).

        ``non_blocking``: from pinned host masters, let the copies overlap (the caller orders any later write
        to the masters after an event)."""
        if self.masters:
            kernels.copy_to_(self.masters, self.model_params, non_blocking=non_blocking)

    def grads_left_out(self) -> None:
        """Record a step that gave every master a grad without writing it (the fused kernel's asynchronous job).

        torch would have a grad on each of them now, so a following ``zero_grad(set_to_none=False)`` of the masters
        makes them, zeroed -- a master whose param then gets no grad is stepped with zero, as torch steps a zeroed
        param -- until master grads are written again."""
        self._grads_left_out = True

    def zero_grad(self, set_to_none: bool = True, *, model: bool = True, masters: bool = True) -> None:
        """Clear the model params' grads and/or the masters' grads (see :meth:`grads_left_out`)."""
        params = [*(self.model_params if model else ()), *(self.masters if masters else ())]
        kernels.clear_grads_(params, set_to_none=set_to_none)
        if masters and self._grads_left_out:
            self._grads_left_out = False
            if not set_to_none:
                for m in self.masters:
                    if m.grad is None:
                        m.grad = torch.zeros_like(m)

    def summary(self) -> str:
        """``"<count> masters, <numel> elements, <dtype> on <devices>[, flat]"`` (for reprs)."""
        d = self.describe()
        devices = ", ".join(d["devices"]) or "-"
        return f"{d['count']} masters, {d['numel']} elements, {d['master_dtype']} on {devices}{', flat' if d['flat'] else ''}"

    def describe(self) -> dict[str, Any]:
        devices = sorted({str(m.device) for m in self.masters})
        return {
            "count": len(self.masters),
            "numel": sum(m.numel() for m in self.masters),
            "master_dtype": str(self.master_dtype).replace("torch.", ""),
            "devices": devices,
            "flat": self.flat,
        }
