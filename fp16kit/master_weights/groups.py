"""Which params of an optimizer's param groups get masters, and which are stepped as they are.

A :class:`MasterGroups` walks a wrapped optimizer's param groups and replaces each trainable
fp16/bf16 param *in place* in its group by its fp32 master (``all_masters``: every trainable
param, fp32 ones too -- asynchronous steps and offloaded masters need that, so the optimizer
thread never writes a tensor the forward pass reads); the optimizer state moves to the master.
Trainable params that keep no master (fp32, fp64) are ``direct``: unscaled in place and
stepped as they are.

Params that are frozen (``requires_grad=False``) when their group is adopted stay in the group
as they are and are *watched*: staged fine-tuning unfreezes them later. :meth:`refresh`, called
before every step reads the grads, adopts the ones that became trainable, by the rule of the
face that owns the optimizer::

    late="adopt"  (modern face, torch's rule: whatever has a grad at step time is unscaled and
                   checked): an fp16/bf16 param gets its master then (so does an fp32 one with
                   all_masters); other params become direct.
    late="refuse" (legacy face, apex's construction-time rule): a watched param that has a grad
                   raises a RuntimeError naming it -- apex stepped it with its scaled fp16
                   grad; fp16kit refuses rather than corrupt it.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ..core.master import LOW_PRECISION, MasterParams

__all__ = [
    "MasterGroup",
    "MasterGroups",
    "check_distinct_groups",
    "check_floating",
    "check_master_dtypes",
    "check_not_sharded",
    "check_params",
    "check_not_wrapped",
    "drop_repeats",
    "mark_wrapped",
]

# Inner optimizers a MixedPrecisionOptimizer has wrapped: their groups hold masters now.
_wrapped: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()

LatePolicy = Literal["adopt", "refuse"]


@dataclass
class MasterGroup:
    """One param group's params, by role.

    ``model_params[i]`` is mastered by ``masters[i]``; ``direct`` params are optimized as they are;
    ``watched`` were frozen when adopted."""

    model_params: list[torch.Tensor] = field(default_factory=list)
    masters: list[torch.Tensor] = field(default_factory=list)
    direct: list[torch.Tensor] = field(default_factory=list)
    watched: list[torch.Tensor] = field(default_factory=list)


def check_master_dtypes(params: Any, master_dtype: torch.dtype, *, where: str = "") -> None:
    """With a master for every trainable param, each must be fp16, bf16 or fp32.

    Raises TypeError naming the param and the fix; changes nothing."""
    for i, p in enumerate([params] if isinstance(params, torch.Tensor) else list(params)):
        if p.requires_grad and p.dtype not in (*LOW_PRECISION, torch.float32):
            raise TypeError(
                f"With async_step=True or a master_device, every trainable param gets a "
                f"{master_dtype} master; got a {p.dtype} param of shape {tuple(p.shape)}"
                f"{where or ''} (index {i}). Keep it out of this optimizer or convert it to float32."
            )


def check_not_sharded(params: Any, all_masters: bool, master_dtype: torch.dtype, *, where: str = "") -> None:
    """Refuse a sharded param (a DTensor, e.g. FSDP2's) that would get a master.

    TypeError naming the rule (its kernels cannot copy into one, and FSDP2 keeps fp32 sharded params itself);
    changes nothing. Free when torch.distributed.tensor was never imported: then no param is a DTensor."""
    module = sys.modules.get("torch.distributed.tensor")
    if module is None:
        return
    for i, p in enumerate([params] if isinstance(params, torch.Tensor) else list(params)):
        if (
            isinstance(p, module.DTensor)
            and p.requires_grad
            and (p.dtype in LOW_PRECISION or (all_masters and p.dtype == torch.float32))
        ):
            raise TypeError(
                f"MixedPrecisionOptimizer got a sharded {p.dtype} param (a DTensor, e.g. from FSDP2's "
                f"fully_shard) of shape {tuple(p.shape)}{where} (index {i}) and would keep a "
                f"{master_dtype} master of it. Do not combine them: FSDP2's MixedPrecisionPolicy "
                "already keeps the sharded params in float32 and computes in float16. Shard the "
                "float32 model with fully_shard(module, mp_policy=MixedPrecisionPolicy(param_dtype="
                "torch.float16, reduce_dtype=torch.float32)), step a plain torch optimizer on "
                "model.parameters(), and use fp16kit.GradScaler(device, process_group=...) so "
                "that the ranks skip steps together."
            )


def check_floating(params: Any, *, where: str = "") -> None:
    """Refuse a param that is not a floating-point tensor, in torch.optim's words.

    An integer or bool tensor (a buffer, an index) never has a gradient, so listing it is a mistake (the wrong
    tensors were passed); a complex one cannot be unscaled (torch's unscale kernel, which torch.amp.GradScaler
    uses too, has no complex version). TypeError; changes nothing."""
    for i, p in enumerate([params] if isinstance(params, torch.Tensor) else list(params)):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"optimizer can only optimize Tensors, but one of the params is {torch.typename(p)}")
        if not p.is_floating_point():
            advice = (
                "Complex params cannot be loss-scaled (torch.amp.GradScaler cannot unscale them either): "
                "give them an optimizer of their own, stepped without a scaler."
                if p.is_complex()
                else "Integer and bool tensors (buffers, indices) have no gradients: build the optimizer "
                "on model.parameters(), not on the state dict's tensors or buffers."
            )
            raise TypeError(
                f"MixedPrecisionOptimizer can only optimize Tensors of floating point dtype, but one of the "
                f"params{where} (index {i}, shape {tuple(p.shape)}) is {p.dtype}. {advice}"
            )


def check_params(params: Any, all_masters: bool, master_dtype: torch.dtype, *, where: str = "") -> None:
    """Run every check a param that may get a master must pass.

    At construction, in add_param_group, when unfrozen later: :func:`check_floating`,
    :func:`check_master_dtypes` when every trainable param gets a master, and :func:`check_not_sharded`.
    Changes nothing."""
    check_floating(params, where=where)
    if all_masters:
        check_master_dtypes(params, master_dtype, where=where)
    check_not_sharded(params, all_masters, master_dtype, where=where)


def check_distinct_groups(param_groups: list[dict[str, Any]]) -> None:
    """Refuse a param listed in two param groups, with torch.optim's error.

    torch checks each group it adds against the ones before; groups edited by hand since reach here. Each
    would get a master, stepped with its group's settings, and the last copied back would win. Changes
    nothing."""
    seen: dict[int, int] = {}
    for gi, group in enumerate(param_groups):
        for p in {id(p): p for p in group["params"]}.values():  # (a repeat in one group: drop_repeats)
            if id(p) in seen:
                raise ValueError(
                    f"some parameters appear in more than one parameter group: param groups "
                    f"{seen[id(p)]} and {gi} both hold a {p.dtype} param of shape {tuple(p.shape)}. "
                    "List each param in one group (torch.optim refuses this too)."
                )
            seen[id(p)] = gi


def drop_repeats(params: list[torch.Tensor]) -> list[int]:
    """Remove the later listings of a param listed more than once in ``params``, in place.

    In place because LBFGS caches the list; returns their positions. One master per param: torch.optim would
    step such a param at every listing."""
    seen: set[int] = set()
    repeats = []
    for i, p in enumerate(params):
        if id(p) in seen:
            repeats.append(i)
        seen.add(id(p))
    if repeats:
        dropped = set(repeats)
        params[:] = [p for i, p in enumerate(params) if i not in dropped]
    return repeats


def check_not_wrapped(optimizer: torch.optim.Optimizer) -> None:
    """Refuse an inner optimizer another MixedPrecisionOptimizer wrapped already.

    See :func:`mark_wrapped`: its groups hold that one's fp32 masters, so a second wrapper would make none and
    step nothing of the model."""
    if optimizer in _wrapped:
        raise TypeError(
            "This optimizer is already wrapped by a MixedPrecisionOptimizer (its param groups hold "
            "that wrapper's fp32 masters): keep using that MixedPrecisionOptimizer, or build a new "
            "torch optimizer on the model's parameters and wrap it."
        )


def mark_wrapped(optimizer: torch.optim.Optimizer) -> None:
    """Record that a MixedPrecisionOptimizer put masters into ``optimizer``'s groups."""
    _wrapped.add(optimizer)


class MasterGroups:
    """The masters of an optimizer's param groups (see the module docstring)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        masters: MasterParams,
        *,
        all_masters: bool,
        late: LatePolicy = "adopt",
    ) -> None:
        self.optimizer = optimizer
        self.masters = masters
        self.all_masters = all_masters
        self.late = late
        self.groups: list[MasterGroup] = []

    def check_assignment(self, groups: Any) -> None:
        """Check ``optimizer.param_groups = groups``: it may rearrange the masters' groups, not add params.

        It may rearrange or edit the groups of the params stepped already (the masters), not bring new ones: a
        new fp16/bf16 param would be stepped directly with its scaled 16-bit grad. Changes nothing."""
        known = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        new = [
            p
            for g in groups
            for p in ([g["params"]] if isinstance(g["params"], torch.Tensor) else g["params"])
            if id(p) not in known
        ]
        if new:
            raise TypeError(
                f"optimizer.param_groups was assigned {len(new)} param(s) this MixedPrecisionOptimizer "
                "does not step (the model's fp16/bf16 params are replaced by fp32 masters in its groups): "
                "add new params with optimizer.add_param_group({'params': ...}), which gives them masters."
            )

    def __iter__(self) -> Any:
        return iter(self.groups)

    def __len__(self) -> int:
        return len(self.groups)

    def __getitem__(self, i: int) -> MasterGroup:
        return self.groups[i]

    def _wants_master(self, p: torch.Tensor) -> bool:
        return p.requires_grad and (p.dtype in LOW_PRECISION or (self.all_masters and p.dtype == torch.float32))

    def check(self, params: list[torch.Tensor], *, new_group: bool = False) -> None:
        """Validate params before adopting them (nothing changes on error).

        ``new_group``: they must not be optimized already, nor listed twice (torch compares against the
        masters, which are not the params the user holds)."""
        check_params(params, self.all_masters, self.masters.master_dtype)
        if not new_group:
            return
        known = {id(p) for p in self.masters.model_params}
        known.update(id(p) for g in self.optimizer.param_groups for p in g["params"])
        if any(id(p) in known for p in params):
            raise ValueError("some parameters appear in more than one parameter group")
        if len({id(p) for p in params}) != len(params):
            raise ValueError("The new param group holds a param twice: list each param once.")

    def adopt(self, group: dict[str, Any]) -> MasterGroup:
        """Master the trainable fp16/bf16 params of ``group``, in place.

        ``group``: a dict of the wrapped optimizer's ``param_groups``."""
        params = group["params"]
        info = MasterGroup()
        chosen = [i for i, p in enumerate(params) if self._wants_master(p)]
        for i, m in zip(chosen, self.masters.add([params[i] for i in chosen])):
            info.model_params.append(params[i])
            info.masters.append(m)
            self._replace(params, i, m)
        mastered = {id(m) for m in info.masters}
        for p in params:
            if id(p) in mastered:
                continue
            (info.direct if p.requires_grad else info.watched).append(p)
        self.groups.append(info)
        return info

    def _replace(self, params: list[torch.Tensor], i: int, master: torch.Tensor) -> None:
        p = params[i]
        params[i] = master  # in place: LBFGS caches this very list
        state = self.optimizer.state
        if p in state:
            moved = state.pop(p)
            # Re-cast moved state (e.g. fp16 momentum) to the master's dtype and device, as
            # torch's load_state_dict casts floating state to its param's dtype.
            state[master] = {
                k: v.to(device=master.device, dtype=master.dtype)
                if isinstance(v, torch.Tensor) and v.is_floating_point() and v.shape == p.shape
                else v
                for k, v in moved.items()
            }

    def watched_ids(self) -> set[int]:
        """The ids of the watched (frozen when adopted, not adopted since) params."""
        return {id(p) for g in self.groups for p in g.watched}

    def direct_params(self) -> list[torch.Tensor]:
        return [p for g in self.groups for p in g.direct]

    def unfrozen(self) -> bool:
        """Has a watched param become trainable? (cheap: called before every step)"""
        return any(p.requires_grad for g in self.groups for p in g.watched)

    def refresh(self, before_change: Callable[[], None]) -> None:
        """Adopt the watched params that became trainable (see the module docstring).

        ``before_change`` runs once before the groups change (waits for a step in flight that reads them).
        Everything is checked before anything changes."""
        if not self.unfrozen():
            return
        found = [(gi, p) for gi, g in enumerate(self.groups) for p in g.watched if p.requires_grad]
        if self.late == "refuse":
            with_grad = [(gi, p) for gi, p in found if p.grad is not None]
            if with_grad:
                gi, p = with_grad[0]
                raise RuntimeError(
                    f"A param of param group {gi} (shape {tuple(p.shape)}, {p.dtype}) was frozen "
                    "when FP16_Optimizer was built and has a gradient now. FP16_Optimizer decides "
                    "at construction which params it trains, as apex did (apex stepped such a "
                    "param with its scaled gradient). Unfreeze the params before building the "
                    "FP16_Optimizer, or use fp16kit.MixedPrecisionOptimizer, which adopts "
                    "params unfrozen later."
                )
            return
        for gi, p in found:
            check_params(
                p, self.all_masters, self.masters.master_dtype, where=f" in param group {gi}, unfrozen after wrapping"
            )
        before_change()
        for gi in sorted({gi for gi, _ in found}):
            self._adopt_unfrozen(gi, [p for g, p in found if g == gi])

    def _adopt_unfrozen(self, gi: int, new: list[torch.Tensor]) -> None:
        """Adopt ``new`` (watched params of group ``gi`` now trainable) in one pass over the
        group: their masters made together (one flat block), each role's list rebuilt in the
        group's order -- checkpoints pair saved masters with them by position, whenever a
        param was unfrozen. The lists are refilled in place (FP16_Optimizer and amp alias them)."""
        info = self.groups[gi]
        new_ids = {id(p) for p in new}
        info.watched[:] = [w for w in info.watched if id(w) not in new_ids]
        wanted = [p for p in new if self._wants_master(p)]
        made = dict(zip((id(p) for p in wanted), self.masters.add(wanted)))
        paired = {id(m): p for p, m in zip(info.model_params, info.masters)}
        direct_ids = {id(p) for p in info.direct} | (new_ids - made.keys())
        params = self.optimizer.param_groups[gi]["params"]
        model_params: list[torch.Tensor] = []
        masters: list[torch.Tensor] = []
        direct: list[torch.Tensor] = []
        for i, q in enumerate(params):
            if id(q) in made:
                m = made[id(q)]
                self._replace(params, i, m)
                model_params.append(q)
                masters.append(m)
            elif id(q) in paired:
                model_params.append(paired[id(q)])
                masters.append(q)
            elif id(q) in direct_ids:
                direct.append(q)
        info.model_params[:] = model_params
        info.masters[:] = masters
        info.direct[:] = direct

    def flag_device(self) -> torch.device:
        """Return where the found-inf flags of the stepped grads live.

        The first master's device (or direct param's); the CPU for an optimizer with no params."""
        for p in (*self.masters.masters, *self.direct_params()):
            return p.device
        return torch.device("cpu")

    def grad_device(self) -> torch.device:
        """The device of the model's fp16/bf16 grads (checked there before a hand-off)."""
        for p in self.masters.model_params:
            return p.device
        return self.flag_device()
