"""The loss scaler: :class:`GradScaler` (torch's API) and its binding to an optimizer thread.

- :mod:`.grad_scaler` -- ``GradScaler``: scale, unscale_, step, update, state dicts; speaks the
  scaler <-> master-weight optimizer protocol (:mod:`fp16kit.core.protocol`). Its methods read
  like torch's, with one call into the modules below where they do more.
- :mod:`.binding` -- a scaler whose steps run on an :class:`~fp16kit.OptimizerThread` (mode 2 of
  docs/async.md): all of the scaler's thread routing (``ScalerThreads``), the per-iteration
  records and the one-iteration lag (``ThreadBinding``), and the per-thread views of ``_scale``
  and ``_per_optimizer_states``.
- :mod:`.stepping` -- what ``unscale_()`` and ``step()`` do with each kind of optimizer: torch's,
  a master-weight optimizer (also with ``async_step=True``), a fused one (``grad_scale``/``found_inf``).
- :mod:`.checkpoint` -- ``state_dict``, ``load_state_dict``, pickling and copies.
- :mod:`.skips` -- ``found_inf`` over a process group's ranks, and the skip flag.
- :mod:`.fields` -- torch's private attributes (``_scale``, ``_growth_tracker``, ...) as views of
  the :class:`~fp16kit.core.scale.LossScale`.
"""

from .grad_scaler import GradScaler, OptState

__all__ = ["GradScaler", "OptState"]
