"""A bound scaler pickled or copied right after ``update()`` (in the mode-2 lag) keeps the lag, as ``state_dict()`` does.

Found by the adversarial pass: the copy took the thread's newer scale as its scale and lost the lag
(fixed: ``__getstate__`` saves what ``state_dict()`` saves).

``state_dict()`` saves ``"scale"`` (what the next loss is multiplied with, R_{k-1}) and
``"next_scale"`` (R_k, what the queued update computed); ``__getstate__`` drops the
``ScalerThreads`` and copies the LossScale, i.e. the *optimizer thread's* scale R_k, with no
lag. A run resumed from the copy scales the next loss with R_k instead of R_{k-1} and ends
on a different scale than the uninterrupted run (here 2048 vs 1024: the copy grows once more
before the overflow of iteration 2). A loaded-but-unbound lag (``ScalerThreads._next_scale``)
is dropped by a copy the same way.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from fp16kit import GradScaler, MixedPrecisionOptimizer

OVERFLOW = 2


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).to(torch.float16)


def _loss(model, i):
    g = torch.Generator().manual_seed(100 + i)
    return model(torch.randn(3, 4, generator=g).to(torch.float16)).float().pow(2).mean()


def _world(threads, scaler=None):
    model = _net()
    opt = MixedPrecisionOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2), thread=threads())
    return model, opt, scaler or GradScaler("cpu", init_scale=2.0**8, growth_interval=1)


def _iterate(model, opt, scaler, steps):
    for i in steps:
        opt.zero_grad()
        scaler.scale(_loss(model, i) * (1e30 if i == OVERFLOW else 1.0)).backward()
        opt.submit_step(lambda: (scaler.step(opt), opt.zero_grad()), scaler=scaler)
        scaler.update()


COPIES = {
    "pickle": lambda s: pickle.loads(pickle.dumps(s)),
    "deepcopy": copy.deepcopy,
    "copy": copy.copy,
}


@pytest.mark.parametrize("how", list(COPIES))
def test_a_copy_taken_in_the_lag_has_the_state_dict_of_the_original(threads, how):
    model, opt, scaler = _world(threads)
    _iterate(model, opt, scaler, range(2))
    original = scaler.state_dict()
    assert "next_scale" in original  # in the lag
    # fails: the copy says {"scale": 1024.0} (the thread's), the original 512.0 + next_scale 1024.0
    assert COPIES[how](scaler).state_dict() == original


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_a_run_resumed_from_a_copy_taken_in_the_lag_equals_the_uninterrupted_run(threads, how):
    model, opt, scaler = _world(threads)
    _iterate(model, opt, scaler, range(2))
    saved = copy.deepcopy((opt.state_dict(), model.state_dict()))
    copied = COPIES[how](scaler)
    _iterate(model, opt, scaler, range(2, 6))
    opt.synchronize()
    reference = scaler.state_dict()

    model2, opt2, scaler2 = _world(threads, copied)
    opt2.load_state_dict(saved[0])
    model2.load_state_dict(saved[1])
    _iterate(model2, opt2, scaler2, range(2, 6))
    opt2.synchronize()
    assert scaler2.state_dict() == reference  # fails: scale 2048.0 vs 1024.0


def test_a_loaded_lag_survives_a_copy_before_the_binding(threads):
    # Loaded into a scaler that is not bound yet, the lag waits in ScalerThreads for the
    # binding made next; state_dict() still reports it, a pickled copy does not.
    model, opt, scaler = _world(threads)
    _iterate(model, opt, scaler, range(2))
    saved = scaler.state_dict()
    fresh = GradScaler("cpu", init_scale=2.0**8, growth_interval=1)
    fresh.load_state_dict(saved)
    assert fresh.state_dict() == saved
    assert pickle.loads(pickle.dumps(fresh)).state_dict() == saved  # fails: no "next_scale"
