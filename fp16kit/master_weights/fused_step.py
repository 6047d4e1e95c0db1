"""The one-pass step: a MixedPrecisionOptimizer's masters stepped by the fused kernel (:mod:`fp16kit.core.fused`).

``scaler.step(opt)`` on a MixedPrecisionOptimizer wrapping torch's ``Adam``/``AdamW(fused=True)`` follows torch's
fused protocol: the scaler checks the grads at scale 1 (``_check_inf_per_device``), then calls ``opt.step()`` with
``grad_scale``/``found_inf`` set (``opt.step()`` with no scaler, as bf16 models train, checks and steps alike). With the kernel the check reads the 16-bit model grads where they are (the step
state goes to CHECKED, nothing moved), and the step goes from them to the masters, the Adam state and the 16-bit
params in one pass -- where the torch-op path copies the grads into fp32 master grads, checks them, runs torch's
fused step and copies the masters back::

    check(found_inf)         every group takes the kernel (below)?  check the 16-bit grads -> flags
                             else None: the caller moves the grads into the masters as before
    step(grad_scale, found_inf)   the kernel, group by group (nothing changes when found_inf is set)
    settle(state)            before anything reads the master grads of a step the kernel took (a second
                             step(), scaler.step() or unscale_ with no new backward, a clip or inner_step()
                             after the step): they are made then -- float(model grad) / grad_scale, what
                             torch's fused step leaves there

The numbers are the torch-op path's bit for bit (masters, state, steps, 16-bit params; tested), except that the
masters hold no ``.grad`` after the step until :meth:`settle` makes it -- so code that reads ``master.grad`` itself,
or steps the wrapped optimizer directly after a kernel step, sees none (``FP16KIT_FUSED=0`` for such code).

The kernel takes a step when all hold:

* on the CPU (masters on their params' device), no step hooks on the wrapped optimizer;
* every param of every group has a master (no fp32 params stepped directly, none frozen since wrapping), one
  16-bit dtype per group, and a contiguous grad;
* the wrapped optimizer is torch's Adam/AdamW with ``fused=True`` (:func:`~fp16kit.core.fused.kernel_refusal`)
  and has its state (the first step is torch's: it creates it).

Otherwise the torch-op path runs, with the same numbers. ``FP16KIT_FUSED=0`` turns the kernel off.

An asynchronous step's job (``async_step=True`` with a GradScaler) takes the kernel too, by :meth:`FusedSteps.step_job`:
from the handed-off grads to the masters and the state, the 16-bit params left to the next landing (26 B/param, then
the landing's 6).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.optim import optimizer as torch_optimizer

from ..core import fused, kernels
from ..core.fused.abi import is_cpu_scalar
from ..core.protocol import Flags
from .groups import MasterGroups
from .step_state import Stage, StepState, TransferRecord

__all__ = ["FUSED", "FusedSteps"]

FUSED = "the fused kernel takes this step"
"""The ``prepared`` value of a CHECKED step state whose step the kernel takes."""


class FusedSteps:
    """A MixedPrecisionOptimizer's kernel steps: the plans per param group and the step the kernel took last."""

    def __init__(self, optimizer: torch.optim.Optimizer, groups: MasterGroups, *, async_step: bool) -> None:
        self.optimizer = optimizer
        self.groups = groups
        # (cheap to ask at every step; the full eligibility is _plan's)
        adam = type(optimizer) in (torch.optim.Adam, torch.optim.AdamW)
        self.candidate = adam and not async_step  # check() and step(): synchronous steps
        self.job_candidate = adam and async_step  # step_job(): an asynchronous step's job
        if adam and any(p.device.type == "cpu" for g in optimizer.param_groups for p in g["params"]):
            for group in optimizer.param_groups:  # build and calibrate the kernel now, not inside a step
                fused.kernel_refusal(optimizer, group)
        self._plans: dict[int, fused.AdamPlan] = {}
        # from_master_grads': per group the plan over its params, and the model params it was built with
        self._grad_plans: dict[int, tuple[fused.AdamPlan, list[torch.Tensor]]] = {}
        self._ready: list[tuple[fused.AdamPlan, fused.GradAddresses, dict[str, Any]]] = []
        self._ready_params: list[torch.Tensor] = []  # the model params of _ready's plans, in order
        self._taken: tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor | None, torch.Tensor | None] | None
        self._taken = None

    def check(self, state: StepState, found_inf: torch.Tensor | None = None) -> Flags | None:
        """Check the 16-bit model grads for inf/NaN into ``found_inf`` when the kernel can take this step, else None.

        Taken, the step state goes to CHECKED with ``prepared=FUSED`` (the grads stay in the model). ``found_inf``
        None (no scaler): a new flag."""
        self._ready = []
        if not self.candidate or state.stage is not Stage.MODEL_GRADS or self._hooked():
            return None
        if found_inf is not None and found_inf.device.type != "cpu":
            return None
        ready = []
        for gi, (group, mg) in enumerate(zip(self.optimizer.param_groups, self.groups)):
            plan = self._plan(gi, group, mg)
            if plan is None:
                return None
            grads = plan.grads([p.grad for p in mg.model_params])
            if grads is None:
                return None
            ready.append((plan, grads, group))
        if not ready:
            return None
        if found_inf is None:
            found_inf = kernels.new_found_inf(torch.device("cpu"))
        for plan, grads, _ in ready:
            fused.check_finite_(plan, grads, found_inf)
        self._ready = ready
        self._ready_params = [p for plan, _, _ in ready for p in plan.params16 if p is not None]  # (all: 16-bit grads)
        flags = {found_inf.device: found_inf}
        state.checked(flags, prepared=FUSED, verdict=found_inf, transfer=TransferRecord(self._ready_params))
        return flags

    def step(self, state: StepState, grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None) -> None:
        """Take the CHECKED step (``state.prepared is FUSED``) with the kernel; the state goes to STEPPED.

        ``found_inf`` None (no scaler: ``opt.step()`` checked the grads itself): the check's own flag decides."""
        if state.stage is not Stage.CHECKED or state.prepared is not FUSED or not self._ready:
            raise RuntimeError("internal: FusedSteps.step without a check that took the step")
        if found_inf is None and grad_scale is None:
            found_inf = next(iter(state.flags.values()))
        try:
            self._step(grad_scale, found_inf)
        finally:
            state.stepped()

    def _step(self, grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None) -> None:
        ready, self._ready = self._ready, []
        model_params = self._ready_params
        masters = [m for plan, _, _ in ready for m in plan.masters]
        keep = [None if t is None else t.clone() for t in (grad_scale, found_inf)]  # (the scaler updates its own)
        self._taken = (model_params, masters, keep[0], keep[1])
        for plan, grads, group in ready:
            plan.step(grads, group, grad_scale=grad_scale, found_inf=found_inf, verify=False)  # (check() just did)
        self.groups.masters.release_grad_memory()  # (the kernel reads none: 4 B/param held for nothing)

    def step_job(
        self,
        model_params: list[torch.Tensor],
        grads: list[torch.Tensor | None],
        groups: list[dict[str, Any]] | None,
        grad_scale: torch.Tensor,
        *,
        land: bool = False,
        found_inf: torch.Tensor | None = None,
    ) -> bool:
        """In an asynchronous step's job: step the masters from the handed-off 16-bit ``grads`` with the kernel.

        ``grads[i]`` is ``model_params[i]``'s (the hand-off); ``groups`` the job's snapshot of the param groups (their
        hyperparameters), or None for the live ones; ``grad_scale`` the scale the grads carry. The model params are
        not written -- the next landing copies the masters into them, as after torch's step -- and the masters keep
        no grad. ``land`` (a job run inline, on the main thread): the model params get the masters as they are now,
        the landing of the step before, in the same pass -- 28 B/param where the landing's copy and the job took 32;
        ``found_inf`` (a float32 CPU flag, or None) then skips the step but not the landing. False, with nothing
        changed, when the kernel cannot take the step: then torch's ops do (and the caller lands)."""
        if grad_scale.device.type != "cpu":
            return False
        if land and (found_inf is None or not is_cpu_scalar(found_inf)):
            return False
        by_param = dict(zip(map(id, model_params), grads))
        ready = self._job_plans(groups, lambda params: list(map(by_param.get, map(id, params))))
        if ready is None:
            return False
        if land and sum(len(plan.masters) for plan, _, _ in ready) != len(self.groups.masters.masters):
            return False  # (a master outside the groups: the landing would miss it)
        for plan, addresses, group in ready:
            plan.step(
                addresses, group, grad_scale=grad_scale, found_inf=found_inf if land else None, verify=False,
                write_params=False, land=land,
            )  # fmt: skip
            for m in plan.masters:
                m.grad = None  # (a grad left from an earlier step would be stale)
        self.groups.masters.release_grad_memory()
        self.groups.masters.grads_left_out()  # (every master had a grad: zero_grad(set_to_none=False) makes them)
        return True

    def check_job_grads(self, found_inf: torch.Tensor) -> bool:
        """Mode 1's check of the model grads on the main thread, by the kernel, when the job could take the kernel.

        Reads the 16-bit grads only (torch's check writes them too). Only while no job runs (the plans are the
        main thread's then). False, with nothing done: check with torch's ops."""
        if found_inf.device.type != "cpu":
            return False
        ready = self._job_plans(None, lambda params: [p.grad for p in params])
        if ready is None:
            return False
        for plan, addresses, _ in ready:
            fused.check_finite_(plan, addresses, found_inf)
        return True

    def _job_plans(
        self, groups: list[dict[str, Any]] | None, grads_of: Any
    ) -> list[tuple[fused.AdamPlan, fused.GradAddresses, dict[str, Any]]] | None:
        """Per group the plan, the grads' addresses and the hyperparameters of an asynchronous step, or None.

        ``grads_of(params)``: the grads of a group's model params, in order."""
        if not self.job_candidate or self._hooked():
            return None
        live = self.optimizer.param_groups
        hyper = live if groups is None else groups
        if len(hyper) != len(live) or len(live) != len(self.groups):
            return None
        ready = []
        for gi, (group, mg) in enumerate(zip(live, self.groups)):
            plan = self._plan(gi, group, mg)
            if plan is None or fused.kernel_refusal(self.optimizer, hyper[gi]) is not None:
                return None
            addresses = plan.grads(grads_of(mg.model_params))
            if addresses is None:
                return None
            ready.append((plan, addresses, hyper[gi]))
        return ready

    def settle(self, state: StepState) -> None:
        """Make the master grads of the step the kernel took, before anything reads them (module docstring).

        Called by every entry point that reads or replaces master grads. When the model grads the kernel read are
        still there (the step state's record), the masters get what torch's fused step leaves in their ``.grad``;
        otherwise (a new backward, an edit, ``zero_grad``) the state machine re-reads the model grads as it would
        after any step, and nothing of the kernel's step is read again."""
        taken, self._taken = self._taken, None
        if taken is None or state.stage is not Stage.STEPPED:
            return
        model_params, masters, grad_scale, found_inf = taken
        if not state.current(model_params):
            return
        grads = [p.grad for p in model_params]
        if found_inf is not None and found_inf.item():  # (a CPU flag: no device sync) skipped: left scaled
            grad_scale = None
        for m, g in zip(masters, fused.unscaled_grads(grads, grad_scale)):  # type: ignore[arg-type]
            m.grad = g

    def from_master_grads(self, found_inf: torch.Tensor | None, *, own_step: bool = False) -> bool:
        """Step the wrapped optimizer from the masters' fp32 ``.grad`` and write the 16-bit params, in one pass.

        For the step whose master grads exist (apex's faces make them at the backward; ``scaler.unscale_`` before a
        clip): torch's fused step on the masters plus the copy into the model (28 + 6 B/param, two passes) become
        one kernel pass of 30 B/param, the numbers bit for bit the same. ``found_inf`` (a float32 CPU flag, or None)
        skips the whole step as torch's fused step skips on it. ``own_step``: the optimizer's instance ``step`` is
        the caller's own patch (amp's), not a hook; the caller checked that what it would call is torch's step.
        False, with nothing changed, when the kernel cannot take it -- then the caller runs torch's step and the
        copy: another optimizer or option, a param without a grad, a first step (no state), a step hook."""
        if not self.candidate or self._hooked(own_step=own_step) or not self.groups.masters.masters:
            return False
        if found_inf is not None and not is_cpu_scalar(found_inf):
            return False
        ready, covered = [], 0
        for gi, (group, mg) in enumerate(zip(self.optimizer.param_groups, self.groups)):
            plan = self._grad_plan(gi, group, mg)
            if plan is None:
                return False
            grads = plan.grads([m.grad for m in plan.masters], fp32=True)
            if grads is None:
                return False
            ready.append((plan, grads, group))
            covered += len(mg.masters)
        if covered != len(self.groups.masters.masters):  # (a master outside the groups: the copy would miss it)
            return False
        for plan, grads, group in ready:
            plan.step(grads, group, grad_scale=None, found_inf=found_inf, verify=False)
        return True

    def _grad_plan(self, gi: int, group: dict[str, Any], mg: Any) -> fused.AdamPlan | None:
        """The plan over ``group["params"]`` in its order: the masters with their 16-bit params, fp32 params as they are."""
        if mg.watched or not group["params"] or fused.kernel_refusal(self.optimizer, group) is not None:
            return None  # (refusal asked every step: the options may change)
        params = group["params"]
        cached = self._grad_plans.get(gi)
        if cached is not None:
            plan, model_params = cached
            if (
                len(plan.masters) == len(params)
                and all(map(operator.is_, plan.masters, params))
                and len(model_params) == len(mg.model_params)
                and all(map(operator.is_, model_params, mg.model_params))
                and plan.current()
            ):
                return plan
        self._grad_plans.pop(gi, None)
        model_of = {id(m): p for m, p in zip(mg.masters, mg.model_params)}
        direct = {id(p) for p in mg.direct}
        if len(params) != len(model_of) + len(direct) or not all(id(p) in model_of or id(p) in direct for p in params):
            return None
        try:
            plan = fused.AdamPlan([model_of.get(id(p)) for p in params], params, self.optimizer)
        except ValueError:  # no state yet (the first step), another device, mixed dtypes: torch's ops
            return None
        self._grad_plans[gi] = (plan, list(mg.model_params))
        return plan

    def forget(self) -> None:
        """``zero_grad()``, a hand-off, a checkpoint load: the step the kernel took is over."""
        self._ready = []
        self._taken = None

    # ------------------------------------------------------------------ eligibility
    def _hooked(self, *, own_step: bool = False) -> bool:
        opt = self.optimizer
        return bool(
            opt._optimizer_step_pre_hooks
            or opt._optimizer_step_post_hooks
            or ("step" in vars(opt) and not own_step)
            or torch_optimizer._global_optimizer_pre_hooks
            or torch_optimizer._global_optimizer_post_hooks
        )

    def _plan(self, gi: int, group: dict[str, Any], mg: Any) -> fused.AdamPlan | None:
        if mg.direct or mg.watched or len(group["params"]) != len(mg.masters) or not mg.masters:
            return None
        if not all(map(operator.is_, group["params"], mg.masters)):
            return None
        plan = self._plans.get(gi)
        if fused.kernel_refusal(self.optimizer, group) is not None:  # (every step: the options may change)
            return None
        if plan is not None and plan.current() and all(map(operator.is_, plan.masters, mg.masters)):
            return plan
        self._plans.pop(gi, None)
        try:
            plan = fused.AdamPlan(mg.model_params, mg.masters, self.optimizer)
        except ValueError:  # no state yet (the first step), another device, mixed dtypes: torch's ops
            return None
        self._plans[gi] = plan
        return plan
