"""The fused master Adam/AdamW step on the CPU: one pass per tensor, from the 16-bit grad to the 16-bit param.

Per tensor -- torch's fused CPU Adam kernel (``torch._fused_adam_`` / ``_fused_adamw_``) on the fp32 master,
the same operations in the same order, then the copy into the model's 16-bit param::

    if found_inf == 1: nothing changes (the steps neither)
    step += 1;  bc1 = 1 - beta1 ** step;  bc2 = 1 - beta2 ** step            (double)
    g = float(grad16) / grad_scale                                          (float from here on)
    AdamW: master *= 1 - lr * wd        Adam: g += master * wd
    exp_avg = lerp(exp_avg, g, 1 - beta1)
    exp_avg_sq = exp_avg_sq * beta2 + (1 - beta2) * g * g
    master += -(lr / bc1) * exp_avg / (sqrt(exp_avg_sq) / sqrt(bc2) + eps)
    param16 = master rounded to nearest even

It reads 2 + 4 * 3 bytes and writes 4 * 3 + 2 per element: the 28 B/param of one pass, where torch's ops take a
copy of the grads into fp32 master grads, a check, the fused step and a copy back (52 B/param and four passes).

**Bit for bit** the masters, ``exp_avg``, ``exp_avg_sq``, ``step`` and the 16-bit params equal what
``torch.optim.Adam/AdamW(fused=True)`` stepping the masters (grads ``float(grad16)``, torch's ``grad_scale`` /
``found_inf`` attributes) followed by ``param16.copy_(master)`` leaves. One difference: the masters get no ``.grad``
(torch's fused step writes the unscaled grad back there). torch's kernel rounds its vector body and its scalar tail
(the last ``numel % width`` elements) differently, and how depends on its CPU build: the vector width of the CPU
capability, and which ``a * b + c`` its compiler contracted into one rounding. :func:`~fp16kit.core.fused.calibrate.forms` finds them at first
use by running torch's fused Adam and AdamW and this kernel on a probe of every tail length, fp16 and bf16; when
no form reproduces torch bit for bit the kernel stays off (one log line) and callers use torch's ops.

Use::

    if kernel_refusal(optimizer, group) is None:
        plan = AdamPlan(params16, masters, optimizer)   # addresses taken once, checked at every step
        grads = plan.grads(grads16)                     # None: a grad the kernel cannot read (use torch's ops)
        check_finite_(plan, grads, found_inf)           # reads 2 B/param; only ever sets the flag
        plan.step(grads, group, grad_scale=scale, found_inf=found_inf)
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from . import calibrate
from .abi import CHUNK, CPU, F32_GRADS, KIND, Traffic, hyper_of, library, p64, pf

__all__ = [
    "AdamPlan",
    "PlanMismatch",
    "check_finite_",
    "kernel_refusal",
    "unscaled_grads",
]

logger = logging.getLogger("fp16kit")

STEP_BYTES = 28
"""Bytes a step reads and writes per element: 2 + 4 * 3 read, 4 * 3 + 2 written."""
CHECK_BYTES = 2
"""Bytes the non-finite check reads per element."""


class GradAddresses:
    """The 16-bit grads a step reads (:meth:`AdamPlan.grads`): the tensors, kept alive, and their addresses."""

    __slots__ = ("kind", "ptrs", "tensors")

    def __init__(self, tensors: list[torch.Tensor], ptrs: torch.Tensor, kind: int) -> None:
        self.tensors = tensors
        self.ptrs = ptrs
        self.kind = kind  # the kernel's grad kind: a 16-bit one, or float32


_GET_A, _GET_V, _GET_S = (operator.itemgetter(k) for k in ("exp_avg", "exp_avg_sq", "step"))


class PlanMismatch(RuntimeError):
    """The tensors handed to :meth:`AdamPlan.step` are not the ones the plan was built on (build a new plan)."""


def kernel_refusal(optimizer: torch.optim.Optimizer, group: Mapping[str, Any]) -> str | None:
    """Why the kernel cannot step ``group`` of ``optimizer`` exactly as the optimizer would, or None when it can.

    It can for ``torch.optim.Adam`` / ``AdamW`` themselves (not subclasses: they may change the step) built with
    ``fused=True`` -- the numbers it reproduces -- and no ``amsgrad``, ``maximize``, ``capturable``,
    ``differentiable`` or tensor hyperparameters."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return f"{type(optimizer).__name__} is not torch.optim.Adam or AdamW"
    if not group.get("fused"):
        return "the optimizer was not built with fused=True (the kernel reproduces torch's fused step)"
    for flag in ("amsgrad", "maximize", "capturable", "differentiable"):
        if group.get(flag):
            return f"{flag}=True"
    values = [group["lr"], *group["betas"], group["eps"], group["weight_decay"]]
    if any([isinstance(v, torch.Tensor) for v in values]):  # (asked at every step: no generator)
        return "a hyperparameter is a tensor"
    if calibrate.forms() is None:
        return "the kernel is off (see the log)"
    return None


