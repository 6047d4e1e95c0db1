"""What ``amp.initialize`` does to optimizers (docs/apex-amp.md §5, §8).

The SAME optimizer object (its class kept) gets ``_amp_stash`` and apex's instance methods; with
master weights (O2) its param groups hold fp32 masters after the lazy init, made by
:class:`fp16kit.master_weights.groups.MasterGroups` / :class:`fp16kit.core.master.MasterParams`
(the code FP16_Optimizer and MixedPrecisionOptimizer use). All tensor math runs in
:mod:`fp16kit.core.kernels`.

Grad flow per non-delayed ``scale_loss`` (S = the loss scale of that backward)::

    prepare (entry):  O2: fp16 grads -> None;  params without masters: grad -> stash, None
    post (exit):      O2 master grad = fp16 grad * (1/S)  [+ master grad, if set]
                      params without masters: grad = new * (1/S) [+ stash]  (stash alone if
                      no new grad)
    step:             a skip recorded by scale_loss -> log, master grads None, no step;
                      else O2: step on masters, masters -> fp16 params, master grads None

Fixes (MIGRATION.md): ``step()``/``zero_grad()`` before the first backward lazy-init (apex#341);
``zero_grad(set_to_none=...)`` is accepted; a static scale of 1.0 with masters keeps the
accumulated fp32 grads (§13.7); the O2 optimizer state stays fp32 whatever the order of
``initialize`` and ``optimizer.load_state_dict``, and the exact masters travel in
``optimizer.state_dict()[MASTERS_KEY]`` (option (b) of §12).

Ctrl-C (:mod:`fp16kit.core.interrupts`): ``step``, ``zero_grad``, ``add_param_group``,
``state_dict``, ``load_state_dict`` and each side of ``scale_loss`` (:func:`within_commits`) are
commits of the optimizer. Who carries the mark of a commit a second Ctrl-C broke off: what it
changes. The optimizer (params, masters, grads, its state), until its ``load_state_dict``
(which also drops the backward in progress and the pending skips); a loss scaler, for the
commits that change one (``scale_loss``'s exit, a ``step()`` applying deferred updates,
``update_scale()``, ``amp.load_state_dict``), until ``amp.load_state_dict`` restores it -- so a
run restored as apex documents (model, optimizer, amp) is whole again, and one that skipped a
part is refused by the part it skipped. ``step()`` and ``scale_loss`` refuse while any amp
scaler is marked.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable
from typing import Any

import torch

from ...core import kernels
from ...core.interrupts import commit
from ...core.master import MasterParams
from ...master_weights.fused_step import FusedSteps
from ...master_weights.groups import MasterGroups
from .._messages import apex_logger, float_or_half
from ._amp_state import _amp_state
from .scaler import refuse_if_broken

#: An optimizer amp.initialize patches: ``_amp_stash`` and apex's methods are instance attributes
#: added at run time, which no static type of torch's describes.
AmpOptimizer = Any

__all__ = ["AmpOptimizerState", "process_optimizer", "unprepare", "unscale_into_stash", "MASTERS_KEY", "AMP_METHODS"]

MASTERS_KEY = "amp_fp32_masters"
"""The extra ``optimizer.state_dict()`` entry holding the exact fp32 masters per group (O2)."""

AMP_METHODS = (
    "_lazy_init_maybe_master_weights",
    "_master_params_to_model_params",
    "_prepare_amp_backward",
    "_post_amp_backward",
    "_amp_lazy_init",
)

CLOSURE_ERROR = "Currently, Amp does not support closure use with optimizers."
_ALLOWED = (torch.float16, torch.bfloat16, torch.float32)


class AmpOptimizerState:
    """``optimizer._amp_stash``: apex's attribute names plus the masters and the pending skips.

    ``optimizer._amp_stash``: apex's attribute names (``lazy_init_called``,
    ``params_have_scaled_gradients``, ``all_fp16_params``, ``all_fp32_from_fp16_params``,
    ``all_fp32_from_fp32_params``, ...) plus the masters and the pending skips."""

    def __init__(self) -> None:
        self.lazy_init_called = False
        self.already_patched = False
        self.params_have_scaled_gradients = False
        self.built = False
        self.master_groups: MasterGroups | None = None
        self.fused: FusedSteps | None = None  # the kernel's plans for master_groups (built at the first step)
        self.pending: list[tuple[int, Any, torch.Tensor]] = []  # (loss_id, scaler, found_inf)
        self.all_fp16_params: list[torch.Tensor] = []
        self.all_fp32_params: list[torch.Tensor] = []
        self.fp16_groups: list[list[torch.Tensor]] = []
        self.fp32_from_fp16_groups: list[list[torch.Tensor]] = []
        self.fp32_from_fp32_groups: list[list[torch.Tensor]] = []
        self.all_fp32_from_fp16_params: list[torch.Tensor] = []
        self.all_fp32_from_fp32_params: list[torch.Tensor] = []
        self.grad_stash: dict[int, torch.Tensor | None] = {}  # id(param) -> stashed grad
        # (param, its grad) for each grad the last scale_loss entry changed, until its exit:
        # what the exit puts back if the block failed (or Ctrl-C came)
        self.grads_at_entry: list[tuple[torch.Tensor, torch.Tensor | None]] = []


def _check_types(params: Any) -> None:
    for p in params:
        if p.dtype not in _ALLOWED:
            raise TypeError(f"Optimizer's parameters must be either {float_or_half(p)}. Received {p.type()}")


def _all_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


# ---------------------------------------------------------------------- lazy init
def _lazy_init(optimizer: AmpOptimizer, master_weights: bool) -> None:
    stash = optimizer._amp_stash
    if stash.built:
        return
    if master_weights:
        _check_types(p for p in _all_params(optimizer) if p.requires_grad)
        groups = MasterGroups(optimizer, MasterParams([]), all_masters=False, late="adopt")
        for group in optimizer.param_groups:
            groups.adopt(group)
        stash.master_groups = groups
        _record_master_lists(stash)
        # (apex also set the fp32 params' grads to None here: a first delay_unscale window
        # lost them. The new masters have no grads anyway.)
    else:
        _check_types(_all_params(optimizer))
        _record_plain_lists(optimizer)
    stash.built = True


def _record_master_lists(stash: AmpOptimizerState) -> None:
    groups = stash.master_groups
    assert groups is not None  # _lazy_init set them just before
    stash.fp16_groups = [g.model_params for g in groups]
    stash.fp32_from_fp16_groups = [g.masters for g in groups]
    stash.fp32_from_fp32_groups = [g.direct for g in groups]
    stash.all_fp16_params = [p for g in stash.fp16_groups for p in g]
    stash.all_fp32_from_fp16_params = [p for g in stash.fp32_from_fp16_groups for p in g]
    stash.all_fp32_from_fp32_params = [p for g in stash.fp32_from_fp32_groups for p in g]


def _record_plain_lists(optimizer: AmpOptimizer) -> None:
    stash = optimizer._amp_stash
    params = _all_params(optimizer)
    stash.all_fp16_params = [p for p in params if p.dtype in (torch.float16, torch.bfloat16)]
    stash.all_fp32_params = [p for p in params if p.dtype == torch.float32]


def _stashed_params(optimizer: AmpOptimizer) -> list[torch.Tensor]:
    """The params whose grads go through the stash: O2's fp32 params, else every param."""
    stash = optimizer._amp_stash
    if stash.master_groups is not None:
        return stash.all_fp32_from_fp32_params
    return _all_params(optimizer)


