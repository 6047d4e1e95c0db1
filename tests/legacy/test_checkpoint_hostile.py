"""Files whose pickle claims tensor sizes their data does not hold (a damaged or crafted file):
``load_checkpoint`` refuses them with its one exception type (``pickle.UnpicklingError``, "this
file was not loaded") saying the file is corrupt -- not torch's ``RuntimeError: can't allocate
memory: you tried to allocate 4398046511104 bytes`` for a 300-byte file, which reads as "buy more
RAM". Also: REDUCE chains through torch's own allowed rebuild helpers, and the CLI's behaviour
on them (exit 1, nothing written).
"""

from __future__ import annotations

import io
import pickle
import zipfile

import pytest
import torch

from fp16kit.legacy import load_checkpoint
from fp16kit.legacy.convert import convert_file


def _claim(data: bytes, numel: int, at: bytes = b"cpu") -> bytes:
    """``data`` (a pickle holding one 4-element storage) with the storage's numel replaced."""
    i = data.find(at)
    j = data.find(b"K\x04", i)  # BININT1 4: the storage's numel, after its location
    assert i > 0 and j > i
    new = b"J" + numel.to_bytes(4, "little") if numel < 2**31 else b"\x8a\x08" + numel.to_bytes(8, "little")
    return data[:j] + new + data[j + 2:]


def _legacy_file(numel: int) -> bytes:
    buf = io.BytesIO()
    torch.save({"w": torch.zeros(4)}, buf, _use_new_zipfile_serialization=False)
    return _claim(buf.getvalue(), numel)


def _zip_file(numel: int) -> bytes:
    buf = io.BytesIO()
    torch.save({"w": torch.zeros(4)}, buf)
    src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for info in src.infolist():
            record = src.read(info.filename)
            z.writestr(info.filename, _claim(record, numel) if info.filename.endswith("data.pkl") else record)
    return out.getvalue()


