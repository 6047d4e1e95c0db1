"""fairseq's ``FusedAdamV2`` (fairseq/optim/fused_adam.py, 2020-2023) subclasses
``apex.optimizers.FusedAdam``, refuses to build unless the instance has ``multi_tensor_adam``
("Apex installation is outdated"), and rewrites ``step()`` to call
``multi_tensor_applier(self.multi_tensor_adam, self._dummy_overflow_buf, [g, p, m, v], lr, beta1,
beta2, eps, step, adam_w_mode, bias_correction, weight_decay)`` per dtype. With fp16kit's apex
alias on a GPU machine fairseq picks that class, so it must build and step by docs/apex-others.md §3.1's rule
(checked here against a hand-written reference)."""

from __future__ import annotations

import pytest
import torch

from fp16kit.legacy.multi_tensor_apply import amp_C, multi_tensor_applier
from fp16kit.legacy.optimizers import FusedAdam


class FusedAdamV2(FusedAdam):
    """fairseq's class, its step() as written there (CUDA device context dropped)."""

    def __init__(self, *args, use_fp16_stats=False, **kwargs):
        if use_fp16_stats:
            raise NotImplementedError("--fp16-adam-stats is only supported with FusedAdamV1")
        super().__init__(*args, **kwargs)
        if not hasattr(self, "multi_tensor_adam"):
            raise Exception("Apex installation is outdated. Please install an updated version of apex.")

    def step(self, closure=None, grads=None, output_params=None, scale=None, grad_norms=None):
        loss = None
        if closure is not None:
            loss = closure()
        for group in self.param_groups:
            bias_correction = 1 if group["bias_correction"] else 0
            beta1, beta2 = group["betas"]
            if "step" in group:
                group["step"] += 1
            else:
                group["step"] = 1
            g_16, p_16, orig_p_16, m_16, v_16 = [], [], [], [], []
            g_32, p_32, m_32, v_32 = [], [], [], []
            for p, orig_p in zip(group["params"], group["params"]):
                if p.grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    state["exp_avg"] = torch.zeros_like(p.data, dtype=torch.float)
                    state["exp_avg_sq"] = torch.zeros_like(p.data, dtype=torch.float)
                else:
                    state["exp_avg"] = state["exp_avg"].to(device=p.data.device, dtype=torch.float)
                    state["exp_avg_sq"] = state["exp_avg_sq"].to(device=p.data.device, dtype=torch.float)
                if p.dtype == torch.float16:
                    g_16.append(p.grad.data.float())
                    p_16.append(p.data.float())
                    orig_p_16.append(orig_p.data)
                    m_16.append(state["exp_avg"])
                    v_16.append(state["exp_avg_sq"])
                elif p.dtype == torch.float32:
                    g_32.append(p.grad.data)
                    p_32.append(p.data)
                    m_32.append(state["exp_avg"])
                    v_32.append(state["exp_avg_sq"])
                else:
                    raise RuntimeError("FusedAdam only support fp16 and fp32.")
            if len(g_16) > 0:
                multi_tensor_applier(
                    self.multi_tensor_adam,
                    self._dummy_overflow_buf,
                    [g_16, p_16, m_16, v_16],
                    group["lr"],
                    beta1,
                    beta2,
                    group["eps"],
                    group["step"],
                    self.adam_w_mode,
                    bias_correction,
                    group["weight_decay"],
                )
                for orig_p, p in zip(orig_p_16, p_16):
                    orig_p.copy_(p.data)
            if len(g_32) > 0:
                multi_tensor_applier(
                    self.multi_tensor_adam,
                    self._dummy_overflow_buf,
                    [g_32, p_32, m_32, v_32],
                    group["lr"],
                    beta1,
                    beta2,
                    group["eps"],
                    group["step"],
                    self.adam_w_mode,
                    bias_correction,
                    group["weight_decay"],
                )
        return loss


def _reference(p, grads, *, lr, wd, adam_w_mode, b1=0.9, b2=0.999, eps=1e-8):
    p, m, v = p.double(), torch.zeros_like(p, dtype=torch.float64), torch.zeros_like(p, dtype=torch.float64)
    for t, g in enumerate(grads, start=1):
        g = g.double()
        if not adam_w_mode:
            g = g + wd * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        u = (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps)
        if adam_w_mode:
            u = u + wd * p
        p = p - lr * u
    return p


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_fairseq_fused_adam_v2_builds_and_follows_the_rule(adam_w_mode):
    gen = torch.Generator().manual_seed(0)
    w32 = torch.randn(4, 3, generator=gen).requires_grad_()
    w16 = torch.randn(5, generator=gen).half().requires_grad_()
    start = [w32.detach().clone(), w16.detach().float()]
    opt = FusedAdamV2([w32, w16], lr=1e-2, weight_decay=0.1, adam_w_mode=adam_w_mode)
    grads = [[torch.randn(4, 3, generator=gen) for _ in range(4)], [torch.randn(5, generator=gen) for _ in range(4)]]
    for k in range(4):
        w32.grad = grads[0][k].clone()
        w16.grad = grads[1][k].half()
        with torch.no_grad():
            opt.step()
    ref32 = _reference(start[0], grads[0], lr=1e-2, wd=0.1, adam_w_mode=adam_w_mode)
    torch.testing.assert_close(w32.detach().double(), ref32, rtol=1e-5, atol=1e-6)
    # fp16 param: rounded every step, so compare with a reference that rounds too
    p = start[1]
    m = torch.zeros(5)
    v = torch.zeros(5)
    for t in range(1, 5):
        g = grads[1][t - 1].half().float()
        if not adam_w_mode:
            g = g + 0.1 * p
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        u = (m / (1 - 0.9**t)) / ((v / (1 - 0.999**t)).sqrt() + 1e-8) + (0.1 * p if adam_w_mode else 0)
        p = (p - 1e-2 * u).half().float()
    torch.testing.assert_close(w16.detach().float(), p, rtol=2e-3, atol=2e-3)
    assert opt.param_groups[0]["step"] == 4


def test_multi_tensor_adam_refuses_mismatched_lists_before_any_write():
    p = torch.ones(3)
    flag = torch.zeros(1, dtype=torch.int)
    with pytest.raises(ValueError, match="float32 tensors of the param's shape"):
        multi_tensor_applier(
            amp_C.multi_tensor_adam,
            flag,
            [[torch.ones(3)], [p], [torch.zeros(2)], [torch.zeros(3)]],
            1e-3,
            0.9,
            0.999,
            1e-8,
            1,
            1,
            1,
            0.0,
        )
    with pytest.raises(ValueError, match="got 2 lists"):
        multi_tensor_applier(
            amp_C.multi_tensor_adam, flag, [[torch.ones(3)], [p]], 1e-3, 0.9, 0.999, 1e-8, 1, 1, 1, 0.0
        )
    assert torch.equal(p, torch.ones(3))
