"""The loops rows 1 and 2 time: the anchors a user writes with torch alone, and fp16kit's variants.

Every loop works on a param list of :mod:`fp16kit.bench.shapes` and repeats one iteration::

    zero_grad (set_to_none=True)        timed     (each variant's own; apex's default zeroes
                                                   instead: set_to_none is what torch loops do)
    the "backward": attach the grads    NOT timed (the same 16-bit tensors every iteration)
    the path / the step                 timed

The master-grad path (row 1): 16-bit grads -> unscaled fp32 master grads + a found_inf flag::

    hand loop (torch only)     torch._foreach_copy_(master_grads, grads)        # allocated once
                               torch._amp_foreach_non_finite_check_and_unscale_(master_grads, found_inf, inv_scale)
    MixedPrecisionOptimizer    opt.unscale_grads_(inv_scale, found_inf)   (what scaler.unscale_(opt) calls;
                               flat=False and flat=True)
    FP16_Optimizer             opt.update_master_grads()                  (dynamic loss scale)

The whole master-weight step (row 2), AdamW(fused=True) inside every one::

    hand loop (torch only)     loss * scale; _foreach_copy_ grads into the master grads;
                               _amp_foreach_non_finite_check_and_unscale_ at 1.0 (the check only:
                               torch's GradScaler does so for a fused optimizer); opt.grad_scale,
                               opt.found_inf = scale, found_inf; opt.step(); _foreach_copy_ back
                               to the 16-bit params; torch._amp_update_scale_
    MixedPrecisionOptimizer    scaler.scale(loss); scaler.step(opt); scaler.update()  (fp16kit.GradScaler;
                               flat=False and flat=True)
    FP16_Optimizer             opt.update_master_grads(); opt.step()
    amp O2                     with amp.scale_loss(loss, opt): <attach>;  opt.step()
    torch AdamW(fused), fp32   the step an fp32 model takes (fp32 grads, no masters, no scaler)

All start from the same initial values and see the same grads, so after a few iterations the
masters agree -- bit for bit where the arithmetic is the same (tests/bench/test_loops.py says
which). ``loss`` is a 0-dim fp32 tensor without a graph: only the scaling is exercised.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch

import fp16kit
from fp16kit.core import fused
from fp16kit.legacy import FP16_Optimizer, amp

from .shapes import Shape, fake_grads, initial_values
from .timing import Clock

__all__ = [
    "HAND",
    "INIT_SCALE",
    "Loop",
    "master_grad_loops",
    "step_loops",
]

INIT_SCALE = 2.0**16
HAND = "hand loop (torch only)"
LR = 1e-3


class Loop:
    """One variant: ``iteration(clock)`` times its own work; ``run(n)`` is what the interleaved runner calls."""

    name = ""
    device = torch.device("cpu")
    params: list[torch.Tensor]
    grads: list[torch.Tensor]

    def iteration(self, clock: Any) -> None:
        raise NotImplementedError

    def run(self, n: int) -> float:
        clock = Clock(self.device)
        for _ in range(n):
            self.iteration(clock)
        return clock.seconds()

    def attach(self) -> None:
        """The fake backward: the same grads into the model params."""
        for p, g in zip(self.params, self.grads):
            p.grad = g

    def scaled_backward(self, clock: Any, loss: torch.Tensor, scale: torch.Tensor) -> None:
        """What a hand-written loop does up to its step: clear the grads (set_to_none), scale the loss, and the
        fake backward (not timed)."""
        for p in self.params:
            p.grad = None
        loss * scale  # noqa: B018  (the scaled loss a backward would start from)
        with clock.paused():
            self.attach()

    def masters(self) -> list[torch.Tensor]:
        """The fp32 tensors this variant steps (for the equality tests)."""
        raise NotImplementedError

    def finish(self) -> None:
        """Wait for work in flight (asynchronous steps)."""


def _params(values: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.nn.Parameter(v.clone()) for v in values]


def _groups_params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


def _grads_of(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``[t.grad for t in tensors]`` (every one has a grad here)."""
    return cast(list[torch.Tensor], [t.grad for t in tensors])


