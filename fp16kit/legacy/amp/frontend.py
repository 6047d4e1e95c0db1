"""apex.amp.frontend: ``initialize``, ``state_dict``, ``load_state_dict`` and the opt levels.

See docs/apex-amp.md §2, §3, §9.

``initialize`` checks everything (levels, overrides, models, optimizers, the scaler settings)
before it changes anything: an error leaves the models, the optimizers and ``_amp_state`` as they
were (apex had reset ``_amp_state.opt_properties`` first). Scaler settings apex took and then
trained into NaN weights, skipped every step with, or failed on at the first ``scale_loss`` are
ValueErrors naming the valid values: ``loss_scale`` other than ``"dynamic"`` or a finite number
> 0, ``num_losses`` other than an int >= 1, a NaN or negative ``min_loss_scale``, a NaN or
non-positive ``max_loss_scale``, a floor above the cap. ``load_state_dict`` refuses, loading
nothing, an entry whose scale is not a finite number > 0 or whose count is not a whole number >= 0.
"""

from __future__ import annotations

import collections
import math
import re
from typing import Any

import torch

from ...core.interrupts import hold_interrupts
from ...core.log import logger
from .._messages import apex_logger
from ..checkpoints.load import scaler_state
from ..loss_scaler import check_saved_scaler
from . import _model, _process_optimizer
from ._amp_state import _amp_state, maybe_print, warn_or_err
from .handle import AmpHandle
from .scaler import LossScaler, refuse_if_broken

__all__ = ["Properties", "initialize", "state_dict", "load_state_dict", "opt_levels"]


class Properties:
    """``_amp_state.opt_properties``: the seven options, with apex's override checks."""

    def __init__(self) -> None:
        self.options = {
            "enabled": False,
            "opt_level": None,
            "cast_model_type": None,
            "patch_torch_functions": False,
            "keep_batchnorm_fp32": None,
            "master_weights": None,
            "loss_scale": 1.0,
        }

    def __getattr__(self, name: str) -> Any:
        options = self.__dict__.get("options")
        if options is not None and name in options:
            return options[name]
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def __setattr__(self, name: str, value: Any) -> None:
        options = self.__dict__.get("options")
        if options is None or name not in options:
            super().__setattr__(name, value)
            return
        if name == "cast_model_type":
            if self.opt_level == "O1" and value is not None and value is not False and value is not torch.float32:
                warn_or_err(
                    "O1 inserts casts around Torch functions rather than model weights, so with O1, "
                    "the model weights themselves should remain FP32. If you wish to cast the model "
                    "to a different type, use opt_level='O2' or 'O3'. " + f"cast_model_type was {value}"
                )
        elif name == "patch_torch_functions":
            if self.opt_level != "O1" and value:
                warn_or_err("Currently, patch_torch_functions=True should only be set by selecting opt_level='O1'.")
        elif name == "keep_batchnorm_fp32":
            if self.opt_level == "O1" and value is not None:
                warn_or_err(
                    "With opt_level O1, batchnorm functions are automatically patched to run in FP32, "
                    "so keep_batchnorm_fp32 should be None." + f" keep_batchnorm_fp32 was {value}"
                )
            if value == "False":
                value = False
            elif value == "True":
                value = True
            else:
                assert value is True or value is False or value is None, (
                    "keep_batchnorm_fp32 must be a boolean, the string 'True' or 'False', "
                    f"or None, found keep_batchnorm_fp32={value}"
                )
        elif name == "master_weights":
            if self.opt_level == "O1" and value is not None:
                warn_or_err(
                    "It doesn't make sense to use master_weights with O1. "
                    "With O1, your model weights themselves should be FP32."
                )
        elif name == "loss_scale":
            if value != "dynamic":
                value = float(value)
        options[name] = value


_LEVELS = {
    "O0": ("O0:  Pure FP32 training.\n", torch.float32, False, None, False, 1.0),
    "O1": (
        "O1:  Insert automatic casts around Pytorch functions and Tensor methods.\n",
        None,
        True,
        None,
        None,
        "dynamic",
    ),
    "O2": (
        "O2:  FP16 training with FP32 batchnorm and FP32 master weights.\n",
        torch.float16,
        False,
        True,
        True,
        "dynamic",
    ),
    "O3": ("O3:  Pure FP16 training.", torch.float16, False, False, False, 1.0),
}
opt_levels = {k: v[0] for k, v in _LEVELS.items()}
"""opt level -> apex's ``brief``."""


