"""What ``fp16kit.legacy.load_checkpoint`` refuses, and how it reads what it accepts: crafted
pickles (a REDUCE calling ``os.system``, other apex classes, raw legacy-format and zip files)
are refused by name and run nothing; cyclic structures, files that are not checkpoints written by
``torch.save`` and files with absurdly many containers are refused with a
``pickle.UnpicklingError`` that says what to do; shared references (pickle's memo) are rebuilt
once and stay shared, however deep. Resuming training from checkpoints is tested in
test_checkpoint_resume.py; the ``fake_apex`` and ``save`` fixtures are in conftest.py.
"""

from __future__ import annotations

import importlib
import io
import os
import pathlib
import pickle
import random
import re
import struct
import subprocess
import zipfile

import pytest
import torch
from torch import nn

from fp16kit.legacy import load_checkpoint
from fp16kit.legacy.checkpoints.errors import CheckpointRefused

# ====================================================================== 2. crafted pickles


class _Reduce:
    """Pickles as ``func(*args)``: what a malicious checkpoint does."""

    def __init__(self, func, *args) -> None:
        self.func, self.args = func, args

    def __reduce__(self):
        return (self.func, self.args)


def _wrap_like_checkpoint(payload) -> dict:
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3)).half()
    return {"model": model.state_dict(), "optimizer": {"loss_scaler": payload, "overflow": False}}


def _payloads(marker: pathlib.Path) -> dict:
    m = str(marker)
    return {
        "os.system": (_Reduce(os.system, f"touch {m}"), r"(os|posix|nt)\.system\b"),
        "builtins.eval": (_Reduce(eval, f"open({m!r}, 'w').close()"), r"(builtins\.)?eval\b"),
        "builtins.exec": (_Reduce(exec, f"open({m!r}, 'w').close()"), r"(builtins\.)?exec\b"),
        "open": (_Reduce(open, m, "w"), r"(io|_io|builtins)\.open\b"),
        # protocol 2 records it under its Python 2 name (what fix_imports maps back)
        "subprocess.call": (_Reduce(subprocess.call, ["touch", m]), r"(subprocess|commands)\.call\b"),
    }


@pytest.mark.parametrize("name", ["os.system", "builtins.eval", "builtins.exec", "open", "subprocess.call"])
def test_crafted_reduce_payload_is_refused_and_runs_nothing(tmp_path, name, save):
    marker = tmp_path / "pwned"
    payload, pattern = _payloads(marker)[name]
    path = save(_wrap_like_checkpoint(payload), tmp_path / "evil.pt")
    assert not marker.exists()
    with pytest.raises(pickle.UnpicklingError) as info:
        load_checkpoint(path)
    # the refused global is named in fp16kit's own sentence (torch prints builtins unqualified)
    assert re.search("load_checkpoint refused to load " + pattern, str(info.value)), str(info.value)
    assert not marker.exists()


def test_the_file_creating_payload_is_live(tmp_path, save):
    """Control for the test above: unrestricted unpickling does create the marker."""
    marker = tmp_path / "pwned"
    path = save(_wrap_like_checkpoint(_Reduce(open, str(marker), "w")), tmp_path / "evil.pt")
    obj = torch.load(path, weights_only=False)
    obj["optimizer"]["loss_scaler"].close()
    assert marker.exists()


def _evil_setstate(self, state):
    pathlib.Path(state["marker"]).write_text("pwned")


@pytest.mark.parametrize("module", ["apex.amp.scaler", "apex.fp16_utils.loss_scaler"])
def test_other_apex_classes_are_refused_even_when_importable(tmp_path, fake_apex, module, save):
    """Only the three scaler paths are mapped: ``apex.amp.scaler.Evil`` is refused by name,
    and its ``__setstate__`` (which would write a file) never runs -- even with apex present."""
    marker = tmp_path / "pwned"
    Evil = fake_apex.add_class(module, "Evil", {"__setstate__": _evil_setstate})
    evil = Evil.__new__(Evil)
    evil.__dict__["marker"] = str(marker)
    path = save(_wrap_like_checkpoint(evil), tmp_path / "evil.pt")

    torch.load(path, weights_only=False)  # control: the payload is live
    assert marker.exists()
    marker.unlink()

    with pytest.raises(pickle.UnpicklingError, match=_named(module, "Evil")):
        load_checkpoint(path)
    assert not marker.exists()


