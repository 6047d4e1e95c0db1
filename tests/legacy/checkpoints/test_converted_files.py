"""Converted files (``fp16kit convert-checkpoint``) loaded into the classes that should take them:
the apex-era optimizer a script still uses (``fp16kit.legacy.optimizers.FusedAdam`` inside
Megatron's ``FP16_Optimizer``) and torch's AdamW, each stepped once against apex's rule written
out by hand (docs/apex-others.md §3.1, §2.3) -- files written as 2019-2020 code wrote them:
torch's legacy format, pickle protocol 2, tensors on ``cuda:0``, Megatron's scaler pickled as
an object of its own module path.
"""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from fp16kit.legacy import load_checkpoint
from fp16kit.legacy.checkpoints.convert import Conversion, convert_file

LR, B1, B2, EPS, WD, STEP = 1e-3, 0.9, 0.999, 1e-8, 0.01, 57


def _megatron_file(tmp_path, megatron, save_on):
    """A Megatron-LM v1 checkpoint (docs/apex-others.md §6): args, fp16 model, FP16_Optimizer over FusedAdam
    (group step 57), its DynamicLossScaler pickled as an object."""
    torch.manual_seed(3)
    w = torch.randn(4, 3).half()
    w.model_parallel = True
    inner = {
        "state": {0: {"exp_avg": torch.randn(4, 3) * 0.01, "exp_avg_sq": torch.rand(4, 3) * 1e-4}},
        "param_groups": [
            {
                "lr": LR,
                "bias_correction": True,
                "betas": (B1, B2),
                "eps": EPS,
                "weight_decay": WD,
                "step": STEP,
                "params": [0],
            }
        ],
    }
    optimizer = {
        "loss_scaler": megatron(cur_scale=1024.0, cur_iter=STEP, last_overflow_iter=50, scale_window=1000.0),
        "dynamic_loss_scale": True,
        "overflow": False,
        "first_closure_call_this_step": True,
        "optimizer_state_dict": inner,
        "fp32_from_fp16": [[w.float() + 0.001]],
    }
    ckpt = {
        "args": argparse.Namespace(fp16=True, params_dtype=torch.half),
        "iteration": STEP,
        "model": {"w": w},
        "optimizer": optimizer,
    }
    # as torch 1.4 wrote it from a GPU: legacy format, protocol 2, storages on cuda:0
    return save_on(ckpt, tmp_path / "megatron.pt", legacy=True), ckpt


def _apex_adam(master, m, v, g, t):
    """apex FusedAdam (adam_w_mode), docs/apex-others.md §3.1, in double."""
    out = []
    for p, mi, vi, gi in zip(
        master.flatten().tolist(), m.flatten().tolist(), v.flatten().tolist(), g.flatten().tolist()
    ):
        mi = B1 * mi + (1 - B1) * gi
        vi = B2 * vi + (1 - B2) * gi * gi
        u = (mi / (1 - B1**t)) / (math.sqrt(vi / (1 - B2**t)) + EPS) + WD * p
        out.append(p - LR * u)
    return out


@pytest.mark.parametrize("torch_optimizer_state", [False, True])
def test_a_converted_megatron_checkpoint_continues_in_fusedadam_at_the_saved_step(
    tmp_path, megatron, save_on, torch_optimizer_state
):
    """With --torch-optimizer-state the group's step is gone: apex's FusedAdam continues from the
    per-param counts (it restarted its bias correction at step 1, silently, before)."""
    from fp16kit.legacy.megatron import FP16_Optimizer
    from fp16kit.legacy.optimizers import FusedAdam

    path, saved = _megatron_file(tmp_path, megatron, save_on)
    out = tmp_path / "converted.pt"
    convert_file(path, out, torch_optimizer_state=torch_optimizer_state)
    ckpt = torch.load(out, weights_only=True)
    assert load_checkpoint(path)["optimizer"]["loss_scaler"]["cur_scale"] == 1024.0

    model = torch.nn.Linear(3, 4, bias=False).half()
    model.weight.data = ckpt["model"]["w"].clone()
    opt = FP16_Optimizer(FusedAdam(model.parameters(), lr=LR, weight_decay=WD), dynamic_loss_scale=True)
    opt.load_state_dict(ckpt["optimizer"])
    x = torch.tensor([[0.5, -1.0, 0.25]]).half()
    opt.zero_grad()
    opt.backward(model(x).float().sum())
    opt.step()

    inner = saved["optimizer"]["optimizer_state_dict"]["state"][0]
    g = x.float().expand(4, 3)  # d(sum(W x))/dW, unscaled exactly (1024 is a power of two)
    want = _apex_adam(saved["optimizer"]["fp32_from_fp16"][0][0], inner["exp_avg"], inner["exp_avg_sq"], g, STEP + 1)
    got = opt.fp32_from_fp16_groups[0][0].flatten().tolist()
    assert got == pytest.approx(want, rel=1e-6, abs=1e-8)
    assert opt.optimizer.param_groups[0]["step"] == STEP + 1
    assert opt.loss_scaler.cur_iter == STEP + 1 and opt.loss_scaler.cur_scale == 1024.0