@pytest.mark.parametrize("numel", [8, 2**26, 2**40], ids=["double", "256MB", "4TB"])
@pytest.mark.parametrize("make", [_legacy_file, _zip_file], ids=["legacy-format", "zip"])
def test_a_tensor_claiming_more_data_than_the_file_holds_is_refused_as_corrupt(tmp_path, make, numel):
    data = make(numel)
    with pytest.raises(RuntimeError):  # what torch itself says
        torch.load(io.BytesIO(data), weights_only=True)
    with pytest.raises(pickle.UnpicklingError, match=r"is truncated or corrupt: .*(claims|not the size)") as info:
        load_checkpoint(io.BytesIO(data))
    assert "allocate" not in str(info.value).split("(torch said")[0]
    path = tmp_path / "bad.pt"
    path.write_bytes(data)
    with pytest.raises(pickle.UnpicklingError, match="truncated or corrupt"):
        convert_file(path, tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["bad.pt"]


def test_a_real_out_of_memory_is_not_called_corrupt(monkeypatch, tmp_path):
    """A file that holds its data, on a machine without the memory: torch's error, unchanged."""
    path = tmp_path / "ok.pt"
    torch.save({"w": torch.zeros(4)}, path, _use_new_zipfile_serialization=False)

    def no_memory(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't "
                           "allocate memory: you tried to allocate 16 bytes. Error code 12 (Cannot allocate memory)")

    monkeypatch.setattr(torch.serialization, "_legacy_load", no_memory)
    with pytest.raises(RuntimeError, match="you tried to allocate 16 bytes"):
        load_checkpoint(path)


def _view(data: bytes, part: str, value: int) -> bytes:
    """``data`` with the rebuilt tensor's offset, size or stride (``_rebuild_tensor_v2``'s
    arguments after the storage: ``K\\x00 K\\x04 (1-tuple) K\\x01 (1-tuple)``) replaced."""
    j = data.find(b"QK\x00K\x04\x85", data.find(b"cpu"))
    k = data.find(b"K\x01\x85", j)
    new = b"J" + value.to_bytes(4, "little", signed=True)
    at = {"offset": (j + 1, j + 3), "size": (j + 3, j + 5), "stride": (k, k + 2)}[part]
    return data[:at[0]] + new + data[at[1]:]


def _rezip(data: bytes, edit) -> bytes:
    src = zipfile.ZipFile(io.BytesIO(data))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for info in src.infolist():
            record = src.read(info.filename)
            z.writestr(info.filename, edit(record) if info.filename.endswith("data.pkl") else record)
    return out.getvalue()


@pytest.mark.parametrize("part, value", [("offset", 1000), ("stride", 1000), ("stride", -1), ("size", -1)])
@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy-format"])
def test_a_tensor_view_reaching_past_its_data_is_refused_as_corrupt(legacy, part, value):
    """torch refuses these views itself (no memory past the storage is read), with a
    RuntimeError such as 'Trying to resize storage that is not resizable'."""
    buf = io.BytesIO()
    torch.save({"w": torch.zeros(4)}, buf, _use_new_zipfile_serialization=not legacy)
    data = _view(buf.getvalue(), part, value) if legacy else _rezip(buf.getvalue(), lambda r: _view(r, part, value))
    with pytest.raises(RuntimeError):
        torch.load(io.BytesIO(data), weights_only=True)
    with pytest.raises(pickle.UnpicklingError, match="is truncated or corrupt: a tensor's (size|data)"):
        load_checkpoint(io.BytesIO(data))


@pytest.mark.parametrize("shape", [(0, 2**62, 2**62), (2**40, 2**40, 0), (0, 2**63 - 1, 2)])
def test_an_empty_numpy_array_with_an_impossible_shape_is_refused(tmp_path, fake_numpy, save, shape):
    """No items and no raw data, but dimensions whose product (zeros left out) no array can
    have: torch raised 'Stride calculation overflowed' (a RuntimeError) while decoding it."""
    path = save({"a": fake_numpy.ndarray(shape, "<f8", b"")}, tmp_path / "empty.pt")
    with pytest.raises(pickle.UnpicklingError, match="bad array shape"):
        load_checkpoint(path)


def test_an_empty_numpy_array_of_a_possible_shape_loads(tmp_path, fake_numpy, save):
    path = save({"a": fake_numpy.ndarray((0, 3, 2**20), "<f8", b"")}, tmp_path / "empty.pt")
    a = load_checkpoint(path)["a"]
    assert tuple(a.shape) == (0, 3, 2**20) and a.dtype == torch.float64


@pytest.mark.parametrize("shape, want", [
    ((2, 0), [[], []]), ((0, 2), []), ((2, 0, 3), [[], []]), ((2, 3, 0), [[[], [], []], [[], [], []]]),
    ((2, 2), [[b"a", b"b"], [b"c", b"d"]]), ((2, 1, 2), [[[b"a", b"b"]], [[b"c", b"d"]]]),
])
def test_numpy_text_arrays_with_empty_dimensions_are_numpys_tolist(tmp_path, fake_numpy, save, shape, want):
    """Without numpy a text array becomes nested lists, as numpy's tolist() (worked out by hand
    here); a zero dimension raised 'ValueError: range() arg 3 must not be zero'."""
    import math

    raw = b"abcd"[:math.prod(shape)]
    path = save({"a": fake_numpy.ndarray(shape, "|S1", raw)}, tmp_path / "text.pt")
    assert load_checkpoint(path)["a"] == want


def test_an_empty_text_array_of_a_trillion_empty_lists_is_refused(tmp_path, fake_numpy, save):
    path = save({"a": fake_numpy.ndarray((2**40, 0), "|S1", b"")}, tmp_path / "text.pt")
    with pytest.raises(pickle.UnpicklingError, match="would be 1,099,511,627,776 nested lists"):
        load_checkpoint(path)


def test_a_scaler_attribute_named_like_the_class_key_cannot_change_the_class(tmp_path, megatron, save):
    """A Megatron scaler whose pickled attributes claim "__apex_class__": apex's era-2 class came
    back as that class (and was read as apex's scaler by FP16_Optimizer.load_state_dict)."""
    scaler = megatron(cur_scale=4.0)
    scaler.__dict__.update({"__apex_class__": "apex.amp.scaler.LossScaler", "dynamic": True, "_loss_scale": 2.0**30,
                            "_max_loss_scale": 2.0**24, "_min_loss_scale": None, "_scale_seq_len": 1, "_unskipped": 0})
    out = load_checkpoint(save({"s": scaler}, tmp_path / "s.pt"))["s"]
    assert out["__apex_class__"] == "megatron.fp16.loss_scaler.DynamicLossScaler"
    assert list(out)[0] == "__apex_class__" and out["cur_scale"] == 4.0
