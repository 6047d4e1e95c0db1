"""`fp16kit migrate`: in place, --diff, --check, the summary, exit codes, reports as file:line."""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("libcst")

from fp16kit.cli import main  # noqa: E402

SCRIPT = (
    "import torch\n"
    "import apex\n"
    "from apex import amp, RNN  # mixed\n"
    "model = apex.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))\n"
)
MIGRATED = (
    "import torch\n"
    "import fp16kit.legacy\n"
    "from fp16kit.legacy import amp\n"
    "from apex import RNN  # mixed\n"
    "model = fp16kit.legacy.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))\n"
)


@pytest.fixture
def project(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "train.py").write_text(SCRIPT)
    (tmp_path / "src" / "clean.py").write_text("import torch\n")
    (tmp_path / "README.md").write_text("from apex import amp\n")
    return tmp_path


def _snapshot(root):
    return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_rewrites_in_place_and_reports(project, capsys):
    assert main(["migrate", str(project)]) == 0
    out = capsys.readouterr().out
    assert (project / "src" / "train.py").read_text() == MIGRATED
    assert (project / "README.md").read_text() == "from apex import amp\n"  # not Python
    train = project / "src" / "train.py"
    assert f"{train}:3: from apex import RNN: apex.RNN" in out and "torch.nn.LSTM" in out
    assert "1 of 2 Python files rewritten (2 imports, 1 dotted use); 1 use of apex left for you" in out
    # second run: nothing to do
    assert main(["migrate", "--check", str(project)]) == 0
    assert "0 of 2 Python files would be rewritten" in capsys.readouterr().out


def test_diff_prints_and_writes_nothing(project, capsys):
    before = _snapshot(project)
    assert main(["migrate", "--diff", str(project)]) == 0
    captured = capsys.readouterr()
    assert _snapshot(project) == before
    train = project / "src" / "train.py"
    assert captured.out.startswith(f"--- {train}\n+++ {train}\n")
    assert "\n-import apex\n" in captured.out and "\n+import fp16kit.legacy\n" in captured.out
    assert all(line[:1] in " -+@" for line in captured.out.splitlines())  # stdout is a clean diff
    assert "1 of 2 Python files would be rewritten" in captured.err and "train.py:3: " in captured.err


def test_check_exits_1_when_something_would_change(project, capsys):
    before = _snapshot(project)
    assert main(["migrate", "--check", str(project / "src")]) == 1
    assert _snapshot(project) == before
    assert main(["migrate", "--check", "--diff", str(project / "src" / "train.py")]) == 1
    assert main(["migrate", "--check", str(project / "src" / "clean.py")]) == 0
    assert _snapshot(project) == before


def test_megatron_flag(tmp_path, capsys):
    path = tmp_path / "m.py"
    path.write_text("from fp16 import FP16_Optimizer\n")
    assert main(["migrate", str(path)]) == 0
    assert path.read_text() == "from fp16 import FP16_Optimizer\n"
    assert main(["migrate", "--megatron", str(path)]) == 0
    assert path.read_text() == "from fp16kit.legacy.megatron import FP16_Optimizer\n"


def test_exit_codes_for_bad_input(tmp_path, capsys):
    assert main(["migrate", str(tmp_path / "nope")]) == 2
    assert "no such file or directory" in capsys.readouterr().err
    (tmp_path / "py2.py").write_text("import apex\nprint 'x'\n")
    (tmp_path / "ok.py").write_text("import apex.amp\n")
    assert main(["migrate", str(tmp_path)]) == 3
    captured = capsys.readouterr()
    assert f"{tmp_path / 'py2.py'}:2: cannot parse" in captured.err
    assert (tmp_path / "ok.py").read_text() == "import fp16kit.legacy.amp\n"  # the others are done
    with pytest.raises(SystemExit) as e:
        main(["migrate"])
    assert e.value.code == 2


def test_help_documents_the_exit_codes(capsys):
    with pytest.raises(SystemExit):
        main(["migrate", "--help"])
    out = capsys.readouterr().out
    for line in ("0  done", "1  --check", "2  bad arguments", "3  some file could not be processed"):
        assert line in out


