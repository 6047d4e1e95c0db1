"""The argument checks of :class:`~fp16kit.integrations.accelerate.MasterWeightsAccelerator`.

Run before Accelerate's (process-global) state is touched, so a refused call changes nothing."""

from __future__ import annotations

from .._requires import require

require("accelerate", extra="accelerate", tested=("1.15", "1.16"))

import os  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from accelerate.utils import DistributedType, GradScalerKwargs  # noqa: E402

from ... import GradScaler, MixedPrecisionOptimizer  # noqa: E402

__all__ = ["DTYPES", "SUPPORTED_TYPES", "check_arguments", "check_user_built", "launched_precision"]

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
UNSUPPORTED_KWARGS = ("deepspeed_plugin", "fsdp_plugin", "megatron_lm_plugin", "torch_tp_plugin", "parallelism_config")
UNSUPPORTED_ENV = ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP", "ACCELERATE_USE_MEGATRON_LM")
SUPPORTED_TYPES = (
    DistributedType.NO,
    DistributedType.MULTI_CPU,
    DistributedType.MULTI_GPU,
    DistributedType.MULTI_XPU,
    DistributedType.MULTI_NPU,
    DistributedType.MULTI_MLU,
    DistributedType.MULTI_MUSA,
    DistributedType.MULTI_HPU,
)


def launched_precision(mixed_precision: str | None) -> str:
    """The mixed precision to train in: the argument, else ``accelerate launch``'s, else "fp16".

    The argument if given; else ``accelerate launch``'s ``--mixed_precision`` / accelerate
    config (``ACCELERATE_MIXED_PRECISION``, as ``Accelerator()`` reads it), "fp16" when that is
    unset or "no" (this class trains in half precision)."""
    if mixed_precision is not None:
        return mixed_precision
    launched = os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    if launched in ("no", ""):
        return "fp16"
    if launched not in DTYPES:
        raise ValueError(
            f"MasterWeightsAccelerator: ACCELERATE_MIXED_PRECISION={launched!r} (accelerate launch "
            "--mixed_precision or your accelerate config) is not 'fp16' or 'bf16': launch with "
            "--mixed_precision fp16/bf16, or pass MasterWeightsAccelerator(mixed_precision=...)."
        )
    return launched


def check_arguments(mixed_precision: Any, scaler: Any, kwargs: dict[str, Any]) -> torch.dtype:
    """Everything that can be checked before Accelerate's (global) state is touched."""
    if str(mixed_precision) not in DTYPES:
        raise ValueError(
            f"MasterWeightsAccelerator(mixed_precision={mixed_precision!r}): use 'fp16' or 'bf16' (the dtype "
            "the model is cast to). For fp8 or fp32 autocast training use accelerate.Accelerator."
        )
    dtype = DTYPES[str(mixed_precision)]
    if scaler is not None and dtype is torch.bfloat16:
        raise ValueError("bf16 needs no loss scaling: drop scaler= (bf16 has fp32's exponent range).")
    if scaler is not None and not isinstance(scaler, GradScaler):
        raise TypeError(
            f"scaler must be an fp16kit.GradScaler (got {type(scaler).__name__}): torch's GradScaler "
            "cannot unscale into fp32 master weights."
        )
    handlers = kwargs.get("kwargs_handlers") or []
    if scaler is not None and any(isinstance(h, GradScalerKwargs) for h in handlers):
        raise ValueError("Pass either scaler= or a GradScalerKwargs handler, not both.")
    for name in UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise ValueError(
                f"MasterWeightsAccelerator does not support {name}: DeepSpeed, FSDP and Megatron-LM "
                "keep their own fp32 params and loss scaling. Use accelerate.Accelerator with that "
                "plugin's mixed precision, or DDP with this class."
            )
    for name in UNSUPPORTED_ENV:
        if os.environ.get(name, "false").lower() == "true":
            raise ValueError(
                f"MasterWeightsAccelerator does not support {name}=true (set by `accelerate launch` "
                "or your accelerate config): DeepSpeed, FSDP and Megatron-LM keep their own fp32 params "
                "and loss scaling. Launch with a multi-GPU/CPU (DDP) config."
            )
    return dtype


def check_user_built(optimizer: MixedPrecisionOptimizer, options: dict[str, Any]) -> None:
    if options["async_step"] or options["master_device"] is not None or options["master_dtype"] != torch.float32:
        # (the user-built optimizer is used as is: these options would be silently ignored)
        raise ValueError(
            "The optimizer is already a MixedPrecisionOptimizer, which fixes async_step, master_device "
            "and master_dtype: set them on it, not on MasterWeightsAccelerator -- or pass the plain "
            "torch optimizer to accelerator.prepare() (it wraps it with the accelerator's options)."
        )
    low = [p for g in optimizer.param_groups for p in g["params"] if p.dtype in (torch.float16, torch.bfloat16)]
    if low:
        raise TypeError(
            "This MixedPrecisionOptimizer steps fp16/bf16 params directly (it was built before the "
            "model was cast, so they got no masters): pass the plain torch optimizer to "
            "accelerator.prepare() (it wraps it), or cast the model before building the "
            "MixedPrecisionOptimizer."
        )
