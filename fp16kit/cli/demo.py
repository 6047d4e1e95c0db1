"""``fp16kit demo``: argument parsing and the printed report (the training is in :mod:`fp16kit.demo`)."""

from __future__ import annotations

import argparse
import time

import torch

from .. import __version__

_DTYPES = {"float16": torch.float16, "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def register(sub: argparse._SubParsersAction) -> None:
    demo = sub.add_parser(
        "demo",
        help="train a small MLP in fp32 and in mixed precision side by side (CPU)",
        description="Train one MLP twice on synthetic data: in float32, and under CPU autocast "
        "with fp16kit.GradScaler. Prints per-epoch losses, the loss scale and skipped steps.",
    )
    demo.add_argument("--dtype", choices=sorted(_DTYPES), default="float16", help="autocast dtype (default: float16)")
    demo.add_argument("--epochs", type=_positive_int, default=6)
    demo.add_argument("--steps", type=_positive_int, default=40, help="steps per epoch")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--init-scale", type=float, default=2.0**16)
    demo.set_defaults(func=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from ..demo import DemoConfig, run_demo

    cfg = DemoConfig(
        epochs=args.epochs,
        steps_per_epoch=args.steps,
        dtype=_DTYPES[args.dtype],
        seed=args.seed,
        init_scale=args.init_scale,
    )
    dtype_name = str(cfg.dtype).replace("torch.", "")
    print(f"fp16kit {__version__} demo: MLP 32-256-256-10 on synthetic data, CPU, torch {torch.__version__}")
    print(f"float32 run  vs  {dtype_name} autocast + fp16kit.GradScaler (AdamW, batch {cfg.batch_size})")
    print()
    start = time.perf_counter()
    result = run_demo(cfg)
    elapsed = time.perf_counter() - start
    print(f"{'epoch':>5}  {'fp32 loss':>10}  {dtype_name + ' loss':>14}  {'loss scale':>12}  {'skipped':>7}")
    for row in result.rows:
        print(f"{row.epoch:>5}  {row.fp32_loss:>10.4f}  {row.amp_loss:>14.4f}  {row.scale:>12g}  {row.skipped:>7}")
    print()
    print(f"test accuracy: float32 {result.fp32_accuracy:.3f}, {dtype_name} {result.amp_accuracy:.3f}")
    total_skipped = sum(r.skipped for r in result.rows)
    print(f"skipped steps: {total_skipped} of {cfg.epochs * cfg.steps_per_epoch} ({elapsed:.1f} s)")
    return 0
