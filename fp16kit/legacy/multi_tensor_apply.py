"""apex.multi_tensor_apply (and the ``amp_C`` ops scripts call through it) without apex's CUDA extension.

Pure-torch stand-ins on fp16kit's core kernels and optimizers, CPU and CUDA.

    from fp16kit.legacy.multi_tensor_apply import multi_tensor_applier, amp_C   # was: import amp_C
    overflow_buf = torch.zeros(1, dtype=torch.int)
    multi_tensor_applier(amp_C.multi_tensor_scale, overflow_buf, [srcs, dsts], scale)
    norm, per_tensor = multi_tensor_applier(amp_C.multi_tensor_l2norm, overflow_buf, [tensors], True)

``multi_tensor_scale``: ``dst = src * scale`` (fp32 math, one rounding), ``overflow_buf`` set
to 1 if a source holds inf/NaN (never cleared). ``multi_tensor_l2norm``: the total L2 norm (a
1-element fp32 tensor) and, with ``per_tensor``, each tensor's norm; the flag is set when the
norm is not finite. Exact on CPU for the scale; the norm up to summation order.
``multi_tensor_adam`` (``[grads, params, exp_avgs, exp_avg_sqs]``, what copies of apex's
FusedAdam.step such as fairseq's ``FusedAdamV2`` call): :class:`fp16kit.optim.Adam`'s rule.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..core import kernels
from ..optim.adam import adam_update_

__all__ = [
    "MultiTensorApply",
    "amp_C",
    "multi_tensor_adam",
    "multi_tensor_applier",
    "multi_tensor_l2norm",
    "multi_tensor_scale",
]


class MultiTensorApply:
    """apex's applier: ``applier(op, noop_flag_buffer, tensor_lists, *args)`` calls ``op(chunk_size, ...)``.

    The call is ``op(chunk_size, noop_flag_buffer, tensor_lists, *args)``. ``available`` is True:
    the ops here need no extension."""

    available = True
    warned = False

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size

    @staticmethod
    def check_avail() -> None:
        """apex raised when its extension was missing; these ops are always there."""

    def __call__(
        self,
        op: Callable[..., Any],
        noop_flag_buffer: torch.Tensor,
        tensor_lists: Sequence[Sequence[torch.Tensor]],
        *args: Any,
    ) -> Any:
        return op(self.chunk_size, noop_flag_buffer, tensor_lists, *args)


def multi_tensor_scale(
    chunk_size: int,
    noop_flag: torch.Tensor,
    tensor_lists: Sequence[Sequence[torch.Tensor]],
    scale: float | torch.Tensor,
) -> None:
    """``amp_C.multi_tensor_scale``: ``tensor_lists = [srcs, dsts]``; ``dst = src * scale``."""
    if len(tensor_lists) != 2:
        raise ValueError(f"multi_tensor_scale takes [sources, destinations], got {len(tensor_lists)} lists.")
    if isinstance(scale, torch.Tensor) and scale.dim() > 0:
        # apex's binding took a C++ float: pybind converted a one-element tensor, nothing else
        if scale.numel() != 1:
            raise TypeError(
                f"multi_tensor_scale: the scale must be a number or a one-element tensor, got a "
                f"tensor of shape {tuple(scale.shape)}."
            )
        scale = scale.reshape(())
    kernels.scale_to_(list(tensor_lists[0]), list(tensor_lists[1]), scale, noop_flag)


def multi_tensor_l2norm(
    chunk_size: int, noop_flag: torch.Tensor, tensor_lists: Sequence[Sequence[torch.Tensor]], per_tensor: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``amp_C.multi_tensor_l2norm``: ``tensor_lists = [tensors]``; returns ``(norm, per_tensor_norms)``."""
    if len(tensor_lists) != 1:
        raise ValueError(f"multi_tensor_l2norm takes [tensors], got {len(tensor_lists)} lists.")
    return kernels.l2_norm_and_flag_(list(tensor_lists[0]), noop_flag, per_tensor=bool(per_tensor))


def multi_tensor_adam(
    chunk_size: int,
    noop_flag: torch.Tensor,
    tensor_lists: Sequence[Sequence[torch.Tensor]],
    lr: float,
    beta1: float,
    beta2: float,
    epsilon: float,
    step: int,
    mode: int,
    bias_correction: int,
    weight_decay: float,
) -> None:
    """``amp_C.multi_tensor_adam``: one Adam step in place, the rule of :class:`fp16kit.optim.Adam`.

    ``amp_C.multi_tensor_adam``: ``tensor_lists = [grads, params, exp_avgs, exp_avg_sqs]``,
    one Adam step in place (``mode`` 1: decoupled decay, 0: L2; fp32 math, fp32 moments), the
    rule of :class:`fp16kit.optim.Adam`. What fairseq's ``FusedAdamV2`` and other copies of
    apex's FusedAdam.step call through ``FusedAdam.multi_tensor_adam``. ``noop_flag`` is not
    read (apex's non-capturable kernel did not either)."""
    if len(tensor_lists) != 4:
        raise ValueError(
            f"multi_tensor_adam takes [grads, params, exp_avgs, exp_avg_sqs], got {len(tensor_lists)} lists."
        )
    grads, params, exp_avgs, exp_avg_sqs = (list(t) for t in tensor_lists)
    if not len(grads) == len(params) == len(exp_avgs) == len(exp_avg_sqs):
        raise ValueError("multi_tensor_adam: the four lists must have the same length.")
    for i, (p, m, v) in enumerate(zip(params, exp_avgs, exp_avg_sqs)):
        if m.shape != p.shape or v.shape != p.shape or m.dtype != torch.float32 or v.dtype != torch.float32:
            raise ValueError(
                f"multi_tensor_adam: tensor {i}: exp_avg and exp_avg_sq must be float32 tensors of the "
                f"param's shape {tuple(p.shape)} (got {m.dtype} {tuple(m.shape)}, {v.dtype} {tuple(v.shape)})."
            )
    adam_update_(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=epsilon,
        step=int(step),
        adam_w_mode=bool(mode),
        bias_correction=bool(bias_correction),
        weight_decay=weight_decay,
    )


#: apex's ``MultiTensorApply(2048*32)``
multi_tensor_applier = MultiTensorApply(2048 * 32)


def _not_provided(name: str) -> AttributeError:
    return AttributeError(
        f"amp_C.{name} is not provided by fp16kit: its amp_C stands in for multi_tensor_scale, "
        "multi_tensor_l2norm and multi_tensor_adam only. Use torch's multi-tensor (foreach) ops or an "
        "optimizer of fp16kit.optim / fp16kit.legacy.optimizers instead."
    )


class _AmpC(types.SimpleNamespace):
    """The ``amp_C`` stand-in: the three ops above; other apex op names raise an AttributeError
    that says which ops there are."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("multi_tensor_"):
            raise _not_provided(name)
        raise AttributeError(f"'amp_C' stand-in has no attribute {name!r}")


def __getattr__(name: str) -> Any:
    # `import amp_C` under fp16kit's apex alias resolves to this module
    if name.startswith("multi_tensor_"):
        raise _not_provided(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: stand-in for the ``amp_C`` extension module (the three ops above)
amp_C = _AmpC(
    multi_tensor_scale=multi_tensor_scale, multi_tensor_l2norm=multi_tensor_l2norm, multi_tensor_adam=multi_tensor_adam
)
