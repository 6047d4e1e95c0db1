"""Finding how torch's fused CPU Adam rounds on this machine, so that the fused kernel reproduces it bit for bit.

torch's kernel (``torch._fused_adam_`` / ``_fused_adamw_``) splits each tensor into vectors of its CPU capability's
width and a scalar tail, and its compiler chose which ``a * b + c`` to contract into one rounding in each part.
:func:`forms` runs torch's fused Adam and AdamW and the kernel, under every candidate form, on a probe of every
tail length (fp16 and bf16), and keeps the form that matches torch in every bit; none matching keeps the kernel
off (one log line).
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import logging
from typing import Any

import torch

from . import abi

__all__ = ["forms"]

logger = logging.getLogger("fp16kit")

_PROBE_SIZES = (*range(1, 40), 4096 + 7, 4096 + 9, 4096 + 15, 8, 16, 64)


@functools.cache
def forms() -> tuple[int, int, int, int] | None:
    """How torch's fused Adam rounds on this machine: ``(vector width, body form, tail form, 8-wide tail)``, or None.

    The forms with which the kernel reproduces torch's fused Adam and AdamW bit for bit (module docstring); None:
    none does, and the kernel stays off (logged). Found once per process, in a few milliseconds."""
    if abi.library() is None:
        return None
    capability = torch.backends.cpu.get_cpu_capability()
    widths = (16, 8) if capability.startswith("AVX512") else (8, 16)
    cases = [_probe(dtype, decoupled, wd) for dtype in abi.KIND for decoupled, wd in ((True, 0.01), (False, 0.1))]
    for candidate in itertools.product(widths, (1, 0, 2), (2, 0, 1), (1, 0)):
        if all(_matches(case, candidate) for case in cases):
            return candidate
    logger.warning(
        f"fp16kit: the fused master_adam kernel is off: no form of it reproduces torch {torch.__version__}'s fused "
        f"Adam bit for bit on this CPU ({capability}); using torch's ops."
    )
    return None


def _probe(dtype: torch.dtype, decoupled: bool, wd: float) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1234)
    sizes = _PROBE_SIZES
    p16 = [torch.randn(s, generator=g).to(dtype) for s in sizes]
    g16 = [(torch.randn(s, generator=g) * 300).to(dtype) for s in sizes]
    m = [torch.randn(s, generator=g) * 0.01 for s in sizes]
    v = [torch.rand(s, generator=g) * 1e-3 for s in sizes]
    group: dict[str, Any] = {
        "lr": 0.01,
        "betas": (0.9, 0.999),
        "eps": 1e-8,
        "weight_decay": wd,
        "decoupled_weight_decay": decoupled,
    }
    scale = torch.tensor(256.0)
    masters = [p.float() for p in p16]
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = cls(masters, lr=group["lr"], betas=group["betas"], eps=group["eps"], weight_decay=wd, fused=True)
    for t, gr, a, b in zip(masters, g16, m, v):
        t.grad = gr.float()
        opt.state[t] = {"step": torch.tensor(2.0), "exp_avg": a.clone(), "exp_avg_sq": b.clone()}
    opt.grad_scale, opt.found_inf = scale, torch.zeros(())  # type: ignore[attr-defined]
    opt.step()
    want = [masters, [opt.state[t]["exp_avg"] for t in masters], [opt.state[t]["exp_avg_sq"] for t in masters]]
    return {"p16": p16, "g16": g16, "m": m, "v": v, "group": group, "scale": scale, "want": want, "dtype": dtype}


def _matches(case: dict[str, Any], candidate: tuple[int, int, int, int]) -> bool:
    lib = abi.library()
    assert lib is not None
    p16 = [p.clone() for p in case["p16"]]
    masters = [p.float() for p in case["p16"]]
    exp_avgs, exp_avg_sqs = [t.clone() for t in case["m"]], [t.clone() for t in case["v"]]
    steps = [torch.tensor(2.0) for _ in masters]
    columns = [case["g16"], p16, masters, exp_avgs, exp_avg_sqs, steps]  # master_adam.c's table, per tensor
    table = torch.tensor([[t.data_ptr() for t in row] for row in zip(*columns)], dtype=torch.int64)
    numels = [m.numel() for m in masters]
    numel = torch.tensor(numels, dtype=torch.int64)
    chunk_start = torch.tensor([0, *itertools.accumulate(-(-k // abi.CHUNK) for k in numels)], dtype=torch.int64)
    hyper = abi.hyper_of(case["group"], candidate, decoupled=case["group"]["decoupled_weight_decay"])
    kind = abi.KIND[case["dtype"]]
    lib.fp16kit_master_adam(
        len(masters), abi.p64(table), abi.p64(numel), abi.p64(chunk_start), abi.CHUNK, ctypes.byref(hyper), kind,
        kind, 0, abi.pf(case["scale"]), None, 1,
    )  # fmt: skip
    got = [masters, exp_avgs, exp_avg_sqs]
    for mine, theirs in zip(got, case["want"]):
        if not all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(mine, theirs)):
            return False
    return all(torch.equal(p.view(torch.int16), m.to(case["dtype"]).view(torch.int16)) for p, m in zip(p16, masters))