def test_says_how_to_get_libcst(monkeypatch, tmp_path, capsys):
    for name in [
        m for m in sys.modules if m.startswith(("libcst", "fp16kit.migrate.codemod", "fp16kit.migrate.files"))
    ]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "libcst", None)  # what an install without the extra looks like
    assert main(["migrate", str(tmp_path)]) == 2
    assert 'pip install "fp16kit[migrate]"' in capsys.readouterr().err


def test_a_non_utf8_file_is_skipped_and_the_others_migrated(tmp_path, capsys):
    (tmp_path / "a_latin1.py").write_bytes(b"from apex import amp\nname = 'caf\xe9'\n")  # no coding line
    (tmp_path / "b.py").write_text("from apex import amp\n")
    assert main(["migrate", str(tmp_path)]) == 3
    err = capsys.readouterr().err
    assert f"{tmp_path / 'a_latin1.py'}:2: cannot decode" in err and "Traceback" not in err
    assert (tmp_path / "a_latin1.py").read_bytes() == b"from apex import amp\nname = 'caf\xe9'\n"
    assert (tmp_path / "b.py").read_text() == "from fp16kit.legacy import amp\n"


def test_a_file_that_cannot_be_written_does_not_stop_the_run(tmp_path, capsys, monkeypatch):
    import fp16kit.migrate.files as files

    (tmp_path / "a.py").write_text("from apex import amp\n")
    (tmp_path / "b.py").write_text("from apex import amp\n")
    real = files._write_in_place

    def read_only_a(path, *args):
        if path.endswith("a.py"):
            raise OSError(30, "Read-only file system")
        real(path, *args)

    monkeypatch.setattr(files, "_write_in_place", read_only_a)
    assert main(["migrate", str(tmp_path)]) == 3
    err = capsys.readouterr().err
    assert f"{tmp_path / 'a.py'}: cannot write: Read-only file system; file skipped" in err and "Traceback" not in err
    assert (tmp_path / "b.py").read_text() == "from fp16kit.legacy import amp\n"


def test_vendored_apex_and_named_non_python_files_are_said_to_be_skipped(project, capsys):
    # `fp16kit migrate DIR` rewrote a vendored apex copy's own imports; `fp16kit migrate notes.txt` said nothing
    vendored = project / "apex"
    for sub in ("", "amp", "optimizers"):
        (vendored / sub).mkdir(exist_ok=True)
        (vendored / sub / "__init__.py").write_text("from apex.amp import initialize\n")
    before = _snapshot(vendored)
    assert main(["migrate", str(project), str(project / "README.md")]) == 0
    out = capsys.readouterr().out
    assert _snapshot(vendored) == before
    assert f"{vendored}: a vendored apex source tree (its own imports must stay apex's); folder skipped\n" in out
    assert f"{project / 'README.md'}: not a Python file" in out
    assert out.rstrip().endswith(
        "; 1 vendored apex folder skipped (listed above); 1 named path skipped, not Python (listed above)"
    )
    assert "1 of 2 Python files rewritten" in out


def test_availability_checks_are_counted_checked_and_reported(tmp_path, capsys):
    # Transformer-XL's guard is all that names apex in this utils file: without its rewrite, a
    # migrated run stopped at "APEX AMP unavailable" and --check said there was nothing to do
    utils = tmp_path / "utils.py"
    utils.write_text(
        "import sys\n"
        "import importlib.metadata\n"
        "def check(args):\n"
        "    if args.fp16 and args.amp == 'apex' and 'apex' not in sys.modules:\n"
        "        raise RuntimeError('APEX AMP unavailable, install APEX or switch to pytorch AMP')\n"
        "    return importlib.metadata.version('apex')\n"
    )
    assert main(["migrate", "--check", str(utils)]) == 1
    out = capsys.readouterr().out
    assert "1 of 1 Python file would be rewritten (0 imports, 0 dotted uses, 1 availability check)" in out
    assert f"{utils}:6: importlib.metadata.version('apex') is not rewritten: no migrated install has an 'apex'" in out
    assert main(["migrate", str(utils)]) == 0
    assert "and 'fp16kit.legacy' not in sys.modules:" in utils.read_text()
    capsys.readouterr()
    assert main(["migrate", "--check", str(utils)]) == 0


