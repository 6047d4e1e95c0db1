"""What ``fp16kit.legacy.load_checkpoint`` refuses beyond test_checkpoint_load.py's cases:
hostile pickles nested inside the newly allowed objects (a Namespace, a Megatron scaler) and in
torch's legacy format, a bare ``GLOBAL builtins.eval``; whole pickled modules and optimizers
(refused by name, with how to re-save a state_dict); truncated and corrupt files in both formats
(said so, where torch says ``OSError: [Errno 22] Invalid argument`` or a miniz error). Each
hostile case checks that its side effect (creating a file) did not happen, and that the same
file does create it when unpickled without restrictions (the payload is live).
"""

from __future__ import annotations

import argparse
import io
import os
import pathlib
import pickle
import struct
import zipfile

import pytest
import torch
from torch import nn

from fp16kit.legacy import load_checkpoint

FORMATS = pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy-format"])
# torch.save's legacy format looks up a pickled module's source, which stand-in classes lack
NO_SOURCE = pytest.mark.filterwarnings("ignore:Couldn't retrieve source code:UserWarning")


class _Reduce:
    def __init__(self, func, *args) -> None:
        self.func, self.args = func, args

    def __reduce__(self):
        return (self.func, self.args)


def _save(obj, path, legacy: bool) -> pathlib.Path:
    torch.save(obj, path, _use_new_zipfile_serialization=not legacy)
    return pathlib.Path(path)


def _nest(payload, megatron):
    """``payload`` five levels down, inside objects load_checkpoint now allows."""
    args = argparse.Namespace(lr=0.1, hooks=[{"on_step": payload}])
    scaler = megatron(cur_scale=2.0**16)
    scaler.note = ({"a": [args]},)
    return {"model": {"w": torch.ones(2)}, "optimizer": {"loss_scaler": scaler}, "args": args}


@FORMATS
@pytest.mark.parametrize("call", ["os.system", "builtins.eval", "builtins.exec"])
def test_a_nested_reduce_payload_is_refused_and_runs_nothing(tmp_path, megatron, legacy, call):
    marker = tmp_path / "pwned"
    payload = {
        "os.system": _Reduce(os.system, f"touch {marker}"),
        "builtins.eval": _Reduce(eval, f"open({str(marker)!r}, 'w').close()"),
        "builtins.exec": _Reduce(exec, f"open({str(marker)!r}, 'w').close()"),
    }[call]
    path = _save(_nest(payload, megatron), tmp_path / "evil.pt", legacy)
    with pytest.raises(
        pickle.UnpicklingError,
        match=r"load_checkpoint refused to load (posix\.|os\.|builtins\.)?"
        rf"{call.split('.')[1]}\b.*nothing was run",
    ):
        load_checkpoint(path)
    assert not marker.exists()
    torch.load(path, weights_only=False)  # control: the payload is live
    assert marker.exists()


@FORMATS
def test_a_bare_global_of_eval_is_refused(tmp_path, legacy):
    """``GLOBAL builtins eval`` pushed as a value (no call): refused by name all the same."""
    path = _save({"f": eval, "x": torch.ones(1)}, tmp_path / "g.pt", legacy)
    with pytest.raises(pickle.UnpicklingError, match=r"refused to load (builtins\.)?eval\b"):
        load_checkpoint(path)


def test_a_namespace_built_by_reduce_is_refused(tmp_path):
    """Namespace is read as NEWOBJ + BUILD (how protocol 2 pickles it); ``Namespace(**kw)``
    through REDUCE would call the stand-in's constructor with crafted arguments: refused."""
    path = _save({"args": _Reduce(argparse.Namespace, "positional")}, tmp_path / "n.pt", False)
    with pytest.raises(pickle.UnpicklingError, match="argparse.Namespace in this file is not what that class pickles"):
        load_checkpoint(path)


# ---------------------------------------------------------------------------- whole objects


class _Wrapper(nn.Module):
    """Stands for apex's DistributedDataParallel / Megatron's modules (registered under their paths)."""

    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Linear(2, 2)


WHOLE = [
    ("apex.parallel.distributed.DistributedDataParallel", "module"),
    ("apex.normalization.fused_layer_norm.FusedLayerNorm", "module"),
    ("megatron.model.gpt2_model.GPT2Model", "module"),
    ("megatron.fp16.fp16.FP16_Module", "module"),
]


