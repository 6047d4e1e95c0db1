"""Differential: a file ``torch.load(weights_only=True)`` reads comes back identically through
``fp16kit.legacy.load_checkpoint`` and, re-saved, through ``fp16kit convert-checkpoint``
(``convert_file``) -- for a variety of normal contents, in both of torch.save's formats: types
(OrderedDict and its ``_metadata``, tuple vs list, torch.Size, dtypes, devices, sets, keys that
are not strings), tensors bit for bit (every dtype, views sharing one storage, strides, offsets,
requires_grad, Parameters, sparse, quantized, 0-dim), and the Python values around them (NaN,
-0.0, complex, big ints, bytes).
"""

from __future__ import annotations

import collections
import math

import pytest
import torch

from fp16kit.legacy import load_checkpoint
from fp16kit.legacy.checkpoints.convert import convert_file


def _cases():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    adam = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    adam.step()
    base = torch.arange(12.0).reshape(3, 4)
    shared = {"x": 1}
    return {
        "model and optimizer": {"model": model.state_dict(), "optimizer": adam.state_dict(), "epoch": 3},
        "dtypes": {
            str(d): torch.arange(3).to(d)
            for d in (
                torch.float16,
                torch.bfloat16,
                torch.float32,
                torch.float64,
                torch.int8,
                torch.uint8,
                torch.int16,
                torch.int32,
                torch.int64,
                torch.bool,
                torch.complex64,
                torch.uint16,
                torch.float8_e4m3fn,
            )
        },
        "views": {"a": base, "b": base[1:], "c": base.t(), "d": base[:, ::2]},
        "grads": {"param": torch.nn.Parameter(torch.randn(2, 2)), "leaf": torch.randn(2, requires_grad=True)},
        "python values": [1, 2.5, float("nan"), float("inf"), -0.0, True, None, "s", b"raw", 1 + 2j, 2**70, -(2**70)],
        "torch values": {"size": torch.Size([2, 3]), "dtype": torch.float16, "device": torch.device("cuda", 1)},
        "containers": {
            "nested": [{"b": (1, [2, {"c": torch.zeros(1)}])}],
            "empty": [(), [], {}, collections.OrderedDict()],
            "sets": [{1, 2}, set()],
            "shared": [shared, shared],
        },  # (weights_only refuses frozensets)
        "keys": {0: torch.zeros(1), 1.5: 2, (1, 2): "tuple key", None: 3, True: "bool key"},
        "sparse": torch.sparse_coo_tensor([[0, 1], [1, 0]], [1.0, 2.0], (2, 2), check_invariants=True),
        "quantized": torch.quantize_per_tensor(torch.tensor([0.1, -0.25, 0.3]), 0.05, 2, torch.qint8),
        "0-dim": torch.tensor(3.0),
        "an int": 5,
        "rng state": torch.get_rng_state(),
    }


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.is_sparse:
        t = t.to_dense()
    if t.is_quantized:
        t = t.int_repr()
    t = t.detach().contiguous().reshape(-1)
    return t if t.dtype == torch.bool else t.view(torch.uint8)


def _same(a, b, where="root"):
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.requires_grad, a.device, a.layout) == (
            b.dtype,
            b.shape,
            b.requires_grad,
            b.device,
            b.layout,
        ), where
        if not a.is_sparse and not a.is_quantized:
            assert (a.stride(), a.storage_offset()) == (b.stride(), b.storage_offset()), where
        if a.is_quantized:
            assert (a.q_scale(), a.q_zero_point()) == (b.q_scale(), b.q_zero_point()), where
        assert torch.equal(_bits(a), _bits(b)), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        assert getattr(a, "_metadata", None) == getattr(b, "_metadata", None), where
        for k in a:
            _same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), where
    else:
        assert a == b and repr(a) == repr(b), where  # repr: -0.0 is not 0.0


def _storages(obj) -> list[int]:
    """Which of the tensors in ``obj`` share storage (indices of the first with the same)."""
    ptrs = [t.untyped_storage().data_ptr() for t in obj.values()]
    return [ptrs.index(p) for p in ptrs]


@pytest.mark.filterwarnings(
    "ignore:torch.quantize_per_tensor:UserWarning", "ignore:TypedStorage is deprecated:UserWarning"
)
@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy-format"])
@pytest.mark.parametrize(
    "name",
    [
        "model and optimizer",
        "dtypes",
        "views",
        "grads",
        "python values",
        "torch values",
        "containers",
        "keys",
        "sparse",
        "quantized",
        "0-dim",
        "an int",
        "rng state",
    ],
)
def test_what_weights_only_reads_comes_back_identically(tmp_path, name, legacy):
    obj = _cases()[name]
    if legacy and name == "dtypes":  # the legacy format has no storage type for these
        obj = {k: v for k, v in obj.items() if k not in ("torch.uint16", "torch.float8_e4m3fn")}
    path = tmp_path / "in.pt"
    torch.save(obj, path, _use_new_zipfile_serialization=not legacy)
    want = torch.load(path, weights_only=True)
    _same(load_checkpoint(path), want)

    report = convert_file(path, tmp_path / "out.pt")
    assert report == []  # plain data: nothing to convert, nothing said
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    _same(got, want)
    if name == "views":
        assert _storages(got) == _storages(want) == [0, 0, 0, 0]
    if name == "containers":
        assert got["shared"][0] is got["shared"][1]
