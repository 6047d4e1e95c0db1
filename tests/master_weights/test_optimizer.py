"""MixedPrecisionOptimizer: torch.amp-style training of fp16/bf16 models with fp32 masters."""

from __future__ import annotations

import copy
import logging
import pickle

import pytest
import torch
from torch import nn

import fp16kit
from _helpers import amp_iteration, batches, mlp
from fp16kit import GradScaler, MixedPrecisionOptimizer

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class Reference:
    """Hand-written fp32-master loop: scale the loss, master grad = float(g) * float32(1/S),
    skip on inf/NaN, step the masters with the same torch optimizer, copy back, torch's rule."""

    def __init__(self, model, opt_cls, scale, growth_interval=2000, **kw):
        self.model = model
        self.masters = [p.detach().clone().float().requires_grad_() for p in model.parameters()]
        self.opt = opt_cls(self.masters, **kw)
        self.scale, self.tracker, self.interval = scale, 0, growth_interval

    def iteration(self, x, y, inject=False):
        for p in self.model.parameters():
            p.grad = None
        loss = (self.model(x).float() - y).pow(2).mean()
        (loss * torch.tensor(self.scale)).backward()
        if inject:
            next(self.model.parameters()).grad.view(-1)[0] = float("inf")
        inv = torch.tensor(1.0 / self.scale, dtype=torch.float64).float()
        for p, m in zip(self.model.parameters(), self.masters):
            m.grad = p.grad.float() * inv
        finite = all(torch.isfinite(m.grad).all() for m in self.masters)
        if finite:
            self.opt.step()
            with torch.no_grad():
                for p, m in zip(self.model.parameters(), self.masters):
                    p.copy_(m)
            self.tracker += 1
            if self.tracker == self.interval:
                self.scale, self.tracker = self.scale * 2, 0
        else:
            self.scale, self.tracker = self.scale * 0.5, 0
        return loss


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "opt_cls, kw",
    [
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
        (torch.optim.Adam, {"lr": 1e-2}),
        (torch.optim.Adam, {"lr": 1e-2, "fused": True}),
        (torch.optim.AdamW, {"lr": 1e-2, "foreach": False}),
    ],
    ids=["sgd", "adam", "adam-fused", "adamw-loop"],
)
@pytest.mark.parametrize("flat", [False, True])
def test_grad_scaler_loop_matches_hand_written_reference(dtype, opt_cls, kw, flat):
    model = mlp(dtype)
    ref = Reference(copy.deepcopy(model), opt_cls, 1024.0, growth_interval=3, **kw)
    opt = MixedPrecisionOptimizer(opt_cls(model.parameters(), **kw), flat=flat)
    scaler = GradScaler("cpu", init_scale=1024.0, growth_interval=3)
    for i, (x, y) in enumerate(batches(8, dtype=dtype)):
        inject = i in (2, 5)
        a = amp_iteration(model, opt, scaler, x, y, inject)
        b = ref.iteration(x, y, inject)
        assert torch.equal(a, b)
        assert scaler.get_scale() == ref.scale
        for p, q in zip(model.parameters(), ref.model.parameters()):
            assert torch.equal(p, q), f"iteration {i}"
        for m, r in zip(opt.master_params, ref.masters):
            assert torch.equal(m, r)
    assert scaler.skipped_steps() == 2


def test_without_a_scaler_steps_at_scale_one_and_refuses_non_finite(caplog):
    model = mlp()
    ref = Reference(copy.deepcopy(model), torch.optim.SGD, 1.0, lr=0.1)
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    for i, (x, y) in enumerate(batches(4)):
        opt.zero_grad()
        loss = (model(x).float() - y).pow(2).mean()
        loss.backward()
        if i == 2:
            model[0].weight.grad[0, 0] = float("nan")
        with caplog.at_level(logging.WARNING, logger="fp16kit"):
            ret = opt.step()
        ref.iteration(x, y, inject=(i == 2))
        assert ret is None
        for p, q in zip(model.parameters(), ref.model.parameters()):
            assert torch.equal(p, q)
    assert sum("non-finite gradients" in r.getMessage() for r in caplog.records) == 1


