"""What fp16kit's master weights buy over a framework's own precision modes, as measured ratios.

The README's "Use with Lightning / Accelerate / Transformers / DDP / FSDP2" section quotes these
figures. Three measurements, each a ratio within one run of this script:

a. **Training-state memory per parameter** -- params + grads + optimizer state + masters +
   master grads, counted exactly from the bytes of the distinct tensor storages alive after one
   ``step()`` (before ``zero_grad``), for AdamW on an MLP of a few million params:
   fp32; autocast ("16-mixed"/"bf16-mixed": fp32 params); "16-true"/"bf16-true" (16-bit params
   and 16-bit Adam state, no masters); a 16-bit model + ``MixedPrecisionOptimizer`` (masters on
   the model's device); the same with ``master_device="cpu"`` (model-side bytes -- the
   accelerator's, for a CUDA model -- and host bytes apart). Activation memory is out of scope:
   it depends on the batch and the model, not on where the weights live (autocast keeps fp16
   activations for backward in every 16-bit mode; a 16-bit model also skips the per-op weight
   casts autocast makes). The scaler's few scalar tensors are left out.
b. **Master-weight precision** -- a linear regression (a fine-tuning-like start near the
   solution) trained with plain SGD and a small learning rate in bf16-true, fp16-true, bf16 and
   fp16 models with fp32 masters, and fp32. For each: the distance of the final weights (the
   masters where there are some) to the fp32 run's, relative to how far the fp32 run moved
   (1.0: as if no step had been taken), the final loss (weights evaluated in fp32) over the
   fp32 run's, and the share of (weight, step) updates that left the weight unchanged: an update
   below half a unit in the last place of a 16-bit weight rounds away.
c. **Asynchronous steps** -- milliseconds per training step, synchronous vs ``async_step=True``,
   for a bf16 MLP with many params and a small batch (AdamW's step over the fp32 masters is a
   large part of the step); the median of several alternating rounds, with torch's default
   intra-op threads, split between the two threads, and one each. The headline figure is the
   fastest synchronous round of any configuration over the fastest asynchronous one: the
   fastest rounds are the least disturbed by other load on a shared machine, and on small ops
   extra intra-op threads can cost more than they give, so comparing both at torch's default
   would flatter the asynchronous side. On a CPU the optimizer thread and the intra-op threads
   share the same few cores, memory bandwidth and the GIL between ops (a forward/backward slows
   by about 1.6x here while AdamW runs on another thread), so the gain stays below the bound
   1/max(step share, 1 - step share); on CUDA the step overlaps GPU work instead (not
   measurable here).

    python benchmarks/integrations.py             # the full run: about a minute on 2 idle cores
    python benchmarks/integrations.py --quick     # tiny sizes, seconds (the test runs this)
    python benchmarks/integrations.py --only async --json out.json

Not run in CI; tests/integrations/test_benchmark_integrations.py runs ``--quick`` and checks the
exact byte counts and the precision ordering, never timings.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import fp16kit
from fp16kit.demo.measure import storage_bytes  # distinct storages: a flat buffer's views count once

# ---------------------------------------------------------------------------- a. memory


@dataclass(frozen=True)
class MemoryMode:
    name: str
    dtype: torch.dtype  # the model's params
    autocast: torch.dtype | None = None  # forward under torch.autocast to this dtype
    masters: bool = False  # MixedPrecisionOptimizer
    master_device: str | None = None
    async_step: bool = False


MEMORY_MODES = [
    MemoryMode("fp32", torch.float32),
    MemoryMode("16-mixed (autocast fp16, fp32 params)", torch.float32, autocast=torch.float16),
    MemoryMode("16-true (fp16 params + fp16 AdamW state)", torch.float16),
    MemoryMode("fp16 + MixedPrecisionOptimizer", torch.float16, masters=True),
    MemoryMode("fp16 + MPO, async_step=True", torch.float16, masters=True, async_step=True),
    MemoryMode("fp16 + MPO, master_device='cpu'", torch.float16, masters=True, master_device="cpu"),
    MemoryMode("bf16-mixed (autocast bf16, fp32 params)", torch.float32, autocast=torch.bfloat16),
    MemoryMode("bf16-true (bf16 params + bf16 AdamW state)", torch.bfloat16),
    MemoryMode("bf16 + MixedPrecisionOptimizer", torch.bfloat16, masters=True),
    MemoryMode("bf16 + MPO, master_device='cpu'", torch.bfloat16, masters=True, master_device="cpu"),
]
PARTS = ("params", "grads", "opt_state", "masters", "master_grads")


def _backward_step(loss: torch.Tensor, opt: torch.optim.Optimizer, scaler: fp16kit.GradScaler | None) -> None:
    """One backward and step: through the scaler when there is one (fp16), else plainly."""
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    else:
        loss.backward()
        opt.step()


def mlp(width: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*mods)


def training_state(mode: MemoryMode, width: int, layers: int) -> dict[str, Any]:
    """One AdamW step in ``mode``; the bytes of each part of the training state after it."""
    model = mlp(width, layers).to(mode.dtype)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt: torch.optim.Optimizer = inner
    scaler = None
    if mode.masters:
        opt = fp16kit.MixedPrecisionOptimizer(inner, master_device=mode.master_device, async_step=mode.async_step)
        if mode.dtype == torch.float16:
            scaler = fp16kit.GradScaler("cpu")
    elif mode.autocast == torch.float16:
        scaler = fp16kit.GradScaler("cpu")  # "16-mixed" scales the loss too
    x = torch.randn(4, width, generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=mode.autocast or torch.bfloat16, enabled=mode.autocast is not None):
        loss = model(x.to(mode.dtype)).float().pow(2).mean()
    _backward_step(loss, opt, scaler)
    if mode.async_step:
        opt.synchronize()  # the step landed; the training state is what it is between steps
    model_params = list(model.parameters())
    masters = list(opt.master_params) if mode.masters else []
    seen: set[tuple[str, int]] = set()
    parts = {
        "params": storage_bytes(model_params, seen),
        "grads": storage_bytes([p.grad for p in model_params if p.grad is not None], seen),
        "masters": storage_bytes(masters, seen),
        "master_grads": storage_bytes([m.grad for m in masters if m.grad is not None], seen),
        "opt_state": storage_bytes(
            [v for st in inner.state.values() for v in st.values() if isinstance(v, torch.Tensor)], seen
        ),
    }
    n = sum(p.numel() for p in model_params)
    # with master_device="cpu" the optimizer's side lives in host memory; the model's side
    # stays on the model's device (the accelerator's memory, for a CUDA model)
    host = parts["masters"] + parts["master_grads"] + parts["opt_state"] if mode.master_device else 0
    return {
        "mode": mode.name,
        "numel": n,
        "bytes": parts,
        "total": sum(parts.values()),
        "device_total": sum(parts.values()) - host,
        "host_total": host,
    }


def memory_table(width: int, layers: int) -> list[dict[str, Any]]:
    return [training_state(mode, width, layers) for mode in MEMORY_MODES]


def print_memory(rows: list[dict[str, Any]]) -> None:
    n = rows[0]["numel"]
    fp32 = rows[0]["total"]
    print(
        f"\na. training-state bytes per parameter after one AdamW step ({n / 1e6:.2f}M params; activations not counted)"
    )
    head = "".join(f"{p:>13}" for p in PARTS)
    print(f"{'mode':<44}{head}{'total':>8}{'device':>8}{'host':>7}{'vs fp32':>9}")
    for r in rows:
        cells = "".join(f"{r['bytes'][p] / n:>13.2f}" for p in PARTS)
        print(
            f"{r['mode']:<44}{cells}{r['total'] / n:>8.2f}{r['device_total'] / n:>8.2f}"
            f"{r['host_total'] / n:>7.2f}{r['device_total'] / fp32:>8.2f}x"
        )
    print("('device' = what stays on the model's device; 'vs fp32' compares it with fp32's total)")


# ---------------------------------------------------------------------------- b. precision

PRECISION_MODES = [  # name, model dtype, fp32 masters
    ("fp32", torch.float32, False),
    ("bf16-true (no masters)", torch.bfloat16, False),
    ("fp16-true (no masters)", torch.float16, False),
    ("bf16 + fp32 masters (MPO)", torch.bfloat16, True),
    ("fp16 + fp32 masters (MPO + GradScaler)", torch.float16, True),
]


def regression(dim: int = 64, out: int = 16, n: int = 512) -> tuple[torch.Tensor, ...]:
    """Inputs, targets of a linear teacher, and a start 20% of the teacher's norm away from it."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, dim, generator=g)
    teacher = torch.randn(out, dim, generator=g) / dim**0.5
    start = teacher + 0.2 * torch.randn(out, dim, generator=g) / dim**0.5
    return x, x @ teacher.T, start