def test_allowed_apex_names_never_run_the_real_classes_code(tmp_path, fake_apex, save):
    """If apex *is* importable, ``apex.amp.scaler.LossScaler`` still becomes plain data:
    the importable class's ``__setstate__`` is not called."""
    marker = tmp_path / "pwned"
    fake_apex.AmpLossScaler.__setstate__ = lambda self, state: marker.write_text("pwned")
    scaler = fake_apex.era2(256.0)
    path = save({"loss_scaler": scaler}, tmp_path / "x.pt")
    out = load_checkpoint(path)
    assert not marker.exists()
    assert type(out["loss_scaler"]) is dict and out["loss_scaler"]["_loss_scale"] == 256.0


def _named(module: str, name: str) -> str:
    """The refused global as the message must name it (torch drops the ``builtins.`` prefix)."""
    qualified = re.escape(f"{module}.{name}")
    if module == "builtins":
        qualified = rf"(builtins\.)?{re.escape(name)}"
    return rf"refused to load {qualified}\b"


def _raw_call(module: str, name: str, arg: str) -> bytes:
    """Protocol-2 pickle bytes for ``module.name(arg)``: PROTO GLOBAL BINUNICODE TUPLE1 REDUCE STOP."""
    a = arg.encode()
    return (
        b"\x80\x02c"
        + module.encode()
        + b"\n"
        + name.encode()
        + b"\n"
        + b"X"
        + struct.pack("<I", len(a))
        + a
        + b"\x85R."
    )


def _with_data_pkl(path, data_pkl: bytes) -> pathlib.Path:
    """A zip checkpoint written by ``torch.save`` whose pickle (``data.pkl``) is ``data_pkl``."""
    good = io.BytesIO()
    torch.save({"x": torch.ones(2)}, good)
    with zipfile.ZipFile(io.BytesIO(good.getvalue())) as zin, zipfile.ZipFile(path, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info.filename)
            if info.filename.endswith("/data.pkl"):
                data = data_pkl
            zout.writestr(info, data)
    return pathlib.Path(path)


RAW = [("os", "system"), ("posix", "system"), ("builtins", "eval"), ("builtins", "exec"), ("builtins", "getattr")]


@pytest.mark.parametrize("module,name", RAW)
def test_raw_legacy_format_pickle_is_refused(tmp_path, module, name):
    marker = tmp_path / "pwned"
    arg = f"touch {marker}" if name == "system" else f"open({str(marker)!r}, 'w').close()"
    path = tmp_path / "raw.pt"
    path.write_bytes(_raw_call(module, name, arg))
    with pytest.raises(pickle.UnpicklingError, match=_named(module, name)):
        load_checkpoint(path)
    assert not marker.exists()


@pytest.mark.parametrize("module,name", [("os", "system"), ("builtins", "eval")])
def test_zip_checkpoint_with_replaced_data_pkl_is_refused(tmp_path, module, name):
    marker = tmp_path / "pwned"
    arg = f"touch {marker}" if name == "system" else f"open({str(marker)!r}, 'w').close()"
    path = _with_data_pkl(tmp_path / "evil.pt", _raw_call(module, name, arg))
    with pytest.raises(pickle.UnpicklingError, match=_named(module, name)):
        load_checkpoint(path)
    assert not marker.exists()


def test_apex_scaler_with_non_dict_state_is_refused(tmp_path, fake_apex, save):
    cls = fake_apex.AmpLossScaler
    cls.__getstate__ = lambda self: ["not", "a", "dict"]
    cls.__setstate__ = lambda self, state: None
    path = save({"s": cls()}, tmp_path / "x.pt")
    fake_apex.remove()
    with pytest.raises(pickle.UnpicklingError):
        load_checkpoint(path)


def test_crafted_record_state_cannot_replace_the_class_path(tmp_path, fake_apex, save):
    scaler = fake_apex.era2(512.0)
    scaler.__dict__["_path"] = "evil"
    scaler.__dict__["__setstate__"] = "x"
    path = save({"s": scaler}, tmp_path / "c.pt")
    out = load_checkpoint(path)["s"]
    assert out["__apex_class__"] == "apex.amp.scaler.LossScaler"
    assert out["_path"] == "evil"  # kept as plain data, not as the record's class path


