"""MasterParams: creation, grads model -> master, copy-back, flat storage, offload."""

from __future__ import annotations

import pytest
import torch

from fp16kit.core import kernels
from fp16kit.core.master import MasterParams, needs_master

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _params(dtype=torch.float16, shapes=((3, 4), (5,), (2, 2, 2))):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g).to(dtype).requires_grad_() for s in shapes]


def test_needs_master():
    assert needs_master(torch.zeros(1, dtype=torch.float16, requires_grad=True))
    assert needs_master(torch.zeros(1, dtype=torch.bfloat16, requires_grad=True))
    assert not needs_master(torch.zeros(1, requires_grad=True))  # fp32 passes through
    assert not needs_master(torch.zeros(1, dtype=torch.float16))  # frozen


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_masters_are_exact_fp32_leaves(flat, dtype):
    params = _params(dtype)
    mp = MasterParams(params, flat=flat)
    assert len(mp) == 3
    for p, m in zip(params, mp.masters):
        assert m.dtype == torch.float32 and m.is_leaf and m.requires_grad
        assert torch.equal(m, p.detach().float())
    if flat:
        assert all(m._base is mp.masters[0]._base for m in mp.masters)


@pytest.mark.parametrize("flat", [False, True])
def test_grads_to_masters_unscales_and_flags(flat):
    params = _params()
    mp = MasterParams(params, flat=flat)
    for p in params:
        p.grad = (torch.randn(p.shape) * 100).half()
    inv = kernels.inv_scale(torch.tensor(128.0))
    flags = mp.grads_to_masters(inv, kernels.new_found_inf("cpu"))
    assert flags[torch.device("cpu")].item() == 0.0
    for p, m in zip(params, mp.masters):
        assert torch.equal(m.grad, p.grad.float() * inv)
    params[1].grad[2] = float("inf")
    flags = mp.grads_to_masters(inv, kernels.new_found_inf("cpu"))
    assert flags[torch.device("cpu")].item() == 1.0


@pytest.mark.parametrize("flat", [False, True])
def test_missing_model_grads(flat):
    params = _params()
    mp = MasterParams(params, flat=flat)
    for p in params:
        p.grad = torch.ones_like(p)
    mp.grads_to_masters(torch.tensor(1.0), kernels.new_found_inf("cpu"))
    params[0].grad = None
    mp.grads_to_masters(torch.tensor(1.0), kernels.new_found_inf("cpu"), clear_missing=False)
    assert mp.masters[0].grad is not None  # kept (apex's FP16_Optimizer did)
    mp.grads_to_masters(torch.tensor(0.5), kernels.new_found_inf("cpu"))
    assert mp.masters[0].grad is None  # cleared: the optimizer skips it
    assert torch.equal(mp.masters[1].grad, torch.full((5,), 0.5))
    assert mp.grads_to_masters(torch.tensor(1.0), kernels.new_found_inf("cpu")) != {}
    for p in params:
        p.grad = None
    assert mp.grads_to_masters(torch.tensor(1.0), kernels.new_found_inf("cpu")) == {}


def test_flat_unscale_runs_on_the_whole_buffer_when_every_grad_is_a_view():
    params = _params()
    mp = MasterParams(params, flat=True)
    for p in params:
        p.grad = torch.full_like(p, 2.0)
    mp.grads_to_masters(torch.tensor(1.0), kernels.new_found_inf("cpu"))
    targets = mp._flat_unscale_targets()
    assert len(targets) == 1 and targets[0].numel() == sum(p.numel() for p in params)
    params[2].grad = None
    mp.grads_to_masters(torch.tensor(1.0), kernels.new_found_inf("cpu"))
    assert len(mp._flat_unscale_targets()) == 2  # partial block: per view


def test_masters_to_model_rounds_to_nearest():
    params = _params()
    mp = MasterParams(params)
    with torch.no_grad():
        for m in mp.masters:
            m.add_(1e-3)
    mp.masters_to_model()
    for p, m in zip(params, mp.masters):
        assert torch.equal(p.detach(), m.detach().half())


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad(set_to_none):
    params = _params()
    mp = MasterParams(params)
    for p in params:
        p.grad = torch.ones_like(p)
    mp.grads_to_masters(torch.tensor(1.0), kernels.new_found_inf("cpu"))
    mp.zero_grad(set_to_none)
    for t in (*params, *mp.masters):
        assert (t.grad is None) if set_to_none else torch.equal(t.grad, torch.zeros_like(t))


def test_rejects_what_cannot_have_a_master():
    with pytest.raises(TypeError, match="floating-point"):
        MasterParams([torch.zeros(2, dtype=torch.int64)])
    with pytest.raises(TypeError, match="master_dtype must be a floating dtype"):
        MasterParams([], master_dtype=torch.int32)
    p = torch.zeros(2, dtype=torch.float16, requires_grad=True)
    mp = MasterParams([p])
    p.grad = torch.zeros(2, dtype=torch.float16).to_sparse()
    with pytest.raises(TypeError, match="Sparse gradients"):
        mp.grads_to_masters(torch.tensor(1.0), kernels.new_found_inf("cpu"))


