"""Helpers shared by several test modules.

pytest runs with ``--import-mode=importlib``, so test modules cannot import each other; the
``pythonpath = ["tests"]`` entry in pyproject.toml puts this package on ``sys.path`` instead.
A module, not conftest fixtures, because what is shared is needed at module level too:
``parametrize`` lists, decorators, ``pytestmark`` and base classes.

* here: the small fp16/bf16 MLP, its batches, its loss and one GradScaler iteration, used by
  test_optimizer.py and test_async.py;
* ``_helpers.torch_scaling``: what the ports of torch's GradScaler tests share
  (test_grad_scaler_torch_scenarios_*.py);
* ``_helpers.fp16_optimizer``: the model, data and hand-written apex reference of the
  FP16_Optimizer tests (tests/legacy/test_fp16_optimizer*.py).
"""

from __future__ import annotations

import torch
from torch import nn


def mlp(dtype=torch.float16, seed=0):
    """Linear(8, 16), Tanh, Linear(16, 4) in ``dtype``, initialised from ``seed``."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(dtype)


def batches(n, dtype=torch.float16, seed=1):
    """``n`` pairs (x: 6x8 in ``dtype``, y: 6x4 in fp32) drawn from a generator seeded ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, 8, generator=g).to(dtype), torch.randn(6, 4, generator=g)) for _ in range(n)]


def mse(model, x, y):
    """The fp32 mean squared error of ``model(x)`` against ``y``."""
    return (model(x).float() - y).pow(2).mean()


def amp_iteration(model, opt, scaler, x, y, inject=False, *, deferred=False):
    """One torch.amp-style iteration: zero_grad, scaled backward, (``inject``: an inf in the
    first grad), ``scaler.step``, ``scaler.update``; returns the loss. ``deferred``: the step
    runs asynchronously, so also check that ``scaler.step`` returned None."""
    opt.zero_grad()
    loss = mse(model, x, y)
    scaler.scale(loss).backward()
    if inject:
        next(model.parameters()).grad.view(-1)[0] = float("inf")
    ret = scaler.step(opt)
    if deferred:
        assert ret is None
    scaler.update()
    return loss


def small_mlp(dtype=torch.float32, seed=0):
    """Linear(4, 6), Tanh, Linear(6, 2) in ``dtype``, initialised from ``seed`` (the models of
    test_master_groups.py, test_async_step.py and test_scaler_thread.py)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).to(dtype)


def seeded_loss(model, i):
    """The fp32 mean square of ``model`` on batch ``i`` (8x4, drawn from seed 100 + i, in the
    model's dtype)."""
    g = torch.Generator().manual_seed(100 + i)
    x = torch.randn(8, 4, generator=g)
    return model(x.to(next(model.parameters()).dtype)).float().pow(2).mean()
