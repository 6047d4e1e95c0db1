"""PyTorch's own GradScaler test scenarios, ported to pytest, run on CPU and (when present) CUDA.

Sources (reproduced from PyTorch's test suite; the device-generic ones are parametrized over
``device``: "cpu" always, "cuda" marked ``cuda`` and skipped without a GPU):

* test/test_torch.py (TestTorchDeviceType): ``test_grad_scaling_unscale``,
  ``test_grad_scaling_update_scale``, ``test_grad_scaling_unscale_sparse``,
  ``test_grad_scaling_state_dict``, ``test_grad_scaling_scale``, ``test_pickle_gradscaler``,
  ``test_grad_scale_will_not_overflow``, ``_run_scaling_case`` and the scenarios built on it
  (``test_grad_scaling_autocast`` with foreach/fused variants for SGD/Adam/AdamW,
  ``test_grad_scaling_clipping``, ``test_grad_scaling_clipping_separate_unscale``,
  ``test_grad_scaling_penalty``, ``test_grad_scaling_accumulation``),
  ``test_grad_scaling_multiple``, ``test_grad_scaling_autocast_fused_optimizers``,
  ``test_params_invalidated_with_grads_invalidated_between_unscale_and_step``,
  ``test_grad_scaling_device_as_key``.
* test/test_cuda.py: ``test_grad_scaler_pass_itself``,
  ``test_grad_scaler_with_preset_grad_scale``, ``test_grad_scaling_scale`` (nested iterables,
  multi-device placement: CUDA-only here), ``test_graph_grad_scaling`` and
  ``test_graph_scaling_fused_optimizers`` (CUDA graphs: CUDA-only), the "CUDA is not available.
  Disabling." warning and the behaviour of a disabled scaler.

Every test runs twice: against ``torch.amp.GradScaler`` (which validates the scenario) and
against ``fp16kit.GradScaler`` (which must behave identically). The few checks at the end marked
"(contract)" are not ports of a specific torch test; they pin torch's documented state machine,
error types/texts and warning locations, and they too must pass for torch's class.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import pickle
import warnings
from itertools import chain

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

pytestmark = pytest.mark.parametrize("scaler_cls", SCALER_CLASSES)

@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


# ---------------------------------------------------------------------------------------------
# torch.testing._internal.common_cuda helpers. The installed torch has them, but importing
# common_cuda pulls in common_utils, which needs `expecttest` (not a dependency here), so they
# are reproduced verbatim (same shapes, same construction order, so the same RNG draws).
# ---------------------------------------------------------------------------------------------
def _create_scaling_models_optimizers(
    device="cuda", optimizer_ctor=torch.optim.SGD, optimizer_kwargs=None
):
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


def _create_scaling_case(
    device="cuda", dtype=torch.float, optimizer_ctor=torch.optim.SGD, optimizer_kwargs=None
):
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
        actual, expected, rtol=rtol, atol=atol, check_dtype=False, check_device=False,
        equal_nan=True, msg=msg,
    )


# ---------------------------------------------------------------------------------------------
# test_torch.py: unscale / update_scale / sparse / state_dict / scale / pickle / overflow
# ---------------------------------------------------------------------------------------------
@on_devices
def test_grad_scaling_unscale(scaler_cls, device, dtype=torch.float):
    device = torch.device(device)
    device0 = "cuda:0" if device.type == "cuda" else "cpu"
    inv_scale = torch.full((1,), 0.25, dtype=torch.float, device=device0)
    found_inf = torch.full((1,), 0.0, dtype=torch.float, device=device0)

    size = 20
    g = torch.full((size, size), 4.0, dtype=dtype, device=device0)
    ginf = g.clone()
    ginf[2, 2] = float("inf")
    gnan = g.clone()
    gnan[2, 2] = float("nan")

    # Tries selected combinations of
    #  - contiguous grads
    #  - g.clone().t() which is not contiguous but still non overlapping and dense
    #  - variants of g.clone()[:, :5] which are not non overlapping and dense
    # Non overlapping and dense grads route into a multi tensor apply kernel,
    # others use a fallback per-tensor kernel, so we should try both.
    cases = (
        ([g.clone(), g.clone()], False),
        ([g.clone(), g.clone().t()], False),
        ([g.clone(), g.clone()[:, :5]], False),
        ([g.clone()[:, :5], g.clone()[:, :5]], False),
        ([g.clone(), ginf.clone()], True),
        ([g.clone(), gnan.clone()], True),
        ([g.clone(), ginf.clone()[:, :5]], True),
        ([g.clone(), gnan.clone()[:, :5]], True),
        ([ginf.clone(), g.clone()[:, :5]], True),
        ([ginf.clone()[:, :5], g.clone()[:, :5]], True),
    )

    for grads, has_inf in cases:
        found_inf.zero_()
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        if has_inf:
            _assert_equal(found_inf, 1.0)
        else:
            _assert_equal(found_inf, 0.0)
            for grad in grads:
                _assert_equal(grad, torch.ones_like(grad), rtol=1e-5, atol=1e-7)

    # When passing lists with mismatched dtypes to a raw
    # _amp_foreach_non_finite_check_and_unscale_ call,
    # it's expected to fall back to single-tensor TensorIterator kernel.
    grads = [g.clone(), g.to(dtype=torch.float16)]
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
    for grad in grads:
        _assert_equal(grad, torch.ones_like(grad), rtol=1e-5, atol=1e-7)

    # Creates a list of grads with mismatched dtypes and devices, to ensure
    # scaler._unscale_grads_ organizes grads by dtype and device before calling
    # _amp_foreach_non_finite_check_and_unscale_ on each set.
    # If inject_inf >= 0, writes an inf into one grad for _unscale_grads_ to find.
    def perfect_storm_grads(inject_inf):
        grads = [g.clone(), g.clone()[:, :5], g.to(dtype=torch.float16), g.to(dtype=torch.float16)]
        if inject_inf >= 0:
            grads[inject_inf][2, 2] = float("inf")
        return grads

    scaler = scaler_cls(device=device.type)
    dummy_params = [torch.empty_like(g) for g in perfect_storm_grads(-1)]
    dummy_opt = torch.optim.SGD(dummy_params, lr=1.0)

    # Ensures the inf/nan checking can find an inf injected onto any grad in the perfect storm.
    for inject_inf in range(-1, len(dummy_params)):
        found_inf = torch.full((1,), 0.0, dtype=torch.float, device=device0)
        grads = perfect_storm_grads(inject_inf)
        for i, p in enumerate(dummy_params):
            p.grad = grads[i]
        found_inf_per_device = scaler._unscale_grads_(dummy_opt, inv_scale, found_inf, True)
        if inject_inf < 0:
            # No inf was injected, ensures unscaling worked normally.
            assert sum(v.item() for v in found_inf_per_device.values()) == 0
            for grad in grads:
                _assert_equal(grad, torch.ones_like(grad), rtol=1e-5, atol=1e-7)
        else:
            # inf was injected, ensures inf was found.
            assert sum(v.item() for v in found_inf_per_device.values()) == 1


@on_devices
def test_grad_scaling_update_scale(scaler_cls, device):
    # torch's test drives torch._amp_update_scale_ directly; the same sequence is run here
    # through the scaler (whose update() must apply exactly that rule to _scale/_growth_tracker).
    growth = 2.0
    backoff = 0.25
    growth_interval = 2
    scale = torch.full((1,), 4.0, dtype=torch.float, device=device)
    growth_tracker = torch.full((1,), 0.0, dtype=torch.int32, device=device)
    found_inf = torch.full((1,), 0.0, dtype=torch.float, device=device)

    # Simulates 2 consecutive unskipped iterations
    torch._amp_update_scale_(scale, growth_tracker, found_inf, growth, backoff, growth_interval)
    _assert_equal(growth_tracker, 1)
    _assert_equal(scale, 4.0)
    torch._amp_update_scale_(scale, growth_tracker, found_inf, growth, backoff, growth_interval)
    _assert_equal(growth_tracker, 0)
    _assert_equal(scale, 8.0)

    # Simulates a skipped iteration
    found_inf.fill_(1.0)
    torch._amp_update_scale_(scale, growth_tracker, found_inf, growth, backoff, growth_interval)
    _assert_equal(growth_tracker, 0)
    _assert_equal(scale, 2.0)

    # The same through the scaler.
    scaler = scaler_cls(
        device, init_scale=4.0, growth_factor=growth, backoff_factor=backoff,
        growth_interval=growth_interval,
    )
    p = torch.zeros(3, device=device, requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.0)

    def iteration(bad):
        opt.zero_grad()
        scaler.scale((p * 1.0).sum()).backward()
        if bad:
            with torch.no_grad():
                p.grad[0] = float("inf")
        scaler.step(opt)
        scaler.update()

    iteration(False)
    _assert_equal(scaler._growth_tracker, 1)
    _assert_equal(scaler._scale, 4.0)
    assert scaler._get_growth_tracker() == 1
    iteration(False)
    _assert_equal(scaler._growth_tracker, 0)
    _assert_equal(scaler._scale, 8.0)
    iteration(True)
    _assert_equal(scaler._growth_tracker, 0)
    _assert_equal(scaler._scale, 2.0)
    assert scaler.get_scale() == 2.0
    assert scaler._scale.dtype == torch.float32 and scaler._scale.dim() == 0
    assert scaler._growth_tracker.dtype == torch.int32 and scaler._growth_tracker.dim() == 0


@on_devices
@pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning")
def test_grad_scaling_unscale_sparse(scaler_cls, device, dtype=torch.float):
    device = torch.device(device)
    scaler = scaler_cls(device=device.type)

    inv_scale = torch.full((1,), 0.25, dtype=dtype, device=device)
    found_inf = torch.empty((1,), dtype=dtype, device=device)
    cur = found_inf.device

    i = torch.tensor([[0, 1, 1], [2, 0, 2]], device=device, dtype=torch.int64)
    v = torch.tensor([16.0, 32.0, 64.0], device=device, dtype=torch.float)
    s = torch.sparse_coo_tensor(i, v, torch.Size([2, 3]), device=device, dtype=dtype)

    p = s.clone()
    assert p.is_sparse
    opt = torch.optim.SGD([p], lr=1.0)

    p.grad = s.clone()
    found_inf.zero_()
    found_inf = scaler._unscale_grads_(opt, inv_scale, found_inf, False)[cur]
    _assert_equal(found_inf, 0.0)
    _assert_equal(p.grad.to_dense(), (s / 4).to_dense())

    v = torch.FloatTensor([16.0, 32.0, float("inf")])
    p.grad = torch.sparse_coo_tensor(i, v, torch.Size([2, 3]), device=device, dtype=dtype)
    found_inf.zero_()
    found_inf = scaler._unscale_grads_(opt, inv_scale, found_inf, False)[cur]
    _assert_equal(found_inf, 1.0)

    v = torch.FloatTensor([16.0, 32.0, float("nan")])
    p.grad = torch.sparse_coo_tensor(i, v, torch.Size([2, 3]), device=device, dtype=dtype)
    found_inf.zero_()
    found_inf = scaler._unscale_grads_(opt, inv_scale, found_inf, False)[cur]
    _assert_equal(found_inf, 1.0)

    p = s.clone().half()
    assert p.is_sparse
    opt = torch.optim.SGD([p], lr=1.0)

    p.grad = s.clone().half()
    found_inf.zero_()
    found_inf = scaler._unscale_grads_(opt, inv_scale, found_inf, True)[cur]
    _assert_equal(found_inf, 0.0)
    _assert_equal(p.grad.to_dense(), (s.half() / 4).to_dense())

    # Creates fp16 sparse tensor with duplicated indices (uncoalesced).  The uncoalesced representation
    # does not overflow in fp16, but the coalesced representation would, because 64000 + 64000 > fp16 max.
    # _amp_non_finite_check_and_unscale_ should report an overflow here.
    i = torch.LongTensor([[0, 1, 0], [2, 0, 2]])
    v = torch.FloatTensor([64000.0, 32.0, 64000.0])
    p.grad = torch.sparse_coo_tensor(i, v, torch.Size([2, 3]), device=device, dtype=torch.float16)
    found_inf.zero_()
    found_inf = scaler._unscale_grads_(opt, inv_scale, found_inf, True)[cur]
    _assert_equal(found_inf, 1.0)
    # (the fp16 grad was replaced by its coalesced version)
    assert p.grad.is_coalesced()


@on_devices
@pytest.mark.parametrize("lazy_init_scale", [True, False])
def test_grad_scaling_state_dict(scaler_cls, device, lazy_init_scale):
    device = torch.device(device)
    s0 = scaler_cls(device.type, init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
    s1 = scaler_cls(device.type, init_scale=6.0, growth_factor=7.0, backoff_factor=0.8, growth_interval=1)

    # sets a random value for load_state_dict to overwrite
    s1._init_growth_tracker = 7

    if lazy_init_scale:
        # Dummy scale() call to ensure the scale tensor is lazily initialized.
        s1.scale(torch.full((1,), 4.0, dtype=torch.float32, device=device))
        if device.type == "cuda":
            assert isinstance(s1._scale, torch.cuda.FloatTensor)
        else:
            assert isinstance(s1._scale, torch.FloatTensor)

    sd = s0.state_dict()
    assert list(sd) == ["scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"]
    assert sd == {
        "scale": 3.0, "growth_factor": 4.0, "backoff_factor": 0.5,
        "growth_interval": 2, "_growth_tracker": 0,
    }
    s1.load_state_dict(sd)

    assert s1.get_scale() == 3.0
    assert s1.get_growth_factor() == 4.0
    assert s1.get_backoff_factor() == 0.5
    assert s1.get_growth_interval() == 2
    assert s1._init_growth_tracker == 0
    if lazy_init_scale:
        _assert_equal(s1._scale, 3.0)
        _assert_equal(s1._growth_tracker, 0)


@on_devices
def test_grad_scaling_state_dict_cross_load(scaler_cls, device):
    # A drop-in must accept torch's state dicts and produce ones torch accepts.
    other_cls = fp16kit.GradScaler if scaler_cls is torch.amp.GradScaler else torch.amp.GradScaler
    src = other_cls(device, init_scale=32.0, growth_factor=3.0, backoff_factor=0.25, growth_interval=5)
    src.scale(torch.ones((), device=device))
    src._growth_tracker.fill_(3)
    dst = scaler_cls(device)
    dst.load_state_dict(src.state_dict())
    assert dst.state_dict() == src.state_dict()
    back = other_cls(device)
    back.load_state_dict(dst.state_dict())
    assert back.state_dict() == src.state_dict()


@on_devices
def test_grad_scaling_scale(scaler_cls, device):
    device = torch.device(device)
    scaler = scaler_cls(device.type, init_scale=2.0)
    t0 = torch.full((1,), 4.0, dtype=torch.float32, device=device)
    t1 = torch.full((1,), 4.0, dtype=torch.float32, device=device)
    # Create some nested iterables of tensors on different devices.
    outputs = (t1.clone(), (t0.clone(), t1.clone()), [t0.clone(), (t1.clone(), t0.clone())])
    outputs = scaler.scale(outputs)
    assert (
        outputs[0] == 8.0 and outputs[1][0] == 8.0 and outputs[1][1] == 8.0
        and outputs[2][0] == 8.0 and outputs[2][1][0] == 8.0 and outputs[2][1][1] == 8.0
    )
    assert scaler._scale.device == t1.device
    # container types are preserved
    assert type(outputs) is tuple and type(outputs[1]) is tuple
    assert type(outputs[2]) is list and type(outputs[2][1]) is tuple
    # single tensor
    out = scaler.scale(torch.full((2, 2), 3.0, device=device))
    _assert_equal(out, 6.0)
    # other iterables come back as a lazy iterator
    gen_out = scaler.scale(t for t in (t0.clone(), t1.clone()))
    assert not isinstance(gen_out, (list, tuple))
    assert [x.item() for x in gen_out] == [8.0, 8.0]
    with pytest.raises(ValueError, match="outputs must be a Tensor or an iterable of Tensors"):
        scaler.scale([t0, 1.0])


@on_devices
@pytest.mark.parametrize("lazy_init_scale", [True, False])
def test_pickle_gradscaler(scaler_cls, device, lazy_init_scale):
    # This test should pass in 3 cases for cuda:
    #  1. cuda is not available.
    #  2. cuda is available but device is not cuda.
    #  3. cuda is available and device is cuda.
    # In case 1, a and b disable themselves on construction and shouldn't try to pickle workhorse attributes.
    # In case 2, a and b are enabled.  Workhorse attributes participate in pickling, but none are lazy-inited
    # to cuda Tensors, because I don't want to do cuda things if device is not cuda.
    # In case 3, a and b are enabled and we may also try lazy-initing _scale to a cuda tensor.
    # (Case 1 is test_pickle_gradscaler_cuda_unavailable below.)
    device = torch.device(device)
    a = scaler_cls(device.type, init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
    assert a.is_enabled()
    if lazy_init_scale:
        # Dummy a.scale() call lazy-inits a._scale Tensor.
        a.scale(torch.tensor([4.0], dtype=torch.float32, device=device))
        assert a._scale.device.type == device.type
    # The following three lines should work whether or not cuda is available.
    serialized = pickle.dumps(a)
    b = pickle.loads(serialized)
    assert type(b) is scaler_cls
    assert b.is_enabled() == a.is_enabled()
    if a.is_enabled():
        assert b.get_scale() == 3.0
        assert b.get_growth_factor() == 4.0
        assert b.get_backoff_factor() == 0.5
        assert b.get_growth_interval() == 2
        assert b._init_growth_tracker == 0
        # supplies a dummy key to test the defaultdict's default_factory
        assert b._per_optimizer_states["fdsa"] == torch.amp.grad_scaler._refresh_per_optimizer_state()
        if lazy_init_scale:
            _assert_equal(b.scale(torch.tensor([4.0], dtype=torch.float32, device=device)), 12.0)


def test_pickle_gradscaler_cuda_unavailable(scaler_cls):
    # Case 1 of test_pickle_gradscaler: device="cuda" without CUDA disables the scaler.
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: the scaler would not disable itself")
    with pytest.warns(UserWarning, match="CUDA is not available"):
        a = scaler_cls("cuda", init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
    assert not a.is_enabled()
    b = pickle.loads(pickle.dumps(a))
    assert b.is_enabled() == a.is_enabled() is False
    assert b.get_scale() == 1.0


@on_devices
def test_pickle_gradscaler_mid_iteration_refused(scaler_cls, device):
    # Same scaler, pickled between step() and update(): torch refuses.
    scaler = scaler_cls(device, init_scale=4.0)
    p = torch.ones(2, device=device, requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.1)
    scaler.scale(p.sum()).backward()
    scaler.step(opt)
    with pytest.raises(AssertionError, match="may only be pickled at the beginning"):
        pickle.dumps(scaler)
    scaler.update()
    b = pickle.loads(pickle.dumps(scaler))
    assert b.get_scale() == scaler.get_scale()
    assert b._get_growth_tracker() == scaler._get_growth_tracker() == 1


@on_devices
def test_grad_scale_will_not_overflow(scaler_cls, device):
    device = torch.device(device)
    model = torch.nn.Linear(5, 1).to(device)
    optimizer = torch.optim.Adam(model.parameters())
    scaler = scaler_cls(device=device.type, growth_interval=1, growth_factor=2**4, init_scale=1e38)
    optimizer.zero_grad()
    x = torch.randn(1, 5).to(device)
    y = 1e-30 * torch.randn(1, 1).to(device)
    l = ((model(x) - y) ** 2).mean()  # noqa: E741
    scaler.scale(l).backward()
    scaler.step(optimizer)
    scaler.update()
    assert scaler._scale != float("inf") and scaler._scale != float("nan")
    assert torch.isfinite(scaler._scale)


@on_devices
def test_grad_scaling_device_as_key(scaler_cls, device):
    # Ensure that different instances of "device" objects that point to the same device
    # are treated as identical keys by dicts.  GradScaler relies on this behavior, and may
    # error otherwise in a way that's difficult to detect (a silent performance hit).
    d = {}
    t = torch.empty((1,), device=device)
    # A tensor's device carries an index on CUDA ("cuda:0") and none on CPU ("cpu").
    dev_str = "cuda:0" if device == "cuda" else "cpu"
    dev0a = torch.device(dev_str)
    dev0b = torch.device(dev_str)
    assert hash(dev0a) == hash(dev0b)
    d[dev0a] = "0a"
    d[dev0b] = "0b"
    assert len(d) == 1
    assert d[dev0a] == "0b"
    d[t.device] = "t"
    assert len(d) == 1
    assert d[dev0a] == "t"

    # ... and the scaler keys its per-device found_inf flags that way (one entry per device).
    scaler = scaler_cls(device)
    params = [
        torch.zeros(3, device=device, requires_grad=True),
        torch.zeros(2, dtype=torch.float64, device=device, requires_grad=True),
    ]
    opt = torch.optim.SGD(params, lr=1.0)
    scaler.scale(sum(p.sum() for p in params)).backward()
    scaler.unscale_(opt)
    per_device = scaler._found_inf_per_device(opt)
    assert list(per_device) == [torch.device(dev_str)]
    assert per_device[dev0a].item() == 0.0


# ---------------------------------------------------------------------------------------------
# _run_scaling_case and the single-optimizer scenarios built on it
# ---------------------------------------------------------------------------------------------
def _run_scaling_case(
    scaler_cls, device, run, unskipped, skipped, atol=1e-7, optimizer_ctor=torch.optim.SGD,
    optimizer_kwargs=None,
):
    # Ensure scaling can be disabled without changing user control flow.
    for enabled in True, False:
        (
            mod_control, mod_scaling, opt_control, opt_scaling, data, loss_fn, skip_iter,
        ) = _create_scaling_case(device=device, optimizer_ctor=optimizer_ctor, optimizer_kwargs=optimizer_kwargs)

        # For functionality, test with a modest initial scale, and an unrealistically-large growth factor
        # so any potential errors with the growth factor handling will be magnified.
        scaler = scaler_cls(device, init_scale=128.0, growth_factor=2.0, enabled=enabled, growth_interval=1)

        _ = run(device, data, mod_control, opt_control, scaler, loss_fn, skip_iter, False)
        ret = run(device, data, mod_scaling, opt_scaling, scaler, loss_fn, skip_iter, True)

        # Allows run() to optionally return a different scaler instance.
        scaler = ret if ret else scaler
        assert isinstance(scaler, scaler_cls)

        # If scaling was enabled, the scale factor should have been multiplied by the growth factor
        # len(data) - skipped times and the backoff factor "skipped" times.
        if enabled:
            net_growth = scaler.get_growth_factor() ** unskipped if unskipped > 0 else 1.0
            net_backoff = scaler.get_backoff_factor() ** skipped if skipped > 0 else 1.0
            assert scaler.get_scale() == (128.0 * net_growth * net_backoff)
        else:
            assert scaler.get_scale() == 1.0

        for c, s in zip(mod_control.parameters(), mod_scaling.parameters()):
            _assert_equal(c.grad, s.grad, atol=atol, rtol=1e-05)

            c_state, s_state = opt_control.state[c], opt_scaling.state[s]
            for k in c_state:
                _assert_equal(c_state[k], s_state[k], atol=atol, rtol=1e-05, msg=k)

            _assert_equal(c, s, atol=atol, rtol=1e-05)


_AUTOCAST_OPTIMS = [
    pytest.param(torch.optim.SGD, id="SGD"),
    pytest.param(torch.optim.Adam, id="Adam"),
    pytest.param(torch.optim.AdamW, id="AdamW"),
]


# Compares no scaling + no autocasting against scaling + autocasting.
@on_devices
@pytest.mark.parametrize(
    "foreach, fused", [(None, None), (True, None), (None, True)],
    ids=["default", "foreach", "fused"],
)
@pytest.mark.parametrize("optimizer_ctor", _AUTOCAST_OPTIMS)
@pytest.mark.parametrize("try_pickle", [False, True], ids=["nopickle", "pickle"])
def test_grad_scaling_autocast(scaler_cls, device, optimizer_ctor, foreach, fused, try_pickle):
    def run(device, data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        for i, (input, target) in enumerate(data):
            optimizer.zero_grad()
            with torch.autocast(device_type=device, dtype=AUTOCAST_DTYPE[device], enabled=try_scaling_api):
                output = model(input)
                loss = loss_fn(output, target)
            if try_scaling_api:
                scaler.scale(loss).backward()
                if i == skip_iter and scaler.is_enabled():
                    with torch.no_grad():
                        model[1].weight.grad.fill_(float("inf"))
                scaler.step(optimizer)
                scaler.update()
                if try_pickle:
                    scaler = pickle.loads(pickle.dumps(scaler))
            else:
                loss.backward()
                if (not scaler.is_enabled()) or (i != skip_iter):
                    optimizer.step()
        return scaler

    # Compare non scaling optimizer step as well as scaling optimizer step. As in torch's test,
    # Adam/AdamW (whose normalised steps amplify fp16 rounding) are expected to miss the
    # tolerance; the match pins that it is the tensor comparison that fails, after the
    # scale-trajectory assertion passed.
    if optimizer_ctor in (torch.optim.Adam, torch.optim.AdamW):
        context = pytest.raises(AssertionError, match="Tensor-likes are not close")
    else:
        context = contextlib.nullcontext()
    with context:
        # sets atol=1e-3 because we're comparing pure fp32 arithmetic vs a mixture of fp16 and fp32
        _run_scaling_case(
            scaler_cls, device, run, unskipped=3, skipped=1, atol=1e-3,
            optimizer_ctor=optimizer_ctor, optimizer_kwargs={"foreach": foreach, "fused": fused},
        )

    # Drop-in check (not in torch's test): the scaled run is bit-identical to torch's scaler's.
    def scaled_run(cls):
        torch.manual_seed(0)
        _, mod_scaling, _, opt_scaling, data, loss_fn, skip_iter = _create_scaling_case(
            device=device, optimizer_ctor=optimizer_ctor,
            optimizer_kwargs={"foreach": foreach, "fused": fused},
        )
        scaler = cls(device, init_scale=128.0, growth_factor=2.0, growth_interval=1)
        scaler = run(device, data, mod_scaling, opt_scaling, scaler, loss_fn, skip_iter, True)
        return scaler.get_scale(), [p.detach().clone() for p in mod_scaling.parameters()]

    ref_scale, ref_params = scaled_run(torch.amp.GradScaler)
    got_scale, got_params = scaled_run(scaler_cls)
    assert got_scale == ref_scale
    for got, ref in zip(got_params, ref_params):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)


@on_devices
def test_grad_scaling_clipping(scaler_cls, device):
    def run(device, data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        max_norm = 0.2  # A reasonable value that actually has an effect, based on printouts of grads
        for i, (input, target) in enumerate(data):
            optimizer.zero_grad()
            output = model(input)
            loss = loss_fn(output, target)
            if try_scaling_api:
                scaler.scale(loss).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm * scaler.get_scale())
                if i == skip_iter and scaler.is_enabled():
                    model[1].weight.grad.data.fill_(float("inf"))
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                if (not scaler.is_enabled()) or (i != skip_iter):
                    optimizer.step()

    _run_scaling_case(scaler_cls, device, run, unskipped=3, skipped=1, atol=1e-5)


@on_devices
def test_grad_scaling_clipping_separate_unscale(scaler_cls, device):
    def run(device, data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        max_norm = 0.2  # A reasonable value that actually has an effect, based on printouts of grads
        for i, (input, target) in enumerate(data):
            optimizer.zero_grad()
            output = model(input)
            loss = loss_fn(output, target)
            if try_scaling_api:
                scaler.scale(loss).backward()
                if i == skip_iter and scaler.is_enabled():
                    model[1].weight.grad.data.fill_(float("inf"))
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, error_if_nonfinite=False)
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                if (not scaler.is_enabled()) or (i != skip_iter):
                    optimizer.step()

    _run_scaling_case(scaler_cls, device, run, unskipped=3, skipped=1)


@on_devices
def test_grad_scaling_penalty(scaler_cls, device):
    def run(device, data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        for i, (input, target) in enumerate(data):
            optimizer.zero_grad()
            output = model(input)
            loss = loss_fn(output, target)

            if try_scaling_api:
                grad_params = torch.autograd.grad(scaler.scale(loss), model.parameters(), create_graph=True)
                inv_scale = 1.0 / scaler.get_scale()
                grad_params = [p * inv_scale for p in grad_params]
            else:
                grad_params = torch.autograd.grad(loss, model.parameters(), create_graph=True)

            grad_norm = 0
            for grad in grad_params:
                grad_norm += grad.pow(2).sum()
            grad_norm = grad_norm.sqrt()
            loss = loss + grad_norm

            if try_scaling_api:
                scaler.scale(loss).backward()
                if i == skip_iter and scaler.is_enabled():
                    model[1].weight.grad.data.fill_(float("inf"))
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                if (not scaler.is_enabled()) or (i != skip_iter):
                    optimizer.step()

    _run_scaling_case(scaler_cls, device, run, unskipped=3, skipped=1)


@on_devices
def test_grad_scaling_accumulation(scaler_cls, device):
    def run(device, data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        iters_to_accumulate = 2
        for i, (input, target) in enumerate(data):
            output = model(input)
            loss = loss_fn(output, target)
            loss = loss / iters_to_accumulate
            if try_scaling_api:
                scaler.scale(loss).backward()
            else:
                loss.backward()
            if (i + 1) % iters_to_accumulate == 0:
                if try_scaling_api:
                    scaler.step(optimizer)
                    scaler.update()
                    optimizer.zero_grad()
                else:
                    optimizer.step()
                    optimizer.zero_grad()

    _run_scaling_case(scaler_cls, device, run, unskipped=2, skipped=0)


@on_devices
@pytest.mark.parametrize("enabled", [True, False])
def test_grad_scaling_multiple(scaler_cls, device, enabled):
    device = torch.device(device)
    # Tests gradient scaling with 2 models and 2 optimizers that both receive gradients from 2 losses.
    # Some of the logic here cannot reuse the generic helper functions created for the 1-optimizer cases.
    mod_control0, mod_scaling0, opt_control0, opt_scaling0, data, loss_fn, skip_iter = _create_scaling_case(device.type)
    mod_control1, mod_scaling1, opt_control1, opt_scaling1 = _create_scaling_models_optimizers(device.type)

    scaler = scaler_cls(device.type, init_scale=128.0, growth_factor=2.0, enabled=enabled, growth_interval=1)

    def run(model0, model1, optimizer0, optimizer1, try_scaling_api):
        for i, (input, target) in enumerate(data):
            optimizer0.zero_grad()
            optimizer1.zero_grad()
            output0 = model0(input)
            output1 = model1(input)
            loss0 = loss_fn(0.3 * output0 + 0.7 * output1, target)
            loss1 = loss_fn(0.6 * output0 - 0.4 * output1, target)

            if try_scaling_api:
                scaler.scale(loss0).backward(retain_graph=True)
                scaler.scale(loss1).backward()
                if i == skip_iter and scaler.is_enabled():
                    model1[1].weight.grad.data.fill_(float("inf"))

                # As an additional stress test, separately unscale for one of the optimizers.
                scaler.unscale_(optimizer0)

                scaler.step(optimizer0)
                scaler.step(optimizer1)
                scaler.update()
            else:
                loss0.backward(retain_graph=True)
                loss1.backward()
                optimizer0.step()
                if (not scaler.is_enabled()) or (i != skip_iter):
                    optimizer1.step()

    run(mod_control0, mod_control1, opt_control0, opt_control1, False)
    run(mod_scaling0, mod_scaling1, opt_scaling0, opt_scaling1, True)

    # The loss scale should have been multiplied by the growth factor 3 times and the backoff factor once.
    if enabled:
        assert scaler.get_scale() == 128.0 * scaler.get_growth_factor() ** 3 * scaler.get_backoff_factor() ** 1
    else:
        assert scaler.get_scale() == 1.0

    for c, s in zip(
        chain(mod_control0.parameters(), mod_control1.parameters()),
        chain(mod_scaling0.parameters(), mod_scaling1.parameters()),
    ):
        _assert_equal(c, s, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# Fused optimizers (the _step_supports_amp_scaling protocol)
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


@on_devices
@pytest.mark.parametrize("separate_unscale", [True, False], ids=["unscale_", "no_unscale_"])
@pytest.mark.parametrize("optimizer_ctor, optimizer_kwargs", _FUSED_OPTIM_INPUTS)
def test_grad_scaling_autocast_fused_optimizers(
    scaler_cls, device, optimizer_ctor, optimizer_kwargs, separate_unscale
):
    optimizer_kwargs = dict(optimizer_kwargs, fused=True)
    (
        mod_control, mod_scaling, opt_control, opt_scaling, data, loss_fn, _,
    ) = _create_scaling_case(optimizer_ctor=optimizer_ctor, optimizer_kwargs=optimizer_kwargs, device=device)
    kwargs = copy.deepcopy(optimizer_kwargs)
    kwargs["fused"] = False
    if "lr" not in optimizer_kwargs:
        # _create_scaling_case will set lr = 1.0 if optimizer_kwargs do not set lr
        kwargs["lr"] = 1.0
    opt_control = optimizer_ctor(mod_control.parameters(), **kwargs)
    assert getattr(opt_scaling, "_step_supports_amp_scaling", False)

    scaler_scaling = scaler_cls(device, init_scale=128.0)
    scaler_control = scaler_cls(device, init_scale=128.0)
    # TensorTracker: compare, then copy the reference in so that error does not accumulate.
    tracker = []

    def pop_check_set(actual):
        ref = tracker.pop(0)
        torch.testing.assert_close(actual, ref)
        with torch.no_grad():
            actual.copy_(ref)

    for input, target in data:
        opt_control.zero_grad()
        with torch.autocast(device_type=device, dtype=AUTOCAST_DTYPE[device]):
            output_control = mod_control(input)
            loss_control = loss_fn(output_control, target)
        scaler_control.scale(loss_control).backward()
        scaler_control.step(opt_control)
        scaler_control.update()

        opt_scaling.zero_grad()
        with torch.autocast(device_type=device, dtype=AUTOCAST_DTYPE[device]):
            output_scaling = mod_scaling(input)
            loss_scaling = loss_fn(output_scaling, target)
        scaler_scaling.scale(loss_scaling).backward()
        if separate_unscale:
            scaler_scaling.unscale_(opt_scaling)
        scaler_scaling.step(opt_scaling)
        scaler_scaling.update()
        # the scaler registered grad_scale/found_inf on the optimizer only for the step
        assert not hasattr(opt_scaling, "grad_scale") and not hasattr(opt_scaling, "found_inf")

        tracker.append(loss_control.detach().clone())
        pop_check_set(loss_scaling)
        for param_control, param_scaling in zip(mod_control.parameters(), mod_scaling.parameters()):
            tracker.append(param_control.grad.detach().clone())
            pop_check_set(param_scaling.grad)
            tracker.append(param_control.detach().clone())
            pop_check_set(param_scaling)

            state_control, state_scaling = opt_control.state[param_control], opt_scaling.state[param_scaling]

            for k in state_control:
                actual = state_scaling[k]
                if k == "step":
                    actual = actual.squeeze()
                tracker.append(state_control[k].detach().clone())
                pop_check_set(actual)
    assert scaler_scaling.get_scale() == scaler_control.get_scale()


@on_devices
@pytest.mark.parametrize(
    "optimizer_ctor, optimizer_kwargs",
    [
        pytest.param(ctor, dict(kw, **impl), id=f"{ctor.__name__}-{name}-{impl_id}")
        for ctor, variants in (
            (torch.optim.SGD, {"plain": {}, "momentum": {"momentum": 0.9, "weight_decay": 0.1}}),
            (torch.optim.Adam, {"plain": {}, "amsgrad": {"amsgrad": True, "weight_decay": 0.1}}),
            (torch.optim.AdamW, {"plain": {}, "amsgrad": {"amsgrad": True}}),
        )
        for name, kw in variants.items()
        for impl_id, impl in (
            ("forloop", {"foreach": False, "fused": False}),
            ("foreach", {"foreach": True}),
            ("fused", {"fused": True}),
        )
    ],
)
def test_params_invalidated_with_grads_invalidated_between_unscale_and_step(
    scaler_cls, device, optimizer_ctor, optimizer_kwargs
):
    model, _, optimizer, _, data, loss_fn, _ = _create_scaling_case(
        optimizer_ctor=optimizer_ctor, optimizer_kwargs=optimizer_kwargs, device=device
    )
    scaler = scaler_cls(device, init_scale=128.0)

    for input, target in data:
        optimizer.zero_grad()
        with torch.autocast(device_type=device, dtype=AUTOCAST_DTYPE[device]):
            output = model(input)
            loss = loss_fn(output, target)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)

        # deliberately break grads
        for j, param in enumerate(model.parameters()):
            param.grad.copy_(torch.inf if j % 2 else torch.nan)

        scaler.step(optimizer)
        scaler.update()

    assert all((p.isnan().any() or p.isinf().any()) for p in model.parameters())


# ---------------------------------------------------------------------------------------------
# test_cuda.py scenarios, device-generic here
# ---------------------------------------------------------------------------------------------
@on_devices
def test_grad_scaler_pass_itself(scaler_cls, device):
    class _PlaceHolderOptimizer(torch.optim.Optimizer):
        def __init__(self, params, defaults=None):
            if defaults is None:
                defaults = {}
            super().__init__(params, defaults)
            self._step_supports_amp_scaling = True

    seen = {}

    class Optimizer1(_PlaceHolderOptimizer):
        def step(self, closure=None, *, grad_scaler=None):
            assert isinstance(grad_scaler, torch.amp.GradScaler)
            assert grad_scaler is scaler
            assert not hasattr(self, "grad_scale")
            assert not hasattr(self, "found_inf")
            seen["o1"] = True
            return "o1-ret"

    class Optimizer2(_PlaceHolderOptimizer):
        def step(self, closure=None):
            assert isinstance(self.grad_scale, torch.Tensor)
            assert isinstance(self.found_inf, torch.Tensor)
            seen["o2"] = (self.grad_scale.clone(), self.found_inf.clone())
            return "o2-ret"

    x = torch.randn(4, 4, device=device)
    m = torch.nn.Linear(4, 1).to(device)
    o1 = Optimizer1(m.parameters())
    o2 = Optimizer2(m.parameters())
    scaler = scaler_cls(device=device, init_scale=2.0)

    with torch.autocast(device_type=device, dtype=AUTOCAST_DTYPE[device]):
        y = m(x)
        loss = y.mean()
    scaler.scale(loss).backward()
    with pytest.warns(FutureWarning, match="GradScaler is going to stop passing itself") as rec:
        assert scaler.step(o1) == "o1-ret"
    # stacklevel=2: the warning points at the caller of scaler.step
    assert [w.filename for w in rec if issubclass(w.category, FutureWarning)] == [__file__]
    assert scaler.step(o2) == "o2-ret"
    scaler.update()
    assert seen["o1"] is True
    grad_scale, found_inf = seen["o2"]
    _assert_equal(grad_scale, 2.0)
    _assert_equal(found_inf, 0.0)
    assert not hasattr(o2, "grad_scale") and not hasattr(o2, "found_inf")
    # one clean iteration recorded (only o2 recorded inf checks)
    assert scaler._get_growth_tracker() == 1


@on_devices
@pytest.mark.parametrize(
    "foreach, fused", [(None, None), (True, None), (None, True)], ids=["default", "foreach", "fused"]
)
def test_grad_scaler_with_preset_grad_scale(scaler_cls, device, foreach, fused):
    weight = torch.ones((5, 5), device=device, requires_grad=True)
    weight.grad = torch.full_like(weight, fill_value=15)
    opt = torch.optim.SGD([weight], lr=0.1, foreach=foreach, fused=fused)
    scaler = scaler_cls(device=device, init_scale=5)

    # simulate scaling a loss
    scaler.scale(torch.ones(5, device=device))

    if fused:
        # A fused optimizer's preset grad_scale multiplies the scaler's: grads are divided by 5 * 3.
        opt.grad_scale = torch.tensor(3.0, device=device)
        scaler.step(opt)
        # the scaler removes the attribute after the step
        assert not hasattr(opt, "grad_scale")
        _assert_equal(weight, torch.full_like(weight, 1 - 0.1 * 15 / 15))
    else:
        scaler.step(opt)
        # the grads were unscaled in place (15 / 5 = 3) before the step
        _assert_equal(weight.grad, torch.full_like(weight, fill_value=3))
        _assert_equal(weight, torch.full_like(weight, 1 - 0.1 * 3))
    scaler.update()
    assert scaler.get_scale() == 5.0
    assert scaler._get_growth_tracker() == 1


@on_devices
def test_grad_scaler_fused_skips_on_inf(scaler_cls, device):
    # Fused optimizers get found_inf on the device and skip the update themselves.
    weight = torch.ones((3,), device=device, requires_grad=True)
    weight.grad = torch.tensor([4.0, float("inf"), 4.0], device=device)
    opt = torch.optim.Adam([weight], lr=0.1, fused=True)
    scaler = scaler_cls(device, init_scale=4.0)
    scaler.scale(torch.ones((), device=device))
    scaler.step(opt)
    scaler.update()
    _assert_equal(weight, torch.ones(3, device=device))
    assert scaler.get_scale() == 2.0


@pytest.mark.parametrize("device_str", ["cuda", None], ids=["device_cuda", "default_device"])
def test_grad_scaler_cuda_unavailable_warns_and_disables(scaler_cls, device_str):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available")
    with pytest.warns(
        UserWarning, match=r"torch\.cuda\.amp\.GradScaler is enabled, but CUDA is not available\.  Disabling\."
    ) as rec:
        scaler = scaler_cls(device_str) if device_str else scaler_cls()
    assert [w.filename for w in rec if "CUDA is not available" in str(w.message)] == [__file__]
    assert not scaler.is_enabled()
    # enabled=False asks for no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not scaler_cls("cuda", enabled=False).is_enabled()


@pytest.mark.parametrize(
    "how, device",
    [
        pytest.param("enabled_false", "cpu", id="enabled_false-cpu"),
        pytest.param("enabled_false", "cuda", id="enabled_false-cuda", marks=_NEEDS_CUDA),
        # a "cuda" scaler that disabled itself (no CUDA): the tensors live on the CPU
        pytest.param("cuda_unavailable", "cpu", id="cuda_unavailable"),
    ],
)
def test_grad_scaler_disabled(scaler_cls, how, device):
    if how == "enabled_false":
        scaler = scaler_cls(device, enabled=False)
    else:
        if torch.cuda.is_available():
            pytest.skip("CUDA is available")
        with pytest.warns(UserWarning, match="CUDA is not available"):
            scaler = scaler_cls("cuda")
    assert not scaler.is_enabled()

    # scale() returns its argument unchanged (the same object)
    t = torch.full((2,), 3.0, device=device)
    assert scaler.scale(t) is t
    nested = [t, (t,)]
    assert scaler.scale(nested) is nested

    p = torch.ones(2, device=device, requires_grad=True)
    p.grad = torch.tensor([2.0, float("inf")], device=device)
    opt = torch.optim.SGD([p], lr=0.5)
    scaler.unscale_(opt)  # no-op: grads untouched
    _assert_equal(p.grad, torch.tensor([2.0, float("inf")]))
    p.grad = torch.tensor([2.0, 4.0], device=device)
    # step() just calls optimizer.step() and returns its value, even twice per iteration
    assert scaler.step(opt) is None
    assert scaler.step(opt) is None
    _assert_equal(p, torch.tensor([1.0 - 2 * 0.5 * 2, 1.0 - 2 * 0.5 * 4]))
    scaler.update()
    scaler.update(4.0)
    assert scaler.get_scale() == 1.0
    assert scaler._get_growth_tracker() == 0
    assert scaler.state_dict() == {}
    scaler.load_state_dict({})  # no-op, no error
    scaler.load_state_dict({"scale": 3.0})
    assert scaler.get_scale() == 1.0

    # closures pass through when disabled
    calls = []

    def closure():
        calls.append(1)
        return torch.tensor(7.0)

    ret = scaler.step(opt, closure=closure)
    assert calls == [1] and ret.item() == 7.0


# ---------------------------------------------------------------------------------------------
# Multi-device placement (CUDA only)
# ---------------------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grad_scaling_scale_cuda(scaler_cls):
    scaler = scaler_cls("cuda", init_scale=2.0)
    t0 = torch.full((1,), 4.0, dtype=torch.float32, device="cuda:0")
    cpu = torch.full((1,), 4.0, dtype=torch.float32, device="cpu")
    outputs = [t0.clone(), (cpu.clone(), t0.clone())]
    outputs = scaler.scale(outputs)
    assert outputs[0].item() == 8.0 and outputs[1][0].item() == 8.0 and outputs[1][1].item() == 8.0
    assert outputs[1][0].device.type == "cpu"
    assert scaler._scale.device == t0.device


@pytest.mark.cuda
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
)
def test_grad_scaling_scale_multigpu(scaler_cls):
    scaler = scaler_cls("cuda", init_scale=2.0)
    t0 = torch.full((1,), 4.0, dtype=torch.float32, device="cuda:0")
    t1 = torch.full((1,), 4.0, dtype=torch.float32, device="cuda:1")
    # Create some nested iterables of tensors on different devices.
    outputs = (t1.clone(), (t0.clone(), t1.clone()), [t0.clone(), (t1.clone(), t0.clone())])
    outputs = scaler.scale(outputs)
    assert (
        outputs[0] == 8.0 and outputs[1][0] == 8.0 and outputs[1][1] == 8.0
        and outputs[2][0] == 8.0 and outputs[2][1][0] == 8.0 and outputs[2][1][1] == 8.0
    )
    assert scaler._scale.device == t1.device


# ---------------------------------------------------------------------------------------------
# CUDA graphs (test_cuda.py; CUDA only)
# ---------------------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "foreach, fused", [(False, False), (True, False), (False, True)],
    ids=["forloop", "foreach", "fused"],
)
def test_graph_grad_scaling(scaler_cls, foreach, fused):
    # torch's test_graph_grad_scaling / _test_graph_grad_scaling: scale() and backward() are
    # captured; the scale tensor is read on replay, so the eager step()/update() between
    # replays must change the scale the graph multiplies by.
    torch.cuda.empty_cache()

    scaler = scaler_cls(device="cuda", init_scale=4.0)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()

    weight = torch.ones((100,), device="cuda", requires_grad=True)
    opt = torch.optim.SGD([weight], lr=0.1, foreach=foreach, fused=fused)
    static_input = torch.ones_like(weight)

    # warmup
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        loss = (weight.half() * static_input).sum()
        scaler.scale(loss).backward()
    torch.cuda.current_stream().wait_stream(s)

    opt.zero_grad(set_to_none=True)

    # capture
    with torch.cuda.stream(s):
        g.capture_begin()
        loss = (weight.half() * static_input).sum()
        scaler.scale(loss).backward()
        g.capture_end()

    input_vals = [5, 20000, 5, 40000]
    # If the scale gets updated properly, these are the scale, growth tracker,
    # and grad values we expect.
    expected_scales = [4, 2, 2, 1]
    expected_growth_trackers = [1, 0, 1, 0]
    expected_grad_vals = [5 * 4, float("inf"), 5 * 2, float("inf")]

    for data, scale, growth_tracker, grad_val in zip(
        input_vals, expected_scales, expected_growth_trackers, expected_grad_vals
    ):
        static_input.fill_(data)
        g.replay()
        _assert_equal(weight.grad, torch.full_like(weight.grad, grad_val))
        scaler.step(opt)
        scaler.update()
        _assert_equal(scaler._scale, scale)
        _assert_equal(scaler._growth_tracker, growth_tracker)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("optimizer_ctor, optimizer_kwargs", _FUSED_OPTIM_INPUTS)
def test_graph_scaling_fused_optimizers(scaler_cls, optimizer_ctor, optimizer_kwargs):
    # torch's test_graph_scaling_fused_optimizers (there over optim_db's fused optimizers and
    # their optim_inputs; here over the fused inputs used above): scaler.step() + update()
    # captured in a graph with a fused optimizer (capturable=True where it has the argument)
    # and replayed must match an eager control run with capturable=False.
    device = "cuda"
    steps_warmup = 3
    steps_train = 2

    kwargs = dict(optimizer_kwargs, fused=True)
    has_capturable_arg = "capturable" in inspect.signature(optimizer_ctor.__init__).parameters

    for actually_do_graphs in (True, False) if has_capturable_arg else (True,):
        params = [torch.randn((i + 5, i + 5), device=device) for i in range(2)]
        params_control = [p.clone().requires_grad_() for p in params]
        params_graphed = [p.clone().requires_grad_() for p in params]

        # `GradScaler` in-place updates gradients thus it's necessary to duplicate gradients.
        grads = [[torch.randn_like(p) for p in params] for _ in range(steps_warmup + steps_train)]
        with torch.no_grad():
            grads_control = [[g.clone() for g in gs] for gs in grads]
            grads_graphed = [[g.clone() for g in gs] for gs in grads]

        # Gradient Scaler
        scaler_for_control = scaler_cls(device=device, init_scale=128.0)
        with torch.no_grad():
            scaler_for_control._lazy_init_scale_growth_tracker(device)

        scaler_for_graphed = scaler_cls(device=device)
        scaler_for_graphed.load_state_dict(scaler_for_control.state_dict())
        with torch.no_grad():
            scaler_for_graphed._lazy_init_scale_growth_tracker(device)

        # Control (capturable=False)
        if has_capturable_arg:
            kwargs["capturable"] = False
        opt = optimizer_ctor(params_control, **kwargs)

        for i in range(steps_warmup + steps_train):
            for j, p in enumerate(params_control):
                p.grad = grads_control[i][j]
            scaler_for_control.step(opt)
            scaler_for_control.update()

        # capturable=True
        if has_capturable_arg:
            kwargs["capturable"] = True
        opt = optimizer_ctor(params_graphed, **kwargs)

        for i in range(steps_warmup):
            for j, p in enumerate(params_graphed):
                p.grad = grads_graphed[i][j]
            scaler_for_graphed.step(opt)
            scaler_for_graphed.update()

        if actually_do_graphs:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                scaler_for_graphed.step(opt)
                scaler_for_graphed.update()

        for i in range(steps_train):
            if actually_do_graphs:
                for j, p in enumerate(params_graphed):
                    p.grad.copy_(grads_graphed[i + steps_warmup][j])
                g.replay()
            else:
                # Passing capturable=True to the constructor and running without graphs should
                # still be numerically correct, even if it's not ideal for performance.
                for j, p in enumerate(params_graphed):
                    p.grad = grads_graphed[i + steps_warmup][j]
                scaler_for_graphed.step(opt)
                scaler_for_graphed.update()

        for p_control, p_graphed in zip(params_control, params_graphed):
            torch.testing.assert_close(p_control, p_graphed)
        assert scaler_for_graphed.get_scale() == scaler_for_control.get_scale()


# ---------------------------------------------------------------------------------------------
# (contract) torch's state machine, error types and texts
# ---------------------------------------------------------------------------------------------
def _one_param_case(scaler_cls, device, **kw):
    p = torch.ones(4, device=device, requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = scaler_cls(device, init_scale=8.0, **kw)
    scaler.scale((p * 2).sum()).backward()
    return p, opt, scaler


@on_devices
def test_state_machine_errors(scaler_cls, device):
    p, opt, scaler = _one_param_case(scaler_cls, device)
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match=r"^unscale_\(\) has already been called on this optimizer since the last update\(\)\.$"):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match=r"^unscale_\(\) is being called after step\(\)\.$"):
        scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match=r"^step\(\) has already been called since the last update\(\)\.$"):
        scaler.step(opt)
    scaler.update()
    # after update() the optimizer is READY again
    assert scaler._per_optimizer_states[id(opt)]["stage"] is torch.amp.grad_scaler.OptState.READY
    with pytest.raises(RuntimeError, match="^Closure use is not currently supported if GradScaler is enabled.$"):
        scaler.step(opt, closure=lambda: None)


@on_devices
def test_calls_before_scale_raise(scaler_cls, device):
    scaler = scaler_cls(device)
    opt = torch.optim.SGD([torch.ones(1, device=device, requires_grad=True)], lr=0.1)
    fix = "This may indicate your script did not use scaler.scale(loss or outputs) earlier in the iteration."
    for name, call in (
        ("unscale_", lambda: scaler.unscale_(opt)),
        ("step", lambda: scaler.step(opt)),
        ("update", lambda: scaler.update()),
    ):
        with pytest.raises(AssertionError) as exc:
            call()
        assert str(exc.value) == f"Attempted {name} but _scale is None.  " + fix
    assert scaler.get_scale() == 2.0**16  # the init scale, before the lazy init
    assert scaler._get_growth_tracker() == 0


@on_devices
def test_update_without_inf_checks_and_no_grad_step(scaler_cls, device):
    scaler = scaler_cls(device)
    scaler.scale(torch.ones((), device=device))
    with pytest.raises(AssertionError, match="^No inf checks were recorded prior to update.$"):
        scaler.update()
    opt = torch.optim.SGD([torch.ones(1, device=device, requires_grad=True)], lr=0.1)  # no grads
    with pytest.raises(AssertionError, match="^No inf checks were recorded for this optimizer.$"):
        scaler.step(opt)


@on_devices
def test_fp16_grads_rejected(scaler_cls, device):
    p = torch.ones(4, dtype=torch.float16, device=device, requires_grad=True)
    p.grad = torch.ones(4, dtype=torch.float16, device=device)
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = scaler_cls(device)
    scaler.scale(torch.ones((), device=device))
    with pytest.raises(ValueError, match="^Attempting to unscale FP16 gradients.$"):
        scaler.unscale_(opt)
    with pytest.raises(ValueError, match="^Attempting to unscale FP16 gradients.$"):
        scaler.step(opt)
    _assert_equal(p.grad, torch.ones(4))


@on_devices
def test_factor_validation(scaler_cls, device):
    with pytest.raises(AssertionError, match=r"^The growth factor must be > 1\.0\.$"):
        scaler_cls(device, growth_factor=1.0)
    with pytest.raises(AssertionError, match=r"^The backoff factor must be < 1\.0\.$"):
        scaler_cls(device, backoff_factor=1.0)
    # a disabled scaler does not validate them
    assert not scaler_cls(device, growth_factor=0.5, backoff_factor=2.0, enabled=False).is_enabled()


@on_devices
def test_update_new_scale(scaler_cls, device):
    p, opt, scaler = _one_param_case(scaler_cls, device)
    scaler.step(opt)
    scaler.update(3.0)
    assert scaler.get_scale() == 3.0
    new = torch.tensor(5.0, device=device)
    scaler.scale((p * 2).sum())
    scaler.update(new)
    new.fill_(11.0)  # copied, not aliased
    assert scaler.get_scale() == 5.0
    reason = (
        "new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
        "torch.FloatTensor with requires_grad=False."
    )
    bads = [torch.ones(2, device=device), torch.tensor(2.0, device=device, requires_grad=True)]
    if device != "cpu":
        bads.append(torch.tensor(2.0))  # on another device type than the scaler's
    for bad in bads:
        with pytest.raises(AssertionError) as exc:
            scaler.update(bad)
        assert str(exc.value) == reason


@on_devices
def test_setters_getters(scaler_cls, device):
    scaler = scaler_cls(device, init_scale=4.0, growth_factor=3.0, backoff_factor=0.25, growth_interval=7)
    assert (scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval()) == (3.0, 0.25, 7)
    scaler.set_growth_factor(5.0)
    scaler.set_backoff_factor(0.125)
    scaler.set_growth_interval(1)
    assert (scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval()) == (5.0, 0.125, 1)
    assert (scaler._growth_factor, scaler._backoff_factor, scaler._growth_interval) == (5.0, 0.125, 1)
    assert scaler._init_scale == 4.0 and scaler._init_growth_tracker == 0
    assert scaler._scale is None and scaler._growth_tracker is None
    p = torch.ones(2, device=device, requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.1)
    scaler.scale(p.sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 20.0
    p.grad.fill_(float("nan"))
    scaler.scale(p.sum())
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.5


@on_devices
def test_fused_optimizer_without_grads_in_iteration(scaler_cls, device):
    # Two fused optimizers; one of them (an unused head) has no grads this iteration. torch
    # then hands that optimizer found_inf = sum([]) and its fused step is a no-op.
    trunk = torch.nn.Linear(4, 4).to(device)
    head = torch.nn.Linear(4, 4).to(device)
    opt_trunk = torch.optim.Adam(trunk.parameters(), lr=0.1, fused=True)
    opt_head = torch.optim.Adam(head.parameters(), lr=0.1, fused=True)
    scaler = scaler_cls(device, init_scale=8.0)
    head_before = [q.detach().clone() for q in head.parameters()]
    scaler.scale(trunk(torch.randn(2, 4, device=device)).sum()).backward()
    scaler.step(opt_trunk)
    scaler.step(opt_head)
    scaler.update()
    for q, q0 in zip(head.parameters(), head_before):
        _assert_equal(q, q0)
    assert scaler.get_scale() == 8.0 and scaler._get_growth_tracker() == 1