def _level_defaults(opt_level: str) -> Properties:
    _, cast, patch, keep_bn, master, scale = _LEVELS[opt_level]
    p = Properties()
    p.enabled = True
    p.opt_level = opt_level
    p.cast_model_type = cast
    p.patch_torch_functions = patch
    p.keep_batchnorm_fp32 = keep_bn
    p.master_weights = master
    p.loss_scale = scale
    return p


def _print_options(p: Properties) -> None:
    for k, v in p.options.items():
        maybe_print(f"{k:22} : {v}", True)


def _as_list(obj: Any, kind: str) -> tuple[list[Any], bool]:
    if kind == "optimizers":
        if isinstance(obj, torch.optim.Optimizer) or type(obj).__name__ == "LARC":
            return [obj], False
        if obj is None:
            return [], False
        if isinstance(obj, list):
            return obj, True
        _check_not_fp16_optimizer([obj])
        raise TypeError("optimizers must be either a single optimizer or a list of optimizers.")
    if isinstance(obj, torch.nn.Module):
        return [obj], False
    if isinstance(obj, list):
        return obj, True
    raise TypeError("models must be either a single model or a list of models.")


def _check_not_fp16_optimizer(optimizers: list[Any]) -> None:
    from ..fp16_optimizer import FP16_Optimizer

    for opt in optimizers:
        if isinstance(opt, FP16_Optimizer) or type(opt).__name__ == "FP16_Optimizer":
            raise RuntimeError(
                "An incoming optimizer is an instance of apex.fp16_utils.FP16_Optimizer. "
                "The optimizer(s) passed to amp.initialize() must be bare \n"
                "instances of either ordinary Pytorch optimizers, or Apex fused \n"
                "optimizers.\n"
            )


def _casts_module() -> Any:
    try:
        from . import casts
    except ImportError as e:
        raise NotImplementedError(
            "opt_level='O1' needs fp16kit.legacy.amp.casts (autocast-based casting), which is not "
            f"available in this build ({e}). Use opt_level='O2' (fp16 model, fp32 master weights) "
            "or torch.autocast with fp16kit.GradScaler."
        ) from None
    return casts


