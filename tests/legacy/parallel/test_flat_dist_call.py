"""apex.parallel.distributed's module-level helpers, which NVIDIA's BERT run_pretraining.py imports
(`from apex.parallel.distributed import flat_dist_call`; `flat_dist_call([p.data for p in
model.parameters()], torch.distributed.broadcast, (0,))`): before, the import failed. Two gloo
ranks; the references are written here by hand (broadcast: rank 0's values; all_reduce: the sum
÷ world size, in each tensor's dtype)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch

import fp16kit

_WORKER = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist
    from fp16kit.legacy.parallel.distributed import flat_dist_call, apply_flat_dist_call, split_by_type
    rank, init, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)

    def tensors(r):
        g = torch.Generator().manual_seed(10 + r)
        return [torch.randn(3, generator=g), torch.randn(2, 2, generator=g).half(), torch.randn(4, generator=g),
                torch.randn(1, generator=g).double()]

    b = tensors(rank)
    flat_dist_call(b, dist.broadcast, (0,))
    a = tensors(rank)
    flat_dist_call(a, dist.all_reduce)
    s = tensors(rank)[:1] + tensors(rank)[2:3]
    apply_flat_dist_call(s, dist.all_reduce)
    types = list(split_by_type(tensors(rank)))
    torch.save({"b": b, "a": a, "s": s, "types": types}, out)
    dist.destroy_process_group()
    """
)


def _tensors(r):
    g = torch.Generator().manual_seed(10 + r)
    return [
        torch.randn(3, generator=g),
        torch.randn(2, 2, generator=g).half(),
        torch.randn(4, generator=g),
        torch.randn(1, generator=g).double(),
    ]


def test_flat_dist_call_broadcasts_and_averages_like_apex(tmp_path):
    root = os.path.dirname(os.path.dirname(fp16kit.__file__))
    env = dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="1")
    init = f"file://{tmp_path / 'rdzv'}"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WORKER, str(r), init, str(tmp_path / f"{r}.pt")],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    t0, t1 = _tensors(0), _tensors(1)
    for r in range(2):
        got = torch.load(tmp_path / f"{r}.pt")
        for x, ref in zip(got["b"], t0):
            assert x.dtype == ref.dtype and torch.equal(x, ref)
        for x, u, v in zip(got["a"], t0, t1):
            assert x.dtype == u.dtype and torch.equal(x, (u + v) / 2)
        assert all(torch.equal(x, (u + v) / 2) for x, u, v in zip(got["s"], [t0[0], t0[2]], [t1[0], t1[2]]))
        assert got["types"] == ["torch.FloatTensor", "torch.HalfTensor", "torch.DoubleTensor"]
