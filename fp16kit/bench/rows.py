"""The rows of ``fp16kit bench``: which variants run together, against which anchors.

Every row builds its variants for one shape, times them in the same interleaved rounds
(:func:`fp16kit.bench.timing.run_interleaved`, the memcpy probe of :mod:`fp16kit.bench.bounds`
among them where a bound is an anchor) and turns the per-round times into ratios::

    master-grads   per shape (many small tensors, few large): the hand loop, MixedPrecisionOptimizer
                   (flat=False, True), FP16_Optimizer.update_master_grads  vs the 6 B/param bound;
                   fp16kit's also vs the hand loop
    step           per shape (a 24.6M-param list, a small MLP's): the hand loop, torch AdamW(fused)
                   on fp32 params, MixedPrecisionOptimizer (flat=False, True) + GradScaler,
                   FP16_Optimizer, amp O2  vs the 28 B/param bound; fp16kit's also vs the hand
                   loop and vs torch's fused AdamW on fp32 params
    scaler         fp16kit.GradScaler vs torch.amp.GradScaler, fp32 MLP, SGD and AdamW(fused)
    async          async_step=True vs async_step=False, per model shape
    syncs          per iteration, counted (not timed): host reads on the main thread, aten ops,
                   Python calls, for each fp16kit variant and the anchors (:mod:`fp16kit.bench.trace`)
    memory         bytes per param of training state held after an AdamW step, after zero_grad and at
                   the step's peak, counted (not timed), per recipe: fp32, autocast, a 16-bit model
                   without masters, MixedPrecisionOptimizer (kernel and torch-op paths, flat and not),
                   FP16_Optimizer, amp O2 (:mod:`fp16kit.bench.memory`)

Bytes per param of the timed rows are counted from one traced iteration
(:func:`fp16kit.bench.trace.op_tally`), not assumed.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from . import trace
from .bounds import MASTER_GRAD_BYTES, MASTER_STEP_BYTES, Memcpy, bound_times
from .loops import HAND, STEP_VARIANTS, Loop, master_grad_loops, step_loops
from .memory import run_recipes
from .shapes import MLP_LIST, Shape, async_models, master_grad_shapes, scaler_model, step_shapes
from .timing import Stats, ratio_stats, run_interleaved
from .training import AsyncLoop, ScalerLoop

__all__ = ["ROWS", "Context", "Count", "Figure", "NullClock", "Skipped"]

FP32_ANCHOR = "torch AdamW(fused), fp32 params"

STEP_NAMES = list(STEP_VARIANTS)

logger = logging.getLogger("fp16kit")


@dataclass
class Figure:
    """One line of the table: a variant's per-round ratios to an anchor."""

    row: str
    device: str
    shape: str
    variant: str
    anchor: str
    ratios: tuple[float, ...]
    bytes_per_param: float | None = None
    seconds: tuple[float, ...] = ()  # the variant's seconds per iteration, per round (JSON only)

    @property
    def stats(self) -> Stats:
        return Stats(self.ratios)

    def as_dict(self) -> dict[str, Any]:
        return {
            "row": self.row,
            "device": self.device,
            "shape": self.shape,
            "variant": self.variant,
            "anchor": self.anchor,
            "kind": "ratio",
            **self.stats.as_dict(),
            "bytes_per_param": self.bytes_per_param,
            "seconds_per_iteration": list(self.seconds),
        }


@dataclass
class Count:
    """One line of the syncs table: what one iteration of a variant does, counted."""

    row: str
    device: str
    shape: str
    variant: str
    host_syncs: float
    ops: float
    python_calls: float
    method: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "row": self.row,
            "device": self.device,
            "shape": self.shape,
            "variant": self.variant,
            "kind": "count",
            "host_syncs_per_step": self.host_syncs,
            "aten_ops_per_step": self.ops,
            "python_calls_per_step": self.python_calls,
            "method": self.method,
        }


@dataclass(frozen=True)
class Skipped:
    """A variant of a row that could not run here, and why (the report lists it with the rows skipped)."""

    row: str
    device: str
    reason: str

    def as_dict(self) -> dict[str, str]:
        return {"row": self.row, "device": self.device, "reason": self.reason}