def test_fused_inner_without_a_scaler_skips_on_the_device():
    model = mlp()
    opt = MixedPrecisionOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2, fused=True))
    x, y = batches(1)[0]
    (model(x).float() - y).pow(2).mean().backward()
    model[2].bias.grad[0] = float("inf")
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert opt._step_supports_amp_scaling


def test_fp32_params_pass_through_and_frozen_params_are_left_alone():
    model = mlp()
    model[2].float()  # the head in fp32
    model[0].bias.requires_grad_(False)  # a frozen fp16 param
    frozen = model[0].bias.detach().clone()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = MixedPrecisionOptimizer(inner)
    (g,) = opt.groups
    assert [p is model[0].weight for p in g.model_params] == [True]
    assert [p is q for p, q in zip(g.direct, [model[2].weight, model[2].bias])] == [True, True]
    assert inner.param_groups[0]["params"][2] is model[2].weight  # optimized in place
    assert inner.param_groups[0]["params"][1] is model[0].bias  # frozen stays in its group
    scaler = GradScaler("cpu", init_scale=256.0)
    w2 = model[2].weight.detach().clone()
    x, y = batches(1)[0]
    opt.zero_grad()
    out = model[2](model[1](model[0](x)).float())  # fp16 body, fp32 head
    scaler.scale((out - y).pow(2).mean()).backward()
    scaler.step(opt)
    scaler.update()
    assert torch.equal(model[0].bias, frozen)
    assert not torch.equal(model[2].weight, w2)


def test_existing_optimizer_state_moves_to_the_masters_and_is_recast():
    model = mlp()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = batches(1)[0]
    (model(x).float() - y).pow(2).mean().backward()
    inner.step()  # fp16 momentum buffers now exist
    opt = MixedPrecisionOptimizer(inner)
    for m in opt.master_params:
        assert inner.state[m]["momentum_buffer"].dtype == torch.float32
    assert all(p not in inner.state for p in model.parameters())


def test_zero_grad_clears_model_and_master_grads():
    model = mlp()
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = batches(1)[0]
    amp_iteration(model, opt, GradScaler("cpu"), x, y)
    assert all(m.grad is not None for m in opt.master_params)
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    assert all(m.grad is None for m in opt.master_params)


def test_lr_scheduler_and_param_groups_reach_the_inner_optimizer():
    model = mlp()
    inner = torch.optim.SGD(model.parameters(), lr=0.4)
    opt = MixedPrecisionOptimizer(inner)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler = GradScaler("cpu")
    for x, y in batches(2):
        amp_iteration(model, opt, scaler, x, y)
        sched.step()
    assert inner.param_groups[0]["lr"] == pytest.approx(0.1)
    assert opt.param_groups is inner.param_groups and opt.state is inner.state


def test_clipping_the_unscaled_master_grads():
    model = mlp()
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = GradScaler("cpu", init_scale=2.0**12)
    x, y = batches(1)[0]
    scaler.scale((model(x).float() - y).pow(2).mean()).backward()
    scaler.unscale_(opt)
    norm = opt.clip_grad_norm_(1e-3)
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(m.grad) for m in opt.master_params]))
    assert total.item() == pytest.approx(1e-3, rel=1e-4) and norm.item() > 1e-3
    scaler.step(opt)
    scaler.update()


