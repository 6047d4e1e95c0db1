"""OptimizerThread: FIFO, futures, errors, shutdown, exit."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
import traceback

import pytest

import fp16kit
from fp16kit.core.thread import OptimizerThread, current_optimizer_thread, optimizer_thread


@pytest.fixture
def thread():
    t = OptimizerThread()
    yield t
    t.shutdown(wait=True, timeout=10)


def test_strict_fifo_under_load(thread):
    out: list[int] = []
    futures = []
    for i in range(2000):
        if i % 100 == 0:
            futures.append(thread.submit(time.sleep, 0.001))  # jobs of uneven length
        futures.append(thread.submit(out.append, i))
    thread.synchronize()
    assert out == list(range(2000))
    assert all(f.done() for f in futures)


def test_results_and_the_worker_identity(thread):
    fut = thread.submit(lambda a, b=0: (a + b, thread.on_optimizer_thread(), current_optimizer_thread()), 2, b=3)
    assert thread.wait(fut) == (5, True, thread)
    assert not thread.on_optimizer_thread() and current_optimizer_thread() is None


def _fails():
    raise ValueError("job failed here")


def test_an_error_is_raised_once_at_the_next_call_with_its_traceback(thread):
    thread.submit(_fails)
    time.sleep(0.05)
    with pytest.raises(ValueError, match="job failed here") as info:
        thread.submit(lambda: None)
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "_fails" in frames  # the original traceback, from the worker
    thread.synchronize()  # reported once: nothing more to raise
    assert thread.wait(thread.submit(lambda: 42)) == 42  # the worker keeps serving


def test_synchronize_raises_a_pending_error(thread):
    thread.submit(_fails)
    with pytest.raises(ValueError, match="job failed here"):
        thread.synchronize()
    thread.synchronize()


def test_waiting_on_the_failed_job_reports_it(thread):
    fut = thread.submit(_fails)
    with pytest.raises(ValueError):
        thread.wait(fut)
    thread.submit(lambda: None)  # already reported: no second raise
    thread.synchronize()


def test_idle_means_every_submitted_job_finished(thread):
    assert thread.idle()
    release = threading.Event()
    fut = thread.submit(release.wait, 30)
    assert not thread.idle()
    release.set()
    thread.wait(fut)
    assert thread.idle()


def test_a_job_may_submit_inline(thread):
    fut = thread.submit(lambda: thread.wait(thread.submit(lambda: "inner")))
    assert thread.wait(fut) == "inner"


def test_shutdown_drains_and_refuses_new_work():
    out = []
    with OptimizerThread() as t:
        for i in range(50):
            t.submit(out.append, i)
    assert out == list(range(50))
    with pytest.raises(RuntimeError, match="shut down"):
        t.submit(out.append, 99)
    t.shutdown()  # idempotent


def test_the_default_thread_is_shared():
    assert optimizer_thread() is optimizer_thread() is fp16kit.optimizer_thread()
    assert isinstance(fp16kit.OptimizerThread(), fp16kit.OptimizerThread)


def test_jobs_run_beside_the_caller(thread):
    started = threading.Event()
    release = threading.Event()
    fut = thread.submit(lambda: (started.set(), release.wait(5)))
    assert started.wait(5)  # the job runs while this thread goes on
    assert not fut.done()
    release.set()
    thread.wait(fut)


def _run(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    root = os.path.dirname(os.path.dirname(os.path.abspath(fp16kit.__file__)))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
        timeout=timeout, env=dict(os.environ, PYTHONPATH=root),
    )


def test_pending_jobs_are_drained_at_exit(tmp_path):
    out = tmp_path / "out.txt"
    r = _run(f"""
        import time, fp16kit
        t = fp16kit.optimizer_thread()
        def job(i):
            time.sleep(0.02)
            with open({str(out)!r}, "a") as f:
                f.write(f"{{i}}\\n")
        for i in range(20):
            t.submit(job, i)
        # exit at once, with the jobs pending
    """)
    assert r.returncode == 0, r.stderr
    assert out.read_text().split() == [str(i) for i in range(20)]


def test_a_hanging_job_cannot_hang_exit():
    start = time.perf_counter()
    r = _run("""
        import time, fp16kit, fp16kit.core.thread as th
        th.EXIT_TIMEOUT_S = 1.0
        fp16kit.optimizer_thread().submit(time.sleep, 600)
    """)
    assert r.returncode == 0
    assert time.perf_counter() - start < 30
    assert "still running" in r.stderr


def test_an_uncollected_error_is_logged_at_exit():
    r = _run("""
        import fp16kit
        def bad():
            raise KeyError("lost")
        fp16kit.optimizer_thread().submit(bad)
    """)
    assert r.returncode == 0
    assert "never collected" in r.stderr and "KeyError" in r.stderr
