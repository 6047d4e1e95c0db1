"""The floor policy: what a loss scale does when a step overflows at its ``min_scale``.

At the floor the scaler cannot adapt any more -- the loss is probably not finite at any
scale. ``on_min_scale`` says what then happens:

    "ignore"  nothing (the default)
    "warn"    a warning through logging.getLogger("fp16kit")
    "raise"   FloatingPointError, after the update that found it completed

Contract, without a host sync: :class:`FloorWatch` counts on the device the back-offs that
started at or below the floor (``hits += backed_off and scale <= min_scale``) and reads that
counter back through :class:`LaggedReader`, which never waits for the device: on CPU the
report comes in the same update, on a GPU as soon as the copy has landed (usually by the next
update). Each new hit is reported once.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any, Literal

import torch

__all__ = ["FloorPolicy", "FLOOR_POLICIES", "FloorWatch", "LaggedReader"]

logger = logging.getLogger("fp16kit")

FloorPolicy = Literal["ignore", "warn", "raise"]
FLOOR_POLICIES: tuple[str, ...] = ("ignore", "warn", "raise")


class FloorWatch:
    """Counts overflows at the floor on ``device`` and reports new ones per the policy."""

    def __init__(self, device: torch.device | str) -> None:
        self._hits = torch.zeros((), dtype=torch.int64, device=device)
        self._reader = LaggedReader()
        self._reported = 0

    def count(self, backed_off: torch.Tensor, scale_before: torch.Tensor, min_scale: float) -> None:
        """Device ops only: count a back-off that started at or below ``min_scale``."""
        self._hits.add_(backed_off & (scale_before <= min_scale))
        self._reader.push(self._hits)

    def report(self, policy: str, min_scale: float | None) -> None:
        """Warn or raise for the hits whose count has reached the host since the last report."""
        if policy == "ignore":
            return
        hits = self._reader.poll()
        if hits is None or hits <= self._reported:
            return
        new = hits - self._reported
        self._reported = hits
        msg = (
            f"Gradients overflowed {new} more time(s) with the loss scale already at its floor "
            f"(min_scale={min_scale:g}): the loss is probably exploding, not just "
            "overflowing fp16. Try a lower learning rate, gradient clipping, checking the "
            "inputs for inf/NaN, or training in bfloat16."
        )
        if policy == "raise":
            raise FloatingPointError(msg)
        logger.warning(msg)


class LaggedReader:
    """Reads a small device tensor on the host without ever waiting for the device.

    ``push(t)`` starts a copy of ``t`` into host memory: on CUDA pinned, non-blocking and
    followed by an event; elsewhere a plain copy. ``poll()`` returns the value of the newest
    copy that has landed, or None if none has. Values are counters, so a newer copy
    supersedes the older ones still in flight.
    """

    _MAX_PENDING = 16

    def __init__(self) -> None:
        self._pending: deque[tuple[torch.Tensor, Any]] = deque()

    def push(self, t: torch.Tensor) -> None:
        if t.device.type == "cuda":
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._pending.append((host, event))
        else:
            self._pending.append((t.to("cpu", copy=True), None))
        while len(self._pending) > self._MAX_PENDING:
            self._pending.popleft()

    def poll(self) -> int | None:
        value: int | None = None
        while self._pending:
            host, event = self._pending[0]
            if event is not None and not event.query():
                break
            self._pending.popleft()
            value = int(host.item())  # a landed host copy: no device sync
        return value
