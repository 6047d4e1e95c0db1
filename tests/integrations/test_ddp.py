"""torch.distributed with fp16kit on two gloo ranks on 127.0.0.1 (issue 11, torch part).

DDP around an fp16 model with MixedPrecisionOptimizer + fp16kit.GradScaler: the ranks stay bit
for bit identical (model params, fp32 masters, scale), also through an overflow on ONE rank --
DDP all-reduces the grads during backward, so one rank's inf reaches both ranks' grads and both
skip without any process_group on the scaler -- and with async_step=True; the result equals one
process training on the concatenated batch (fp16 tolerance).

FSDP2 (fully_shard, MixedPrecisionPolicy fp16 params / fp32 reduce) with a plain torch optimizer
on the sharded fp32 params and fp16kit.GradScaler(process_group=WORLD): an inf written into ONE
rank's local grad shard after backward (FSDP has reduce-scattered already) makes both ranks
skip; training equals a hand-written reference (fp16 forward/backward per rank, fp32 average,
unscale, SGD). In torch 2.13 the ranks skip together even with process_group=None: DTensor's
sharding rule for the unscale op reduces found_inf over the mesh itself. MixedPrecisionOptimizer
refuses to keep masters of sharded params (the rule named in its TypeError).

The workers run the code under test and save what it produced; references are computed here.
"""

from __future__ import annotations

import copy
import textwrap

import pytest
import torch

import fp16kit
from _helpers.gloo import run_two_ranks

STEPS, OVERFLOW_STEP, LR, SCALE = 4, 2, 0.05, 1024.0

