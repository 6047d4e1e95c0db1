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
    assert (
        out.diff
        == (
            f"--- {path}\n+++ {path}\n@@ -1,2 +1,2 @@\n x = 1\n-from apex import amp\n+from fp16kit.legacy import amp\n"
        ).encode()
    )
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
    assert list(iter_python_files([str(tmp_path / "notes.txt"), str(tmp_path / "a.py")], skipped)) == [
        str(tmp_path / "a.py")
    ]
    assert skipped == [
        (str(tmp_path / "notes.txt"), "not a Python file (*.py, *.pyw, *.pyi or a #!...python script); skipped")
    ]
    skipped.clear()  # found by a walk: not named, so not reported
    list(iter_python_files([str(tmp_path)], skipped))
    assert skipped == []


# -- never harming a tree (issue 17 §3) ---------------------------------------------------------


def _migrate_all(paths, **kwargs):
    """What `fp16kit migrate` does with ``paths``: the files walked, each migrated inside the roots."""
    skipped: list = []
    roots = files.given_roots(paths)
    outcomes = {p: migrate_file(p, roots=roots, **kwargs) for p in iter_python_files(paths, skipped)}
    return outcomes, skipped


def test_a_symlink_out_of_the_tree_is_neither_rewritten_nor_followed(tmp_path):
    # a link in a checkout to a shared file (or folder) elsewhere: migrate rewrote the file outside the tree
    tree, outside = tmp_path / "tree", tmp_path / "outside"
    tree.mkdir()
    (outside / "pkg").mkdir(parents=True)
    (outside / "shared.py").write_text("from apex import amp\n")
    (outside / "pkg" / "mod.py").write_text("import apex.amp\n")
    (tree / "train.py").write_text("from apex import amp\n")
    (tree / "shared.py").symlink_to(outside / "shared.py")
    (tree / "ext").symlink_to(outside / "pkg")
    outcomes, skipped = _migrate_all([str(tree)])
    assert sorted(outcomes) == [str(tree / "shared.py"), str(tree / "train.py")]
    link = outcomes[str(tree / "shared.py")]
    assert not link.written and link.error == (
        f"a symlink to {outside / 'shared.py'}, outside the folders given: name {outside / 'shared.py'} itself to migrate it"
    )
    assert skipped == [
        (
            str(tree / "ext"),
            f"a symlink to {outside / 'pkg'}, outside the folders given; not followed (name it to migrate it)",
        )
    ]
    assert (outside / "shared.py").read_text() == "from apex import amp\n"
    assert (outside / "pkg" / "mod.py").read_text() == "import apex.amp\n"
    assert (tree / "train.py").read_text() == "from fp16kit.legacy import amp\n"
    # named itself, the target is migrated
    outcomes, _ = _migrate_all([str(outside)])
    assert (outside / "shared.py").read_text() == "from fp16kit.legacy import amp\n"


