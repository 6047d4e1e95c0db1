"""The demo's training recipes: one function each, written the way README.md and MIGRATION.md tell users to.

Write them (each ``step`` below is a training loop's body, as documentation).

=================  ======  ==================================================================
recipe             face    what it runs
=================  ======  ==================================================================
fp32               torch   the optimizer on a float32 model: the reference
fp16-optimizer     legacy  ``FP16_Optimizer`` on ``network_to_half(model)``, fp32 masters,
                           dynamic loss scale, ``optimizer.backward(loss)`` (apex.fp16_utils)
amp-o2             legacy  ``amp.initialize(model, optimizer, opt_level="O2")``, fp32
                           masters, ``with amp.scale_loss(loss, optimizer)`` (apex.amp)
autocast           modern  fp32 model under ``torch.autocast`` + ``fp16kit.GradScaler``
master-weights     modern  fp16 model + ``fp16kit.MixedPrecisionOptimizer`` (fp32 masters) +
                           ``fp16kit.GradScaler``
async              modern  the same with ``MixedPrecisionOptimizer(async_step=True)``: each
                           step runs on the optimizer thread beside the next forward/backward
fp16-no-masters    torch   ``model.half()`` + the optimizer on the fp16 weights themselves: no
                           masters, no loss scale (GradScaler, torch's as fp16kit's, refuses
                           fp16 grads)
bf16-no-masters    torch   ``model.bfloat16()`` + the optimizer on the bf16 weights: no masters
=================  ======  ==================================================================

The first six train in ``cfg.dtype`` (fp16 by default); with bf16 none of them scales the loss:
the apex pair run a static scale of 1.0 (MIGRATION.md's bf16 advice), the modern ones build
their ``GradScaler`` with ``enabled=False`` (torch's idiom: ``scale()`` returns the loss,
``step()`` steps). The two ``*-no-masters`` recipes are the 16-bit models a user might train
instead of keeping masters, in fp16 and bf16 whatever ``cfg.dtype``.

Every recipe function takes a fresh fp32 copy of the demo model and the config, and returns a
:class:`Recipe`: ``step(x, y)`` trains on one batch and returns the loss (a detached tensor,
no host read), ``predict(x)`` gives fp32 logits for evaluation, ``optimizer`` is the torch
optimizer that steps the weights (the one inside a wrapper: it steps the masters where there
are some), ``loss_scale()`` and ``skipped_steps()`` read the scaler the way users of that API
read it (host reads, between epochs; ``loss_scale`` is None without a loss scale),
``synchronize()`` lands any step still in flight. The same optimizer (:func:`make_optimizer`)
everywhere; the dynamic scales start at ``cfg.init_scale`` and may double after
``cfg.growth_interval`` clean steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import fp16kit
from fp16kit.legacy import FP16_Optimizer, amp, convert_network, network_to_half

from .config import DemoConfig
from .data import loss_fn

__all__ = ["Recipe", "RecipeInfo", "RECIPES", "build", "label", "make_optimizer"]


def _nothing() -> None:
    return None


def _no_skips() -> int:
    return 0


@dataclass(frozen=True)
class Recipe:
    """One recipe's training loop, ready to run (see the module docstring)."""

    model: nn.Module
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    predict: Callable[[torch.Tensor], torch.Tensor]
    optimizer: torch.optim.Optimizer
    loss_scale: Callable[[], float] | None = None
    skipped_steps: Callable[[], int] = _no_skips
    synchronize: Callable[[], None] = _nothing


_OPTIMIZER_LABELS = {"adamw": "AdamW", "sgd": "SGD(momentum=0.9)"}


def make_optimizer(params: object, cfg: DemoConfig) -> torch.optim.Optimizer:
    """The run's optimizer over ``params``: ``AdamW(lr)`` or ``SGD(lr, momentum=0.9)``.

    torch's defaults otherwise (the runner sets each step's lr, see ``DemoConfig.lr_at``)."""
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.peak_lr, momentum=0.9)  # type: ignore[arg-type]
    return torch.optim.AdamW(params, lr=cfg.peak_lr)  # type: ignore[arg-type]


def fp32(model: nn.Module, cfg: DemoConfig) -> Recipe:
    """The reference: float32 weights, activations and grads."""
    optimizer = make_optimizer(model.parameters(), cfg)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return Recipe(model, step, predict=model, optimizer=optimizer)


