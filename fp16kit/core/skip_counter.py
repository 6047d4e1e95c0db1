"""Counting skipped steps on the device, one device op per update.

Contract: :meth:`SkipCounter.record` takes each update's found-inf flag (a float32 device
tensor, nonzero: the step overflowed and was skipped) without a host sync; the reads answer::

    skipped()          updates whose flag was nonzero, since the counter started
    consecutive()      nonzero flags in a row, up to the last one
    last_found_inf()   the last flag != 0, as a new 0-dim bool device tensor (no sync)

Algorithm: each flag is copied into the next slot of a device buffer of ``HISTORY`` flags
(one op). When the buffer is full, or when a count is read, the ``n`` recorded flags are
folded into two int64 device counters (device ops, no sync)::

    skipped     += number of nonzero flags
    consecutive  = flags after the last zero one, or consecutive + n if all n were nonzero

``record`` may run on the optimizer thread while the main thread reads the counts, so
recording and folding hold one lock.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["SkipCounter"]


class SkipCounter:
    """Skip counts on ``device``, starting from ``skipped`` / ``consecutive``."""

    HISTORY = 64  # updates between two folds

    def __init__(self, device: torch.device | str, *, skipped: int = 0, consecutive: int = 0) -> None:
        self._skipped = torch.full((), skipped, dtype=torch.int64, device=device)
        self._consecutive = torch.full((), consecutive, dtype=torch.int64, device=device)
        self._history = torch.zeros(self.HISTORY, dtype=torch.float32, device=device)
        self._slots = list(self._history.unbind(0))
        self._recorded = 0
        self._last: torch.Tensor | None = None  # the slot of the last flag
        self._lock = threading.RLock()  # (re-entrant: see record)

    def record(self, found_inf: torch.Tensor) -> None:
        """Record one update's flag (one device op; a fold every ``HISTORY`` updates).

        The lock is re-entrant because a second Ctrl-C (which abandons the step: fp16kit.core.interrupts) can land
        where CPython has taken the lock but not yet entered the block, leaving it held: a plain lock then hangs the
        thread's next update (a two-Ctrl-C sweep of amp's handle found it); the holding thread goes on."""
        with self._lock:
            self._last = self._slots[self._recorded]
            self._last.copy_(found_inf)
            self._recorded += 1
            if self._recorded == self.HISTORY:
                self._fold()

    def last_found_inf(self) -> torch.Tensor | None:
        """0-dim bool device tensor: was the last recorded flag nonzero? None before any."""
        return None if self._last is None else self._last != 0

    def skipped(self) -> int:
        """Nonzero flags in total (a host read)."""
        with self._lock:
            self._fold()
            return int(self._skipped.item())

    def consecutive(self) -> int:
        """Nonzero flags in a row, up to the last one (a host read)."""
        with self._lock:
            self._fold()
            return int(self._consecutive.item())

    def _fold(self) -> None:
        # under self._lock
        n = self._recorded
        if n == 0:
            return
        overflow = self._history[:n] != 0
        self._skipped.add_(overflow.sum())
        positions = torch.arange(n, device=overflow.device)
        last_clean = torch.where(overflow, -1, positions).max()
        self._consecutive.copy_(torch.where(last_clean >= 0, n - 1 - last_clean, self._consecutive + n))
        self._recorded = 0
