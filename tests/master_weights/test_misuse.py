"""A newcomer's first mistakes with MixedPrecisionOptimizer: each is refused, or warned once,
with the fix named, where torch's own tools would fail opaquely or go on silently.

* torch's GradScaler driving it (fp16kit.master_weights.misuse): TypeError at its first call;
* torch.nn.utils.clip_grad_norm_(model.parameters()) after an asynchronous step's hand-off:
  one warning (it returns 0);
* param groups: a param in two groups refused (torch's rule), a param listed twice in a group
  kept once (warned), and an optimizer with nothing to master (warned).
"""

from __future__ import annotations

import logging
import math
import threading
import warnings

import pytest
import torch
from torch import nn

from _helpers import batches, mlp, mse
from fp16kit import GradScaler, MixedPrecisionOptimizer

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# Bound at import, before this process may have run an asynchronous step (the way apex's
# fp16_utils aliased clip_grad_norm_): see test_the_watch_leaves_torchs_functions...
_TORCH_CLIP = torch.nn.utils.clip_grad_norm_
_TORCH_NORM = torch.nn.utils.get_total_norm


def _warnings(caplog, text):
    return [r for r in caplog.records if r.name == "fp16kit" and text in r.getMessage()]


def _clip_iteration(model, opt, scaler, x, y, *, max_norm=1.0):
    """torch.amp's clipping loop: backward, unscale_, clip model.parameters(), step, update."""
    opt.zero_grad()
    scaler.scale(mse(model, x, y)).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(opt)
    scaler.update()


# ---------------------------------------------------------------- torch's GradScaler (item 7)
def _torch_scaler(kind):
    if kind == "torch.amp":
        return torch.amp.GradScaler("cpu", init_scale=2.0**10)
    if kind == "torch.cpu.amp":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # deprecated by torch, still used
            return torch.cpu.amp.GradScaler(init_scale=2.0**10)

    class LoggingScaler(torch.amp.GradScaler):  # a user's subclass, as in training frameworks
        steps = 0

        def step(self, optimizer, *args, **kwargs):
            LoggingScaler.steps += 1
            return super().step(optimizer, *args, **kwargs)

    return LoggingScaler("cpu", init_scale=2.0**10)


@pytest.mark.parametrize("kind", ["torch.amp", "torch.cpu.amp", "subclass"])
def test_torch_scaler_with_clipping_is_refused_at_unscale_and_fp16kit_scaler_then_trains(kind):
    model = mlp(torch.float16)
    opt = MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    scaler = _torch_scaler(kind)
    (x, y), *rest = batches(3)
    with pytest.raises(TypeError, match=r"fp16kit\.GradScaler\('cpu'\)") as e:
        _clip_iteration(model, opt, scaler, x, y)
    assert "scaler.unscale_(optimizer) was called with torch's GradScaler" in str(e.value)
    assert "optimizer.clip_grad_norm_(max_norm)" in str(e.value)
    # Nothing changed: the masters still equal the model, the model grads are the scaled ones.
    assert all(torch.equal(m.half(), p) for m, p in zip(opt.master_params, model.parameters()))
    assert all(m.grad is None for m in opt.master_params)
    # The named fix, with the torch scaler's state carried over, trains like a fresh fp16kit loop.
    fixed = GradScaler("cpu")
    fixed.load_state_dict(scaler.state_dict())
    reference = mlp(torch.float16)
    ref_opt = MixedPrecisionOptimizer(torch.optim.AdamW(reference.parameters(), lr=1e-3))
    ref_scaler = GradScaler("cpu", init_scale=2.0**10)
    for xb, yb in [(x, y), *rest]:
        for m, o, s in ((model, opt, fixed), (reference, ref_opt, ref_scaler)):
            o.zero_grad()
            s.scale(mse(m, xb, yb)).backward()
            s.unscale_(o)
            o.clip_grad_norm_(1.0)
            s.step(o)
            s.update()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))


@pytest.mark.parametrize("fused", [False, True])
def test_torch_scaler_without_unscale_is_refused_at_step(fused):
    # No unscale_: torch's step reads _step_supports_amp_scaling first (fused inner optimizers
    # take torch's other path from there); both end in the same error, before anything steps.
    model = mlp(torch.float16)
    opt = MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused))
    scaler = _torch_scaler("subclass")
    before = [p.clone() for p in model.parameters()]
    x, y = batches(1)[0]
    opt.zero_grad()
    scaler.scale(mse(model, x, y)).backward()
    with pytest.raises(TypeError, match=r"scaler\.step\(optimizer\) was called with torch's GradScaler"):
        scaler.step(opt)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(m.grad is None for m in opt.master_params)


