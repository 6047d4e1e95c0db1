"""What one ``fp16kit demo`` run trains: :class:`DemoConfig`, checked before anything runs."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["DemoConfig", "RECIPE_NAMES", "DTYPES", "OPTIMIZERS", "cuda_missing_message"]

RECIPE_NAMES = (
    "fp32",
    "fp16-optimizer",
    "amp-o2",
    "autocast",
    "master-weights",
    "async",
    "fp16-no-masters",
    "bf16-no-masters",
)
"""The recipes, in the order they train and print (see :mod:`fp16kit.demo.recipes`)."""

DTYPES = {"float16": torch.float16, "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}

OPTIMIZERS = {"adamw": 3e-3, "sgd": 0.02}
"""The optimizers every recipe can use (``torch.optim.AdamW``; ``torch.optim.SGD`` with momentum
0.9), each with its default peak learning rate."""


@dataclass(frozen=True)
class DemoConfig:
    """One demo run.

    Every recipe trains a copy of the same initial model on the same batches, with the same
    optimizer and learning rate at every step: ``lr`` (None: the optimizer's default in
    :data:`OPTIMIZERS`) decayed to a tenth along a cosine over the run (:meth:`lr_at`).

    ``dtype`` is the low-precision dtype of the mixed recipes; the two ``*-no-masters`` recipes
    are fp16 and bf16 whatever it is. With bf16 no recipe scales the loss (bf16 has fp32's
    exponent range: its gradients do not underflow).

    ``growth_interval`` is the number of clean steps after which every dynamic loss scale
    doubles (torch's ``growth_interval``, apex's ``scale_window``; both default to 2000). The
    demo's default of 100 lets the scale move within a one-minute run. ``trace`` records the
    loss scale after every step (one host read per step; for ``--plot``)."""

    epochs: int = 10
    steps_per_epoch: int = 80
    batch_size: int = 128
    hidden: int = 256
    eval_size: int = 2048
    dtype: torch.dtype = torch.float16
    device: str = "cpu"
    optimizer: str = "adamw"
    lr: float | None = None
    seed: int = 0
    init_scale: float = 2.0**16
    growth_interval: int = 100
    recipes: tuple[str, ...] = RECIPE_NAMES
    trace: bool = False

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise ``ValueError`` (naming the fix) for a config that cannot run."""
        for name in ("epochs", "steps_per_epoch", "batch_size", "hidden", "eval_size", "growth_interval"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"DemoConfig.{name} must be an int >= 1, got {value!r}.")
        if self.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(
                f"demo dtype must be torch.float16 or torch.bfloat16, got {self.dtype} "
                "(the fp32 recipe is always there to compare with)."
            )
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown demo optimizer {self.optimizer!r}; choose from {list(OPTIMIZERS)}.")
        if self.lr is not None and not (isinstance(self.lr, (int, float)) and 0 < self.lr < math.inf):
            raise ValueError(f"DemoConfig.lr must be a finite number > 0, got {self.lr!r}.")
        if not 0 < self.init_scale < math.inf:
            raise ValueError(f"DemoConfig.init_scale must be a finite number > 0, got {self.init_scale!r}.")
        if not self.recipes:
            raise ValueError(f"DemoConfig.recipes is empty; choose from {list(RECIPE_NAMES)}.")
        unknown = [r for r in self.recipes if r not in RECIPE_NAMES]
        if unknown:
            raise ValueError(f"unknown demo recipe(s) {unknown}; choose from {list(RECIPE_NAMES)}.")
        if len(set(self.recipes)) != len(self.recipes):
            raise ValueError(f"DemoConfig.recipes names a recipe twice: {list(self.recipes)}.")
        device = torch.device(self.device)
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"demo device must be 'cpu' or 'cuda', got {self.device!r}.")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(cuda_missing_message())

    @property
    def total_steps(self) -> int:
        return self.epochs * self.steps_per_epoch

    @property
    def scaled(self) -> bool:
        """Whether the recipes that can scale the loss do (fp16); bf16 needs no loss scale."""
        return self.dtype == torch.float16

    @property
    def peak_lr(self) -> float:
        """``lr``, or the optimizer's default learning rate."""
        return OPTIMIZERS[self.optimizer] if self.lr is None else self.lr

    def lr_at(self, step: int) -> float:
        """The learning rate of step ``step`` (0-based): a cosine decay from ``peak_lr`` to ``peak_lr / 10``.

        The learning rate of step ``step`` (0-based): a cosine from ``peak_lr`` at the first
        step down to ``peak_lr / 10`` at the end (the usual decay, with nanoGPT's floor)::

            peak_lr * (0.1 + 0.9 * (1 + cos(pi * step / total_steps)) / 2)

        The later, smaller updates are the ones 16-bit weights round away."""
        return self.peak_lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * step / self.total_steps)))


def cuda_missing_message() -> str:
    """Why ``device="cuda"`` cannot run here, and what to do instead."""
    if torch.version.cuda is None:
        why = f"this PyTorch ({torch.__version__}) is a CPU-only build"
        fix = "install a CUDA build of PyTorch (https://pytorch.org/get-started/locally/)"
    else:
        why = f"this PyTorch (CUDA {torch.version.cuda}) finds no usable GPU"
        fix = "check the driver and CUDA_VISIBLE_DEVICES"
    return f"CUDA is not available: {why}. Run on the CPU (the default, --device cpu), or {fix}."
