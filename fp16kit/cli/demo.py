"""``fp16kit demo``: the options and the printed report (the training is :mod:`fp16kit.demo`).

Prints a header, then one line per epoch per recipe as soon as it is measured, then the final
table and notes. Configuration errors (``--device cuda`` without CUDA, ``--plot`` without
matplotlib) are reported before anything trains, with exit code 2. While the demo trains, the
``fp16kit.apex`` logger's "Gradient overflow" warnings (apex's messages, which the "skipped" column
counts) are counted and hidden unless ``--verbose``.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import textwrap
from typing import Any

import torch

from .. import __version__


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {value}")
    return value


def register(sub: argparse._SubParsersAction) -> None:
    from ..demo.config import DTYPES, RECIPE_NAMES, DemoConfig

    d = DemoConfig()
    demo = sub.add_parser(
        "demo",
        help="fp32 vs apex-style vs modern training, side by side",
        description="Train one small MLP on synthetic data with every recipe: float32; apex's "
        "FP16_Optimizer and amp O2 through fp16kit.legacy; torch.autocast + fp16kit.GradScaler; an "
        "fp16 model with fp16kit.MixedPrecisionOptimizer (fp32 masters), with synchronous and "
        "asynchronous steps. Same initial weights and batches for all. Prints a line per epoch "
        "per recipe, then a table: final loss vs fp32, skipped steps, loss scale, time per step.",
    )
    demo.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="default: cpu")
    demo.add_argument("--dtype", choices=sorted(DTYPES), default="float16", metavar="{float16,bfloat16}",
                      help="the low-precision dtype of every mixed recipe (default: float16; fp16, bf16 too)")
    demo.add_argument("--epochs", type=_positive_int, default=d.epochs, help=f"default: {d.epochs}")
    demo.add_argument("--steps", type=_positive_int, default=d.steps_per_epoch,
                      help=f"steps per epoch, each on a fresh batch of {d.batch_size} (default: {d.steps_per_epoch})")
    demo.add_argument("--seed", type=int, default=d.seed, help="data, initial weights, batches (default: 0)")
    demo.add_argument("--recipes", nargs="+", choices=RECIPE_NAMES, default=list(RECIPE_NAMES), metavar="RECIPE",
                      help=f"a subset of: {', '.join(RECIPE_NAMES)} (default: all)")
    demo.add_argument("--init-scale", type=_positive_float, default=d.init_scale,
                      help="initial loss scale of every dynamic scaler (default: 65536)")
    demo.add_argument("--growth-interval", type=_positive_int, default=d.growth_interval,
                      help=f"clean steps before a scale doubles (default: {d.growth_interval}; torch and apex: 2000)")
    demo.add_argument("--plot", metavar="FILE.png", help='draw loss and loss-scale curves (needs matplotlib: '
                      'pip install "fp16kit[plot]")')
    demo.add_argument("--verbose", action="store_true", help="show apex's overflow messages as they happen")
    demo.set_defaults(func=_run_demo)


def _error(message: str) -> int:
    print(f"fp16kit demo: error: {message}", file=sys.stderr)
    return 2


class _OverflowMessages(logging.Filter):
    """Counts apex's "Gradient overflow.  Skipping step, ..." warnings on the fp16kit.apex logger and
    drops them unless ``show`` (the table's skipped column says the same), as it drops apex's INFO
    lines (amp's banner, which would cut the table). Every other warning passes: one the demo does
    not expect is worth seeing."""

    def __init__(self, show: bool) -> None:
        super().__init__()
        self.show = show
        self.count = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.WARNING and record.getMessage().startswith("Gradient overflow."):
            self.count += 1
            return self.show
        return self.show or record.levelno >= logging.WARNING


def _run_demo(args: argparse.Namespace) -> int:
    from ..demo.config import DTYPES, DemoConfig

    try:
        cfg = DemoConfig(
            epochs=args.epochs, steps_per_epoch=args.steps, dtype=DTYPES[args.dtype], device=args.device,
            seed=args.seed, init_scale=args.init_scale, growth_interval=args.growth_interval,
            recipes=tuple(dict.fromkeys(args.recipes)), trace=args.plot is not None,
        )
        if args.plot is not None:
            from ..demo import plot

            plot.require()
            plot.check_path(args.plot)
    except (ValueError, ImportError) as e:
        return _error(str(e))
    return _report(cfg, args)


def _report(cfg: Any, args: argparse.Namespace) -> int:
    from ..demo import run_demo

    _print_header(cfg)
    hidden = _OverflowMessages(show=args.verbose)
    logger = logging.getLogger("fp16kit.apex")  # where apex's lines go (fp16kit/legacy/_messages.py)
    logger.addFilter(hidden)
    try:
        result = run_demo(cfg, on_epoch=_print_row)
    except KeyboardInterrupt:
        print("fp16kit demo: interrupted", file=sys.stderr)
        return 130
    finally:
        logger.removeFilter(hidden)
    _print_table(result)
    _print_notes(result, hidden.count, args.verbose)
    if args.plot is not None:
        from ..demo import plot

        plot.plot(result, args.plot)
        print(f"plot written to {args.plot}")
    return 0


_ROW = "{:>5}  {:<14}  {:>10}  {:>9}  {:>8}  {:>10}  {:>7}  {:>7}"
_TABLE = "{:<14}  {:>9}  {:>8}  {:>8}  {:>7}  {:>10}  {:>7}  {:>7}"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _print_header(cfg: Any) -> None:
    from ..demo.data import make_model
    from ..demo.recipes import RECIPES, label

    n_params = sum(p.numel() for p in make_model(cfg).parameters())
    where = f"{cfg.device} ({torch.get_num_threads()} threads)" if cfg.device == "cpu" else torch.cuda.get_device_name()
    print(f"fp16kit {__version__} demo: torch {torch.__version__}, {where}, {_dtype_name(cfg.dtype)}", flush=True)
    print(f"model: MLP 32-{cfg.hidden}-{cfg.hidden}-10 ({n_params:,} params) learning a fixed random "
          "teacher's 10 classes")
    print(f"every recipe: the same initial weights and batches, AdamW lr {cfg.lr:g}, "
          f"{_count(cfg.epochs, 'epoch')} x {_count(cfg.steps_per_epoch, 'step')} of {cfg.batch_size} fresh samples")
    cap = ""
    if cfg.init_scale > 2.0**24 and {"fp16-optimizer", "amp-o2"} & set(cfg.recipes):
        cap = " (apex's at most 2**24, their max_loss_scale)"
    print(textwrap.fill(f"loss scales: dynamic, from {_scale_text(cfg.init_scale)}{cap}, doubled after "
                        f"{cfg.growth_interval} clean steps, halved (and the step skipped) on overflow",
                        width=100, subsequent_indent="  "))
    print()
    for name in cfg.recipes:
        print(f"  {name:<14}  {RECIPES[name].face:<6}  {label(name, cfg)}")
    print()
    print(_ROW.format("epoch", "recipe", "train loss", "eval loss", "accuracy", "loss scale", "skipped", "ms/step"),
          flush=True)


def _scale_text(scale: float | None) -> str:
    if scale is None:
        return "-"
    if not math.isfinite(scale):
        return str(scale)
    if scale == int(scale) and scale < 1e10:
        return str(int(scale))
    exponent = math.log2(scale)
    return f"2**{int(exponent)}" if exponent == int(exponent) else f"{scale:.4g}"


def _print_row(row: Any) -> None:
    has_scale = row.scale is not None
    print(_ROW.format(
        row.epoch, row.recipe, f"{row.train_loss:.4f}", f"{row.eval_loss:.4f}", f"{row.accuracy:.3f}",
        _scale_text(row.scale), row.skipped if has_scale else "-", f"{row.ms_per_step:.1f}",
    ), flush=True)


def _percent(ratio: float) -> str:
    text = f"{ratio:+.2%}"
    return "0.00%" if text in ("+0.00%", "-0.00%") else text  # the same to this precision


def _print_table(result: Any) -> None:
    cfg = result.config
    print()
    print(f"after {_count(cfg.epochs, 'epoch')} (eval loss on {cfg.eval_size} held-out samples; ms/step: median over epochs)")
    print(_TABLE.format("recipe", "eval loss", "vs fp32", "accuracy", "skipped", "loss scale", "ms/step", "vs fp32"))
    for s in result.summaries:
        has_scale = s.scale is not None
        vs_loss = "-" if s.loss_vs_fp32 is None or s.recipe == "fp32" else _percent(s.loss_vs_fp32)
        vs_time = "-" if s.time_vs_fp32 is None else f"{s.time_vs_fp32:.2f}x"
        print(_TABLE.format(
            s.recipe, f"{s.eval_loss:.4f}", vs_loss, f"{s.accuracy:.3f}", s.skipped if has_scale else "-",
            _scale_text(s.scale), f"{s.ms_per_step:.1f}", vs_time,
        ))


def _print_notes(result: Any, hidden: int, verbose: bool) -> None:
    cfg = result.config
    notes = []
    if "async" in cfg.recipes:
        notes.append("async: each step runs on the optimizer thread beside the next forward/backward, so "
                     "each update uses a gradient one step old: its loss follows fp32 less closely than the "
                     "synchronous recipes'.")
    if cfg.device == "cpu" and cfg.dtype == torch.float16 and len(cfg.recipes) > 1:
        notes.append("float16 on a CPU: most CPUs have no fast fp16 arithmetic, so the mixed recipes are "
                     "slower here; the losses, scales and skips are the point. For speed: --device cuda, or "
                     "--dtype bfloat16 on a CPU with bf16 support.")
    if hidden and not verbose:
        notes.append(f"{hidden} of apex's \"Gradient overflow.  Skipping step\" messages (fp16kit logger) "
                     "hidden: the skipped column counts them; --verbose shows them.")
    print()
    for note in notes:
        print(textwrap.fill(note, width=100, subsequent_indent="  "))
    print(f"done in {result.seconds:.1f} s")