def test_torch_scaler_on_a_model_with_fp32_params_is_refused_before_it_steps_scaled_grads():
    # fp16 body, fp32 head: torch's scaler unscaled the head's grads, recorded their check and
    # stepped the masters with their grads still multiplied by the scale -- silently.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16).half(), nn.Tanh(), nn.Linear(16, 4).half())
    head = nn.Linear(4, 4)
    opt = MixedPrecisionOptimizer(torch.optim.SGD([*model.parameters(), *head.parameters()], lr=0.1))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    before = [p.clone() for p in (*model.parameters(), *head.parameters())]
    x, y = batches(1)[0]
    opt.zero_grad()
    scaler.scale((head(model(x).float()) - y).pow(2).mean()).backward()
    with pytest.raises(TypeError, match="fp16kit.GradScaler"):
        scaler.step(opt)
    assert all(torch.equal(a, b) for a, b in zip(before, (*model.parameters(), *head.parameters())))


def test_torch_scaler_on_a_bf16_model_names_dropping_the_scaler_too():
    model = mlp(torch.bfloat16)
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = torch.amp.GradScaler("cpu")
    x, y = batches(1, torch.bfloat16)[0]
    scaler.scale(mse(model, x, y)).backward()
    with pytest.raises(TypeError, match=r"needs no loss scaling: you may also drop the scaler"):
        scaler.step(opt)


def test_a_disabled_torch_scaler_passes_through_like_no_scaler():
    # GradScaler(enabled=False) -- a loop that switches amp off by a flag -- only calls step().
    trained = []
    for scaler in (torch.amp.GradScaler("cpu", enabled=False), None):
        model = mlp(torch.bfloat16)
        opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        for x, y in batches(3, torch.bfloat16):
            opt.zero_grad()
            loss = mse(model, x, y)
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                scaler.step(opt)
                scaler.update()
        trained.append([p.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*trained))


def test_other_readers_of_the_optimizer_are_left_alone():
    # LR schedulers read param_groups; fp16kit's own GradScaler subclasses torch's.
    model = mlp(torch.float16)
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler = GradScaler("cpu")
    for x, y in batches(2):
        opt.zero_grad()
        scaler.scale(mse(model, x, y)).backward()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.025)
    assert scaler.get_scale() == 2.0**16


def test_the_torch_scalers_of_every_device_run_the_functions_checked():
    # torch.cuda.amp's scaler disables itself without CUDA: on CPU, check that it runs the code
    # the optimizer recognises (the CUDA test below drives it).
    for cls in (torch.cuda.amp.GradScaler, torch.cpu.amp.GradScaler):
        assert cls._unscale_grads_.__code__ is torch.amp.GradScaler._unscale_grads_.__code__
        assert cls.step.__code__ is torch.amp.GradScaler.step.__code__


@cuda
def test_torch_cuda_scaler_is_refused_on_cuda():
    model = mlp(torch.float16).cuda()
    opt = MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        scaler = torch.cuda.amp.GradScaler()
    x, y = (t.cuda() for t in batches(1)[0])
    with pytest.raises(TypeError, match=r"fp16kit\.GradScaler\('cuda'\)"):
        _clip_iteration(model, opt, scaler, x, y)


# ------------------------------------------------- clip_grad_norm_ after a hand-off (item 8)
def _async_loop(model, opt, scaler, data, *, clip):
    """An asynchronous training loop with a grad-norm logger; ``clip(model, opt)`` runs where
    the loop's author put it and returns the norm logged."""
    norms = []
    for x, y in data:
        opt.zero_grad()
        if scaler is None:  # bf16: no loss scale
            mse(model, x, y).backward()
            norm = clip.before_step(model, opt, scaler)
            opt.step()
        else:
            scaler.scale(mse(model, x, y)).backward()
            norm = clip.before_step(model, opt, scaler)
            scaler.step(opt)
            scaler.update()
        norm = clip.after_step(model, opt) if norm is None else norm
        norms.append(float(norm))
    opt.synchronize()
    return norms


class _LogAfterStep:
    """The logger placed after the step, on the model's params (the mistake)."""

    def before_step(self, model, opt, scaler):
        return None

    def after_step(self, model, opt):
        return torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf)


