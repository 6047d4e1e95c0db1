"""`fp16kit run` as a user types it: a subprocess each (kept few), compared with plain python."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

import fp16kit
from fp16kit.cli import main

ROOT = pathlib.Path(fp16kit.__file__).resolve().parent.parent
ENV = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


def _python(*args, cwd=None):
    r = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=ENV, cwd=cwd, timeout=120)
    # torch without numpy warns at import (two lines); the script itself does not import torch
    err = "".join(
        line for line in r.stderr.splitlines(keepends=True) if "NumPy" not in line and "_conversion_method" not in line
    )
    return r.returncode, r.stdout, err


@pytest.mark.slow
def test_same_argv_output_traceback_and_exit_code_as_python(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
        import sys
        print(__name__, sys.argv[1:])
        def fail():
            raise RuntimeError("stop at " + sys.argv[-1])
        if sys.argv[-1] == "raise":
            fail()
        sys.exit(int(sys.argv[-1]))
        """
        )
    )
    for last in ("5", "raise"):
        args = [str(script), "--lr", "3", "-m", "--megatron", last]
        assert _python("-m", "fp16kit", "run", *args) == _python(*args)
    code, out, err = _python("-m", "fp16kit", "run", str(script), "--lr", "3", "raise")
    assert (code, out) == (1, "__main__ ['--lr', '3', 'raise']\n")
    assert err.startswith(f'Traceback (most recent call last):\n  File "{script}", line 7, in <module>\n')


@pytest.mark.slow
def test_apex_script_and_module_and_spawned_child(tmp_path):
    (tmp_path / "job.py").write_text(
        textwrap.dedent(
            """
        import multiprocessing as mp
        import sys
        from apex import amp  # the spawned child runs this again, as __mp_main__

        def work(queue):
            import apex.optimizers
            queue.put(apex.optimizers.__name__)

        if __name__ == "__main__":
            ctx = mp.get_context("spawn")
            queue = ctx.Queue()
            child = ctx.Process(target=work, args=(queue,))
            child.start()
            print(amp.__name__, queue.get(timeout=60), sys.argv[1:])
            child.join()
            sys.exit(child.exitcode)
        """
        )
    )
    code, out, err = _python("-m", "fp16kit", "run", "-m", "job", "--x", cwd=tmp_path)
    assert (code, out) == (0, "fp16kit.legacy.amp fp16kit.legacy.optimizers ['--x']\n"), err
    code, out, err = _python("-m", "fp16kit", "run", str(tmp_path / "job.py"), cwd=tmp_path)
    assert code == 0, err
    code, out, err = _python(str(tmp_path / "job.py"))  # plain python has no apex
    assert code == 1 and "No module named 'apex'" in err


def test_usage_errors(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["run"])
    assert e.value.code == 2 and "SCRIPT" in capsys.readouterr().err
    assert main(["run", str(tmp_path / "missing.py")]) == 2
    assert "fp16kit run: can't open file" in capsys.readouterr().err
    assert main(["run", "-m", "no_such_module_here"]) == 1
    assert "No module named no_such_module_here" in capsys.readouterr().err


def test_script_arguments_pass_through_untouched(tmp_path, capsys):
    script = tmp_path / "s.py"
    script.write_text("import sys\nprint(sys.argv[1:])\n")
    assert main(["run", "--", str(script), "--shadow", "-h", "--", "x"]) == 0
    assert capsys.readouterr().out == "['--shadow', '-h', '--', 'x']\n"
    assert main(["run", str(script), "--help"]) == 0
    assert capsys.readouterr().out == "['--help']\n"


def test_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "migrate" in out and "run " in out
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = capsys.readouterr().out
    assert "fp16kit run [-h] [--megatron] [--shadow] (SCRIPT | -m MODULE | -c COMMAND | -) [ARGS ...]" in out
    assert "exit status" in out


