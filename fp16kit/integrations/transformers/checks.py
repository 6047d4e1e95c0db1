"""The checks of :class:`~fp16kit.integrations.transformers.MasterWeightsTrainer`, run before anything changes.

The checks of :class:`~fp16kit.integrations.transformers.MasterWeightsTrainer`, run before
the Trainer (or its accelerator) is built or a checkpoint is loaded, so a refused call changes
nothing: the TrainingArguments and the model it can train "O2 style", and the checkpoints it
can resume."""

from __future__ import annotations

import os
from typing import Any

from .._requires import require

require("transformers", extra="transformers", tested=("5.24", "5.25"))

import torch  # noqa: E402
import transformers.trainer as _trainer_module  # noqa: E402
from transformers.trainer_utils import get_last_checkpoint  # noqa: E402

from ...core.master import LOW_PRECISION  # noqa: E402
from ...master_weights.optimizer import MixedPrecisionOptimizer  # noqa: E402
from .._common import find_master_optimizer  # noqa: E402
from ..accelerate.checks import DTYPES  # noqa: E402

__all__ = ["DTYPES", "casts_model", "check_arguments", "check_checkpoint"]


def check_checkpoint(checkpoint: str | bool | None, output_dir: str | None) -> None:
    """Refuse a checkpoint whose optimizer.pt is a plain torch optimizer's state (no masters)."""
    if checkpoint is True and output_dir is not None and os.path.isdir(output_dir):
        checkpoint = get_last_checkpoint(output_dir)
    if isinstance(checkpoint, os.PathLike):
        checkpoint = os.fspath(checkpoint)
    if not isinstance(checkpoint, str):
        return  # None, False, or True with no checkpoint: the Trainer's own handling
    path = os.path.join(checkpoint, _trainer_module.OPTIMIZER_NAME)
    if not os.path.isfile(path):
        return  # save_only_model, or not a checkpoint: the Trainer's own handling
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # unreadable here: the Trainer's own load reports it
        return
    if isinstance(state, dict) and "param_groups" in state and "masters" not in state:
        raise ValueError(
            f"{checkpoint} was saved by transformers.Trainer: its optimizer.pt holds no fp32 master "
            "weights, so MasterWeightsTrainer cannot resume it. Finish that run with "
            "transformers.Trainer, or start a new MasterWeightsTrainer run from its weights "
            "(model=AutoModel...from_pretrained(checkpoint), train() without resume_from_checkpoint: "
            "a new optimizer state and LR schedule)."
        )


def casts_model(model: torch.nn.Module | None, dtype: torch.dtype) -> bool:
    """Does the accelerator cast the model? Not one given with params in ``dtype`` already."""
    return model is None or not any(p.dtype == dtype for p in model.parameters())


def check_arguments(bound: dict[str, Any], *, async_step: bool, master_device: Any, master_dtype: torch.dtype) -> str:
    """Every refusal of the module docstring, before the Trainer is built; returns "fp16"/"bf16"."""
    args = bound.get("args")
    if args is None or bool(args.fp16) == bool(args.bf16):
        raise ValueError(
            "MasterWeightsTrainer trains fp16 or bf16 weights with fp32 masters: pass "
            "TrainingArguments(fp16=True) or TrainingArguments(bf16=True) (exactly one). For fp32 "
            "training or autocast, use transformers.Trainer."
        )
    mixed_precision = "fp16" if args.fp16 else "bf16"
    dtype = DTYPES[mixed_precision]
    if args.deepspeed:
        raise ValueError(
            "MasterWeightsTrainer does not combine with DeepSpeed, which keeps its own fp32 master "
            "weights and loss scaler: drop `deepspeed` from the TrainingArguments, or use "
            "transformers.Trainer with DeepSpeed's fp16/bf16 config."
        )
    if args.fsdp:
        raise ValueError(
            "MasterWeightsTrainer does not combine with FSDP, whose sharded params would get "
            "redundant fp32 masters: drop `fsdp`, or use transformers.Trainer with FSDP's "
            "MixedPrecisionPolicy (see fp16kit's README, 'Use with FSDP2')."
        )
    if "lomo" in str(args.optim).lower():
        raise ValueError(
            f"MasterWeightsTrainer cannot use optim={args.optim!r}: LOMO fuses the update into "
            "backward, so there is no optimizer step to run on fp32 masters. Choose another optim."
        )
    other_eval = "bf16_full_eval" if mixed_precision == "fp16" else "fp16_full_eval"
    if getattr(args, other_eval):
        raise ValueError(
            f"{other_eval}=True would cast the {mixed_precision} weights being trained to another "
            f"dtype in place; the model already evaluates in {mixed_precision}: drop {other_eval}."
        )
    if args.n_gpu > 1:
        raise ValueError(
            "MasterWeightsTrainer does not support nn.DataParallel (several GPUs in one process): "
            "launch with torchrun for DDP, or set CUDA_VISIBLE_DEVICES to one GPU."
        )
    model = bound.get("model")
    full_eval = f"{mixed_precision}_full_eval"
    if getattr(args, full_eval) and model is not None and not casts_model(model, dtype):
        kept = sorted({str(p.dtype) for p in model.parameters() if p.dtype != dtype})
        if kept:
            raise ValueError(
                f"{full_eval}=True would cast the model's {', '.join(kept)} params (kept as given, "
                f"e.g. _keep_in_fp32_modules) to {mixed_precision} in place at evaluation: drop "
                f"{full_eval} (the model evaluates in the dtypes it trains in)."
            )
    if model is not None:
        if isinstance(model, (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)):
            raise TypeError(
                f"MasterWeightsTrainer got a model wrapped in {type(model).__name__}: pass the "
                "unwrapped model; the Trainer wraps it for distributed training itself."
            )
        other = set(LOW_PRECISION) - {dtype}
        wrong = sorted({str(p.dtype) for p in model.parameters() if p.dtype in other})
        if wrong:
            raise ValueError(
                f"The model has {', '.join(wrong)} parameters but the TrainingArguments ask for "
                f"{mixed_precision}: set {'bf16' if mixed_precision == 'fp16' else 'fp16'}=True, or "
                "give the model in float32 (it is cast when training starts)."
            )
    optimizer = (bound.get("optimizers") or (None, None))[0]
    user_built = find_master_optimizer(optimizer)
    if user_built is not None and model is not None and casts_model(model, dtype):
        # Built before the cast: it steps the model's own params (no masters), which
        # the trainer is about to cast to fp16/bf16.
        ids = {id(p) for p in model.parameters() if p.dtype not in LOW_PRECISION}
        if any(id(p) in ids for g in user_built.param_groups for p in g["params"]):
            raise ValueError(
                f"The MixedPrecisionOptimizer was built on the float32 model, so it keeps no fp32 masters "
                f"of the params the trainer casts to {mixed_precision}: pass the plain optimizer, "
                "optimizers=(torch.optim.AdamW(model.parameters(), ...), scheduler) -- the trainer wraps "
                f"it --, or cast the model first (model.to({dtype})) and build the "
                "MixedPrecisionOptimizer on it."
            )
    if isinstance(user_built, MixedPrecisionOptimizer):
        if async_step or master_device is not None or master_dtype != torch.float32:
            raise ValueError(
                "The optimizer is already a MixedPrecisionOptimizer, which fixes async_step, "
                "master_device and master_dtype: set them on it, not on MasterWeightsTrainer "
                "(or pass the plain optimizer and let the trainer wrap it)."
            )
    return mixed_precision