def initialize(
    models: Any,
    optimizers: Any = None,
    enabled: bool = True,
    opt_level: str = "O1",
    cast_model_type: Any = None,
    patch_torch_functions: Any = None,
    keep_batchnorm_fp32: Any = None,
    master_weights: Any = None,
    loss_scale: Any = None,
    cast_model_outputs: Any = None,
    num_losses: int = 1,
    verbosity: int = 1,
    min_loss_scale: float | None = None,
    max_loss_scale: float = 2.0**24,
    *,
    on_min_scale: str = "ignore",
) -> Any:
    """apex's ``amp.initialize`` (docs/apex-amp.md §2): cast the models, patch the optimizers, create the scalers.

    apex's ``amp.initialize`` (docs/apex-amp.md §2): cast the models for ``opt_level``, give the
    optimizers amp's methods, create ``num_losses`` loss scalers. Returns the same objects in
    the structure given.

    ``on_min_scale`` (keyword-only, not in apex): what the dynamic scalers do when overflows keep
    happening with the scale at ``min_loss_scale`` -- ``"ignore"`` (apex: halve and skip
    forever), ``"warn"`` (log a warning) or ``"raise"`` (``FloatingPointError`` at the
    ``scale_loss`` exit; that step is still skipped). ``"warn"``/``"raise"`` need
    ``min_loss_scale``."""
    if not enabled:
        _amp_state.opt_properties = Properties()
        _amp_state.verbosity = verbosity
        return models if optimizers is None else (models, optimizers)
    if opt_level not in _LEVELS:
        raise RuntimeError(
            f"Unexpected optimization level {opt_level}. "
            + "Options are 'O0', 'O1', 'O2', 'O3'.  Note that in `O0`, `O1`, etc., "
            + "the prefix O is the letter O, not the number zero."
        )
    prior_verbosity, _amp_state.verbosity = getattr(_amp_state, "verbosity", 1), verbosity
    try:
        properties = _level_defaults(opt_level)
        maybe_print(f"Selected optimization level {opt_levels[opt_level]}", True)
        maybe_print("Defaults for this optimization level are:", True)
        _print_options(properties)
        maybe_print("Processing user overrides (additional kwargs that are not None)...", True)
        for name, value in (
            ("cast_model_type", cast_model_type),
            ("patch_torch_functions", patch_torch_functions),
            ("keep_batchnorm_fp32", keep_batchnorm_fp32),
            ("master_weights", master_weights),
            ("loss_scale", loss_scale),
        ):
            if value is not None:
                setattr(properties, name, value)
        maybe_print("After processing overrides, optimization options are:", True)
        _print_options(properties)
        model_list, models_was_list = _as_list(models, "models")
        opt_list, optimizers_was_list = _as_list(optimizers, "optimizers")
        _check_not_fp16_optimizer(opt_list)
        _model.check_models(model_list)
        if not getattr(_amp_state, "allow_incoming_model_not_fp32", False):
            _model.check_params(model_list)
        for opt in opt_list:
            _process_optimizer.check_optimizer(opt)
        _check_num_losses(num_losses)
        scalers = [
            LossScaler(
                properties.loss_scale,
                min_loss_scale=min_loss_scale,
                max_loss_scale=max_loss_scale,
                on_min_scale=on_min_scale,
            )
            for _ in range(num_losses)
        ]
        casts = _casts_module() if properties.patch_torch_functions else None
        rules = casts.read_lists() if casts is not None else None  # amp.lists as edited until now
    except BaseException:
        _amp_state.verbosity = prior_verbosity
        raise
    # ---- nothing above changed a model, an optimizer or _amp_state (but verbosity)
    _amp_state.opt_properties = properties
    _amp_state.min_loss_scale = min_loss_scale
    _amp_state.max_loss_scale = max_loss_scale
    if properties.cast_model_type is torch.bfloat16 and properties.loss_scale == "dynamic" and verbosity > 0:
        logger.info(
            "bfloat16 models need no loss scaling (bf16 has fp32's range); the dynamic "
            "scale is kept as requested, set loss_scale=1.0 to drop it."
        )
    _model.cast_models(model_list, properties, cast_model_outputs)
    if properties.cast_model_type and not properties.master_weights:
        for opt in opt_list:  # recast existing state to the params' dtype, as apex
            opt.load_state_dict(opt.state_dict())
    for opt in opt_list:
        _process_optimizer.process_optimizer(opt, properties, casts)
    _amp_state.loss_scalers = scalers
    if properties.master_weights and opt_list:
        for model in model_list:
            model.register_load_state_dict_post_hook(_model.RefreshMastersHook(opt_list))
    if casts is not None:
        device_type = next((p.device.type for m in model_list for p in m.parameters()), "cuda")
        if hasattr(casts, "apply_registrations"):
            casts.apply_registrations()  # amp.register_*_function calls queued before initialize
        casts.enable_o1(device_type, verbose=(verbosity == 2), rules=rules)
        _amp_state.handle = AmpHandle(properties.loss_scale, verbose=(verbosity == 2))
        if hasattr(casts, "clear_cache_after_forward"):
            for model in model_list:
                casts.clear_cache_after_forward(model)
    if optimizers_was_list:
        return (model_list if models_was_list else model_list[0]), opt_list
    if len(opt_list) == 0:
        return model_list if models_was_list else model_list[0]
    return (model_list if models_was_list else model_list[0]), opt_list[0]


def _check_num_losses(num_losses: Any) -> None:
    # apex made that many scalers and failed at the first scale_loss with IndexError (0) or at
    # range() (a float)
    if isinstance(num_losses, bool) or not isinstance(num_losses, int) or num_losses < 1:
        raise ValueError(
            f"num_losses must be an int >= 1 (one loss scaler per loss, picked by "
            f"amp.scale_loss(..., loss_id=i)), got {num_losses!r:.80}."
        )


def state_dict(destination: dict[str, Any] | None = None) -> dict[str, Any]:
    """Return the amp loss scalers' state as plain data (``{}`` before ``initialize``).

    ``{'loss_scaler0': {'loss_scale': float, 'unskipped': int}, ...}`` (plain data); ``{}``
    before ``initialize`` (FIX: apex raised AttributeError).

    A second Ctrl-C that breaks off one of amp's commits (fp16kit.core.interrupts) marks what it
    changed half way: the optimizer (its step, zero_grad, add_param_group, scale_loss's entry and
    exit), until its ``load_state_dict``; and a loss scaler (scale_loss's exit, a step that applies
    the updates ``delay_overflow_check`` deferred, ``update_scale()``, this module's
    ``load_state_dict``), until ``amp.load_state_dict`` restores it. Until then this refuses (a
    checkpoint of half a change), as do ``scale_loss`` and ``optimizer.step()``: RuntimeError
    saying to restore the last checkpoint, as a resumed run does."""
    refuse_if_broken(getattr(_amp_state, "loss_scalers", []))
    if destination is None:
        destination = collections.OrderedDict()
    for idx, scaler in enumerate(getattr(_amp_state, "loss_scalers", [])):
        destination[f"loss_scaler{idx}"] = {"loss_scale": scaler.loss_scale(), "unskipped": scaler._unskipped}
    return destination


