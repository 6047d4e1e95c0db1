"""The fused-era FP16_Optimizer refuses what its optimizers cannot take with a message that says
what to do, before anything changes (house rule 7)."""

from __future__ import annotations

import pytest
import torch

from fp16kit.legacy.contrib.optimizers import FP16_Optimizer, FusedSGD
from fp16kit.legacy.optimizers import FusedAdam


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: FusedAdam(ps, lr=1e-3, bias_correction=False, max_grad_norm=1.0),
        lambda ps: FusedSGD(ps, lr=1e-3, momentum=0.9),
    ],
)
def test_a_sparse_embedding_grad_is_refused_by_name_before_any_change(make):
    emb = torch.nn.Embedding(5, 2, sparse=True).half()
    lin = torch.nn.Linear(2, 2).half()
    opt = FP16_Optimizer(make(list(lin.parameters()) + list(emb.parameters())), dynamic_loss_scale=True, verbose=False)
    opt.backward(lin(emb(torch.tensor([1, 2]))).float().sum())
    before = [p.detach().clone() for p in [*lin.parameters(), *emb.parameters()]]
    masters = [m.detach().clone() for g in opt.fp32_groups for m in g]
    with pytest.raises(RuntimeError, match=r"param 2 of group 0.*sparse.*sparse=False"):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, [*lin.parameters(), *emb.parameters()]))
    assert all(torch.equal(a, m) for a, m in zip(masters, (m for g in opt.fp32_groups for m in g)))
    assert opt.cur_iter == 0 and opt.cur_scale == 2.0**16 and not opt.state


@pytest.mark.parametrize("bad", [0, 0.0, -8.0, float("inf"), float("nan"), "128", True, None])
def test_a_static_scale_that_cannot_work_is_refused_at_construction(bad):
    # 0 divided the grads by zero inside the update: every param became NaN, silently
    p = torch.ones(3, dtype=torch.float16, requires_grad=True)
    inner = FusedAdam([p], lr=1e-3, bias_correction=False, max_grad_norm=1.0)
    with pytest.raises(ValueError, match="static_loss_scale.*dynamic_loss_scale=True"):
        FP16_Optimizer(inner, static_loss_scale=bad)
    assert inner.param_groups[0]["params"][0] is p  # the inner optimizer is left as it was


def test_opennmt_passes_a_zero_static_scale_with_the_dynamic_one():
    # onmt: static_loss_scale=opt.loss_scale, dynamic_loss_scale=opt.loss_scale == 0
    p = torch.ones(3, dtype=torch.float16, requires_grad=True)
    opt = FP16_Optimizer(FusedAdam([p], lr=1e-3), static_loss_scale=0, dynamic_loss_scale=True, verbose=False)
    assert opt.cur_scale == 2.0**16


@pytest.mark.parametrize(
    "key,bad",
    [
        ("cur_scale", 0.0),
        ("cur_scale", float("nan")),
        ("cur_scale", "65536"),
        ("cur_scale", 10**400),  # OverflowError from math.isfinite
        ("cur_iter", 2.5),
        ("cur_iter", -1),
    ],
)
def test_a_checkpoint_with_an_unusable_scale_or_count_is_refused_before_any_change(key, bad):
    p = torch.ones(3, dtype=torch.float16, requires_grad=True)
    saved = FP16_Optimizer(FusedAdam([p], lr=1e-3, max_grad_norm=1.0), static_loss_scale=8.0, verbose=False)
    p.grad = torch.ones(3, dtype=torch.float16)
    saved.step()
    sd = saved.state_dict()
    sd[key] = bad
    q = torch.ones(3, dtype=torch.float16, requires_grad=True)
    opt = FP16_Optimizer(FusedAdam([q], lr=1e-3, max_grad_norm=1.0), dynamic_loss_scale=True, verbose=False)
    with pytest.raises(ValueError, match=key):
        opt.load_state_dict(sd)
    assert opt.dynamic_loss_scale and opt.cur_scale == 2.0**16 and opt.cur_iter == 0 and not opt.state


