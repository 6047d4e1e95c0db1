"""``fp16kit bench``: the options and the printed report (the measuring is :mod:`fp16kit.bench`).

Prints the markdown report (or ``--json``) on stdout, one progress line per measurement on
stderr. Exit code 2 for bad options (an unknown row, fewer than 7 rounds)."""

from __future__ import annotations

import argparse
import sys
import textwrap

_ROWS_HELP = """\
the rows (--only picks some; all by default):
  master-grads  fp16 grads -> unscaled fp32 master grads + found_inf: MixedPrecisionOptimizer
                (flat and not), FP16_Optimizer.update_master_grads vs the 6 B/param bound and
                the hand loop (torch._foreach_copy_ + _amp_foreach_non_finite_check_and_unscale_);
                8000 x 1k and 40 x 1M tensors (--quick: 2000 x 1k, 8 x 1M)
  step          the whole master-weight AdamW(fused) step: MixedPrecisionOptimizer + GradScaler,
                FP16_Optimizer, amp O2 vs the hand loop (torch only), torch's fused AdamW on fp32
                params and the 28 B/param bound; a 24.6M-param list and a small MLP's params
  scaler        fp16kit.GradScaler vs torch.amp.GradScaler, fp32 MLP, SGD and AdamW(fused)
  async         async_step=True vs async_step=False: step-heavy, balanced, matmul-heavy MLPs
  syncs         host syncs, aten ops and Python calls per step, counted (not timed)
  memory        bytes per param held after an AdamW step, after zero_grad and at the step's peak
                (torch's CPU allocator events via torch.profiler; on CUDA torch.cuda's counters),
                counted (not timed): fp32, autocast, a bf16 model without masters,
                MixedPrecisionOptimizer (fused kernel and torch ops, flat and not), FP16_Optimizer,
                amp O2, and stated figures of ZeRO and Megatron-Core; an MLP of 4.2M params
                (--quick: 0.13M)"""


def _rounds(text: str) -> int:
    from ..bench import MIN_ROUNDS

    value = int(text)
    if value < MIN_ROUNDS:
        raise argparse.ArgumentTypeError(f"must be >= {MIN_ROUNDS} (median and spread need them), got {value}")
    return value


def _threads(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _rows(text: str) -> list[str]:
    from ..bench import ROWS

    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in ROWS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown row {', '.join(unknown) or repr(text)}: choose from {', '.join(ROWS)}"
        )
    return names


def _devices(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in ("cpu", "cuda")]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"devices are cpu and cuda (comma-separated), got {text!r}")
    return list(dict.fromkeys(names))


def register(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser(
        "bench",
        help="fp16kit vs hand-written torch loops, as ratios",
        description=textwrap.fill(
            "Time fp16kit's master-weight paths against what a user would write instead (a loop with "
            "torch alone, torch's GradScaler, the synchronous step) and against the memory-bandwidth "
            "bound measured in the run by a large copy. Every figure is a ratio measured in the same "
            "run: variants interleaved, the order reversed every other round, the median and spread "
            "(min-max) of the per-round ratios. Prints the machine and its load first: when the load "
            "exceeds the core count, the figures are unreliable.",
            width=94,
        ),
        epilog=_ROWS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument("--quick", action="store_true", help="small sizes, short rounds: under 30 s on 2 cores")
    bench.add_argument("--rounds", type=_rounds, default=7, help="measured rounds, >= 7 (default: 7)")
    bench.add_argument(
        "--device",
        type=_devices,
        default=["cpu"],
        metavar="cpu|cuda|cpu,cuda",
        help="where to run the rows (default: cpu); cuda rows are skipped without a CUDA device",
    )
    bench.add_argument("--only", type=_rows, metavar="ROW[,ROW]", help="run only these rows (see below)")
    bench.add_argument(
        "--threads", type=_threads, help="torch.set_num_threads for the run (default: torch's, stated in the output)"
    )
    bench.add_argument("--json", action="store_true", help="print JSON (the same figures, per-round ratios too)")
    bench.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from ..bench import run_bench
    from ..bench.report import to_json, to_markdown

    def progress(msg: str) -> None:
        print(f"fp16kit bench: {msg}", file=sys.stderr, flush=True)

    result = run_bench(
        rows=args.only,
        devices=args.device,
        rounds=args.rounds,
        quick=args.quick,
        threads=args.threads,
        progress=progress,
    )
    sys.stdout.write(to_json(result) + "\n" if args.json else to_markdown(result))
    return 0
