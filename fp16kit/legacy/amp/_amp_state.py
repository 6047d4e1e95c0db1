"""apex.amp._amp_state: the process-wide amp state scripts read, and apex's ``maybe_print`` / ``warn_or_err``.

apex.amp._amp_state: the process-wide amp state scripts read (``_amp_state.loss_scalers``,
``opt_properties``, ``verbosity``, ...), and apex's ``maybe_print`` / ``warn_or_err`` (apex
printed; these write apex's text to the ``fp16kit.apex`` logger, whose handler writes it to
stdout: :mod:`fp16kit.legacy._messages`)."""

from __future__ import annotations

from typing import Any

import torch

from .._messages import apex_logger

__all__ = ["AmpState", "_amp_state", "maybe_print", "warn_or_err", "master_params"]


class AmpState:
    """apex's ``AmpState``: the attributes ``amp.initialize`` sets.

    apex's ``AmpState``: attributes set by ``amp.initialize`` (``opt_properties``,
    ``loss_scalers``, ``verbosity``, ``min_loss_scale``, ``max_loss_scale``; ``handle`` at O1)."""

    # set by amp.initialize (handle: also by amp.init); annotated only, so absent before it as in
    # apex, where scripts test hasattr(_amp_state, "opt_properties")
    opt_properties: Any
    loss_scalers: list[Any]  # amp.scaler.LossScaler objects (that module imports this one)
    min_loss_scale: float | None
    max_loss_scale: float
    handle: Any

    def __init__(self) -> None:
        self.hard_override = False
        self.allow_incoming_model_not_fp32 = False
        self.verbosity = 1

    @property
    def _amp_state(self) -> AmpState:
        """``apex.amp._amp_state._amp_state`` read as an attribute chain (``amp._amp_state`` is
        this object, as in apex's package namespace)."""
        return self


_amp_state = AmpState()


def _is_rank0() -> bool:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank() == 0
    return True


def maybe_print(msg: str, rank0: bool = False) -> None:
    """apex's line ``msg`` at INFO when ``verbosity > 0`` (with ``rank0``, on rank 0 only)."""
    if _amp_state.verbosity > 0 and (not rank0 or _is_rank0()):
        apex_logger.info(msg)


def warn_or_err(msg: str) -> None:
    if _amp_state.hard_override:
        apex_logger.warning("Warning:  " + msg)
    else:
        raise RuntimeError(msg)


def master_params(optimizer: torch.optim.Optimizer) -> Any:
    """Every param of every group of ``optimizer`` (the fp32 masters once amp created them, at O2).

    Every param of every group of ``optimizer``: the fp32 masters once amp created them (O2),
    the model params before (frozen ones included). Clip these after ``scale_loss``."""
    for group in optimizer.param_groups:
        yield from group["params"]
