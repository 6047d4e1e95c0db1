"""The one unscale path: arithmetic against torch's reference, grouping, flags, edge cases."""

from __future__ import annotations

import pytest
import torch

from fp16kit.core import kernels

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_inv_scale_is_double_reciprocal_cast_to_float():
    for s in [3.0, 65536.0, 7.1e-3, 2.0**-20]:
        inv = kernels.inv_scale(torch.tensor(s))
        assert inv.dtype == torch.float32 and inv.shape == ()
        s32 = torch.tensor(s).item()  # the scale is a float32 tensor
        assert inv.item() == torch.tensor(1.0 / s32, dtype=torch.float64).float().item()
    # a float64 scale (legacy exactness) gives the same float32 reciprocal
    assert torch.equal(kernels.inv_scale(torch.tensor(3.0, dtype=torch.float64)), kernels.inv_scale(torch.tensor(3.0)))


@pytest.mark.parametrize("dtype", FLOATS)
def test_unscale_multiplies_and_flags(dtype):
    g = torch.randn(37, dtype=dtype) * 100
    opmath = torch.float64 if dtype == torch.float64 else torch.float32
    expected = (g.to(opmath) * torch.tensor(0.1).item()).to(dtype)
    found = kernels.new_found_inf("cpu")
    out = kernels.unscale_([g], torch.tensor(0.1), found)
    assert torch.equal(g, expected)
    assert set(out) == {torch.device("cpu")}
    assert out[torch.device("cpu")].item() == 0.0
    assert found.item() == 0.0  # the argument itself is never written


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_unscale_flags_non_finite_and_still_unscales(bad):
    a = torch.full((5,), 8.0)
    b = torch.full((5,), 8.0, dtype=torch.float16)
    b[3] = bad
    out = kernels.unscale_([a, b], torch.tensor(0.5), kernels.new_found_inf("cpu"))
    assert out[torch.device("cpu")].item() == 1.0
    assert torch.equal(a, torch.full((5,), 4.0))  # other group unscaled too
    assert b[0].item() == 4.0


def test_found_inf_is_only_ever_set():
    preset = torch.full((), 1.0)
    out = kernels.unscale_([torch.ones(3)], torch.tensor(1.0), preset)
    assert out[torch.device("cpu")].item() == 1.0


def test_unscale_of_nothing_returns_no_devices():
    assert kernels.unscale_([], torch.tensor(0.5), kernels.new_found_inf("cpu")) == {}


def test_group_by_device_and_dtype_keeps_order():
    ts = [torch.zeros(1), torch.zeros(1, dtype=torch.half), torch.ones(1), torch.ones(1, dtype=torch.half)]
    groups = kernels.group_by_device_and_dtype(ts)
    cpu = groups[torch.device("cpu")]
    assert cpu[torch.float32][0] is ts[0] and cpu[torch.float32][1] is ts[2]
    assert cpu[torch.float16][0] is ts[1] and cpu[torch.float16][1] is ts[3]


def _params_with_grads(*grads):
    params = []
    for g in grads:
        p = torch.zeros(g.shape, dtype=g.dtype, requires_grad=True) if not g.is_sparse else g.clone()
        p.grad = g
        params.append(p)
    return params


def test_unscale_grads_skips_missing_grads():
    p1, p2 = _params_with_grads(torch.full((2,), 4.0), torch.full((2,), 4.0))
    p3 = torch.zeros(2, requires_grad=True)
    out = kernels.unscale_grads_([p1, p3, p2], torch.tensor(0.5), kernels.new_found_inf("cpu"), allow_fp16=False)
    assert p3.grad is None
    assert torch.equal(p1.grad, torch.full((2,), 2.0)) and torch.equal(p2.grad, torch.full((2,), 2.0))
    assert out[torch.device("cpu")].item() == 0.0


def test_unscale_grads_refuses_fp16_before_touching_anything():
    p32, p16 = _params_with_grads(torch.full((2,), 4.0), torch.full((2,), 4.0, dtype=torch.half))
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients."):
        kernels.unscale_grads_([p32, p16], torch.tensor(0.5), kernels.new_found_inf("cpu"), allow_fp16=False)
    assert torch.equal(p32.grad, torch.full((2,), 4.0))


