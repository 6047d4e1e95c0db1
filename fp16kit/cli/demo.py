"""``fp16kit demo``: the options and the printed report (the training is :mod:`fp16kit.demo`).

Prints a header (what each row is), then one line per epoch per recipe as soon as it is
measured, then the final table and notes. Configuration errors (``--device cuda`` without
CUDA, ``--plot`` without matplotlib) are reported before anything trains, with exit code 2.
While the demo trains, apex's "Gradient overflow" lines (which the "skipped" column counts)
are counted and hidden unless ``--verbose`` (:class:`_OverflowLines`).
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import textwrap
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from .. import __version__

_OVERFLOW = "Gradient overflow."  # how apex's "Gradient overflow.  Skipping step, ..." lines start


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


_COLUMNS_HELP = """\
the final table's columns:
  eval loss, vs fp32   held-out cross-entropy after the last epoch; relative to fp32's
  accuracy             on the same held-out samples
  updates lost         share of the weight elements each step updated that it left unchanged
                       (the update rounded away), over all steps taken; "the weights" are the
                       fp32 masters where a recipe keeps them, else the model's own
  skipped (total)      steps skipped on a loss-scale overflow over the run (the per-epoch
                       lines: in that epoch)
  loss scale           the final dynamic loss scale, or "no loss scale"
  bytes/param          training state held after the last step, counted from the tensors:
                       weights + grads + optimizer state + masters (fp32 copies, their grads);
                       activations not counted
  time/step (x fp32)   median time per step over the epochs, as a multiple of fp32's"""


def _rows_help() -> str:
    from ..demo.config import DemoConfig
    from ..demo.recipes import RECIPES, label

    cfg = DemoConfig()
    lines = ["the rows (--recipes picks some; all by default):"]
    lines += [f"  {name:<16} {label(name, cfg)}" for name in RECIPES]
    lines += textwrap.wrap(
        "--dtype sets the 16-bit type of the first six rows (float16 above); the *-no-masters rows "
        "are fp16 and bf16, as named. With --dtype bfloat16 no recipe scales the loss (bf16 needs "
        "no loss scale). Every recipe: the same initial weights, batches and learning rate at "
        "every step.",
        width=94,
        initial_indent="  ",
        subsequent_indent="  ",
    )
    return "\n".join(lines)


def register(sub: argparse._SubParsersAction) -> None:
    from ..demo.config import DTYPES, OPTIMIZERS, RECIPE_NAMES, DemoConfig

    d = DemoConfig()
    demo = sub.add_parser(
        "demo",
        help="fp32, apex-style, modern, no masters: side by side",
        description=textwrap.fill(
            "Train one small MLP on synthetic data with every recipe: float32; apex's FP16_Optimizer "
            "and amp O2 through fp16kit.legacy; torch.autocast + fp16kit.GradScaler; a 16-bit model "
            "with fp16kit.MixedPrecisionOptimizer (fp32 masters), with synchronous and asynchronous "
            "steps; and fp16 and bf16 models trained without masters. Prints a line per epoch per "
            "recipe, then a table: final loss vs fp32, the updates lost to rounding, skipped steps, "
            "loss scale, bytes of training state per parameter, time per step vs fp32.",
            width=94,
        ),
        epilog=f"{_rows_help()}\n\n{_COLUMNS_HELP}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="default: cpu")
    demo.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="float16",
        metavar="{float16,bfloat16}",
        help="the 16-bit dtype of the mixed recipes (default: float16; fp16, bf16 too)",
    )
    demo.add_argument(
        "--optimizer",
        choices=tuple(OPTIMIZERS),
        default=d.optimizer,
        help="every recipe's: torch.optim.AdamW or SGD with momentum 0.9 (default: adamw)",
    )
    demo.add_argument(
        "--lr",
        type=_positive_float,
        help="peak learning rate, cosine-decayed to a tenth over the run (default: "
        + ", ".join(f"{lr:g} for {name}" for name, lr in OPTIMIZERS.items())
        + ")",
    )
    demo.add_argument("--epochs", type=_positive_int, default=d.epochs, help=f"default: {d.epochs}")
    demo.add_argument(
        "--steps",
        type=_positive_int,
        default=d.steps_per_epoch,
        help=f"steps per epoch, each on a fresh batch of {d.batch_size} (default: {d.steps_per_epoch})",
    )
    demo.add_argument("--seed", type=int, default=d.seed, help="data, initial weights, batches (default: 0)")
    demo.add_argument(
        "--recipes",
        nargs="+",
        choices=RECIPE_NAMES,
        default=list(RECIPE_NAMES),
        metavar="RECIPE",
        help="some of the rows below (default: all)",
    )
    demo.add_argument(
        "--init-scale",
        type=_positive_float,
        default=d.init_scale,
        help="initial loss scale of every dynamic scaler (default: 65536)",
    )
    demo.add_argument(
        "--growth-interval",
        type=_positive_int,
        default=d.growth_interval,
        help=f"clean steps before a scale doubles (default: {d.growth_interval}; torch and apex: 2000)",
    )
    demo.add_argument(
        "--plot",
        metavar="FILE.png",
        help='draw loss and loss-scale curves (needs matplotlib: pip install "fp16kit[plot]")',
    )
    demo.add_argument("--verbose", action="store_true", help="show apex's overflow messages as they happen")
    demo.set_defaults(func=_run_demo)


