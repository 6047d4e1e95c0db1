"""MixedPrecisionOptimizer's one-pass steps (fp16kit.master_weights.fused_step): the torch-op path's numbers."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import fp16kit
from _helpers.interrupt import assert_equal
from fp16kit.core import fused
from fp16kit.master_weights.fused_step import FusedSteps

pytestmark = pytest.mark.skipif(fused.forms() is None, reason="the fused Adam kernel is off on this machine (logged)")


@pytest.fixture
def torch_ops(monkeypatch):
    """Turn the kernel off for the reference run: the torch-op path."""

    def off():
        monkeypatch.setattr(FusedSteps, "check", lambda self, state, found_inf=None: None)

    return off


def _model(dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(37, 129), torch.nn.ReLU(), torch.nn.Linear(129, 5)).to(dtype)


def _batch(i: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(8, 37, generator=torch.Generator().manual_seed(100 + i)).to(dtype)


def _train(
    *,
    dtype: torch.dtype = torch.float16,
    flat: bool = False,
    cls: Any = torch.optim.AdamW,
    groups: bool = False,
    steps: int = 7,
    overflow_at: tuple[int, ...] = (3,),
    each: Any = None,
) -> dict[str, Any]:
    model = _model(dtype)
    params: Any = model.parameters()
    if groups:  # two groups, their own hyperparameters
        first, second = list(model[0].parameters()), list(model[2].parameters())
        params = [{"params": first, "lr": 3e-3, "weight_decay": 0.1}, {"params": second, "betas": (0.3, 0.99)}]
    opt = fp16kit.MixedPrecisionOptimizer(cls(params, lr=1e-2, weight_decay=0.01, fused=True), flat=flat)
    scaler = fp16kit.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    grads_after_step = []
    for i in range(steps):
        opt.zero_grad()
        loss = model(_batch(i, dtype)).float().pow(2).mean()
        scaler.scale(loss * (1e30 if i in overflow_at else 1)).backward()
        scaler.step(opt)
        grads_after_step.append([m.grad is None for m in opt.master_params])
        if each is not None:
            each(i, model, opt, scaler)
        scaler.update()
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "masters": [m.detach().clone() for m in opt.master_params],
        "opt": opt.state_dict(),
        "scaler": scaler.state_dict(),
        "no_master_grads": grads_after_step,
    }


def _compare(torch_ops, **kw):
    mine = _train(**kw)
    torch_ops()
    ref = _train(**kw)
    for key in ("params", "masters", "opt", "scaler"):
        assert_equal(mine[key], ref[key], key)
    return mine, ref


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("flat", [False, True], ids=["per-tensor", "flat"])
@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam], ids=["adamw", "adam"])
def test_the_kernel_steps_bit_for_bit_as_the_torch_op_path(torch_ops, dtype, flat, cls):
    mine, ref = _compare(torch_ops, dtype=dtype, flat=flat, cls=cls)
    # the first step is torch's (it creates the state); from then on the kernel's, which makes no master grads
    assert not any(mine["no_master_grads"][0]) and all(all(s) for s in mine["no_master_grads"][1:])
    assert not any(any(s) for s in ref["no_master_grads"])


def test_param_groups_with_their_own_hyperparameters(torch_ops):
    _compare(torch_ops, groups=True, overflow_at=(2, 3))


def test_a_second_step_without_a_backward_applies_the_same_grads_again(torch_ops):
    made = []

    def again(i, model, opt, scaler):
        if i == 4:
            opt.step()  # torch re-applies the unscaled grads its fused step left in the masters' .grad
            made.append(all(m.grad is not None for m in opt.master_params))

    _compare(torch_ops, each=again)
    assert made == [True, True]  # (made by settle() before the second step; the reference had them)


def test_clipping_after_the_step_sees_the_step_s_unscaled_grads(torch_ops):
    norms = []

    def clip(i, model, opt, scaler):
        norms.append(opt.clip_grad_norm_(1e9))

    _compare(torch_ops, each=clip)
    mine = norms[:7]
    ref = norms[7:]
    assert all(torch.equal(a, b) or (a.isnan() and b.isnan()) for a, b in zip(mine, ref))  # (step 3 overflows)


def test_a_checkpoint_round_trip_mid_run(torch_ops):
    def reload(i, model, opt, scaler):
        if i == 3:
            opt.load_state_dict(opt.state_dict())  # new state tensors: the kernel's plan is rebuilt

    _compare(torch_ops, each=reload)


@pytest.mark.parametrize(
    "setup",
    ["unscale_and_clip", "foreach", "hook", "fp32_param", "async"],
)
def test_what_the_kernel_leaves_to_torch_s_ops(setup):
    model = _model(torch.float16)
    extra = torch.nn.Parameter(torch.zeros(3))  # an fp32 param: stepped as it is, beside the masters
    params = [*model.parameters(), *([extra] if setup == "fp32_param" else [])]
    inner = torch.optim.AdamW(params, lr=1e-2, fused=setup != "foreach")
    opt = fp16kit.MixedPrecisionOptimizer(inner, async_step=setup == "async")
    if setup == "hook":
        inner.register_step_pre_hook(lambda *a: None)
    scaler = fp16kit.GradScaler("cpu", init_scale=2.0**10)
    for i in range(3):
        opt.zero_grad()
        scaler.scale(model(_batch(i, torch.float16)).float().pow(2).mean() + extra.sum()).backward()
        if setup == "unscale_and_clip":
            scaler.unscale_(opt)
            opt.clip_grad_norm_(1.0)
        scaler.step(opt)
        if setup != "async":  # (its job holds the master grads)
            assert all(m.grad is not None for m in opt.master_params), (setup, i)
        scaler.update()
    opt.synchronize()


def test_fp16kit_fused_0_means_torch_s_ops_with_the_same_numbers(tmp_path):
    import subprocess
    import sys

    code = (
        "import torch, fp16kit\n"
        "torch.manual_seed(0)\n"
        "m = torch.nn.Linear(33, 17).half()\n"
        "o = fp16kit.MixedPrecisionOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True))\n"
        "s = fp16kit.GradScaler('cpu', init_scale=1024.)\n"
        "for i in range(4):\n"
        "    o.zero_grad(); s.scale(m(torch.randn(4, 33, generator=torch.Generator().manual_seed(i)).half()).float().sum()).backward()\n"
        "    s.step(o); s.update()\n"
        "print(all(x.grad is None for x in o.master_params), m.weight.float().sum().item())\n"
    )
    outs = [
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env={**__import__("os").environ, **env},
            check=True,
        ).stdout.split()
        for env in ({}, {"FP16KIT_FUSED": "0"})
    ]
    assert outs[0][0] == "True" and outs[1][0] == "False"  # the kernel ran, then it did not
    assert outs[0][1] == outs[1][1]


def _train_without_a_scaler(dtype: torch.dtype, nan_at: int) -> dict[str, Any]:
    model = _model(dtype)
    opt = fp16kit.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True))
    no_grads = []
    for i in range(6):
        opt.zero_grad()
        loss = model(_batch(i, dtype)).float().pow(2).mean()
        (loss * float("nan") if i == nan_at else loss).backward()
        assert opt.step() is None
        no_grads.append(all(m.grad is None for m in opt.master_params))
    return {"params": list(model.parameters()), "masters": opt.master_params, "opt": opt.state_dict(), "no": no_grads}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_without_a_scaler_step_checks_and_steps_in_the_kernel(torch_ops, dtype):
    # bf16 models train without a loss scale: opt.step() checks the grads (a NaN step is skipped) and steps
    mine = _train_without_a_scaler(dtype, nan_at=3)
    torch_ops()
    ref = _train_without_a_scaler(dtype, nan_at=3)
    for key in ("params", "masters", "opt"):
        assert_equal(mine[key], ref[key], key)
    assert mine["no"] == [False, True, True, True, True, True] and not any(ref["no"])


# ---------------------------------------------------------------------- found by an adversarial pass
def _then(i_at: int, action):
    """An ``each`` hook: at iteration ``i_at``, after the step, run ``action(model, opt, scaler)``."""

    def each(i, model, opt, scaler):
        if i == i_at:
            action(model, opt, scaler)

    return each


def _loss(model, i=0):
    return model(_batch(i, next(model.parameters()).dtype)).float().pow(2).mean()


@pytest.mark.parametrize("swap", ["float_and_back", "share_memory", "clone_data"])
def test_a_param_whose_storage_was_swapped_is_stepped_where_it_is_now(torch_ops, swap):
    # model.float(); model.half() (an fp32 evaluation), share_memory(), p.data = p.data.clone(): the kernel's
    # addresses are stale -- it must take the new ones, never write the freed memory
    def do(model, opt, scaler):
        if swap == "float_and_back":
            model.float()
            model.half()
        elif swap == "share_memory":
            model.share_memory()
        else:
            for p in model.parameters():
                p.data = p.data.clone()

    _compare(torch_ops, each=_then(3, do), overflow_at=())


def test_state_tensors_whose_storage_was_swapped(torch_ops):
    def do(model, opt, scaler):
        for st in opt.optimizer.state.values():
            st["exp_avg"].data = st["exp_avg"].data.clone()
        for m in opt.master_params:
            m.data = m.data.clone()

    _compare(torch_ops, each=_then(3, do), overflow_at=())


def test_a_cleared_optimizer_state_starts_over(torch_ops):
    _compare(torch_ops, each=_then(3, lambda model, opt, scaler: opt.optimizer.state.clear()), overflow_at=())


@pytest.mark.parametrize(
    "after",
    ["scaler_step_again", "unscale_clip_step_again", "backward_without_zero_grad", "grads_edited", "inner_step"],
)
def test_what_follows_a_kernel_step_sees_the_grads_the_torch_op_path_leaves(torch_ops, after):
    norms = []

    def do(model, opt, scaler):
        scaler.update()  # (each hook runs before the loop's update: open the next scaler iteration)
        if after == "scaler_step_again":  # no new backward: the same grads again
            scaler.step(opt)
        elif after == "unscale_clip_step_again":
            scaler.unscale_(opt)
            norms.append(opt.clip_grad_norm_(1e9))
            scaler.step(opt)
        elif after == "backward_without_zero_grad":  # accumulates onto the stepped grads
            scaler.scale(_loss(model)).backward()
            scaler.step(opt)
        elif after == "grads_edited":
            for p in model.parameters():
                p.grad.mul_(0.5)
            norms.append(opt.clip_grad_norm_(1e9))
            scaler.step(opt)
        else:
            opt.inner_step()
            scaler.scale(_loss(model)).backward()  # (the loop's update needs a scaled iteration)
            scaler.step(opt)

    _compare(torch_ops, each=_then(4, do), overflow_at=())
    if norms:
        assert len(norms) == 2 and torch.equal(norms[0], norms[1])


@pytest.mark.parametrize("swap", ["float", "bfloat16", "small"])
def test_a_grad_whose_data_was_swapped_goes_to_torch_s_ops(torch_ops, swap):
    # g.data = ... gets past the grad setter's checks: another dtype or size must not be read as fp16
    def run() -> list[torch.Tensor]:
        model = _model(torch.float16)
        opt = fp16kit.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True))
        scaler = fp16kit.GradScaler("cpu", init_scale=2.0**10)
        for i in range(3):
            opt.zero_grad()
            scaler.scale(_loss(model, i)).backward()
            g = model[0].weight.grad
            if i == 2:
                g.data = {"float": g.data.float(), "bfloat16": g.data.bfloat16(), "small": g.data[:1, :1].clone()}[swap]
            scaler.step(opt)
            scaler.update()
        return [*model.parameters(), *opt.master_params]

    mine = run()
    torch_ops()
    ref = run()
    assert_equal(mine, ref, swap)


# ---------------------------------------------------------------------- from the master grads (apex's faces)
@pytest.fixture
def counted(monkeypatch):
    """How many steps from_master_grads took; ``off()`` turns it off (the reference: torch's step + the copy)."""
    taken = []
    original = FusedSteps.from_master_grads

    def spy(self, *args, **kwargs):
        took = original(self, *args, **kwargs)
        taken.append(took)
        return took

    monkeypatch.setattr(FusedSteps, "from_master_grads", spy)

    def off():
        monkeypatch.setattr(FusedSteps, "from_master_grads", lambda self, *a, **k: False)

    return taken, off


def _fp16_optimizer_run(dtype, steps=6):
    from fp16kit.legacy import FP16_Optimizer

    model = _model(dtype)
    opt = FP16_Optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05, fused=True),
                         dynamic_loss_scale=True, verbose=False)  # fmt: skip
    for i in range(steps):
        opt.zero_grad(set_grads_to_None=i % 2 == 0)
        opt.backward(model(_batch(i, dtype)).float().pow(2).mean() * (1e30 if i == 3 else 1))
        opt.clip_master_grads(0.5)
        opt.step()
    return {"params": [p.detach().clone() for p in model.parameters()], "opt": opt.state_dict()}


