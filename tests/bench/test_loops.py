"""fp16kit.bench.loops and .training: every variant steps the same masters as its anchor.

Bit for bit: the arithmetic is the same everywhere. The loss scale is a power of two, so
unscaling by multiplying with 1/scale (the hand loop's master-grad path, FP16_Optimizer, amp) and
by dividing inside the fused AdamW (MixedPrecisionOptimizer with fp16kit.GradScaler, the hand
step) give the same fp32 grads; then the same fused AdamW runs on the same values."""

from __future__ import annotations

import pytest
import torch

from fp16kit.bench import loops, training
from fp16kit.bench.rows import NullClock
from fp16kit.bench.shapes import MLP, Shape, fake_grads

SHAPE = Shape("tiny", ((1000,),) * 5 + ((64, 64),) * 3 + ((7,),))
STEPS = 3
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
    ),
]


pytestmark = pytest.mark.usefixtures("amp_state_restored")  # (tests/conftest.py)


def _stepped(variants):
    for loop in variants:
        for _ in range(STEPS):
            loop.iteration(NullClock())
        loop.finish()
    return variants


def _assert_same(anchor, other):
    a, b = anchor.masters(), other.masters()
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.dtype == y.dtype == torch.float32
        assert torch.equal(x, y), f"{other.name} differs from {anchor.name} at tensor {i}"


@pytest.mark.parametrize("device", DEVICES)
def test_master_grad_path_variants_match_the_hand_loop(device):
    hand, *others = _stepped(loops.master_grad_loops(SHAPE, device))
    assert [o.name for o in others] == [
        "MixedPrecisionOptimizer",
        "MixedPrecisionOptimizer (flat)",
        "FP16_Optimizer.update_master_grads",
    ]
    expected = [g.float() / loops.INIT_SCALE for g in fake_grads(SHAPE, torch.float16, device)]
    for got, want in zip(hand.masters(), expected):
        assert torch.equal(got, want)
    for other in others:
        _assert_same(hand, other)


@pytest.mark.parametrize("device", DEVICES)
def test_step_variants_match_the_hand_loop_bit_for_bit(device):
    variants = _stepped(loops.step_loops(SHAPE, device))
    hand = variants[0]
    assert hand.name == loops.HAND
    # the masters moved, and the 16-bit params are their rounding
    start = [p.detach().float() for p in loops.step_loops(SHAPE, device, names=["hand"])[0].params]
    assert not any(torch.equal(m, s) for m, s in zip(hand.masters(), start))
    for p, m in zip(hand.params, hand.masters()):
        assert torch.equal(p.detach(), m.half())
    for other in variants[1:]:  # fp16kit's, and torch's fused AdamW on fp32 params with unscaled grads
        _assert_same(hand, other)


def test_step_variants_keep_the_model_params_in_fp16():
    for loop in _stepped(loops.step_loops(SHAPE, "cpu", names=["mpo", "mpo-flat", "fp16-optimizer", "amp-o2"])):
        assert all(p.dtype == torch.float16 for p in loop.params), loop.name
        for p, m in zip(loop.params, loop.masters()):
            assert torch.equal(p.detach(), m.half()), loop.name


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_fp16kit_grad_scaler_trains_as_torchs(optimizer):
    mlp = MLP("tiny", 2, 32, 8)
    ours, theirs = _stepped(
        [training.ScalerLoop(mlp, "cpu", optimizer=optimizer, fp16kit_scaler=flag) for flag in (True, False)]
    )
    assert (ours.name, theirs.name) == ("fp16kit.GradScaler", "torch.amp.GradScaler")
    _assert_same(theirs, ours)


def test_async_loops_run_and_put_the_threads_back():
    before = torch.get_num_threads()
    mlp = MLP("tiny", 2, 32, 4)
    try:
        sync = training.AsyncLoop(mlp, "cpu", async_step=False, threads=1)
        asyn = training.AsyncLoop(mlp, "cpu", async_step=True, threads=2)
        assert sync.run(2) > 0 and asyn.run(3) > 0
        assert torch.get_num_threads() == 2  # its own setting, put back after the run
        assert sync.run(1) > 0 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    # (a one-step delay makes the asynchronous numbers differ: no equality here)
    assert all(p.dtype == torch.bfloat16 for p in asyn.model.parameters())


def test_split_threads():
    assert training.split_threads(2) == (1, 1)
    assert training.split_threads(16) == (8, 8)
    assert training.split_threads(3) == (1, 2)
    assert training.split_threads(1) == (1, 1)
