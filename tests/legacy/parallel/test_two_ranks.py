"""apex.parallel with two gloo ranks on 127.0.0.1 (one spawn checks everything; docs/apex-others.md §4.1-4.3):
the DDP shim's grads are apex's arithmetic bit for bit (sum, then x f/world; 1/f before; fp32
reduction; sum only), parameters but not buffers are broadcast, disable_allreduce is local;
Reducer averages; SyncBatchNorm with unequal (and empty) per-rank batches equals BatchNorm over
the concatenated batch (outputs, input and parameter grads, running stats).

The workers only run the code under test and save what it produced; the references are
computed here, in this process, from the same seeded data.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from _helpers.gloo import run_two_ranks

_WORKER = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist
    from fp16kit.legacy.parallel import (DistributedDataParallel as DDP, Reducer, SyncBatchNorm,
                                         create_syncbn_process_group)

    def data(seed, *shape):
        return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))

    def linear(seed, dtype=torch.float32):
        torch.manual_seed(seed)
        return torch.nn.Linear(5, 3).to(dtype)

    def grads(module):
        return [p.grad.clone() for p in module.parameters()]

    def bn_step(bn, x, w, z=None):
        x = x.clone().requires_grad_()
        out = bn(x) if z is None else bn(x, z)
        (out * w).sum().backward()
        return out.detach(), x.grad

    def main(rank, world, init_file, out_file):
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        res = {}
        cases = {
            "default": (torch.float32, {}),
            "predivide": (torch.float32, {"gradient_predivide_factor": 3.0}),
            "sum": (torch.float32, {"gradient_average": False, "gradient_predivide_factor": 3.0}),
            "fp16_fp32": (torch.float16, {"allreduce_always_fp32": True, "gradient_predivide_factor": 3.0}),
            "fp16": (torch.float16, {"gradient_predivide_factor": 3.0}),
        }
        for name, (dtype, kw) in cases.items():
            ddp = DDP(linear(rank, dtype), **kw)  # rank-specific init; DDP broadcasts rank 0's
            ddp(data(100 + rank, 4, 5).to(dtype)).float().pow(2).sum().backward()
            res[name] = grads(ddp.module)

        torch.manual_seed(rank)
        net = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.BatchNorm1d(3))
        net[1].running_mean.fill_(float(rank))
        ddp = DDP(net)
        res["params_after_init"] = [p.detach().clone() for p in net.parameters()]
        res["running_mean_after_init"] = net[1].running_mean.clone()
        ddp(data(200 + rank, 6, 5)).sum().backward()
        res["running_mean_after_forward"] = net[1].running_mean.clone()
        res["keys"] = list(ddp.state_dict())
        res["is_torch_ddp"] = isinstance(ddp, torch.nn.parallel.DistributedDataParallel)

        ddp = DDP(linear(0))
        ddp.disable_allreduce()
        ddp(data(300 + rank, 4, 5)).pow(2).sum().backward()
        res["local"] = grads(ddp.module)
        ddp.enable_allreduce()
        ddp(data(400 + rank, 4, 5)).pow(2).sum().backward()
        res["accumulated"] = grads(ddp.module)

        torch.manual_seed(rank)
        m = torch.nn.Linear(3, 2)
        reducer = Reducer(m)
        res["reducer_params"] = [p.detach().clone() for p in m.parameters()]
        for i, p in enumerate(m.parameters()):
            p.grad = data(500 + 10 * i + rank, *p.shape)
        reducer.reduce()
        res["reducer_grads"] = grads(m)
        tensors = [data(600 + rank, 4), data(700 + rank, 2).half()]
        Reducer([tensors]).reduce()
        res["reducer_tensors"] = tensors

        n = 3 if rank == 0 else 5  # unequal batches
        bn = SyncBatchNorm(4)
        with torch.no_grad():
            bn.weight.copy_(1 + 0.1 * torch.arange(4.0))
            bn.bias.copy_(0.2 * torch.arange(4.0))
        res["bn_steps"] = [bn_step(bn, data(800 + 10 * s + rank, n, 4, 2, 2), data(900 + 10 * s + rank, n, 4, 2, 2))
                           for s in range(2)]
        res["bn_param_grads"] = grads(bn)
        res["bn_running"] = [bn.running_mean.clone(), bn.running_var.clone(), bn.num_batches_tracked.clone()]

        last = SyncBatchNorm(4, channel_last=True, fuse_relu=True, momentum=None)
        res["last_step"] = bn_step(last, data(1000 + rank, n, 2, 4), data(1100 + rank, n, 2, 4),
                                   z=data(1200 + rank, n, 2, 4))
        res["last_running"] = [last.running_mean.clone(), last.running_var.clone()]

        empty = SyncBatchNorm(4, affine=False)
        res["empty_step"] = bn_step(empty, data(1300, 4 if rank == 0 else 0, 4), data(1400, 4 if rank == 0 else 0, 4))
        res["empty_running"] = empty.running_var.clone()

        own = create_syncbn_process_group(1)
        solo = SyncBatchNorm(4, affine=False, process_group=own)
        res["solo_step"] = bn_step(solo, data(800 + rank, n, 4, 2, 2), torch.ones(n, 4, 2, 2))

        torch.save(res, f"{out_file}.{rank}")
        dist.barrier()
        dist.destroy_process_group()

    if __name__ == "__main__":
        import torch.multiprocessing as mp
        mp.spawn(main, args=(2, sys.argv[1], sys.argv[2]), nprocs=2)
    """
)


