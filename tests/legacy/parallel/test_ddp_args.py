"""apex.parallel.DistributedDataParallel's arguments on torch's DDP, in one process (docs/apex-others.md §4.1);
the arithmetic with two ranks is in test_two_ranks.py."""

from __future__ import annotations

import logging
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist

from fp16kit.core import log as fp16kit_log
from fp16kit.legacy import parallel
from fp16kit.legacy.parallel import DistributedDataParallel, ReduceOp, Reducer, SyncBatchNorm, multiproc


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"shared_param": True},
            r"^shared_param is no longer supported as an option\.  It was misleadingly named from the start\.  It turns "
            r"out overlapping communication with computation should work fine with shared parameters\.  If you still "
            r"wish to delay communication to the end of the backward pass, use delay_allreduce=True\|False instead\.$",
        ),
        (
            {"delay_allreduce": True, "allreduce_trigger_params": []},
            r"^Setting allreduce_trigger_params is only valid if delay_allreduce=False\.$",
        ),
        (
            {"delay_allreduce": True, "num_allreduce_streams": 2},
            r"^self\.allreduce_different_streams may only be used if delay_allreduce=False\.$",
        ),
        ({"gradient_predivide_factor": 0}, "gradient_predivide_factor must be a number > 0"),
    ],
)
def test_apex_value_errors_before_anything_is_built(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DistributedDataParallel(_model(), **kwargs)


def test_needs_a_process_group_and_says_how():
    with pytest.raises(RuntimeError, match="init_process_group"):
        DistributedDataParallel(_model())


def test_is_torch_ddp_with_apex_mapping(gloo_world, caplog):
    for key in ("delay_allreduce", "retain_allreduce_buffers", "message_size", "num_allreduce_streams"):
        fp16kit_log._seen.discard(("apex.parallel.DistributedDataParallel", key))
    model = _model()
    with caplog.at_level(logging.INFO, logger="fp16kit"), warnings.catch_warnings():
        warnings.simplefilter("error")  # no deprecation warning, no FutureWarning from torch
        ddp = DistributedDataParallel(
            model,
            delay_allreduce=True,
            retain_allreduce_buffers=True,
            message_size=1000,
            gradient_average_split_factor=3,
            prof=True,
        )
        DistributedDataParallel(_model(), delay_allreduce=True, num_allreduce_streams=1)
    assert isinstance(ddp, torch.nn.parallel.DistributedDataParallel) and ddp.module is model
    assert ddp.find_unused_parameters and ddp.gradient_as_bucket_view and ddp.device_ids is None
    assert getattr(ddp, "forward_sync_buffers", getattr(ddp, "broadcast_buffers", None)) is False
    for key in ("delay_allreduce", "retain_allreduce_buffers", "message_size"):
        assert caplog.text.count(f"DistributedDataParallel({key})") == 1, caplog.text
    assert "num_allreduce_streams" not in caplog.text and "prof" not in caplog.text
    assert all(k.startswith("module.") for k in ddp.state_dict())


def test_disable_allreduce_is_no_sync(gloo_world):
    ddp = DistributedDataParallel(_model())
    ddp.disable_allreduce()
    assert ddp.require_backward_grad_sync is False
    ddp(torch.randn(5, 4)).sum().backward()
    ddp.enable_allreduce()
    assert ddp.require_backward_grad_sync is True
    ddp(torch.randn(5, 4)).sum().backward()


def test_one_rank_gradients_are_local_gradients_after_apex_scaling(gloo_world):
    model = _model()
    ref = _model()
    ddp = DistributedDataParallel(model, gradient_predivide_factor=3.0)
    x = torch.randn(6, 4)
    ddp(x).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    for p, r in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, r.grad.mul(1.0 / 3.0).mul(3.0 / 1))


def test_reducer_in_one_rank(gloo_world):
    model = _model()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    Reducer(model).reduce()
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in model.parameters())
    tensors = {"a": [torch.full((2,), 3.0), None], "b": (torch.ones(3, dtype=torch.float16),)}
    reducer = Reducer(tensors)
    assert len(reducer.grads) == 2
    reducer.reduce()


def test_names_and_groups(gloo_world):
    assert ReduceOp is dist.ReduceOp
    assert parallel.LARC.LARC.__name__ == "LARC"
    assert parallel.create_syncbn_process_group(0) is None
    assert parallel.create_syncbn_process_group(1) is not None
    with pytest.raises(ValueError, match="multiple of group_size"):
        parallel.create_syncbn_process_group(2)
    from fp16kit.legacy.parallel import optimized_sync_batchnorm, sync_batchnorm

    assert sync_batchnorm.SyncBatchNorm is optimized_sync_batchnorm.SyncBatchNorm is SyncBatchNorm


