"""An LR scheduler attached to an optimizer replaces its ``step`` with a wrapper bound (by a weak
reference) to that optimizer. torch's optimizers leave that wrapper out of pickles and copies;
fp16kit's must too: pickling used to fail, and ``copy.deepcopy`` gave a copy whose ``step()``
stepped the *original* optimizer -- the copy silently never trained."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from fp16kit.legacy.contrib.optimizers import FP16_Optimizer
from fp16kit.legacy.contrib.optimizers import FusedAdam as ContribFusedAdam
from fp16kit.legacy.optimizers import FusedAdagrad, FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD
from fp16kit.optim import LAMB, SGD, Adagrad, Adam, LegacyAdam, NovoGrad

MAKERS = {
    "Adam": lambda ps: Adam(ps, lr=0.1),
    "LAMB": lambda ps: LAMB(ps, lr=0.1),
    "NovoGrad": lambda ps: NovoGrad(ps, lr=0.1),
    "Adagrad": lambda ps: Adagrad(ps, lr=0.1),
    "SGD": lambda ps: SGD(ps, lr=0.1, momentum=0.9),
    "LegacyAdam": lambda ps: LegacyAdam(ps, lr=0.1),
    "FusedAdam": lambda ps: FusedAdam(ps, lr=0.1),
    "FusedLAMB": lambda ps: FusedLAMB(ps, lr=0.1),
    "FusedNovoGrad": lambda ps: FusedNovoGrad(ps, lr=0.1),
    "FusedAdagrad": lambda ps: FusedAdagrad(ps, lr=0.1),
    "FusedSGD": lambda ps: FusedSGD(ps, lr=0.1),
    "fused-era FP16_Optimizer": lambda ps: FP16_Optimizer(ContribFusedAdam(ps, lr=0.1), static_loss_scale=1.0),
}


def _params_of(opt):
    return opt.fp16_groups[0] if isinstance(opt, FP16_Optimizer) else opt.param_groups[0]["params"]


@pytest.mark.parametrize("name", list(MAKERS))
def test_pickle_and_deepcopy_of_an_optimizer_with_a_scheduler(name):
    dtype = torch.float16 if "FP16" in name else torch.float32
    original = [torch.ones(3, dtype=dtype, requires_grad=True)]
    opt = MAKERS[name](original)
    torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    restored = pickle.loads(pickle.dumps(opt))
    copied = copy.deepcopy(opt)
    for other in (restored, copied):
        params = _params_of(other)
        for p in params:
            p.grad = torch.ones_like(p)
        other.step()
        assert not torch.equal(params[0].detach(), torch.ones(3, dtype=dtype)), "the copy did not train"
    assert torch.equal(original[0].detach(), torch.ones(3, dtype=dtype)), "a copy stepped the original"
