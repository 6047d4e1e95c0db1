"""A Ctrl-C held during a commit that raises after it changed state says the call is over (RAISED).

Found by the adversarial pass: it got no note, so the user repeated a call that was done (fixed:
the RAISED note).

``hold_interrupts.__exit__`` (fp16kit/core/interrupts.py, the restore line and ``_deliver``'s
``done = exc_type is None``) assumes "a call that raises changes nothing, so it may be
repeated". ``GradScaler.update()`` with ``on_min_scale="raise"`` breaks that: it clears the
per-optimizer states and completes the scale update, *then* raises FloatingPointError
(fp16kit/core/floor.py "after the update that found it completed"; grad_scaler.py update:
states cleared before ``self._loss_scale.update``). With a SIGINT held in it, the user gets a
KeyboardInterrupt whose ``__context__`` is the FloatingPointError and which has no COMPLETED
note: ``completed(e) is None`` says "nothing changed, repeat the call" -- and the repeated
``update()`` fails with "No inf checks were recorded prior to update." (the skip was counted
once, the iteration's flags are gone). An interrupt before the commit (the first few call
events) is fine: the repeat raises the FloatingPointError, as an uninterrupted call does.
"""

from __future__ import annotations

import torch

import fp16kit
from _helpers.interrupt import sigint_at
from fp16kit.core.interrupts import completed


def _scaler_at_its_floor_with_an_overflow():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).half()
    opt = fp16kit.MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = fp16kit.GradScaler("cpu", init_scale=2.0, min_scale=2.0, on_min_scale="raise", growth_interval=100)
    (scaler.scale(model(torch.ones(1, 3).half()).float().sum()) * float("inf")).backward()
    scaler.step(opt)
    return scaler


def test_ctrl_c_in_an_update_that_raises_at_the_floor_never_asks_to_repeat_a_done_update() -> None:
    bad = []
    n = 1
    while True:
        scaler = _scaler_at_its_floor_with_an_overflow()
        out = sigint_at(n, scaler.update, on="call")  # only where a real SIGINT can land
        if not out.fired:
            break
        assert isinstance(out.error, KeyboardInterrupt), (n, out.error)
        if completed(out.error) is None:  # "nothing changed": the user repeats update()
            try:
                scaler.update()
            except FloatingPointError:
                pass  # what the uninterrupted call raises: the repeat is the same call
            except AssertionError as e:  # "No inf checks were recorded prior to update."
                bad.append((n, type(out.error.__context__).__name__, str(e)))
        n += 1
    assert n > 10
    # fails: ~49 points, each (n, 'FloatingPointError', 'No inf checks were recorded prior to update.')
    assert bad == [], f"{len(bad)} interrupt points; first: {bad[:1]}"
