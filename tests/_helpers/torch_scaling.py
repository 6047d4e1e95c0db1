"""What the ports of PyTorch's GradScaler tests share (test_grad_scaler_torch_scenarios_*.py).

The ports (reproduced from PyTorch's test suite; the device-generic ones are parametrized over
``device``: "cpu" always, "cuda" marked ``cuda`` and skipped without a GPU):

* test_grad_scaler_torch_scenarios_basics.py: test/test_torch.py's unscale_, update, sparse
  grads, state_dict, scale, pickling, overflow and device-as-key scenarios; test/test_cuda.py's
  disabled scaler and its "CUDA is not available.  Disabling." warning.
* test_grad_scaler_torch_scenarios_training.py: ``_run_scaling_case`` and the scenarios built on
  it, several models and optimizers, fused optimizers, params invalidated between unscale_ and
  step; test/test_cuda.py's optimizer step protocol (a scaler passing itself, a preset
  grad_scale, a fused step skipping on inf).
* test_grad_scaler_torch_scenarios_cuda.py: test/test_cuda.py's CUDA-only scenarios (multi-device
  placement, CUDA graphs).
* test_grad_scaler_torch_scenarios_contract.py: the "(contract)" checks, not ports of a specific
  torch test: they pin torch's documented state machine, error types/texts and warning locations.

Every test runs twice: against ``torch.amp.GradScaler`` (which validates the scenario) and
against ``fp16kit.GradScaler`` (which must behave identically): each of those modules sets
``pytestmark = pytest.mark.parametrize("scaler_cls", SCALER_CLASSES)`` and imports the autouse
``_seed`` fixture from here.
"""

from __future__ import annotations

import pytest
import torch

import fp16kit

_NEEDS_CUDA = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=_NEEDS_CUDA),
]

# Every device-generic scenario takes `device` ("cpu" / "cuda"); as the outermost decorator it
# lands just before scaler_cls in the test id: test_x[...-cpu-fp16kit], test_x[...-cuda-torch].
on_devices = pytest.mark.parametrize("device", DEVICES)

# torch's tests autocast to float16 on CUDA; the CPU ports have always used float16 (torch.half)
# too (the default CPU autocast dtype would be bfloat16).
AUTOCAST_DTYPE = {"cpu": torch.half, "cuda": torch.float16}

SCALER_CLASSES = [
    pytest.param(torch.amp.GradScaler, id="torch"),
    pytest.param(fp16kit.GradScaler, id="fp16kit"),
]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


# ---------------------------------------------------------------------------------------------
# torch.testing._internal.common_cuda helpers. The installed torch has them, but importing
# common_cuda pulls in common_utils, which needs `expecttest` (not a dependency here), so they
# are reproduced verbatim (same shapes, same construction order, so the same RNG draws).
# ---------------------------------------------------------------------------------------------
def _create_scaling_models_optimizers(device="cuda", optimizer_ctor=torch.optim.SGD, optimizer_kwargs=None):
    # Create a module+optimizer that will use scaling, and a control module+optimizer
    # that will not use scaling, against which the scaling-enabled module+optimizer can be compared.
    mod_control = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)).to(device=device)
    mod_scaling = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)).to(device=device)
    with torch.no_grad():
        for c, s in zip(mod_control.parameters(), mod_scaling.parameters(), strict=True):
            s.copy_(c)

    kwargs = {"lr": 1.0}
    if optimizer_kwargs is not None:
        kwargs.update(optimizer_kwargs)
    opt_control = optimizer_ctor(mod_control.parameters(), **kwargs)
    opt_scaling = optimizer_ctor(mod_scaling.parameters(), **kwargs)

    return mod_control, mod_scaling, opt_control, opt_scaling


def _create_scaling_case(device="cuda", dtype=torch.float, optimizer_ctor=torch.optim.SGD, optimizer_kwargs=None):
    data = [
        (torch.randn((8, 8), dtype=dtype, device=device), torch.randn((8, 8), dtype=dtype, device=device)),
        (torch.randn((8, 8), dtype=dtype, device=device), torch.randn((8, 8), dtype=dtype, device=device)),
        (torch.randn((8, 8), dtype=dtype, device=device), torch.randn((8, 8), dtype=dtype, device=device)),
        (torch.randn((8, 8), dtype=dtype, device=device), torch.randn((8, 8), dtype=dtype, device=device)),
    ]

    loss_fn = torch.nn.MSELoss().to(device)

    skip_iter = 2

    return _create_scaling_models_optimizers(
        device=device, optimizer_ctor=optimizer_ctor, optimizer_kwargs=optimizer_kwargs
    ) + (data, loss_fn, skip_iter)


def _assert_equal(actual, expected, *, rtol=None, atol=None, msg=None):
    """torch's TestCase.assertEqual for the cases used here: numbers and tensors (values only,
    dtype/device not compared, as assertEqual does for a tensor against a number)."""
    if not isinstance(expected, torch.Tensor):
        expected = torch.full_like(actual, expected) if isinstance(actual, torch.Tensor) else expected
    if not isinstance(actual, torch.Tensor):
        assert actual == expected, msg
        return
    torch.testing.assert_close(
        actual,
        expected,
        rtol=rtol,
        atol=atol,
        check_dtype=False,
        check_device=False,
        equal_nan=True,
        msg=msg,
    )


# ---------------------------------------------------------------------------------------------
# Fused optimizers (the _step_supports_amp_scaling protocol): the training scenarios and the
# CUDA graph scenarios
# ---------------------------------------------------------------------------------------------
_FUSED_OPTIM_INPUTS = [
    pytest.param(torch.optim.Adam, {}, id="Adam"),
    pytest.param(torch.optim.Adam, {"lr": 0.01, "weight_decay": 0.1, "amsgrad": True}, id="Adam-wd-amsgrad"),
    pytest.param(torch.optim.Adam, {"lr": 0.01, "maximize": True}, id="Adam-maximize"),
    pytest.param(torch.optim.AdamW, {}, id="AdamW"),
    pytest.param(torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1, "amsgrad": True}, id="AdamW-wd-amsgrad"),
    pytest.param(torch.optim.SGD, {"lr": 0.01}, id="SGD"),
    pytest.param(torch.optim.SGD, {"lr": 0.01, "momentum": 0.9, "weight_decay": 0.1}, id="SGD-momentum"),
    pytest.param(torch.optim.SGD, {"lr": 0.01, "momentum": 0.9, "nesterov": True}, id="SGD-nesterov"),
]