def _error(message: str) -> int:
    print(f"fp16kit demo: error: {message}", file=sys.stderr)
    return 2


class _OverflowLines(logging.Handler):
    """apex's lines while the demo trains, kept out of its table unless ``show`` (--verbose):
    the "Gradient overflow.  Skipping step, ..." lines are counted (the skipped column says the
    same) and dropped, and so are apex's INFO lines (amp's banner). Every other warning goes
    where it went before: one the demo does not expect is worth seeing. With ``show`` every
    line goes where it went before (apex's lines: stdout).

    The legacy faces log apex's lines on the ``fp16kit.apex`` logger, which has its own stdout
    handler and does not propagate (fp16kit/legacy/_messages.py) -- or, in versions before it,
    on ``fp16kit`` itself. So :meth:`installed` puts this object on both: as the only handler of
    ``fp16kit.apex`` (its own handlers set aside, given what passes, and put back after), and
    as a filter of ``fp16kit`` (a filter, not a handler: only a filter keeps a record from the
    root logger's handlers). A record is seen once: ``fp16kit.apex`` does not propagate, and a
    logger's filters see only the records logged on it."""

    def __init__(self, show: bool) -> None:
        super().__init__()
        self.show = show
        self.count = 0
        self._set_aside: list[logging.Handler] = []

    def take(self, record: logging.LogRecord) -> bool:
        """Count an overflow line; whether ``record`` goes on (an overflow line: only if ``show``)."""
        if record.getMessage().startswith(_OVERFLOW):
            self.count += 1
            return self.show
        return True

    def emit(self, record: logging.LogRecord) -> None:
        if self.take(record) and (self.show or record.levelno >= logging.WARNING):
            for handler in self._set_aside:
                if record.levelno >= handler.level:
                    handler.handle(record)

    @contextmanager
    def installed(self) -> Iterator[_OverflowLines]:
        parent, apex = logging.getLogger("fp16kit"), logging.getLogger("fp16kit.apex")
        self._set_aside = list(apex.handlers)
        for handler in self._set_aside:
            apex.removeHandler(handler)
        apex.addHandler(self)
        parent.addFilter(self.take)
        try:
            yield self
        finally:
            parent.removeFilter(self.take)
            apex.removeHandler(self)
            for handler in self._set_aside:
                apex.addHandler(handler)
            self._set_aside = []


