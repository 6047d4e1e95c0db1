"""fp16kit run's runner, in process: what the script sees, exit codes, tracebacks, and a clean
interpreter afterwards."""

from __future__ import annotations

import os
import sys
import textwrap

import pytest

from fp16kit.legacy.apex_alias.finder import apex_alias_installed
from fp16kit.migrate.runner import RunError, run_module, run_script


@pytest.fixture
def script(tmp_path):
    def write(body: str, name: str = "train.py"):
        path = tmp_path / name
        path.write_text(textwrap.dedent(body))
        return str(path)

    return write


@pytest.fixture(autouse=True)
def clean_interpreter():
    argv, path, main = list(sys.argv), list(sys.path), sys.modules["__main__"]
    yield
    assert sys.argv == argv and sys.path == path and sys.modules["__main__"] is main
    assert not apex_alias_installed()
    assert not [m for m in sys.modules if m.partition(".")[0] in ("apex", "amp_C", "fp16")]


def test_the_script_sees_what_python_would_give_it(script, capsys):
    path = script(
        """
        import os, sys, pickle
        import apex
        from apex.fp16_utils import FP16_Optimizer

        class Point:  # defined in __main__: must pickle as python's would
            pass

        assert pickle.loads(pickle.dumps(Point())).__class__ is Point
        print(__name__, __file__, sys.argv[1:], sys.path[0], FP16_Optimizer.__module__, apex.amp.__name__)
        """
    )
    assert run_script(path, ["--lr", "3", "-m", "x"]) == 0
    out = capsys.readouterr().out.split()
    assert out == [
        "__main__",
        path,
        "['--lr',",
        "'3',",
        "'-m',",
        "'x']",
        os.path.dirname(os.path.realpath(path)),
        "fp16kit.legacy.fp16_optimizer",
        "fp16kit.legacy.amp",
    ]


def test_relative_script_path_as_python_gives_it(script, tmp_path, monkeypatch, capsys):
    # since python 3.9: __file__ absolute, sys.argv[0] as typed, tracebacks with the absolute name
    script("import sys\nprint(__file__, sys.argv[0])\nraise KeyError('k')\n", name="rel.py")
    monkeypatch.chdir(tmp_path)
    assert run_script("rel.py", []) == 1
    captured = capsys.readouterr()
    assert captured.out == f"{tmp_path / 'rel.py'} rel.py\n"
    assert f'File "{tmp_path / "rel.py"}", line 3, in <module>' in captured.err


@pytest.mark.parametrize(
    "body,code,stderr",
    [
        ("pass", 0, ""),
        ("import sys; sys.exit()", 0, ""),
        ("import sys; sys.exit(3)", 3, ""),
        ("raise SystemExit(0)", 0, ""),
        ("import sys; sys.exit('bad flags')", 1, "bad flags\n"),
    ],
)
def test_exit_codes(script, capsys, body, code, stderr):
    assert run_script(script(body), []) == code
    assert capsys.readouterr().err == stderr


def test_traceback_starts_in_the_script(script, capsys):
    path = script(
        """
        def inner():
            raise ValueError("boom")

        inner()
        """
    )
    assert run_script(path, []) == 1
    err = capsys.readouterr().err
    assert err == (
        "Traceback (most recent call last):\n"
        f'  File "{path}", line 5, in <module>\n'
        "    inner()\n"
        f'  File "{path}", line 3, in inner\n'
        '    raise ValueError("boom")\n'
        "ValueError: boom\n"
    )


def test_keyboard_interrupt_is_130(script, capsys):
    assert run_script(script("raise KeyboardInterrupt"), []) == 130
    assert capsys.readouterr().err.endswith("KeyboardInterrupt\n")


def test_syntax_error_reported_like_python(script, capsys):
    assert run_script(script("x = (\n"), []) == 1
    err = capsys.readouterr().err
    assert "SyntaxError" in err and "runpy" not in err and "fp16kit" not in err


def test_uncovered_import_names_fp16kit_and_the_replacement(script, capsys):
    assert run_script(script("from apex import RNN\n"), []) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):\n")
    assert "ImportError: No module named 'apex.RNN' under fp16kit's apex alias" in err and "torch.nn.LSTM" in err


def test_megatron_flag(script, capsys):
    path = script("from fp16 import FP16_Optimizer\nprint(FP16_Optimizer.__module__)\n")
    assert run_script(path, []) == 1
    assert "No module named 'fp16'" in capsys.readouterr().err
    assert run_script(path, [], megatron=True) == 0
    assert capsys.readouterr().out.startswith("fp16kit.legacy.megatron")


def test_cannot_start(script, tmp_path):
    with pytest.raises(RunError, match="can't open file") as e:
        run_script(str(tmp_path / "missing.py"), [])
    assert e.value.exit_code == 2
    path = script("import apex\n")
    for sub in ("", "amp", "fp16_utils"):  # a vendored apex before 25.x beside the script: not needed
        (tmp_path / "apex" / sub).mkdir(exist_ok=True)
        (tmp_path / "apex" / sub / "__init__.py").write_text("")
    with pytest.raises(RunError, match="real module named 'apex'.*do not need the alias") as e:
        run_script(path, [])
    assert e.value.exit_code == 2
    assert run_script(path, [], shadow=True) == 0


