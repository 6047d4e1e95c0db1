"""Throughput of synchronous vs asynchronous optimizer steps (docs/async.md §3, mode 1).

A bf16 MLP trains with fp32 masters and Adam through fp16kit.MixedPrecisionOptimizer and
fp16kit.GradScaler. Synchronous: forward, backward and step in sequence, with every core for
intra-op threads. Asynchronous (``async_step=True``): the step of iteration k runs on the
optimizer thread while the main thread computes forward/backward k+1; the cores are split
between the two sides. Runs the two alternately for ``--rounds`` rounds (so drift on a shared
machine hits both alike) and prints iterations per second and the async/sync ratio of every
round, then the median ratio.

    python benchmarks/async_overlap.py                    # CPU, 2 cores here
    python benchmarks/async_overlap.py --device cuda      # CUDA model, masters offloaded to CPU

The gain depends on the balance: overlap pays most when forward/backward and the step take
similar time and neither speeds up much with more intra-op threads. The default -- 24 layers
of 256 at batch 8 -- is such a point: on one core a forward/backward takes about 6 ms and the
Adam step with its transfers about 6.5 ms, large enough that the fixed costs of a step (thread
hand-offs, a few scaler ops: some 0.3 ms) weigh little, as in real models. Away from the
balance the ratio falls: a heavier step (more layers) or a heavier forward/backward (larger
batches, large matmuls that scale across cores) leaves one side waiting. On CPU the two
threads also share the GIL: every Python-level op of one can wait for the other. Not run in
CI.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch import nn

import fp16kit


def build(args: argparse.Namespace, async_step: bool):
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.width, args.width), nn.GELU()]
    model = nn.Sequential(*layers, nn.Linear(args.width, 16)).to(args.device, torch.bfloat16)
    master_device = "cpu" if args.device == "cuda" else None
    opt = fp16kit.MixedPrecisionOptimizer(
        torch.optim.Adam(model.parameters(), lr=1e-4, **{args.impl: True}),
        master_device=master_device,
        async_step=async_step,
    )
    scaler = fp16kit.GradScaler(args.device)
    return model, opt, scaler


def run(args: argparse.Namespace, async_step: bool) -> float:
    model, opt, scaler = build(args, async_step)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.width, generator=g).to(args.device, torch.bfloat16)
    y = torch.randn(args.batch, 16, generator=g).to(args.device)

    def iteration() -> None:
        opt.zero_grad()
        loss = (model(x).float() - y).pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    for _ in range(args.warmup):
        iteration()
    opt.synchronize()
    if args.device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.iters):
        iteration()
    opt.synchronize()
    if args.device == "cuda":
        torch.cuda.synchronize()
    return args.iters / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--iters", type=int, default=80)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--impl", default="foreach", choices=["foreach", "fused"], help="Adam implementation")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="CPU cores to use")
    parser.add_argument(
        "--main-threads",
        type=int,
        default=None,
        help="intra-op threads of the main thread when asynchronous (default: half)",
    )
    args = parser.parse_args()

    params = sum(p.numel() for p in build(args, False)[0].parameters())
    print(
        f"bf16 MLP {args.layers}x{args.width}, {params / 1e6:.1f}M params, batch {args.batch}, "
        f"Adam ({args.impl}) on fp32 masters ({'CPU-offloaded, ' if args.device == 'cuda' else ''}{args.device}), "
        f"{args.threads} cores, torch {torch.__version__}"
    )

    # asynchronous: the main thread and the optimizer thread share the cores
    main_threads = args.main_threads or max(1, args.threads // 2)
    worker_threads = max(1, args.threads - main_threads)
    thread = fp16kit.optimizer_thread()
    ratios = []
    for r in range(args.rounds):
        torch.set_num_threads(args.threads)  # synchronous: every core on each op
        sync_ips = run(args, async_step=False)
        torch.set_num_threads(main_threads)
        thread.wait(thread.submit(torch.set_num_threads, worker_threads))
        async_ips = run(args, async_step=True)
        ratios.append(async_ips / sync_ips)
        print(
            f"round {r + 1}: synchronous {sync_ips:7.1f} it/s, asynchronous {async_ips:7.1f} it/s "
            f"({main_threads}+{worker_threads} threads): {ratios[-1]:.2f}x"
        )
    print(
        f"ratio async/sync: {statistics.median(ratios):.2f}x median of {args.rounds} rounds "
        f"(range {min(ratios):.2f}-{max(ratios):.2f})"
    )


if __name__ == "__main__":
    main()