def test_a_file_converted_for_torch_still_loads_into_torchs_adamw(tmp_path, megatron, save_on):
    path, saved = _megatron_file(tmp_path, megatron, save_on)
    out = tmp_path / "converted.pt"
    convert_file(path, out, torch_optimizer_state=True)
    osd = torch.load(out, weights_only=True)["optimizer"]["optimizer_state_dict"]
    master = saved["optimizer"]["fp32_from_fp16"][0][0].clone().requires_grad_()
    adam = torch.optim.AdamW([master], lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD)
    adam.load_state_dict(osd)
    g = torch.linspace(-1, 1, 12).reshape(4, 3)
    master.grad = g
    adam.step()
    inner = saved["optimizer"]["optimizer_state_dict"]["state"][0]
    # torch's AdamW decays before the update: p*(1-lr*wd) - lr*m_hat/(sqrt(v_hat)+eps)
    before = saved["optimizer"]["fp32_from_fp16"][0][0].flatten().tolist()
    t = STEP + 1
    for j, (p, m, v, gi) in enumerate(
        zip(before, inner["exp_avg"].flatten().tolist(), inner["exp_avg_sq"].flatten().tolist(), g.flatten().tolist())
    ):
        m = B1 * m + (1 - B1) * gi
        v = B2 * v + (1 - B2) * gi * gi
        want = p * (1 - LR * WD) - LR / (1 - B1**t) * m / (math.sqrt(v) / math.sqrt(1 - B2**t) + EPS)
        assert master.flatten()[j].item() == pytest.approx(want, rel=1e-6, abs=1e-7)
    assert adam.state[master]["step"].item() == t


def test_a_converted_file_trained_on_in_torch_goes_back_to_fusedadam_at_torchs_count(tmp_path, megatron, save_on):
    """convert --torch-optimizer-state -> torch AdamW, 3 steps -> its state_dict -> apex's
    FusedAdam: the count is torch's (60), not the converted file's (57): the converter drops the
    group step, which torch would carry along unchanged (a stale copy that FusedAdam reads)."""
    from fp16kit.legacy.optimizers import FusedAdam

    path, saved = _megatron_file(tmp_path, megatron, save_on)
    out = tmp_path / "converted.pt"
    convert_file(path, out, torch_optimizer_state=True)
    osd = torch.load(out, weights_only=True)["optimizer"]["optimizer_state_dict"]
    master = saved["optimizer"]["fp32_from_fp16"][0][0].clone().requires_grad_()
    adam = torch.optim.AdamW([master], lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD)
    adam.load_state_dict(osd)
    for _ in range(3):
        master.grad = torch.ones_like(master)
        adam.step()
    resaved = tmp_path / "torch.pt"
    torch.save(adam.state_dict(), resaved)
    sd = torch.load(resaved, weights_only=True)

    p = master.detach().clone().requires_grad_()
    fused = FusedAdam([p], lr=LR, weight_decay=WD)
    fused.load_state_dict(sd)
    g = torch.linspace(-1, 1, 12).reshape(4, 3)
    p.grad = g
    fused.step()
    want = _apex_adam(master.detach(), sd["state"][0]["exp_avg"], sd["state"][0]["exp_avg_sq"], g, STEP + 3 + 1)
    assert p.flatten().tolist() == pytest.approx(want, rel=1e-6, abs=1e-8)
    assert fused.param_groups[0]["step"] == STEP + 4


# ------------------------------------------------------------- fused-era FP16_Optimizer (§1.5)

SHAPES = [(3, 2), (4,)]


