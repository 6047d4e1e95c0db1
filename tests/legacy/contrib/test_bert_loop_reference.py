"""pytorch-pretrained-BERT's 2019 fp16 fine-tuning loop, end to end, against a hand-written
fp32-master reference of docs/apex-others.md §1.3 (scale rule, skip on overflow, per-group norms
of the scaled fp16 grads) and §1.4 (legacy FusedAdam: unscale and clip per group inside the
update, bias_correction=False, decoupled decay times the step size, fp16 copy-out), through
overflow storms, scale growth, two param groups and an LR written into ``param_groups``."""

from __future__ import annotations

import math

import pytest
import torch

from fp16kit.legacy.optimizers import FP16_Optimizer, FusedAdam


def _model_params():
    g = torch.Generator().manual_seed(1)
    return [
        torch.randn(8, 4, generator=g).half().requires_grad_(),
        torch.randn(8, generator=g).half().requires_grad_(),
        torch.randn(8, generator=g).half().requires_grad_(),
    ]


def _loss(params, x, blow_up):
    w, b, ln = params
    y = (x.half() @ w.t() + b) * ln
    return (y.float() ** 2).mean() * (3e4 if blow_up else 1.0)


class Reference:
    """fp32 masters, §1.3's dynamic rule and §1.4's legacy FusedAdam in plain tensor code."""

    def __init__(self, params, group_of, wd, window, max_grad_norm):
        self.params, self.group_of, self.wd = params, group_of, wd
        self.masters = [p.detach().float().clone() for p in params]
        self.m = [torch.zeros_like(x) for x in self.masters]
        self.v = [torch.zeros_like(x) for x in self.masters]
        self.scale, self.cur_iter, self.last_overflow, self.window = 2.0**16, 0, -1, window
        self.max_grad_norm = max_grad_norm

    def step(self, loss, lr, b1=0.9, b2=0.999, eps=1e-8):
        for p in self.params:
            p.grad = None
        (loss.float() * self.scale).backward()
        n_groups = max(self.group_of) + 1
        norms = [
            math.sqrt(
                sum(
                    float(self.params[i].grad.double().square().sum())
                    for i in range(len(self.params))
                    if self.group_of[i] == gi
                )
            )
            for gi in range(n_groups)
        ]
        skip = not all(math.isfinite(n) for n in norms)
        if skip:
            self.scale = max(self.scale / 2, 1)
            self.last_overflow = self.cur_iter
        else:
            for i, p in enumerate(self.params):
                combined = self.scale
                clip = (norms[self.group_of[i]] / self.scale + 1e-6) / self.max_grad_norm
                if clip > 1:
                    combined = clip * self.scale
                g = p.grad.float() / combined
                self.m[i] = b1 * self.m[i] + (1 - b1) * g
                self.v[i] = b2 * self.v[i] + (1 - b2) * g * g
                update = self.m[i] / (self.v[i].sqrt() + eps) + self.wd[i] * self.masters[i]
                self.masters[i] = self.masters[i] - lr * update
                with torch.no_grad():
                    p.copy_(self.masters[i].half())
            if (self.cur_iter - self.last_overflow) % self.window == 0:
                self.scale *= 2
        self.cur_iter += 1
        return skip


@pytest.mark.parametrize("max_grad_norm", [1.0, 1e-3])
def test_bert_fp16_loop_matches_the_fp32_master_reference(max_grad_norm):
    params = _model_params()
    groups = [{"params": [params[0]], "weight_decay": 0.01}, {"params": [params[1], params[2]], "weight_decay": 0.0}]
    optimizer = FP16_Optimizer(
        FusedAdam(groups, lr=5e-3, bias_correction=False, max_grad_norm=max_grad_norm),
        dynamic_loss_scale=True,
        verbose=False,
    )
    optimizer.scale_window = 7
    ref = Reference(_model_params(), [0, 1, 1], [0.01, 0.0, 0.0], window=7, max_grad_norm=max_grad_norm)
    gen = torch.Generator().manual_seed(0)
    skips, growths = 0, 0
    for k in range(80):
        lr = 5e-3 * (1 - k / 100)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x = torch.randn(3, 4, generator=gen)
        blow_up = k % 17 == 3 or 40 <= k < 44
        optimizer.backward(_loss(params, x, blow_up))
        optimizer.step()
        optimizer.zero_grad()
        before = ref.scale
        skips += ref.step(_loss(ref.params, x, blow_up), lr)
        growths += ref.scale > before
        assert optimizer.cur_scale == ref.scale, k
        assert optimizer.overflow == (ref.last_overflow == k)
    assert skips >= 5 and growths >= 3  # overflows happened, and the scale grew back between them
    assert optimizer.cur_iter == ref.cur_iter and optimizer.last_overflow_iter == ref.last_overflow
    masters = [m for group in optimizer.fp32_groups for m in group]
    for m, r in zip(masters, ref.masters):
        torch.testing.assert_close(m.detach(), r, rtol=1e-5, atol=2e-6)
    for p, r in zip(params, ref.params):
        torch.testing.assert_close(p.detach().float(), r.detach().float(), rtol=2e-3, atol=1e-5)
