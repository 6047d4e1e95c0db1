"""After a second Ctrl-C abandons a mode-2 call waiting for a step in flight, ``load_state_dict`` recovers at once.

Found by the adversarial pass: the job in flight hit the broken mark on the optimizer thread and
failed, so the first ``load_state_dict`` re-raised that error (fixed: the mark refuses on the main
thread only; a job queued before the break runs to its end).

The user presses Ctrl-C twice while ``opt.submit_step()`` (or ``opt.synchronize()``, or
``opt.state_dict()``: a checkpoint being *read*) waits for the previous step job, which is
slow. The hold is abandoned (ABANDONED note, handler and grad mode restored: fine) and the
optimizer is marked broken (interrupts.py ``commit``'s ``on_abandon``). The step job still in
flight then calls ``scaler.step(opt)`` on the optimizer thread, where the mark refuses it
(interrupts.py ``call``: the ``_BROKEN`` check runs off the main thread too) -- a healthy
job is killed -- and the scaler's queued update job fails in turn ("No inf checks were
recorded"). Both errors stay pending on the thread. Then:

* ``opt.load_state_dict(saved)`` waits for the step (optimizer.py ``load_state_dict`` ->
  ``wait_for_step``), re-raises the pending error -- which is the text "A second Ctrl-C broke
  off optimizer.submit_step() half way ... Restore it from the last checkpoint
  (load_state_dict)" -- and, as a refused load, puts the mark back;
* ``scaler.load_state_dict(saved)`` re-raises the update job's "No inf checks were recorded
  prior to update()" (grad_scaler.py ``load_state_dict`` -> ``ScalerThreads.load``, which
  waits for the jobs first).

Called a second time each succeeds and training goes on bit for bit, so the errors are only
ones the recovery should have consumed: the load the message prescribes is refused with
that very message.
"""

from __future__ import annotations

import copy
import signal
import threading
import time

import pytest
import torch
from torch import nn

from fp16kit import GradScaler, MixedPrecisionOptimizer
from fp16kit.core.interrupts import ABANDONED


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).to(torch.float16)


def _loss(model, i):
    g = torch.Generator().manual_seed(100 + i)
    return model(torch.randn(3, 4, generator=g).to(torch.float16)).float().pow(2).mean()


def _world(threads):
    model = _net()
    opt = MixedPrecisionOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2), thread=threads())
    return model, opt, GradScaler("cpu", init_scale=2.0**8, growth_interval=1)


def _iterate(model, opt, scaler, steps):
    for i in steps:
        opt.zero_grad()
        scaler.scale(_loss(model, i)).backward()
        opt.submit_step(lambda: (scaler.step(opt), opt.zero_grad()), scaler=scaler)
        scaler.update()


def _state(model, opt, scaler):
    opt.synchronize()
    return [p.detach().clone() for p in model.parameters()], scaler.state_dict(), opt.state_dict()


def _equal(a, b):
    leaves_a, leaves_b = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    assert len(leaves_a) == len(leaves_b)
    for x, y in zip(leaves_a, leaves_b):
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y


def _ctrl_c_twice_then_finish(scaler, opt, waiting):
    """The slow step job: the user presses Ctrl-C twice while the main thread waits for it."""
    main = threading.main_thread().ident
    waiting.wait(10)
    time.sleep(0.2)  # the main thread is in the call's wait by now
    signal.pthread_kill(main, signal.SIGINT)
    time.sleep(0.1)
    signal.pthread_kill(main, signal.SIGINT)
    time.sleep(0.3)  # the main thread has raised ABANDONED by now
    scaler.step(opt)
    opt.zero_grad()


WAITS = {
    "submit_step": lambda m, o, s: o.submit_step(lambda: (s.step(o), o.zero_grad()), scaler=s),
    "synchronize": lambda m, o, s: o.synchronize(),
    "state_dict": lambda m, o, s: o.state_dict(),
}


@pytest.mark.parametrize("waiting_in", list(WAITS))
def test_load_state_dict_recovers_at_the_first_try_after_a_second_ctrl_c(threads, waiting_in):
    if threading.current_thread() is not threading.main_thread() or not callable(signal.getsignal(signal.SIGINT)):
        pytest.skip("needs the main thread and Python's SIGINT handler")
    model, opt, scaler = _world(threads)
    _iterate(model, opt, scaler, range(6))
    reference = _state(model, opt, scaler)

    model, opt, scaler = _world(threads)
    _iterate(model, opt, scaler, range(2))
    saved = copy.deepcopy((opt.state_dict(), model.state_dict(), scaler.state_dict()))
    opt.zero_grad()
    scaler.scale(_loss(model, 2)).backward()
    waiting = threading.Event()
    opt.submit_step(lambda: _ctrl_c_twice_then_finish(scaler, opt, waiting), scaler=scaler)
    scaler.update()
    if waiting_in == "submit_step":
        opt.zero_grad()
        scaler.scale(_loss(model, 3)).backward()
    with pytest.raises(KeyboardInterrupt) as info:
        waiting.set()
        WAITS[waiting_in](model, opt, scaler)
    assert any(n.startswith(ABANDONED.split("{what}")[0]) for n in info.value.__notes__)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert torch.is_grad_enabled()
    time.sleep(0.6)  # the slow job has run (and been refused) by now

    # The recovery the ABANDONED note and the refusal ask for: each load must work at once.
    failures = []
    for what, load in (
        ("opt", lambda: opt.load_state_dict(copy.deepcopy(saved[0]))),
        ("model", lambda: model.load_state_dict(saved[1])),
        ("scaler", lambda: scaler.load_state_dict(copy.deepcopy(saved[2]))),
    ):
        try:
            load()
        except RuntimeError as e:  # a second call would succeed
            failures.append(f"{what}.load_state_dict: {str(e).splitlines()[0][:90]}")
            load()
    _iterate(model, opt, scaler, range(2, 6))
    _equal(_state(model, opt, scaler), reference)  # holds (after the retried loads)
    assert failures == []  # fails: opt's "A second Ctrl-C broke off ...", scaler's "No inf checks ..."