@dataclass
class Context:
    """What a row needs: the settings, the device, the memcpy probe and a progress callback."""

    device: torch.device
    rounds: int
    warmup: int
    quick: bool
    threads: int
    progress: Callable[[str], None] = lambda _msg: None
    copy_seconds: list[float] = field(default_factory=list)  # every round's, for the header
    _memcpy: Memcpy | None = None

    @property
    def target_s(self) -> float:
        return 0.03 if self.quick else 0.25

    def memcpy(self) -> Memcpy:
        if self._memcpy is None:
            mib = (128 if self.quick else 256) if self.device.type == "cpu" else (256 if self.quick else 1024)
            self._memcpy = Memcpy(mib * 2**20, self.device)
        return self._memcpy

    def interleave(self, variants: dict[str, Any], *, min_iters: int = 1) -> dict[str, list[float]]:
        return run_interleaved(
            variants, rounds=self.rounds, warmup=self.warmup, target_s=self.target_s, min_iters=min_iters
        )


class NullClock:
    """A clock that times nothing (for the traced and counted iterations)."""

    def __enter__(self) -> NullClock:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def paused(self) -> NullClock:
        return self


def _bytes_per_param(loop: Loop, params: int) -> float | None:
    try:
        return trace.op_tally(lambda: loop.iteration(NullClock())).moved / params
    except Exception as e:  # an op the observer cannot follow (e.g. a compiled kernel): no count
        logger.warning("fp16kit bench: could not count the bytes of %s (%s: %s)", loop.name, type(e).__name__, e)
        return None


_BOUND = "memcpy"


def _bound_name(nbytes: int) -> str:
    return f"{nbytes} B/param bound (memcpy)"


def _param_list_row(
    ctx: Context,
    row: str,
    shape: Shape,
    loops: list[Loop],
    bound_bytes: int,
    anchors: Sequence[str],
    peers: Mapping[str, str] | None = None,
) -> list[Figure]:
    """Every loop vs the bound; the others also vs each of ``anchors`` and vs its peer in ``peers``."""
    ctx.progress(f"{row} [{ctx.device.type}] {shape.name}: {len(loops)} variants + memcpy, {ctx.rounds} rounds")
    memcpy = ctx.memcpy()
    variants: dict[str, Any] = {loop.name: loop for loop in loops}
    variants[_BOUND] = memcpy
    times = ctx.interleave(variants)
    for loop in loops:
        loop.finish()
    ctx.copy_seconds.extend(times[_BOUND])
    bound = bound_times(times[_BOUND], memcpy.moved, bound_bytes, shape.params)
    figures = []
    dev = ctx.device.type
    for loop in loops:
        bpp = _bytes_per_param(loop, shape.params)
        stats = ratio_stats(times[loop.name], bound)
        seconds = tuple(times[loop.name])
        figures.append(Figure(row, dev, shape.name, loop.name, _bound_name(bound_bytes), stats.ratios, bpp, seconds))
        if loop.name in anchors:
            continue
        peer = (peers or {}).get(loop.name)
        for anchor in [*anchors, *([peer] if peer in times else [])]:
            stats = ratio_stats(times[loop.name], times[anchor])
            figures.append(Figure(row, dev, shape.name, loop.name, anchor, stats.ratios, bpp, tuple(times[loop.name])))
    return figures


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def master_grads(ctx: Context) -> list[Figure]:
    figures: list[Figure] = []
    for shape in master_grad_shapes(ctx.quick):
        loops = master_grad_loops(shape, ctx.device)
        figures += _param_list_row(ctx, "master-grads", shape, loops, MASTER_GRAD_BYTES, [HAND])
        del loops
        _free()
    return figures


def step(ctx: Context) -> list[Figure]:
    figures: list[Figure] = []
    for shape in step_shapes(ctx.quick):
        loops = step_loops(shape, ctx.device, names=STEP_NAMES)
        # the legacy faces also vs the modern one they stand on (issue 19's target: <= 1.05x)
        mpo = loops[STEP_NAMES.index("mpo")].name
        peers = {loops[STEP_NAMES.index(n)].name: mpo for n in ("fp16-optimizer", "amp-o2")}
        figures += _param_list_row(ctx, "step", shape, loops, MASTER_STEP_BYTES, [HAND, FP32_ANCHOR], peers)
        del loops
        _free()
    return figures