def test_cyclic_pickles_are_refused(tmp_path, save):
    cyc: list = []
    cyc.append(cyc)
    path = save({"c": cyc}, tmp_path / "cyc.pt")
    with pytest.raises(pickle.UnpicklingError, match="cyclic"):
        load_checkpoint(path)


# ============================================================ 3. shared and nested structures

DAG_DEPTH = 60  # 2**60 paths: walking each path, as load_checkpoint once did, never ends

DAG_LEVELS = {
    "list": lambda x: [x, x],
    "tuple": lambda x: (x, x),
    "dict": lambda x: {"left": x, "right": x},
}


def _dag(leaf, kind: str):
    """``leaf`` under DAG_DEPTH levels, each referring twice to the one below."""
    for _ in range(DAG_DEPTH):
        leaf = DAG_LEVELS[kind](leaf)
    return leaf


def _halves(level) -> tuple:
    return (level["left"], level["right"]) if isinstance(level, dict) else tuple(level)


@pytest.mark.parametrize("kind", list(DAG_LEVELS))
def test_shared_references_are_rebuilt_once_and_stay_shared(tmp_path, fake_apex, save, kind):
    """pickle memoizes: a DAG with 2**60 paths is a file of a few KB. Every level holds an apex
    scaler (so is rebuilt); each comes back once, shared exactly as in the file."""
    with_scaler = _dag([fake_apex.era1_static(8)], kind)
    plain = _dag([torch.arange(2)], kind)
    path = save({"with_scaler": with_scaler, "again": with_scaler, "plain": plain}, tmp_path / "dag.pt")
    assert path.stat().st_size < 8192
    fake_apex.remove()

    out = load_checkpoint(path)
    assert out["again"] is out["with_scaler"]
    bottom = {}
    for name in ("with_scaler", "plain"):
        level = out[name]
        for depth in range(DAG_DEPTH):
            assert type(level) is type(DAG_LEVELS[kind](0)), (name, depth)
            first, second = _halves(level)
            assert first is second, (name, depth)
            level = first
        bottom[name] = level
    scaler = {"__apex_class__": "apex.fp16_utils.loss_scaler.LossScaler", "cur_scale": 8}
    assert bottom["with_scaler"] == [scaler]
    assert len(bottom["plain"]) == 1 and torch.equal(bottom["plain"][0], torch.arange(2))


@pytest.mark.parametrize("depth", [150, 100_000])
def test_deep_nesting_is_no_recursion_error(tmp_path, depth):
    """A pickle 100,000 lists deep (torch's unpickler reads it without recursing, but no
    checkpoint nests like this, and a tuple that deep overflows the C stack when hashed): refused
    by the pre-scan with the loader's one exception, never a bare RecursionError; 150 levels load."""
    scaler = (
        b"capex.fp16_utils.loss_scaler\nLossScaler\n)\x81"  # GLOBAL, EMPTY_TUPLE, NEWOBJ
        b"}X\x09\x00\x00\x00cur_scaleK\x08sb"
    )  # EMPTY_DICT, "cur_scale", 8, SETITEM, BUILD
    data_pkl = b"\x80\x02" + b"]" * depth + scaler + b"a" * depth + b"."  # EMPTY_LISTs ... APPENDs
    path = _with_data_pkl(tmp_path / "deep.pt", data_pkl)
    if depth > 200:
        with pytest.raises(CheckpointRefused, match="nest deeper than .*MAX_DEPTH = 200 levels"):
            load_checkpoint(path)
        return
    out = load_checkpoint(path)
    for _ in range(depth):
        assert type(out) is list and len(out) == 1
        out = out[0]
    assert out == {"__apex_class__": "apex.fp16_utils.loss_scaler.LossScaler", "cur_scale": 8}


def test_more_containers_than_the_limit_are_refused(tmp_path, save, monkeypatch):
    checkpoint = importlib.import_module("fp16kit.legacy.checkpoints.load")
    shared = [1]
    obj = {"l": [shared, shared, (3,)]}  # 5 references to containers (a shared one counts twice)
    path = save(obj, tmp_path / "five.pt")
    assert checkpoint.MAX_CONTAINERS == 10_000_000
    monkeypatch.setattr(checkpoint, "MAX_CONTAINERS", 5)
    assert load_checkpoint(path) == obj
    monkeypatch.setattr(checkpoint, "MAX_CONTAINERS", 4)
    with pytest.raises(
        pickle.UnpicklingError,
        match=r"more than fp16kit\.legacy\.checkpoints\.load\.MAX_CONTAINERS"
        r" = 4 times.*raise that limit",
    ):
        load_checkpoint(path)


