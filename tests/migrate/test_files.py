"""Which files a migration walks, and rewriting one in place."""

from __future__ import annotations

import os
import stat

import pytest

pytest.importorskip("libcst")

from fp16kit.migrate import files  # noqa: E402
from fp16kit.migrate.files import is_python_file, iter_python_files, migrate_file  # noqa: E402


def _tree(root):
    files = {
        "train.py": "from apex import amp\n",
        "pkg/__init__.py": "",
        "pkg/model.py": "import apex.optimizers\n",
        "pkg/types.pyi": "from apex.optimizers import FusedAdam\n",
        "pkg/notes.txt": "from apex import amp\n",
        "bin/launch": "#!/usr/bin/env python3\nfrom apex import amp\n",
        "bin/run.sh": "#!/bin/sh\necho apex\n",
        ".git/hooks/x.py": "import apex\n",
        ".hidden.py": "import apex\n",
        "venv/lib/site.py": "import apex\n",
        "venv/pyvenv.cfg": "home = /usr\n",
        "lib/site-packages/apex/__init__.py": "import apex\n",
        "pkg/__pycache__/model.py": "import apex\n",
    }
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_walks_python_files_only(tmp_path):
    root = _tree(tmp_path)
    found = [os.path.relpath(p, root) for p in iter_python_files([str(root)])]
    assert found == ["bin/launch", "pkg/__init__.py", "pkg/model.py", "pkg/types.pyi", "train.py"]


def test_each_file_once_and_missing_paths_refused(tmp_path):
    root = _tree(tmp_path)
    twice = list(iter_python_files([str(root / "train.py"), str(root), str(root / "train.py")]))
    assert len(twice) == len(set(twice)) == 5
    assert list(iter_python_files([str(root / "pkg" / "notes.txt")])) == []
    with pytest.raises(FileNotFoundError, match="nope"):
        list(iter_python_files([str(root / "nope")]))


def test_is_python_file(tmp_path):
    (tmp_path / "a").write_text("#!/usr/bin/python2.7\n")
    (tmp_path / "b").write_text("just text\n")
    assert is_python_file(str(tmp_path / "a")) and not is_python_file(str(tmp_path / "b"))
    assert is_python_file("x.py") and is_python_file("x.pyw") and not is_python_file("x.pyc")


def test_migrate_file_writes_in_place_keeping_the_mode(tmp_path):
    path = tmp_path / "train.py"
    path.write_bytes(b"#!/usr/bin/env python\r\nfrom apex import amp\r\n")
    path.chmod(0o755)
    out = migrate_file(str(path))
    assert out.changed and out.written and out.imports_rewritten == 1 and out.error is None
    assert path.read_bytes() == b"#!/usr/bin/env python\r\nfrom fp16kit.legacy import amp\r\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o755
    assert [p.name for p in tmp_path.iterdir()] == ["train.py"]  # no temporary file left
    again = migrate_file(str(path))
    assert not again.changed and not again.written


def test_migrate_file_through_a_symlink_rewrites_the_target(tmp_path):
    real = tmp_path / "real.py"
    real.write_text("import apex.amp as amp\n")
    link = tmp_path / "link.py"
    link.symlink_to(real)
    migrate_file(str(link))
    assert link.is_symlink() and real.read_text() == "import fp16kit.legacy.amp as amp\n"


def test_diff_and_dry_runs_write_nothing(tmp_path):
    path = tmp_path / "t.py"
    path.write_text("x = 1\nfrom apex import amp\n")
    mtime = path.stat().st_mtime_ns
    out = migrate_file(str(path), write=False, diff=True)
    assert out.changed and not out.written
    assert out.diff == (
        f"--- {path}\n+++ {path}\n@@ -1,2 +1,2 @@\n x = 1\n-from apex import amp\n+from fp16kit.legacy import amp\n"
    ).encode()
    assert path.read_text() == "x = 1\nfrom apex import amp\n" and path.stat().st_mtime_ns == mtime


def test_unparsable_and_unreadable_files_are_reported_not_written(tmp_path):
    bad = tmp_path / "py2.py"
    bad.write_text("import apex\nprint 'x'\n")
    out = migrate_file(str(bad))
    assert out.error is not None and out.error_line == 2 and not out.written
    assert bad.read_text() == "import apex\nprint 'x'\n"
    gone = migrate_file(str(tmp_path / "missing.py"))
    assert gone.error is not None and "cannot read" in gone.error


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_fifos_are_not_opened(tmp_path):
    # a named pipe in the tree (*.py or an extensionless name) used to block the walk forever on open()
    os.mkfifo(tmp_path / "pipe.py")
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "train.py").write_text("from apex import amp\n")
    assert list(iter_python_files([str(tmp_path)])) == [str(tmp_path / "train.py")]
    assert list(iter_python_files([str(tmp_path / "pipe.py")])) == []


