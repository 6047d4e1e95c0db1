"""``amp.scale_loss(..., delay_overflow_check=True)`` with the script's own ``update_scale()``,
and ``LossScaler._overflow_buf``: NVIDIA DeepLearningExamples' BERT ``run_pretraining.py``
(``--allreduce_post_accumulation``) accumulates, rescales the master grads with
``multi_tensor_applier(amp_C.multi_tensor_scale, overflow_buf, ...)``, swaps ``overflow_buf`` in as
``scaler._overflow_buf``, calls ``scaler.update_scale()`` once per optimizer step and only calls
``optimizer.step()`` when it returned False. apex's rule (docs/apex-amp.md §6.7, §7), written by hand
here: no update at a delayed exit; one update per ``update_scale()`` call."""

from __future__ import annotations

import torch
from torch import nn

from fp16kit.legacy import amp
from fp16kit.legacy.amp import _amp_state
from fp16kit.legacy.multi_tensor_apply import amp_C, multi_tensor_applier


def _setup(opt_level="O2"):
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=opt_level, loss_scale="dynamic", verbosity=0)
    return model, opt


def _dle_step(model, opt, x, bad_micro, accumulate=2):
    """One DLE optimizer step; returns had_overflow (the script's decision)."""
    for micro in range(accumulate):
        loss = model(x.half() if next(model.parameters()).dtype == torch.float16 else x).float().pow(2).mean()
        loss = loss / accumulate * (float("inf") if micro == bad_micro else 1.0)
        with amp.scale_loss(loss, opt, delay_overflow_check=True) as scaled:
            scaled.backward()
    scaler = _amp_state.loss_scalers[0]
    loss_scale = scaler.loss_scale()
    master_grads = [p.grad for p in amp.master_params(opt) if p.grad is not None]
    overflow_buf = torch.zeros(1, dtype=torch.int)
    multi_tensor_applier(amp_C.multi_tensor_scale, overflow_buf, [master_grads, master_grads], loss_scale / accumulate)
    overflow_buf.zero_()
    multi_tensor_applier(amp_C.multi_tensor_scale, overflow_buf, [master_grads, master_grads], 1.0 / loss_scale)
    old_overflow_buf = scaler._overflow_buf
    scaler._overflow_buf = overflow_buf
    had_overflow = scaler.update_scale()
    scaler._overfloat_buf = old_overflow_buf  # (sic: the script's typo; the swapped buffer stays)
    if not had_overflow:
        opt.step()
    elif _amp_state.opt_properties.master_weights:
        for param in opt._amp_stash.all_fp32_from_fp16_params:
            param.grad = None
    for param in model.parameters():
        param.grad = None
    return had_overflow


def test_dle_post_accumulation_updates_the_scale_once_per_step_and_applies_good_steps():
    model, opt = _setup()
    scaler = _amp_state.loss_scalers[0]
    x = torch.randn(5, 4)
    # hand-written apex: S = 65536, unskipped = 0; overflow -> S/2, unskipped = 0; else unskipped += 1
    scale, unskipped = 65536.0, 0
    for bad_micro in (0, 1, None, None, 0, None):
        before = [p.detach().clone() for p in model.parameters()]
        had_overflow = _dle_step(model, opt, x, bad_micro)
        assert had_overflow == (bad_micro is not None)
        if bad_micro is not None:
            scale, unskipped = scale / 2, 0
        else:
            unskipped += 1
        assert scaler.loss_scale() == scale and scaler._unskipped == unskipped
        changed = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
        # a step the script took is applied (before: a stale overflow flag of an earlier,
        # script-skipped step made amp skip it silently)
        assert changed == (bad_micro is None), bad_micro


def test_delayed_check_without_update_scale_still_skips_the_step_and_halves_once():
    model, opt = _setup()
    scaler = _amp_state.loss_scalers[0]
    x = torch.randn(5, 4)
    before = [p.detach().clone() for p in model.parameters()]
    for bad in (float("inf"), 1.0):
        loss = model(x.half()).float().pow(2).mean() * bad
        with amp.scale_loss(loss, opt, delay_overflow_check=True) as scaled:
            scaled.backward()
        assert scaler.loss_scale() == 65536.0  # apex: no update at a delayed exit
    opt.step()
    assert scaler.loss_scale() == 32768.0 and scaler._unskipped == 0  # FIX: applied at the step, once
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    opt.zero_grad()
    loss = model(x.half()).float().pow(2).mean()
    with amp.scale_loss(loss, opt, delay_overflow_check=True) as scaled:
        scaled.backward()
    opt.step()
    assert scaler.loss_scale() == 32768.0 and scaler._unskipped == 1
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_overflow_buf_is_read_by_update_scale_and_zeroed_by_clear_overflow_state():
    _setup()
    scaler = _amp_state.loss_scalers[0]
    assert scaler._overflow_buf.dtype == torch.int32 and scaler._overflow_buf.tolist() == [0]
    scaler._overflow_buf = torch.ones(1, dtype=torch.int)
    assert scaler.update_scale() is True and scaler.loss_scale() == 32768.0
    scaler.clear_overflow_state()
    assert scaler._overflow_buf.tolist() == [0]
    assert scaler.update_scale() is False and scaler._unskipped == 1
