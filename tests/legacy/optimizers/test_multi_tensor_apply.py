"""fp16kit.legacy.multi_tensor_apply: apex's applier and the amp_C stand-ins (docs/apex-others.md §5 last row)."""

from __future__ import annotations

import math

import pytest
import torch

from fp16kit.legacy.multi_tensor_apply import MultiTensorApply, amp_C, multi_tensor_applier


def test_applier_is_available_and_passes_its_chunk_size():
    assert multi_tensor_applier.available and MultiTensorApply.available
    seen = []
    multi_tensor_applier(lambda *a: seen.append(a), "flag", [[1]], "x")
    assert seen == [(2048 * 32, "flag", [[1]], "x")]


@pytest.mark.parametrize(
    "src_dtype,dst_dtype",
    [
        (torch.float16, torch.float32),
        (torch.float32, torch.float16),
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),
    ],
)
def test_scale_is_fp32_product_rounded_once(src_dtype, dst_dtype):
    srcs = [torch.randn(5).to(src_dtype) * 100, torch.randn(3, 2).to(src_dtype)]
    dsts = [torch.empty(s.shape, dtype=dst_dtype) for s in srcs]
    flag = torch.zeros(1, dtype=torch.int)
    multi_tensor_applier(amp_C.multi_tensor_scale, flag, [srcs, dsts], 1.0 / 3.0)
    for s, d in zip(srcs, dsts):
        assert torch.equal(d, (s.float() * torch.tensor(1.0 / 3.0, dtype=torch.float32)).to(dst_dtype))
    assert flag.item() == 0


def test_scale_raises_the_flag_on_non_finite_and_never_clears_it():
    flag = torch.zeros(1, dtype=torch.int)
    src = [torch.tensor([1.0, float("nan")])]
    multi_tensor_applier(amp_C.multi_tensor_scale, flag, [src, [torch.empty(2)]], 2.0)
    assert flag.item() == 1
    multi_tensor_applier(amp_C.multi_tensor_scale, flag, [[torch.ones(2)], [torch.empty(2)]], 2.0)
    assert flag.item() == 1


def test_scale_in_place():
    t = torch.full((4,), 3.0, dtype=torch.float16)
    multi_tensor_applier(amp_C.multi_tensor_scale, torch.zeros(1, dtype=torch.int), [[t], [t]], 0.5)
    assert torch.equal(t, torch.full((4,), 1.5, dtype=torch.float16))


def test_l2norm_total_and_per_tensor():
    ts = [torch.tensor([3.0, 4.0]), torch.tensor([[12.0]], dtype=torch.float16)]
    flag = torch.zeros(1, dtype=torch.int)
    total, per = multi_tensor_applier(amp_C.multi_tensor_l2norm, flag, [ts], True)
    assert total.shape == (1,) and total.dtype == torch.float32
    assert math.isclose(total.item(), 13.0, rel_tol=1e-6)
    assert per.tolist() == [5.0, 12.0]
    total, per = multi_tensor_applier(amp_C.multi_tensor_l2norm, flag, [ts], False)
    assert per.numel() == 0 and flag.item() == 0


def test_l2norm_flags_non_finite():
    flag = torch.zeros(1, dtype=torch.int)
    total, _ = multi_tensor_applier(amp_C.multi_tensor_l2norm, flag, [[torch.tensor([1.0, float("inf")])]])
    assert flag.item() == 1 and math.isinf(total.item())


def test_wrong_list_counts_are_refused():
    with pytest.raises(ValueError, match="sources, destinations"):
        multi_tensor_applier(amp_C.multi_tensor_scale, torch.zeros(1, dtype=torch.int), [[torch.ones(1)]], 1.0)