def test_files_it_cannot_or_must_not_rewrite_are_listed_and_the_run_goes_on(tmp_path, capsys):
    # issue 17 §3: a link out of the tree, a hard link, a 0444 file, a deep expression, a NUL byte, an
    # invalid escape under -W error, a big generated file: each harmed the tree or stopped the run
    import os
    import warnings

    tree, outside = tmp_path / "tree", tmp_path / "outside"
    tree.mkdir()
    outside.mkdir()
    (outside / "shared.py").write_text("from apex import amp\n")
    (tree / "shared.py").symlink_to(outside / "shared.py")
    (tree / "linked.py").write_text("from apex import amp\n")
    os.link(tree / "linked.py", tmp_path / "elsewhere.py")
    (tree / "locked.py").write_text("from apex import amp\n")
    (tree / "locked.py").chmod(0o444)
    (tree / "nul.py").write_bytes(b"import apex\ns = 'a\0b'\n")
    (tree / "deep.py").write_text("import apex\nx = " + " + ".join(["a"] * 400) + "\n")
    (tree / "escape.py").write_text("import apex\npattern = '\\d+'\n")
    (tree / "big_pb2.py").write_text("from apex import amp\n" + "# generated\n" * 200)
    before = {
        p: p.read_bytes() for p in (outside / "shared.py", tree / "linked.py", tree / "locked.py", tree / "nul.py")
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        code = main(["migrate", str(tree), "--max-size", "2000"])
    captured = capsys.readouterr()
    assert code == 3 and "Traceback" not in captured.err
    lines = captured.err.splitlines()
    assert lines == [
        f"{tree / 'big_pb2.py'}: 2421 bytes, over the 2000-byte limit (a generated file?), not read: --max-size BYTES "
        "raises the limit; file skipped",
        f"{tree / 'linked.py'}: a hard-linked file (2 names; a rewrite would split it from the others): "
        "--write-hard-links rewrites it in place, for all of them; file skipped",
        f"{tree / 'locked.py'}: read-only (mode 0444): --write-read-only rewrites it, keeping the mode; file skipped",
        f"{tree / 'nul.py'}:2: cannot parse: a NUL byte (python would refuse the file too): remove it, or write it as "
        "\\x00; file skipped",
        f"{tree / 'shared.py'}: a symlink to {outside / 'shared.py'}, outside the folders given: name "
        f"{outside / 'shared.py'} itself to migrate it; file skipped",
    ]
    assert (
        "2 of 7 Python files rewritten" in captured.out
        and "; 5 files could not be processed (listed above)" in captured.out
    )
    assert {p: p.read_bytes() for p in before} == before
    assert (tree / "deep.py").read_text().startswith("import fp16kit.legacy\n")
    assert (tree / "escape.py").read_text() == "import fp16kit.legacy\npattern = '\\d+'\n"
    # the flags let them through; --check still says 1 for "would change", 3 only for what it cannot process
    assert main(["migrate", "--check", str(tree / "locked.py"), str(tree / "linked.py")]) == 1
    assert main(["migrate", "--check", str(tree), "--max-size", "2000"]) == 3
    capsys.readouterr()
    assert main(["migrate", str(tree), "--max-size", "3000", "--write-hard-links", "--write-read-only"]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 2 and "nul.py:2: cannot parse" in err and "shared.py: a symlink to" in err
    assert (tmp_path / "elsewhere.py").read_text() == "from fp16kit.legacy import amp\n"  # one file, both names
    assert (tree / "locked.py").read_text() == "from fp16kit.legacy import amp\n"
    assert (tree / "big_pb2.py").read_text().startswith("from fp16kit.legacy import amp\n")
    assert (outside / "shared.py").read_bytes() == before[outside / "shared.py"]


def test_help_documents_the_safety_flags(capsys):
    with pytest.raises(SystemExit):
        main(["migrate", "--help"])
    out = capsys.readouterr().out
    for text in (
        "--max-size BYTES",
        "--write-hard-links",
        "--write-read-only",
        "changed while migrating",
        "3  some file could not be processed",
    ):
        assert text in out
    with pytest.raises(SystemExit) as e:
        main(["migrate", ".", "--max-size", "0"])
    assert e.value.code == 2 and "must be a positive number of bytes" in capsys.readouterr().err