def test_a_vendored_apex_without_amp_is_complemented(script, tmp_path, capsys):
    # apex >= 25.x copied beside the script: its own modules are used, fp16kit's fill in amp
    path = script("import apex\nfrom apex import amp\nprint(apex.VENDORED, amp.__name__, apex.amp is amp)\n")
    (tmp_path / "apex").mkdir()
    (tmp_path / "apex" / "__init__.py").write_text("VENDORED = True\n")
    try:
        assert run_script(path, []) == 0
        assert capsys.readouterr().out == "True fp16kit.legacy.amp True\n"
        assert not hasattr(sys.modules["apex"], "amp")  # taken off again
    finally:
        sys.modules.pop("apex", None)


def test_run_module(tmp_path, monkeypatch, capsys):
    (tmp_path / "trainer.py").write_text(
        "import sys\nfrom apex import amp\nprint(__name__, sys.argv[1:])\nsys.exit(4)\n"
    )
    monkeypatch.chdir(tmp_path)
    assert run_module("trainer", ["--epochs", "2"]) == 4
    assert capsys.readouterr().out == "__main__ ['--epochs', '2']\n"
    with pytest.raises(RunError, match="No module named nothing_here") as e:
        run_module("nothing_here", [])
    assert e.value.exit_code == 1
    with pytest.raises(RunError, match="torch.nn.LSTM"):
        run_module("apex.RNN", [])


def test_run_module_errors_read_as_python_m_does(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "nomain").mkdir()
    (tmp_path / "nomain" / "__init__.py").write_text("")
    # python -m nomain: one line, exit 1 (was runpy's chained ImportError traceback)
    with pytest.raises(RunError) as e:
        run_module("nomain", [])
    assert str(e.value) == "No module named nomain.__main__; 'nomain' is a package and cannot be directly executed"
    assert e.value.exit_code == 1
    # an import failing inside the package: python shows where (was one line without file or line)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "__init__.py").write_text("x = 1\nfrom apex.contrib import xentropy\n")
    (tmp_path / "broken" / "train.py").write_text("print('never')\n")
    assert run_module("broken.train", []) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):\n")
    assert f'File "{tmp_path / "broken" / "__init__.py"}", line 2, in <module>' in err
    assert "torch.nn.functional.cross_entropy" in err and "runpy" not in err
    # a runpy call inside the module's own code is the module's error: a traceback, not a RunError
    (tmp_path / "launcher.py").write_text("import runpy\nrunpy.run_module('no_such_module_at_all')\n")
    assert run_module("launcher", []) == 1
    assert "ImportError: No module named no_such_module_at_all" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["folder", "zip"])
def test_a_folder_or_zip_file_runs_its_main_from_an_absolute_sys_path_entry(tmp_path, monkeypatch, capsys, kind):
    # runpy.run_path put a relative entry first on sys.path (twice): after an os.chdir() the script's
    # own modules no longer imported (python's entry is absolute, and there only once)
    import zipfile

    app = tmp_path / "app"
    app.mkdir()
    (app / "__main__.py").write_text(
        "import os, sys\nfrom apex import amp\n"
        "print(sys.argv, sys.path.count(sys.path[0]), os.path.isabs(sys.path[0]), __file__ == os.path.abspath(__file__))\n"
        "os.chdir(os.path.dirname(os.getcwd()))\nimport helper\nhelper.boom()\n"
    )
    (app / "helper.py").write_text("def boom():\n    raise SystemExit(6)\n")
    target = "app"
    if kind == "zip":
        with zipfile.ZipFile(tmp_path / "app.zip", "w") as z:
            z.write(app / "__main__.py", "__main__.py")
            z.write(app / "helper.py", "helper.py")
        target = "app.zip"
    monkeypatch.chdir(tmp_path)
    assert run_script(target, ["--x"]) == 6
    assert capsys.readouterr().out == f"['{target}', '--x'] 1 True True\n"
    (tmp_path / "empty").mkdir()
    os.chdir(tmp_path)  # the script moved away (monkeypatch puts the original back at the end)
    with pytest.raises(RunError) as e:
        run_script("empty", [])
    assert str(e.value) == f"can't find '__main__' module in {str(tmp_path / 'empty')!r}" and e.value.exit_code == 1


def test_restore_false_leaves_the_scripts_main_and_the_alias(script, monkeypatch):
    # what the command line asks for: its process ends with the script
    from multiprocessing import spawn

    from fp16kit.legacy.apex_alias.finder import uninstall_apex_alias

    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setitem(sys.modules, "__main__", sys.modules["__main__"])
    monkeypatch.setattr(spawn, "get_preparation_data", spawn.get_preparation_data)  # put back at teardown
    path = script("import apex\nclass C:\n    pass\n")
    try:
        assert run_script(path, ["--x"], restore=False) == 0
        assert sys.modules["__main__"].__file__ == path and hasattr(sys.modules["__main__"], "C")
        assert apex_alias_installed() and sys.argv == [path, "--x"]
    finally:
        uninstall_apex_alias()