def _fused_era_state(layout: str):
    """apex.optimizers.FP16_Optimizer(FusedAdam(..., max_grad_norm=1.0), dynamic_loss_scale=True)
    .state_dict() at cur_iter 10, legacy FusedAdam (per-param int step) inside: the flat
    layout (2018-12 -> 2019-12, one flat master and one flat state per group) or per-param."""
    torch.manual_seed(5)
    model = [torch.randn(s).half() for s in SHAPES]
    masters = [p.float() + 0.01 for p in model]
    n = sum(p.numel() for p in model)
    m, v = torch.randn(n) * 0.01, torch.rand(n) * 1e-4
    group = {"lr": LR, "bias_correction": True, "betas": (B1, B2), "eps": EPS, "weight_decay": WD, "max_grad_norm": 1.0}
    if layout == "flat":
        inner = {
            "state": {0: {"step": 10, "exp_avg": m.clone(), "exp_avg_sq": v.clone()}},
            "param_groups": [{**group, "params": [0]}],
        }
        held = {"fp32_groups_flat": [torch.cat([t.flatten() for t in masters])]}
    else:
        inner = {
            "state": {
                0: {"step": 10, "exp_avg": m[:6].reshape(3, 2).clone(), "exp_avg_sq": v[:6].reshape(3, 2).clone()},
                1: {"step": 10, "exp_avg": m[6:].clone(), "exp_avg_sq": v[6:].clone()},
            },
            "param_groups": [{**group, "params": [0, 1]}],
        }
        held = {"fp32_groups": [[t.clone() for t in masters]]}
    sd = {
        "dynamic_loss_scale": True,
        "cur_scale": 1024.0,
        "cur_iter": 10,
        "last_overflow_iter": -1,
        "scale_factor": 2.0,
        "scale_window": 1000,
        "optimizer_state_dict": inner,
        **held,
    }
    return {"model": {"w": model[0], "b": model[1]}, "optimizer": sd, "epoch": 3}, masters, m, v


def _legacy_adam(masters, m, v, grads, scale):
    """The fused-era step (docs/apex-others.md §1.3-1.4), in double: per-group clip from the scaled grads'
    norm, then legacy FusedAdam at t = 11 (eps outside the sqrt, decay times step_size)."""
    g = [x for t in grads for x in t.double().flatten().tolist()]
    norm = math.sqrt(sum(x * x for x in g))
    combined = scale
    clip = (norm / scale + 1e-6) / 1.0
    if clip > 1:
        combined = clip * scale
    t = 11
    step_size = LR * math.sqrt(1 - B2**t) / (1 - B1**t)
    out = []
    for p, mi, vi, gi in zip([x for t_ in masters for x in t_.flatten().tolist()], m.tolist(), v.tolist(), g):
        gi /= combined
        mi = B1 * mi + (1 - B1) * gi
        vi = B2 * vi + (1 - B2) * gi * gi
        out.append(p - step_size * (mi / (math.sqrt(vi) + EPS) + WD * p))
    return out


@pytest.mark.parametrize("how", ["load_checkpoint", "converted", "converted --torch-optimizer-state"])
@pytest.mark.parametrize("layout", ["flat", "per-param"])
def test_a_fused_era_fp16_optimizer_file_continues_in_fp16kit(tmp_path, save_on, layout, how):
    from fp16kit.legacy.contrib.optimizers import FusedAdam
    from fp16kit.legacy.optimizers import FP16_Optimizer

    ckpt, masters, m, v = _fused_era_state(layout)
    path = save_on(ckpt, tmp_path / "bert.pt", legacy=True)
    if how == "load_checkpoint":
        loaded = load_checkpoint(path)
    else:
        convert_file(path, tmp_path / "out.pt", torch_optimizer_state=how.endswith("state"))
        loaded = torch.load(tmp_path / "out.pt", weights_only=True)
    if how.endswith("state"):  # the legacy per-param int step became torch's float32 tensor
        assert all(
            s["step"].dtype == torch.float32 for s in loaded["optimizer"]["optimizer_state_dict"]["state"].values()
        )

    model = [loaded["model"]["w"].clone().requires_grad_(), loaded["model"]["b"].clone().requires_grad_()]
    opt = FP16_Optimizer(
        FusedAdam([{"params": model}], lr=LR, weight_decay=WD, max_grad_norm=1.0),
        dynamic_loss_scale=True,
        verbose=False,
    )
    opt.load_state_dict(loaded["optimizer"])
    grads = [(torch.arange(p.numel()).reshape(p.shape) * 0.5).half() for p in model]
    for p, g in zip(model, grads):
        p.grad = g.clone()
    opt.step()
    got = [x for t in opt.fp32_groups for mm in t for x in mm.detach().double().flatten().tolist()]
    assert got == pytest.approx(_legacy_adam(masters, m, v, grads, 1024.0), rel=1e-6, abs=1e-7)
    assert opt.cur_iter == 11


