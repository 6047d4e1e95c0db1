"""The ``fp16kit`` logger, and messages logged once per process.

fp16kit never prints: its messages go to ``logging.getLogger("fp16kit")``. Notes about how an
apex argument was mapped (an ignored knob, a substituted option) are worth one line per process,
not one per call: :func:`log_once` keeps the keys it has logged.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable

__all__ = ["log_once", "logger"]

logger = logging.getLogger("fp16kit")
_seen: set[Hashable] = set()
_lock = threading.Lock()


def log_once(key: Hashable, message: str, *args: object, level: int = logging.INFO) -> None:
    """Log ``message % args`` at ``level`` the first time ``key`` is seen in this process."""
    with _lock:
        if key in _seen:
            return
        _seen.add(key)
    logger.log(level, message, *args)
