"""``fp16kit convert-checkpoint IN OUT``: what it prints (one line per converted item), what it
writes (a file ``torch.load(weights_only=True)`` reads, every tensor on the CPU), its exit codes
(0 written; 1 IN refused or unreadable; 2 usage, OUT exists, OUT is IN), and that it writes
nothing -- and runs nothing -- for hostile, truncated or damaged input, and never touches IN.

Checkpoints are written here as apex- and Megatron-era code wrote them: stand-in classes under
those libraries' module paths (removed before converting), storages recorded as saved on
``cuda:0`` (no GPU needed). The converted values expected are worked out from docs/apex-fp16-optimizer.md and
docs/apex-others.md §6 in tests/legacy/checkpoints/test_convert.py; here the command's behaviour.
"""

from __future__ import annotations

import argparse
import io
import os
import pathlib
import subprocess
import sys
import types
from unittest import mock

import pytest
import torch

from fp16kit.cli import build_parser, main


def _stand_in(monkeypatch, path: str) -> type:
    module, name = path.rsplit(".", 1)
    parts = module.split(".")
    for i in range(1, len(parts) + 1):
        mod_name = ".".join(parts[:i])
        if not isinstance(sys.modules.get(mod_name), types.ModuleType) or not getattr(
            sys.modules[mod_name], "_stand_in", False
        ):
            mod = types.ModuleType(mod_name)
            mod._stand_in = True
            monkeypatch.setitem(sys.modules, mod_name, mod)
    cls = type(name, (), {"__module__": module, "__qualname__": name})
    setattr(sys.modules[module], name, cls)
    return cls