def test_unscale_grads_sparse():
    i = torch.tensor([[0, 1, 1], [2, 0, 2]])
    v = torch.tensor([16.0, 32.0, 64.0])
    s = torch.sparse_coo_tensor(i, v, (2, 3), check_invariants=True)
    (p,) = _params_with_grads(s.clone())
    out = kernels.unscale_grads_([p], torch.tensor(0.25), kernels.new_found_inf("cpu"), allow_fp16=False)
    assert out[torch.device("cpu")].item() == 0.0
    assert torch.equal(p.grad.to_dense(), (s / 4).to_dense())


def test_unscale_grads_coalesces_fp16_sparse_before_checking():
    # 64000 + 64000 overflows fp16 only once duplicates are summed: the check must see that.
    i = torch.tensor([[0, 1, 0], [2, 0, 2]])
    v = torch.tensor([64000.0, 32.0, 64000.0])
    g = torch.sparse_coo_tensor(i, v, (2, 3), dtype=torch.float16, check_invariants=True)
    p = torch.zeros(2, 3, dtype=torch.float16).to_sparse()
    p.grad = g
    out = kernels.unscale_grads_([p], torch.tensor(0.25), kernels.new_found_inf("cpu"), allow_fp16=True)
    assert out[torch.device("cpu")].item() == 1.0
    assert p.grad.is_coalesced()


