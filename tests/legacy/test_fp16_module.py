"""apex 2018's FP16_Module, fp32_to_fp16, fp16_to_fp32 (docs/apex-others.md §4.6 and §2.1)."""

from __future__ import annotations

from collections import namedtuple

import torch
from torch import nn

from fp16kit.legacy.fp16_module import FP16_Module, conversion_helper, fp16_to_fp32, fp32_to_fp16


def test_conversions_recurse_through_tuples_and_lists_only():
    f32, f16 = torch.ones(2), torch.ones(2, dtype=torch.float16)
    ints, f64, bf = torch.arange(3), torch.ones(1, dtype=torch.float64), torch.ones(1, dtype=torch.bfloat16)
    d = {"a": f32}
    out = fp32_to_fp16([f32, (f32, [ints, f64, bf]), d, 3.0, None])
    assert isinstance(out, list) and isinstance(out[1], tuple) and isinstance(out[1][1], list)
    assert out[0].dtype == torch.float16 and out[1][0].dtype == torch.float16
    assert out[1][1][0] is ints and out[1][1][1] is f64 and out[1][1][2] is bf  # only float32 is cast
    assert out[2] is d and d["a"].dtype == torch.float32  # dicts untouched, as apex
    assert out[3] == 3.0 and out[4] is None
    back = fp16_to_fp32((f16, [f32, ints]))
    assert back[0].dtype == torch.float32 and back[1][0] is f32 and back[1][1] is ints
    assert torch.equal(fp16_to_fp32(f16), torch.ones(2))
    p = nn.Parameter(torch.ones(3))
    assert fp32_to_fp16(p).dtype == torch.float16  # Parameters too


def test_namedtuples_come_back_as_tuples_as_in_apex():
    Pair = namedtuple("Pair", "a b")
    out = conversion_helper(Pair(1, 2), lambda v: v * 10)
    assert out == (10, 20) and type(out) is tuple


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.fc = nn.Linear(4, 2)

    def forward(self, ids, x, *, scale=None, extra=None):
        out = self.fc(self.emb(ids) + x)
        self.seen = (ids.dtype, x.dtype, None if scale is None else scale.dtype)
        return out, [out * 2], {"raw": out}


def test_fp16_module_casts_inputs_and_outputs_not_kwargs():
    torch.manual_seed(0)
    net = Embed()
    ref = Embed()
    ref.load_state_dict(net.state_dict())
    model = FP16_Module(net)
    assert all(p.dtype == torch.float16 for p in model.parameters())
    ids, x, scale = torch.tensor([[1, 2], [3, 4]]), torch.randn(2, 2, 4), torch.ones(1)
    out, listed, raw = model(ids, x, scale=scale)
    assert net.seen == (torch.int64, torch.float16, torch.float32)  # ints pass, kwargs not cast
    assert out.dtype == torch.float32 and listed[0].dtype == torch.float32
    assert raw["raw"].dtype == torch.float16  # dict outputs untouched
    # the same arithmetic by hand: fp16 weights, fp16 input, fp32 output
    ref.half()
    expected = ref.fc(ref.emb(ids) + x.half()).float()
    assert torch.equal(out, expected)


def test_fp16_module_keys_keep_the_module_prefix():
    model = FP16_Module(nn.Linear(3, 2))
    assert list(model.state_dict()) == ["module.weight", "module.bias"]
    other = FP16_Module(nn.Linear(3, 2))
    other.load_state_dict(model.state_dict())
    assert torch.equal(other.module.weight, model.module.weight)