def fp16_optimizer(model: nn.Module, cfg: DemoConfig) -> Recipe:
    """apex.fp16_utils, migrated by changing the import (MIGRATION.md §1).

    A half model, fp32 masters inside FP16_Optimizer, apex's dynamic loss scale (bf16: the
    static 1.0, no scaling), ``optimizer.backward(loss)``."""
    forward: Callable[[torch.Tensor], torch.Tensor]
    if cfg.dtype == torch.float16:
        model = network_to_half(model)  # casts the inputs too
        forward = model
    else:  # bf16: apex had no bf16; fp16kit's FP16_Optimizer takes bf16 params
        model = convert_network(model, cfg.dtype)
        forward = _casting_inputs(model, cfg.dtype)
    scaling: dict[str, Any] = {
        "dynamic_loss_scale": True,
        "dynamic_loss_args": {"init_scale": cfg.init_scale, "scale_window": cfg.growth_interval},
    }
    optimizer = FP16_Optimizer(
        make_optimizer(model.parameters(), cfg), verbose=False, **(scaling if cfg.scaled else {})
    )
    skipped = 0

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        nonlocal skipped
        optimizer.zero_grad()
        loss = loss_fn(forward(x), y)
        optimizer.backward(loss)  # (loss * scale).backward(); fp16 grads -> fp32 master grads / scale
        optimizer.step()  # skipped on overflow; masters -> model
        skipped += optimizer.overflow  # how apex scripts counted skips
        return loss.detach()

    return Recipe(
        model,
        step,
        predict=forward,
        optimizer=optimizer.optimizer,
        loss_scale=(lambda: optimizer.loss_scale) if cfg.scaled else None,
        skipped_steps=lambda: skipped,
    )


def amp_o2(model: nn.Module, cfg: DemoConfig) -> Recipe:
    """apex.amp, migrated by changing the import (MIGRATION.md §5).

    ``initialize`` takes the fp32 model and optimizer, casts the model, keeps fp32 masters in
    the optimizer. bf16: ``cast_model_type=torch.bfloat16, loss_scale=1.0`` (MIGRATION.md:
    bf16 needs no scaling)."""
    optimizer = make_optimizer(model.parameters(), cfg)
    if cfg.dtype == torch.float16:
        model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
    else:
        model, optimizer = amp.initialize(model, optimizer, opt_level="O2", cast_model_type=cfg.dtype, loss_scale=1.0)
    scaler = amp._amp_state.loss_scalers[0]
    if cfg.scaled:
        # amp.initialize has no init_scale or scale_window; apex scripts set its scaler's fields
        # (capped at max_loss_scale, 2**24, as apex's LossScaler(init_scale=...) and FP16_Optimizer do)
        cap = scaler._max_loss_scale  # amp.initialize always sets one (2**24 by default)
        scaler._loss_scale = cfg.init_scale if cap is None else min(cfg.init_scale, cap)
        scaler._scale_seq_len = cfg.growth_interval
    skipped = 0

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        nonlocal skipped
        scale_before = scaler.loss_scale()
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)  # O2: the model casts x to fp16, its output to fp32
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()  # skipped after an overflow
        # amp's rule: an overflow halves the scale (no floor by default), nothing else lowers it
        skipped += scaler.loss_scale() < scale_before
        return loss.detach()

    return Recipe(
        model,
        step,
        predict=model,
        optimizer=optimizer,
        loss_scale=scaler.loss_scale if cfg.scaled else None,
        skipped_steps=lambda: skipped,
    )


def _grad_scaler(cfg: DemoConfig) -> fp16kit.GradScaler:
    """fp16kit's GradScaler for the run: off for bf16 (torch's ``enabled=`` idiom)."""
    return fp16kit.GradScaler(
        torch.device(cfg.device).type,
        init_scale=cfg.init_scale,
        growth_interval=cfg.growth_interval,
        enabled=cfg.scaled,
    )


