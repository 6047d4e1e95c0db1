"""NVIDIA's BERT pretraining recipe (2019-2020): ``FusedLAMB`` with two param groups (decay /
no decay) under ``amp.initialize(opt_level="O2", loss_scale="dynamic")`` with gradient
accumulation (``delay_unscale``), against a hand-written reference: fp16 model, fp32 masters made
from the fp16 weights, grads unscaled into the masters, a skipped step at overflow, and docs/apex-others.md
§3.2's LAMB rule (global clip, per-group step, trust ratio only where weight_decay != 0)."""

from __future__ import annotations

import copy
import math

import torch

from fp16kit.legacy import amp
from fp16kit.legacy.optimizers import FusedLAMB


def _no_decay(name):
    return "bias" in name or name.startswith("1.")


def test_fused_lamb_under_amp_o2_with_accumulation_matches_the_reference():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    ref_model = copy.deepcopy(model).half()
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if not _no_decay(n)], "weight_decay": 0.01},
        {"params": [p for n, p in named if _no_decay(n)], "weight_decay": 0.0},
    ]
    ref_named = list(ref_model.named_parameters())
    ref_params = [p for n, p in ref_named if not _no_decay(n)] + [p for n, p in ref_named if _no_decay(n)]
    ref_wd = [0.01] * len(groups[0]["params"]) + [0.0] * len(groups[1]["params"])
    model, opt = amp.initialize(model, FusedLAMB(groups, lr=1e-2), opt_level="O2", loss_scale="dynamic", verbosity=0)

    masters = [p.detach().double() for p in ref_params]
    m = [torch.zeros_like(x) for x in masters]
    v = [torch.zeros_like(x) for x in masters]
    scale, t, skipped = 2.0**16, 0, 0
    b1, b2, eps, lr = 0.9, 0.999, 1e-6, 1e-2
    gen = torch.Generator().manual_seed(1)
    for _k in range(8):
        x = torch.randn(6, 4, generator=gen).half()
        for micro in range(2):
            loss = model(x).float().pow(2).mean()
            with amp.scale_loss(loss, opt, delay_unscale=(micro == 0)) as scaled:
                scaled.backward()
        opt.step()
        opt.zero_grad()

        for p in ref_params:
            p.grad = None
        for _micro in range(2):
            (ref_model(x).float().pow(2).mean() * scale).backward()
        grads = [p.grad.float() * torch.tensor(1 / scale, dtype=torch.float32) for p in ref_params]
        if not all(torch.isfinite(g).all() for g in grads):
            scale /= 2
            skipped += 1
            continue
        t += 1
        norm = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
        clip = max(norm / 1.0, 1.0)
        for i, g in enumerate(grads):
            g = g.double() / clip
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            u = (m[i] / (1 - b1**t)) / ((v[i] / (1 - b2**t)).sqrt() + eps) + ref_wd[i] * masters[i]
            p_norm, u_norm = float(masters[i].norm()), float(u.norm())
            ratio = lr * p_norm / u_norm if ref_wd[i] != 0 and p_norm != 0 and u_norm != 0 else lr
            masters[i] = masters[i] - ratio * u
            with torch.no_grad():
                ref_params[i].copy_(masters[i].half())
    assert skipped >= 1 and t >= 5  # the first scale overflowed, later steps were taken
    assert [g["step"] for g in opt.param_groups] == [t, t]
    opt_masters = [p for g in opt.param_groups for p in g["params"]]
    for a, r in zip(opt_masters, masters):
        torch.testing.assert_close(a.detach().double(), r, rtol=1e-5, atol=1e-6)
    model_named = list(model.named_parameters())
    model_params = [p for n, p in model_named if not _no_decay(n)] + [p for n, p in model_named if _no_decay(n)]
    assert all(p.dtype == torch.float16 for p in model_params)
    for a, r in zip(model_params, ref_params):
        torch.testing.assert_close(a.detach().float(), r.detach().float(), rtol=2e-3, atol=1e-4)