# ---------------------------------------------------------------------- backward
def _prepare(optimizer: AmpOptimizer) -> None:
    optimizer._amp_lazy_init()
    stash = optimizer._amp_stash
    if stash.grads_at_entry:
        # the last entry's exit never ran (a Ctrl-C at its first line, before its commit, is
        # raised from __exit__ itself): the grads go back as they were before that with
        unprepare(optimizer)
    if stash.master_groups is not None:
        if stash.master_groups.unfrozen():
            stash.master_groups.refresh(lambda: None)
            _record_master_lists(stash)
    stashed = _stashed_params(optimizer)
    cleared = (stash.all_fp16_params if stash.master_groups is not None else []) + stashed
    stash.grads_at_entry = [(p, p.grad) for p in cleared]
    for p in cleared:
        p.grad = None
    stash.grad_stash = {id(p): g for p, g in stash.grads_at_entry[len(cleared) - len(stashed) :]}


def unprepare(optimizer: AmpOptimizer) -> None:
    """Undo the last ``_prepare_amp_backward``, restoring every grad it changed.

    Undo the last ``_prepare_amp_backward``: every grad it changed as it was (a scale_loss
    block that failed, or was interrupted, leaves the grads as before the ``with``)."""
    stash = optimizer._amp_stash
    for p, g in stash.grads_at_entry:
        p.grad = g
    stash.grads_at_entry = []
    stash.grad_stash = {}