def scaler(ctx: Context) -> list[Figure]:
    mlp = scaler_model(ctx.quick)
    figures = []
    for optimizer in ("sgd", "adamw"):
        label = "SGD(momentum=0.9)" if optimizer == "sgd" else "AdamW(fused=True)"
        ctx.progress(f"scaler [{ctx.device.type}] {mlp.name}, {label}: {ctx.rounds} rounds")
        ours = ScalerLoop(mlp, ctx.device, optimizer=optimizer, fp16kit_scaler=True)
        theirs = ScalerLoop(mlp, ctx.device, optimizer=optimizer, fp16kit_scaler=False)
        times = ctx.interleave({ours.name: ours, theirs.name: theirs})
        stats = ratio_stats(times[ours.name], times[theirs.name])
        shape = f"{mlp.name}, {label}"
        seconds = tuple(times[ours.name])
        figures.append(Figure("scaler", ctx.device.type, shape, ours.name, theirs.name, stats.ratios, None, seconds))
    return figures


def async_steps(ctx: Context) -> list[Figure]:
    figures = []
    for mlp in async_models(ctx.quick):
        ctx.progress(f"async [{ctx.device.type}] {mlp.name}: {ctx.rounds} rounds")
        sync = AsyncLoop(mlp, ctx.device, async_step=False, threads=ctx.threads)
        asyn = AsyncLoop(mlp, ctx.device, async_step=True, threads=ctx.threads)
        # enough iterations per block that filling and draining the pipeline weighs little
        times = ctx.interleave({sync.name: sync, asyn.name: asyn}, min_iters=8 if ctx.quick else 20)
        asyn.finish()
        stats = ratio_stats(times[asyn.name], times[sync.name])
        seconds = tuple(times[asyn.name])
        figures.append(Figure("async", ctx.device.type, mlp.name, asyn.name, sync.name, stats.ratios, None, seconds))
        del sync, asyn
        _free()
    return figures


SYNC_STEPS = 3


def _count(ctx: Context, shape: str, loop: Loop) -> Count:
    clock = NullClock()
    for _ in range(3):  # warm: lazy state, first allocations
        loop.iteration(clock)
    loop.finish()

    def steps() -> None:
        for _ in range(SYNC_STEPS):
            loop.iteration(clock)

    ops = trace.op_tally(steps)
    if ctx.device.type == "cuda":
        syncs, method = trace.cuda_syncs(steps), "torch.cuda.set_sync_debug_mode('warn'), main thread"
    else:
        syncs, method = ops.host_reads, "_local_scalar_dense + Tensor.tolist calls, main thread"
    calls = trace.python_calls(steps)
    loop.finish()
    n = SYNC_STEPS
    return Count("syncs", ctx.device.type, shape, loop.name, syncs / n, ops.ops / n, calls / n, method)


def syncs(ctx: Context) -> list[Count]:
    ctx.progress(f"syncs [{ctx.device.type}]: counting")
    counts = [_count(ctx, MLP_LIST.name, loop) for loop in step_loops(MLP_LIST, ctx.device)]
    mlp = scaler_model(ctx.quick)
    for fp16kit_scaler in (False, True):
        loop = ScalerLoop(mlp, ctx.device, optimizer="adamw", fp16kit_scaler=fp16kit_scaler)
        counts.append(_count(ctx, f"{mlp.name}, AdamW(fused=True)", loop))
    balanced = async_models(ctx.quick)[1]
    for async_step in (False, True):
        counts.append(
            _count(ctx, balanced.name, AsyncLoop(balanced, ctx.device, async_step=async_step, threads=ctx.threads))
        )
    _free()
    return counts


def memory(ctx: Context) -> list[Any]:
    dev = ctx.device.type
    ctx.progress(f"memory [{dev}]: bytes per param held and at the step's peak, counted")
    figures, skipped = run_recipes(ctx.device, ctx.quick)
    _free()
    return [*figures, *(Skipped("memory", dev, f"{label}: {why}") for label, why in skipped)]


ROWS: dict[str, Callable[[Context], list[Any]]] = {
    "master-grads": master_grads,
    "step": step,
    "scaler": scaler,
    "async": async_steps,
    "syncs": syncs,
    "memory": memory,
}
"""Every row, in the order the report lists them."""
