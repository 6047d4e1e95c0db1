"""fp16kit.master_weights.sides: which side a call runs on, and that each side writes only its own objects."""

from __future__ import annotations

import dataclasses
import threading
from collections import defaultdict

import pytest
import torch

from _helpers import seeded_loss, small_mlp
from fp16kit import GradScaler, MixedPrecisionOptimizer
from fp16kit.master_weights import sides
from fp16kit.master_weights.sides import MainSide, MasterStep, StepJob, SubmittedCall
from fp16kit.master_weights.step_state import StepState


def _opt(threads, **kw):
    model = small_mlp(torch.float16, 0)
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), thread=threads(), **kw)
    return model, opt


def test_the_side_is_the_main_one_the_running_job_or_the_standing_job(threads):
    model, opt = _opt(threads, master_device="cpu")
    seen = {}
    assert opt._async.side() is opt._async.main and opt._async.running() is None

    def job():
        seen["in_job"] = opt._async.side()
        seen["running"] = opt._async.running()
        seen["job_state"] = opt._state()

    seeded_loss(model, 0).backward()
    opt.submit_step(job).result(timeout=10)
    assert isinstance(seen["in_job"], StepJob) and seen["in_job"].in_job and seen["in_job"] is seen["running"]
    assert isinstance(seen["in_job"].work, SubmittedCall)
    assert seen["job_state"] is seen["in_job"].state and seen["job_state"] is not opt._async.main.state
    # on the thread, outside a job of this optimizer: the standing job (no work), the same each time
    outside = [opt.thread.submit(opt._async.side).result(timeout=10) for _ in range(2)]
    assert outside[0] is outside[1] and not outside[0].in_job and outside[0].work is None
    assert outside[0] is not seen["in_job"]
    # another optimizer's running job is not this optimizer's
    model2, opt2 = _opt(threads, master_device="cpu")
    seeded_loss(model2, 1).backward()
    other = opt2.submit_step(opt._async.side).result(timeout=10)
    assert other is not opt2._async.main and not other.in_job
    opt.synchronize()
    opt2.synchronize()


def test_a_job_is_frozen_and_carries_its_arguments_as_one_record(threads):
    model, opt = _opt(threads, async_step=True)
    captured = []
    real = opt._async._jobs.run

    def spy(job):
        captured.append(job)
        return real(job)

    opt._async._jobs.run = spy
    seeded_loss(model, 0).backward()
    opt.step()
    opt.synchronize()
    (job,) = captured
    assert isinstance(job.work, MasterStep) and job.work.handoff is not None and job.owner is opt._async
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.work = None  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.work.found = torch.ones(())  # type: ignore[misc]


@pytest.mark.parametrize("mode", ["async_step", "submit_step", "submit_step_scaler"])
def test_no_field_is_written_by_both_threads(threads, monkeypatch, mode):
    """The structural rule, checked at run time: a MainSide is written on the main thread only,
    and every StepState is moved by one thread only (after it was made)."""
    main = threading.current_thread()
    main_side_writers: set[str] = set()
    state_movers: dict[int, set[str]] = defaultdict(set)
    real_setattr = MainSide.__setattr__
    real_move = StepState._move

    def record_setattr(self, name, value):
        main_side_writers.add(threading.current_thread().name)
        real_setattr(self, name, value)

    def record_move(self, event):
        state_movers[id(self)].add(threading.current_thread().name)
        real_move(self, event)

    monkeypatch.setattr(MainSide, "__setattr__", record_setattr)
    monkeypatch.setattr(StepState, "_move", record_move)
    model, opt = _opt(threads, async_step=mode == "async_step", master_device=None if mode == "async_step" else "cpu")
    scaler = GradScaler("cpu", init_scale=2.0**10)
    for i in range(4):
        if mode == "async_step":
            opt.zero_grad()
            scaler.scale(seeded_loss(model, i)).backward()
            scaler.unscale_(opt) if i % 2 else None
            scaler.step(opt)
            scaler.update()
        elif mode == "submit_step":
            seeded_loss(model, i).backward()
            opt.submit_step(lambda: (opt.clip_grad_norm_(1.0), opt.step(), opt.zero_grad()))
        else:
            scaler.scale(seeded_loss(model, i)).backward()
            opt.submit_step(lambda: (scaler.unscale_(opt), scaler.step(opt), opt.zero_grad()), scaler=scaler)
            scaler.update()
    opt.synchronize()
    scaler.state_dict()
    assert main_side_writers == {main.name}
    assert state_movers, "no step state moved: the test exercised nothing"
    assert all(len(names) == 1 for names in state_movers.values()), dict(state_movers)
    if mode != "async_step":  # the jobs moved their own states, on the optimizer thread
        assert {n for names in state_movers.values() for n in names} == {main.name, opt.thread.name}


def test_the_running_job_is_per_thread():
    job = StepJob(owner=None, work=None)
    seen = []
    with sides.running(job):
        assert sides.running_job() is job
        t = threading.Thread(target=lambda: seen.append(sides.running_job()))
        t.start()
        t.join()
    assert seen == [None] and sides.running_job() is None
