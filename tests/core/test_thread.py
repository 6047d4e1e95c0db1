"""OptimizerThread: FIFO, futures, errors delivered once, steps, shutdown, exit."""

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
import fp16kit.core.thread as thread_module
from fp16kit.core.thread import (
    JobFuture,
    OptimizerThread,
    current_optimizer_thread,
    optimizer_thread,
    step_serial,
    threads_with_steps_since,
)


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
    thread.wait_idle()  # the job has failed; waiting idle does not deliver its error
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
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, PYTHONPATH=root),
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
        def bad(what):
            raise KeyError(what)
        t = fp16kit.optimizer_thread()
        t.submit(bad, "seen").exception()  # delivered: not logged
        t.submit(bad, "lost")
    """)
    assert r.returncode == 0
    assert r.stderr.count("never collected") == 1 and "KeyError: 'lost'" in r.stderr
    assert "seen" not in r.stderr


# ---------------------------------------------------------------------- shutdown races
def test_submit_racing_shutdown_never_strands_a_future():
    # Short thread slices, so that the shutdown lands among the submitters' calls rather than
    # after a whole 5 ms slice of them (and the rounds stay fast).
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    try:
        for _ in range(200):
            _race_submitters_against_shutdown()
    finally:
        sys.setswitchinterval(interval)


def _race_submitters_against_shutdown() -> None:
    t = OptimizerThread()
    go = threading.Barrier(3)
    submitting = threading.Event()
    accepted: list[JobFuture] = []
    refused: list[RuntimeError] = []

    def submitter() -> None:
        go.wait()
        for i in range(100_000):  # until the shutdown refuses one (bounded all the same)
            try:
                accepted.append(t.submit(int, i))
            except RuntimeError as e:
                refused.append(e)
                return
            submitting.set()

    submitters = [threading.Thread(target=submitter) for _ in range(3)]
    for s in submitters:
        s.start()
    assert submitting.wait(10)
    t.shutdown(wait=False)  # while they submit
    for s in submitters:
        s.join()
    t.shutdown(wait=True, timeout=10)  # the worker has drained everything it accepted
    assert all(f.done() for f in accepted)
    assert len(refused) == 3 and all("shut down" in str(e) for e in refused)


def test_a_submit_paused_inside_enqueue_by_a_shutdown_is_refused_or_runs(monkeypatch):
    """The deterministic form of the race: the submitter is paused inside enqueue (where it
    records the caller's CUDA event) while shutdown() runs to its end."""
    t = OptimizerThread()
    paused, release = threading.Event(), threading.Event()
    record_event = thread_module._record_event

    def pausing_record_event():
        paused.set()
        release.wait(10)
        return record_event()

    monkeypatch.setattr(thread_module, "_record_event", pausing_record_event)
    outcome: list[object] = []

    def submitter() -> None:
        try:
            outcome.append(t.submit(int, 7))
        except RuntimeError as e:
            outcome.append(e)

    s = threading.Thread(target=submitter)
    s.start()
    assert paused.wait(10)
    closer = threading.Thread(target=t.shutdown, kwargs={"wait": False})
    closer.start()
    closer.join(1.0)  # returns at once unless shutdown waits for the enqueue (also correct)
    release.set()
    s.join(10)
    closer.join(10)
    t.shutdown(wait=True, timeout=10)
    [result] = outcome
    assert isinstance(result, RuntimeError) or (result.done() and result.result() == 7)


def test_closed_is_a_read_only_property():
    t = OptimizerThread()
    assert not t.closed and "running" in repr(t)
    t.shutdown()
    assert t.closed and t._closed and "closed" in repr(t)
    with pytest.raises(AttributeError):
        t.closed = False  # type: ignore[misc]
    with pytest.raises(RuntimeError, match="shut down"):
        t.enqueue(int)


def test_the_default_thread_is_recreated_after_shutdown():
    old = optimizer_thread()
    old.shutdown()
    new = optimizer_thread()
    assert new is not old and not new.closed


# ---------------------------------------------------------------------- errors, once
def _deliver_by_result(thread, fut):
    with pytest.raises(ValueError, match="job failed here"):
        fut.result()


def _deliver_by_exception(thread, fut):
    assert isinstance(fut.exception(), ValueError)


def _deliver_by_wait(thread, fut):
    with pytest.raises(ValueError, match="job failed here"):
        thread.wait(fut)


def _deliver_by_another_submit(thread, fut):
    thread.wait_idle()  # the job failed; the next submit (of any caller) raises it
    with pytest.raises(ValueError, match="job failed here"):
        thread.submit(int)


def _deliver_by_raise_pending_error(thread, fut):
    thread.wait_idle()
    with pytest.raises(ValueError, match="job failed here"):
        thread.raise_pending_error()


def _deliver_by_synchronize(thread, fut):
    with pytest.raises(ValueError, match="job failed here"):
        thread.synchronize()


@pytest.mark.parametrize(
    "deliver",
    [
        _deliver_by_result,
        _deliver_by_exception,
        _deliver_by_wait,
        _deliver_by_another_submit,
        _deliver_by_raise_pending_error,
        _deliver_by_synchronize,
    ],
    ids=lambda f: f.__name__[len("_deliver_by_") :],
)
def test_each_channel_delivers_an_error_once(thread, deliver):
    fut = thread.submit(_fails)
    deliver(thread, fut)
    thread.wait(thread.submit(int))  # neither the next submit nor a wait raises it again
    thread.synchronize()
    thread.raise_pending_error()
    assert thread.wait(fut) is None  # delivered before: wait does not raise it again
    with pytest.raises(ValueError):
        fut.result()  # the Future itself keeps concurrent.futures' semantics


def test_a_loop_that_catches_each_error_goes_on(thread):
    for i in range(5):
        fut = thread.submit(_fails)
        with pytest.raises(ValueError):
            fut.result()
        assert thread.wait(thread.submit(lambda i=i: i)) == i
    thread.synchronize()


def test_errors_are_raised_oldest_first(thread):
    def fails(what):
        raise KeyError(what)

    thread.submit(fails, "first")
    thread.submit(fails, "second")
    thread.wait_idle()
    with pytest.raises(KeyError, match="first"):
        thread.submit(int)
    with pytest.raises(KeyError, match="second"):
        thread.synchronize()
    thread.synchronize()


def test_an_ignored_inline_failure_reaches_the_main_thread(thread):
    thread.submit(lambda: thread.submit(_fails))  # the job drops the inline job's future
    with pytest.raises(ValueError, match="job failed here"):
        thread.synchronize()
    thread.synchronize()


def test_an_error_propagated_through_an_outer_job_is_raised_once(thread):
    fut = thread.submit(lambda: thread.wait(thread.submit(_fails)))
    with pytest.raises(ValueError, match="job failed here"):
        thread.synchronize()
    thread.synchronize()
    assert thread.wait(fut) is None


def test_a_job_waiting_for_a_later_job_raises_instead_of_deadlocking(thread):
    release = threading.Event()
    later: list[JobFuture] = []
    first = thread.submit(lambda: (release.wait(10), thread.wait(later[0])))
    later.append(thread.submit(int))
    release.set()
    with pytest.raises(RuntimeError, match="deadlock"):
        thread.wait(first)
    thread.synchronize()


# ---------------------------------------------------------------------- enqueue, steps
def test_enqueue_does_not_raise_pending_errors_but_submit_does(thread):
    thread.submit(_fails)
    thread.wait_idle()
    fut = thread.enqueue(lambda a, b=0: a + b, (2,), {"b": 3})  # queued: the error stays pending
    assert thread.wait(fut) == 5
    with pytest.raises(ValueError, match="job failed here"):
        thread.submit(int)
    thread.synchronize()


def test_enqueue_from_a_job_runs_inline(thread):
    def job():
        inner = thread.enqueue(current_optimizer_thread)
        return inner.done(), inner.result()

    assert thread.wait(thread.submit(job)) == (True, thread)
    assert thread.submitted == 2


def test_steps_are_counted_per_thread_and_process_wide():
    with OptimizerThread() as a, OptimizerThread() as b:
        before = step_serial()
        assert threads_with_steps_since(before) == []
        a.enqueue(int, step=True)
        a.submit(int)  # not a step
        assert (a.steps, a.submitted, step_serial()) == (1, 2, before + 1)
        assert threads_with_steps_since(before) == [a]
        mid = step_serial()
        a.wait(b.enqueue(lambda: b.enqueue(int, step=True), step=True))  # one queued, one inline
        assert (b.steps, step_serial()) == (2, before + 3)
        assert threads_with_steps_since(mid) == [b]
        assert threads_with_steps_since(before) == [a, b]
        a.shutdown()
        assert threads_with_steps_since(before) == [b]  # a closed thread receives no more steps
    assert threads_with_steps_since(before) == []


# ---------------------------------------------------------------------- Ctrl-C while waiting
def _interrupt_the_first_wait(monkeypatch, fut: JobFuture) -> None:
    """Ctrl-C while the main thread blocks on ``fut``: its first wait raises KeyboardInterrupt."""
    wait = fut._wait_error
    calls = []

    def interrupted() -> BaseException | None:
        calls.append(None)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return wait()

    monkeypatch.setattr(fut, "_wait_error", interrupted)


@pytest.mark.parametrize("waiting", ["wait", "synchronize", "wait_idle"])
def test_ctrl_c_while_waiting_keeps_the_job_tracked(thread, monkeypatch, waiting):
    release = threading.Event()
    ran: list[str] = []

    def job():
        release.wait(10)
        ran.append("ran")
        raise ValueError("failed after the interrupt")

    fut = thread.submit(job)
    _interrupt_the_first_wait(monkeypatch, fut)
    with pytest.raises(KeyboardInterrupt):
        getattr(thread, waiting)(*([fut] if waiting == "wait" else []))
    assert not fut.done() and not thread.idle() and "1 pending" in repr(thread)
    release.set()
    with pytest.raises(ValueError, match="after the interrupt"):
        thread.synchronize()  # still waits for the job, and delivers its error once
    assert ran == ["ran"] and thread.idle()
    thread.synchronize()
    assert thread.wait(fut) is None


@pytest.mark.parametrize("wait", ["wait", "synchronize", "result"])
def test_ctrl_c_at_any_line_of_a_wait_is_a_keyboard_interrupt_and_the_job_stays_tracked(thread, wait):
    # A wait outside fp16kit's holds (a user's own thread.wait), interrupted at every entry into
    # a Python function under it -- where CPython runs a real SIGINT's handler (line events
    # would also fire where it never does, e.g. a `with` line on the way out, before the lock's
    # C __exit__). The waiter sees the KeyboardInterrupt, the job stays tracked, and the thread
    # goes on serving (each round submits and waits again).
    from _helpers.interrupt import sigint_at

    n, hits = 1, 0
    while True:
        fut = thread.submit(time.sleep, 0.02)
        call = {"wait": lambda: thread.wait(fut), "synchronize": thread.synchronize, "result": fut.result}[wait]
        outcome = sigint_at(n, call, on="call")
        if not outcome.fired:
            assert outcome.error is None
            break
        assert isinstance(outcome.error, KeyboardInterrupt), f"line {n}: {outcome.error!r}"
        hits += 1
        assert thread.wait(fut) is None  # still tracked: waiting again gets its result
        thread.synchronize()
        n += 1
    assert hits >= 3