@pytest.mark.parametrize("src_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_unscale_to_master(src_dtype):
    src = [(torch.randn(7) * 1000).to(src_dtype), (torch.randn(3, 2) * 10).to(src_dtype)]
    dst = [torch.empty(7), torch.empty(3, 2)]
    inv = kernels.inv_scale(torch.tensor(1024.0))
    out = kernels.unscale_to_(src, dst, inv, kernels.new_found_inf("cpu"))
    for s, d in zip(src, dst):
        assert torch.equal(d, s.float() * inv)  # exact widening, then one fp32 multiply
    assert out[torch.device("cpu")].item() == 0.0
    src[1][0, 0] = float("nan")
    out = kernels.unscale_to_(src, dst, inv, kernels.new_found_inf("cpu"))
    assert out[torch.device("cpu")].item() == 1.0


def test_unscale_to_length_mismatch():
    with pytest.raises(ValueError, match="one destination per source; got 2 sources and 1"):
        kernels.unscale_to_([torch.ones(1)] * 2, [torch.ones(1)], torch.tensor(1.0), kernels.new_found_inf("cpu"))


@pytest.mark.parametrize("dst_dtype", [torch.float16, torch.bfloat16])
def test_copy_rounds_like_copy_(dst_dtype):
    masters = [torch.randn(100) * 3, torch.randn(5, 5) * 1e5]
    params = [torch.empty(100, dtype=dst_dtype), torch.empty(5, 5, dtype=dst_dtype)]
    kernels.copy_to_(masters, params)
    for m, p in zip(masters, params):
        assert torch.equal(p, m.to(dst_dtype))


def test_copy_length_mismatch():
    with pytest.raises(ValueError, match="one destination per source"):
        kernels.copy_to_([torch.ones(1)], [])


def test_check_finite_leaves_values_bitwise():
    t = torch.tensor([1.5, -0.0, float("nan"), 3e38, 1e-45])
    before = t.clone()
    out = kernels.check_finite_([t], kernels.new_found_inf("cpu"))
    assert out[torch.device("cpu")].item() == 1.0
    assert torch.equal(t.view(torch.int32), before.view(torch.int32))
    clean = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    assert kernels.check_finite_([clean], kernels.new_found_inf("cpu"))[torch.device("cpu")].item() == 0.0


def test_combine_found_inf():
    a, b = torch.tensor(1.0), torch.tensor(0.0)
    total = kernels.combine_found_inf([a, b, a], torch.device("cpu"))
    assert total.item() == 1.0 and a.item() == 1.0  # a flag, not a count; inputs untouched
    merged = kernels.merge_found_inf({torch.device("cpu"): a}, {torch.device("cpu"): a.clone()})
    assert merged[torch.device("cpu")].item() == 1.0  # fused optimizers skip only on exactly 1
    empty = kernels.combine_found_inf([], torch.device("cpu"))  # no grads: a cleared flag
    assert empty.item() == 0.0 and empty.dtype == torch.float32


def test_scale_outputs_structures():
    calls = []

    def get_scale(device):
        calls.append(device)
        return torch.tensor(2.0)

    t = torch.full((1,), 4.0)
    out = kernels.scale_outputs((t, [t, (t,)], t), get_scale)
    assert isinstance(out, tuple) and isinstance(out[1], list) and isinstance(out[1][1], tuple)
    assert out[0].item() == out[1][0].item() == out[1][1][0].item() == out[2].item() == 8.0
    assert calls == [torch.device("cpu")]  # the scale is looked up once
    lazy = kernels.scale_outputs(iter([t, t]), get_scale)
    assert [x.item() for x in lazy] == [8.0, 8.0]
    assert kernels.scale_outputs(t, get_scale).item() == 8.0
    with pytest.raises(ValueError, match="outputs must be a Tensor or an iterable of Tensors"):
        kernels.scale_outputs([t, 3.0], get_scale)


def test_scale_outputs_keeps_torch_dtype_promotion():
    loss = torch.tensor(1.5, dtype=torch.float16)
    out = kernels.scale_outputs(loss, lambda d: torch.tensor(4.0))
    assert out.dtype == (loss * torch.tensor(4.0)).dtype


@pytest.mark.cuda
@cuda
def test_unscale_to_cpu_offloaded_masters():
    src = [torch.randn(1000, device="cuda").half(), torch.randn(10, device="cuda").bfloat16()]
    dst = [torch.empty(1000), torch.empty(10)]
    out = kernels.unscale_to_(src, dst, torch.tensor(0.5), kernels.new_found_inf("cpu"))
    for s, d in zip(src, dst):
        assert torch.equal(d, s.float().cpu() * 0.5)
    assert list(out) == [torch.device("cpu")]


@pytest.mark.cuda
@cuda
def test_unscale_mixed_devices_flags_per_device():
    a = torch.ones(3, device="cuda")
    b = torch.ones(3)
    b[0] = float("inf")
    out = kernels.unscale_([a, b], torch.tensor(0.5, device="cuda"), kernels.new_found_inf("cuda"))
    assert out[torch.device("cpu")].item() == 1.0
    assert out[torch.device("cuda", 0)].item() == 0.0


# ---------------------------------------------------------------------------- amp's accumulation
@pytest.mark.parametrize("src_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_unscale_add_to_rounds_the_product_then_adds(src_dtype):
    torch.manual_seed(0)
    src = (torch.randn(41) * 300).to(src_dtype)
    dst = torch.randn(41)
    before = dst.clone()
    inv = torch.tensor(1.0 / 3.0)
    found = kernels.new_found_inf("cpu")
    flags = kernels.unscale_add_to_([src], [dst], inv, found)
    expected = (src.float() * inv.item()) + before  # two roundings, as apex's Python path
    assert torch.equal(dst, expected)
    assert flags[torch.device("cpu")].item() == 0.0


def test_unscale_add_to_flags_non_finite_sources_only():
    src = torch.tensor([1.0, float("inf")], dtype=torch.float16)
    dst = torch.zeros(2)
    found = kernels.new_found_inf("cpu")
    kernels.unscale_add_to_([src], [dst], torch.tensor(0.5), found)
    assert found.item() == 1.0
    clean = kernels.new_found_inf("cpu")
    kernels.unscale_add_to_(
        [torch.ones(2, dtype=torch.float16)], [torch.full((2,), float("nan"))], torch.tensor(0.5), clean
    )
    assert clean.item() == 0.0  # the accumulated destination is not checked (apex checked the new grads)


def test_unscale_add_to_checks_lengths_and_empty():
    with pytest.raises(ValueError, match="one destination per source"):
        kernels.unscale_add_to_([torch.ones(1)], [], torch.tensor(1.0), kernels.new_found_inf("cpu"))
    assert kernels.unscale_add_to_([], [], torch.tensor(1.0), kernels.new_found_inf("cpu")) == {}


def test_stack_flags():
    flags = [torch.tensor(0.0), torch.tensor(1.0), torch.tensor(0.0)]
    assert kernels.stack_flags(flags, torch.device("cpu")).tolist() == [0.0, 1.0, 0.0]
    assert kernels.stack_flags([], torch.device("cpu")).numel() == 0


def test_refresh_stale_masters_keeps_masters_that_round_to_the_param():
    master = torch.tensor([1.0001, 2.0, 3.0])
    param = master.half()
    param[2] = 7.0  # loaded / edited
    kernels.refresh_stale_masters_([param], [master])
    assert master[0].item() == torch.tensor(1.0001).item()  # extra precision kept
    assert master[2].item() == 7.0


# ---------------------------------------------------------------- norms and apex's scale op
def test_l2_norms_per_tensor_in_fp32_and_l2_norm_total():
    ts = [torch.tensor([3.0, 4.0]), torch.tensor([300.0, 400.0], dtype=torch.float16), torch.zeros(0)]
    norms = kernels.l2_norms(ts)
    assert [n.dtype for n in norms] == [torch.float32] * 3
    assert [n.item() for n in norms] == [5.0, 500.0, 0.0]  # fp16 squares would overflow
    total = kernels.l2_norm(ts)
    assert total.shape == () and abs(total.item() - (25.0 + 250000.0) ** 0.5) < 1e-3
    assert kernels.l2_norm([]).item() == 0.0
    assert torch.isinf(kernels.l2_norm([torch.tensor([float("inf")])]))


def test_scale_to_rounds_once_and_raises_any_flag_dtype():
    src = [torch.tensor([1.0, 3.0], dtype=torch.float16)]
    dst = [torch.empty(2)]
    flag = torch.zeros(1, dtype=torch.int32)
    kernels.scale_to_(src, dst, 0.1, flag)
    assert torch.equal(dst[0], src[0].float() * torch.tensor(0.1, dtype=torch.float32))
    assert flag.item() == 0
    kernels.scale_to_([torch.tensor([float("-inf")])], [torch.empty(1)], 2.0, flag)
    assert flag.item() == 1
    kernels.scale_to_([torch.ones(1)], [torch.empty(1)], 2.0, flag)
    assert flag.item() == 1  # never cleared


def test_l2_norm_and_flag_matches_apex_shapes():
    flag = torch.zeros(1)
    total, per = kernels.l2_norm_and_flag_([torch.tensor([6.0, 8.0])], flag, per_tensor=True)
    assert total.tolist() == [10.0] and per.tolist() == [10.0] and flag.item() == 0.0
    total, per = kernels.l2_norm_and_flag_([torch.tensor([float("nan")])], flag)
    assert per.numel() == 0 and flag.item() == 1.0


def test_norms_is_exported():
    assert "norms" in kernels.__all__ and "move" in kernels.__all__


@pytest.fixture
def blocking_to_cpu(monkeypatch):
    """Records every ``Tensor.to(..., non_blocking=True)`` whose target is the CPU: such a copy
    from CUDA returns before the data arrives, and the CPU op after it may read garbage."""
    seen = []
    original = torch.Tensor.to

    def to(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if kwargs.get("non_blocking") and out.device.type == "cpu":
            seen.append(out)
        return out

    monkeypatch.setattr(torch.Tensor, "to", to)
    return seen


def test_no_non_blocking_copy_onto_the_cpu(blocking_to_cpu):
    ts = [torch.tensor([3.0, 4.0]), torch.tensor([1.0], dtype=torch.float16)]
    cpu = torch.device("cpu")
    assert torch.equal(kernels.l2_norm(ts, cpu), torch.tensor(26.0).sqrt())
    kernels.l2_norm_and_flag_(ts, torch.zeros(1, dtype=torch.int32), per_tensor=True)
    kernels.stack_flags([torch.tensor(1.0), torch.tensor(0.0)], cpu)
    kernels.combine_found_inf([torch.tensor(1.0), torch.tensor(0.0)], cpu)
    kernels.PerDevice(torch.tensor(2.0)).get(cpu)
    kernels.scale_outputs(torch.ones(2), lambda d: torch.tensor(2.0))
    kernels.unscale_([torch.ones(2)], torch.tensor(0.5), kernels.new_found_inf(cpu))
    assert blocking_to_cpu == []


def test_scale_to_with_a_python_scale_makes_no_host_tensor(monkeypatch):
    """A Python scale is filled in on each device (``torch.full``), not made on the host and
    copied over at every call; the numbers are those of ``float64 -> dtype``, then multiply."""
    src = [torch.tensor([1.0, 3.0, 65504.0], dtype=torch.float16), torch.tensor([0.1], dtype=torch.float64)]
    dst = [torch.empty(3, dtype=torch.float16), torch.empty(1, dtype=torch.float64)]
    flag = torch.zeros(1, dtype=torch.int32)

    def no_host_tensor(*a, **k):
        raise AssertionError("torch.tensor called in scale_to_")

    monkeypatch.setattr(torch, "tensor", no_host_tensor)
    kernels.scale_to_(src, dst, 1 / 3, flag)
    monkeypatch.undo()
    third32 = torch.tensor(1 / 3, dtype=torch.float64).float()
    assert torch.equal(dst[0], (src[0].float() * third32).half())
    assert torch.equal(dst[1], src[1] * (1 / 3))
    assert flag.item() == 0