def _post(optimizer: AmpOptimizer, scaler: Any) -> None:
    optimizer._amp_lazy_init()
    stash = optimizer._amp_stash
    inv = scaler.inv_scale()
    if stash.master_groups is not None:
        masters = stash.master_groups.masters
        new: list[torch.Tensor | None] = []
        acc_src: list[torch.Tensor] = []
        acc_dst: list[torch.Tensor] = []
        for p, m in zip(masters.model_params, masters.masters):
            if p.grad is not None and m.grad is not None:
                acc_src.append(p.grad)
                acc_dst.append(m.grad)
                new.append(None)
            else:
                new.append(p.grad)
        scaler.record(masters.grads_to_masters(inv, scaler.new_flag(), clear_missing=False, grads=new))
        if acc_src:
            scaler.record(kernels.unscale_add_to_(acc_src, acc_dst, inv, scaler.new_flag()))
    _post_stashed(optimizer, scaler, inv)
    stash.grads_at_entry = []


def _post_stashed(optimizer: AmpOptimizer, scaler: Any, inv: torch.Tensor) -> None:
    stash = optimizer._amp_stash
    params = _stashed_params(optimizer)
    new = unscale_into_stash(params, [stash.grad_stash.get(id(p)) for p in params], scaler, inv)
    stash.grad_stash = {}
    if any(g.dtype != torch.float32 for g in new) and not scaler.__class__.warned_unscaling_non_fp32_grad:
        scaler.__class__.warned_unscaling_non_fp32_grad = True
        apex_logger.warning(
            "Warning:  unscaling grads that are not FP32. Unscaling non-fp32 grads may indicate an "
            "error. When using Amp, you don't need to call .half() on your model."
        )


def unscale_into_stash(
    params: list[torch.Tensor], stashed: list[torch.Tensor | None], scaler: Any, inv: torch.Tensor
) -> list[torch.Tensor]:
    """Unscale a backward's new grads into the stashed ones (apex's "unscale with stash").

    After a scaled backward, for each param and its grad from before it (``stashed``):
    ``grad = new * inv + stashed`` -- ``new * inv`` with no stash, the stash with no new grad
    (apex's "unscale with stash"). The flags go to ``scaler``; returns the new grads."""
    alone: list[torch.Tensor] = []
    srcs: list[torch.Tensor] = []
    dsts: list[torch.Tensor] = []
    for p, old in zip(params, stashed):
        grad = p.grad
        if grad is None:
            if old is not None:
                p.grad = old
        elif old is None:
            alone.append(grad)
        else:
            srcs.append(grad)
            dsts.append(old)
            p.grad = old
    if alone:
        scaler.record(kernels.unscale_(alone, inv, scaler.new_flag()))
    if srcs:
        scaler.record(kernels.unscale_add_to_(srcs, dsts, inv, scaler.new_flag()))
    return [*alone, *srcs]