def train_regression(dtype: torch.dtype, masters: bool, steps: int, lr: float) -> dict[str, Any]:
    x, y, start = regression()
    model = nn.Linear(start.shape[1], start.shape[0], bias=False)
    with torch.no_grad():
        model.weight.copy_(start)
    model.to(dtype)
    opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    scaler = None
    if masters:
        opt = fp16kit.MixedPrecisionOptimizer(opt)
        if dtype == torch.float16:
            scaler = fp16kit.GradScaler("cpu")

    def weights() -> torch.Tensor:  # what the optimizer steps: the master, or the param itself
        return (opt.master_params[0] if masters else model.weight).detach().float().clone()

    unchanged = 0
    for _ in range(steps):
        before = weights()
        opt.zero_grad()
        loss = (model(x.to(dtype)).float() - y).pow(2).mean()
        _backward_step(loss, opt, scaler)
        unchanged += int((weights() == before).sum())
    final = weights()
    return {
        "weights": final,
        "model_weights": model.weight.detach().float().clone(),
        "lost": unchanged / (steps * final.numel()),
        "loss": float((x @ final.T - y).pow(2).mean()),
        "model_loss": float((x @ model.weight.detach().float().T - y).pow(2).mean()),
    }


def precision_table(steps: int, lr: float) -> list[dict[str, Any]]:
    _, _, start = regression()
    runs = {name: train_regression(dtype, m, steps, lr) for name, dtype, m in PRECISION_MODES}
    ref = runs["fp32"]
    moved = float((ref["weights"] - start).norm())
    return [
        {
            "mode": name,
            "distance": float((r["weights"] - ref["weights"]).norm()) / moved,
            "loss": r["loss"],
            "loss_vs_fp32": r["loss"] / ref["loss"],
            "model_loss_vs_fp32": r["model_loss"] / ref["loss"],
            "updates_lost": r["lost"],
        }
        for name, r in runs.items()
    ]


