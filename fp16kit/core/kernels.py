"""The one unscale path: stateless multi-tensor operations on gradients, masters and scales.

Every tensor operation fp16kit performs on gradients, master weights or loss scales lives here,
so that a fix or a faster kernel serves every face (GradScaler, MixedPrecisionOptimizer, legacy).

Arithmetic contract (the reference is ``torch.amp.GradScaler``)::

    inv_scale = float32(1 / float64(scale))          # reciprocal in double, then cast
    for each tensor t (grouped by (device, dtype)):
        if any element of t is inf or NaN: found_inf[t.device] = 1.0
        t = t * inv_scale                            # also when non-finite values are present

* ``found_inf`` is a float32 0-dim tensor. A kernel returns ``{device: flag}`` and only ever
  *sets* flags to 1.0 (a flag passed in set stays set): ``found_inf`` itself on its own
  device (pass a fresh one, :func:`new_found_inf`), copies of it on other devices. Flags of
  several calls are merged with :func:`merge_found_inf` / :func:`combine_found_inf`;
  clearing means a new flag.
* Tensors are grouped by ``(device, dtype)`` and each group is handed to one multi-tensor op
  (``torch._amp_foreach_non_finite_check_and_unscale_`` / ``torch._foreach_copy_``), which runs
  on CPU and CUDA alike: one launch per group, not one per tensor.
* Nothing here reads a tensor's value on the host: no ``.item()``, ``bool(t)``, ``float(t)`` or
  ``.tolist()``. The only host work is looking at tensor metadata (device, dtype, layout).
* Copies are ``non_blocking`` only towards an accelerator (:func:`move`): a non-blocking copy
  onto the CPU returns before the data has arrived, and the next CPU op could read garbage.
"""

from __future__ import annotations

from collections import abc, defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Union, overload

import torch

from .fused import unscale as fused_unscale

__all__ = [
    "PerDevice",
    "TensorOrIterable",
    "all_reduce_found_inf",
    "check_finite_",
    "clear_grads_",
    "clear_overflow_buf_",
    "clip_grad_norm_",
    "combine_found_inf",
    "copy_pairs_",
    "copy_to_",
    "flat_views",
    "flatten",
    "group_by_device_and_dtype",
    "inv_scale",
    "l2_norm",
    "l2_norm_and_flag_",
    "l2_norms",
    "raise_flag_",
    "merge_found_inf",
    "move",
    "new_found_inf",
    "new_overflow_buf",
    "norms",
    "overflow_buf_as_found_inf",
    "scale_outputs",
    "scale_to_",
    "unscale_",
    "unscale_grads_",
    "unscale_add_to_",
    "unscale_to_",
    "stack_flags",
    "refresh_stale_masters_",
]

TensorOrIterable = Union[torch.Tensor, Iterable[Any]]


class PerDevice:
    """Lazily serves copies of one tensor to the devices that ask for it (cached per device).

    The copy for the tensor's own device is a copy too (``copy=True``), exactly as torch's
    ``_MultiDeviceReplicator``, so writes into a per-device flag never alias the master --
    unless ``share_own_device``: then that device gets the master itself (one device op less;
    for a read-only value, or a fresh flag the caller lets the kernels write).
    """

    def __init__(self, master: torch.Tensor, *, share_own_device: bool = False) -> None:
        self.master = master
        self.per_device: dict[torch.device, torch.Tensor] = {}
        self._share = share_own_device

    def get(self, device: torch.device) -> torch.Tensor:
        t = self.per_device.get(device)
        if t is None:
            if self._share and device == self.master.device:
                t = self.master
            else:
                t = move(self.master, device, copy=True)
            self.per_device[device] = t
        return t


def move(
    t: torch.Tensor, device: torch.device | str, dtype: torch.dtype | None = None, *, copy: bool = False
) -> torch.Tensor:
    """Return ``t.to(device, dtype)``, non-blocking unless the target is the CPU.

    A non-blocking copy from an accelerator into host memory may still be in flight when the CPU reads it."""
    device = torch.device(device)
    return t.to(device=device, dtype=dtype, non_blocking=device.type != "cpu", copy=copy)