class _ClipWithOptimizer:
    """The named fix: unscale_, then optimizer.clip_grad_norm_ (it returns the norm)."""

    def before_step(self, model, opt, scaler):
        if scaler is not None:
            scaler.unscale_(opt)
        return opt.clip_grad_norm_(math.inf)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_grad_norm_logged_after_an_async_step_warns_once_naming_the_fix(dtype, caplog):
    model = mlp(dtype)
    opt = MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), async_step=True)
    scaler = GradScaler("cpu") if dtype == torch.float16 else None
    with caplog.at_level(logging.WARNING, logger="fp16kit"):
        norms = _async_loop(model, opt, scaler, batches(4, dtype), clip=_LogAfterStep())
    assert norms == [0.0] * 4  # torch's result is left as it is: the warning explains it
    (record,) = _warnings(caplog, "torch.nn.utils.clip_grad_norm_ was called")
    assert "clipped nothing and returned 0" in record.getMessage()
    assert "optimizer.clip_grad_norm_(max_norm)" in record.getMessage()


def test_the_fix_logs_the_norm_of_the_grads_the_step_uses(caplog):
    # optimizer.clip_grad_norm_ in the asynchronous loop: the unscaled norm, and no warning.
    # The first step's grads are those of the synchronous loop's first step (same weights).
    runs = []
    for async_step in (True, False):
        model = mlp(torch.float16)
        opt = MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), async_step=async_step)
        with caplog.at_level(logging.WARNING, logger="fp16kit"):
            runs.append(_async_loop(model, opt, GradScaler("cpu"), batches(3), clip=_ClipWithOptimizer()))
    assert all(n > 0 for n in runs[0]) and runs[0][0] == runs[1][0]
    assert not _warnings(caplog, "clip_grad_norm_")


def test_clipping_the_model_params_where_they_hold_grads_does_not_warn(caplog):
    # Before the step (no unscale_: torch's clip of the scaled grads, as torch.amp does), after
    # zero_grad (None in torch too), a model this optimizer does not step, a synchronous step.
    model = mlp(torch.float16)
    other = mlp(torch.float16, seed=1)
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), async_step=True)
    sync_model = mlp(torch.float16)
    sync_opt = MixedPrecisionOptimizer(torch.optim.SGD(sync_model.parameters(), lr=0.1))
    scaler, sync_scaler = GradScaler("cpu"), GradScaler("cpu")
    with caplog.at_level(logging.WARNING, logger="fp16kit"):
        for x, y in batches(3):
            opt.zero_grad()
            scaler.scale(mse(model, x, y)).backward()
            assert torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf) > 0
            scaler.step(opt)
            scaler.update()
            torch.nn.utils.clip_grad_norm_(other.parameters(), 1.0)
            opt.zero_grad()
            assert torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0) == 0
            sync_opt.zero_grad()
            sync_scaler.scale(mse(sync_model, x, y)).backward()
            sync_scaler.step(sync_opt)
            sync_scaler.update()
            torch.nn.utils.clip_grad_norm_(sync_model.parameters(), math.inf)
    opt.synchronize()
    assert not _warnings(caplog, "clip_grad_norm_")


def test_clip_of_the_model_params_inside_a_submitted_step_warns(caplog):
    # submit_step (mode 2): the function runs on the optimizer thread, after the hand-off.
    model = mlp(torch.float16)
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = GradScaler("cpu")
    norms = []

    def step():
        scaler.unscale_(opt)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        scaler.step(opt)
        opt.zero_grad()

    with caplog.at_level(logging.WARNING, logger="fp16kit"):
        for x, y in batches(2):
            scaler.scale(mse(model, x, y)).backward()
            opt.submit_step(step, scaler=scaler)
            scaler.update()
        opt.synchronize()
    # The job's clip reads model grads the main thread owns: none (0), or -- racing the next
    # iteration's backward on the main thread -- that backward's; never this step's. The last
    # job has no backward after it.
    assert norms[-1] == 0.0
    (record,) = _warnings(caplog, "inside a step job")
    assert "optimizer.clip_grad_norm_(max_norm) after scaler.unscale_(optimizer)" in record.getMessage()


def test_clip_inside_a_job_that_finds_the_next_backwards_grads_warns_too(caplog):
    # The job runs after the main thread's next backward: its clip finds grads (that backward's,
    # which it rescales under the main thread) -- the in-job check must not depend on finding none.
    model = mlp(torch.float16)
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = GradScaler("cpu")
    ready = threading.Event()
    norms = []

    def step():
        assert ready.wait(30)
        scaler.unscale_(opt)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        scaler.step(opt)

    (x, y), (x2, y2) = batches(2)
    with caplog.at_level(logging.WARNING, logger="fp16kit"):
        scaler.scale(mse(model, x, y)).backward()
        opt.submit_step(step, scaler=scaler)
        scaler.update()
        mse(model, x2, y2).backward()  # the next iteration's backward, before the job clips
        ready.set()
        opt.synchronize()
    assert norms[0] > 0  # it found the main thread's grads
    (record,) = _warnings(caplog, "inside a step job")
    assert "optimizer.clip_grad_norm_(max_norm)" in record.getMessage()