@pytest.fixture
def apex_era_file(tmp_path, monkeypatch):
    """A Megatron-v1-style checkpoint with an apex era-2 scaler beside it, saved on cuda:0."""
    amp_scaler = _stand_in(monkeypatch, "apex.amp.scaler.LossScaler")()
    amp_scaler.__dict__.update(
        dynamic=True,
        _loss_scale=4096.0,
        _max_loss_scale=2.0**24,
        _min_loss_scale=None,
        _scale_seq_len=2000,
        _unskipped=12,
        _has_overflow=False,
        _overflow_buf=torch.IntTensor([0]),
    )
    meg = _stand_in(monkeypatch, "megatron.fp16.loss_scaler.DynamicLossScaler")()
    meg.__dict__.update(
        cur_scale=2.0**31,
        cur_iter=5,
        last_overflow_iter=1,
        scale_factor=2.0,
        scale_window=1000,
        min_scale=1,
        delayed_shift=2,
        cur_hysteresis=2,
        consecutive_hysteresis=False,
    )
    master = torch.ones(2, 3)
    master.model_parallel = True
    ckpt = {
        "args": argparse.Namespace(params_dtype=torch.float16, lr=1e-4),
        "iteration": 5,
        "model": {"w": torch.ones(2, 3).half()},
        "optimizer": {
            "loss_scaler": meg,
            "dynamic_loss_scale": True,
            "overflow": False,
            "first_closure_call_this_step": True,
            "fp32_from_fp16": [[master]],
            "optimizer_state_dict": {
                "state": {0: {"exp_avg": torch.zeros(2, 3), "exp_avg_sq": torch.zeros(2, 3)}},
                "param_groups": [{"lr": 1e-4, "step": 5, "params": [0]}],
            },
        },
        "apex_fp16_optimizer": {"loss_scaler": amp_scaler},
    }
    path = tmp_path / "old.pt"
    with mock.patch("torch.serialization.location_tag", lambda storage: "cuda:0"):
        torch.save(ckpt, path)
    for name in [n for n, m in sys.modules.items() if getattr(m, "_stand_in", False)]:
        monkeypatch.delitem(sys.modules, name)  # as on a machine without apex or Megatron
    return path


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = main(["convert-checkpoint", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def test_help_lists_the_command_with_a_one_line_summary():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    summary = next(a.help for a in sub._choices_actions if a.dest == "convert-checkpoint")
    assert "\n" not in summary and len(summary) < 80 and "weights_only=True" in summary
    assert "convert-checkpoint" in parser.format_help()
    args = parser.parse_args(["convert-checkpoint", "a", "b"])
    assert (args.map_location, args.torch_optimizer_state, args.force) == ("cpu", False, False)


def test_it_converts_prints_one_line_per_item_and_never_touches_in(tmp_path, capsys, apex_era_file):
    before = apex_era_file.read_bytes()
    out_path = tmp_path / "new.pt"
    code, out, err = _run(capsys, apex_era_file, out_path)
    assert (code, err) == (0, "")
    assert out.splitlines() == [
        f"{apex_era_file} -> {out_path}",
        "  converted  args: argparse.Namespace (2 attributes) -> dict (argparse.Namespace(**that_dict) gives code "
        "reading args.foo its Namespace back)",
        "  kept       optimizer.loss_scaler: megatron.fp16.loss_scaler.DynamicLossScaler -> a dict of its attributes "
        "(fp16kit.legacy.megatron's FP16_Optimizer reads it)",
        "  kept       optimizer.optimizer_state_dict.param_groups[0].step: per-group step 5 (apex Fused*) -> kept "
        "(--torch-optimizer-state / torch_optimizer_state=True moves it into each param's state for "
        "torch.optim.Adam/AdamW)",
        "  converted  apex_fp16_optimizer.loss_scaler: apex.amp.scaler.LossScaler -> fp16kit's scaler state "
        "(dynamic, loss_scale 4096; FP16_Optimizer.load_state_dict reads it)",
        "  converted  (tensors): 5 storages saved on cuda:0 -> loaded to cpu",
        f"wrote {out_path}: torch.load({str(out_path)!r}, weights_only=True) reads it",
    ]
    assert apex_era_file.read_bytes() == before
    new = torch.load(out_path, weights_only=True)
    assert new["args"] == {"params_dtype": torch.float16, "lr": 1e-4}
    assert new["apex_fp16_optimizer"]["loss_scaler"]["unskipped"] == 12
    assert new["optimizer"]["fp32_from_fp16"][0][0].model_parallel is True
    assert all(t.device.type == "cpu" for t in (new["model"]["w"], new["optimizer"]["fp32_from_fp16"][0][0]))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.pt", "old.pt"]  # no temporary file left


def test_torch_optimizer_state_option(tmp_path, capsys, apex_era_file):
    code, out, _ = _run(capsys, apex_era_file, tmp_path / "new.pt", "--torch-optimizer-state")
    assert code == 0
    assert (
        "  converted  optimizer.optimizer_state_dict.param_groups[0].step: per-group step 5 (apex Fused*) -> "
        "state[p]['step'] = tensor(5.0) for the group's 1 params with state"
    ) in out.splitlines()
    sd = torch.load(tmp_path / "new.pt", weights_only=True)["optimizer"]["optimizer_state_dict"]
    assert sd["state"][0]["step"].dtype == torch.float32 and sd["state"][0]["step"].item() == 5.0
    assert "step" not in sd["param_groups"][0]


def test_a_plain_file_is_rewritten_and_says_so(tmp_path, capsys):
    torch.save({"w": torch.ones(2)}, tmp_path / "plain.pt")
    code, out, _ = _run(capsys, tmp_path / "plain.pt", tmp_path / "new.pt")
    assert code == 0 and "  nothing to convert: the file held plain data only; re-saved as it was" in out.splitlines()
    assert torch.equal(torch.load(tmp_path / "new.pt", weights_only=True)["w"], torch.ones(2))


# ------------------------------------------------------------------------------ refusals


class _Evil:
    def __init__(self, marker: pathlib.Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy-format"])
def test_a_hostile_file_is_refused_runs_nothing_and_writes_nothing(tmp_path, capsys, legacy):
    marker = tmp_path / "pwned"
    torch.save(
        {"args": argparse.Namespace(hook=[{"x": _Evil(marker)}])},
        tmp_path / "evil.pt",
        _use_new_zipfile_serialization=not legacy,
    )
    code, out, err = _run(capsys, tmp_path / "evil.pt", tmp_path / "new.pt")
    assert code == 1 and out == ""
    assert err == (
        f"fp16kit convert-checkpoint: error: {tmp_path / 'evil.pt'} pickles {os.system.__module__}.system, "
        "which no checkpoint of state dicts holds; nothing in it ran. If you trust the file, re-save its "
        "state dicts where that code is installed, and convert that file.\n"
    )
    assert not marker.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["evil.pt"]


def test_truncated_damaged_and_missing_files_exit_1(tmp_path, capsys):
    buf = io.BytesIO()
    torch.save({"w": torch.arange(500.0)}, buf)
    data = buf.getvalue()
    (tmp_path / "cut.pt").write_bytes(data[:-30])
    code, _, err = _run(capsys, tmp_path / "cut.pt", tmp_path / "a.pt")
    assert code == 1 and "is truncated or corrupt" in err

    damaged = bytearray(data)
    damaged[len(data) // 2] ^= 0x01  # one flipped bit in the middle of the tensor data
    (tmp_path / "bad.pt").write_bytes(bytes(damaged))
    assert not torch.equal(
        torch.load(tmp_path / "bad.pt", weights_only=True)["w"], torch.arange(500.0)
    )  # torch: silent
    code, _, err = _run(capsys, tmp_path / "bad.pt", tmp_path / "b.pt")
    assert code == 1 and "fails its CRC check" in err

    code, _, err = _run(capsys, tmp_path / "missing.pt", tmp_path / "c.pt")
    assert code == 1 and err == f"fp16kit convert-checkpoint: error: {tmp_path / 'missing.pt'}: no such file.\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.pt", "cut.pt"]


def test_out_existing_or_being_in_needs_force(tmp_path, capsys, apex_era_file):
    original = apex_era_file.read_bytes()
    (tmp_path / "taken.pt").write_bytes(b"keep me")
    code, _, err = _run(capsys, apex_era_file, tmp_path / "taken.pt")
    assert code == 2 and f"{tmp_path / 'taken.pt'} exists; choose another name, or pass --force to replace it." in err
    assert (tmp_path / "taken.pt").read_bytes() == b"keep me"

    code, _, err = _run(capsys, apex_era_file, apex_era_file)
    assert code == 2 and "is IN; write the converted checkpoint elsewhere, or pass --force to replace IN" in err
    code, _, err = _run(capsys, apex_era_file, tmp_path / "." / apex_era_file.name)  # another spelling of IN
    assert code == 2 and "is IN; write the converted checkpoint elsewhere" in err
    assert apex_era_file.read_bytes() == original

    assert _run(capsys, apex_era_file, tmp_path / "taken.pt", "--force")[0] == 0
    assert _run(capsys, apex_era_file, apex_era_file, "--force")[0] == 0  # replaced once converted
    assert torch.load(apex_era_file, weights_only=True)["iteration"] == 5


def test_bad_arguments_and_a_missing_out_folder_exit_2(tmp_path, capsys, apex_era_file):
    with pytest.raises(SystemExit) as info:
        main(["convert-checkpoint", "only-one"])
    assert info.value.code == 2
    code, _, err = _run(capsys, apex_era_file, tmp_path / "no" / "such" / "new.pt")
    assert code == 2 and "is not a directory: create it first" in err


@pytest.mark.slow
def test_python_m_fp16kit_convert_checkpoint(tmp_path, apex_era_file):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [sys.executable, "-m", "fp16kit", "convert-checkpoint", str(apex_era_file), str(tmp_path / "new.pt")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1].startswith(f"wrote {tmp_path / 'new.pt'}")
    done = subprocess.run(
        [sys.executable, "-m", "fp16kit", "convert-checkpoint", str(apex_era_file), str(tmp_path / "new.pt")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 2 and "--force" in done.stderr


@pytest.mark.parametrize("force", [[], ["--force"]])
def test_out_being_a_folder_names_the_file_to_give_even_with_force(tmp_path, capsys, apex_era_file, force):
    """It used to say 'exists; ... pass --force', and with --force 'IN was not converted'
    (exit 1) from the rename onto the folder."""
    folder = tmp_path / "converted"
    folder.mkdir()
    code, out, err = _run(capsys, apex_era_file, folder, *force)
    assert code == 2 and out == ""
    assert f"{folder} is a directory; name the file to write in it, e.g. {folder / apex_era_file.name}" in err
    assert "--force" not in err and list(folder.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["converted", apex_era_file.name]


@pytest.mark.parametrize("when", ["writing", "checking"])
@pytest.mark.parametrize("existing", [False, True])
def test_ctrl_c_while_writing_leaves_no_partial_out(tmp_path, capsys, apex_era_file, monkeypatch, when, existing):
    out = tmp_path / "new.pt"
    if existing:
        out.write_bytes(b"the old OUT")
    real_save, real_load = torch.save, torch.load

    def interrupted_save(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)
        if when == "writing":
            with open(f, "r+b") as written:
                written.truncate(100)  # half written
            raise KeyboardInterrupt

    def interrupted_load(f, *args, **kwargs):
        if when == "checking" and str(f).endswith(".tmp"):
            raise KeyboardInterrupt
        return real_load(f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", interrupted_save)
    monkeypatch.setattr(torch, "load", interrupted_load)
    with pytest.raises(KeyboardInterrupt):
        main(["convert-checkpoint", str(apex_era_file), str(out), *(["--force"] if existing else [])])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([apex_era_file.name] + (["new.pt"] if existing else []))
    if existing:
        assert out.read_bytes() == b"the old OUT"


@pytest.mark.parametrize("failure", ["torch's zip writer", "ENOSPC"])
def test_a_full_disk_is_said_so_and_leaves_nothing(tmp_path, capsys, apex_era_file, monkeypatch, failure):
    """torch's zip writer reports a full disk as '[enforce fail at inline_container.cc:672] .
    unexpected pos 704 vs 598', which was printed as 'IN was not converted'."""
    import errno
    import shutil

    real_save = torch.save

    def full(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)  # a partial file is left, as a real failure leaves one
        if failure == "ENOSPC":
            raise OSError(errno.ENOSPC, "No space left on device")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(torch, "save", full)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 100, 100))
    code, out, err = _run(capsys, apex_era_file, tmp_path / "new.pt")
    assert code == 1 and out == ""
    assert f"could not write {tmp_path / 'new.pt'}, nothing was written: the disk holding {tmp_path} is full" in err
    assert "100 bytes free" in err and "was not converted" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == [apex_era_file.name]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has CUDA")
def test_map_location_cuda_without_cuda_names_this_commands_option(tmp_path, capsys, apex_era_file):
    code, out, err = _run(capsys, apex_era_file, tmp_path / "new.pt", "--map-location", "cuda:0")
    assert (code, out) == (2, "")
    assert err == (
        "fp16kit convert-checkpoint: error: --map-location cuda:0: this machine has no CUDA; leave the "
        "option out (the default is cpu)\n"
    )
    assert not (tmp_path / "new.pt").exists()


@pytest.mark.parametrize("same", [False, True], ids=["OUT exists", "OUT is IN"])
def test_force_keeps_the_replaced_files_permissions(tmp_path, capsys, apex_era_file, same):
    out = apex_era_file if same else tmp_path / "private.pt"
    if not same:
        out.write_bytes(b"old")
    out.chmod(0o600)
    assert _run(capsys, apex_era_file, out, "--force")[0] == 0
    assert out.stat().st_mode & 0o777 == 0o600
    assert torch.load(out, weights_only=True)["iteration"] == 5


# ----------------------------------------------------- one message per case, naming the fix

_PREFIX = "fp16kit convert-checkpoint: error: "


def _zip_without_pickle(path):
    import zipfile

    with zipfile.ZipFile(path, "w") as z:
        z.writestr("notes.txt", "hello")


def _cyclic(path):
    loop: list = []
    loop.append(loop)
    torch.save({"optimizer": loop}, path)


def _bad_scaler(path, monkeypatch):
    scaler = _stand_in(monkeypatch, "apex.amp.scaler.LossScaler")()
    scaler.__dict__.update(dynamic=True, _scale_seq_len=2000)  # no _loss_scale, no _unskipped
    torch.save({"optimizer": {"loss_scaler": scaler}}, path)


# case -> (write IN at path, exit code, the message after the prefix; {IN} and {OUT} filled in)
CASES = {
    "whole pickled model": (
        lambda p, mp: torch.save(torch.nn.Sequential(torch.nn.Linear(2, 2)), p),
        1,
        "{IN} holds a whole pickled model (torch.nn.modules.container.Sequential), not its state_dict(); nothing in it "
        "ran. If you trust the file, re-save its state_dict() once where its classes import, and convert that file.",
    ),
    "whole pickled optimizer": (
        lambda p, mp: torch.save(torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1), p),
        1,
        "{IN} holds a whole pickled optimizer (torch.optim.sgd.SGD), not its state_dict(); nothing in it ran. If you "
        "trust the file, re-save its state_dict() once where its classes import, and convert that file.",
    ),
    "unknown global": (
        lambda p, mp: torch.save({"args": argparse.ArgumentParser}, p),
        1,
        "{IN} pickles argparse.ArgumentParser, which no checkpoint of state dicts holds; nothing in it ran. If you "
        "trust the file, re-save its state dicts where that code is installed, and convert that file.",
    ),
    "empty file": (
        lambda p, mp: p.write_bytes(b""),
        1,
        "{IN} is not a checkpoint written by torch.save: it is empty. Check that it is the file you meant.",
    ),
    "text file": (
        lambda p, mp: p.write_text("step,loss\n1,0.5\n"),
        1,
        "{IN} is not a checkpoint written by torch.save: it starts with b'step,loss\\n1,0.5\\n'. Check that it is the "
        "file you meant.",
    ),
    "plain pickle": (
        lambda p, mp: p.write_bytes(__import__("pickle").dumps({"w": [1.0]}, protocol=4)),
        1,
        "{IN} is not a checkpoint written by torch.save: it is a plain pickle (protocol 4), not torch.save's format. "
        "Check that it is the file you meant.",
    ),
    "zip without data.pkl": (
        lambda p, mp: _zip_without_pickle(p),
        1,
        "{IN} is not a checkpoint written by torch.save: it is a zip archive without a data.pkl record (it holds "
        "['notes.txt']...). Check that it is the file you meant.",
    ),
    "newer pickle protocol": (
        lambda p, mp: torch.save({"w": torch.ones(2)}, p, pickle_protocol=4),
        1,
        "{IN} was saved with pickle protocol 4, which torch's safe reader does not read. Re-save it with "
        "torch.save's default protocol where it loads, and convert that file.",
    ),
    "TorchScript archive": (
        lambda p, mp: torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), p),
        1,
        "{IN} is a TorchScript archive (torch.jit.save), not a checkpoint: load it with torch.jit.load.",
    ),
    "cyclic structure": (
        lambda p, mp: _cyclic(p),
        1,
        "{IN} was not converted: it holds a cyclic structure (a container that contains itself), which a "
        "checkpoint's state dicts never hold.",
    ),
    "scaler without its attributes": (
        _bad_scaler,
        1,
        "{IN} was not converted: optimizer.loss_scaler: the apex.amp.scaler.LossScaler there lacks that class's "
        "attributes, or holds ones that are not numbers (apex did not write it).",
    ),
}


_JIT_DEPRECATED = pytest.mark.filterwarnings("ignore:`torch.jit.:DeprecationWarning")  # writing the archive


@_JIT_DEPRECATED
@pytest.mark.parametrize("case", list(CASES))
def test_each_refused_input_gets_one_line_naming_the_fix(tmp_path, capsys, monkeypatch, case):
    """A whole pickled model used to print ~20 lines of torch's text with raw ANSI codes and its
    add_safe_globals advice; every case is one line of this command's own."""
    write, code, message = CASES[case]
    src, out = tmp_path / "in.pt", tmp_path / "out.pt"
    write(src, monkeypatch)
    for name in [n for n, m in sys.modules.items() if getattr(m, "_stand_in", False)]:
        monkeypatch.delitem(sys.modules, name)
    got = _run(capsys, src, out)
    assert got == (code, "", _PREFIX + message.format(IN=src, OUT=out) + "\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.pt"]


def test_a_truncated_and_a_damaged_file(tmp_path, capsys):
    buf = io.BytesIO()
    torch.save({"w": torch.arange(500.0)}, buf)
    (tmp_path / "cut.pt").write_bytes(buf.getvalue()[:-30])
    code, out, err = _run(capsys, tmp_path / "cut.pt", tmp_path / "a.pt")
    assert (code, out) == (1, "")
    assert err.startswith(f"{_PREFIX}{tmp_path / 'cut.pt'} is truncated or corrupt: its zip archive does not open")
    assert err.endswith(". Copy it again from the original.\n") and err.count("\n") == 1
    damaged = bytearray(buf.getvalue())
    damaged[len(damaged) // 2] ^= 0x01
    (tmp_path / "bad.pt").write_bytes(bytes(damaged))
    assert _run(capsys, tmp_path / "bad.pt", tmp_path / "b.pt") == (
        1,
        "",
        f"{_PREFIX}{tmp_path / 'bad.pt'} is truncated or corrupt: record 'archive/data/0' of its zip archive fails "
        "its CRC check. Copy it again from the original.\n",
    )


def test_input_and_output_paths(tmp_path, capsys):
    good = tmp_path / "good.pt"
    torch.save({"w": torch.ones(2)}, good)
    (tmp_path / "a_file").write_bytes(b"x")
    (tmp_path / "folder").mkdir()
    (tmp_path / "taken.pt").write_bytes(b"keep me")
    cases = [  # (IN, OUT, exit code, message)
        (tmp_path / "missing.pt", tmp_path / "o.pt", 1, f"{tmp_path / 'missing.pt'}: no such file."),
        (
            tmp_path / "folder",
            tmp_path / "o.pt",
            1,
            f"{tmp_path / 'folder'} is a directory; give the checkpoint file in it.",
        ),
        (
            good,
            tmp_path / "taken.pt",
            2,
            f"{tmp_path / 'taken.pt'} exists; choose another name, or pass --force to replace it.",
        ),
        (
            good,
            good,
            2,
            f"{good} is IN; write the converted checkpoint elsewhere, or pass --force to replace IN once converted.",
        ),
        (
            good,
            tmp_path / "folder",
            2,
            f"{tmp_path / 'folder'} is a directory; name the file to write in it, e.g. "
            f"{tmp_path / 'folder' / 'good.pt'}.",
        ),
        (
            good,
            tmp_path / "no" / "o.pt",
            2,
            f"{tmp_path / 'no'} is not a directory: create it first, or write o.pt elsewhere.",
        ),
        (
            good,
            tmp_path / "a_file" / "o.pt",
            2,
            f"{tmp_path / 'a_file'} is not a directory: create it first, or write o.pt elsewhere.",
        ),
    ]
    for src, out, code, message in cases:
        assert _run(capsys, src, out) == (code, "", f"{_PREFIX}{message}\n"), (src, out)
    assert (tmp_path / "taken.pt").read_bytes() == b"keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "folder", "good.pt", "taken.pt"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_input(tmp_path, capsys):
    src = tmp_path / "locked.pt"
    torch.save({"w": torch.ones(2)}, src)
    src.chmod(0)
    assert _run(capsys, src, tmp_path / "o.pt") == (1, "", f"{_PREFIX}{src} cannot be read: permission denied.\n")


@pytest.mark.parametrize(
    "location,message",
    [
        ("gpu", "--map-location gpu is not a device: give cpu (the default), cuda or cuda:N"),
        ("cuda:x", "--map-location cuda:x is not a device: give cpu (the default), cuda or cuda:N"),
    ],
)
def test_a_map_location_that_is_not_a_device(tmp_path, capsys, apex_era_file, location, message):
    assert _run(capsys, apex_era_file, tmp_path / "o.pt", "--map-location", location) == (
        2,
        "",
        f"{_PREFIX}{message}\n",
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_device_this_machine_lacks(tmp_path, capsys, apex_era_file):
    n = torch.cuda.device_count()
    assert _run(capsys, apex_era_file, tmp_path / "o.pt", "--map-location", f"cuda:{n}") == (
        2,
        "",
        f"{_PREFIX}--map-location cuda:{n}: this machine has {n} CUDA device(s), cuda:0 to cuda:{n - 1}\n",
    )


def test_a_safetensors_file_is_re_saved(tmp_path, capsys):
    safetensors = pytest.importorskip("safetensors.torch")
    src = tmp_path / "w.safetensors"
    safetensors.save_file({"w": torch.ones(2)}, str(src))
    code, out, err = _run(capsys, src, tmp_path / "w.pt")
    assert (code, err) == (0, "") and "nothing to convert" in out
    assert torch.equal(torch.load(tmp_path / "w.pt", weights_only=True)["w"], torch.ones(2))


@_JIT_DEPRECATED
def test_no_message_names_python_arguments_torch_advice_or_escape_codes(tmp_path, capsys, monkeypatch, apex_era_file):
    """Every failing case above, and the usage ones, checked for what used to leak into the messages."""
    messages = []
    for _case, (write, _, _) in CASES.items():
        src = tmp_path / f"{len(messages)}.pt"
        write(src, monkeypatch)
        messages.append(_run(capsys, src, tmp_path / "never.pt")[2])
    (tmp_path / "taken.pt").write_bytes(b"x")
    messages += [_run(capsys, apex_era_file, tmp_path / "taken.pt")[2], _run(capsys, apex_era_file, apex_era_file)[2]]
    for err in messages:
        assert err.startswith(_PREFIX) and err.count("\n") == 1 and len(err) < 400, err
        for leak in ("\x1b[", "safe_globals", "weights_only", "=True", "torch said", "Traceback", "overwrite"):
            assert leak not in err, (leak, err)


# ---------------------------------------- files that would cost more than they hold (issue 17 §2)


def _with_pickle(path, pkl: bytes) -> None:
    """A zip checkpoint whose data.pkl is ``pkl``."""
    import zipfile

    buf = io.BytesIO()
    torch.save({"w": torch.zeros(4)}, buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as src, zipfile.ZipFile(path, "w") as z:
        for info in src.infolist():
            z.writestr(info.filename, pkl if info.filename.endswith("data.pkl") else src.read(info.filename))


def _shared_records(path) -> None:
    """A checkpoint whose zip directory points 300 more entries at one stored 64 KB record."""
    import struct
    import zipfile
    import zlib

    buf = io.BytesIO()
    torch.save({"w": torch.zeros(4)}, buf)
    data = buf.getvalue()
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        infos, start = z.infolist(), z.start_dir
    body, blob, name = bytearray(data[:start]), bytes(2**16), b"archive/data/big"
    offset = len(body)
    body += (
        struct.pack(
            zipfile.structFileHeader,
            zipfile.stringFileHeader,
            20,
            0,
            0,
            0,
            0,
            0,
            zlib.crc32(blob),
            len(blob),
            len(blob),
            len(name),
            0,
        )
        + name
        + blob
    )
    rows = [(i.filename.encode(), i.CRC, i.compress_size, i.header_offset) for i in infos]
    rows += [(b"archive/data/big%d" % k, zlib.crc32(blob), len(blob), offset) for k in range(300)]
    directory = b"".join(
        struct.pack(
            zipfile.structCentralDir,
            zipfile.stringCentralDir,
            20,
            3,
            20,
            0,
            0,
            0,
            0,
            0,
            crc,
            size,
            size,
            len(n),
            0,
            0,
            0,
            0,
            0,
            at,
        )
        + n
        for n, crc, size, at in rows
    )
    path.write_bytes(
        bytes(body)
        + directory
        + struct.pack(
            zipfile.structEndArchive, zipfile.stringEndArchive, 0, 0, len(rows), len(rows), len(directory), len(body), 0
        )
    )


def _unfilled_legacy(path) -> None:
    """The issue's 829 bytes: a legacy FloatStorage of 2**24 items the file never fills."""
    buf = io.BytesIO()
    torch.save({"w": torch.zeros(4)}, buf, _use_new_zipfile_serialization=False)
    data = buf.getvalue()
    i = data.find(b"K\x04", data.find(b"cpu"))  # the storage's numel
    data = data[:i] + b"J\x00\x00\x00\x01" + data[i + 2 :]
    path.write_bytes(data[: data.rindex(b"\x80\x02]")] + b"\x80\x02].")


HOSTILE = {  # IN -> what the one line says after "{IN} "
    "300 zip entries sharing one record": (
        _shared_records,
        "is truncated or corrupt: its zip records 'archive/data/big0' and 'archive/data/big1' overlap",
    ),
    "bytearray(2**26)": (
        lambda p: _with_pickle(p, b"\x80\x02c__builtin__\nbytearray\nJ\x00\x00\x00\x04\x85R."),
        "was not converted: its pickle builds 67,108,864 bytes by builtins.bytearray",
    ),
    "torch.FloatTensor(2**24)": (
        lambda p: _with_pickle(p, b"\x80\x02ctorch\nFloatTensor\nJ\x00\x00\x00\x01\x85R."),
        "was not converted: it calls torch.FloatTensor(...) with arguments",
    ),
    "a bare apex class": (
        lambda p: _with_pickle(p, b"\x80\x02}X\x01\x00\x00\x00scapex.amp.scaler\nLossScaler\ns."),
        "was not converted: it holds apex.amp.scaler.LossScaler itself (the class or function",
    ),
    "a legacy storage never filled": (
        _unfilled_legacy,
        "is truncated or corrupt: its pickle claims storages of 67,108,864 bytes, more than the rest of the file",
    ),
    # a 200k-deep tuple: tests/legacy/checkpoints/test_hostile.py, in a child process (it crashed the reader)
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_file_that_would_cost_more_than_it_holds_is_one_line_and_nothing_written(tmp_path, capsys, case):
    write, said = HOSTILE[case]
    src, out = tmp_path / "in.pt", tmp_path / "out.pt"
    write(src)
    code, printed, err = _run(capsys, src, out)
    assert (code, printed) == (1, "") and err.count("\n") == 1, err
    assert err.startswith(f"{_PREFIX}{src} {said}"), err
    assert "Traceback" not in err and sorted(p.name for p in tmp_path.iterdir()) == ["in.pt"]


def _unblocking(path):
    """Writes to the FIFO ``path`` whenever someone opens it for reading (so that a reader does
    not wait forever); returns a function that stops it and says how often that happened."""
    import threading

    done, opened = threading.Event(), []

    def run():
        while not done.wait(0.01):
            try:
                fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:
                continue
            opened.append(1)
            os.write(fd, b"x")
            os.close(fd)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def stop():
        done.set()
        thread.join()
        return len(opened)

    return stop


def test_a_fifo_or_a_device_as_in_or_out_is_refused_at_once(tmp_path, capsys, apex_era_file):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    stop = _unblocking(fifo)
    try:
        got_in = _run(capsys, fifo, tmp_path / "o.pt")
    finally:
        opened = stop()
    assert (
        got_in
        == (
            1,
            "",
            f"{_PREFIX}{fifo} is a FIFO (named pipe), not a regular file (reading it could wait "
            "forever): give the checkpoint file.\n",
        )
        and opened == 0
    )
    assert _run(capsys, "/dev/zero", tmp_path / "o.pt")[:2] == (1, "")
    for out in (fifo, pathlib.Path("/dev/null")):
        assert _run(capsys, apex_era_file, out, "--force") == (
            2,
            "",
            f"{_PREFIX}{out} is not a regular file (a FIFO, "
            "a device or a socket); name a file to write, --force or not.\n",
        )
    assert fifo.is_fifo() and pathlib.Path("/dev/null").is_char_device()


def test_a_file_name_with_a_newline_is_still_one_line(tmp_path, capsys):
    """The one-line promise holds for what the message quotes: IN's own name may hold a newline."""
    src = tmp_path / "two\nlines.pt"
    src.write_bytes(b"step,loss\n1,0.5\n")
    code, out, err = _run(capsys, src, tmp_path / "out.pt")
    assert code == 1 and out == "" and err.count("\n") == 1 and "two\\nlines.pt is not a checkpoint" in err, err