_KEY = re.compile(r"^loss_scaler(\d+)$")


def _saved_entry(value: Any, scaler: LossScaler) -> tuple[float, int]:
    """``(loss_scale, unskipped)`` of an entry: amp's dict, or a saved apex scaler in any form
    (e.g. the object ``torch.load(..., weights_only=False)`` makes of one under ``fp16kit
    run``); ValueError saying why for anything else."""
    if isinstance(value, dict) and "loss_scale" in value and "unskipped" in value:
        scale, unskipped = value["loss_scale"], value["unskipped"]
    else:
        check_saved_scaler(value)
        state = scaler_state(value, current=scaler.state_dict())
        scale, unskipped = state["loss_scale"], state["unskipped"]
    # read as apex read them, float() and int(); a scale of NaN, 0 or inf would reach the weights
    # or skip every step, and a negative count never reaches the growth window
    scale_read, count = _as_number(float, scale), _as_number(int, unskipped)
    if scale_read is None or not math.isfinite(scale_read) or scale_read <= 0:
        raise ValueError(f"loss_scale must be a finite number > 0, got {scale!r:.80}.")
    if count is None or count < 0 or count != unskipped:
        raise ValueError(f"unskipped (clean steps counted) must be a whole number >= 0, got {unskipped!r:.80}.")
    return scale_read, count


def _as_number(kind: Any, value: Any) -> Any:
    try:
        return kind(value)
    except (TypeError, ValueError, OverflowError):
        return None


def load_state_dict(state_dict: dict[str, Any]) -> None:
    """Restore the scalers from ``amp.state_dict()``.

    Each ``loss_scaler{i}`` goes to scaler ``i`` (FIX: apex matched by key order); an
    entry may also be a saved apex scaler (its scale and clean-step count are taken).
    Everything is checked before anything changes (FIX: apex applied the first entries,
    then raised)."""
    scalers = getattr(_amp_state, "loss_scalers", [])
    if len(state_dict) != len(scalers):
        apex_logger.warning(
            f"Warning: state_dict contains {len(state_dict)} entries, while {len(scalers)} loss_scalers are used"
        )  # apex printed both lines whatever the verbosity
    unexpected = [k for k in state_dict if "loss_scaler" not in str(k)]
    if unexpected:
        raise RuntimeError(
            "Error(s) in loading state_dict. Unexpected key(s) in state_dict: {}. ".format(
                ", ".join(f'"{k}"' for k in unexpected)
            )
        )
    updates = []
    for key, value in state_dict.items():
        m = _KEY.match(str(key))
        if m is None:
            raise RuntimeError(
                f"Error(s) in loading state_dict. Key {key!r} names no loss scaler: expected "
                "'loss_scaler<index>' as amp.state_dict() writes."
            )
        i = int(m.group(1))
        if i >= len(scalers):
            apex_logger.warning(f"Skipping loss_scaler[{i}], since num_losses was set to {len(scalers)}")
            continue
        try:
            entry = _saved_entry(value, scalers[i])
        except ValueError as e:
            if isinstance(value, dict) and "loss_scale" in value and "unskipped" in value:
                raise RuntimeError(f"Error(s) in loading state_dict. {key!r}: {e} Nothing was loaded.") from e
            raise RuntimeError(
                f"Error(s) in loading state_dict. {key!r} must be a dict with 'loss_scale' and "
                f"'unskipped' (amp.state_dict()'s) or a saved apex scaler, got a {type(value).__name__}: {e}"
            ) from e
        updates.append((scalers[i], *entry))
    what = "amp.load_state_dict()"

    def abandon() -> None:  # a second Ctrl-C broke this off: each scaler may be half restored
        for scaler, _, _ in updates:
            scaler.mark_broken(what)

    with hold_interrupts(what, on_abandon=abandon):
        for scaler, scale, unskipped in updates:  # all checked: now every scaler or none
            scaler._loss_scale = scale
            scaler._unskipped = unskipped
            scaler.restored()  # whole again after a second Ctrl-C broke a call off (see state_dict)