def test_the_watch_leaves_torchs_functions_and_numbers_and_sees_earlier_aliases(caplog):
    # Installed by the first hand-off into the helper torch's clip_grad_norm_ calls: the public
    # functions stay torch's objects (an alias made before, as apex's fp16_utils.clip_grad_norm,
    # is watched too), and the norms and clipped grads are torch's.
    model = mlp(torch.float16)
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), async_step=True)
    scaler = GradScaler("cpu")
    x, y = batches(1)[0]
    scaler.scale(mse(model, x, y)).backward()
    scaler.step(opt)
    assert torch.nn.utils.clip_grad_norm_ is _TORCH_CLIP and torch.nn.utils.get_total_norm is _TORCH_NORM
    with caplog.at_level(logging.WARNING, logger="fp16kit"):
        assert _TORCH_CLIP(model.parameters(), 1.0) == 0
    assert _warnings(caplog, "clipped nothing and returned 0")
    opt.synchronize()
    grads = [torch.randn(5, 3) for _ in range(3)]
    params, reference = ([nn.Parameter(torch.zeros(5, 3)) for _ in range(3)] for _ in range(2))
    for p, r, g in zip(params, reference, grads):
        p.grad, r.grad = g.clone(), g.clone()
    norm = torch.nn.utils.clip_grad_norm_(params, 0.5, norm_type=1.0)
    expected = _TORCH_NORM(grads, 1.0)
    torch.nn.utils.clip_grads_with_norm_(reference, 0.5, expected)
    assert torch.equal(norm, expected) and all(torch.equal(p.grad, r.grad) for p, r in zip(params, reference))
    assert not torch.equal(params[0].grad, grads[0])  # (clipped)
    with pytest.warns(UserWarning, match="empty generator"):
        torch.nn.utils.clip_grad_norm_((p for p in ()), 1.0)


def test_a_third_partys_wrap_of_the_watch_is_not_wrapped_again(caplog, monkeypatch):
    # A tracer that wraps torch's helper with functools.wraps after the watch is installed links
    # to ours; the next first hand-off (all earlier optimizers gone) must not stack a second check.
    import functools
    import gc

    from fp16kit.master_weights import misuse as optimizer_misuse

    module = torch.nn.utils.clip_grad
    model = mlp(torch.float16)
    first = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), async_step=True)
    x, y = batches(1)[0]
    mse(model, x, y).backward()
    first.step()  # the first hand-off installs the watch
    first.synchronize()
    ours = module._get_total_norm
    assert optimizer_misuse._wraps_ours(ours)
    calls = []

    @functools.wraps(ours)
    def traced(*args, **kwargs):
        calls.append(1)
        return ours(*args, **kwargs)

    monkeypatch.setattr(module, "_get_total_norm", traced)
    del first
    gc.collect()
    model = mlp(torch.float16)
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), async_step=True)
    scaler = GradScaler("cpu")
    scaler.scale(mse(model, x, y)).backward()
    scaler.step(opt)
    assert module._get_total_norm is traced and optimizer_misuse._wraps_ours(traced)
    with caplog.at_level(logging.WARNING, logger="fp16kit"):
        assert torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0) == 0
    assert len(_warnings(caplog, "clipped nothing and returned 0")) == 1 and calls == [1]
    opt.synchronize()


# ------------------------------------------------------------------ param groups (item 9)
def test_a_param_in_two_groups_is_refused_with_torchs_error_and_nothing_changes():
    # torch refuses it when the optimizer is built; groups edited by hand afterwards reach here.
    model = mlp(torch.float16)
    inner = torch.optim.SGD([{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.01}], lr=0.1)
    inner.param_groups[1]["params"].append(model[0].weight)  # e.g. a tied weight added by hand
    with pytest.raises(
        ValueError, match=r"some parameters appear in more than one parameter group: param groups 0 and 1"
    ):
        MixedPrecisionOptimizer(inner)
    assert all(p.dtype == torch.float16 for g in inner.param_groups for p in g["params"])  # no masters
    inner.param_groups[1]["params"].pop()
    assert len(MixedPrecisionOptimizer(inner).master_params) == 4  # the fixed groups wrap