# ============================================================== 4. files that are not checkpoints


def _zip_of_other_files() -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        archive.writestr("weights.npy", b"\x93NUMPY")
    return out.getvalue()


NOT_CHECKPOINTS = {
    # name: (the file's bytes, what the message says the file is)
    "text": (b"epoch 3: loss 0.25\n", r"it starts with b'epoch 3: loss 0\.25\\n'"),
    "empty": (b"", "it is empty"),
    "random-bytes": (random.Random(0).randbytes(2048), "it starts with b"),
    "pickle-protocol-0": (pickle.dumps({"model": {}}, protocol=0), r"it starts with b'\(dp0"),
    "pickle-protocol-2": (pickle.dumps({"model": {}}, protocol=2), r"it is a plain pickle \(protocol 2\)"),
    "pickle-protocol-5": (pickle.dumps({"model": {}}, protocol=5), r"it is a plain pickle \(protocol 5\)"),
    "zip-of-other-files": (_zip_of_other_files(), r"it is a zip archive without a data\.pkl record"),
}


@pytest.mark.filterwarnings("ignore:Detected pickle protocol 5:UserWarning")  # torch's, on reading it
@pytest.mark.parametrize("how", ["path", "open file", "BytesIO"])
@pytest.mark.parametrize("kind", list(NOT_CHECKPOINTS))
def test_a_file_that_is_not_a_checkpoint_is_refused_as_such(tmp_path, kind, how):
    data, what = NOT_CHECKPOINTS[kind]
    path = tmp_path / f"{kind}.bin"
    path.write_bytes(data)
    with open(path, "rb") as opened:
        f = {"path": path, "open file": opened, "BytesIO": io.BytesIO(data)}[how]
        with pytest.raises(pickle.UnpicklingError) as info:
            load_checkpoint(f)
        if how != "path":
            assert f.tell() == 0  # left where it was
    message = str(info.value)
    named = "the BytesIO it was given" if how == "BytesIO" else re.escape(repr(str(path)))
    assert re.search(rf"{named} is not a checkpoint written by torch\.save: {what}", message), message
    assert "Expected a zip archive holding a data.pkl record (torch >= 1.6) or torch's legacy" in message
    assert "(torch said: " in message  # torch's own error, quoted


def test_a_truncated_legacy_checkpoint_is_refused_as_cut_short(tmp_path):
    saved = io.BytesIO()
    torch.save({"x": torch.ones(3)}, saved, _use_new_zipfile_serialization=False)
    path = tmp_path / "cut.pt"
    path.write_bytes(saved.getvalue())
    assert load_checkpoint(path)["x"].tolist() == [1.0, 1.0, 1.0]  # control: the whole file loads
    path.write_bytes(saved.getvalue()[:-30])
    with pytest.raises(pickle.UnpicklingError, match=r"cut\.pt' is truncated or corrupt: .* is cut short"):
        load_checkpoint(path)


def test_a_missing_file_raises_torchs_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "missing.pt")


@pytest.mark.parametrize("key", ["_min_loss_scale", "_max_loss_scale"])
@pytest.mark.parametrize("bad", ["1.0x", [1.0], float("nan"), True], ids=["text", "list", "nan", "bool"])
def test_a_saved_min_or_max_scale_that_is_no_number_is_refused_naming_the_field(key, bad):
    """A bare ValueError ("could not convert string to float") or TypeError said neither which field
    nor what to do."""
    from fp16kit.legacy.checkpoints.load import scaler_state
    from fp16kit.legacy.fp16_optimizer import AmpLossScaler

    saved = {
        "__apex_class__": "apex.amp.scaler.LossScaler",
        "dynamic": True,
        "_loss_scale": 2.0**16,
        "_scale_seq_len": 2000,
        "_unskipped": 0,
        "_min_loss_scale": None,
        "_max_loss_scale": 2.0**24,
        key: bad,
    }
    field = key.lstrip("_")
    with pytest.raises(
        ValueError, match=rf"its {field} is .*, not a number or None \(None: no (floor|cap)\)\. Re-save"
    ):
        scaler_state(saved, current=AmpLossScaler(1.0).state_dict())
