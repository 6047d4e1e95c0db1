"""PyTorch's own GradScaler test scenarios, ported to pytest (run on CPU and, when present, CUDA):
the scaler's basic operations.

* test/test_torch.py (TestTorchDeviceType): ``test_grad_scaling_unscale``,
  ``test_grad_scaling_update_scale``, ``test_grad_scaling_unscale_sparse``,
  ``test_grad_scaling_state_dict``, ``test_grad_scaling_scale``, ``test_pickle_gradscaler``,
  ``test_grad_scale_will_not_overflow``, ``test_grad_scaling_device_as_key``.
* test/test_cuda.py: the "CUDA is not available.  Disabling." warning and the behaviour of a
  disabled scaler.

Each test runs for torch's class and for fp16kit's: see tests/_helpers/torch_scaling.py.
"""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch

import fp16kit
from _helpers.torch_scaling import (
    _NEEDS_CUDA,
    SCALER_CLASSES,
    _assert_equal,
    _seed,  # noqa: F401 -- the autouse fixture: torch.manual_seed(0) before each test
    on_devices,
)

pytestmark = pytest.mark.parametrize("scaler_cls", SCALER_CLASSES)


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
        device,
        init_scale=4.0,
        growth_factor=growth,
        backoff_factor=backoff,
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
        "scale": 3.0,
        "growth_factor": 4.0,
        "backoff_factor": 0.5,
        "growth_interval": 2,
        "_growth_tracker": 0,
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
        outputs[0] == 8.0
        and outputs[1][0] == 8.0
        and outputs[1][1] == 8.0
        and outputs[2][0] == 8.0
        and outputs[2][1][0] == 8.0
        and outputs[2][1][1] == 8.0
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
# test_cuda.py: a disabled scaler, and the warning of a CUDA scaler without CUDA
# ---------------------------------------------------------------------------------------------


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