@pytest.mark.parametrize("edit", ["mul_", "backward"])
def test_changing_model_grads_after_clip_without_scaler_is_refused(edit):
    # bf16 (no scaler): clip_grad_norm_ reads the grads into the masters and clips them there.
    # Re-reading the model grads at step() would drop the clip silently.
    model = mlp()
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = batches(1)[0]
    (model(x).float() - y).pow(2).mean().backward()
    opt.clip_grad_norm_(1e-3)
    if edit == "mul_":
        next(model.parameters()).grad.mul_(0.5)
    else:
        (model(x).float() - y).pow(2).mean().backward()
    masters = [m.detach().clone() for m in opt.master_params]
    with pytest.raises(RuntimeError, match=r"changed after optimizer.clip_grad_norm_\(\)"):
        opt.step()
    assert all(torch.equal(a, m) for a, m in zip(masters, opt.master_params))


def test_new_backward_after_a_clipped_step_is_read_again():
    # The refusal above is for edits before the step; after it, a new backward (with
    # model.zero_grad() instead of the optimizer's, as the HF Trainer does) is the next step's.
    model, ref = mlp(), mlp()
    ref.load_state_dict(model.state_dict())
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = MixedPrecisionOptimizer(torch.optim.SGD(ref.parameters(), lr=0.1))
    for _step, (x, y) in enumerate(batches(2)):
        for m, o in ((model, opt), (ref, ref_opt)):
            (m(x).float() - y).pow(2).mean().backward()
            o.clip_grad_norm_(1e-3)
            o.step()
            if m is model:
                model.zero_grad()
            else:
                o.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(opt.master_params, ref_opt.master_params))


def test_editing_model_grads_after_unscale_names_the_fix():
    model = mlp()
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = GradScaler("cpu")
    x, y = batches(1)[0]
    scaler.scale((model(x).float() - y).pow(2).mean()).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the torch.amp habit
    with pytest.raises(RuntimeError, match="clip or edit the params in optimizer.param_groups"):
        scaler.step(opt)


def test_a_second_bare_step_reuses_the_unscaled_master_grads():
    model = mlp()
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = GradScaler("cpu", init_scale=2.0**10)
    x, y = batches(1)[0]
    amp_iteration(model, opt, scaler, x, y)
    grads = [m.grad.clone() for m in opt.master_params]
    opt.step()  # as torch: the same (unscaled) grads applied again, not the scaled fp16 ones
    assert all(torch.equal(a, m.grad) for a, m in zip(grads, opt.master_params))


def test_lbfgs_closure_matches_reference():
    model = mlp()
    ref_model = copy.deepcopy(model)
    masters = [p.detach().clone().float().requires_grad_() for p in ref_model.parameters()]
    ref_opt = torch.optim.LBFGS(masters, lr=0.5, max_iter=4)
    opt = MixedPrecisionOptimizer(torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4))
    x, y = batches(1)[0]

    def closure():
        opt.zero_grad()
        loss = (model(x).float() - y).pow(2).mean()
        loss.backward()
        return loss

    def ref_closure():
        with torch.no_grad():
            for p, m in zip(ref_model.parameters(), masters):
                p.copy_(m)
        for p in ref_model.parameters():
            p.grad = None
        loss = (ref_model(x).float() - y).pow(2).mean()
        loss.backward()
        for p, m in zip(ref_model.parameters(), masters):
            m.grad = p.grad.float()
        return loss

    for _ in range(2):
        a = opt.step(closure)
        b = ref_opt.step(ref_closure)
        with torch.no_grad():
            for p, m in zip(ref_model.parameters(), masters):
                p.copy_(m)
        assert torch.equal(a, b)
        for m, r in zip(opt.master_params, masters):
            assert torch.equal(m, r)
        for p, q in zip(model.parameters(), ref_model.parameters()):
            assert torch.equal(p, q)


def test_closure_with_non_finite_grads_raises():
    model = mlp()
    opt = MixedPrecisionOptimizer(torch.optim.LBFGS(model.parameters(), max_iter=2))
    x, _ = batches(1)[0]

    def closure():
        opt.zero_grad()
        loss = model(x).float().sum() * float("inf")
        loss.backward()
        return loss

    with pytest.raises(FloatingPointError, match="closure produced non-finite gradients"):
        opt.step(closure)