def _flag(device: torch.device) -> torch.Tensor:
    return torch.zeros((), dtype=torch.float32, device=device)


# ---------------------------------------------------------------------------- row 1: the master-grad path


class HandGrads(Loop):
    name = HAND

    def __init__(self, values: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        self.device = values[0].device
        self.params, self.grads = _params(values), grads
        self.master_grads = [torch.empty(v.shape, dtype=torch.float32, device=self.device) for v in values]
        self.found_inf = _flag(self.device)
        self.inv_scale = torch.full((), 1.0 / INIT_SCALE, dtype=torch.float32, device=self.device)

    def iteration(self, clock: Any) -> None:
        with clock:
            for p in self.params:
                p.grad = None
            with clock.paused():
                self.attach()
            self.found_inf.zero_()
            torch._foreach_copy_(self.master_grads, _grads_of(self.params))
            torch._amp_foreach_non_finite_check_and_unscale_(self.master_grads, self.found_inf, self.inv_scale)

    def masters(self) -> list[torch.Tensor]:
        return self.master_grads


class MPOGrads(Loop):
    def __init__(self, values: list[torch.Tensor], grads: list[torch.Tensor], *, flat: bool) -> None:
        self.name = f"MixedPrecisionOptimizer{' (flat)' if flat else ''}"
        self.device = values[0].device
        self.params, self.grads = _params(values), grads
        self.opt = fp16kit.MixedPrecisionOptimizer(torch.optim.SGD(self.params, lr=0.0), flat=flat)
        self.found_inf = _flag(self.device)
        self.inv_scale = torch.full((), 1.0 / INIT_SCALE, dtype=torch.float32, device=self.device)

    def iteration(self, clock: Any) -> None:
        with clock:
            self.opt.zero_grad()
            with clock.paused():
                self.attach()
            self.found_inf.zero_()
            self.opt.unscale_grads_(self.inv_scale, self.found_inf)

    def masters(self) -> list[torch.Tensor]:
        return _grads_of(_groups_params(self.opt))


class FP16OptGrads(Loop):
    name = "FP16_Optimizer.update_master_grads"

    def __init__(self, values: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        self.device = values[0].device
        self.params, self.grads = _params(values), grads
        self.opt = FP16_Optimizer(
            torch.optim.SGD(self.params, lr=0.0),
            dynamic_loss_scale=True,
            dynamic_loss_args={"init_scale": INIT_SCALE},
            verbose=False,
        )

    def iteration(self, clock: Any) -> None:
        with clock:
            self.opt.zero_grad(set_grads_to_None=True)
            with clock.paused():
                self.attach()
            self.opt.update_master_grads()

    def masters(self) -> list[torch.Tensor]:
        return _grads_of([m for g in self.opt.fp32_from_fp16_groups for m in g])


def master_grad_loops(shape: Shape, device: torch.device | str, dtype: torch.dtype = torch.float16) -> list[Loop]:
    """Row 1's variants on ``shape``, the anchor first."""
    values, grads = initial_values(shape, dtype, device), fake_grads(shape, dtype, device)
    return [
        HandGrads(values, grads),
        MPOGrads(values, grads, flat=False),
        MPOGrads(values, grads, flat=True),
        FP16OptGrads(values, grads),
    ]


# ---------------------------------------------------------------------------- row 2: the whole step


def _adamw(params: list[torch.Tensor]) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.01, fused=True)


class HandStep(Loop):
    name = HAND

    def __init__(self, values: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        self.device = values[0].device
        self.params, self.grads = _params(values), grads
        self.master = [p.detach().float() for p in self.params]
        for m in self.master:
            m.grad = torch.empty_like(m)  # allocated once, reused
        self.master_grads = _grads_of(self.master)
        self.opt = _adamw(self.master)
        dev = self.device
        self.scale = torch.full((), INIT_SCALE, dtype=torch.float32, device=dev)
        self.growth_tracker = torch.zeros((), dtype=torch.int32, device=dev)
        self.one = torch.ones((), dtype=torch.float32, device=dev)
        self.found_inf = _flag(dev)
        self.loss = torch.ones((), dtype=torch.float32, device=dev)

    def iteration(self, clock: Any) -> None:
        with clock:
            self.scaled_backward(clock, self.loss, self.scale)
            self.found_inf.zero_()
            torch._foreach_copy_(self.master_grads, _grads_of(self.params))
            torch._amp_foreach_non_finite_check_and_unscale_(self.master_grads, self.found_inf, self.one)
            self.opt.grad_scale = self.scale  # type: ignore[attr-defined]
            self.opt.found_inf = self.found_inf  # type: ignore[attr-defined]
            self.opt.step()
            with torch.no_grad():
                torch._foreach_copy_(self.params, self.master)
            torch._amp_update_scale_(self.scale, self.growth_tracker, self.found_inf, 2.0, 0.5, 2000)

    def masters(self) -> list[torch.Tensor]:
        return self.master


class MPOStep(Loop):
    def __init__(self, values: list[torch.Tensor], grads: list[torch.Tensor], *, flat: bool) -> None:
        self.name = f"MixedPrecisionOptimizer{' (flat)' if flat else ''} + GradScaler"
        self.device = values[0].device
        self.params, self.grads = _params(values), grads
        self.opt = fp16kit.MixedPrecisionOptimizer(_adamw(self.params), flat=flat)
        self.scaler = fp16kit.GradScaler(self.device.type, init_scale=INIT_SCALE)
        self.loss = torch.ones((), dtype=torch.float32, device=self.device)

    def iteration(self, clock: Any) -> None:
        with clock:
            self.opt.zero_grad()
            self.scaler.scale(self.loss)
            with clock.paused():
                self.attach()
            self.scaler.step(self.opt)
            self.scaler.update()

    def masters(self) -> list[torch.Tensor]:
        return _groups_params(self.opt)


class FP16OptStep(Loop):
    name = "FP16_Optimizer"

    def __init__(self, values: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        self.device = values[0].device
        self.params, self.grads = _params(values), grads
        self.opt = FP16_Optimizer(
            _adamw(self.params), dynamic_loss_scale=True, dynamic_loss_args={"init_scale": INIT_SCALE}, verbose=False
        )

    def iteration(self, clock: Any) -> None:
        with clock:
            self.opt.zero_grad(set_grads_to_None=True)
            with clock.paused():
                self.attach()
            self.opt.update_master_grads()
            self.opt.step()

    def masters(self) -> list[torch.Tensor]:
        return [m for g in self.opt.fp32_from_fp16_groups for m in g]


class AmpStep(Loop):
    """amp O2 (fp16kit.legacy.amp). amp's state is process-wide, as apex's: one at a time."""

    name = "amp O2"

    def __init__(self, values: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        self.device = values[0].device
        model = torch.nn.Module()
        model.params = torch.nn.ParameterList([torch.nn.Parameter(v.float()) for v in values])
        opt = _adamw(list(model.parameters()))
        self.model, self.opt = amp.initialize(model, opt, opt_level="O2", loss_scale="dynamic", verbosity=0)
        self.params, self.grads = list(self.model.parameters()), grads
        self.loss = torch.ones((), dtype=torch.float32, device=self.device)

    def iteration(self, clock: Any) -> None:
        with clock:
            self.opt.zero_grad(set_to_none=True)
            with amp.scale_loss(self.loss, self.opt):
                with clock.paused():
                    self.attach()
            self.opt.step()

    def masters(self) -> list[torch.Tensor]:
        return list(amp.master_params(self.opt))


class Fp32Step(Loop):
    name = "torch AdamW(fused), fp32 params"

    def __init__(self, values: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        self.device = values[0].device
        self.params = [torch.nn.Parameter(v.float()) for v in values]
        # the unscaled grads (exact: the scale is a power of two)
        self.grads = [g.float() / INIT_SCALE for g in grads]
        self.opt = _adamw(self.params)

    def iteration(self, clock: Any) -> None:
        with clock:
            self.opt.zero_grad(set_to_none=True)
            with clock.paused():
                self.attach()
            self.opt.step()

    def masters(self) -> list[torch.Tensor]:
        return self.params


class FusedKernelStep(Loop):
    """fp16kit's fused master-AdamW kernel (:mod:`fp16kit.core.fused.adam`) driven by hand: the one-pass step.

    The hand loop's arithmetic (its masters match it bit for bit) in two passes over the 16-bit grads -- the check,
    then the step -- where the hand loop makes four plus a copy back (its bytes: the kernel's own count, 30 per
    param; :func:`fp16kit.bench.trace.op_tally`). CPU only."""

    name = "fused kernel (fp16kit.core.fused), by hand"

    @staticmethod
    def unavailable(device: torch.device) -> str | None:
        if device.type != "cpu":
            return "the fused kernel is CPU-only"
        return None if fused.forms() is not None else "the fused kernel is off on this machine (logged)"

    def __init__(self, values: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        self.device = values[0].device
        self.params, self.grads = _params(values), grads
        self.master = [p.detach().float() for p in self.params]
        self.opt = _adamw(self.master)
        for m in self.master:  # the state torch's first fused step creates
            self.opt.state[m] = {
                "step": torch.zeros(()),
                "exp_avg": torch.zeros_like(m),
                "exp_avg_sq": torch.zeros_like(m),
            }
        self.plan = fused.AdamPlan(self.params, self.master, self.opt)
        self.scale = torch.full((), INIT_SCALE, dtype=torch.float32)
        self.growth_tracker = torch.zeros((), dtype=torch.int32)
        self.found_inf = _flag(self.device)
        self.loss = torch.ones((), dtype=torch.float32)

    def iteration(self, clock: Any) -> None:
        with clock:
            self.scaled_backward(clock, self.loss, self.scale)
            grads = self.plan.grads(_grads_of(self.params))
            assert grads is not None
            self.found_inf.zero_()
            fused.check_finite_(self.plan, grads, self.found_inf)
            with torch.no_grad():
                self.plan.step(grads, self.opt.param_groups[0], grad_scale=self.scale, found_inf=self.found_inf)
            torch._amp_update_scale_(self.scale, self.growth_tracker, self.found_inf, 2.0, 0.5, 2000)

    def masters(self) -> list[torch.Tensor]:
        return self.master


STEP_VARIANTS: dict[str, Callable[[list[torch.Tensor], list[torch.Tensor]], Loop]] = {
    "hand": HandStep,
    "mpo": lambda v, g: MPOStep(v, g, flat=False),
    "mpo-flat": lambda v, g: MPOStep(v, g, flat=True),
    "fp16-optimizer": FP16OptStep,
    "amp-o2": AmpStep,
    "fp32": Fp32Step,
    "fused-kernel": FusedKernelStep,
}
"""Row 2's variants, the anchors first (the hand loop; torch's fused AdamW on fp32 params)."""


def step_loops(
    shape: Shape, device: torch.device | str, dtype: torch.dtype = torch.float16, names: list[str] | None = None
) -> list[Loop]:
    """Row 2's variants on ``shape`` (``names``: some of :data:`STEP_VARIANTS`)."""
    values, grads = initial_values(shape, dtype, device), fake_grads(shape, dtype, device)
    dev = torch.device(device)
    return [
        STEP_VARIANTS[n](values, grads)
        for n in (names or list(STEP_VARIANTS))
        if getattr(STEP_VARIANTS[n], "unavailable", lambda d: None)(dev) is None
    ]
