"""One ``scaler.update()`` per iteration, however many optimizers step: the rule the framework adapters share.

torch.amp's loop::

    scaler.scale(loss).backward()                  # (several backwards: several losses, or accumulation)
    scaler.unscale_(a); clip(a); scaler.step(a)
    if it % k == 0: scaler.unscale_(b); clip(b); scaler.step(b)
    scaler.update()                                # once, after every optimizer that steps on these grads

A framework hook sees one optimizer's step at a time and not the user's ``if``: it cannot tell
whether another optimizer will still step on the same grads. An update between two such steps
makes the second unscale with a scale that changed already (x2 on growth, x0.5 on back-off: its
grads, clipped norm and update off by that factor). So a step never updates by itself; it makes
the update *owed* (:meth:`OwedUpdate.stepped`), and the owed update runs once
(:meth:`OwedUpdate.settle`) at the first of:

* the iteration boundary: the next backward that follows a step, before its ``scaler.scale``
  (a backward that follows no step -- gradient accumulation, a second loss -- owes nothing);
* right after a step, when every optimizer that may step on this backward's grads has stepped
  since the last update (the ``sharing`` the adapter names: Lightning's and Accelerate's
  optimizers, Fabric's that own a param holding a grad);
* a point that needs the next iteration's scale: a checkpoint save or load, the end of training
  (teardown), the end of a Lightning training batch, an explicit ``settle_scale()``.

The steps since the last update are the iteration's; an update (however it was reached) starts
the next iteration with none, so a step never counts towards an iteration it did not belong to.
With a backward per optimizer (``backward(loss_d); opt_d.step(); backward(loss_g);
opt_g.step()``) the update runs at the second backward: each backward with its steps is an
iteration, as in torch.amp's loop with an update after each step.

The second point is not needed for the numbers (the first and third would do): it keeps what is
read after an iteration. Without it a one-optimizer loop -- the HF Trainer's, most Accelerate and
Fabric loops -- would read ``scaler.get_scale()`` one update behind torch.amp's loop after every
step, and a scaler saved by itself (``{"scaler": plugin.scaler}``) would hold the scale before
the update. With it, every iteration in which all optimizers stepped ends updated; one in which
some did not is updated at the next of the other points (Lightning: the end of the batch;
elsewhere read the scale after ``settle_scale()``). A settle called between two
optimizers' steps on one backward runs the update there, as torch.amp's ``update()`` would: the
later step then unscales with the new scale and owes an update of its own.

The skipped-step flag of a step is known before the update (``scaler.last_step_skipped_tensor()``
answers for the iteration's checked grads), so settling later changes no skipped-step signal.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .. import GradScaler

__all__ = ["OwedUpdate"]


class OwedUpdate:
    """The ``scaler.update()`` owed by the optimizer steps since the last one (main thread)."""

    def __init__(self) -> None:
        self._stepped: set[int] = set()  # id(opt) stepped (or step skipped) since the last update

    def stepped(self, scaler: GradScaler | None, optimizer: Any, sharing: Iterable[Any] | None) -> None:
        """Record that ``optimizer`` stepped (or its step was skipped): the update is owed.

        ``optimizer`` stepped (or its step was skipped): the update is owed. ``sharing``: every
        optimizer that may step on this backward's grads, or None where they are not known. If
        all of them have stepped since the last update, no step can need this iteration's scale
        any more and the update runs now; else it waits for :meth:`settle`."""
        self._stepped.add(id(optimizer))
        if sharing is not None and {id(o) for o in sharing} <= self._stepped:
            self.settle(scaler)

    def settle(self, scaler: GradScaler | None) -> bool:
        """Run the owed update, if any, once; the next step starts a new iteration. True if it ran."""
        if not self._stepped:
            return False
        if scaler is not None and scaler.is_enabled():
            scaler.update()  # first: if it raises, the update is still owed and a retry runs it
        self._stepped.clear()
        return True