# ---------------------------------------------------------------------- step and friends
def _take_skip(optimizer: AmpOptimizer) -> tuple[int, Any] | None:
    """The first pending overflow since the last step (one host read), or None."""
    stash = optimizer._amp_stash
    if not stash.pending:
        return None
    flags = kernels.stack_flags([f for _, _, f in stash.pending], torch.device("cpu")).tolist()
    first = next(((loss_id, scaler) for (loss_id, scaler, _), flag in zip(stash.pending, flags) if flag), None)
    stash.pending = [] if first is None else [(first[0], first[1], kernels.one(torch.device("cpu")))]
    return first


def _clear_master_grads(optimizer: AmpOptimizer) -> None:
    stash = optimizer._amp_stash
    if stash.master_groups is not None:
        kernels.clear_grads_(stash.master_groups.masters.masters, set_to_none=True)


def _kernel_step(optimizer: AmpOptimizer, old_step: Callable[..., Any]) -> bool:
    """Step the masters from their grads and write the model params with the fused kernel, when it can.

    Only when ``old_step`` is torch's own step of the optimizer's class (not an LR scheduler's wrapper, which
    counts the steps): :meth:`~fp16kit.master_weights.fused_step.FusedSteps.from_master_grads` checks the rest."""
    stash = optimizer._amp_stash
    if stash.master_groups is None or getattr(old_step, "__func__", None) is not type(optimizer).step:
        return False
    if stash.fused is None or stash.fused.groups is not stash.master_groups:
        stash.fused = FusedSteps(optimizer, stash.master_groups, async_step=False)
    return stash.fused.from_master_grads(None, own_step=True)


def _make_step(optimizer: AmpOptimizer, master_weights: bool, casts: Any) -> Callable[..., Any]:
    old_step = optimizer.step

    @commit("optimizer.step()")  # one commit, torch's step hooks included
    def step(self: Any, closure: Callable[[], Any] | None = None) -> Any:
        return amp_step(closure)

    def amp_step(closure: Callable[[], Any] | None) -> Any:
        refuse_if_broken(getattr(_amp_state, "loss_scalers", []))  # it would update them, or step on their flags
        skip = _take_skip(optimizer)
        for deferring in getattr(_amp_state, "loss_scalers", ()):  # delay_overflow_check exits
            if hasattr(deferring, "apply_deferred"):
                deferring.apply_deferred()
        if skip is not None:
            if closure is not None:
                raise RuntimeError(CLOSURE_ERROR)  # the skip stays pending, as apex's patch
            optimizer._amp_stash.pending = []
            loss_id, scaler = skip
            if _amp_state.verbosity >= 1:
                apex_logger.warning(
                    f"Gradient overflow.  Skipping step, loss scaler {loss_id} reducing loss scale to {scaler.loss_scale()}"
                )
            _clear_master_grads(optimizer)
            return None
        ctx = casts.disable_casts() if casts is not None else contextlib.nullcontext()
        if not master_weights:
            with ctx:
                return old_step() if closure is None else old_step(closure)
        if closure is not None:
            raise RuntimeError(CLOSURE_ERROR)
        optimizer._amp_lazy_init()
        if _kernel_step(optimizer, old_step):  # torch's step and the copy back, in one pass
            _clear_master_grads(optimizer)
            return None
        with ctx:
            retval = old_step()
        optimizer._master_params_to_model_params()
        _clear_master_grads(optimizer)
        return retval

    if getattr(old_step, "_wrapped_by_lr_sched", False):
        # an LR scheduler built before initialize wrapped step(); ours calls its wrapper (so a
        # skipped step is seen as no step, and the scheduler warns, as with apex)
        step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    # a bound method, as apex's patch: a scheduler built after initialize wraps step.__func__
    return types.MethodType(step, optimizer)


def _make_zero_grad(optimizer: AmpOptimizer) -> Callable[..., None]:
    def zero_grad(self: Any, set_to_none: bool | None = None) -> None:
        """apex zeroed the fp16 and fp32 grads in place and set the master grads to None;
        ``set_to_none=True`` sets them all to None (FIX: apex took no argument)."""
        optimizer._amp_lazy_init()
        stash = optimizer._amp_stash
        kernels.clear_grads_(stash.all_fp16_params + stash.all_fp32_from_fp32_params, set_to_none=bool(set_to_none))
        _clear_master_grads(optimizer)

    return types.MethodType(commit("optimizer.zero_grad()")(zero_grad), optimizer)