class AdamPlan:
    """The fused step's view of a list of tensors: per tensor the 16-bit param, its master and its Adam state.

    Built once (when the optimizer's state exists: after its first step). :meth:`current` -- which :meth:`step`
    asks unless told it was just asked -- checks that the state still holds the same tensors
    (``load_state_dict`` replaces them) and that every tensor still has the storage address the plan took: a
    param's ``.data`` is swapped by ``model.float(); model.half()``, ``share_memory()``, ``p.data = ...``. The
    plan keeps the storages it addresses alive, so no other tensor can be given one of those addresses while it
    lives, and an address that is unchanged is the same memory of the same size. A plan that is not current
    raises :class:`PlanMismatch` (build a new one). Refuses (ValueError) tensors the kernel cannot address: not
    on the CPU, not contiguous, masters or state not float32, params not float16/bfloat16 of one dtype.

    ``params16[i]`` None: ``masters[i]`` is an fp32 param the optimizer steps as it is (apex's fp32_from_fp32; it
    has no 16-bit copy to write). Such a plan steps only from fp32 grads (``grads(..., fp32=True)``)."""

    def __init__(
        self,
        params16: Sequence[torch.Tensor | None],
        masters: Sequence[torch.Tensor],
        optimizer: torch.optim.Optimizer,
    ) -> None:
        if len(params16) != len(masters) or not masters:
            raise ValueError("AdamPlan needs one 16-bit param (or None) per master, and at least one.")
        dtypes = {p.dtype for p in params16 if p is not None}
        if len(dtypes) > 1 or not dtypes <= KIND.keys():
            raise ValueError(f"AdamPlan steps float16 or bfloat16 params of one dtype, got {sorted(map(str, dtypes))}.")
        dtype = dtypes.pop() if dtypes else torch.float32  # (float32: fp32 params stepped in place only)
        self.optimizer = optimizer
        states: list[dict[str, Any]] = [optimizer.state.get(m) or {} for m in masters]
        if any("exp_avg" not in s for s in states):
            raise ValueError("AdamPlan needs the optimizer's state of every master (after its first step).")
        self.kind = KIND.get(dtype, 0)  # (no 16-bit param: no store, any kind)
        self.dtype = dtype
        self.direct = dtype is torch.float32 or None in params16  # steps from fp32 grads only
        self.params16 = list(params16)
        self.masters = list(masters)
        self.states = states
        self._state_map, self._state_values = optimizer.state, list(optimizer.state.values())
        self.exp_avgs = [s["exp_avg"] for s in states]
        self.exp_avg_sqs = [s["exp_avg_sq"] for s in states]
        self.steps = [s["step"] for s in states]
        for p, m, a, v, st in zip(self.params16, self.masters, self.exp_avgs, self.exp_avg_sqs, self.steps):
            if p is not None:
                _check(p, dtype, m.numel(), "param")
            for t, what in ((m, "master"), (a, "exp_avg"), (v, "exp_avg_sq")):
                _check(t, torch.float32, m.numel(), what)
            if st.dtype != torch.float32 or st.device.type != "cpu" or st.dim() != 0:
                raise ValueError(f"AdamPlan needs float32 0-dim CPU steps, got {st.dtype} {tuple(st.shape)}.")
        numels = [m.numel() for m in self.masters]
        self._numels = numels
        self.n = len(numels)
        self.total = sum(numels)
        self._total16 = sum(k for p, k in zip(self.params16, numels) if p is not None)  # (elements written in 16 bits)
        self.numel = torch.tensor(numels, dtype=torch.int64)
        starts = [0, *itertools.accumulate(-(-k // CHUNK) for k in numels)]
        self.chunk_start = torch.tensor(starts, dtype=torch.int64)
        written = [p for p in self.params16 if p is not None]
        self._addressed = [*written, *self.masters, *self.exp_avgs, *self.exp_avg_sqs, *self.steps]
        self._storages = [t.untyped_storage() for t in self._addressed]  # (kept alive: see the class docstring)
        self._addresses = self._now()
        self.ptrs = torch.zeros(self.n, 6, dtype=torch.int64)
        rest = torch.tensor(self._addresses[len(written) :], dtype=torch.int64).reshape(4, self.n).t()
        self.ptrs[:, 2:] = rest
        self.ptrs[:, 1] = torch.tensor([0 if p is None else p.data_ptr() for p in self.params16], dtype=torch.int64)
        self._ptr_args = (p64(self.ptrs), p64(self.numel), p64(self.chunk_start))
        self._masters_only = self.ptrs.clone()  # the same with no 16-bit params to write (write_params=False)
        self._masters_only[:, 1] = 0

    def current(self) -> bool:
        """Does the optimizer's state still hold the tensors this plan addresses?

        Identity comparisons only: the state mapping's values as they were (no tensor hashing), then each state's
        tensors; a changed mapping (``load_state_dict`` replaces it; a first step adds to it) is looked up again."""
        if self._now() != self._addresses:
            return False
        get_a, get_v, get_s = _GET_A, _GET_V, _GET_S
        state = self.optimizer.state
        try:
            values = self._state_values
            if (
                state is not self._state_map
                or len(state) != len(values)
                or not all(map(operator.is_, state.values(), values))
            ):
                states: list[Any] = list(map(state.get, self.masters))
                if not all(map(operator.is_, states, self.states)):
                    return False
                self._state_map, self._state_values = state, list(state.values())
            return (
                all(map(operator.is_, map(get_a, self.states), self.exp_avgs))
                and all(map(operator.is_, map(get_v, self.states), self.exp_avg_sqs))
                and all(map(operator.is_, map(get_s, self.states), self.steps))
            )
        except (KeyError, TypeError):
            return False

    def _now(self) -> list[int]:
        return [t.data_ptr() for t in self._addressed]

    def grads(self, grads16: Sequence[torch.Tensor | None], *, fp32: bool = False) -> GradAddresses | None:
        """The grads for :meth:`step` and :func:`check_finite_`, or None: then use torch's ops.

        ``fp32``: float32 grads (the masters' own, unscaled: apex's faces), for :meth:`step` only. None when a grad is
        missing, not contiguous, or not the expected dtype, size and device (``g.data = ...`` gets past the grad
        setter's checks), and for 16-bit grads when the plan steps fp32 params in place."""
        if len(grads16) != self.n:
            raise PlanMismatch(f"{len(grads16)} grads for a plan of {self.n} tensors.")
        if self.direct and not fp32:
            return None
        dtype, cpu = (torch.float32 if fp32 else self.dtype), CPU
        try:
            ptrs = [
                g.data_ptr()  # type: ignore[union-attr]
                for g, k in zip(grads16, self._numels)
                if g.dtype is dtype and g.numel() == k and g.is_contiguous() and g.device == cpu  # type: ignore[union-attr]
            ]
        except AttributeError:  # a None grad
            return None
        if len(ptrs) != self.n:
            return None
        kind = F32_GRADS if fp32 else self.kind
        return GradAddresses(list(grads16), torch.tensor(ptrs, dtype=torch.int64), kind)  # type: ignore[arg-type]

    def step(
        self,
        grads: GradAddresses,
        group: Mapping[str, Any],
        *,
        grad_scale: torch.Tensor | None,
        found_inf: torch.Tensor | None,
        verify: bool = True,
        write_params: bool = True,
        land: bool = False,
    ) -> bool:
        """Step every tensor of the plan with the 16-bit grads ``grads`` (:meth:`grads`); False: skipped (found_inf).

        ``group``: the param group's hyperparameters; ``grad_scale``: the loss scale the grads carry (a float32 CPU
        tensor, or None: unscaled); ``found_inf``: a float32 CPU flag (1: skip the whole step), or None.
        ``verify=False``: the caller checked :meth:`current` since the state last could change.
        ``write_params=False``: the masters and the state only (an asynchronous step: the 16-bit params are copied
        from the masters later; 2 B per element less). ``land``: the 16-bit params get the masters as they were
        *before* this step -- skipped or not -- in the same pass (an inline asynchronous job landing the step
        before it: the copy of the masters into the model, ``param16.copy_(master)``, bit for bit)."""
        lib = library()
        found = calibrate.forms()
        if lib is None or found is None:
            raise RuntimeError("internal: AdamPlan.step called with the kernel off (check kernel_refusal first)")
        if verify and not self.current():
            raise PlanMismatch("The optimizer's state holds other tensors than this plan's (load_state_dict?).")
        writes = write_params or land
        table = self.ptrs if writes else self._masters_only
        table[:, 0] = grads.ptrs
        hyper = hyper_of(group, found, decoupled=bool(group.get("decoupled_weight_decay")))
        stepped = lib.fp16kit_master_adam(
            self.n, p64(table), *self._ptr_args[1:], CHUNK, ctypes.byref(hyper), self.kind, grads.kind, int(land),
            pf(grad_scale), pf(found_inf), torch.get_num_threads(),
        )  # fmt: skip
        grad_bytes = 4 if grads.kind == F32_GRADS else 2
        if stepped:
            Traffic.bytes += (STEP_BYTES - 4 + grad_bytes) * self.total + (2 * self._total16 if writes else 0)
        elif land:  # (the landing alone: each master read, its 16-bit param written)
            Traffic.bytes += 6 * self._total16
        return bool(stepped)


def check_finite_(plan: AdamPlan, grads: GradAddresses, found_inf: torch.Tensor) -> None:
    """Set ``found_inf`` (a float32 CPU flag) to 1 when one of the 16-bit ``grads`` (:meth:`AdamPlan.grads`) holds inf/NaN.

    The flag is only ever set, as torch's ``_amp_foreach_non_finite_check_and_unscale_`` sets it."""
    if grads.kind == F32_GRADS:
        raise ValueError("check_finite_ reads 16-bit grads; these are float32 (AdamPlan.grads(..., fp32=True)).")
    lib = library()
    if lib is None:
        raise RuntimeError("internal: check_finite_ called with the kernel off")
    lib.fp16kit_check_finite(
        plan.n, p64(grads.ptrs), plan._ptr_args[1], plan._ptr_args[2], CHUNK, plan.kind, pf(found_inf),
        torch.get_num_threads(),
    )  # fmt: skip
    Traffic.bytes += CHECK_BYTES * plan.total


def unscaled_grads(grads16: Sequence[torch.Tensor], grad_scale: torch.Tensor | None) -> list[torch.Tensor]:
    """What torch's fused step leaves in the masters' ``.grad``: ``float(grad16) / grad_scale`` (None: no division).

    The kernel keeps no master grads; a caller that must show them (a second step with no new backward) makes
    them with this, bit for bit torch's (its kernel divides too, correctly rounded)."""
    out = [g.float() for g in grads16]
    if grad_scale is not None and out:
        torch._foreach_div_(out, grad_scale)
    return out


def _check(t: torch.Tensor, dtype: torch.dtype, numel: int, what: str) -> None:
    if t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous() or t.numel() != numel:
        raise ValueError(
            f"AdamPlan: a {what} is {t.dtype} on {t.device}{'' if t.is_contiguous() else ', not contiguous'} with "
            f"{t.numel()} elements; the kernel needs {dtype} on the CPU, contiguous, with {numel}."
        )