@pytest.mark.parametrize(
    "key,bad",
    [
        ("scale_window", None),
        ("scale_window", 0),
        ("scale_window", 2.5),
        ("scale_factor", None),
        ("scale_factor", 0.0),
        ("scale_factor", float("inf")),
        ("scale_factor", "2"),
        ("scale_factor", 10**400),
        ("last_overflow_iter", None),
        ("last_overflow_iter", -2),
        ("last_overflow_iter", 1.5),
    ],
)
def test_a_dynamic_checkpoint_with_unusable_scale_settings_is_refused_before_any_change(key, bad):
    # scale_window=None raised a bare TypeError after the masters, inner state and scale were replaced
    p = torch.ones(3, dtype=torch.float16, requires_grad=True)
    saved = FP16_Optimizer(FusedAdam([p], lr=1e-3, max_grad_norm=1.0), dynamic_loss_scale=True, verbose=False)
    p.grad = torch.ones(3, dtype=torch.float16)
    saved.step()
    saved.cur_scale = 4.0
    sd = saved.state_dict()
    sd[key] = bad
    q = torch.zeros(3, dtype=torch.float16, requires_grad=True)
    opt = FP16_Optimizer(FusedAdam([q], lr=1e-3, max_grad_norm=1.0), dynamic_loss_scale=True, verbose=False)
    with pytest.raises(ValueError, match=key):
        opt.load_state_dict(sd)
    assert opt.cur_scale == 2.0**16 and opt.cur_iter == 0 and not opt.state
    assert (opt.scale_factor, opt.scale_window, opt.last_overflow_iter) == (2.0, 1000, -1)
    assert torch.equal(opt.fp32_groups[0][0], torch.zeros(3))


def test_a_dynamic_checkpoint_with_tensor_settings_loads_as_numbers():
    p = torch.ones(3, dtype=torch.float16, requires_grad=True)
    saved = FP16_Optimizer(FusedAdam([p], lr=1e-3, max_grad_norm=1.0), dynamic_loss_scale=True, verbose=False)
    sd = saved.state_dict()
    sd.update(scale_factor=torch.tensor(4.0), scale_window=torch.tensor(7), last_overflow_iter=torch.tensor(-1))
    opt = FP16_Optimizer(
        FusedAdam([torch.ones(3, dtype=torch.float16, requires_grad=True)], lr=1e-3),
        dynamic_loss_scale=True,
        verbose=False,
    )
    opt.load_state_dict(sd)
    assert (opt.scale_factor, opt.scale_window, opt.last_overflow_iter) == (4.0, 7, -1)
    assert type(opt.scale_factor) is float and type(opt.scale_window) is int


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("bad", [0, -8.0, float("inf"), float("nan")], ids=repr)
def test_writing_a_scale_that_cannot_work_is_refused(bad, dynamic):
    # scripts write opt.cur_scale by hand; 0 or NaN made every param NaN at the next step
    p = torch.ones(3, dtype=torch.float16, requires_grad=True)
    opt = FP16_Optimizer(
        FusedAdam([p], lr=1e-3, bias_correction=False), static_loss_scale=8.0, dynamic_loss_scale=dynamic, verbose=False
    )
    before = opt.cur_scale
    with pytest.raises(ValueError, match=rf"cur_scale must be a finite number > 0 \(e\.g\. 128\.0\), got {bad!r}\."):
        opt.cur_scale = bad
    assert opt.cur_scale == before
    opt.cur_scale = 1024  # what scripts write
    assert opt.cur_scale == 1024.0


@pytest.mark.parametrize("bad", [1.0, 0.5, 1, torch.tensor(0.5)])
def test_a_saved_scale_factor_of_at_most_1_is_refused_naming_the_valid_range(bad):
    """apex divides the scale by scale_factor at an overflow and multiplies at a growth: a factor
    in (0, 1] (accepted before) never backs off, so every step after an overflow is skipped."""
    p = torch.ones(3, dtype=torch.float16, requires_grad=True)
    saved = FP16_Optimizer(FusedAdam([p], lr=1e-3), dynamic_loss_scale=True, verbose=False)
    sd = {**saved.state_dict(), "scale_factor": bad}
    q = torch.zeros(3, dtype=torch.float16, requires_grad=True)
    opt = FP16_Optimizer(FusedAdam([q], lr=1e-3), dynamic_loss_scale=True, verbose=False)
    with pytest.raises(ValueError, match=r"scale_factor must be a finite number > 1 \(the scale is divided by it"):
        opt.load_state_dict(sd)
    assert opt.scale_factor == 2.0 and opt.cur_scale == 2.0**16