@NO_SOURCE
@FORMATS
@pytest.mark.parametrize("path_,kind", WHOLE, ids=[w[0].split(".")[-1] for w in WHOLE])
def test_a_whole_pickled_apex_or_megatron_module_is_refused_with_how_to_resave(
    tmp_path, stand_ins, legacy, path_, kind
):
    cls = stand_ins.add(path_, bases=(_Wrapper,))
    path = _save(cls(), tmp_path / "model.pt", legacy)
    with pytest.raises(pickle.UnpicklingError) as info:
        load_checkpoint(path)
    message = str(info.value)
    assert f"refused to load {path_} in {str(path)!r}: the file holds a whole pickled {kind} object" in message
    assert "torch.save(obj.state_dict(), NEW_PATH)" in message and "obj.module.state_dict()" in message
    assert "apex or Megatron-LM installed" in message


@FORMATS
def test_whole_torch_modules_and_optimizers_are_refused_as_such(tmp_path, legacy):
    model = nn.Sequential(nn.Linear(2, 2))
    path = _save(model, tmp_path / "m.pt", legacy)
    with pytest.raises(
        pickle.UnpicklingError,
        match=r"refused to load torch\.nn\.modules\.container\.Sequential in '.*m\.pt': "
        r"the file holds a whole pickled module object",
    ):
        load_checkpoint(path)
    path = _save(torch.optim.SGD(model.parameters(), lr=0.1), tmp_path / "o.pt", legacy)
    with pytest.raises(
        pickle.UnpicklingError,
        match=r"refused to load torch\.optim\.sgd\.SGD in '.*o\.pt': the file holds a "
        r"whole pickled optimizer object",
    ):
        load_checkpoint(path)


@NO_SOURCE
@FORMATS
def test_a_pickled_module_of_a_class_not_imported_is_told_by_its_state(tmp_path, stand_ins, legacy):
    """A user's own model class (``model.GPT``), not importable here: its pickle holds
    ``_modules``/``_parameters``, which is how load_checkpoint tells a module (nothing imported)."""
    cls = stand_ins.add("mymodels.gpt.GPT", bases=(_Wrapper,))
    path = _save(cls(), tmp_path / "m.pt", legacy)
    stand_ins.remove()
    with pytest.raises(
        pickle.UnpicklingError,
        match=r"refused to load mymodels\.gpt\.GPT in '.*m\.pt': the file holds a whole "
        r"pickled module object",
    ):
        load_checkpoint(path)


def test_an_unknown_class_that_is_no_module_gets_the_plain_refusal(tmp_path, stand_ins):
    cls = stand_ins.add("mylib.Thing")
    path = _save({"x": cls()}, tmp_path / "t.pt", False)
    with pytest.raises(pickle.UnpicklingError) as info:
        load_checkpoint(path)
    assert f"refused to load mylib.Thing in {str(path)!r}: only tensors, plain containers" in str(info.value)
    assert "whole pickled" not in str(info.value)


# ---------------------------------------------------------------------- truncated and corrupt


def _checkpoint_bytes(legacy: bool) -> bytes:
    out = io.BytesIO()
    torch.save(
        {"w": torch.arange(2000, dtype=torch.float32), "step": 3}, out, _use_new_zipfile_serialization=not legacy
    )
    return out.getvalue()


def _cuts(data: bytes, legacy: bool) -> dict[str, int]:
    cuts = {
        "first bytes": 10,
        "early": 60,
        "middle": len(data) // 2,
        "last 30 bytes": len(data) - 30,
        "last byte": len(data) - 1,
    }
    if legacy:
        cuts["inside the magic number"] = 5
    return cuts


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy-format"])
def test_a_truncated_file_is_refused_as_truncated(tmp_path, legacy):
    data = _checkpoint_bytes(legacy)
    path = tmp_path / "cut.pt"
    path.write_bytes(data)
    assert load_checkpoint(path)["step"] == 3  # control: the whole file loads
    torch_errors = set()
    for where, n in _cuts(data, legacy).items():
        path.write_bytes(data[:n])
        try:
            torch.load(path, weights_only=True)
        except Exception as e:  # what torch says: no word of truncation in most of these
            torch_errors.add(type(e).__name__)
        with pytest.raises(pickle.UnpicklingError, match=r"cut\.pt' is truncated or corrupt: .*Save or copy it again"):
            load_checkpoint(path)
        with open(path, "rb") as opened:  # a file object too, left where it was
            opened.seek(0)
            with pytest.raises(pickle.UnpicklingError, match="is truncated or corrupt"):
                load_checkpoint(opened)
            assert opened.tell() == 0, where
    if not legacy:
        assert "OSError" in torch_errors and "RuntimeError" in torch_errors  # Errno 22; miniz


def _flip(data: bytes, record: str, at: int) -> bytes:
    """``data`` with one byte of zip record ``record`` (e.g. "data.pkl") inverted."""
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith(record))
    name_len, extra_len = struct.unpack_from("<HH", data, info.header_offset + 26)  # the local header's own
    local_header = 30 + name_len + extra_len
    out = bytearray(data)
    out[info.header_offset + local_header + at] ^= 0x01
    return bytes(out)