def test_links_inside_the_tree_are_followed_once_and_loops_reported(tmp_path):
    (tmp_path / ".store").mkdir()
    (tmp_path / ".store" / "kept.py").write_text("import apex.amp\n")  # reached only through the link
    (tmp_path / "code").symlink_to(tmp_path / ".store")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text("import apex.amp\n")
    (tmp_path / "alias").symlink_to(tmp_path / "pkg")  # a second way to pkg/mod.py
    (tmp_path / "again").symlink_to(tmp_path / "alias")  # and a third
    (tmp_path / "pkg" / "back").symlink_to(tmp_path)  # a loop: a link to a folder holding it
    (tmp_path / "pkg" / "here").symlink_to(".")  # and to its own folder
    (tmp_path / "a.py").symlink_to(tmp_path / "b.py")  # a loop of file links
    (tmp_path / "b.py").symlink_to(tmp_path / "a.py")
    skipped: list = []
    found = [os.path.relpath(p, tmp_path) for p in iter_python_files([str(tmp_path)], skipped)]
    assert found == ["code/kept.py", "pkg/mod.py"]
    assert sorted(skipped) == [
        (str(tmp_path / "a.py"), "a symlink loop; skipped"),
        (str(tmp_path / "b.py"), "a symlink loop; skipped"),
        (str(tmp_path / "pkg" / "back"), f"a symlink loop (to {tmp_path}, a folder holding it); not followed"),
        (str(tmp_path / "pkg" / "here"), f"a symlink loop (to {tmp_path / 'pkg'}, a folder holding it); not followed"),
    ]
    outcomes, _ = _migrate_all([str(tmp_path)])
    assert all(o.written and o.error is None for o in outcomes.values())
    assert (tmp_path / ".store" / "kept.py").read_text() == "import fp16kit.legacy.amp\n"


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_rewritten_file_keeps_its_owner_group_mode_and_xattrs(tmp_path):
    # run as root, every rewritten file became root's (a new file from mkstemp); its xattrs were dropped
    path = tmp_path / "train.py"
    path.write_text("from apex import amp\n")
    os.chown(path, 1234, 5678)
    path.chmod(0o640)
    has_xattrs = hasattr(os, "setxattr")
    if has_xattrs:
        try:
            os.setxattr(path, "user.fp16kit.test", b"kept")
        except OSError:
            has_xattrs = False
    out = migrate_file(str(path))
    assert out.written and out.error is None
    st = path.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (1234, 5678, 0o640)
    if has_xattrs:
        assert os.getxattr(path, "user.fp16kit.test") == b"kept"
    assert path.read_text() == "from fp16kit.legacy import amp\n"


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="giving a file to another user needs root")
def test_an_owner_or_xattr_that_cannot_be_kept_leaves_the_file(tmp_path, monkeypatch):
    path = tmp_path / "train.py"
    path.write_text("from apex import amp\n")
    os.chown(path, 1234, 5678)

    def refuse(*args):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "fchown", refuse)  # what a user other than the owner (and not root) gets
    out = migrate_file(str(path))
    assert not out.written and out.error == (
        "owned by uid 1234 gid 5678, which this user cannot give the rewritten file: run migrate as its owner, or as root"
    )
    assert path.read_text() == "from apex import amp\n" and path.stat().st_uid == 1234
    assert [p.name for p in tmp_path.iterdir()] == ["train.py"]
    monkeypatch.undo()
    if not hasattr(os, "setxattr"):
        return
    try:
        os.setxattr(path, "user.fp16kit.test", b"v")
    except OSError:
        pytest.skip("no user xattrs on this file system")
    monkeypatch.setattr(os, "setxattr", lambda *args: refuse())
    out = migrate_file(str(path))
    assert (
        not out.written
        and out.error == "its extended attribute user.fp16kit.test cannot be given to the rewritten file"
    )
    assert path.read_text() == "from apex import amp\n"
    assert [p.name for p in tmp_path.iterdir()] == ["train.py"]


def test_hard_linked_files_are_left_unless_asked_then_rewritten_for_all_names(tmp_path):
    # the atomic replace split a hard link: the other name kept apex's imports
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("from apex import amp\n")
    os.link(a, b)
    out = migrate_file(str(a))
    assert not out.written and out.error == (
        "a hard-linked file (2 names; a rewrite would split it from the others): --write-hard-links rewrites it in "
        "place, for all of them"
    )
    assert a.read_text() == b.read_text() == "from apex import amp\n"
    clean = tmp_path / "clean.py"  # nothing to change: not reported
    clean.write_text("import torch\n")
    os.link(clean, tmp_path / "clean2.py")
    assert migrate_file(str(clean)).error is None
    out = migrate_file(str(a), write_hard_links=True)
    assert out.written and out.error is None
    assert a.read_text() == b.read_text() == "from fp16kit.legacy import amp\n"
    assert os.path.samefile(a, b)


def test_read_only_files_are_left_unless_asked(tmp_path):
    # a 0444 file was rewritten (root ignores permission bits; so did the atomic replace)
    path = tmp_path / "train.py"
    path.write_text("from apex import amp\n")
    path.chmod(0o444)
    out = migrate_file(str(path))
    assert not out.written and out.error == "read-only (mode 0444): --write-read-only rewrites it, keeping the mode"
    assert path.read_text() == "from apex import amp\n"
    assert migrate_file(str(path), write=False).changed  # a dry run says it would change
    out = migrate_file(str(path), write_read_only=True)
    assert out.written and path.read_text() == "from fp16kit.legacy import amp\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o444