def print_precision(rows: list[dict[str, Any]], steps: int, lr: float) -> None:
    x, y, start = regression()
    start_loss = float((x @ start.T - y).pow(2).mean())
    print(
        f"\nb. master-weight precision: linear regression 64->16, SGD lr={lr:g}, {steps} full-batch "
        f"steps from loss {start_loss:.5f} (weights evaluated in fp32)"
    )
    print(
        f"{'mode':<42}{'distance to fp32':>17}{'final loss':>12}{'loss/fp32':>10}"
        f"{'16-bit copy loss/fp32':>23}{'updates lost':>14}"
    )
    for r in rows:
        print(
            f"{r['mode']:<42}{r['distance']:>17.4f}{r['loss']:>12.6f}{r['loss_vs_fp32']:>10.3f}"
            f"{r['model_loss_vs_fp32']:>23.3f}{r['updates_lost']:>13.1%}"
        )
    print(
        "(distance: |W - W_fp32| / |W_fp32 - W_start|, W the masters where there are some; "
        "'16-bit copy': the model's own weights)"
    )


# ---------------------------------------------------------------------------- c. async steps


def step_times(width: int, layers: int, batch: int, iters: int, async_step: bool) -> float:
    """Seconds per training iteration (forward, backward, scaler.step, update), after warm-up."""
    model = mlp(width, layers).to(torch.bfloat16)
    opt = fp16kit.MixedPrecisionOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True), async_step=async_step
    )
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, width, generator=g).to(torch.bfloat16)

    def iteration() -> None:
        opt.zero_grad()
        model(x).float().pow(2).mean().backward()
        opt.step()

    for _ in range(3):
        iteration()
    opt.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        iteration()
    opt.synchronize()
    return (time.perf_counter() - start) / iters


def step_share(width: int, layers: int, batch: int, iters: int) -> float:
    """The optimizer step's share of a synchronous iteration."""
    model = mlp(width, layers).to(torch.bfloat16)
    opt = fp16kit.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True))
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    fwd_bwd = stepping = 0.0
    for i in range(iters + 3):
        t0 = time.perf_counter()
        opt.zero_grad()
        model(x).float().pow(2).mean().backward()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        if i >= 3:
            fwd_bwd, stepping = fwd_bwd + t1 - t0, stepping + t2 - t1
    return stepping / (fwd_bwd + stepping)


def _set_threads(main: int, worker: int) -> None:
    torch.set_num_threads(main)
    thread = fp16kit.optimizer_thread()
    thread.wait(thread.submit(torch.set_num_threads, worker))