def test_a_file_that_cannot_be_written_is_reported_and_left_as_it_was(tmp_path, monkeypatch):
    # a read-only folder or file system (root ignores permission bits, so the failure is simulated)
    import tempfile

    path = tmp_path / "train.py"
    path.write_text("from apex import amp\n")

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    out = migrate_file(str(path))
    assert out.error == "cannot write: Permission denied" and not out.written
    assert path.read_text() == "from apex import amp\n"


def test_the_diff_is_in_the_files_own_bytes_so_patch_applies_it(tmp_path, monkeypatch):
    # it was decoded text: a BOM file's first line lost its BOM, a latin-1 line came out as UTF-8,
    # and a form feed split a line (str.splitlines) -- `patch` / `git apply` refused all three
    files = {
        "bom.py": b"\xef\xbb\xbfimport apex\r\nx = apex.amp.initialize\r\nfrom apex import amp",
        "latin.py": b"# -*- coding: latin-1 -*-\nfrom apex import amp  # caf\xe9\n",
        "ff.py": b"x = 1\n\x0c\nfrom apex import amp\n",
    }
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    monkeypatch.chdir(tmp_path)
    diffs = {name: migrate_file(os.path.join(".", name), write=False, diff=True).diff for name in files}
    assert diffs["latin.py"] == (
        b"--- a/latin.py\n+++ b/latin.py\n@@ -1,2 +1,2 @@\n # -*- coding: latin-1 -*-\n"
        b"-from apex import amp  # caf\xe9\n+from fp16kit.legacy import amp  # caf\xe9\n"
    )
    assert diffs["bom.py"].startswith(b"--- a/bom.py\n+++ b/bom.py\n@@ -1,3 +1,3 @@\n-\xef\xbb\xbfimport apex\r\n")
    assert diffs["bom.py"].endswith(b"+from fp16kit.legacy import amp\n\\ No newline at end of file\n")
    assert diffs["ff.py"] == (
        b"--- a/ff.py\n+++ b/ff.py\n@@ -1,3 +1,3 @@\n x = 1\n \x0c\n-from apex import amp\n+from fp16kit.legacy import amp\n"
    )
    # applied with a hand-written unified-diff applier (one hunk each): the migrated bytes come back
    for name, data in files.items():
        hunk = diffs[name].split(b"\n", 3)[3].replace(b"\n\\ No newline at end of file\n", b"\x00\n")
        old, new = b"", b""
        for line in hunk.split(b"\n")[:-1]:  # the diff's own lines end in \n; the file's \r stays in them
            body = line[1:] + b"\n"
            body = body[:-2] if body.endswith(b"\x00\n") else body
            old += body if line[:1] in b" -" else b""
            new += body if line[:1] in b" +" else b""
        assert data.startswith(old) or data == old
        migrate_file(name)
        assert (tmp_path / name).read_bytes() == data.replace(old, new, 1)


def _vendored_apex(root):
    for sub in ("", "amp", "optimizers"):
        (root / "apex" / sub).mkdir(parents=True, exist_ok=True)
        (root / "apex" / sub / "__init__.py").write_text("from apex.multi_tensor_apply import multi_tensor_applier\n")


def test_a_vendored_apex_source_tree_is_skipped_and_reported(tmp_path):
    # a checkout with a copy of apex's package: its own `from apex.x import ...` were rewritten, breaking it
    (tmp_path / "train.py").write_text("from apex import amp\n")
    (tmp_path / "third_party").mkdir()
    _vendored_apex(tmp_path / "third_party")
    (tmp_path / "third_party" / "tests").mkdir()
    (tmp_path / "third_party" / "tests" / "test_amp.py").write_text("from apex import amp\n")
    # a user's own folder named apex without apex's subpackages, or one of its scripts, is migrated
    (tmp_path / "tools" / "apex").mkdir(parents=True)
    (tmp_path / "tools" / "apex" / "__init__.py").write_text("from apex import amp\n")
    skipped: list = []
    found = [os.path.relpath(p, tmp_path) for p in iter_python_files([str(tmp_path)], skipped)]
    assert found == ["third_party/tests/test_amp.py", "tools/apex/__init__.py", "train.py"]
    assert skipped == [(str(tmp_path / "third_party" / "apex"), files.VENDORED_APEX)]
    skipped.clear()  # named itself: skipped too
    assert list(iter_python_files([str(tmp_path / "third_party" / "apex")], skipped)) == []
    assert skipped == [(str(tmp_path / "third_party" / "apex"), files.VENDORED_APEX)]


def test_a_non_python_file_named_explicitly_is_reported(tmp_path):
    (tmp_path / "notes.txt").write_text("from apex import amp\n")
    (tmp_path / "a.py").write_text("")
    skipped: list = []
    assert list(iter_python_files([str(tmp_path / "notes.txt"), str(tmp_path / "a.py")], skipped)) == [str(tmp_path / "a.py")]
    assert skipped == [(str(tmp_path / "notes.txt"), "not a Python file (*.py, *.pyw, *.pyi or a #!...python script); skipped")]
    skipped.clear()  # found by a walk: not named, so not reported
    list(iter_python_files([str(tmp_path)], skipped))
    assert skipped == []