@pytest.mark.parametrize("how", ["in place", "replaced", "same size"])
@pytest.mark.parametrize("links", [False, True])
def test_an_edit_saved_while_migrating_is_not_overwritten(tmp_path, monkeypatch, how, links):
    # an editor saved the file between migrate's read and its write: the save was lost
    path = tmp_path / "train.py"
    path.write_text("from apex import amp\n")
    if links:
        os.link(path, tmp_path / "other.py")
    real = files.migrate_source
    saved = {
        "in place": "from apex import amp\nx = 1\n",
        "replaced": "from apex import amp  # edited\n",
        "same size": "from apex import AMP\n",
    }[how]

    def editor_saves_meanwhile(source, **kwargs):
        result = real(source, **kwargs)
        if how == "replaced":  # most editors: a new file renamed over the old one
            (tmp_path / "new").write_text(saved)
            os.replace(tmp_path / "new", path)
        else:
            stamp = path.stat()
            path.write_text(saved)
            if how == "same size":  # same size and mtime (a coarse clock): only the content tells
                os.utime(path, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
        return result

    monkeypatch.setattr(files, "migrate_source", editor_saves_meanwhile)
    out = migrate_file(str(path), write_hard_links=links)
    assert not out.written and out.error == files.CHANGED_WHILE_MIGRATING
    assert path.read_text() == saved
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.py", "train.py"][not links :]  # no temporary file left


def _deep(terms):
    return "import apex\nx = " + " + ".join(["a"] * terms) + "\n"


def test_files_the_parser_cannot_handle_are_reported_not_raised(tmp_path, monkeypatch):
    # each used to stop the run with a traceback
    cases = {
        "deep.py": _deep(400),  # valid: RecursionError at python's default recursion limit
        "parens.py": "import apex\nx = " + "(" * 180 + "1" + ")" * 180 + "\n",
        "escape.py": "import apex\nx = '\\d'\n",  # under -W error: SyntaxError from a DeprecationWarning
        "nul.py": "import apex\nx = 1\ny = 'a\0b'\n",  # python refuses it too
        "deeper.py": _deep(3000),
    }
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
    import warnings

    monkeypatch.setattr(files, "_DEEP_RECURSION", 3000)  # deep.py still fits; deeper.py does not
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # `python -W error`
        out = {name: migrate_file(str(tmp_path / name)) for name in cases}
    for name in ("deep.py", "parens.py", "escape.py"):
        assert out[name].written and out[name].error is None, (name, out[name].error)
        assert (tmp_path / name).read_text() == cases[name].replace("import apex", "import fp16kit.legacy")
    assert out["nul.py"].error_line == 3 and out["nul.py"].error.startswith("cannot parse: a NUL byte")
    assert out["deeper.py"].error.startswith("cannot parse: nested too deeply for the parser")
    for name in ("nul.py", "deeper.py"):
        assert not out[name].written and (tmp_path / name).read_text() == cases[name]

    def broken(source, **kwargs):
        raise KeyError("no such node")

    monkeypatch.setattr(files, "migrate_source", broken)  # whatever else the parser raises
    out = migrate_file(str(tmp_path / "deep.py"))
    assert out.error == "cannot migrate: KeyError: 'no such node' (rewrite its apex imports by hand)"


def test_a_file_over_the_size_limit_is_not_read(tmp_path, monkeypatch):
    # a 2 MB generated file took > 120 s and 4.6 GB to parse
    path = tmp_path / "generated_pb2.py"
    body = "from apex import amp\n" + "# " + "x" * 78 + "\n"
    path.write_text(body * (files.DEFAULT_MAX_SIZE // len(body) + 1))
    size = path.stat().st_size
    assert size > files.DEFAULT_MAX_SIZE

    def must_not_parse(source, **kwargs):
        raise AssertionError("parsed a file over the size limit")

    monkeypatch.setattr(files, "migrate_source", must_not_parse)
    out = migrate_file(str(path))
    assert not out.written and out.error == (
        f"{size} bytes, over the {files.DEFAULT_MAX_SIZE}-byte limit (a generated file?), not read: --max-size BYTES "
        "raises the limit"
    )
    monkeypatch.undo()
    small = tmp_path / "small.py"
    small.write_text("from apex import amp\n" + "# padding\n" * 10)
    assert migrate_file(str(small), max_size=100).error.startswith("121 bytes, over the 100-byte limit")
    assert migrate_file(str(small), max_size=121).written
