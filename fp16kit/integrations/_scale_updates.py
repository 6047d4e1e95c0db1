"""One ``scaler.update()`` per iteration, whatever the number of optimizers: the rule the
framework adapters share.

torch.amp's loop is ``scaler.scale(loss).backward(); scaler.step(opt_a); scaler.step(opt_b);
scaler.update()``. A framework hook sees only one optimizer's step at a time and cannot know
whether another optimizer will step on the same grads, so an update run after each step would
make the next optimizer unscale with a scale that changed already (x2 on growth, x0.5 on
backoff: its update off by that factor). Instead each step marks the update as owed
(:meth:`OwedUpdate.owe`), and the owed update runs once (:meth:`OwedUpdate.settle`) at the next
point that needs the new scale: right after the step once every optimizer sharing the scaler
has stepped (:meth:`OwedUpdate.stepped`; a single optimizer updates after each step, as
before), else at the next backward (before ``scaler.scale``), and before the scale is saved
(checkpoint save, teardown). With a backward per optimizer (the GAN
pattern: ``backward(loss_d); opt_d.step(); backward(loss_g); opt_g.step()``) the update runs at
the second backward, exactly where an update after each step put it.

The skipped-step flag of a step is known before the update (``scaler.last_step_skipped_tensor()``
answers for the iteration's checked grads), so settling later changes no skipped-step signal.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .. import GradScaler

__all__ = ["OwedUpdate"]


class OwedUpdate:
    """Whether a ``scaler.update()`` is owed for steps taken since the last one (main thread)."""

    def __init__(self) -> None:
        self.owed = False
        self._round: set[int] = set()  # id(opt) stepped since every optimizer last had its turn
        self._known: set[int] = set()  # id(opt) seen stepping (used when the caller has no list)

    def owe(self) -> None:
        """A step ran: the iteration's update is owed (run by :meth:`settle`)."""
        self.owed = True

    def stepped(self, scaler: GradScaler | None, optimizer: Any, optimizers: Iterable[Any] | None = None) -> None:
        """``optimizer`` stepped (or skipped its step). The update is owed; it runs now once every
        optimizer sharing the scaler -- ``optimizers``, or (None: Fabric, which shows the plugin
        no list) those seen stepping before the last settled update -- has stepped since the
        last full round. One optimizer: after each step, as before (Fabric: from the second
        iteration); one backward and two optimizers: after the second; so the scale read after
        an iteration is the updated one. Otherwise it waits for :meth:`settle`."""
        self.owe()
        self._round.add(id(optimizer))
        members = self._known if optimizers is None else {id(o) for o in optimizers}
        if members and members <= self._round:
            self._settle_round(scaler)

    def settle(self, scaler: GradScaler | None) -> bool:
        """Run the owed update, if any, once; True if it ran."""
        if not self.owed:
            return False
        self._known |= self._round
        if self._known <= self._round:
            self._round.clear()
        self.owed = False
        if scaler is not None and scaler.is_enabled():
            scaler.update()
        return True

    def _settle_round(self, scaler: GradScaler | None) -> None:
        self._known |= self._round
        self._round.clear()
        self.owed = False
        if scaler is not None and scaler.is_enabled():
            scaler.update()

    def forget(self) -> None:
        """Drop the debt without updating (the scaler's state was replaced)."""
        self.owed = False
