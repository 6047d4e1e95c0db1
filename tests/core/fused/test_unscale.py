"""The one-pass master-grad kernel (fp16kit.core.fused.unscale) against torch's copy + check-and-unscale."""

from __future__ import annotations

import pytest
import torch

from fp16kit.core import kernels
from fp16kit.core.fused import abi, unscale

pytestmark = pytest.mark.skipif(abi.library() is None, reason="the fused kernels are off on this machine (logged)")

SIZES = [1, 7, 8, 9, 15, 16, 17, 100, 4096 + 9, (1 << 16) + 3, 3 * (1 << 16)]
DTYPES = pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])


def _torch(srcs, inv, found=0.0):
    dsts = [torch.empty(s.shape, dtype=torch.float32) for s in srcs]
    flag = torch.tensor(found)
    torch._foreach_copy_(dsts, srcs)
    torch._amp_foreach_non_finite_check_and_unscale_(dsts, flag, torch.tensor(inv))
    return dsts, flag


def _kernel(srcs, inv, found=0.0):
    dsts = [torch.full(s.shape, 123.0) for s in srcs]
    flag = torch.tensor(found)
    assert unscale.unscale_to_(srcs, dsts, torch.tensor(inv), flag)
    return dsts, flag


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    """Bit for bit, except that a NaN need only be a NaN (its payload: see the module docstring)."""
    for x, y in zip(a, b):
        assert torch.equal(x.isnan(), y.isnan())
        keep = ~x.isnan()
        assert torch.equal(x[keep].view(torch.int32), y[keep].view(torch.int32))


def _every_pattern(dtype: torch.dtype, sizes: list[int]) -> list[torch.Tensor]:
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    sizes = [*sizes, bits.numel() - sum(sizes)]
    return [t.clone() for t in torch.split(bits[torch.randperm(bits.numel())], sizes)]


@DTYPES
@pytest.mark.parametrize("inv", [1.0, 0.5, 1 / 3, 2.0**-24, 3.0, 65504.0])
def test_every_16_bit_value_unscales_as_torch_and_flags_alike(dtype, inv):
    srcs = _every_pattern(dtype, [1, 7, 8, 9, 15, 16, 17, 1000, 30001])
    ref, ref_flag = _torch(srcs, inv)
    out, flag = _kernel(srcs, inv)
    _same(ref, out)
    assert flag.item() == ref_flag.item() == 1.0


@DTYPES
@pytest.mark.parametrize("threads", [1, 2])
def test_finite_grads_of_every_size_match_bit_for_bit_and_leave_the_flag(dtype, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        srcs = [(torch.randn(s, generator=g) * 1000).to(dtype) for s in SIZES]
        for inv in (1.0, 2.0**-10, 0.1):
            ref, ref_flag = _torch(srcs, inv)
            out, flag = _kernel(srcs, inv)
            assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(ref, out))
            assert flag.item() == ref_flag.item() == 0.0
    finally:
        torch.set_num_threads(before)


@DTYPES
@pytest.mark.parametrize("where", [0, 8, 65535, 65536, (1 << 16) + 2])
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_one_non_finite_value_anywhere_sets_the_flag(dtype, where, value):
    srcs = [torch.ones(5, dtype=dtype), torch.ones((1 << 16) + 3, dtype=dtype)]
    srcs[1][where] = value
    out, flag = _kernel(srcs, 0.5)
    assert flag.item() == 1.0
    assert out[1][where].isnan() if value != value else out[1][where].item() == value * 0.5


def test_the_flag_is_only_ever_set():
    out, flag = _kernel([torch.ones(unscale.MIN_MEAN_NUMEL, dtype=torch.float16)], 1.0, found=1.0)
    assert flag.item() == 1.0


def test_small_tensors_are_left_to_torch_s_ops():
    # (their addresses cost more Python than the one pass saves: MIN_MEAN_NUMEL)
    k = unscale.MIN_MEAN_NUMEL
    assert not unscale.unscale_to_([torch.ones(k - 1, dtype=torch.float16)], [torch.zeros(k - 1)], *_scalars())
    assert unscale.unscale_to_([torch.ones(k, dtype=torch.float16)], [torch.zeros(k)], *_scalars())
    mixed = [torch.ones(1, dtype=torch.float16), torch.ones(2 * k, dtype=torch.float16)]
    assert unscale.unscale_to_(mixed, [torch.zeros(1), torch.zeros(2 * k)], *_scalars())  # the mean counts


def _scalars() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(0.5), torch.tensor(0.0)


def _refused(srcs, dsts, inv=None, found=None) -> None:
    inv = torch.tensor(0.5) if inv is None else inv
    found = torch.tensor(0.0) if found is None else found
    before = [d.clone() for d in dsts]
    assert not unscale.unscale_to_(srcs, dsts, inv, found)
    assert all(torch.equal(a, b) for a, b in zip(before, dsts)) and found.item() == 0.0


def test_what_the_kernel_cannot_read_is_left_to_torch_s_ops_with_nothing_changed():
    k = unscale.MIN_MEAN_NUMEL
    h = torch.ones(k, dtype=torch.float16)
    f = torch.zeros(k)
    _refused([], [])
    _refused([h], [f, f])  # not one destination per source
    _refused([torch.ones(k)], [f])  # an fp32 source
    _refused([h, torch.ones(k, dtype=torch.bfloat16)], [f, f.clone()])  # two 16-bit dtypes
    _refused([h], [torch.zeros(k, dtype=torch.float64)])
    _refused([h], [torch.zeros(k - 1)])  # another size
    _refused([torch.ones(64, k // 64, dtype=torch.float16).t()], [torch.zeros(k // 64, 64)])  # not contiguous
    _refused([h], [torch.zeros(2 * k)[::2]])
    _refused([h], [f], inv=torch.tensor(0.5, dtype=torch.float64))
    _refused([h], [f], found=torch.zeros(1))  # not 0-dim


@DTYPES
def test_the_one_unscale_path_takes_it_and_counts_its_bytes(dtype):
    srcs = [torch.randn(s).to(dtype) for s in (3, 70_000)]
    dsts = [torch.empty(s.shape) for s in srcs]
    before = abi.Traffic.bytes
    flags = kernels.unscale_to_(srcs, dsts, torch.tensor(0.25), torch.zeros(()))
    assert abi.Traffic.bytes - before == unscale.UNSCALE_BYTES * 70_003
    assert list(flags) == [torch.device("cpu")]
    ref, _ = _torch(srcs, 0.25)
    assert all(torch.equal(a, b) for a, b in zip(ref, dsts))