def autocast(model: nn.Module, cfg: DemoConfig) -> Recipe:
    """torch.amp's recipe with fp16kit's drop-in scaler (README, "Use").

    fp32 weights, low-precision compute inside ``torch.autocast``."""
    device = torch.device(cfg.device).type
    optimizer = make_optimizer(model.parameters(), cfg)
    scaler = _grad_scaler(cfg)

    def forward(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device, dtype=cfg.dtype):
            return model(x)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        loss = loss_fn(forward(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)  # skipped if any grad is inf/NaN
        scaler.update()
        return loss.detach()

    return Recipe(
        model,
        step,
        predict=forward,
        optimizer=optimizer,
        loss_scale=scaler.get_scale if cfg.scaled else None,
        skipped_steps=scaler.skipped_steps,
    )


def master_weights(model: nn.Module, cfg: DemoConfig, *, async_step: bool = False) -> Recipe:
    """An fp16 (or bf16) model with fp32 master weights, the torch.amp way (README).

    The scaler unscales the model's fp16 grads straight into the masters."""
    model = model.to(cfg.dtype)
    inner = make_optimizer(model.parameters(), cfg)
    optimizer = fp16kit.MixedPrecisionOptimizer(inner, async_step=async_step)
    scaler = _grad_scaler(cfg)
    forward = _casting_inputs(model, cfg.dtype)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        loss = loss_fn(forward(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)  # step the masters, copy them into the model (async: hand it off)
        scaler.update()
        return loss.detach()

    return Recipe(
        model,
        step,
        predict=forward,
        optimizer=inner,
        loss_scale=scaler.get_scale if cfg.scaled else None,
        skipped_steps=scaler.skipped_steps,
        synchronize=optimizer.synchronize,  # before evaluating
    )


def async_steps(model: nn.Module, cfg: DemoConfig) -> Recipe:
    """:func:`master_weights` with ``async_step=True``.

    The same loop; each step runs on the optimizer thread beside the next forward/backward
    (a one-step delayed update)."""
    return master_weights(model, cfg, async_step=True)


def no_masters(model: nn.Module, cfg: DemoConfig, dtype: torch.dtype) -> Recipe:
    """A 16-bit model trained on its own weights, without masters or loss scale.

    A 16-bit model trained on its own weights: the optimizer steps the fp16/bf16 params
    (its state in their dtype too, as torch keeps it), no masters. No loss scale: bf16 needs
    none, and for fp16 ``GradScaler.step`` raises "Attempting to unscale FP16 gradients" (torch's
    check, kept by fp16kit's drop-in)."""
    model = model.to(dtype)
    optimizer = make_optimizer(model.parameters(), cfg)
    forward = _casting_inputs(model, dtype)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        loss = loss_fn(forward(x), y)
        loss.backward()
        optimizer.step()  # w - lr * u, rounded to the weight's 16-bit grid
        return loss.detach()

    return Recipe(model, step, predict=forward, optimizer=optimizer)


def fp16_no_masters(model: nn.Module, cfg: DemoConfig) -> Recipe:
    """:func:`no_masters` in fp16."""
    return no_masters(model, cfg, torch.float16)


def bf16_no_masters(model: nn.Module, cfg: DemoConfig) -> Recipe:
    """:func:`no_masters` in bf16."""
    return no_masters(model, cfg, torch.bfloat16)


def _casting_inputs(model: nn.Module, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        return model(x.to(dtype))

    return forward


@dataclass(frozen=True)
class RecipeInfo:
    """One recipe of the demo: its name, face, label and builder.

    ``label`` is a format string: ``{dtype}`` (the run's), ``{optimizer}`` (its class name)
    and ``{scaler}`` (" + GradScaler" when the run scales the loss, else ", no loss scale")."""

    name: str
    face: str  # "torch", "legacy" or "modern"
    label: str  # what it runs, in a few words
    build: Callable[[nn.Module, DemoConfig], Recipe]


RECIPES: dict[str, RecipeInfo] = {
    info.name: info
    for info in (
        RecipeInfo("fp32", "torch", "torch.optim.{optimizer}, float32 throughout", fp32),
        RecipeInfo(
            "fp16-optimizer", "legacy", "fp16kit.legacy.FP16_Optimizer (apex.fp16_utils), fp32 masters", fp16_optimizer
        ),
        RecipeInfo("amp-o2", "legacy", 'fp16kit.legacy.amp, opt_level="O2" (apex.amp), fp32 masters', amp_o2),
        RecipeInfo("autocast", "modern", "torch.autocast{scaler}, fp32 model", autocast),
        RecipeInfo(
            "master-weights", "modern", "{dtype} model, fp32 masters: MixedPrecisionOptimizer{scaler}", master_weights
        ),
        RecipeInfo("async", "modern", "the same, MixedPrecisionOptimizer(async_step=True)", async_steps),
        RecipeInfo(
            "fp16-no-masters", "torch", "float16 model + {optimizer} on its own weights: no masters", fp16_no_masters
        ),
        RecipeInfo(
            "bf16-no-masters", "torch", "bfloat16 model + {optimizer} on its own weights: no masters", bf16_no_masters
        ),
    )
}


def build(name: str, model: nn.Module, cfg: DemoConfig) -> Recipe:
    """The recipe ``name`` (a key of :data:`RECIPES`) on ``model``."""
    return RECIPES[name].build(model, cfg)


def label(name: str, cfg: DemoConfig) -> str:
    """What recipe ``name`` runs, in a few words (for headers and legends)."""
    return RECIPES[name].label.format(
        dtype=str(cfg.dtype).replace("torch.", ""),
        optimizer=_OPTIMIZER_LABELS[cfg.optimizer],
        scaler=" + fp16kit.GradScaler" if cfg.scaled else ", no loss scale",
    )