def async_table(width: int, layers: int, batch: int, iters: int, rounds: int) -> list[dict[str, Any]]:
    """Per configuration (synchronous intra-op threads; asynchronous main thread's + optimizer
    thread's): torch's default everywhere, the cores split between the two threads (what
    benchmarks/async_overlap.py does), and one core per thread."""
    cores = torch.get_num_threads()
    configs = sorted(
        {(cores, cores, cores), (cores, max(1, cores // 2), max(1, cores - cores // 2)), (1, 1, 1)}, reverse=True
    )
    rows = []
    for sync_threads, main_threads, worker_threads in configs:
        _set_threads(sync_threads, sync_threads)
        share = step_share(width, layers, batch, iters)
        sync, asyn = [], []
        for _ in range(rounds):  # alternate, so drift on a shared machine hits both alike
            _set_threads(sync_threads, sync_threads)
            sync.append(step_times(width, layers, batch, iters, False))
            _set_threads(main_threads, worker_threads)
            asyn.append(step_times(width, layers, batch, iters, True))
        ratios = [s / a for s, a in zip(sync, asyn)]
        rows.append(
            {
                "sync_threads": sync_threads,
                "async_threads": [main_threads, worker_threads],
                "step_share": share,
                "sync_ms": 1e3 * statistics.median(sync),
                "async_ms": 1e3 * statistics.median(asyn),
                "speedup": statistics.median(ratios),
                "sync_best_ms": 1e3 * min(sync),
                "async_best_ms": 1e3 * min(asyn),
                "best_speedup": min(sync) / min(asyn),
                "speedup_range": [min(ratios), max(ratios)],
            }
        )
    _set_threads(cores, cores)
    return rows


def print_async(rows: list[dict[str, Any]], width: int, layers: int, batch: int, rounds: int) -> None:
    n = sum(p.numel() for p in mlp(width, layers).parameters())
    print(
        f"\nc. async steps: bf16 MLP {layers}x{width} ({n / 1e6:.2f}M params), batch {batch}, AdamW "
        f"(foreach) on fp32 masters, median of {rounds} alternating rounds, {os.cpu_count()} CPUs"
    )
    print(
        f"{'threads sync':>12}{'async main+opt':>16}{'step share':>12}{'bound':>7}{'sync ms/step':>14}"
        f"{'async ms/step':>15}{'sync/async':>12}{'range':>12}{'best/best':>11}"
    )
    for r in rows:
        lo, hi = r["speedup_range"]
        main_t, worker_t = r["async_threads"]
        bound = 1 / max(r["step_share"], 1 - r["step_share"])
        print(
            f"{r['sync_threads']:>12}{f'{main_t}+{worker_t}':>16}{r['step_share']:>11.0%}{bound:>6.2f}x{r['sync_ms']:>13.2f}"
            f"{r['async_ms']:>15.2f}{r['speedup']:>11.2f}x{lo:>6.2f}-{hi:.2f}{r['best_speedup']:>10.2f}x"
        )
    best_sync = min(rows, key=lambda r: r["sync_best_ms"])
    best_async = min(rows, key=lambda r: r["async_best_ms"])
    print(
        f"fastest synchronous round ({best_sync['sync_threads']} threads, {best_sync['sync_best_ms']:.2f} ms) / "
        f"fastest asynchronous round ({'+'.join(map(str, best_async['async_threads']))} threads, "
        f"{best_async['async_best_ms']:.2f} ms): {best_sync['sync_best_ms'] / best_async['async_best_ms']:.2f}x"
    )
    print(
        "('step share': the optimizer step's part of a synchronous iteration; 'bound': the best "
        "overlap can do, 1/max(share, 1-share), with a core free for each side; sync/async: median of the "
        "rounds' ratios, > 1: async is faster; best/best: fastest sync round / fastest async round, "
        "the figure least disturbed by other load)"
    )


# ---------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for the test")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument(
        "--only",
        choices=["memory", "precision", "async"],
        action="append",
        help="run only this part (repeatable; default: all three)",
    )
    args = parser.parse_args(argv)
    q = args.quick
    mem = dict(width=64, layers=2) if q else dict(width=1024, layers=4)
    prec = dict(steps=40, lr=1e-2) if q else dict(steps=300, lr=1e-2)
    asy = (
        dict(width=64, layers=2, batch=2, iters=3, rounds=1)
        if q
        else dict(width=512, layers=16, batch=4, iters=40, rounds=9)
    )
    load = os.getloadavg()
    print(
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, {torch.get_num_threads()} intra-op threads, "
        f"load average {load[0]:.2f} at start"
    )

    only = set(args.only or ["memory", "precision", "async"])
    results: dict[str, Any] = {}
    if "memory" in only:
        results["memory"] = memory_table(**mem)
        print_memory(results["memory"])
    if "precision" in only:
        results["precision"] = precision_table(**prec)
        print_precision(results["precision"], **prec)
    if "async" in only:
        results["async"] = async_table(**asy)
        print_async(results["async"], asy["width"], asy["layers"], asy["batch"], asy["rounds"])
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