@pytest.mark.parametrize("fused", [False, True])
def test_state_dict_resume_is_bitwise(tmp_path, fused):
    data = batches(8)

    def build():
        model = mlp()
        opt = MixedPrecisionOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2, fused=fused))
        return model, opt, GradScaler("cpu", init_scale=512.0, growth_interval=2)

    model, opt, scaler = build()
    for x, y in data[:4]:
        amp_iteration(model, opt, scaler, x, y)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict()}, tmp_path / "c.pt")
    for i, (x, y) in enumerate(data[4:]):
        amp_iteration(model, opt, scaler, x, y, inject=(i == 1))

    ck = torch.load(tmp_path / "c.pt", weights_only=True)
    model2, opt2, scaler2 = build()
    model2.load_state_dict(ck["model"])
    opt2.load_state_dict(ck["opt"])
    scaler2.load_state_dict(ck["scaler"])
    for i, (x, y) in enumerate(data[4:]):
        amp_iteration(model2, opt2, scaler2, x, y, inject=(i == 1))
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
    for m, n in zip(opt.master_params, opt2.master_params):
        assert torch.equal(m, n)
    assert scaler.state_dict() == scaler2.state_dict()


def test_masters_survive_the_fp16_round_trip_exactly():
    model = mlp()
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3))
    scaler = GradScaler("cpu")
    for x, y in batches(3):
        amp_iteration(model, opt, scaler, x, y)
    sd = opt.state_dict()
    assert any(not torch.equal(m, m.half().float()) for m in sd["masters"][0])  # fp32 detail
    opt2 = MixedPrecisionOptimizer(torch.optim.SGD(mlp().parameters(), lr=1e-3))
    opt2.load_state_dict(sd)
    assert all(torch.equal(a, b) for a, b in zip(opt.master_params, opt2.master_params))


def test_load_state_dict_rejects_mismatch_and_changes_nothing():
    model = mlp()
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    x, y = batches(1)[0]
    amp_iteration(model, opt, GradScaler("cpu"), x, y)
    good = opt.state_dict()
    before = [m.detach().clone() for m in opt.master_params]
    other = MixedPrecisionOptimizer(torch.optim.SGD(nn.Linear(8, 2).half().parameters(), lr=0.1))
    with pytest.raises(ValueError, match="Param group 0: the checkpoint has 2 params, this optimizer has 4"):
        opt.load_state_dict(other.state_dict())
    bad = {"optimizer": good["optimizer"], "masters": [[torch.zeros(3)] + good["masters"][0][1:]]}
    with pytest.raises(ValueError, match=r"Param group 0, master 0: the checkpoint has shape \(3,\)"):
        opt.load_state_dict(bad)
    with pytest.raises(ValueError, match="expects the keys"):
        opt.load_state_dict({"optimizer": good["optimizer"]})
    assert all(torch.equal(a, b) for a, b in zip(before, opt.master_params))


def test_add_param_group_gets_masters():
    model = mlp()
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model[0].parameters(), lr=0.1))
    opt.add_param_group({"params": model[2].parameters(), "lr": 0.01})
    assert len(opt.groups) == 2 and len(opt.groups[1].masters) == 2
    assert all(p.dtype == torch.float32 for p in opt.param_groups[1]["params"])
    amp_iteration(model, opt, GradScaler("cpu"), *batches(1)[0])


def test_construction_errors_and_pickling():
    model = mlp()
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TypeError, match="already a MixedPrecisionOptimizer"):
        MixedPrecisionOptimizer(opt)
    with pytest.raises(TypeError, match="wraps a torch.optim.Optimizer"):
        MixedPrecisionOptimizer(list(model.parameters()))
    with pytest.raises(RuntimeError, match="save it with state_dict"):
        pickle.dumps(opt)
    with pytest.raises(RuntimeError, match="save it with state_dict"):
        copy.deepcopy(opt)
    assert isinstance(opt, torch.optim.Optimizer)
    assert "4 masters" in repr(opt)
    assert fp16kit.MixedPrecisionOptimizer is MixedPrecisionOptimizer


