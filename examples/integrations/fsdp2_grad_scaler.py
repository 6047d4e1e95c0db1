"""FSDP2 (``fully_shard``) with fp16 compute and fp16kit.GradScaler, on 2 gloo ranks on this
machine (CPU; spawns its own processes).

The recommended setup, per rank::

    policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)            # sharded fp32 params: FSDP2's own masters
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)      # a PLAIN torch optimizer
    scaler = fp16kit.GradScaler("cuda", process_group=dist.group.WORLD)
    ...
    scaler.scale(loss).backward()    # fp16 forward/backward, fp32 reduce-scatter of the grads
    scaler.unscale_(opt)             # this rank's shard; found_inf all-reduced over the group
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # DTensor grads: a global norm
    scaler.step(opt)                 # every rank skips together, or none does
    scaler.update()

The rule: no MixedPrecisionOptimizer on FSDP2-sharded params. FSDP2's MixedPrecisionPolicy
already keeps the sharded fp32 params (the "masters") and casts them to fp16 for each
forward/backward; masters of those shards would be a second fp32 copy that FSDP never reads.
MixedPrecisionOptimizer refuses them with a TypeError naming this rule (shown below).

Each rank holds only its shard of the grads, so an inf may be seen by one rank alone:
``process_group`` makes the scaler all-reduce (max) its found-inf flag so that the ranks skip
the same steps and keep the same scale. ``--overflow-step K`` writes an inf into rank 1's local
grad shard at step K (after the reduce-scatter) to show it. (In torch 2.13 DTensor's sharding
rule for the unscale op reduces the flag over the mesh by itself as well; process_group makes
the rule hold whatever the torch version and for grads that are not DTensors.)

    python examples/integrations/fsdp2_grad_scaler.py [--steps 8] [--overflow-step 3]

On this machine torch/gloo sometimes aborts a rank while it exits ("terminate called without an
active exception"), after all its work is done. The lines printed before are valid.
"""

from __future__ import annotations

import argparse
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import fp16kit

WORLD = 2


def build_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(32, 16, generator=g)
    return x, x[:, :4].sin()


def train(rank: int, port: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)  # the ranks share this machine's cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    model = build_model()
    policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=3e-3)
    scaler = fp16kit.GradScaler("cpu", init_scale=2.0**14, process_group=dist.group.WORLD)

    # The rule, as the library enforces it: fp32 masters of FSDP2 shards (here of an fp16
    # model sharded by mistake) are refused before anything changes.
    wrong = build_model().half()
    fully_shard(wrong)
    try:
        fp16kit.MixedPrecisionOptimizer(torch.optim.AdamW(wrong.parameters(), lr=3e-3))
    except TypeError as e:
        rule = str(e)[str(e).index("Do not combine"):str(e).index(" Shard the")]
        if rank == 0:
            print(f"MixedPrecisionOptimizer over FSDP2 shards refused: {rule}")
    else:
        raise RuntimeError("MixedPrecisionOptimizer accepted masters of FSDP2 shards")

    flags = []
    for step in range(args.steps):
        x, y = batch(step, rank)
        opt.zero_grad()
        out = model(x)  # fp16 compute from the fp32 shards
        loss = (out.float() - y).pow(2).mean()
        scaler.scale(loss).backward()
        if step == args.overflow_step and rank == 1:
            params[0].grad.to_local().view(-1)[0] = float("inf")  # only rank 1's shard
        scaler.unscale_(opt)
        norm = nn.utils.clip_grad_norm_(params, 1.0)  # a DTensor: the norm over all shards
        scaler.step(opt)
        scaler.update()
        flags.append(scaler.last_step_skipped_tensor())  # no host sync in the loop
        shown = loss.detach().clone()
        dist.all_reduce(shown)  # for printing only
        norm = norm.full_tensor()  # replicated already; every rank calls it in case it is not
        if rank == 0:
            print(f"step {step}  loss {shown.item() / WORLD:.5f}  grad-norm {norm.item():.4g}  "
                  f"scale {scaler.get_scale():g}  skipped {scaler.last_step_skipped()}", flush=True)

    mine = torch.stack([f.float() for f in flags])
    gathered = [torch.empty_like(mine) for _ in range(WORLD)]
    dist.all_gather(gathered, mine)
    full = [p.full_tensor() for p in params]  # collectives: every rank calls them
    if rank == 0:
        together = all(torch.equal(gathered[0], g) for g in gathered[1:])
        print(f"compute dtype {out.dtype}; params: {type(params[0]).__name__} shards of "
              f"{params[0].dtype}, {sum(p.numel() for p in full)} weights in all")
        print(f"skipped steps per rank: {[int(g.sum().item()) for g in gathered]}")
        print(f"ranks skipped the same steps: {together}", flush=True)
        if not together:
            raise RuntimeError("the ranks skipped different steps")
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
    args = parser.parse_args()
    mp.spawn(train, args=(free_port(), args), nprocs=WORLD)


if __name__ == "__main__":
    main()