# ------------------------------------------------------------ an early era-2 apex scaler


def test_an_era2_scaler_pickled_before_min_loss_scale_existed_loads_without_a_floor(tmp_path, fake_apex, save_on):
    """apex's amp LossScaler of spring 2019 had no ``_min_loss_scale`` (and no floor): such a
    FP16_Optimizer checkpoint was refused ("Cannot read the saved loss scaler
    ('_min_loss_scale')"), by load_state_dict and by the converter."""
    from fp16kit.legacy import FP16_Optimizer

    model = torch.nn.Linear(2, 2).half()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True, verbose=False)
    sd = opt.state_dict()
    scaler = fake_apex.era2(2.0, window=2000, unskipped=7)
    del scaler._min_loss_scale
    sd["loss_scaler"] = scaler
    path = save_on({"optimizer": sd}, tmp_path / "early.pt", legacy=True)
    fake_apex.remove()

    loaded = load_checkpoint(path)["optimizer"]
    assert "_min_loss_scale" not in loaded["loss_scaler"]
    convert_file(path, tmp_path / "out.pt")
    converted = torch.load(tmp_path / "out.pt", weights_only=True)["optimizer"]
    assert converted["loss_scaler"]["min_loss_scale"] is None and converted["loss_scaler"]["unskipped"] == 7
    for state in (loaded, converted):
        fresh = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True, verbose=False)
        fresh.load_state_dict(state)
        assert fresh.loss_scale == 2.0 and fresh.state_dict()["loss_scaler"]["min_loss_scale"] is None


# ------------------------------------------------------------------------- FusedAdagrad


def test_fused_adagrad_state_loads_into_torchs_adagrad_after_torch_optimizer_state(tmp_path, save_on):
    """apex FusedAdagrad's state is 'sum' only; torch's Adagrad raised KeyError 'step' in
    load_state_dict. Rule (docs/apex-others.md §3.5, adagrad_w_mode False, no decay): sum += g*g;
    p -= lr * g / (sqrt(sum) + eps) -- torch's with lr_decay 0 and the count unused."""
    lr, eps = 0.01, 1e-10
    saved_sum = torch.tensor([0.5, 2.0, 0.25])
    sd = {
        "state": {0: {"sum": saved_sum.clone()}},
        "param_groups": [{"lr": lr, "eps": eps, "weight_decay": 0.0, "params": [0]}],
    }
    path = save_on({"optimizer": sd}, tmp_path / "adagrad.pt", legacy=True)
    plain, report = convert_file(path, tmp_path / "plain.pt"), None
    with pytest.raises(KeyError, match="step"):  # why the option does this
        torch.optim.Adagrad([torch.zeros(3, requires_grad=True)]).load_state_dict(
            torch.load(tmp_path / "plain.pt", weights_only=True)["optimizer"]
        )
    report = convert_file(path, tmp_path / "out.pt", torch_optimizer_state=True)
    assert [str(r) for r in report if r.path == "optimizer.state"] == [
        "converted  optimizer.state: 'sum' only, no count, for 1 params (apex FusedAdagrad) -> state[p]['step'] = "
        "tensor(0.0) and group lr_decay 0: torch.optim.Adagrad needs both; the count matters only with lr_decay, "
        "which apex's lacked"
    ]
    p = torch.tensor([1.0, -1.0, 0.5], requires_grad=True)
    opt = torch.optim.Adagrad([p], lr=lr, eps=eps)
    opt.load_state_dict(torch.load(tmp_path / "out.pt", weights_only=True)["optimizer"])
    g = [0.3, -0.7, 1.1]
    p.grad = torch.tensor(g)
    opt.step()
    for j, (w, s, gj) in enumerate(zip([1.0, -1.0, 0.5], saved_sum.tolist(), g)):
        s += gj * gj
        assert p[j].item() == pytest.approx(w - lr * gj / (math.sqrt(s) + eps), rel=1e-6)
    assert plain == [Conversion("(tensors)", "1 storages saved on cuda:0", "loaded to cpu")]

    from fp16kit.legacy.optimizers import FusedAdagrad  # and apex's class still takes the file

    q = torch.tensor([1.0, -1.0, 0.5], requires_grad=True)
    fused = FusedAdagrad([q], lr=lr, eps=eps)
    fused.load_state_dict(torch.load(tmp_path / "out.pt", weights_only=True)["optimizer"])
    q.grad = torch.tensor(g)
    fused.step()
    assert q.tolist() == pytest.approx(p.tolist(), rel=1e-6)