@pytest.mark.slow
def test_the_scripts_logging_setup_works_as_under_python(tmp_path):
    # HF-style scripts call logging.basicConfig(level=INFO, format=...): with the command line's own
    # root handler still there it did nothing (the INFO lines vanished, the format was fp16kit's)
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
        import logging
        logging.basicConfig(format="%(levelname)s|%(name)s|%(message)s", level=logging.INFO)
        logging.getLogger(__name__).info("***** Running training *****")
        logging.getLogger("fp16kit").warning("Gradient overflow.")
        """
        )
    )
    expected = (0, "", "INFO|__main__|***** Running training *****\nWARNING|fp16kit|Gradient overflow.\n")
    assert _python(str(script)) == expected
    assert _python("-m", "fp16kit", "run", str(script)) == expected
    # a script that configures nothing: fp16kit's warnings print as python's last-resort handler prints them
    script.write_text("import logging\nlogging.getLogger('fp16kit').warning('Gradient overflow.')\n")
    assert _python("-m", "fp16kit", "run", str(script)) == _python(str(script)) == (0, "", "Gradient overflow.\n")


@pytest.mark.slow
def test_threads_and_atexit_handlers_still_see_the_script_after_its_last_line(tmp_path):
    # the script's __main__ and the alias were put back when its body ended: a non-daemon thread or
    # an atexit handler then failed to pickle the script's classes (and to import apex)
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
        import atexit, pickle, threading, time
        class Checkpoint:
            pass
        def save():
            time.sleep(0.2)
            from apex import amp
            print("thread", len(pickle.dumps(Checkpoint())) > 0, amp.__name__)
        atexit.register(lambda: print("atexit", len(pickle.dumps(Checkpoint())) > 0))
        threading.Thread(target=save).start()
        """
        )
    )
    code, out, err = _python("-m", "fp16kit", "run", str(script))
    assert (code, out) == (0, "thread True fp16kit.legacy.amp\natexit True\n"), err


def test_c_and_stdin_as_python_runs_them(capsys, monkeypatch):
    # `fp16kit run -c ...` was "unrecognized arguments: -c", and `fp16kit run -` "can't open file '-'"
    code = "import sys; from apex import amp; print(sys.argv, repr(sys.path[0]), amp.__name__); sys.exit(5)"
    assert main(["run", "-c", code, "--lr", "3"]) == 5
    assert capsys.readouterr().out == "['-c', '--lr', '3'] '' fp16kit.legacy.amp\n"
    assert main(["run", "-c", "x = ("]) == 1
    err = capsys.readouterr().err
    assert err.startswith('  File "<string>", line 1\n') and "SyntaxError" in err
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO("import sys\nprint(sys.argv, __file__)\nraise ValueError('no')\n"))
    assert main(["run", "-", "a"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "['-', 'a'] <stdin>\n"
    assert 'File "<stdin>", line 3, in <module>' in captured.err and captured.err.endswith("ValueError: no\n")
    with pytest.raises(SystemExit):
        main(["run", "-m", "-c", "x"])


@pytest.mark.slow
def test_beside_a_new_apex_only_what_it_lacks_is_fp16kit(tmp_path):
    # NVIDIA apex >= 25.x (NGC containers): apex.contrib.xentropy, apex.optimizers, ... but no amp or
    # fp16_utils. `fp16kit run` refused it (exit 2) unless --shadow, which hid the real apex entirely
    site = tmp_path / "site"
    (site / "apex" / "contrib" / "xentropy").mkdir(parents=True)
    (site / "apex" / "optimizers").mkdir()
    (site / "apex" / "__init__.py").write_text("REAL = True\n")
    (site / "apex" / "contrib" / "__init__.py").write_text("")
    (site / "apex" / "contrib" / "xentropy" / "__init__.py").write_text("class SoftmaxCrossEntropyLoss:\n    pass\n")
    (site / "apex" / "optimizers" / "__init__.py").write_text("class FusedAdam:\n    MARKER = 'real'\n")
    (tmp_path / "train.py").write_text(
        textwrap.dedent(
            """
        import multiprocessing as mp
        import apex
        from apex import amp
        from apex.contrib.xentropy import SoftmaxCrossEntropyLoss
        from apex.optimizers import FusedAdam

        def work(queue):
            import apex.fp16_utils
            queue.put((apex.REAL, apex.fp16_utils.__name__, apex.optimizers.FusedAdam.MARKER))

        if __name__ == "__main__":
            ctx = mp.get_context("spawn")
            queue = ctx.Queue()
            child = ctx.Process(target=work, args=(queue,))
            child.start()
            print(apex.REAL, amp.__name__, apex.amp.initialize.__module__, FusedAdam.MARKER,
                  SoftmaxCrossEntropyLoss.__module__, queue.get(timeout=60))
            child.join()
        """
        )
    )
    env = dict(ENV, PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]))
    run = [sys.executable, "-m", "fp16kit", "run"]
    r = subprocess.run([*run, "train.py"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout == (
        "True fp16kit.legacy.amp fp16kit.legacy.amp.frontend real apex.contrib.xentropy "
        "(True, 'fp16kit.legacy.fp16_utils', 'real')\n"
    )
    # --shadow keeps its meaning: all of apex is fp16kit's, the real one is hidden
    r = subprocess.run(
        [
            *run,
            "--shadow",
            "-c",
            "import apex, apex.optimizers; print(hasattr(apex, 'REAL'), apex.optimizers.__name__)",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert (r.returncode, r.stdout) == (0, "False fp16kit.legacy.optimizers\n"), r.stderr
