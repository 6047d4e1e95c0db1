"""Files whose pickle claims tensor sizes their data does not hold (a damaged or crafted file):
``load_checkpoint`` refuses them with its one exception type (``pickle.UnpicklingError``, "this
file was not loaded") saying the file is corrupt -- not torch's ``RuntimeError: can't allocate
memory: you tried to allocate 4398046511104 bytes`` for a 300-byte file, which reads as "buy more
RAM". Also: REDUCE chains through torch's own allowed rebuild helpers, and the CLI's behaviour
on them (exit 1, nothing written).
"""

from __future__ import annotations

import collections
import io
import os
import pathlib
import pickle
import random
import socket
import struct
import subprocess
import sys
import threading
import tracemalloc
import zipfile
import zlib

import pytest
import torch

from fp16kit.legacy import load_checkpoint
from fp16kit.legacy.checkpoints.convert import convert_file
from fp16kit.legacy.checkpoints.errors import CheckpointRefused


def _claim(data: bytes, numel: int, at: bytes = b"cpu") -> bytes:
    """``data`` (a pickle holding one 4-element storage) with the storage's numel replaced."""
    i = data.find(at)
    j = data.find(b"K\x04", i)  # BININT1 4: the storage's numel, after its location
    assert i > 0 and j > i
    new = b"J" + numel.to_bytes(4, "little") if numel < 2**31 else b"\x8a\x08" + numel.to_bytes(8, "little")
    return data[:j] + new + data[j + 2 :]


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
        raise RuntimeError(
            "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't "
            "allocate memory: you tried to allocate 16 bytes. Error code 12 (Cannot allocate memory)"
        )

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
    return data[: at[0]] + new + data[at[1] :]


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


@pytest.mark.parametrize(
    "shape, want",
    [
        ((2, 0), [[], []]),
        ((0, 2), []),
        ((2, 0, 3), [[], []]),
        ((2, 3, 0), [[[], [], []], [[], [], []]]),
        ((2, 2), [[b"a", b"b"], [b"c", b"d"]]),
        ((2, 1, 2), [[[b"a", b"b"]], [[b"c", b"d"]]]),
    ],
)
def test_numpy_text_arrays_with_empty_dimensions_are_numpys_tolist(tmp_path, fake_numpy, save, shape, want):
    """Without numpy a text array becomes nested lists, as numpy's tolist() (worked out by hand
    here); a zero dimension raised 'ValueError: range() arg 3 must not be zero'."""
    import math

    raw = b"abcd"[: math.prod(shape)]
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
    scaler.__dict__.update(
        {
            "__apex_class__": "apex.amp.scaler.LossScaler",
            "dynamic": True,
            "_loss_scale": 2.0**30,
            "_max_loss_scale": 2.0**24,
            "_min_loss_scale": None,
            "_scale_seq_len": 1,
            "_unskipped": 0,
        }
    )
    out = load_checkpoint(save({"s": scaler}, tmp_path / "s.pt"))["s"]
    assert out["__apex_class__"] == "megatron.fp16.loss_scaler.DynamicLossScaler"
    assert list(out)[0] == "__apex_class__" and out["cur_scale"] == 4.0


# ------------------------------------------------------------------------------------------------
# Files that would cost far more than they hold (issue 17 §2): each is refused by the loader's
# pre-scan (fp16kit.legacy.checkpoints.scan) before anything is inflated or handed to torch. The
# bounds are asserted through the loader's limits -- bytes inflated, bytes allocated (tracemalloc),
# torch.load never called -- never by timing.


def _zip_with(pickle_bytes: bytes, extra: dict | None = None) -> bytes:
    """A zip checkpoint of ``{"w": zeros(4)}`` whose data.pkl is ``pickle_bytes``."""
    buf = io.BytesIO()
    torch.save({"w": torch.zeros(4)}, buf)
    return _rezip(buf.getvalue(), lambda record: pickle_bytes) if extra is None else _add(buf.getvalue(), extra)


def _add(data: bytes, records: dict) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w") as z:
        for info in src.infolist():
            z.writestr(info.filename, src.read(info.filename))
        for name, record in records.items():
            z.writestr(name, record)
    return out.getvalue()


@pytest.fixture
def no_torch_load(monkeypatch):
    """torch.load fails the test if it is reached (the pre-scan must refuse first)."""

    def reached(*args, **kwargs):
        raise AssertionError("torch.load was reached")

    monkeypatch.setattr(torch, "load", reached)


@pytest.fixture
def inflated(monkeypatch):
    """A list whose sum is the bytes zipfile inflates (every decompressor it makes is counted);
    more than 16 MiB fails at once (the bomb would inflate ~19 GB)."""
    counted = [0]
    made = zipfile._get_decompressor

    class Counting:
        def __init__(self, inner):
            self.inner = inner

        def decompress(self, data, *args):
            out = self.inner.decompress(data, *args)
            counted[0] += len(out)
            assert counted[0] < 2**24, "inflated more than 16 MiB"
            return out

        def __getattr__(self, name):
            return getattr(self.inner, name)

    monkeypatch.setattr(zipfile, "_get_decompressor", lambda method: Counting(made(method)))
    return counted