def test_a_zip_checkpoint_with_a_damaged_pickle_record_is_refused_as_corrupt(tmp_path):
    """torch reads zip records without checking their CRC: a flipped bit in the pickle (here in
    the key ``step``) would load as another key. load_checkpoint checks data.pkl's CRC."""
    data = _checkpoint_bytes(False)
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        pkl = archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
    path = tmp_path / "bad.pt"
    path.write_bytes(_flip(data, "data.pkl", pkl.index(b"step")))
    assert "rtep" in torch.load(path, weights_only=True)  # control: torch loads the damage
    with pytest.raises(
        pickle.UnpicklingError,
        match=r"bad\.pt' is truncated or corrupt: record data\.pkl of its "
        r"zip archive fails its check \(Bad CRC-32",
    ):
        load_checkpoint(path)


def test_a_damaged_tensor_record_loads_as_torch_loads_it(tmp_path):
    """Checking every record would read the file twice: load_checkpoint does as torch does
    (fp16kit convert-checkpoint checks them all: tests/cli/test_convert_checkpoint.py)."""
    data = _checkpoint_bytes(False)
    path = tmp_path / "bad.pt"
    path.write_bytes(_flip(data, "/data/0", 100))
    assert not torch.equal(load_checkpoint(path)["w"], torch.arange(2000, dtype=torch.float32))


def test_a_legacy_file_with_a_damaged_pickle_is_refused_as_corrupt(tmp_path):
    data = bytearray(_checkpoint_bytes(True))
    main = data.index(b"step")  # inside the main pickle: replace the string's opcode with garbage
    data[main - 5] = 0xFE
    path = tmp_path / "bad.pt"
    path.write_bytes(bytes(data))
    with pytest.raises(
        pickle.UnpicklingError,
        match=r"is truncated or corrupt: its pickle holds a byte that is no "
        r"pickle opcode",
    ):
        load_checkpoint(path)


def test_an_enum_under_a_module_path_is_not_taken_for_a_whole_module(tmp_path, stand_ins):
    """``megatron.model.enums.AttnMaskType`` in args is refused by name, without the re-save advice
    meant for ``torch.save(model)``: the pickle holds no module state."""
    import enum

    cls = stand_ins.add("megatron.model.enums.AttnMaskType", enum.Enum("AttnMaskType", "padding causal"))
    path = _save({"args": argparse.Namespace(attn_mask_type=cls.causal)}, tmp_path / "e.pt", False)
    with pytest.raises(pickle.UnpicklingError) as info:
        load_checkpoint(path)
    assert f"refused to load megatron.model.enums.AttnMaskType in {str(path)!r}: only tensors" in str(info.value)


@pytest.mark.filterwarnings("ignore:Detected pickle protocol:UserWarning")
@FORMATS
def test_a_file_saved_with_a_newer_pickle_protocol_is_told_so(tmp_path, legacy):
    """torch's weights-only reader reads protocol 2 (torch.save's default) only: such a file is
    intact, and the message says how it was saved, not that it is corrupt."""
    path = tmp_path / "p4.pt"
    torch.save({"w": torch.ones(2)}, path, pickle_protocol=4, _use_new_zipfile_serialization=not legacy)
    with pytest.raises(
        pickle.UnpicklingError, match=r"p4\.pt' was saved with torch\.save\(\.\.\., pickle_protocol=4\)"
    ):
        load_checkpoint(path)


@pytest.mark.parametrize(
    "saved,kind,subject,whole",
    [
        (
            lambda: torch.nn.Sequential(torch.nn.Linear(2, 2)),
            "whole",
            "torch.nn.modules.container.Sequential",
            "module",
        ),
        (lambda: {"args": argparse.ArgumentParser}, "global", "argparse.ArgumentParser", ""),
    ],
)
def test_a_refusal_says_its_kind_and_quotes_torch_without_its_advice_or_escape_codes(
    tmp_path, saved, kind, subject, whole
):
    """The command line words its own message from kind and subject; the library's quotes what
    torch found, not torch's terminal colour codes nor its add_safe_globals advice (which
    MIGRATION.md warns against)."""
    from fp16kit.legacy.checkpoints.errors import CheckpointRefused

    torch.save(saved(), tmp_path / "f.pt")
    with pytest.raises(CheckpointRefused) as info:
        load_checkpoint(tmp_path / "f.pt")
    assert (info.value.kind, info.value.subject, info.value.whole) == (kind, subject, whole)
    message = str(info.value)
    assert (
        f"(torch said: UnpicklingError: Unsupported global: GLOBAL {subject} was not an allowed global by default.)"
        in message
    )
    assert "\x1b[" not in message and "safe_globals" not in message