_WORKER = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist
    import fp16kit

    STEPS, OVERFLOW_STEP, LR, SCALE = 4, 2, 0.05, 1024.0

    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))

    def batch(step, rank):
        return torch.randn(3, 8, generator=torch.Generator().manual_seed(100 * step + rank))

    def ddp_run(rank, async_step):
        model = net().half()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = fp16kit.MixedPrecisionOptimizer(
            torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), async_step=async_step)
        scaler = fp16kit.GradScaler("cpu", init_scale=SCALE)
        log = []
        for step in range(STEPS):
            opt.zero_grad()
            loss = ddp(batch(step, rank).half()).float().pow(2).mean()
            if step == OVERFLOW_STEP and rank == 1:
                loss = loss * float("inf")  # only rank 1's loss overflows
            scaler.scale(loss).backward()
            finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
            before = [p.detach().clone() for p in model.parameters()]
            scaler.step(opt)
            scaler.update()
            if async_step:
                opt.synchronize()
            same = all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
            log.append((finite, same, scaler.get_scale()))
        opt.synchronize()
        return {"log": log, "params": [p.detach().clone() for p in model.parameters()],
                "masters": [m.detach().clone() for m in opt.master_params],
                "scale": scaler.get_scale()}

    def fsdp_run(rank, group):
        from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy
        model = net()
        policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
        for layer in (model[0], model[2]):
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        params = list(model.parameters())
        opt = torch.optim.SGD(params, lr=LR)
        scaler = fp16kit.GradScaler("cpu", init_scale=SCALE, process_group=group)
        log = []
        for step in range(STEPS):
            opt.zero_grad()
            out = model(batch(step, rank))
            scaler.scale(out.float().pow(2).mean()).backward()
            if step == OVERFLOW_STEP and rank == 1:
                params[0].grad.to_local().view(-1)[0] = float("inf")  # after the reduce-scatter
            before = [p.to_local().clone() for p in params]
            scaler.step(opt)
            scaler.update()
            same = all(torch.equal(b, p.to_local()) for b, p in zip(before, params))
            log.append((out.dtype, str(params[0].grad.dtype), same, scaler.get_scale()))
        res = {"log": log, "params": [p.full_tensor().detach().clone() for p in params],
               "kind": type(params[0]).__name__, "dtype": str(params[0].dtype)}
        if group is None:
            return res
        # MixedPrecisionOptimizer over sharded params: fp32 ones without masters pass through;
        # a master of a sharded param (fp32 with async_step, fp16/bf16 always) is refused
        res["mpo_sync_masters"] = len(fp16kit.MixedPrecisionOptimizer(torch.optim.SGD(params, lr=LR)).master_params)
        half = net().half()
        fully_shard(half)
        frozen = net().half()
        fully_shard(frozen)
        frozen.requires_grad_(False)
        late = fp16kit.MixedPrecisionOptimizer(torch.optim.SGD(frozen.parameters(), lr=LR))
        frozen.requires_grad_(True)
        res["refused"] = []
        for build in (lambda: fp16kit.MixedPrecisionOptimizer(torch.optim.SGD(params, lr=LR), async_step=True),
                      lambda: fp16kit.MixedPrecisionOptimizer(torch.optim.SGD(half.parameters(), lr=LR)),
                      late.step):
            try:
                build()
                res["refused"].append("")
            except TypeError as e:
                res["refused"].append(str(e))
        return res

    def main(rank, world, init_file, out_file, what):
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        if what == "ddp":
            res = {"sync": ddp_run(rank, False), "async": ddp_run(rank, True)}
        else:
            res = fsdp_run(rank, dist.group.WORLD)
            res["no_group"] = fsdp_run(rank, None)
        torch.save(res, f"{out_file}.{rank}")
        dist.barrier()
        dist.destroy_process_group()

    if __name__ == "__main__":
        import torch.multiprocessing as mp
        mp.spawn(main, args=(2, sys.argv[1], sys.argv[2], sys.argv[3]), nprocs=2)
    """
)


def _spawn(tmp_path, what):
    return run_two_ranks(_WORKER, tmp_path, what)


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))


def _batch(step, rank):
    return torch.randn(3, 8, generator=torch.Generator().manual_seed(100 * step + rank))


@pytest.mark.slow
def test_ddp_mixed_precision_optimizer_ranks_stay_identical(tmp_path):
    ranks = _spawn(tmp_path, "ddp")
    expected_log = [  # (grads finite after backward, params unchanged, scale)
        (True, False, SCALE),
        (True, False, SCALE),
        (False, True, SCALE / 2),
        (True, False, SCALE / 2),
    ]
    for mode in ("sync", "async"):
        r0, r1 = ranks[0][mode], ranks[1][mode]
        # rank 1's inf loss reached rank 0's grads through DDP's all-reduce: both skip
        assert r0["log"] == r1["log"] == expected_log, mode
        assert r0["scale"] == r1["scale"] == SCALE / 2
        for a, b in zip(r0["params"] + r0["masters"], r1["params"] + r1["masters"]):
            assert torch.equal(a, b), mode
        assert all(p.dtype == torch.float16 for p in r0["params"])
        assert all(m.dtype == torch.float32 for m in r0["masters"])
    for a, b in zip(ranks[0]["sync"]["masters"], ranks[0]["async"]["masters"]):
        assert torch.equal(a, b)  # async steps land the same numbers

    # one process on the concatenated batch (equal halves: mean over 6 == average of means)
    model = _net().half()
    opt = fp16kit.MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9))
    scaler = fp16kit.GradScaler("cpu", init_scale=SCALE)
    for step in range(STEPS):
        opt.zero_grad()
        loss = model(torch.cat([_batch(step, 0), _batch(step, 1)]).half()).float().pow(2).mean()
        if step == OVERFLOW_STEP:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    assert scaler.get_scale() == SCALE / 2
    for ref, got in zip(opt.master_params, ranks[0]["sync"]["masters"]):
        torch.testing.assert_close(got, ref, atol=2e-3, rtol=0)
    for ref, got in zip(model.parameters(), ranks[0]["sync"]["params"]):
        torch.testing.assert_close(got, ref.detach(), atol=2e-3, rtol=0)


@pytest.mark.slow
def test_fsdp2_plain_optimizer_and_process_group_scaler_skip_together(tmp_path):
    ranks = _spawn(tmp_path, "fsdp")
    for res in ranks:
        assert res["kind"] == "DTensor" and res["dtype"] == "torch.float32"  # sharded fp32 params
        # fp16 compute, fp32 grads; only rank 1's shard had the inf, both ranks skipped step 2
        assert res["log"] == [
            (torch.float16, "torch.float32", False, SCALE),
            (torch.float16, "torch.float32", False, SCALE),
            (torch.float16, "torch.float32", True, SCALE / 2),
            (torch.float16, "torch.float32", False, SCALE / 2),
        ]
    for a, b in zip(ranks[0]["params"], ranks[1]["params"]):
        assert torch.equal(a, b)
    # torch 2.13: the same without process_group -- DTensor's sharding rule for
    # torch._amp_foreach_non_finite_check_and_unscale_ max-reduces found_inf over the grads'
    # mesh by itself, so with FSDP2 the scaler's all-reduce is a second, redundant one
    for res in ranks:
        assert res["no_group"]["log"] == res["log"]
        for a, b in zip(res["no_group"]["params"], ranks[0]["params"]):
            assert torch.equal(a, b)

    # reference: fp32 params; per rank an fp16 forward/backward of the scaled loss, grads
    # averaged in fp32 (reduce_dtype), unscaled, SGD; the overflow step is skipped
    ref = _net()
    scale = SCALE
    for step in range(STEPS):
        if step == OVERFLOW_STEP:
            scale /= 2
            continue
        grads = []
        for rank in range(2):
            half = copy.deepcopy(ref).half()
            (half(_batch(step, rank).half()).float().pow(2).mean() * scale).backward()
            grads.append([p.grad.float() for p in half.parameters()])
        with torch.no_grad():
            for p, g0, g1 in zip(ref.parameters(), *grads):
                p -= LR * ((g0 + g1) / 2 / scale)
    for want, got in zip(ref.parameters(), ranks[0]["params"]):
        torch.testing.assert_close(got, want.detach(), atol=1e-5, rtol=0)

    assert ranks[0]["mpo_sync_masters"] == 0
    async_fp32, sync_fp16, unfrozen_fp16 = ranks[0]["refused"]
    for msg in (async_fp32, sync_fp16, unfrozen_fp16):
        assert "Do not combine them: FSDP2's MixedPrecisionPolicy already keeps" in msg, msg
        assert "fp16kit.GradScaler(device, process_group=...)" in msg
    assert "torch.float32 param" in async_fp32 and "in param group 0 (index 0)" in async_fp32
    assert "torch.float16 param" in sync_fp16
    assert "unfrozen after wrapping" in unfrozen_fp16