def _run_demo(args: argparse.Namespace) -> int:
    from ..demo.config import DTYPES, DemoConfig

    try:
        cfg = DemoConfig(
            epochs=args.epochs,
            steps_per_epoch=args.steps,
            dtype=DTYPES[args.dtype],
            device=args.device,
            optimizer=args.optimizer,
            lr=args.lr,
            seed=args.seed,
            init_scale=args.init_scale,
            growth_interval=args.growth_interval,
            recipes=tuple(dict.fromkeys(args.recipes)),
            trace=args.plot is not None,
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
    lines = _OverflowLines(show=args.verbose)
    try:
        with lines.installed():
            result = run_demo(cfg, on_epoch=_print_row)
    except KeyboardInterrupt:
        print("fp16kit demo: interrupted", file=sys.stderr)
        return 130
    _print_table(result)
    _print_notes(result, lines.count, args.verbose)
    if args.plot is not None:
        from ..demo import plot

        plot.plot(result, args.plot)
        print(f"plot written to {args.plot}")
    return 0


class _Columns:
    """A table's columns, each (first header line, second header line, width, alignment: "<"
    or ">"), two spaces apart."""

    def __init__(self, *columns: tuple[str, str, int, str]) -> None:
        self.formats = [f"{{:{align}{width}}}" for _, _, width, align in columns]
        self.header = [self.line([c[0] for c in columns]).rstrip(), self.line([c[1] for c in columns])]

    def line(self, cells: Sequence[str]) -> str:
        return "  ".join(f.format(cell) for f, cell in zip(self.formats, cells))


_EPOCH = _Columns(
    ("", "epoch", 5, ">"),
    ("", "recipe", 15, "<"),
    ("train", "loss", 7, ">"),
    ("eval", "loss", 7, ">"),
    ("", "accuracy", 8, ">"),
    ("updates", "lost", 7, ">"),
    ("", "loss scale", 13, ">"),
    ("skipped", "(epoch)", 7, ">"),
    ("ms", "/step", 6, ">"),
)
_FINAL = _Columns(
    ("", "recipe", 15, "<"),
    ("eval", "loss", 7, ">"),
    ("loss vs", "fp32", 8, ">"),
    ("", "accuracy", 8, ">"),
    ("updates", "lost", 7, ">"),
    ("skipped", "(total)", 7, ">"),
    ("final", "loss scale", 13, ">"),
    ("bytes", "/param", 6, ">"),
    ("time/step", "(x fp32)", 9, ">"),
)
_NO_SCALE = "no loss scale"


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
    print(
        f"model: MLP 32-{cfg.hidden}-{cfg.hidden}-10 ({n_params:,} params) learning a fixed random teacher's 10 classes"
    )
    optimizer = "AdamW" if cfg.optimizer == "adamw" else "SGD momentum 0.9"
    _wrapped(
        f"every recipe: the same initial weights and batches, {optimizer} lr {cfg.peak_lr:g} "
        f"cosine-decayed to {cfg.peak_lr / 10:g}, {_count(cfg.epochs, 'epoch')} x "
        f"{_count(cfg.steps_per_epoch, 'step')} of {cfg.batch_size} fresh samples"
    )
    _wrapped(_scales_text(cfg))
    print()
    for name in cfg.recipes:
        print(f"  {name:<15}  {RECIPES[name].face:<6}  {label(name, cfg)}")
    print()
    for line in _EPOCH.header:
        print(line)
    sys.stdout.flush()


def _scales_text(cfg: Any) -> str:
    if not cfg.scaled:
        return (
            "loss scales: none -- bf16 has float32's exponent range, so its gradients need no "
            "loss scale (MIGRATION.md's FAQ): the recipes that scale fp16 losses run without a scaler"
        )
    cap = ""
    if cfg.init_scale > 2.0**24 and {"fp16-optimizer", "amp-o2"} & set(cfg.recipes):
        cap = " (apex's at most 2**24, their max_loss_scale)"
    text = (
        f"loss scales: dynamic, from {_scale_text(cfg.init_scale)}{cap}, doubled after {cfg.growth_interval} "
        "clean steps, halved (and the step skipped) on overflow"
    )
    if "fp16-no-masters" in cfg.recipes:
        text += '; none for fp16-no-masters (GradScaler refuses fp16 grads: "Attempting to unscale FP16 gradients")'
    return text


def _wrapped(text: str) -> None:
    print(textwrap.fill(text, width=100, subsequent_indent="  "))


def _scale_text(scale: float | None) -> str:
    if scale is None:
        return _NO_SCALE
    if not math.isfinite(scale):
        return str(scale)
    if scale == int(scale) and scale < 1e10:
        return str(int(scale))
    exponent = math.log2(scale)
    return f"2**{int(exponent)}" if exponent == int(exponent) else f"{scale:.4g}"


def _lost_text(fraction: float | None, finite: bool) -> str:
    if not finite:
        return "nan"  # inf/NaN weights: whether they "changed" means nothing
    return "-" if fraction is None else f"{fraction:.1%}"


def _print_row(row: Any) -> None:
    print(
        _EPOCH.line(
            [
                str(row.epoch),
                row.recipe,
                f"{row.train_loss:.4f}",
                f"{row.eval_loss:.4f}",
                f"{row.accuracy:.3f}",
                _lost_text(row.updates_lost, row.finite),
                _scale_text(row.scale),
                "-" if row.scale is None else str(row.skipped),
                f"{row.ms_per_step:.1f}",
            ]
        ),
        flush=True,
    )


def _percent(ratio: float) -> str:
    if not math.isfinite(ratio):
        return str(ratio)
    text = f"{ratio:+.2%}"
    return "0.00%" if text in ("+0.00%", "-0.00%") else text  # the same to this precision


def _print_table(result: Any) -> None:
    cfg = result.config
    print()
    print(f"after {_count(cfg.epochs, 'epoch')} (eval: {cfg.eval_size} held-out samples)")
    for line in _FINAL.header:
        print(line)
    for s in result.summaries:
        print(
            _FINAL.line(
                [
                    s.recipe,
                    f"{s.eval_loss:.4f}",
                    "-" if s.loss_vs_fp32 is None or s.recipe == "fp32" else _percent(s.loss_vs_fp32),
                    f"{s.accuracy:.3f}",
                    _lost_text(s.updates_lost, s.finite),
                    "-" if s.scale is None else str(s.skipped),
                    _scale_text(s.scale),
                    "-" if s.bytes_per_param is None else f"{s.bytes_per_param:.1f}",
                    "-" if s.time_vs_fp32 is None else f"{s.time_vs_fp32:.2f}x",
                ]
            )
        )


def _bytes_text(result: Any) -> str:
    """bytes/param per part, recipes with the same parts together: "fp32, autocast 4+4+8+0"."""
    from ..demo.measure import STATE_PARTS

    groups: dict[str, list[str]] = {}
    params = result.rows[-1].params
    for s in result.summaries:
        parts = "+".join(f"{round(s.state[p] / params, 1):g}" for p in STATE_PARTS)
        groups.setdefault(parts, []).append(s.recipe)
    return "; ".join(f"{', '.join(names)} {parts}" for parts, names in groups.items())


def _print_notes(result: Any, hidden: int, verbose: bool) -> None:
    cfg = result.config
    by = {s.recipe: s for s in result.summaries}
    notes = [
        "updates lost: an update smaller than about 1/2000 of its weight (fp16 keeps 11 significant "
        "bits) or 1/250 (bf16: 8) rounds back to the same 16-bit value; fp32 masters (24 bits) keep "
        "it, and the 16-bit model gets the masters' rounded copy.",
        f"bytes/param = weights + grads + optimizer state + masters: {_bytes_text(result)}.",
    ]
    if "async" in cfg.recipes:
        notes.append(
            "async: each step runs on the optimizer thread beside the next forward/backward, so "
            "each update uses a gradient one step old: its loss follows fp32 less closely than the "
            "synchronous recipes'."
        )
    broken = by.get("fp16-no-masters")
    if broken is not None and not broken.finite:
        first = next(r.epoch for r in result.rows if r.recipe == "fp16-no-masters" and not r.finite)
        text = f"fp16-no-masters: its weights are inf/NaN after epoch {first}"
        if cfg.optimizer == "adamw":
            text += (
                ": AdamW keeps its state in the params' dtype, and in fp16 the squared gradients "
                "underflow to 0 and eps (1e-8) to 0 too, so the update divides by zero. With masters "
                "the optimizer's state is fp32. --optimizer sgd shows fp16's rounding instead"
            )
        notes.append(text + ".")
    if cfg.device == "cpu" and cfg.dtype == torch.float16 and len(cfg.recipes) > 1:
        notes.append(
            "float16 on a CPU: most CPUs have no fast fp16 arithmetic, so the mixed recipes are "
            "slower here; the losses, scales and skips are the point. For speed: --device cuda, or "
            "--dtype bfloat16 on a CPU with bf16 support."
        )
    if hidden and not verbose:
        notes.append(
            f'{hidden} of apex\'s "Gradient overflow.  Skipping step" messages hidden: the skipped '
            "column counts them; --verbose shows them."
        )
    print()
    for note in notes:
        _wrapped(note)
    print(f"done in {result.seconds:.1f} s")