def test_convert_syncbn_model_reuses_parameters_fix():
    model = _model()
    weight = model[1].weight
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model.eval()
    model = parallel.convert_syncbn_model(model, channel_last=True)
    assert isinstance(model[1], SyncBatchNorm) and model[1].channel_last and not model[1].training
    assert model[1].weight is weight  # apex made new Parameters that `opt` no longer saw
    model[1].weight.grad = torch.ones(3)
    opt.step()
    assert torch.equal(model[1].weight, torch.zeros(3))


def test_multiproc_points_to_torchrun():
    with pytest.raises(RuntimeError, match="torchrun --nproc_per_node"):
        multiproc.main()
    done = subprocess.run(
        [sys.executable, "-m", "fp16kit.legacy.parallel.multiproc", "train.py"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1 and "torchrun" in done.stderr


def test_gradient_average_split_factor_is_apex_old_name_for_predivide(gloo_world, caplog):
    key = ("apex.parallel.DistributedDataParallel", "gradient_average_split_factor")
    fp16kit_log._seen.discard(key)
    model, ref = _model(), _model()
    with caplog.at_level(logging.INFO, logger="fp16kit"):
        ddp = DistributedDataParallel(model, gradient_average=False, gradient_average_split_factor=4.0)
        DistributedDataParallel(_model(), gradient_average_split_factor=2.0)
    assert ddp.gradient_predivide_factor == 4.0
    assert caplog.text.count("gradient_average_split_factor has been renamed to gradient_predivide_factor") == 1
    x = torch.randn(6, 4)
    ddp(x).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    for p, r in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, r.grad.mul(1.0 / 4.0))  # predivided, never re-multiplied
    with pytest.raises(ValueError, match="gradient_predivide_factor must be a number > 0"):
        DistributedDataParallel(_model(), gradient_average_split_factor=0)


def test_arithmetic_arguments_assigned_later_take_effect(gloo_world):
    model, ref = _model(), _model()
    ddp = DistributedDataParallel(model)
    ddp.gradient_predivide_factor = 4.0
    ddp.gradient_average = False
    assert (ddp.gradient_predivide_factor, ddp.gradient_average) == (4.0, False)
    x = torch.randn(6, 4)
    ddp(x).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    for p, r in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, r.grad.mul(1.0 / 4.0))
    with pytest.raises(ValueError, match="gradient_predivide_factor must be a number > 0"):
        ddp.gradient_predivide_factor = -1.0
    assert ddp.gradient_predivide_factor == 4.0


def test_allreduce_always_fp32_assigned_later_takes_effect(gloo_world):
    torch.manual_seed(1)
    model = torch.nn.Linear(16, 8).half()
    ref = torch.nn.Linear(16, 8).half()
    ref.load_state_dict(model.state_dict())
    ddp = DistributedDataParallel(model, gradient_predivide_factor=3.0)
    ddp.allreduce_always_fp32 = True
    assert ddp.allreduce_always_fp32 is True
    x = torch.randn(32, 16).half()
    ddp(x).float().pow(2).sum().backward()
    ref(x).float().pow(2).sum().backward()
    half_path = [r.grad.mul(1.0 / 3.0).mul(3.0) for r in ref.parameters()]
    fp32_path = [r.grad.float().mul(1.0 / 3.0).mul(3.0).half() for r in ref.parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(half_path, fp32_path))  # the test can tell them apart
    for p, expected in zip(model.parameters(), fp32_path):
        assert torch.equal(p.grad, expected)


def test_multiproc_names_the_given_script_and_arguments():
    with pytest.raises(RuntimeError, match=r"torchrun --nproc_per_node=NUM_GPUS train\.py --lr 0\.1 'a b'"):
        multiproc.main(["train.py", "--lr", "0.1", "a b"])
    with pytest.raises(RuntimeError, match=r"torchrun --nproc_per_node=NUM_GPUS train\.py ARGS"):
        multiproc.main([])
    done = subprocess.run(
        [sys.executable, "-m", "fp16kit.legacy.parallel.multiproc", "main.py", "--fp16"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1 and "torchrun --nproc_per_node=NUM_GPUS main.py --fp16" in done.stderr