def test_step_hooks_run():
    model = mlp()
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    calls = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    amp_iteration(model, opt, GradScaler("cpu"), *batches(1)[0])
    assert calls == ["pre", "post"]


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("flat", [False, True])
def test_cuda_model_with_cpu_masters_matches_on_device_masters(flat):
    data = [(x.cuda(), y.cuda()) for x, y in batches(5)]
    runs = []
    for master_device in (None, "cpu"):
        model = mlp().cuda()
        opt = MixedPrecisionOptimizer(
            torch.optim.Adam(model.parameters(), lr=1e-2), master_device=master_device, flat=flat
        )
        scaler = GradScaler("cuda", init_scale=1024.0)
        for i, (x, y) in enumerate(data):
            amp_iteration(model, opt, scaler, x, y, inject=(i == 2))
        runs.append([p.detach().cpu() for p in model.parameters()])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("with_scaler", [True, False])
def test_fused_inner_with_fp32_params_skips_an_overflow_everywhere(with_scaler):
    # masters and fp32 params both overflow: their flags must combine to exactly 1.0, or the
    # fused kernel applies the step and the weights turn NaN
    model = mlp()
    model[2].float()
    opt = MixedPrecisionOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2, fused=True))
    x, y = batches(1)[0]
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    out = model[2](model[1](model[0](x)).float())
    loss = (out - y).pow(2).mean()
    scaler = GradScaler("cpu", init_scale=256.0) if with_scaler else None
    (scaler.scale(loss) if scaler else loss).backward()
    model[0].weight.grad[0, 0] = float("inf")
    model[2].weight.grad[0, 0] = float("nan")
    if scaler:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    for a, b in zip(before, model.parameters()):
        assert torch.equal(a, b)
    assert all(torch.isfinite(m).all() for m in opt.master_params)


def test_clip_after_unscale_with_fp32_params():
    model = mlp()
    model[2].float()
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = GradScaler("cpu", init_scale=2.0**10)
    x, y = batches(1)[0]
    opt.zero_grad()
    out = model[2](model[1](model[0](x)).float())
    scaler.scale((out - y).pow(2).mean()).backward()
    scaler.unscale_(opt)
    opt.clip_grad_norm_(1e-3)  # clips masters and the fp32 params' grads in place
    w = model[2].weight.detach().clone()
    g = model[2].weight.grad.clone()
    scaler.step(opt)
    scaler.update()
    assert torch.equal(model[2].weight, w - 0.1 * g)


@pytest.mark.parametrize(
    "options",
    [{}, {"flat": True}, {"master_device": "cpu"}, {"async_step": True}],
    ids=["sync", "flat", "offload", "async"],
)
def test_a_scale_underflowed_to_zero_skips_instead_of_writing_nan(options):
    # ~170 overflows in a row take torch's scale rule to 0.0; then inv_scale = inf and the
    # zero grads of a finite step unscale to NaN, which torch's check (before the multiply)
    # does not flag: torch.amp writes NaN into the weights. The master path skips the step.
    model = torch.nn.Linear(4, 3).half()
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **options)
    scaler = GradScaler("cpu")
    x = torch.randn(2, 4).half()
    for _ in range(170):
        scaler.scale(model(x).float().sum() * float("inf")).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert scaler.get_scale() == 0.0
    opt.synchronize()
    before = model.weight.detach().clone()
    scaler.scale(model(x).float().sum()).backward()
    scaler.step(opt)
    scaler.update()
    opt.synchronize()
    assert scaler.last_step_skipped() and torch.equal(model.weight, before)