def _amp_o2_run(steps=6):
    from fp16kit.legacy import amp

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(37, 129), torch.nn.BatchNorm1d(129), torch.nn.Linear(129, 5))
    first, rest = list(model[0].parameters()), [*model[1].parameters(), *model[2].parameters()]
    opt = torch.optim.Adam([{"params": first}, {"params": rest, "lr": 3e-3, "weight_decay": 0.1}], lr=1e-2, fused=True)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)  # the batch norm stays fp32
    for i in range(steps):
        opt.zero_grad()
        loss = model(_batch(i, torch.float16)).float().pow(2).mean() * (1e30 if i == 3 else 1)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        torch.nn.utils.clip_grad_norm_(amp.master_params(opt), 0.5)
        opt.step()
    return {"params": [p.detach().clone() for p in model.parameters()], "opt": opt.state_dict()}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_fp16_optimizer_steps_from_its_master_grads_bit_for_bit(counted, dtype):
    taken, off = counted
    mine = _fp16_optimizer_run(dtype)
    assert taken.count(True) >= 3  # (the first step is torch's: it makes the state; the overflow skips)
    off()
    assert_equal(mine, _fp16_optimizer_run(dtype), "FP16_Optimizer")


def test_amp_o2_with_fp32_batch_norms_steps_from_its_master_grads_bit_for_bit(counted):
    taken, off = counted
    mine = _amp_o2_run()
    assert taken.count(True) >= 3
    off()
    assert_equal(mine, _amp_o2_run(), "amp O2")


def test_options_changed_after_the_plan_was_built_mean_torch_s_ops(counted):
    taken, _ = counted
    from fp16kit.legacy import FP16_Optimizer

    model = _model(torch.float16)
    opt = FP16_Optimizer(torch.optim.AdamW(model.parameters(), fused=True), verbose=False)
    for i in range(4):
        if i == 2:
            opt.optimizer.param_groups[0]["amsgrad"] = True
            for s in opt.optimizer.state.values():
                s["max_exp_avg_sq"] = torch.zeros_like(s["exp_avg_sq"])
        opt.zero_grad()
        opt.backward(model(_batch(i, torch.float16)).float().pow(2).mean())
        opt.step()
    assert taken == [False, True, False, False]
