"""The loss scaler: :class:`GradScaler` (torch's API) and its binding to an optimizer thread.

- :mod:`.grad_scaler` -- ``GradScaler``: scale, unscale_, step, update, state dicts; speaks the
  scaler <-> master-weight optimizer protocol (:mod:`fp16kit.core.protocol`).
- :mod:`.binding` -- a scaler whose steps run on an :class:`~fp16kit.OptimizerThread` (mode 2 of
  docs/async.md): the per-iteration records and the one-iteration lag.
"""

from .grad_scaler import GradScaler, OptState

__all__ = ["GradScaler", "OptState"]