def _make_add_param_group(optimizer: AmpOptimizer, master_weights: bool) -> Callable[..., None]:
    old_add = optimizer.add_param_group

    @commit("optimizer.add_param_group()")
    def add_param_group(self: Any, new_group: dict[str, Any]) -> None:
        add(new_group)

    def add(new_group: dict[str, Any]) -> None:
        optimizer._amp_lazy_init()
        assert isinstance(new_group, dict), "param group must be a dict"
        params = new_group["params"]
        if isinstance(params, torch.Tensor):
            new_group["params"] = [params]
        elif isinstance(params, set):
            raise TypeError(
                "optimizer parameters need to be organized in ordered collections, but the ordering "
                "of tensors in sets will change between runs. Please use a list instead."
            )
        else:
            new_group["params"] = list(params)
        stash = optimizer._amp_stash
        if not master_weights:
            _check_types(new_group["params"])
            old_add(new_group)
            _record_plain_lists(optimizer)
            return
        _check_types(p for p in new_group["params"] if p.requires_grad)
        stash.master_groups.check(new_group["params"], new_group=True)
        old_add(new_group)
        stash.master_groups.adopt(optimizer.param_groups[-1])
        _record_master_lists(stash)

    return types.MethodType(add_param_group, optimizer)


def _make_checkpointing(
    optimizer: AmpOptimizer, master_weights: bool
) -> tuple[Callable[..., Any], Callable[..., None]]:
    """``state_dict`` / ``load_state_dict``, each one commit of the optimizer: ``state_dict``
    refuses after a second Ctrl-C broke a commit off (a checkpoint of half a change would be
    saved), ``load_state_dict`` recovers from it (see :func:`process_optimizer`)."""
    old_state_dict = optimizer.state_dict
    old_load = optimizer.load_state_dict

    def state_dict(self: Any) -> dict[str, Any]:
        """The optimizer's state dict, plus the exact fp32 masters per group once they exist."""
        sd = old_state_dict()
        stash = optimizer._amp_stash
        if stash.master_groups is not None:
            sd[MASTERS_KEY] = [[m.detach() for m in g.masters] for g in stash.master_groups]
        return sd

    def load_state_dict(self: Any, sd: dict[str, Any]) -> None:
        """Load into the fp32 masters (the state stays fp32); restore the saved masters, or
        rebuild them from the fp16 model weights for a checkpoint without them (apex's). All
        checked first: an error loads nothing."""
        if not master_weights:
            return old_load(sd)
        optimizer._amp_lazy_init()
        groups = optimizer._amp_stash.master_groups
        saved = sd.get(MASTERS_KEY) if isinstance(sd, dict) else None
        pairs = _match_masters(saved, groups) if saved is not None else None
        old_load({k: v for k, v in sd.items() if k != MASTERS_KEY} if isinstance(sd, dict) else sd)
        if pairs is not None:
            kernels.copy_pairs_(pairs)
        elif groups.masters.masters:
            kernels.copy_to_(groups.masters.model_params, groups.masters.masters)

    return (
        types.MethodType(commit("optimizer.state_dict()")(state_dict), optimizer),
        types.MethodType(commit("optimizer.load_state_dict()", recovers=True)(load_state_dict), optimizer),
    )


def _recovered_from_interrupt(optimizer: AmpOptimizer) -> None:
    """After ``load_state_dict`` recovered the optimizer from a commit a second Ctrl-C broke off:
    no backward in progress and no skip pending, as in a run resumed from that checkpoint (the
    model's grads are the next ``zero_grad()``'s, as there)."""
    stash = optimizer._amp_stash
    stash.pending = []
    stash.grads_at_entry = []
    stash.grad_stash = {}
    stash.params_have_scaled_gradients = False