def inv_scale(scale: torch.Tensor) -> torch.Tensor:
    """Return float32 ``1/scale``, the reciprocal taken in float64.

    fp32 division can be inexact under some compile options; on MPS, which has no float64, the reciprocal is
    taken in float32 as torch does."""
    if scale.device.type == "mps":
        return scale.float().reciprocal()
    return scale.double().reciprocal().float()


def new_found_inf(device: torch.device | str) -> torch.Tensor:
    """A fresh, cleared found-inf flag: float32 0-dim zero on ``device``."""
    return torch.full((), 0.0, dtype=torch.float32, device=device)


def new_overflow_buf(device: torch.device | str) -> torch.Tensor:
    """Return apex amp's ``LossScaler._overflow_buf``: a cleared int32 ``[0]`` on ``device``.

    It is the ``noop_flag`` amp_C kernels set to 1 on inf/NaN."""
    return torch.zeros(1, dtype=torch.int32, device=device)


def clear_overflow_buf_(buf: torch.Tensor) -> None:
    """Zero an apex ``_overflow_buf`` (or any ``noop_flag``) in place."""
    with torch.no_grad():
        buf.zero_()


def overflow_buf_as_found_inf(buf: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Read an apex ``noop_flag`` / ``_overflow_buf`` as a found-inf flag on ``device``.

    The buffer may have any dtype and shape; the flag is float32 0-dim, 1.0 when any element is nonzero."""
    return (buf != 0).any().to(device=device, dtype=torch.float32)


def group_by_device_and_dtype(
    tensors: Iterable[torch.Tensor],
) -> dict[torch.device, dict[torch.dtype, list[torch.Tensor]]]:
    """Split tensors into ``{device: {dtype: [tensors]}}``, keeping their order within a group."""
    groups: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(lambda: defaultdict(list))
    for t in tensors:
        groups[t.device][t.dtype].append(t)
    return groups


def unscale_(
    tensors: Iterable[torch.Tensor], inv_scale: torch.Tensor, found_inf: torch.Tensor
) -> dict[torch.device, torch.Tensor]:
    """In place: ``t *= inv_scale`` for every tensor; flag non-finite values in ``found_inf``.

    Returns ``{device: found_inf on that device}`` for every device that held a tensor:
    ``found_inf`` itself on its own device (pass a fresh flag, e.g. :func:`new_found_inf`),
    copies of it on the others, so the caller combines them (see :func:`combine_found_inf`).
    Tensors must be dense and floating point.
    """
    per_inv = PerDevice(inv_scale, share_own_device=True)
    per_found = PerDevice(found_inf, share_own_device=True)
    with torch.no_grad():
        for device, per_dtype in group_by_device_and_dtype(tensors).items():
            for group in per_dtype.values():
                torch._amp_foreach_non_finite_check_and_unscale_(group, per_found.get(device), per_inv.get(device))
    return per_found.per_device


def unscale_grads_(
    params: Iterable[torch.Tensor],
    inv_scale: torch.Tensor,
    found_inf: torch.Tensor,
    *,
    allow_fp16: bool,
) -> dict[torch.device, torch.Tensor]:
    """Unscale the ``.grad`` of each param in place, as ``torch.amp.GradScaler`` does.

    * Params without a grad are skipped.
    * ``allow_fp16=False`` rejects float16 grads with ``ValueError("Attempting to unscale FP16
      gradients.")`` *before* touching any grad (torch's GradScaler refuses to unscale fp16
      grads in place: 1/scale can underflow them).
    * Sparse grads: their ``_values()`` are unscaled. An uncoalesced fp16 sparse grad is first
      coalesced (``param.grad`` is replaced): summing duplicate indices can overflow fp16, and
      the check must see the coalesced values.

    Returns ``{device: found_inf}`` as :func:`unscale_`.
    """
    to_unscale: list[torch.Tensor] = []
    with torch.no_grad():
        for param in params:
            grad = param.grad
            if grad is None:
                continue
            if (not allow_fp16) and grad.dtype == torch.float16:
                raise ValueError("Attempting to unscale FP16 gradients.")
            if grad.is_sparse:
                if grad.dtype is torch.float16:
                    param.grad = grad = grad.coalesce()
                to_unscale.append(grad._values())
            else:
                to_unscale.append(grad)
    return unscale_(to_unscale, inv_scale, found_inf)


def check_finite_(tensors: Iterable[torch.Tensor], found_inf: torch.Tensor) -> dict[torch.device, torch.Tensor]:
    """Flag non-finite values of ``tensors`` in ``found_inf`` without changing their values.

    Implemented as an in-place multiply by exactly 1.0 through the same multi-tensor op as
    :func:`unscale_` (``x * 1.0 == x`` bit for bit, NaN stays NaN), which is also how torch's
    GradScaler checks grads for fused optimizers. Returns ``{device: found_inf}``.
    """
    return unscale_(tensors, one(found_inf.device), found_inf)


_ONES: dict[Any, torch.Tensor] = {}


def one(device: torch.device) -> torch.Tensor:
    """A float32 0-dim 1.0 on ``device`` (read it, never write it): a scale of 1 with no device op per use.

    Made once per device -- on CUDA once per stream, since it is first written on the stream that asks for it
    and read there."""
    key: Any = device
    if device.type == "cuda":
        key = (device, torch.cuda.current_stream(device).cuda_stream)
    t = _ONES.get(key)
    if t is None:
        t = _ONES[key] = torch.ones((), dtype=torch.float32, device=device)
    return t


def flag_nonfinite_scale_(
    flags: dict[torch.device, torch.Tensor], inv_scale: torch.Tensor
) -> dict[torch.device, torch.Tensor]:
    """Also set every flag in ``flags`` when ``inv_scale`` is inf/NaN; returns ``flags``.

    torch's check-and-unscale tests the grads *before* multiplying: once a scale has
    underflowed to 0 (about 170 overflows in a row under torch's rule), ``inv_scale`` is inf
    and zero grads become ``0 * inf = NaN`` unflagged, which torch.amp's scaler then writes
    into the weights. The master-weight paths call this so such a step is skipped instead.
    """
    bad = torch.isfinite(inv_scale).logical_not()
    for device, found in flags.items():
        torch.maximum(found, move(bad, device, found.dtype), out=found)
    return flags


def unscale_to_(
    srcs: Sequence[torch.Tensor],
    dsts: Sequence[torch.Tensor],
    inv_scale: torch.Tensor,
    found_inf: torch.Tensor,
) -> dict[torch.device, torch.Tensor]:
    """``dst = float(src) * inv_scale`` for each pair, flagging non-finite values.

    This is the model-grads -> master-grads path: ``src`` is typically an fp16/bf16 grad and
    ``dst`` its fp32 master grad, possibly on another device (CPU offload). The copy converts
    exactly (every fp16/bf16 value, inf and NaN included, is representable in fp32); then the
    check-and-unscale runs on the destination, so the found-inf flags live on the destination
    devices. Pairs are grouped so each (src device, src dtype, dst device, dst dtype) group is
    one multi-tensor copy. Returns ``{device: found_inf}`` keyed by destination device.
    """
    if len(srcs) != len(dsts):
        raise ValueError(
            f"unscale_to_ needs one destination per source; got {len(srcs)} sources and {len(dsts)} destinations."
        )
    flags = unscale_to_one_pass_(srcs, dsts, inv_scale, found_inf)
    if flags is not None:
        return flags
    copy_to_(srcs, dsts)
    return unscale_(dsts, inv_scale, found_inf)


def unscale_to_one_pass_(
    srcs: Sequence[torch.Tensor],
    dsts: Sequence[torch.Tensor],
    inv_scale: torch.Tensor,
    found_inf: torch.Tensor,
) -> dict[torch.device, torch.Tensor] | None:
    """:func:`unscale_to_` in one pass by the fused kernel (:mod:`fp16kit.core.fused.unscale`), or None, nothing done.

    None when the kernel does not take the pairs (off, not all on the CPU, ...); the numbers are the two-op path's."""
    if not fused_unscale.unscale_to_(srcs, dsts, inv_scale, found_inf):
        return None
    return {found_inf.device: found_inf}


def unscale_add_to_(
    srcs: Sequence[torch.Tensor],
    dsts: Sequence[torch.Tensor],
    inv_scale: torch.Tensor,
    found_inf: torch.Tensor,
) -> dict[torch.device, torch.Tensor]:
    """Compute ``dst += float(src) * inv_scale`` for each pair, flagging non-finite values of the sources.

    This is gradient accumulation across backward passes that were scaled differently (apex amp's "unscale
    with stash": the product is rounded to ``dst``'s dtype, then added, one rounding each, as apex's Python
    path). Returns ``{device: found_inf}`` keyed by the destinations' devices."""
    if not srcs and not dsts:
        return {}
    with torch.no_grad():
        tmps = [torch.empty_like(d) for d in dsts]
        flags = unscale_to_(srcs, tmps, inv_scale, found_inf)
        groups: dict[tuple[Any, ...], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for t, d in zip(tmps, dsts):
            key = (d.device, d.dtype)
            groups.setdefault(key, ([], []))
            groups[key][0].append(d)
            groups[key][1].append(t)
        for d_list, t_list in groups.values():
            torch._foreach_add_(d_list, t_list)
    return flags


def stack_flags(flags: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Return found-inf flags from any devices as one 1-D float32 tensor on ``device``.

    A caller that must decide on the host then reads them all at once."""
    if not flags:
        return torch.zeros(0, dtype=torch.float32, device=device)
    return torch.stack([move(f, device, torch.float32) for f in flags])


def refresh_stale_masters_(model_params: Sequence[torch.Tensor], masters: Sequence[torch.Tensor]) -> None:
    """Set ``master = float(param)`` where a master no longer rounds to its model param's value.

    That happens when the model was loaded or edited in place. Masters that still round to the param keep
    their extra precision (an exact checkpoint restore, the state after a step). Elementwise, on the device."""
    with torch.no_grad():
        for p, m in zip(model_params, masters):
            src = p.detach().to(device=m.device)
            stale = m.to(p.dtype) != src
            m.copy_(torch.where(stale, src.to(m.dtype), m))


def copy_to_(
    srcs: Sequence[torch.Tensor],
    dsts: Sequence[torch.Tensor],
    *,
    non_blocking: bool = False,
) -> None:
    """Do ``dst.copy_(src)`` for each pair (casting dtype, crossing devices), one multi-tensor copy per group.

    A group is one (src device, src dtype, dst device, dst dtype). This is also the masters -> model params
    path (fp32 -> fp16/bf16 rounds to nearest even, as ``copy_``).

    ``non_blocking=True`` lets copies between pinned host memory and a device overlap; the
    caller then owns the ordering (an event before the host reads or rewrites either side)."""
    if len(srcs) != len(dsts):
        raise ValueError(
            f"copy_ needs one destination per source; got {len(srcs)} sources and {len(dsts)} destinations."
        )
    groups: dict[tuple[Any, ...], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for s, d in zip(srcs, dsts):
        key = (s.device, s.dtype, d.device, d.dtype)
        if key not in groups:
            groups[key] = ([], [])
        groups[key][0].append(s)
        groups[key][1].append(d)
    with torch.no_grad():
        for s_list, d_list in groups.values():
            torch._foreach_copy_(d_list, s_list, non_blocking=non_blocking)


def copy_pairs_(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], *, non_blocking: bool = False) -> None:
    """:func:`copy_to_` for ``(source, destination)`` pairs (checkpoint restores)."""
    if pairs:
        copy_to_([src for src, _ in pairs], [dst for _, dst in pairs], non_blocking=non_blocking)


def combine_found_inf(
    found_infs: Iterable[torch.Tensor], device: torch.device, *, into_first: bool = False
) -> torch.Tensor:
    """Combine found-inf flags from any devices onto ``device``: 1.0 if any is set.

    With ``into_first``, their sum, as torch's ``update()``.

    The result is a new tensor, unless ``into_first=True``: then the sum accumulates into the
    first flag when it already lives on ``device`` (torch's ``update()`` sums into it; it saves
    a copy). No flags (an optimizer without grads this iteration) give a cleared flag."""
    moved = [move(f, device) for f in found_infs]
    if not moved:
        return new_found_inf(device)
    total = moved[0] if into_first else moved[0].clone()
    for f in moved[1:]:
        total += f
    if len(moved) > 1 and not into_first:
        # A flag, not a count: fused optimizers skip only on found_inf == 1.0 (torch's own
        # sum here could reach 2.0 with grads on two devices, and the step would apply).
        # (update()'s in-place sum stays torch's: the scale rule only asks "nonzero?")
        total.clamp_max_(1.0)
    return total


def flatten(
    tensors: Sequence[torch.Tensor],
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    pin_memory: bool = False,
) -> torch.Tensor:
    """Return a new 1-D tensor holding the values of ``tensors`` one after another.

    The values are converted to ``dtype``/``device``; by default those of the first tensor."""
    if not tensors:
        raise ValueError("flatten needs at least one tensor.")
    dtype = tensors[0].dtype if dtype is None else dtype
    device = tensors[0].device if device is None else device
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device=device, pin_memory=pin_memory)
    copy_to_([t.detach() for t in tensors], flat_views(flat, tensors))
    return flat


def flat_views(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of consecutive slices of the 1-D tensor ``flat``, shaped like each of ``like``."""
    views, offset = [], 0
    for t in like:
        n = t.numel()
        views.append(flat[offset : offset + n].view(t.shape))
        offset += n
    if offset > flat.numel():
        raise ValueError(f"flat_views: the shapes need {offset} elements, the flat tensor has {flat.numel()}.")
    return views


def clear_grads_(params: Iterable[torch.Tensor], *, set_to_none: bool) -> None:
    """Clear the params' grads as ``torch.optim.Optimizer.zero_grad`` does.

    Set them to None, or detach and zero them (one multi-tensor zero per (device, dtype) group)."""
    dense: list[torch.Tensor] = []
    with torch.no_grad():
        for p in params:
            g = p.grad
            if g is None:
                continue
            if set_to_none:
                p.grad = None
                continue
            if g.grad_fn is not None:
                g.detach_()
            else:
                g.requires_grad_(False)
            if g.is_sparse:
                g.zero_()
            else:
                dense.append(g)
        for per_dtype in group_by_device_and_dtype(dense).values():
            for grads in per_dtype.values():
                torch._foreach_zero_(grads)


def merge_found_inf(
    *per_device: dict[torch.device, torch.Tensor],
) -> dict[torch.device, torch.Tensor]:
    """Merge ``{device: found_inf}`` dicts from several unscale calls.

    Flags of the same device are combined (their maximum, a new tensor: still 0.0 or 1.0), others kept."""
    out: dict[torch.device, torch.Tensor] = {}
    for flags in per_device:
        for device, f in flags.items():
            out[device] = f if device not in out else torch.maximum(out[device], f)
    return out


def clip_grad_norm_(
    params: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Clip the grads of ``params`` by their total norm; return the norm (a device tensor).

    torch's own multi-tensor implementation, kept here so every face clips the same way."""
    return torch.nn.utils.clip_grad_norm_(
        list(params), max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite
    )


def all_reduce_found_inf(
    found_inf_per_device: dict[torch.device, torch.Tensor], device: torch.device, group: Any
) -> dict[torch.device, torch.Tensor]:
    """Combine the flags onto ``device`` and max-reduce them over the ranks of ``group``.

    Uses ``torch.distributed``; asynchronous on the device with NCCL. Returns ``{device: flag}``."""
    combined = combine_found_inf(found_inf_per_device.values(), device)
    torch.distributed.all_reduce(combined, op=torch.distributed.ReduceOp.MAX, group=group)
    return {combined.device: combined}


#: ``get_scale(device)`` of :func:`scale_outputs`: the scale as a 0-dim tensor or a Python number
ScaleFn = Callable[[torch.device], Union[torch.Tensor, float]]


@overload
def scale_outputs(outputs: torch.Tensor, get_scale: ScaleFn) -> torch.Tensor: ...
@overload
def scale_outputs(outputs: TensorOrIterable, get_scale: ScaleFn) -> TensorOrIterable: ...
def scale_outputs(outputs: TensorOrIterable, get_scale: ScaleFn) -> TensorOrIterable:
    """Multiply a tensor, or a (nested) list/tuple/iterable of tensors, by the loss scale.

    ``get_scale(device)`` is called once, with the device of the first tensor met (the place
    where a lazily created scale is materialized), and returns the scale: a 0-dim tensor
    (float32 multiplies as it is, with torch's type promotion; float64 -- a legacy scale kept
    in double -- multiplies as its float32 value, as a Python float did in apex) or a Python
    number (multiplied as a scalar). Lists and tuples keep their type; other iterables come
    back as a lazy ``map`` (torch's behaviour). Anything else raises ``ValueError("outputs
    must be a Tensor or an iterable of Tensors")``. Scale copies are made once per device.
    """
    if isinstance(outputs, torch.Tensor):
        scale = _as_multiplier(get_scale(outputs.device))
        if not isinstance(scale, torch.Tensor):
            return outputs * scale
        return outputs * move(scale, outputs.device)

    stash: list[Any] = []

    def apply(val: Any) -> Any:
        if isinstance(val, torch.Tensor):
            if not stash:
                scale = _as_multiplier(get_scale(val.device))
                stash.append(PerDevice(scale) if isinstance(scale, torch.Tensor) else scale)
            if isinstance(stash[0], PerDevice):
                return val * stash[0].get(val.device)
            return val * stash[0]
        if isinstance(val, abc.Iterable):
            iterable = map(apply, val)
            if isinstance(val, (list, tuple)):
                return type(val)(iterable)
            return iterable
        raise ValueError("outputs must be a Tensor or an iterable of Tensors")

    return apply(outputs)


def _as_multiplier(scale: Any) -> Any:
    if isinstance(scale, torch.Tensor) and scale.dtype == torch.float64:
        return scale.float()
    return scale


def norms(tensors: Sequence[torch.Tensor], ord: float = 2.0, *, fp32_accumulate: bool = False) -> list[torch.Tensor]:
    """Return the ``ord``-norm of each tensor (``inf``: the max-abs norm), as 0-dim tensors.

    The norms are on the tensors' devices, in order: one multi-tensor norm per (device, dtype) group. By
    default each norm has its tensor's dtype and equals ``torch.linalg.vector_norm(t, ord)`` bit for bit;
    ``fp32_accumulate=True`` accumulates and returns float32 (float64 for float64 tensors). Non-finite values
    give a non-finite norm."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    index: dict[tuple[Any, ...], list[int]] = {}
    for i, t in enumerate(tensors):
        index.setdefault((t.device, t.dtype), []).append(i)
    with torch.no_grad():
        for (_, dtype), idx in index.items():
            group = [tensors[i].detach() for i in idx]
            if fp32_accumulate:
                acc = torch.float64 if dtype == torch.float64 else torch.float32
                found = torch._foreach_norm(group, ord, dtype=acc)
            else:
                found = torch._foreach_norm(group, ord)
            for i, n in zip(idx, found):
                out[i] = n
    return [n for n in out if n is not None]


def l2_norms(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Return the L2 norm of each tensor, accumulated in float32 (float64 for float64 tensors).

    They are 0-dim tensors on the tensors' devices, in order (:func:`norms`)."""
    return norms(tensors, 2.0, fp32_accumulate=True)


def l2_norm(tensors: Sequence[torch.Tensor], device: torch.device | str | None = None) -> torch.Tensor:
    """Return ``sqrt(sum over tensors of ||t||^2)`` as one float32 0-dim tensor on ``device``.

    ``device`` defaults to the first tensor's (CPU when there are none); 0.0 for no tensors. Non-finite values
    give a non-finite result (the overflow test of apex's fused-era FP16_Optimizer)."""
    if device is None:
        device = tensors[0].device if tensors else torch.device("cpu")
    found = l2_norms(tensors)
    if not found:
        return torch.zeros((), dtype=torch.float32, device=device)
    with torch.no_grad():
        stacked = torch.stack([move(n, device, torch.float32) for n in found])
        return stacked.square().sum().sqrt()


def scale_to_(
    srcs: Sequence[torch.Tensor],
    dsts: Sequence[torch.Tensor],
    scale: float | torch.Tensor,
    flag: torch.Tensor,
) -> None:
    """Compute ``dst = src * scale`` for each pair, setting ``flag`` where a source holds inf or NaN.

    ``dst`` may be ``src``: in place. ``flag`` may have any dtype and shape (e.g. apex's int32
    ``overflow_buf``); it is set to 1, never cleared. The arithmetic of apex's ``amp_C.multi_tensor_scale``:
    the product in float32 (float64 for float64 data), rounded once into ``dst``."""
    if len(srcs) != len(dsts):
        raise ValueError(
            f"scale_to_ needs one destination per source; got {len(srcs)} sources and {len(dsts)} destinations."
        )
    if not srcs:
        return
    with torch.no_grad():
        temps: list[torch.Tensor] = []
        for src in srcs:
            acc = torch.float64 if src.dtype == torch.float64 else torch.float32
            temps.append(torch.empty_like(src, dtype=acc))
        found = new_found_inf(flag.device)
        per_device = check_finite_([t.detach() for t in srcs], found)
        copy_to_([t.detach() for t in srcs], temps)
        groups: dict[tuple[Any, ...], list[torch.Tensor]] = {}
        for t in temps:
            groups.setdefault((t.device, t.dtype), []).append(t)
        for (device, dtype), ts in groups.items():
            if isinstance(scale, torch.Tensor):
                s = scale.detach().to(device=device, dtype=dtype)
            else:  # filled in on the device (no host-to-device copy): float64 -> dtype, as .to()
                s = torch.full((), scale, dtype=torch.float64, device=device).to(dtype)
            torch._foreach_mul_(ts, s)
        copy_to_(temps, [d.detach() for d in dsts])
        raise_flag_(flag, per_device)


def raise_flag_(flag: torch.Tensor, found_inf_per_device: dict[torch.device, torch.Tensor]) -> None:
    """Set ``flag`` to 1 where any of the found-inf flags is set; never clear it.

    ``flag`` may have any dtype and shape (e.g. apex's int32 ``overflow_buf``). A device op, no host read."""
    if not found_inf_per_device:
        return
    with torch.no_grad():
        hit = combine_found_inf(found_inf_per_device.values(), flag.device)
        flag.copy_(torch.maximum(flag, hit.to(flag.dtype)))


def l2_norm_and_flag_(
    tensors: Sequence[torch.Tensor], flag: torch.Tensor, *, per_tensor: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Do apex's ``amp_C.multi_tensor_l2norm``: return ``(total, per_tensor_norms)``, flagging a non-finite total.

    ``total`` is the total L2 norm as a 1-element float32 tensor on ``flag``'s device, ``per_tensor_norms``
    the norm of each tensor as a 1-D float32 tensor (empty unless ``per_tensor``); ``flag`` is set when the
    total is not finite. Accumulation in float32 (apex: per chunk; the last bits may differ)."""
    device = flag.device
    found = [move(n, device, torch.float32) for n in l2_norms(tensors)]
    with torch.no_grad():
        per = torch.stack(found) if found else torch.zeros(0, dtype=torch.float32, device=device)
        total = per.square().sum().sqrt().reshape(1)
        raise_flag_(flag, check_finite_([total.clone()], new_found_inf(device)))
    return total, (per if per_tensor else torch.zeros(0, dtype=torch.float32, device=device))