def _deflated_zeros(n: int) -> bytes:
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    chunk = bytes(2**20)
    return b"".join(c.compress(chunk) for _ in range(n // 2**20)) + c.flush()


def _bomb(entries: int = 300, size: int = 2**26, stored: bool = False) -> bytes:
    """A real checkpoint plus ``entries`` central-directory entries that all point at ONE deflated
    record of ``size`` zeros (the issue's: ~84 KB, 300 x 64 MiB = ~19 GB to inflate), or at one
    stored record (``stored``)."""
    buf = io.BytesIO()
    torch.save({"w": torch.zeros(4)}, buf)
    data = buf.getvalue()
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        infos = z.infolist()
        start = z.start_dir
    body = bytearray(data[:start])
    deflated = bytes(size) if stored else _deflated_zeros(size)
    method, crc = (0, zlib.crc32(deflated)) if stored else (8, 0)
    name = b"archive/data/big"
    local_offset = len(body)
    body += (
        struct.pack(
            zipfile.structFileHeader,
            zipfile.stringFileHeader,
            20,
            0,
            0,
            method,
            0,
            0,
            crc,
            len(deflated),
            size,
            len(name),
            0,
        )
        + name
        + deflated
    )
    directory = bytearray()

    def entry(filename: bytes, method, crc, csize, usize, offset):
        return (
            struct.pack(
                zipfile.structCentralDir,
                zipfile.stringCentralDir,
                20,
                3,
                20,
                0,
                0,
                method,
                0,
                0,
                crc,
                csize,
                usize,
                len(filename),
                0,
                0,
                0,
                0,
                0,
                offset,
            )
            + filename
        )

    for info in infos:
        directory += entry(
            info.filename.encode(), info.compress_type, info.CRC, info.compress_size, info.file_size, info.header_offset
        )
    for i in range(entries):
        directory += entry(b"archive/data/big%d" % i, method, crc, len(deflated), size, local_offset)
    count = len(infos) + entries
    end = struct.pack(
        zipfile.structEndArchive, zipfile.stringEndArchive, 0, 0, count, count, len(directory), len(body), 0
    )
    return bytes(body + directory + end)


@pytest.mark.parametrize("stored", [False, True], ids=["deflated (the issue's)", "stored"])
def test_a_zip_bomb_is_refused_before_anything_is_inflated(tmp_path, inflated, stored):
    """300 directory entries sharing one record: deflated 64 MiB (refused for its ratio and its
    overlap), or stored 64 KB (300 entries reading the same bytes: refused for the overlap)."""
    data = _bomb(size=2**16, stored=True) if stored else _bomb()
    assert len(data) < 100_000  # the 84 KB file
    said = "overlap" if stored else "MAX_INFLATION = 32"
    with pytest.raises(CheckpointRefused, match=said) as info:
        load_checkpoint(io.BytesIO(data))
    assert info.value.kind == "damaged"
    path = tmp_path / "bomb.pt"
    path.write_bytes(data)
    with pytest.raises(CheckpointRefused, match=said):
        convert_file(path, tmp_path / "out.pt")  # checks every record's CRC: it inflated all 300
    assert inflated[0] == 0 and not (tmp_path / "out.pt").exists()


def test_a_record_deflated_far_beyond_what_torch_save_writes_is_refused_uninflated(inflated):
    """One 64 MiB record of zeros, deflated to 64 KB: no overlap, but more than MAX_INFLATION."""
    data = _bomb(entries=1)
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        assert z.getinfo("archive/data/big0").compress_size < 2**17
    with pytest.raises(CheckpointRefused, match=r"claims 67,108,864 bytes from 6.* stored .*MAX_INFLATION = 32"):
        load_checkpoint(io.BytesIO(data))
    assert inflated[0] == 0


def test_a_pickle_record_stored_twice_is_refused():
    """Two data.pkl records: which one a reader takes is its own choice (torch's and zipfile's, the
    CRC check's, need not agree), so a corrupted copy could load silently."""
    buf = io.BytesIO()
    torch.save({"step": 1}, buf)
    good = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    out = io.BytesIO()
    with pytest.warns(UserWarning, match="Duplicate name"), zipfile.ZipFile(out, "w") as z:
        for info in good.infolist():
            record = good.read(info.filename)
            if info.filename.endswith("data.pkl"):
                z.writestr(info.filename, record.replace(b"step", b"stop"))
            z.writestr(info.filename, record)
    data = out.getvalue()
    assert torch.load(io.BytesIO(data), weights_only=True)  # control: torch takes one, says nothing
    with pytest.raises(CheckpointRefused, match="holds the record 'archive/data.pkl' twice"):
        load_checkpoint(io.BytesIO(data))


# ---------------------------------------------------------------------- what is not a regular file


class _Unblock:
    """Opens the FIFO ``path`` for writing whenever a reader has it open, and writes garbage, so
    that a loader which opened it (the bug) gets an error instead of waiting forever."""

    def __init__(self, path):
        self.path, self.done, self.opened = path, threading.Event(), 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.done.wait(0.01):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO while nobody reads
            except OSError:
                continue
            self.opened += 1
            os.write(fd, b"not a checkpoint")
            os.close(fd)

    def stop(self):
        self.done.set()
        self.thread.join()


def _special(tmp_path, kind):
    path = tmp_path / kind
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
        return path, s
    elif kind == "directory":
        path.mkdir()
    else:
        return pathlib.Path("/dev/null"), None
    return path, None


@pytest.mark.parametrize(
    "kind, said", [("fifo", "a FIFO"), ("socket", "a socket"), ("device", "a device"), ("directory", "a directory")]
)
def test_what_is_not_a_regular_file_is_refused_without_reading_it(tmp_path, kind, said):
    path, keep = _special(tmp_path, kind)
    unblock = _Unblock(path) if kind == "fifo" else None
    try:
        with pytest.raises(CheckpointRefused, match=f"is {said}.*, not a regular file") as info:
            load_checkpoint(path)
    finally:
        if unblock:
            unblock.stop()
        if keep:
            keep.close()
    assert info.value.kind == "not_file" and repr(str(path)) in str(info.value)
    assert unblock is None or unblock.opened == 0  # never opened for reading


def test_file_objects_still_load(tmp_path):
    path = tmp_path / "ok.pt"
    torch.save({"w": torch.ones(2)}, path)
    with open(path, "rb") as opened:
        assert load_checkpoint(opened)["w"].tolist() == [1.0, 1.0]
    assert load_checkpoint(io.BytesIO(path.read_bytes()))["w"].tolist() == [1.0, 1.0]


# -------------------------------------------------------------------------- pickles that allocate

_G = b"c__builtin__\nbytearray\n"
_ENCODE = b"c_codecs\nencode\n"


def _text(s: str) -> bytes:
    data = s.encode()
    return b"X" + struct.pack("<I", len(data)) + data


def _hex_chain(levels: int) -> bytes:
    """_codecs.encode(... _codecs.encode(_codecs.encode("ab", "utf-8"), "hex") ..., "hex"): each
    level doubles; 25 levels of a few bytes each make 64 MiB."""
    inner = _ENCODE + _text("a" * 2) + _text("utf-8") + b"\x86R"
    for _ in range(levels):
        inner = _ENCODE + inner + _text("hex") + b"\x86R"
    return inner


def _copies(n: int, size: int = 2**16) -> bytes:
    """One ``size``-byte bytes object, memoized, copied ``n`` times by bytearray(...) into a list."""
    made = _ENCODE + _text("x" * size) + _text("latin1") + b"\x86Rq\x00a"  # ..., BINPUT 0, APPEND
    return b"]" + made + (_G + b"h\x00\x85Ra") * n  # bytearray(BINGET 0), APPEND


PICKLE_BOMBS = {
    "bytearray(2**26)": (
        b"\x80\x02" + _G + b"J\x00\x00\x00\x04\x85R.",
        "builds 67,108,864 bytes by builtins.bytearray",
    ),
    "_codecs.encode hex chain": (
        b"\x80\x02" + _hex_chain(25) + b".",
        "calls _codecs.encode on something other than text",
    ),
    "one bytes object copied 2,000 times": (b"\x80\x02" + _copies(2000) + b".", "more than .*ALLOCATION_RATIO = 4"),
    "torch.FloatTensor(2**24)": (
        b"\x80\x02ctorch\nFloatTensor\nJ\x00\x00\x00\x01\x85R.",
        r"calls torch.FloatTensor\(...\) with arguments, which allocates",
    ),
    "torch.Tensor.__new__(2**24)": (
        b"\x80\x02ctorch\nTensor\nJ\x00\x00\x00\x01\x85\x81.",
        r"calls torch.Tensor\(...\) with arguments",
    ),
    "UntypedStorage(2**26)": (
        b"\x80\x02ctorch.storage\nUntypedStorage\nJ\x00\x00\x00\x04\x85R.",
        "makes a storage by calling",
    ),
}


def _refused_with_peak(data: bytes, said: str):
    """load_checkpoint(data) refuses with ``said``; returns the refusal and the peak traced memory."""
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointRefused, match=said) as info:
            load_checkpoint(io.BytesIO(data))
        return info, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("case", list(PICKLE_BOMBS))
def test_a_pickle_that_allocates_more_than_the_file_holds_is_refused_before_torch_reads_it(case, no_torch_load):
    pkl, said = PICKLE_BOMBS[case]
    data = _zip_with(pkl)
    info, peak = _refused_with_peak(data, said)
    assert peak < 2 * len(data) + 2**21, peak  # what it holds, not what it asks for
    assert info.value.kind == "structure" and "the BytesIO it was given" in str(info.value)


def test_the_allocation_bound_is_the_files_size(monkeypatch):
    """The budget scales with the file: a legit bytes object of 3 MB in a 3 MB file loads."""
    blob = bytes(range(256)) * (3 * 2**12)
    buf = io.BytesIO()
    torch.save({"blob": blob, "copy": bytearray(blob)}, buf)
    out = load_checkpoint(io.BytesIO(buf.getvalue()))
    assert out["blob"] == blob and out["copy"] == blob


def test_a_200k_deep_tuple_is_refused_not_a_segfault(tmp_path):
    """Hashing it (a dict key) overflows the C stack: torch's reader died with SIGSEGV under
    load_checkpoint. Run in a child process, so that the bug shows as a failure, not a crash."""
    data = _zip_with(b"\x80\x02}N" + b"\x85" * 200_000 + b"K\x01s.")
    path = tmp_path / "deep.pt"
    path.write_bytes(data)
    code = (
        "import sys\nfrom fp16kit.legacy import load_checkpoint\nfrom fp16kit.legacy.checkpoints.errors import "
        "CheckpointRefused\ntry:\n    load_checkpoint(sys.argv[1])\nexcept CheckpointRefused as e:\n"
        "    print(e.kind, e.subject)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "structure its containers nest deeper than" in done.stdout


def test_a_bare_apex_class_is_refused_not_returned_as_fp16kits_stand_in(no_torch_load):
    """GLOBAL apex.amp.scaler.LossScaler, no NEWOBJ/BUILD: load_checkpoint returned fp16kit's
    stand-in class itself (and convert-checkpoint then failed with a PicklingError)."""
    for pkl in (
        b"\x80\x02capex.amp.scaler\nLossScaler\n.",
        b"\x80\x02}X\x01\x00\x00\x00kcargparse\nNamespace\ns.",
        b"\x80\x02]c__builtin__\nbytes\na.",
    ):
        with pytest.raises(CheckpointRefused, match=r"itself \(the class or function, not an object made by it\)"):
            load_checkpoint(io.BytesIO(_zip_with(pkl)))


# -------------------------------------------------------------------- storages not in the file


def _legacy_unfilled(numel: int = 2**24) -> bytes:
    """The issue's 829-byte legacy file: a FloatStorage of ``numel`` items that the list of stored
    keys does not name, so torch never fills it (64 MiB of uninitialized memory)."""
    buf = io.BytesIO()
    torch.save({"w": torch.zeros(4)}, buf, _use_new_zipfile_serialization=False)
    data = _claim(buf.getvalue(), numel)
    keys = data.rindex(b"\x80\x02]")  # the last pickle: the list of stored keys
    return data[:keys] + b"\x80\x02]."  # an empty list, and no storage data


def test_a_legacy_storage_the_file_never_fills_is_refused(tmp_path, no_torch_load):
    data = _legacy_unfilled()
    assert len(data) < 900
    with pytest.raises(CheckpointRefused, match="claims storages of 67,108,864 bytes, more than the rest of the file"):
        load_checkpoint(io.BytesIO(data))
    small = _legacy_unfilled(numel=4) + bytes(24)  # fits the file, but still never filled
    with pytest.raises(CheckpointRefused, match="whose data the file does not hold"):
        load_checkpoint(io.BytesIO(small))


def test_convert_checkpoint_never_writes_uninitialized_memory(tmp_path):
    path = tmp_path / "old.pt"
    path.write_bytes(_legacy_unfilled())
    with pytest.raises(CheckpointRefused):
        convert_file(path, tmp_path / "out.pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.pt"]


def test_a_zip_storage_without_its_record_is_refused(no_torch_load):
    buf = io.BytesIO()
    torch.save({"w": torch.zeros(4)}, buf)
    data = _rezip(buf.getvalue(), lambda r: r.replace(b"X\x01\x00\x00\x000", b"X\x01\x00\x00\x007"))
    with pytest.raises(CheckpointRefused, match="names storage '7', but the archive holds no record 'archive/data/7'"):
        load_checkpoint(io.BytesIO(data))


# ---------------------------------------------------------------------------------- fuzzing


def _seeds(fake_apex, fake_numpy) -> dict[str, bytes]:
    """Valid checkpoints as apex-era code wrote them (era-1 and era-2 scalers, Megatron's args
    Namespace, numpy RNG state, a tensor with an attribute, shared tensors), in both formats."""
    import argparse

    w = torch.arange(6, dtype=torch.float16).reshape(2, 3)
    master = torch.ones(3)
    master.model_parallel = True
    checkpoint = {
        "model": {"w": w, "w_view": w[1]},
        "optimizer": {
            "loss_scaler": fake_apex.era1_dynamic(cur_scale=2.0**16),
            "overflow": False,
            "fp32_from_fp16": [[master]],
            "state": {0: {"step": 3}},
        },
        "amp": {"loss_scaler0": fake_apex.era2(2.0**10)},
        "args": argparse.Namespace(lr=1e-3, params_dtype=torch.float16),
        "np_rng_state": fake_numpy.rng_state(list(range(8)), pos=8),
        "iteration": 7,
        "blob": b"\x00\x01" * 8,
        "set": {1, 2},
        "size": torch.Size([2, 3]),
    }
    out = {}
    for legacy in (False, True):
        buf = io.BytesIO()
        torch.save(checkpoint, buf, _use_new_zipfile_serialization=not legacy)
        out["legacy" if legacy else "zip"] = buf.getvalue()
    return out


def _mutants(seeds: dict[str, bytes], rng: random.Random, n: int):
    for i in range(n):
        name = rng.choice(sorted(seeds))
        data = bytearray(seeds[name])
        how = rng.choice(["truncate", "flip", "flip pickle", "flip many"])
        if how == "truncate":
            data = data[: rng.randrange(len(data))]
        elif how == "flip pickle" and name == "zip":

            def edit(record, rng=rng):
                record = bytearray(record)
                record[rng.randrange(len(record))] ^= 1 << rng.randrange(8)
                return bytes(record)

            data = bytearray(_rezip(bytes(data), edit))  # a valid CRC: the pickle parser sees the damage
        else:
            span = len(data) if how == "flip many" or name == "zip" else min(len(data), 1200)  # legacy: its pickles
            for _ in range(1 if how != "flip many" else rng.randint(2, 8)):
                data[rng.randrange(span)] ^= 1 << rng.randrange(8)
        yield f"{i}: {name} {how}", bytes(data)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_mutated_checkpoints_load_or_raise_checkpoint_refused_only(fake_apex, fake_numpy_2):
    """400 truncations and bit flips of real apex-era checkpoints (fixed seed): each either loads
    or raises exactly CheckpointRefused -- never KeyError, IndexError, struct.error,
    AssertionError, RuntimeError or anything else."""
    seeds = _seeds(fake_apex, fake_numpy_2)
    fake_apex.remove()
    for data in seeds.values():
        assert load_checkpoint(io.BytesIO(data))["iteration"] == 7  # control: the seeds load
    outcomes = {"loaded": 0, "refused": 0}
    for label, data in _mutants(
        seeds, random.Random(int(os.environ.get("FUZZ_SEED", 17))), int(os.environ.get("FUZZ_N", 400))
    ):
        try:
            load_checkpoint(io.BytesIO(data))
            outcomes["loaded"] += 1
        except CheckpointRefused:
            outcomes["refused"] += 1
        except Exception as e:  # noqa: BLE001 -- what the test is about
            pytest.fail(f"mutant {label}: {type(e).__module__}.{type(e).__name__}: {e}")
    assert outcomes["refused"] > 200, outcomes


def _legacy_cut_after(opcode: str) -> bytes:
    """A legacy checkpoint cut just after the main pickle's first ``opcode`` (its argument gone)."""
    import pickletools

    buf = io.BytesIO()
    torch.save({"w": torch.zeros(4), "n": 123456}, buf, _use_new_zipfile_serialization=False)
    data = buf.getvalue()
    stream = io.BytesIO(data)
    for index in range(4):
        for op, _arg, pos in pickletools.genops(stream):
            if index == 3 and op.name == opcode:
                return data[: pos + 1]
    raise AssertionError(opcode)


def _legacy_tar() -> bytes:
    import tarfile

    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in ("sys_info", "pickle", "tensors", "storages"):
            info = tarfile.TarInfo(name)
            info.size = 3
            tar.addfile(info, io.BytesIO(b"\x80\x02."))
    return out.getvalue()


def _legacy_other_key() -> bytes:
    buf = io.BytesIO()
    torch.save({"w": torch.zeros(4)}, buf, _use_new_zipfile_serialization=False)
    data = buf.getvalue()
    keys = data.rindex(b"\x80\x02]")
    at = data.index(b"X", keys) + 5  # the first stored key's text
    return data[:at] + b"x" + data[at + 1 :]


LEAKS = {  # what torch raised, leaking through load_checkpoint: the file, its refusal
    "IndexError (cut inside BININT1)": (lambda: _legacy_cut_after("BININT1"), "truncated or corrupt"),
    "struct.error (cut inside BININT)": (lambda: _legacy_cut_after("BININT"), "truncated or corrupt"),
    "AssertionError (a storage id not a tuple)": (
        lambda: _zip_with(b"\x80\x02K\x00Q."),
        "refers to a storage in a form",
    ),
    "AssertionError (a stored key no storage has)": (_legacy_other_key, "whose data the file does not hold"),
    "KeyError (a memo entry never stored)": (lambda: _zip_with(b"\x80\x02h\x05."), "refers to a value it never stored"),
    "IndexError (SETITEMS without a value)": (
        lambda: _zip_with(b"\x80\x02}(K\x01u."),
        "sets a dict item without a value",
    ),
    "RuntimeError with torch's weights_only=False advice (legacy tar)": (_legacy_tar, "legacy tar format"),
    # LONG4 (protocol 1+, never in torch.save's output): the refusal quoted torch's whole message,
    # "Re-running `torch.load` with `weights_only` set to `False` will likely succeed" included
    "torch's advice quoted for an unsupported opcode (LONG4)": (
        lambda: _zip_with(b"\x80\x02\x8b\xff\xff\xff\x7f."),
        r"no pickle opcode torch.save writes \(Unsupported operand 139\)",
    ),
}


@pytest.mark.parametrize("case", list(LEAKS))
def test_what_torch_raises_on_a_malformed_file_is_one_checkpoint_refused(case):
    make, said = LEAKS[case]
    with pytest.raises(CheckpointRefused, match=said) as info:
        load_checkpoint(io.BytesIO(make()))
    assert type(info.value) is CheckpointRefused and "weights_only=False` " not in str(info.value)
    assert "weights_only` set to `False`" not in str(info.value) and "Weights only load failed" not in str(info.value)
    assert "the BytesIO it was given" in str(info.value)


# ------------------------------------------------------------------------------------------------
# A second adversarial round (issue 17 §2): file forms where what the pre-scan checked was not what
# torch then read, or where a few bytes still asked for memory or work the file does not hold.

_HOSTILE_PICKLE = b"\x80\x02c__builtin__\nbytearray\nJ\x00\x00\x00\x10\x85R."  # bytearray(2**28)


def _zip_records(records: list[tuple[str, bytes]]) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for name, record in records:
            z.writestr(name, record)
    return out.getvalue()


def _legit_records(folder: str = "archive/") -> list[tuple[str, bytes]]:
    buf = io.BytesIO()
    torch.save({"w": torch.zeros(4)}, buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
        return [(folder + i.filename[len("archive/") :], z.read(i.filename)) for i in z.infolist()]


ZIP_NAME_TRICKS = {
    # torch's zip reader (miniz) looks names up ignoring ASCII case: it read the hostile twin, the
    # scan and the CRC check the benign one (1.2 KB -> 5 GB, MemoryError)
    "a data.pkl twin differing in case, after": (
        lambda: _zip_records(_legit_records() + [("archive/Data.pkl", _HOSTILE_PICKLE)]),
        "one name to torch's reader",
    ),
    "a data.pkl twin differing in case, before": (
        lambda: _zip_records(_legit_records()[:1] + [("archive/DATA.PKL", _HOSTILE_PICKLE)] + _legit_records()[1:]),
        "one name to torch's reader",
    ),
    # torch reads FOLDER/data.pkl, FOLDER the first record's: the scan read the first record ending
    # in /data.pkl (1.2 KB -> 2.3 GB, loaded)
    "a benign data.pkl in a subfolder, the hostile one in the first record's folder": (
        lambda: _zip_records([("a/version", b"3\n")] + _legit_records("a/b/") + [("a/data.pkl", _HOSTILE_PICKLE)]),
        "builds 268,435,456 bytes by builtins.bytearray",
    ),
    "records outside the first record's folder": (
        lambda: _zip_records([("a/version", b"3\n")] + _legit_records("b/") + [("a/data.pkl", _HOSTILE_PICKLE)]),
        "is outside the folder 'a/' of its first record",
    ),
    "a NUL in a record's name": (
        lambda: _zip_records(_legit_records() + [("archive/data/0@x", b"")]).replace(b"0@x", b"0\x00x"),
        "has a NUL byte in its name",
    ),
}


@pytest.mark.parametrize("case", list(ZIP_NAME_TRICKS))
def test_the_pickle_scanned_is_the_one_torch_reads(case, inflated):
    make, said = ZIP_NAME_TRICKS[case]
    data = make()
    info, peak = _refused_with_peak(data, said)
    assert peak < 2**22, peak  # not the 256 MiB the hostile pickle asks for
    assert "weights_only=False` " not in str(info.value)


def test_records_named_in_other_cases_or_folders_still_load():
    """Storage keys are looked up as torch does; a folder name of any case is torch's own choice."""
    data = _zip_records(_legit_records("MyModel/"))
    assert load_checkpoint(io.BytesIO(data))["w"].tolist() == [0.0] * 4


def _pid(legacy: bool) -> bytes:
    """The persistent id (MARK ... BINPERSID) of the one 4-float storage of a real checkpoint's pickle."""
    buf = io.BytesIO()
    torch.save({"w": torch.zeros(4)}, buf, _use_new_zipfile_serialization=not legacy)
    data = buf.getvalue()
    if not legacy:
        data = zipfile.ZipFile(io.BytesIO(data)).read("archive/data.pkl")
    start = data.index(b"(X\x07\x00\x00\x00storage")
    return data[start : data.index(b"Q", start) + 1]


def _with_object(legacy: bool, obj: bytes) -> bytes:
    """A checkpoint of ``{"w": zeros(4)}`` whose object pickle is ``{"w": <obj>}`` (``obj`` uses the storage)."""
    buf = io.BytesIO()
    torch.save({"w": torch.zeros(4)}, buf, _use_new_zipfile_serialization=not legacy)
    data = buf.getvalue()
    pkl = b"\x80\x02}X\x01\x00\x00\x00w" + obj + b"s."
    if not legacy:
        return _rezip(data, lambda record: pkl)
    stream = io.BytesIO(data)
    import pickletools

    for _ in range(3):
        for _op in pickletools.genops(stream):
            pass
    start = stream.tell()
    for _op in pickletools.genops(stream):
        pass
    return data[:start] + pkl + data[stream.tell() :]


_J = lambda n: b"J" + struct.pack("<i", n)  # noqa: E731
_EMPTY_STORAGE = b"ctorch.storage\nUntypedStorage\n)R"
_V2 = b"ctorch._utils\n_rebuild_tensor_v2\n"
_NO_HOOKS = b"\x89ccollections\nOrderedDict\n)R"


def _growing(storage: bytes, size: int = 2**29, stride: int = 1) -> bytes:
    """torch.FloatTensor(), then BUILD: tensor.set_(storage, 0, (size,), (stride,))."""
    return b"ctorch\nFloatTensor\n)R(" + storage + b"K\x00" + _J(size) + b"\x85" + _J(stride) + b"\x85tb"


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy-format"])
@pytest.mark.parametrize(
    "case, said",
    [
        # an empty storage made by a call grows to fit: 973 bytes loaded a 2 GiB tensor of uninitialized
        # memory (convert-checkpoint wrote it out); 2**31 items raised a bare RuntimeError (can't allocate)
        ("set_ on an empty storage", "makes a storage by calling torch.storage.UntypedStorage"),
        ("rebuild on an empty storage", "makes a storage by calling torch.storage.UntypedStorage"),
        # a legacy-format storage grew to fit a view set on it (2 GiB asked of the allocator)
        (
            "set_ past the file's storage",
            r"reach past its storage: a tensor's state \(tensor.set_\) needs 536,870,912 items",
        ),
        # a zero-stride view of 2**28 items of one float, converted: 2 GiB from 1 KB (loaded)
        ("a converted zero-stride view", "builds a copy of 268,435,456 items by torch._utils._rebuild_device_tensor"),
    ],
)
def test_a_view_that_grows_or_expands_into_memory_the_file_lacks_is_refused(legacy, case, said, no_torch_load):
    pid = _pid(legacy)
    obj = {
        "set_ on an empty storage": lambda: _growing(_EMPTY_STORAGE),
        "rebuild on an empty storage": lambda: (
            _V2 + b"(" + _EMPTY_STORAGE + b"K\x00" + _J(2**29) + b"\x85K\x01\x85" + _NO_HOOKS + b"tR"
        ),
        "set_ past the file's storage": lambda: _growing(pid),
        "a converted zero-stride view": lambda: (
            b"ctorch._utils\n_rebuild_device_tensor_from_cpu_tensor\n("
            + _V2
            + b"("
            + pid
            + b"K\x00"
            + _J(2**28)
            + b"\x85K\x00\x85"
            + _NO_HOOKS
            + b"tRctorch\nfloat64\nX\x03\x00\x00\x00cpu\x89tR"
        ),
    }[case]()
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointRefused, match=said):
            load_checkpoint(io.BytesIO(_with_object(legacy, obj)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**22, peak


@pytest.mark.parametrize("n", [2, 3, 5])
def test_a_tensor_state_of_another_length_is_refused_in_words(n, no_torch_load):
    """BUILD(tensor, (storage, 0)): the scan's own 'not enough values to unpack' was the reason given."""
    state = [_pid(False), b"K\x00", b"K\x04\x85", b"K\x01\x85", b"K\x00"][:n]
    obj = b"ctorch\nFloatTensor\n)R(" + b"".join(state) + b"tb"
    with pytest.raises(CheckpointRefused, match=f"sets a tensor's state \\(tensor.set_\\) from {n} values"):
        load_checkpoint(io.BytesIO(_with_object(False, obj)))


def test_a_size_of_many_huge_dimensions_is_not_multiplied_out():
    """200,000 sizes of 2**62 and strides 0: the scan multiplied them (minutes for 2.4 MB); now
    only the view's extent is computed, and its item count capped."""
    k = 200_000
    obj = (
        _V2
        + b"("
        + _pid(False)
        + b"K\x00("
        + (b"\x8a\x08" + (2**62).to_bytes(8, "little")) * k
        + b"t("
        + b"K\x00" * k
        + b"t"
        + _NO_HOOKS
        + b"tR"
    )
    with pytest.raises(CheckpointRefused):
        load_checkpoint(io.BytesIO(_with_object(False, obj)))


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy-format"])
def test_views_of_every_shape_torch_save_writes_still_load(legacy):
    """Offsets, transposes, slices, zero strides (expand), empty views, of a big storage: each
    loads as torch.load(weights_only=True) gives it, sharing its storage."""
    base = torch.arange(60.0).reshape(6, 10)
    obj = {
        "base": base,
        "t": base.t(),
        "slice": base[2:, 3:7],
        "step": base[:, ::3],
        "row": base[5],
        "expand": torch.arange(3.0).expand(4, 3),
        "empty": base[3:3],
        "scalar": base[1, 1],
        "h": base.half()[1:],
        "c": torch.tensor([1 + 2j, 3j])[1:],
        "b": torch.tensor([True, False]),
    }
    buf = io.BytesIO()
    torch.save(obj, buf, _use_new_zipfile_serialization=not legacy)
    want = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    got = load_checkpoint(io.BytesIO(buf.getvalue()))
    for k, v in want.items():
        assert (
            got[k].stride() == v.stride() and got[k].storage_offset() == v.storage_offset() and torch.equal(got[k], v)
        )
    assert got["t"].untyped_storage().data_ptr() == got["base"].untyped_storage().data_ptr()


def _shared_tuple(levels: int) -> bytes:
    """T0 = (); T(i+1) = (Ti, Ti), memoized: a few bytes per level, 2**levels items to hash."""
    return b")q\x00" + b"h\x00\x86q\x00" * levels


_P = 2**61 - 1  # Python's int hash is the value modulo this prime: these ints all hash alike


def _colliding_ints(n: int, after: bytes = b"") -> bytes:
    return b"".join(b"\x8a\x10" + (k * _P).to_bytes(16, "little", signed=True) + after for k in range(1, n + 1))


HASH_BOMBS = {
    # a 1.2 KB file as one dict key: hashing it visited 2**60 items (never ended)
    "a shared tuple as a dict key": b"\x80\x02}" + _shared_tuple(60) + b"K\x01s.",
    "a shared tuple as a set member": b"\x80\x02c__builtin__\nset\n]" + _shared_tuple(60) + b"a\x85R.",
    "a shared tuple in OrderedDict's pairs": b"\x80\x02ccollections\nOrderedDict\n]"
    + _shared_tuple(60)
    + b"K\x01\x86a\x85R.",
    # each copy hashes the keys again: 2**18 steps a copy, 100,000 copies
    "a dict of one costly key, copied": b"\x80\x02]}"
    + _shared_tuple(18)
    + b"K\x01sq\x01("
    + b"ccollections\nOrderedDict\nh\x01\x85R" * 100_000
    + b"e.",
    # 50,000 int keys of one hash: each compared with all before it (950 KB: 14 s, quadratic)
    "ints chosen to collide, as dict keys": b"\x80\x02}(" + _colliding_ints(50_000, b"N") + b"u.",
    "ints chosen to collide, in a set": b"\x80\x02c__builtin__\nset\n](" + _colliding_ints(50_000) + b"e\x85R.",
}


@pytest.mark.parametrize("case", list(HASH_BOMBS))
def test_keys_that_take_more_steps_to_hash_than_the_file_has_bytes_are_refused(case, no_torch_load):
    """Bounded by the budget the scan charges each key's hashing and comparing to (never timed)."""
    with pytest.raises(CheckpointRefused, match="hashing and comparing take more steps than the file has bytes"):
        load_checkpoint(io.BytesIO(_zip_with(HASH_BOMBS[case])))


def test_int_float_and_tuple_keys_of_real_checkpoints_still_load():
    obj = {
        "state": {i: {"step": i} for i in range(5000)},
        (1, 2): {(3, (4, 5)), 6, -1, -2},
        1.5: 2,
        -7: None,
        "od": collections.OrderedDict([((1, 2), 3), (4, 5)]),
    }
    buf = io.BytesIO()
    torch.save(obj, buf)
    assert load_checkpoint(io.BytesIO(buf.getvalue())) == torch.load(io.BytesIO(buf.getvalue()), weights_only=True)


def _appended_archive(good: bytes, pkl: bytes = b"", archive: bytes | None = None) -> bytes:
    """Bytes that, appended to the checkpoint ``good``, make a new end of the archive: records of a
    folder of their own and a directory (offsets counted from the start of ``good``) naming them
    only -- what torch's reader, reading the directory at the end of the file, then reads."""
    tail = (archive or _zip_with(pkl)).replace(b"archive/", b"appendd/")  # the same length
    start = zipfile.ZipFile(io.BytesIO(tail)).start_dir
    directory, i = bytearray(tail[start:]), 0
    while directory[i : i + 4] == b"PK\x01\x02":
        n, m, k = struct.unpack("<HHH", directory[i + 28 : i + 34])
        directory[i + 42 : i + 46] = struct.pack("<I", struct.unpack("<I", directory[i + 42 : i + 46])[0] + len(good))
        i += 46 + n + m + k
    directory[i + 16 : i + 20] = struct.pack("<I", struct.unpack("<I", directory[i + 16 : i + 20])[0] + len(good))
    return tail[:start] + bytes(directory)


def test_a_file_growing_after_its_scan_is_read_as_it_was_scanned(tmp_path, monkeypatch):
    """Appended to between the scan and torch.load, a zip checkpoint pointed torch at a new
    directory the scan never saw (a 256 MiB bytearray from a few appended bytes, loaded)."""
    import fp16kit.legacy.checkpoints.load as checkpoint

    buf = io.BytesIO()
    torch.save({"w": torch.ones(2)}, buf)
    good = buf.getvalue()
    tail = _appended_archive(good, _HOSTILE_PICKLE)
    assert isinstance(torch.load(io.BytesIO(good + tail), weights_only=True), bytearray)  # control
    path = tmp_path / "growing.pt"
    path.write_bytes(good)
    real = checkpoint.scan

    def scan_then_grow(f, opened):
        end = real(f, opened)
        with open(path, "ab") as out:  # another process, saving into the file
            out.write(tail)
        return end

    monkeypatch.setattr(checkpoint, "scan", scan_then_grow)
    tracemalloc.start()
    try:
        out = load_checkpoint(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert out["w"].tolist() == [1.0, 1.0] and peak < 2**24, peak


@pytest.mark.parametrize("torch_fails", [True, False], ids=["torch fails", "torch loads"])
def test_a_path_replaced_by_a_fifo_while_loading_is_never_opened(tmp_path, monkeypatch, torch_fails):
    """After torch.load, the path is opened again (to word a refusal, to check data.pkl's CRC):
    replaced by a FIFO meanwhile, that open waited forever for a writer."""
    path = tmp_path / "ckpt.pt"
    torch.save({"w": torch.ones(2)}, path)
    real = torch.load
    unblock = []

    def load_then_swap(*args, **kwargs):
        out = real(*args, **kwargs)
        os.unlink(path)
        os.mkfifo(path)
        unblock.append(_Unblock(path))
        if torch_fails:
            raise RuntimeError("PytorchStreamReader failed reading zip archive: failed finding central directory")
        return out

    monkeypatch.setattr(torch, "load", load_then_swap)
    try:
        if torch_fails:
            with pytest.raises(CheckpointRefused):
                load_checkpoint(path)
        else:
            assert load_checkpoint(path)["w"].tolist() == [1.0, 1.0]
    finally:
        for u in unblock:
            u.stop()
    assert unblock and unblock[0].opened == 0  # never opened for reading


def test_convert_checks_the_crcs_of_the_file_it_scanned(tmp_path, monkeypatch, inflated):
    """convert_file scanned the path, then opened it again to CRC-check every record: a zip bomb
    appended in between (or the path replaced) was inflated in full (19 GB)."""
    import fp16kit.legacy.checkpoints.scan as checkpoint_scan

    buf = io.BytesIO()
    torch.save({"w": torch.ones(2)}, buf)
    good = buf.getvalue()
    tail = _appended_archive(good, archive=_bomb(entries=3))
    path = tmp_path / "growing.pt"
    path.write_bytes(good)
    real = checkpoint_scan.scan

    def scan_then_grow(f, opened):
        end = real(f, opened)
        with open(path, "ab") as out:
            out.write(tail)
        return end

    monkeypatch.setattr(checkpoint_scan, "scan", scan_then_grow)
    with pytest.raises(CheckpointRefused, match="MAX_INFLATION"):  # the load's own scan, of the grown file
        convert_file(path, tmp_path / "out.pt")
    assert inflated[0] < 2**16, inflated[0]  # the records scanned, not the bomb's 3 x 64 MiB
    assert not (tmp_path / "out.pt").exists()


def test_a_zip_comment_torch_cannot_read_past_is_one_refusal_naming_the_file(tmp_path):
    """A 64 KB archive comment: torch's zip reader seeks before the start of the file looking for
    the directory; from a file that was a bare OSError (Errno 22, Invalid argument)."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for name, record in _legit_records():
            z.writestr(name, record)
        z.comment = b"x" * 65535
    path = tmp_path / "comment.pt"
    path.write_bytes(out.getvalue())
    with pytest.raises(CheckpointRefused, match="could not read .*comment.pt.*negative seek value"):
        load_checkpoint(path)


# ------------------------------------------------------------------------------------------------
# What the pre-scan itself keeps in memory, per byte of pickle (issue 17 §2, third round): a flat
# pickle of 10 million Nones cost the scan ~108 bytes of memory per file byte (1.08 GB for 10 MB)
# where torch's own reader keeps a reference per None (~8). Measured up to the moment torch.load
# would start (the file's bytes themselves are allocated before tracing starts).


class _TorchReached(BaseException):
    """Raised where torch.load would start reading (a BaseException: the loader lets it pass)."""


def _scanned_with_peak(monkeypatch, data: bytes) -> int:
    """The peak traced memory of load_checkpoint(data) up to torch.load (which is never run)."""
    peaks = []

    def reached(*args, **kwargs):
        peaks.append(tracemalloc.get_traced_memory()[1])
        raise _TorchReached

    monkeypatch.setattr(torch, "load", reached)
    tracemalloc.start()
    try:
        with pytest.raises(_TorchReached):
            load_checkpoint(io.BytesIO(data))
    finally:
        tracemalloc.stop()
    return peaks[0]


def _ints(opcode: bytes, fmt: str, n: int) -> bytes:
    return b"".join(opcode + struct.pack(fmt, i % 65536 if fmt == "<H" else i) for i in range(n))


FLAT_PICKLES = {  # name: (the pickle's body, built in about n bytes; bytes per byte it may cost)
    "a list of Nones, by APPENDS": (lambda n: b"](" + b"N" * n + b"e", 16),
    "a tuple of Nones": (lambda n: b"(" + b"N" * n + b"t", 16),
    "Nones left on the stack": (lambda n: b"N" * n, 16),
    "a list of small ints": (lambda n: b"](" + b"K\x07" * (n // 2) + b"e", 16),
    "a list of memo references": (lambda n: b"]Nq\x00(" + b"h\x00" * (n // 2) + b"e", 16),
}
FLAT_CONTAINERS = {  # values the scan cannot share: its ratio, at most
    "empty lists": lambda n: b"](" + b"]" * n + b"e",
    "empty dicts": lambda n: b"](" + b"}" * n + b"e",
    "empty sets": lambda n: b"](" + b"\x8f" * n + b"e",
    "1-tuples": lambda n: b"](" + b"N\x85" * (n // 2) + b"e",
    "dicts of one int key": lambda n: b"](" + b"}K\x01Ns" * (n // 4) + b"e",
    "distinct BININT2s": lambda n: b"](" + _ints(b"M", "<H", n // 3) + b"e",
    "distinct BININTs": lambda n: b"](" + _ints(b"J", "<i", n // 5) + b"e",
    "memo entries (LONG_BINPUT)": lambda n: b"N" + _ints(b"r", "<I", n // 5),
    "short strings": lambda n: b"](" + b"".join(b"X\x02\x00\x00\x00%02d" % (i % 100) for i in range(n // 7)) + b"e",
}


@pytest.mark.parametrize("case", list(FLAT_PICKLES))
def test_the_scan_of_a_flat_pickle_keeps_a_reference_per_value(case, monkeypatch):
    """1M one-byte values: the scan shares None, True, False, small ints and memoized values, so it
    keeps what torch's own reader keeps (a reference each), not a record per opcode (~100 bytes)."""
    make, ratio = FLAT_PICKLES[case]
    pkl = b"\x80\x02" + make(1_000_000) + b"."
    peak = _scanned_with_peak(monkeypatch, _zip_with(pkl))
    assert peak < ratio * len(pkl) + 2**20, f"{peak / len(pkl):.1f} bytes per byte"


@pytest.mark.parametrize("case", list(FLAT_CONTAINERS))
def test_the_scan_keeps_at_most_its_memory_ratio_per_byte(case, monkeypatch):
    from fp16kit.legacy.checkpoints.unpickler import SCAN_MEMORY_RATIO

    pkl = b"\x80\x02" + FLAT_CONTAINERS[case](200_000) + b"."
    peak = _scanned_with_peak(monkeypatch, _zip_with(pkl))
    assert peak < SCAN_MEMORY_RATIO * len(pkl) + 2**20, f"{peak / len(pkl):.1f} bytes per byte"


def test_marks_nested_deeper_than_any_container_are_refused(monkeypatch):
    """Each MARK keeps a stack of its own (a list: 56 bytes) until it closes into a container; nested
    deeper than MAX_DEPTH, whatever closes them would be refused as too deep, so they are at once."""
    pkl = b"\x80\x02" + b"(" * 1_000_000 + b"N."
    with pytest.raises(CheckpointRefused, match="nest deeper than"):
        load_checkpoint(io.BytesIO(_zip_with(pkl)))
    legit = b"\x80\x02" + b"(" * 150 + b"N" + b"t" * 150 + b"."  # 150 nested tuples: torch.save's shape
    assert _scanned_with_peak(monkeypatch, _zip_with(legit)) < 2**21


# ------------------------------------------------------------------------------------------------
# Every refusal names the file (issue 17 §2): "refused to load os.system", "refused this file" did
# not say which, a problem when a script loads many. Every hostile form this module (and its
# friends: test_checkpoint_refusals, test_checkpoint_load) builds, as a file: load_checkpoint's
# one CheckpointRefused names its path (and an open file's name); convert-checkpoint prints one
# line naming it and exits 1, writing nothing.


def _duplicate_pickle() -> bytes:
    buf = io.BytesIO()
    torch.save({"step": 1}, buf)
    good = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for info in good.infolist():
            if info.filename.endswith("data.pkl"):
                z.writestr(zipfile.ZipInfo(info.filename), good.read(info.filename).replace(b"step", b"stop"))
            z.writestr(zipfile.ZipInfo(info.filename), good.read(info.filename))
    return out.getvalue()


def _saved(obj, legacy: bool = False, **kwargs) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf, _use_new_zipfile_serialization=not legacy, **kwargs)
    return buf.getvalue()


def _cycle() -> bytes:
    loop: list = []
    loop.append(loop)
    return _saved({"optimizer": loop})


class _System:
    def __reduce__(self):
        return (os.system, ("true",))


def _refused_forms() -> dict[str, bytes]:
    forms: dict[str, bytes] = {}
    for legacy in (False, True):
        fmt = "legacy" if legacy else "zip"
        forms[f"{fmt}: a tensor claiming 4 TB"] = (_legacy_file if legacy else _zip_file)(2**40)
        good = _saved({"w": torch.zeros(4)}, legacy)
        for part, value in [("offset", 1000), ("stride", -1), ("size", -1)]:
            forms[f"{fmt}: a view's {part} of {value}"] = (
                _view(good, part, value) if legacy else _rezip(good, lambda r, p=part, v=value: _view(r, p, v))
            )
        pid = _pid(legacy)
        forms[f"{fmt}: set_ on an empty storage"] = _with_object(legacy, _growing(_EMPTY_STORAGE))
        forms[f"{fmt}: set_ past the file's storage"] = _with_object(legacy, _growing(pid))
        forms[f"{fmt}: os.system"] = _saved({"x": _System()}, legacy)
        forms[f"{fmt}: a whole pickled module"] = _saved(torch.nn.Sequential(torch.nn.Linear(2, 2)), legacy)
        forms[f"{fmt}: a cut at half"] = good[: len(good) // 2]
        forms[f"{fmt}: a cut 30 bytes short"] = good[:-30]
    for name, (pkl, _said) in PICKLE_BOMBS.items():
        forms[f"pickle bomb: {name}"] = _zip_with(pkl)
    for name, pkl in HASH_BOMBS.items():
        forms[f"hash bomb: {name}"] = _zip_with(pkl)
    for name, (make, _said) in {**LEAKS, **ZIP_NAME_TRICKS}.items():
        forms[name] = make()
    forms["a zip bomb"] = _bomb()
    forms["a stored zip bomb"] = _bomb(size=2**16, stored=True)
    forms["data.pkl twice"] = _duplicate_pickle()
    forms["a legacy storage never filled"] = _legacy_unfilled()
    forms["a legacy storage not in the stored keys"] = _legacy_unfilled(numel=4) + bytes(24)
    forms["a bare apex class"] = _zip_with(b"\x80\x02capex.amp.scaler\nLossScaler\n.")
    forms["a scaler record as a dict key"] = _zip_with(b"\x80\x02}capex.amp.scaler\nLossScaler\n)\x81K\x01s.")
    forms["a cycle"] = _cycle()
    forms["marks nested 1,000 deep"] = _zip_with(b"\x80\x02" + b"(" * 1000 + b"N.")
    forms["a newer pickle protocol"] = _saved({"w": torch.ones(2)}, pickle_protocol=4)
    forms["an empty file"] = b""
    forms["a text file"] = b"step,loss\n1,0.5\n"
    forms["a plain pickle"] = pickle.dumps({"w": [1.0]}, protocol=4)
    forms["a zip without data.pkl"] = _zip_records([("notes.txt", b"hello")])
    forms["a 64 KB zip comment"] = _zip_records(_legit_records())[:-2] + b"\xff\xff" + b"x" * 65535
    forms["torch's legacy tar format"] = _legacy_tar()
    return forms


REFUSED_FORMS = _refused_forms()


def _one_line_naming(capsys, path: pathlib.Path, out: pathlib.Path) -> str:
    from fp16kit.cli import main

    code = main(["convert-checkpoint", str(path), str(out)])
    stdout, stderr = capsys.readouterr()
    assert code == 1 and stdout == "" and stderr.count("\n") == 1, (code, stdout, stderr)
    assert stderr.startswith("fp16kit convert-checkpoint: error: ") and str(path) in stderr, stderr
    assert not out.exists()
    return stderr


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch's and zipfile's, on some of these files
@pytest.mark.parametrize("case", list(REFUSED_FORMS))
def test_every_refusal_names_the_file_and_the_cli_prints_one_line(case, tmp_path, capsys):
    path = tmp_path / "hostile ckpt.pt"
    path.write_bytes(REFUSED_FORMS[case])
    with pytest.raises(CheckpointRefused) as info:
        load_checkpoint(path)
    assert type(info.value) is CheckpointRefused and repr(str(path)) in str(info.value), str(info.value)
    with open(path, "rb") as opened, pytest.raises(CheckpointRefused) as info:
        load_checkpoint(opened)
    assert repr(str(path)) in str(info.value), str(info.value)
    _one_line_naming(capsys, path, tmp_path / "out.pt")


def test_refusals_after_torch_read_the_file_name_it(tmp_path, capsys, monkeypatch, fake_numpy, save):
    """Refused once torch has loaded it: a record whose data its class cannot hold (a numpy array
    of an impossible shape), more containers than MAX_CONTAINERS -- 'refused this file' said not which."""
    import fp16kit.legacy.checkpoints.load as checkpoint

    path = save({"a": fake_numpy.ndarray((0, 2**62, 2**62), "<f8", b"")}, tmp_path / "numpy ckpt.pt")
    with pytest.raises(CheckpointRefused, match="bad array shape") as info:
        load_checkpoint(path)
    assert repr(str(path)) in str(info.value)
    _one_line_naming(capsys, path, tmp_path / "out.pt")

    path = tmp_path / "many ckpt.pt"
    torch.save({"a": [[1], [2], [3]]}, path)
    monkeypatch.setattr(checkpoint, "MAX_CONTAINERS", 3)
    with pytest.raises(CheckpointRefused, match="MAX_CONTAINERS") as info:
        load_checkpoint(path)
    assert repr(str(path)) in str(info.value)
    _one_line_naming(capsys, path, tmp_path / "out.pt")


def _same_size_hostile(length: int) -> bytes:
    """A pickle of exactly ``length`` bytes: {padding: bytearray(2**28)} (256 MiB from a few bytes)."""
    alloc = b"c__builtin__\nbytearray\nJ\x00\x00\x00\x10\x85R"
    pad = length - len(b"\x80\x02}X\x00\x00\x00\x00" + alloc + b"s.")
    assert pad >= 0
    return b"\x80\x02}X" + struct.pack("<I", pad) + b"p" * pad + alloc + b"s."


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy-format"])
def test_a_file_rewritten_in_place_after_its_scan_is_read_as_it_was_scanned(tmp_path, monkeypatch, legacy):
    """The same size, the same inode, another pickle: rewritten between the scan and torch.load
    (another process saving into the file), torch read a pickle the scan never saw (256 MiB
    allocated from 1 KB). torch is handed the bytes the scan read, from the same open file."""
    import pickletools

    import fp16kit.legacy.checkpoints.load as checkpoint

    good = _saved({"w": torch.ones(2)}, legacy)
    if legacy:  # the object's pickle: the fourth in the file
        stream = io.BytesIO(good)
        for _ in range(3):
            for _op in pickletools.genops(stream):
                pass
        at = stream.tell()
        for _op in pickletools.genops(stream):
            pass
        old = good[at : stream.tell()]
    else:
        old = zipfile.ZipFile(io.BytesIO(good)).read("archive/data.pkl")
        at = good.index(old)
    hostile = _same_size_hostile(len(old))
    rewritten = good[:at] + hostile + good[at + len(old) :]
    assert len(rewritten) == len(good)
    if not legacy:  # control: what torch makes of the rewrite (the legacy format's then fails on its keys)
        loaded = torch.load(io.BytesIO(rewritten), weights_only=True)
        assert [len(v) for v in loaded.values()] == [2**28]
        del loaded
    path = tmp_path / "rewritten.pt"
    path.write_bytes(good)
    real = checkpoint.scan

    def scan_then_rewrite(f, opened):
        scanned = real(f, opened)
        fd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(fd, hostile, at)  # in place: same size, same inode
        finally:
            os.close(fd)
        return scanned

    monkeypatch.setattr(checkpoint, "scan", scan_then_rewrite)
    tracemalloc.start()
    try:
        out = load_checkpoint(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert path.read_bytes() == rewritten  # the rewrite happened
    assert list(out) == ["w"] and out["w"].tolist() == [1.0, 1.0]  # the file as scanned
    assert peak < 2**24, peak