def within_commits(what: str, optimizers: list[Any], body: Callable[[], Any]) -> Any:
    """Run ``body()`` as one commit of each of ``optimizers``, nested.

    ``body()`` as one commit (:func:`fp16kit.core.interrupts.commit`) of each of ``optimizers``,
    nested: each refuses first if a second Ctrl-C broke one of its commits off (before ``body``
    changes anything), and a second Ctrl-C during ``body`` marks them all."""
    run = _commit_running(what)

    def nest(i: int) -> Any:
        return body() if i == len(optimizers) else run(optimizers[i], lambda: nest(i + 1))

    return nest(0)


@functools.cache
def _commit_running(what: str) -> Callable[[Any, Callable[[], Any]], Any]:
    return commit(what)(lambda self, body: body())


def _match_masters(saved: Any, groups: MasterGroups) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if not isinstance(saved, list) or len(saved) != len(groups):
        raise ValueError(
            f"The checkpoint's {MASTERS_KEY!r} holds masters for "
            f"{len(saved) if isinstance(saved, list) else type(saved).__name__} param groups, the "
            f"optimizer has {len(groups)}: load a checkpoint of the same model and optimizer."
        )
    pairs = []
    for gi, (s, g) in enumerate(zip(saved, groups)):
        if len(s) != len(g.masters):
            raise ValueError(
                f"Param group {gi}: the checkpoint holds {len(s)} fp32 masters, the optimizer "
                f"has {len(g.masters)}: load a checkpoint of the same model and optimizer."
            )
        for i, (t, m) in enumerate(zip(s, g.masters)):
            if not isinstance(t, torch.Tensor) or t.shape != m.shape:
                raise ValueError(
                    f"Param group {gi}, master {i}: saved shape "
                    f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}, expected "
                    f"{tuple(m.shape)}."
                )
            pairs.append((t, m))
    return pairs


# ---------------------------------------------------------------------- entry point
def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    if hasattr(optimizer, "_amp_stash"):
        raise RuntimeError("A given optimizer should only be passed through amp.initialize once.")
    for name in AMP_METHODS:
        if hasattr(optimizer, name):
            raise RuntimeError(f"Incoming optimizer already has {name} defined.")


def process_optimizer(optimizer: AmpOptimizer, properties: Any, casts: Any) -> torch.optim.Optimizer:
    """Give ``optimizer`` amp's stash and methods (in place; returns it)."""
    check_optimizer(optimizer)
    master_weights = bool(properties.master_weights)
    optimizer._amp_stash = AmpOptimizerState()

    def lazy_init_maybe_master_weights(self: Any) -> None:
        _lazy_init(self, master_weights)

    def amp_lazy_init(self: Any) -> None:
        if not self._amp_stash.lazy_init_called:
            self._lazy_init_maybe_master_weights()
            self._amp_stash.lazy_init_called = True
        _lazy_init(self, master_weights)  # idempotent (DLE sets lazy_init_called itself)

    def master_params_to_model_params(self: Any) -> None:
        groups = self._amp_stash.master_groups
        if groups is not None:
            groups.masters.masters_to_model()

    optimizer._lazy_init_maybe_master_weights = types.MethodType(lazy_init_maybe_master_weights, optimizer)
    optimizer._amp_lazy_init = types.MethodType(amp_lazy_init, optimizer)
    optimizer._prepare_amp_backward = types.MethodType(_prepare, optimizer)
    optimizer._post_amp_backward = types.MethodType(_post, optimizer)
    optimizer._master_params_to_model_params = types.MethodType(master_params_to_model_params, optimizer)
    optimizer.step = _make_step(optimizer, master_weights, casts)
    optimizer.add_param_group = _make_add_param_group(optimizer, master_weights)
    if master_weights:
        optimizer.zero_grad = _make_zero_grad(optimizer)
    optimizer.state_dict, optimizer.load_state_dict = _make_checkpointing(optimizer, master_weights)
    recovered = getattr(optimizer, "_recovered_from_interrupt", None)  # the class's own, if any, first

    def recovered_from_interrupt(self: Any) -> None:
        if recovered is not None:
            recovered()
        _recovered_from_interrupt(self)

    optimizer._recovered_from_interrupt = types.MethodType(recovered_from_interrupt, optimizer)
    return optimizer