def test_a_param_listed_twice_gets_one_master_and_trains_as_listed_once(caplog):
    # A tied/shared param appended to model.parameters() by hand: torch warns and would step it
    # twice; two masters of it (one stepped, one not, both copied back) gave other numbers.
    trained = []
    for listed_twice in (True, False):
        model = mlp(torch.float16)
        params = [*model.parameters(), model[2].weight] if listed_twice else list(model.parameters())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch's own duplicate warning
            inner = torch.optim.SGD(params, lr=0.1, momentum=0.9)
        with caplog.at_level(logging.WARNING, logger="fp16kit"):
            opt = MixedPrecisionOptimizer(inner)
        assert len(opt.master_params) == 4 and len(opt.param_groups[0]["params"]) == 4
        scaler = GradScaler("cpu")
        for x, y in batches(3):
            opt.zero_grad()
            scaler.scale(mse(model, x, y)).backward()
            scaler.step(opt)
            scaler.update()
        trained.append([p.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*trained))
    (record,) = _warnings(caplog, "a second time")
    assert "param group 0 lists 1 param(s) a second time (at positions [4])" in record.getMessage()
    assert "List each param once" in record.getMessage()


def test_add_param_group_keeps_a_repeated_param_once_and_refuses_one_already_present(caplog):
    model = mlp(torch.float16)
    frozen = nn.Parameter(torch.zeros(3, dtype=torch.float16), requires_grad=False)
    fp32 = nn.Parameter(torch.zeros(3))
    opt = MixedPrecisionOptimizer(torch.optim.SGD([*model[0].parameters(), frozen, fp32], lr=0.1))
    # Already present, in each role (mastered, watched while frozen, stepped directly).
    for present in (model[0].weight, frozen, fp32):
        with pytest.raises(ValueError, match="more than one parameter group"):
            opt.add_param_group({"params": [*model[2].parameters(), present]})
        assert len(opt.param_groups) == 1 and len(opt.master_params) == 2
    head = list(model[2].parameters())
    with caplog.at_level(logging.WARNING, logger="fp16kit"):
        opt.add_param_group({"params": [*head, head[0]], "lr": 0.01})
    assert _warnings(caplog, "the new param group lists 1 param(s) a second time")
    assert len(opt.param_groups[1]["params"]) == 2 and len(opt.master_params) == 4


def test_an_optimizer_with_nothing_to_master_warns(caplog):
    # The newcomer's order: wrap, then convert -- the params are float32 when wrapped.
    model = mlp(torch.float32)
    with caplog.at_level(logging.WARNING, logger="fp16kit"):
        opt = MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
        model.half()
    (record,) = _warnings(caplog, "none of the optimizer's params is float16 or bfloat16")
    assert "convert it first" in record.getMessage() and "torch.amp.GradScaler" in record.getMessage()
    assert opt.master_params == []


def test_nothing_to_master_does_not_warn_where_the_optimizer_adds_masters(caplog):
    # Asynchronous steps and offloaded masters give fp32 params masters; a frozen fp16 param
    # gets one when it is unfrozen; a model with any fp16 param has them.
    with caplog.at_level(logging.WARNING, logger="fp16kit"):
        MixedPrecisionOptimizer(torch.optim.SGD(mlp(torch.float32).parameters(), lr=0.1), async_step=True)
        MixedPrecisionOptimizer(torch.optim.SGD(mlp(torch.float32).parameters(), lr=0.1), master_device="cpu")
        later = mlp(torch.float16).requires_grad_(False)
        MixedPrecisionOptimizer(torch.optim.SGD(later.parameters(), lr=0.1))
        mixed = nn.Sequential(nn.Linear(4, 4).half(), nn.Linear(4, 4))
        MixedPrecisionOptimizer(torch.optim.SGD(mixed.parameters(), lr=0.1))
    assert not _warnings(caplog, "none of the optimizer's params")


def test_fp16_optimizer_keeps_apexs_groups(caplog):
    # The legacy face builds its MixedPrecisionOptimizer with apex_groups=True: apex's
    # FP16_Optimizer made a master per listing of a repeated param (its checkpoints hold them
    # all) and said nothing about an fp32 model.
    from fp16kit.legacy import FP16_Optimizer

    model = mlp(torch.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's own duplicate warning
        inner = torch.optim.SGD([*model.parameters(), model[2].weight], lr=0.1)
    with caplog.at_level(logging.WARNING, logger="fp16kit"):
        opt = FP16_Optimizer(inner, verbose=False)
        FP16_Optimizer(torch.optim.SGD(mlp(torch.float32).parameters(), lr=0.1), verbose=False)
    assert [len(g) for g in opt.fp32_from_fp16_groups] == [5]
    assert not _warnings(caplog, "a second time") and not _warnings(caplog, "none of the optimizer's params")
