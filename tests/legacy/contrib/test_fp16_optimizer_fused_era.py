"""The fused-era FP16_Optimizer (apex.optimizers / apex.contrib.optimizers, docs/apex-others.md
§1): the scale sequence against §1.3's pseudo-code through overflow storms (dynamic and static),
skipped steps, BERT-style per-group clipping against §1.4's rule, checkpoints in both master
layouts, the FIXes, and what OpenNMT-py feature-detects."""

from __future__ import annotations

import inspect
import io
import logging
import math
import random

import pytest
import torch

from fp16kit.legacy.contrib.optimizers import FP16_Optimizer, FusedAdam, FusedSGD
from fp16kit.legacy.optimizers import FP16_Optimizer as FP16_Optimizer_apex_optimizers
from fp16kit.legacy.optimizers import FusedAdam as CurrentFusedAdam


class ScaleReference:
    """§1.3's ``_update_scale``, with Python numbers."""

    def __init__(self, dynamic, static=1.0, window=1000):
        self.dynamic = dynamic
        self.cur_scale = 2**16 if dynamic else static
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = 2
        self.scale_window = window

    def update(self, skip):
        if self.dynamic:
            if skip:
                self.cur_scale = max(self.cur_scale / self.scale_factor, 1)
                self.last_overflow_iter = self.cur_iter
            elif (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1


def _bert_groups(dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(4, 3, generator=g).to(dtype).requires_grad_()
    b = torch.randn(3, generator=g).to(dtype).requires_grad_()
    ln = torch.randn(5, generator=g).to(dtype).requires_grad_()
    return [w, b, ln]


def _make(params, dynamic=True, static=1.0, max_grad_norm=1.0, verbose=False):
    w, b, ln = params
    groups = [{"params": [w], "weight_decay": 0.01}, {"params": [b, ln], "weight_decay": 0.0}]
    inner = FusedAdam(groups, lr=1e-2, bias_correction=False, max_grad_norm=max_grad_norm)
    return FP16_Optimizer(inner, dynamic_loss_scale=dynamic, static_loss_scale=static, verbose=verbose)


def _set_grads(params, k, overflow=False, magnitude=1.0):
    g = torch.Generator().manual_seed(1000 + k)
    for i, p in enumerate(params):
        p.grad = (torch.randn(p.shape, generator=g) * magnitude * (1 + i)).to(p.dtype)
    if overflow:
        params[k % len(params)].grad.view(-1)[0] = float("inf")


def _check_scale(opt, ref):
    assert opt.cur_scale == ref.cur_scale
    assert opt.cur_iter == ref.cur_iter
    if ref.dynamic:
        assert opt.last_overflow_iter == ref.last_overflow_iter


@pytest.mark.parametrize("seed", [0, 1])
def test_dynamic_scale_follows_the_pseudo_code_through_overflow_storms(seed):
    rng = random.Random(seed)
    params = _bert_groups()
    opt = _make(params)
    opt.scale_window = 5  # apex's attribute; the rule reads it at each update
    ref = ScaleReference(True, window=5)
    pattern = [True] * 20 + [rng.random() < 0.3 for _ in range(60)] + [False] * 12 + [True, False] * 4
    seen = []
    for k, overflow in enumerate(pattern):
        _set_grads(params, k, overflow)
        opt.step()
        ref.update(overflow)
        _check_scale(opt, ref)
        assert opt.overflow is overflow
        seen.append(opt.cur_scale)
    assert min(seen) == 1 and max(seen[20:]) > 1  # the storm hit the floor, growth resumed


def test_first_doubling_at_iteration_999():
    p = [torch.ones(1, dtype=torch.float16, requires_grad=True)]
    opt = FP16_Optimizer(FusedAdam(p, lr=0.0), dynamic_loss_scale=True)
    ref = ScaleReference(True)
    for k in range(1001):
        p[0].grad = torch.ones(1, dtype=torch.float16)
        opt.step()
        ref.update(False)
        if k in (998, 999, 1000):
            _check_scale(opt, ref)
    assert opt.cur_scale == 2**17 and ref.cur_iter == 1001


def test_static_scale_detects_overflow_skips_and_logs(caplog):
    params = _bert_groups()
    opt = _make(params, dynamic=False, static=128.0, verbose=False)
    ref = ScaleReference(False, static=128.0)
    with caplog.at_level(logging.WARNING, logger="fp16kit"):
        for k, overflow in enumerate([False, True, True, False]):
            before = [p.detach().clone() for p in params]
            _set_grads(params, k, overflow)
            opt.step()
            ref.update(overflow)
            _check_scale(opt, ref)
            assert all(torch.equal(a, p.detach()) for a, p in zip(before, params)) == overflow
    lines = [r.getMessage() for r in caplog.records]
    assert lines.count("\nGrad overflow on iteration 1") == 1
    assert lines.count("Using static loss scale of 128.0") == 2
    with pytest.raises(AttributeError):
        opt.last_overflow_iter


def test_dynamic_overflow_lines_only_when_verbose(caplog):
    for verbose, expected in (
        (True, ["\nGrad overflow on iteration 0", "Using dynamic loss scale of 65536.0"]),
        (False, []),
    ):
        caplog.clear()
        params = _bert_groups()
        opt = _make(params, verbose=verbose)
        with caplog.at_level(logging.INFO, logger="fp16kit"):
            _set_grads(params, 0, overflow=True)
            opt.step()
        assert [r.getMessage() for r in caplog.records] == expected


def test_skipped_step_leaves_params_masters_and_state_alone():
    params = _bert_groups()
    opt = _make(params)
    _set_grads(params, 0)
    opt.step()
    snap = [p.detach().clone() for p in params]
    masters = [m.detach().clone() for g in opt.fp32_groups for m in g]
    state = {k: v.clone() for k, v in opt.state[opt.fp32_groups[0][0]].items() if torch.is_tensor(v)}
    _set_grads(params, 1, overflow=True)
    grads = [p.grad for p in params]
    opt.step()
    assert all(torch.equal(a, p.detach()) for a, p in zip(snap, params))
    assert all(torch.equal(a, m.detach()) for a, m in zip(masters, (m for g in opt.fp32_groups for m in g)))
    for k, v in state.items():
        assert torch.equal(v, opt.state[opt.fp32_groups[0][0]][k])
    assert opt.state[opt.fp32_groups[0][0]]["step"] == 1
    assert all(p.grad is g for p, g in zip(params, grads))  # left in place, as apex


def _reference_bert_step(masters, states, fp16_grads, scale, groups_wd, lr=1e-2, mgn=1.0, b1=0.9, b2=0.999, eps=1e-8):
    """§1.4 per group: norm of the scaled fp16 grads, per-group clip, unscale, BertAdam."""
    for (_gi, idx), wd in zip(enumerate([[0], [1, 2]]), groups_wd):
        norm = math.sqrt(sum(float((fp16_grads[i].double() ** 2).sum()) for i in idx))
        clip = (norm / scale + 1e-6) / mgn
        combined = clip * scale if clip > 1 else scale
        for i in idx:
            g = fp16_grads[i].double() / combined
            m, v = states[i]
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            masters[i] = masters[i] - lr * (m / (v.sqrt() + eps) + wd * masters[i])
            states[i] = (m, v)


def test_bert_style_two_groups_clip_independently():
    params = _bert_groups()
    opt = _make(params, dynamic=False, static=64.0)
    masters = [p.detach().double() for p in params]
    states = [(torch.zeros_like(m), torch.zeros_like(m)) for m in masters]
    for k in range(4):
        # group 0 far above max_grad_norm, group 1 below it
        g = torch.Generator().manual_seed(k)
        grads = [(torch.randn(p.shape, generator=g) * s * 64.0).half() for p, s in zip(params, (5.0, 0.01, 0.01))]
        for p, gr in zip(params, grads):
            p.grad = gr.clone()
        opt.step()
        _reference_bert_step(masters, states, grads, 64.0, (0.01, 0.0))
        flat = [m for grp in opt.fp32_groups for m in grp]
        for m, e, p in zip(flat, masters, params):
            torch.testing.assert_close(m.detach().double(), e, rtol=1e-5, atol=1e-6)
            assert torch.equal(p.detach(), m.detach().half())


def test_fp32_and_bf16_model_params_train_and_are_copied_back():
    w = torch.randn(3, requires_grad=True)  # fp32: apex never copied it back
    h = torch.randn(3).bfloat16().requires_grad_()
    opt = FP16_Optimizer(FusedAdam([w, h], lr=0.1), static_loss_scale=8.0)
    w0, h0 = w.detach().clone(), h.detach().clone()
    opt.backward(w.sum() + h.float().sum())
    assert torch.equal(w.grad, torch.full((3,), 8.0))
    opt.step()
    assert not torch.equal(w.detach(), w0) and not torch.equal(h.detach(), h0)
    assert torch.equal(w.detach(), opt.fp32_groups[0][0].detach())
    assert torch.equal(h.detach(), opt.fp32_groups[0][1].detach().bfloat16())


def test_backward_scales_the_float_loss_and_zero_grad_sets_none():
    p = torch.ones(2, dtype=torch.float16, requires_grad=True)
    opt = FP16_Optimizer(FusedAdam([p]), dynamic_loss_scale=True)
    opt.backward((p * 2).sum())
    assert p.grad.dtype == torch.float16 and torch.equal(p.grad, torch.full((2,), 2.0 * 2**16).half())
    opt.zero_grad()
    assert p.grad is None


def test_param_groups_and_lr_reach_the_inner_optimizer():
    params = _bert_groups()
    opt = _make(params)
    for group in opt.param_groups:
        group["lr"] = 0.0
    before = [p.detach().clone() for p in params]
    _set_grads(params, 0)
    opt.step()
    assert all(torch.equal(a, p.detach()) for a, p in zip(before, params))
    assert opt.param_groups is opt.optimizer.param_groups
    assert opt.param_groups[0]["params"][0] is opt.fp32_groups[0][0]


def test_construction_errors():
    p = [torch.zeros(2, dtype=torch.float16, requires_grad=True)]
    with pytest.raises(SystemError, match="^Do not support dynamic loss scale args for now.$"):
        FP16_Optimizer(FusedAdam(p), dynamic_loss_scale=True, dynamic_loss_args={"init_scale": 4})
    with pytest.raises(TypeError, match="fp16kit.legacy.FP16_Optimizer"):
        FP16_Optimizer(torch.optim.Adam(p))


def test_current_fused_adam_is_driven_with_the_legacy_rule():
    # apex.optimizers.FP16_Optimizer(apex.optimizers.FusedAdam(...)) as in 2018-12..2019-08
    a = [torch.ones(3, dtype=torch.float16, requires_grad=True)]
    b = [torch.ones(3, dtype=torch.float16, requires_grad=True)]
    o1 = FP16_Optimizer_apex_optimizers(CurrentFusedAdam(a, lr=0.1), static_loss_scale=4.0)
    o2 = FP16_Optimizer(FusedAdam(b, lr=0.1), static_loss_scale=4.0)
    for k in range(3):
        _set_grads(a, k)
        _set_grads(b, k)
        o1.step()
        o2.step()
    assert torch.equal(a[0], b[0])
    assert "step" not in o1.param_groups[0]


def test_fused_sgd_inside_the_wrapper():
    p = [torch.ones(3, dtype=torch.float16, requires_grad=True)]
    opt = FP16_Optimizer(FusedSGD(p, lr=0.5, momentum=0.9), static_loss_scale=16.0)
    expected = torch.ones(3, dtype=torch.float64)
    buf = None
    for _ in range(3):
        p[0].grad = torch.full((3,), 32.0, dtype=torch.float16)
        opt.step()
        g = torch.full((3,), 2.0, dtype=torch.float64)
        buf = g if buf is None else 0.9 * buf + g
        expected = expected - 0.5 * buf
    torch.testing.assert_close(opt.fp32_groups[0][0].detach().double(), expected)
    assert torch.equal(p[0].detach(), opt.fp32_groups[0][0].detach().half())


def test_opennmt_feature_detection_sees_the_fused_era_wrapper():
    opt = _make(_bert_groups())
    assert not hasattr(opt, "update_master_grads")
    assert not hasattr(opt, "clip_master_grads")
    assert list(inspect.signature(opt.backward).parameters) == ["loss"]
    assert opt.loss_scale == opt.cur_scale == 2.0**16
    assert opt.scale_factor == 2.0 and opt.scale_window == 1000 and opt.last_overflow_iter == -1


# ------------------------------------------------------------------ checkpoints
def _train(opt, params, ks):
    for k in ks:
        _set_grads(params, k, overflow=(k % 4 == 3))
        opt.step()


def _clone_params(params):
    return [p.detach().clone().requires_grad_() for p in params]


def _assert_same(o1, p1, o2, p2):
    for a, b in zip(p1, p2):
        assert torch.equal(a, b)
    for ga, gb in zip(o1.fp32_groups, o2.fp32_groups):
        for a, b in zip(ga, gb):
            assert torch.equal(a, b)
    assert (o1.cur_scale, o1.cur_iter, o1.last_overflow_iter) == (o2.cur_scale, o2.cur_iter, o2.last_overflow_iter)


def test_state_dict_is_plain_data_and_round_trips_exactly():
    p1 = _bert_groups()
    o1 = _make(p1)
    _train(o1, p1, range(5))
    buf = io.BytesIO()
    torch.save(o1.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    assert set(sd) == {
        "dynamic_loss_scale",
        "cur_scale",
        "cur_iter",
        "last_overflow_iter",
        "scale_factor",
        "scale_window",
        "optimizer_state_dict",
        "fp32_groups",
    }
    p2 = _clone_params(p1)
    o2 = _make(p2, dynamic=False)  # the saved dynamic_loss_scale wins
    o2.load_state_dict(sd)
    assert o2.dynamic_loss_scale
    _train(o1, p1, range(5, 10))
    _train(o2, p2, range(5, 10))
    _assert_same(o1, p1, o2, p2)


@pytest.mark.parametrize("one_param_groups", [False, True])
def test_loads_apex_flat_master_layout(one_param_groups):
    p1 = _bert_groups()
    if one_param_groups:  # each flat state then has its param's numel but not its shape
        groups = [{"params": [p]} for p in p1]
        o1 = FP16_Optimizer(FusedAdam(groups, lr=1e-2, max_grad_norm=1.0), dynamic_loss_scale=True)
    else:
        o1 = _make(p1)
    _train(o1, p1, range(3))
    sd = o1.state_dict()
    # what apex's flat version saved: one flat master per group, the inner state per flat param
    inner = sd["optimizer_state_dict"]
    flat_state, flat_groups, ids = {}, [], iter(range(len(inner["param_groups"])))
    for g in inner["param_groups"]:
        fid = next(ids)
        states = [inner["state"][i] for i in g["params"]]
        flat_state[fid] = {
            "step": states[0]["step"],
            "exp_avg": torch.cat([s["exp_avg"].reshape(-1) for s in states]),
            "exp_avg_sq": torch.cat([s["exp_avg_sq"].reshape(-1) for s in states]),
        }
        flat_groups.append({**g, "params": [fid]})
    apex_sd = {k: v for k, v in sd.items() if k != "fp32_groups"}
    apex_sd["fp32_groups_flat"] = [torch.cat([m.reshape(-1) for m in grp]) for grp in sd["fp32_groups"]]
    apex_sd["optimizer_state_dict"] = {"state": flat_state, "param_groups": flat_groups}
    p2 = _clone_params(p1)
    if one_param_groups:
        o2 = FP16_Optimizer(
            FusedAdam([{"params": [p]} for p in p2], lr=1e-2, max_grad_norm=1.0), dynamic_loss_scale=True
        )
    else:
        o2 = _make(p2)
    o2.load_state_dict(apex_sd)
    assert o2.state[o2.fp32_groups[0][0]]["exp_avg"].shape == (4, 3)
    _train(o1, p1, range(3, 8))
    _train(o2, p2, range(3, 8))
    _assert_same(o1, p1, o2, p2)


@pytest.mark.parametrize("breakage", ["groups", "shape", "flat_size", "no_masters"])
def test_mismatched_checkpoints_are_refused_before_any_change(breakage):
    p1 = _bert_groups()
    o1 = _make(p1)
    _train(o1, p1, range(2))
    sd = o1.state_dict()
    if breakage == "groups":
        sd["fp32_groups"] = sd["fp32_groups"][:1]
    elif breakage == "shape":
        sd["fp32_groups"] = [list(sd["fp32_groups"][0]), [sd["fp32_groups"][1][0], torch.zeros(7)]]
    elif breakage == "flat_size":
        sd["fp32_groups_flat"] = [torch.zeros(12), torch.zeros(9)]
        del sd["fp32_groups"]
    else:
        del sd["fp32_groups"]
    p2 = _bert_groups(seed=1)
    o2 = _make(p2)
    before = [m.detach().clone() for g in o2.fp32_groups for m in g]
    with pytest.raises(ValueError, match="Group 1|param groups|no masters|shape"):
        o2.load_state_dict(sd)
    assert all(torch.equal(a, m) for a, m in zip(before, (m for g in o2.fp32_groups for m in g)))
    assert o2.cur_iter == 0 and not o2.state


def test_pickles_and_keeps_training_like_the_original():
    import pickle

    p1 = _bert_groups()
    o1 = _make(p1)
    _train(o1, p1, range(3))
    o2 = pickle.loads(pickle.dumps(o1))
    p2 = [p for g in o2.fp16_groups for p in g]
    assert o2.optimizer.param_groups[0]["params"][0] is o2.fp32_groups[0][0]
    _train(o1, p1, range(3, 6))
    _train(o2, p2, range(3, 6))
    _assert_same(o1, p1, o2, p2)


def test_lr_scheduler_drives_the_wrapper_and_add_param_group_is_refused():
    params = _bert_groups()
    opt = _make(params)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.5**k)
    for k in range(3):
        _set_grads(params, k)
        opt.step()
        sched.step()
    assert [g["lr"] for g in opt.optimizer.param_groups] == [1e-2 * 0.125] * 2
    with pytest.raises(RuntimeError, match="before wrapping"):
        opt.add_param_group({"params": [torch.zeros(1, requires_grad=True)]})


def test_pytorch_pretrained_bert_training_loop_runs_as_written():
    # examples/run_classifier.py (2019): two groups, FusedAdam(bias_correction=False,
    # max_grad_norm=1.0), dynamic scale, LR written into param_groups, 2-step accumulation
    from fp16kit.legacy.optimizers import FP16_Optimizer as Wrapper
    from fp16kit.legacy.optimizers import FusedAdam as BertFusedAdam

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 2)).half()
    no_decay = ["bias", "LayerNorm.weight", "1.weight"]
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if not any(nd in n for nd in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in named if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = Wrapper(
        BertFusedAdam(groups, lr=5e-2, bias_correction=False, max_grad_norm=1.0), dynamic_loss_scale=True
    )
    x = torch.randn(32, 8).half()
    y = (x[:, 0] > 0).long()
    losses = []
    for step in range(40):
        for xb, yb in ((x[:16], y[:16]), (x[16:], y[16:])):
            loss = torch.nn.functional.cross_entropy(model(xb).float(), yb) / 2
            optimizer.backward(loss)
        for param_group in optimizer.param_groups:
            param_group["lr"] = 5e-2 * (1 - step / 40)
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            losses.append(float(torch.nn.functional.cross_entropy(model(x).float(), y)))
    assert all(p.dtype == torch.float16 for p in model.parameters())
    assert losses[-1] < 0.5 * losses[0]
    assert optimizer.cur_iter == 40


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_takes_torchs_set_to_none(set_to_none):
    model = torch.nn.Linear(4, 4).half()
    opt = FP16_Optimizer(FusedAdam(model.parameters(), lr=1e-3), dynamic_loss_scale=True, verbose=False)
    opt.backward(model(torch.randn(2, 4).half()).float().sum())
    opt.zero_grad(set_to_none=set_to_none)
    for p in model.parameters():
        assert (p.grad is None) if set_to_none else (p.grad is not None and not p.grad.any())