def test_add_more_params_and_describe():
    mp = MasterParams(_params(), flat=True)
    new = mp.add(_params(torch.bfloat16, shapes=((7,),)))
    assert len(new) == 1 and len(mp) == 4
    d = mp.describe()
    assert d == {"count": 4, "numel": 12 + 5 + 8 + 7, "master_dtype": "float32", "devices": ["cpu"], "flat": True}


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("flat", [False, True])
def test_cpu_offloaded_masters(flat):
    params = [p.cuda().detach().requires_grad_() for p in _params()]
    mp = MasterParams(params, master_device="cpu", flat=flat)
    assert all(m.device.type == "cpu" and m.is_pinned() for m in mp.masters)
    for p in params:
        p.grad = torch.randn_like(p)
    flags = mp.grads_to_masters(torch.tensor(0.5), kernels.new_found_inf("cpu"))
    assert list(flags) == [torch.device("cpu")]
    for p, m in zip(params, mp.masters):
        assert torch.equal(m.grad, p.grad.float().cpu() * 0.5)
    mp.masters_to_model()
    assert all(torch.equal(p.detach().cpu(), m.detach().half()) for p, m in zip(params, mp.masters))


def _big_pair(numel=1 << 16):
    p = torch.randn(numel).half().requires_grad_()
    return p, MasterParams([p])


def _transfer(mp, value):
    mp.model_params[0].grad = torch.full_like(mp.model_params[0], value)
    mp.grads_to_masters(torch.ones(()), torch.zeros(()))
    return mp.masters[0]


def test_a_dropped_cpu_master_grad_is_reused_when_nothing_holds_it():
    _, mp = _big_pair()
    m = _transfer(mp, 1.0)
    address = m.grad.data_ptr()
    m.grad = None  # apex's faces drop the master grads at every step
    _transfer(mp, 2.0)
    assert m.grad.data_ptr() == address and torch.equal(m.grad, torch.full_like(m, 2.0))


def _saved_for_backward(g):
    w = torch.zeros_like(g, requires_grad=True)
    y = (w * g).sum()  # mul saves g for w's grad

    def probe():
        y.backward()
        return w.grad

    return probe


def _another_grad(g):
    t = torch.zeros_like(g)
    t.grad = g
    return lambda: t.grad


@pytest.mark.parametrize(
    "hold",
    [
        lambda g: lambda: g,  # a reference
        lambda g: (lambda v: lambda: v)(g[10:20]),  # a view
        lambda g: (lambda history: lambda: history[0])([g]),  # a list of them (a grad-norm history)
        _saved_for_backward,
        _another_grad,
        lambda g: (lambda st: lambda: torch.tensor([], dtype=g.dtype).set_(st, 0, g.shape))(g.untyped_storage()),
    ],
    ids=["reference", "view", "list", "saved-for-backward", "another-grad", "its-storage"],
)
def test_a_master_grad_something_still_holds_is_never_overwritten(hold):
    _, mp = _big_pair()
    m = _transfer(mp, 1.0)
    probe = hold(m.grad)
    m.grad = None
    _transfer(mp, 2.0)
    assert torch.all(probe() == 1.0)
    assert torch.equal(m.grad, torch.full_like(m, 2.0))


def test_releasing_grad_memory_drops_the_spares_and_idle_flat_buffers():
    _, mp = _big_pair()
    m = _transfer(mp, 1.0)
    m.grad = None
    mp.release_grad_memory()  # (a step that reads no master grads: the fused kernel's)
    assert not mp._spare_grads
    assert torch.equal(_transfer(mp, 2.0).grad, torch.full_like(m, 2.0))  # made again when needed

    ps = [torch.randn(n).half().requires_grad_() for n in (40, 24)]
    flat = MasterParams(ps, flat=True)
    for p in ps:
        p.grad = torch.ones_like(p)
    flat.grads_to_masters(torch.ones(()), torch.zeros(()))
    (block,) = flat._flat_blocks
    flat.masters[0].grad = None
    flat.release_grad_memory()
    assert block.grad_buffer is not None  # a master's grad is still one of its views
    flat.masters[1].grad = None
    flat.release_grad_memory()
    assert block.grad_buffer is None and block.grad_views == []
    flat.grads_to_masters(torch.full((), 0.5), torch.zeros(()))  # a new buffer, the unscale over it as before
    assert block.grad_buffer is not None and flat.masters[1].grad is block.grad_views[1]
    assert torch.equal(flat.masters[1].grad, torch.full((24,), 0.5))


def test_small_master_grads_are_not_spared():
    _, mp = _big_pair(numel=1000)
    m = _transfer(mp, 1.0)
    m.grad = None
    assert not mp._spare_grads
    _transfer(mp, 2.0)
    assert torch.equal(m.grad, torch.full_like(m, 2.0))


def test_a_master_grad_in_shared_memory_is_not_reused():
    """Sent through a torch.multiprocessing queue, its memory is another process's too."""
    _, mp = _big_pair()
    m = _transfer(mp, 1.0)
    m.grad.share_memory_()
    address = m.grad.data_ptr()
    m.grad = None
    _transfer(mp, 2.0)
    assert m.grad.data_ptr() != address and not m.grad.is_shared()


def test_a_master_grad_with_a_weak_reference_is_not_reused():
    """Reused, the weak reference would find the old grad alive again, holding the new values."""
    import weakref

    _, mp = _big_pair()
    m = _transfer(mp, 1.0)
    ref = weakref.ref(m.grad)
    m.grad = None
    _transfer(mp, 2.0)
    assert ref() is not m.grad