def _data(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _linear(seed, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Linear(5, 3).to(dtype)


def _local_grads(seeds, dtype=torch.float32):
    """One rank's grads of linear(0) on its data, accumulated over ``seeds``."""
    model = _linear(0, dtype)
    for seed in seeds:
        model(_data(seed, 4, 5).to(dtype)).float().pow(2).sum().backward()
    return [p.grad for p in model.parameters()]


def _apex_reduce(per_rank, factor=1.0, average=True, fp32=False):
    """apex's allreduce_bucket: t = g (fp32 if asked) * 1/f; sum over ranks; * f/world."""
    dtype = per_rank[0].dtype
    ts = [g.float() if fp32 else g for g in per_rank]
    if factor != 1.0:
        ts = [t.mul(1.0 / factor) for t in ts]
    total = ts[0] + ts[1]
    if average:
        total = total.mul(factor / 2.0)
    return total.to(dtype)


def _concat_bn(xs, ws, weight=None, bias=None, zs=None, relu=False, channel_last=False, momentum=0.1, bn=None):
    """BatchNorm over the concatenated batch, loss sum(out * w): per-rank outputs and grads."""
    if bn is None:
        bn = torch.nn.BatchNorm2d(4, momentum=momentum, affine=weight is not None)
        if weight is not None:
            with torch.no_grad():
                bn.weight.copy_(weight)
                bn.bias.copy_(bias)
    x = torch.cat(xs).requires_grad_()
    inp = x.movedim(-1, 1) if channel_last else x
    out = bn(inp)
    out = out.movedim(1, -1) if channel_last else out
    if zs is not None:
        out = out + torch.cat(zs)
    if relu:
        out = torch.relu(out)
    (out * torch.cat(ws)).sum().backward()
    sizes = [len(t) for t in xs]
    return bn, out.detach().split(sizes), x.grad.split(sizes)


@pytest.mark.slow
def test_two_gloo_ranks(tmp_path):
    res = run_two_ranks(_WORKER, tmp_path)

    # -- DDP: apex's arithmetic, bit for bit, identical on both ranks
    expected_args = {
        "default": (torch.float32, {}),
        "predivide": (torch.float32, {"factor": 3.0}),
        "sum": (torch.float32, {"factor": 3.0, "average": False}),
        "fp16_fp32": (torch.float16, {"factor": 3.0, "fp32": True}),
        "fp16": (torch.float16, {"factor": 3.0}),
    }
    for name, (dtype, kw) in expected_args.items():
        per_rank = [_local_grads([100 + r], dtype) for r in range(2)]
        for i in range(2):
            expected = _apex_reduce([per_rank[0][i], per_rank[1][i]], **kw)
            for r in range(2):
                assert torch.equal(res[r][name][i], expected), (name, i, r)
    # the predivide order is visible: torch's default hook (÷world before) differs in the last bit
    g = [_local_grads([100 + r]) for r in range(2)]
    assert not all(torch.equal(res[0]["predivide"][i], g[0][i] / 2 + g[1][i] / 2) for i in range(2))

    # -- parameters broadcast from rank 0 at construction; buffers never
    torch.manual_seed(0)
    rank0 = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.BatchNorm1d(3))
    for r in range(2):
        assert all(torch.equal(a, b) for a, b in zip(res[r]["params_after_init"], rank0.parameters()))
        assert torch.equal(res[r]["running_mean_after_init"], torch.full((3,), float(r)))
        batch_mean = rank0[0](_data(200 + r, 6, 5)).detach().mean(0)
        torch.testing.assert_close(res[r]["running_mean_after_forward"], 0.9 * r + 0.1 * batch_mean)
        assert res[r]["is_torch_ddp"] and all(k.startswith("module.") for k in res[r]["keys"])

    # -- disable_allreduce: local grads; the next synced backward reduces what accumulated
    for r in range(2):
        assert all(torch.equal(a, b) for a, b in zip(res[r]["local"], _local_grads([300 + r])))
    acc = [_local_grads([300 + r, 400 + r]) for r in range(2)]
    for r in range(2):
        assert all(torch.equal(res[r]["accumulated"][i], _apex_reduce([acc[0][i], acc[1][i]])) for i in range(2))

    # -- Reducer: rank 0's params; sum then ÷ world, per dtype
    torch.manual_seed(0)
    m0 = torch.nn.Linear(3, 2)
    for r in range(2):
        assert all(torch.equal(a, b) for a, b in zip(res[r]["reducer_params"], m0.parameters()))
        for i, p in enumerate(m0.parameters()):
            expected = (_data(500 + 10 * i, *p.shape) + _data(501 + 10 * i, *p.shape)) / 2
            assert torch.equal(res[r]["reducer_grads"][i], expected)
        assert torch.equal(res[r]["reducer_tensors"][0], (_data(600, 4) + _data(601, 4)) / 2)
        torch.testing.assert_close(res[r]["reducer_tensors"][1], (_data(700, 2).half() + _data(701, 2).half()) / 2)

    # -- SyncBatchNorm, unequal batches (3 and 5): BatchNorm over the concatenated batch
    sizes = (3, 5)
    weight, bias = 1 + 0.1 * torch.arange(4.0), 0.2 * torch.arange(4.0)
    ref = None
    for s in range(2):
        xs = [_data(800 + 10 * s + r, sizes[r], 4, 2, 2) for r in range(2)]
        ws = [_data(900 + 10 * s + r, sizes[r], 4, 2, 2) for r in range(2)]
        ref, outs, xgrads = _concat_bn(xs, ws, weight, bias, bn=ref)
        for r in range(2):
            out, xgrad = res[r]["bn_steps"][s]
            torch.testing.assert_close(out, outs[r])
            torch.testing.assert_close(xgrad, xgrads[r], rtol=1e-4, atol=1e-5)
    for i, p in enumerate(ref.parameters()):
        torch.testing.assert_close(
            res[0]["bn_param_grads"][i] + res[1]["bn_param_grads"][i], p.grad, rtol=1e-4, atol=1e-5
        )
    for r in range(2):
        torch.testing.assert_close(res[r]["bn_running"][0], ref.running_mean)
        torch.testing.assert_close(res[r]["bn_running"][1], ref.running_var)
        assert res[r]["bn_running"][2].item() == 2

    # -- channel-last with z and fused ReLU, momentum=None (cumulative average)
    xs = [_data(1000 + r, sizes[r], 2, 4) for r in range(2)]
    ws = [_data(1100 + r, sizes[r], 2, 4) for r in range(2)]
    zs = [_data(1200 + r, sizes[r], 2, 4) for r in range(2)]
    bn = torch.nn.BatchNorm1d(4, momentum=None, affine=True)
    bn, outs, xgrads = _concat_bn(xs, ws, zs=zs, relu=True, channel_last=True, bn=bn)
    for r in range(2):
        torch.testing.assert_close(res[r]["last_step"][0], outs[r])
        torch.testing.assert_close(res[r]["last_step"][1], xgrads[r], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(res[r]["last_running"][0], bn.running_mean)
        torch.testing.assert_close(res[r]["last_running"][1], bn.running_var)

    # -- a rank with an empty batch joins the collective and contributes nothing
    bn = torch.nn.BatchNorm1d(4, affine=False)
    bn, outs, xgrads = _concat_bn([_data(1300, 4, 4)], [_data(1400, 4, 4)], bn=bn)
    torch.testing.assert_close(res[0]["empty_step"][0], outs[0])
    torch.testing.assert_close(res[0]["empty_step"][1], xgrads[0])
    assert res[1]["empty_step"][0].shape == (0, 4)
    for r in range(2):
        torch.testing.assert_close(res[r]["empty_running"], bn.running_var)

    # -- create_syncbn_process_group(1): every rank its own group, so local batch norm
    for r in range(2):
        x = _data(800 + r, sizes[r], 4, 2, 2)
        expected = torch.nn.functional.batch_norm(x, None, None, training=True, eps=1e-5)
        torch.testing.assert_close(res[r]["solo_step"][0], expected)
