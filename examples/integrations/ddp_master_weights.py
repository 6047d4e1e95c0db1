"""DDP around an fp16 model, with fp32 master weights (fp16kit.MixedPrecisionOptimizer) and
fp16kit.GradScaler, on 2 gloo ranks on this machine (CPU; spawns its own processes).

The recommended setup, per rank::

    model = build_model().half()                       # fp16 weights: fp16 forward/backward
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = fp16kit.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    scaler = fp16kit.GradScaler("cuda")                # no process_group needed with DDP
    ...
    scaler.scale(loss).backward()      # DDP all-reduces the (scaled) fp16 grads
    scaler.unscale_(opt)               # fp16 grads -> fp32 master grads * 1/scale
    opt.clip_grad_norm_(1.0)           # clips the masters; returns the unscaled norm
    scaler.step(opt)                   # AdamW on the masters, masters -> fp16 model
    scaler.update()

Why the ranks stay identical: DDP averages the grads during backward, so every rank unscales the
same grads, takes the same skip decision (an inf on one rank reaches all ranks' grads through the
all-reduce) and steps the same masters. So the scaler needs no ``process_group`` under DDP.
``--overflow-step K`` multiplies rank 1's loss by inf at step K to show both ranks skipping;
``--async-step`` runs each optimizer step on fp16kit's optimizer thread (a one-step-delayed
update; ``opt.synchronize()`` before reading the weights). ``--accumulate N`` accumulates N
micro-batches per step under ``ddp.no_sync()`` (one all-reduce per step). A bf16 model trains the
same way without a scaler: ``loss.backward(); opt.clip_grad_norm_(1.0); opt.step()``.

    python examples/integrations/ddp_master_weights.py [--steps 8] [--overflow-step 3] [--accumulate 2] [--async-step]

On this machine torch/gloo sometimes aborts a rank while it exits ("terminate called without an
active exception"), after all its work is done; the same happens with torch.amp and a plain
all_reduce. The lines printed before are valid.
"""

from __future__ import annotations

import argparse
import contextlib
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import fp16kit

WORLD = 2


def build_model() -> nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    # each rank its own shard of the data, as a DistributedSampler would give it
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(32, 16, generator=g)
    return x, x[:, :4].sin()


def train(rank: int, port: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)  # the ranks share this machine's cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    model = build_model().half()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = fp16kit.MixedPrecisionOptimizer(
        torch.optim.AdamW(model.parameters(), lr=3e-3), async_step=args.async_step)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
    scaler = fp16kit.GradScaler("cpu", init_scale=2.0**14)

    for step in range(args.steps):
        opt.zero_grad()
        shown = torch.zeros(())
        for micro in range(args.accumulate):
            x, y = batch(step * args.accumulate + micro, rank)
            last = micro == args.accumulate - 1
            # accumulation: DDP all-reduces once, in the last micro-batch's backward
            with contextlib.nullcontext() if last else ddp.no_sync():
                loss = (ddp(x.half()).float() - y).pow(2).mean() / args.accumulate
                shown += loss.detach()
                if step == args.overflow_step and rank == 1 and last:
                    loss = loss * float("inf")  # only rank 1 overflows
                scaler.scale(loss).backward()  # the scaled fp16 grads add up in the model's .grad
        scaler.unscale_(opt)
        norm = opt.clip_grad_norm_(1.0)  # the fp32 master grads, unscaled
        scaler.step(opt)
        scaler.update()
        sched.step()
        dist.all_reduce(shown)  # for printing only: the mean loss over the ranks
        # with async_step the step runs on the optimizer thread; last_step_skipped() waits for
        # its decision (a host read -- fine once per step in an example, use
        # last_step_skipped_tensor() in a hot loop)
        skipped = scaler.last_step_skipped()
        if rank == 0:
            print(f"step {step}  loss {shown.item() / WORLD:.5f}  grad-norm {norm.item():.4g}  "
                  f"scale {scaler.get_scale():g}  skipped {skipped}", flush=True)

    opt.synchronize()  # let an asynchronous step land before reading the weights
    # compare the ranks: gather every rank's fp16 params and fp32 masters
    mine = torch.cat([p.detach().float().flatten() for p in model.parameters()]
                     + [m.detach().flatten() for m in opt.master_params])
    gathered = [torch.empty_like(mine) for _ in range(WORLD)]
    dist.all_gather(gathered, mine)
    skips = torch.tensor([float(scaler.skipped_steps())])
    all_skips = [torch.empty_like(skips) for _ in range(WORLD)]
    dist.all_gather(all_skips, skips)
    if rank == 0:
        identical = all(torch.equal(gathered[0], g) for g in gathered[1:])
        print(f"model params {sorted({str(p.dtype) for p in model.parameters()})}, "
              f"{sum(m.numel() for m in opt.master_params)} fp32 master weights per rank")
        print(f"skipped steps per rank: {[int(s.item()) for s in all_skips]}")
        print(f"ranks' params and masters bit-identical: {identical}", flush=True)
        if not identical:
            raise RuntimeError("the ranks' weights differ")
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--overflow-step", type=int, default=3, help="-1: none")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per step")
    parser.add_argument("--async-step", action="store_true")
    args = parser.parse_args()
    mp.spawn(train, args=(free_port(), args), nprocs=WORLD)


if __name__ == "__main__":
    main()
