"""apex's messages: the lines apex printed, and its type messages told per device.

**apex's printed lines** (the amp banner and option listing, "Gradient overflow.  Skipping
step, ..." and the other skip lines, FP16_Optimizer's ingestion lines, apex's "Warning:  ..."
lines) go to the logger ``"fp16kit.apex"`` (:data:`apex_logger`), never to the ``fp16kit``
logger, which carries fp16kit's own notes. It is set up at import as apex's ``print``:

    handler     one :class:`CurrentStdoutHandler`: ``%(message)s`` (apex's text, no level or
                name) written to ``sys.stdout`` as it is at the time of the line, as ``print``
                writes (``contextlib.redirect_stdout`` and pytest's ``capsys`` see it)
    propagate   False: the lines never reach the root logger, so a script's own logging setup
                (DeepLearningExamples' ``%(rank)s`` formats with a filter on the root logger,
                handlers that expect fields only the script's records carry) sees none of them
    level       INFO: the banner and ingestion lines are INFO, skip and warning lines WARNING;
                lines apex printed only when asked (Megatron's ``verbose=False``) are DEBUG

Whether a line is emitted at all follows apex's own switches first (amp's ``verbosity``,
FP16_Optimizer's ``verbose``). Beyond them, after importing fp16kit (or apex, under
``fp16kit run``), the standard ``logging`` calls control it::

    logging.getLogger("fp16kit.apex").setLevel(logging.WARNING)  # no banner; skip lines stay
    logging.getLogger("fp16kit.apex").disabled = True            # nothing at all
    lg = logging.getLogger("fp16kit.apex")                       # into the script's logging:
    lg.handlers.clear(); lg.propagate = True                     #   its handlers, its format

(``logging.config.dictConfig`` disables loggers that exist before it runs unless given
``disable_existing_loggers=False``; this one is no exception.)

**Type messages.** apex accepted CUDA tensors only, so its texts name ``torch.cuda.*`` types.
fp16kit also runs on the CPU, where those names would send the reader the wrong way; there the
same message names the dtypes fp16kit accepts instead.
"""

from __future__ import annotations

import logging
import sys

import torch

__all__ = ["APEX_LOGGER", "CurrentStdoutHandler", "apex_logger", "float_or_half", "float_type"]

APEX_LOGGER = "fp16kit.apex"


class CurrentStdoutHandler(logging.Handler):
    """A logging handler that writes each record to the current ``sys.stdout``, as ``print`` does.

    Writes each record to ``sys.stdout`` as it is when the record is handled, as ``print``
    does (a ``StreamHandler`` would keep the stream it was given at import)."""

    terminator = "\n"

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
            stream = sys.stdout
            if stream is not None:  # pythonw: no console, print() drops it too
                stream.write(text + self.terminator)
        except RecursionError:
            raise
        except Exception:
            self.handleError(record)


def _set_up(name: str) -> logging.Logger:
    log = logging.getLogger(name)
    if not any(isinstance(h, CurrentStdoutHandler) for h in log.handlers):  # once per process
        handler = CurrentStdoutHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.propagate = False
        log.setLevel(logging.INFO)
    return log


apex_logger = _set_up(APEX_LOGGER)
"""The ``"fp16kit.apex"`` logger (see the module docstring)."""


def float_or_half(t: torch.Tensor) -> str:
    """What apex's "must be either ..." messages list for ``t``'s device."""
    if t.is_cuda:
        return "torch.cuda.FloatTensor or torch.cuda.HalfTensor"
    return "float32, float16 or bfloat16 tensors (CPU or CUDA)"


def float_type(t: torch.Tensor) -> str:
    """The fp32 tensor type apex expected, named for ``t``'s device."""
    return "torch.cuda.FloatTensor" if t.is_cuda else "torch.FloatTensor"
