"""Bytes per param of training state, held after a step and at the step's peak: counted, not timed.

Each recipe (:data:`RECIPES`) builds an MLP and its optimizer and trains it for :data:`STEPS` AdamW steps on one
fixed batch (made before the run, so it is not counted); the last step is the measured one, when the
optimizer's state exists and every lazy buffer has been made. The figures, in bytes (B/param in the table)::

    held after step     the bytes the run holds when step() returns, the grads still attached: the run's
                        allocations minus its frees, from before the model was built
      split by part     the distinct storages (a flat buffer's views count once) of the params, their grads,
                        the torch optimizer's state tensors (exp_avg, exp_avg_sq, step), the masters and the
                        master grads; "other" is the rest of the held bytes: what a library keeps beyond
                        them (spare master grads kept between steps, a flat grad buffer no master points to,
                        the scaler's and a kernel plan's few small tensors)
    after zero_grad     held after the user's zero_grad(set_to_none=True) (FP16_Optimizer:
                        set_grads_to_None=True): what stays alive into the next forward
    peak in step        the most bytes alive during the step: from the end of the backward to the end of
                        the step (the scaler's check or unscale, the master grads, the optimizer step, the
                        copy into the model, scaler.update())
    temporaries         peak - max(held at the step's start, held at its end): bytes that live only
                        inside the step (the issue's target: <= 1 B/param beyond what is held)

Activations are not in the figures: the graph is freed by the step's start. How the bytes are seen:

* CPU: ``torch.profiler.profile(profile_memory=True)`` around the whole run records every allocation and
  free of torch's CPU allocator with its time; their running sum, in time order, is the bytes held at any
  instant, and the step's bounds are ``record_function`` ranges. Memory outside torch's allocator is not
  seen: fp16kit's fused kernel (C, through ctypes) allocates none.
* CUDA: ``torch.cuda.memory_allocated()`` at the same instants (less the bytes allocated before the run),
  ``torch.cuda.reset_peak_memory_stats()`` at the step's start and ``max_memory_allocated()`` at its end;
  the host bytes of ``master_device="cpu"`` are the parts' storages on the CPU (not in the GPU's figures).

:data:`STATED` are figures from other systems' papers and manuals (docs/memory.md), printed as stated, never
as measured. No figure is asserted anywhere; tests/bench/test_memory.py checks the counting on known cases.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import gc
import itertools
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import fp16kit
from fp16kit.core import fused
from fp16kit.legacy import FP16_Optimizer, amp

__all__ = [
    "PARTS",
    "RECIPES",
    "STATED",
    "STEPS",
    "MemoryFigure",
    "Recipe",
    "StatedMemory",
    "Window",
    "measure",
    "memory_model",
    "parts_bytes",
    "recipes_for",
    "run_recipes",
]

STEPS = 3
"""Steps per run; the last is measured (the first makes the optimizer's state and the lazy buffers)."""

PARTS = ("params", "grads", "opt_state", "masters", "master_grads", "other")

logger = logging.getLogger("fp16kit")

LR = 1e-3
CPU_METHOD = "torch.profiler(profile_memory=True): CPU allocator events, running sum"
CUDA_METHOD = "torch.cuda.memory_allocated / max_memory_allocated (peak reset at the step's start)"


@dataclass(frozen=True)
class MemoryModel:
    """The MLP every recipe trains: ``layers`` x (Linear(width, width), GELU), batch ``batch``."""

    name: str
    layers: int
    width: int
    batch: int = 8

    def build(self, dtype: torch.dtype, device: torch.device) -> nn.Module:
        torch.manual_seed(0)
        mods: list[nn.Module] = []
        for _ in range(self.layers):
            mods += [nn.Linear(self.width, self.width), nn.GELU()]
        return nn.Sequential(*mods).to(device, dtype)

    def numel(self) -> int:
        return self.layers * (self.width * self.width + self.width)


def memory_model(quick: bool) -> MemoryModel:
    """A few million params (--quick: 0.13M; each weight still large enough for spare master grads)."""
    if quick:
        return MemoryModel("MLP 2 x 256 (0.13M params)", 2, 256)
    return MemoryModel("MLP 4 x 1024 (4.20M params)", 4, 1024)


# ---------------------------------------------------------------------------- the step's bounds


class Window:
    """Marks the step's bounds (``begin()``, ``end()``) where a recipe's step starts and ends."""

    def __init__(self, on_begin: Callable[[], None], on_end: Callable[[], None]) -> None:
        self._on_begin, self._on_end = on_begin, on_end

    def begin(self) -> None:
        self._on_begin()

    def end(self) -> None:
        self._on_end()


def _null_window() -> Window:
    return Window(lambda: None, lambda: None)


# ---------------------------------------------------------------------------- the recipes


class Recipe:
    """One way to train: ``iteration(x, window)`` runs forward, backward and the step, ``window`` around the step.

    ``params`` the model's, ``optimizer`` the torch optimizer whose state is counted, ``masters`` the tensors it
    steps that are not model params (none without masters)."""

    params: list[torch.Tensor]
    optimizer: torch.optim.Optimizer
    note = ""  # what the table says of the measured step (e.g. which path took it)

    def iteration(self, x: torch.Tensor, window: Window) -> None:
        raise NotImplementedError

    def zero_grad(self) -> None:
        raise NotImplementedError

    def masters(self) -> list[torch.Tensor]:
        return []

    def finish(self) -> None:
        """After the measured step: record what the figures need to say about it (``note``)."""

    def _backward_and_step(self, loss: torch.Tensor, step_of: Any, scaler: Any, window: Window) -> None:
        """Backward from ``loss`` (scaled by ``scaler`` unless None), then ``step_of``'s step inside ``window``.

        The caller passes ``loss`` without keeping it: dropped here, the graph is freed before the window opens."""
        if scaler is None:
            loss.backward()
            del loss
            window.begin()
            step_of.step()
        else:
            scaler.scale(loss).backward()
            del loss
            window.begin()
            scaler.step(step_of)
            scaler.update()
        window.end()


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().pow(2).mean()


class TorchRecipe(Recipe):
    """A model stepped by torch's AdamW(fused=True) itself: fp32, fp32 under autocast with torch's GradScaler,
    or 16-bit params and 16-bit state (no masters)."""

    def __init__(self, model: nn.Module, autocast: torch.dtype | None = None, scaler: bool = False) -> None:
        self.model, self.params = model, list(model.parameters())
        self.device = self.params[0].device
        self.optimizer = torch.optim.AdamW(self.params, lr=LR, weight_decay=0.01, fused=True)
        self.autocast = autocast
        self.scaler = torch.amp.GradScaler(self.device.type) if scaler else None

    def iteration(self, x: torch.Tensor, window: Window) -> None:
        self._backward_and_step(self._forward(x), self.optimizer, self.scaler, window)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(self.device.type, dtype=self.autocast or torch.bfloat16, enabled=self.autocast is not None):
            return _loss(self.model, x)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)


class DeclinedAdamW(torch.optim.AdamW):
    """torch's AdamW, unchanged: a subclass, so fp16kit's fused kernel declines it (it steps only torch's own
    classes) and the master step runs torch's ops -- in this process, without ``FP16KIT_FUSED=0``."""


class MPORecipe(Recipe):
    """A 16-bit model + ``MixedPrecisionOptimizer`` (+ ``fp16kit.GradScaler`` for fp16)."""

    def __init__(self, model: nn.Module, *, flat: bool, path: str = "kernel", master_device: str | None = None) -> None:
        self.model, self.params = model, list(model.parameters())
        device = self.params[0].device
        kind: type[torch.optim.AdamW] = DeclinedAdamW if path == "declined" else torch.optim.AdamW
        foreach = path == "foreach"
        self.optimizer = kind(
            self.params, lr=LR, weight_decay=0.01, foreach=True if foreach else None, fused=None if foreach else True
        )
        self.opt = fp16kit.MixedPrecisionOptimizer(self.optimizer, flat=flat, master_device=master_device)
        self.path = path
        fp16 = self.params[0].dtype == torch.float16
        self.scaler = fp16kit.GradScaler(device.type) if fp16 else None

    def iteration(self, x: torch.Tensor, window: Window) -> None:
        self._backward_and_step(_loss(self.model, x), self.opt, self.scaler, window)

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def masters(self) -> list[torch.Tensor]:
        return list(self.opt.master_params)

    def finish(self) -> None:
        on_cpu = all(p.device.type == "cpu" for p in self.params)
        if self.path == "kernel" and on_cpu:  # the kernel gives the masters no grad: say whether it took the step
            took = all(m.grad is None for m in self.masters())
            self.note = "" if took else "the kernel did not take the step (torch's ops did)"


class FP16OptimizerRecipe(Recipe):
    """fp16kit.legacy FP16_Optimizer over AdamW(fused=True), dynamic loss scale, on an fp16 model."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.params = model, list(model.parameters())
        self.optimizer = torch.optim.AdamW(self.params, lr=LR, weight_decay=0.01, fused=True)
        self.opt = FP16_Optimizer(self.optimizer, dynamic_loss_scale=True, verbose=False)

    def iteration(self, x: torch.Tensor, window: Window) -> None:
        loss = _loss(self.model, x)
        self.opt.backward(loss, update_master_grads=False)  # (the master grads are the step's: in the window)
        del loss
        window.begin()
        self.opt.update_master_grads()
        self.opt.step()
        window.end()

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_grads_to_None=True)

    def masters(self) -> list[torch.Tensor]:
        return [m for group in self.opt.fp32_from_fp16_groups for m in group]


class AmpO2Recipe(Recipe):
    """fp16kit.legacy amp O2 (an fp32 model cast to fp16 by ``amp.initialize``), AdamW(fused=True)."""

    def __init__(self, model: nn.Module) -> None:
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, fused=True)
        self.model, self.opt = amp.initialize(model, self.optimizer, opt_level="O2", verbosity=0)
        self.params = list(self.model.parameters())

    def iteration(self, x: torch.Tensor, window: Window) -> None:
        loss = _loss(self.model, x.half())
        with amp.scale_loss(loss, self.opt) as scaled:
            scaled.backward()
            del scaled
            window.begin()  # the unscale into the master grads runs as the block exits: in the window
        del loss
        self.opt.step()
        window.end()

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def masters(self) -> list[torch.Tensor]:
        return list(amp.master_params(self.opt))


@dataclass(frozen=True)
class RecipeSpec:
    """A row of the table: its label, the model's dtype, how to build the recipe, where it can run."""

    name: str
    dtype: torch.dtype
    make: Callable[[nn.Module], Recipe]
    kernel: bool = False  # takes fp16kit's fused CPU kernel (skipped where it is off)
    autocast_cpu: bool = False  # the label names bf16 on the CPU, fp16 on CUDA

    def label(self, device: torch.device) -> str:
        if self.autocast_cpu and device.type == "cuda":
            return self.name.replace("autocast(bf16)", "autocast(fp16)")
        return self.name


def _mpo(flat: bool, path: str, master_device: str | None = None) -> Callable[[nn.Module], Recipe]:
    return lambda m: MPORecipe(m, flat=flat, path=path, master_device=master_device)


def _mpo_specs(dtype: torch.dtype) -> list[RecipeSpec]:
    name = "fp16" if dtype == torch.float16 else "bf16"
    scaler = " + fp16kit.GradScaler" if dtype == torch.float16 else ""
    specs = []
    for path, how in (("kernel", "fused kernel"), ("declined", "torch ops (AdamW subclass: kernel declines)")):
        for flat in (False, True):
            layout = "flat" if flat else "per-tensor"
            label = f"{name} model + MPO(AdamW(fused=True), {layout}){scaler}: {how}"
            specs.append(RecipeSpec(label, dtype, _mpo(flat, path), kernel=path == "kernel"))
    return specs


def _autocast_recipe(m: nn.Module) -> Recipe:
    device = next(m.parameters()).device
    return TorchRecipe(m, autocast=torch.bfloat16 if device.type == "cpu" else torch.float16, scaler=True)


RECIPES: list[RecipeSpec] = [
    RecipeSpec("fp32 model + torch AdamW(fused=True)", torch.float32, TorchRecipe),
    RecipeSpec(
        "fp32 model + autocast(bf16) + torch.amp.GradScaler, AdamW(fused=True)",
        torch.float32,
        _autocast_recipe,
        autocast_cpu=True,
    ),
    RecipeSpec("bf16 model + torch AdamW(fused=True) on bf16 params (no masters)", torch.bfloat16, TorchRecipe),
    *_mpo_specs(torch.float16),
    *_mpo_specs(torch.bfloat16),
    RecipeSpec(
        "fp16 model + MPO(AdamW(foreach=True), per-tensor) + fp16kit.GradScaler: torch ops",
        torch.float16,
        _mpo(False, "foreach"),
    ),
    RecipeSpec(
        "fp16 model + MPO(AdamW(fused=True), master_device='cpu') + fp16kit.GradScaler",
        torch.float16,
        _mpo(False, "kernel", "cpu"),
    ),
    RecipeSpec("FP16_Optimizer(AdamW(fused=True)), fp16 model, dynamic loss scale", torch.float16, FP16OptimizerRecipe),
    RecipeSpec("amp O2 (AdamW(fused=True)), fp16 model", torch.float32, AmpO2Recipe),
]
"""Every measured row, in the order the table lists them."""


def recipes_for(device: torch.device) -> tuple[list[RecipeSpec], list[tuple[str, str]]]:
    """The recipes that run on ``device``, and (label, why) for those that do not.

    The fused kernel is CPU-only: on CUDA its rows are left out (torch's ops take those steps there, as the
    "torch ops" rows show); on a CPU where the kernel is off they are skipped, with the reason."""
    if device.type == "cuda":
        return [s for s in RECIPES if not s.kernel], []
    if fused.forms() is None:
        skipped = [(s.label(device), "the fused kernel is off on this machine (logged)") for s in RECIPES if s.kernel]
        return [s for s in RECIPES if not s.kernel], skipped
    return list(RECIPES), []


# ---------------------------------------------------------------------------- counting


def _storages(tensors: Iterable[torch.Tensor | None], seen: set[tuple[str, int]]) -> dict[str, int]:
    """Bytes of the storages behind ``tensors`` not in ``seen`` yet, per device type (adds them to ``seen``)."""
    out: dict[str, int] = {}
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        if key not in seen:
            seen.add(key)
            out[t.device.type] = out.get(t.device.type, 0) + storage.nbytes()
    return out


def parts_bytes(recipe: Recipe) -> dict[str, dict[str, int]]:
    """Per part (all of :data:`PARTS` but "other"), the bytes of its distinct storages, per device type."""
    seen: set[tuple[str, int]] = set()
    masters = recipe.masters()
    state = [v for st in recipe.optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return {  # (in this order: a tensor that is two parts counts in the first)
        "params": _storages(recipe.params, seen),
        "grads": _storages((p.grad for p in recipe.params), seen),
        "masters": _storages(masters, seen),
        "master_grads": _storages((m.grad for m in masters), seen),
        "opt_state": _storages(state, seen),
    }


@dataclass
class MemoryFigure:
    """One measured row: bytes of each part and the held/peak figures (bytes; the table prints B/param)."""

    row: str
    device: str
    shape: str
    variant: str
    numel: int
    parts: dict[str, int]  # PARTS -> bytes on the run's device ("other": held - the other parts)
    held_after_step: int
    after_zero_grad: int
    step_start: int
    peak: int
    method: str
    host_bytes: int = 0  # CUDA runs: the parts' bytes on the CPU (master_device="cpu"), not in the figures above
    note: str = ""

    @property
    def temporaries(self) -> int:
        return self.peak - max(self.step_start, self.held_after_step)

    def per_param(self, nbytes: int) -> float:
        return nbytes / self.numel

    def as_dict(self) -> dict[str, Any]:
        return {
            "row": self.row,
            "device": self.device,
            "shape": self.shape,
            "variant": self.variant,
            "kind": "memory",
            "numel": self.numel,
            "bytes": dict(self.parts),
            "held_after_step_bytes": self.held_after_step,
            "after_zero_grad_bytes": self.after_zero_grad,
            "step_start_bytes": self.step_start,
            "peak_bytes": self.peak,
            "temporaries_bytes": self.temporaries,
            "host_bytes": self.host_bytes,
            "bytes_per_param": {
                **{p: self.per_param(b) for p, b in self.parts.items()},
                "held_after_step": self.per_param(self.held_after_step),
                "after_zero_grad": self.per_param(self.after_zero_grad),
                "peak": self.per_param(self.peak),
                "temporaries": self.per_param(self.temporaries),
                "host": self.per_param(self.host_bytes),
            },
            "method": self.method,
            "note": self.note,
        }


@dataclass(frozen=True)
class StatedMemory:
    """A figure another system's paper or manual states (not measured): its parts and total in B/param, as text."""

    variant: str
    parts: dict[str, str]
    held: str
    source: str  # the footnote: where it is stated
    row: str = "memory"
    kind: str = field(default="stated")

    def as_dict(self) -> dict[str, Any]:
        return {
            "row": self.row,
            "variant": self.variant,
            "kind": self.kind,
            "bytes_per_param": dict(self.parts),
            "held": self.held,
            "source": self.source,
        }


_ZERO = (
    "Rajbhandari et al., ZeRO: Memory Optimizations Toward Training Trillion Parameter Models (SC20, "
    "arXiv:1910.02054), sec. 3.1: mixed-precision Adam holds 2 + 2 + K bytes per param, K = 12 (fp32 "
    "master, momentum, variance); stage 1 (P_os) partitions the K bytes over N_d data-parallel ranks"
)
_MEGATRON = (
    "Megatron-Core developer guide, 'Distributed Optimizer': bf16 params + fp32 grads, 18 B/param "
    "non-distributed, 6 + 12/d distributed (fp32 main params always)"
)
_REMAINDERS = (
    "Transformer Engine FusedAdam(store_param_remainders=True): the fp32 master kept as the 16 bits the bf16 "
    "param lacks (int16); Megatron-Core passes it with its precision-aware optimizer (TE >= 2.1)"
)

STATED: list[StatedMemory] = [
    StatedMemory(
        "DeepSpeed ZeRO stage 0, mixed-precision Adam",
        {"params": "2", "grads": "2", "opt_state": "8", "masters": "4"},
        "16",
        _ZERO,
    ),
    StatedMemory(
        "DeepSpeed ZeRO stage 1, per rank of N_d",
        {"params": "2", "grads": "2", "opt_state": "8/N_d", "masters": "4/N_d"},
        "4 + 12/N_d",
        _ZERO,
    ),
    StatedMemory(
        "Megatron-Core, bf16 params + fp32 main grads (not distributed)",
        {"params": "2", "grads": "4", "opt_state": "8", "masters": "4"},
        "18",
        _MEGATRON,
    ),
    StatedMemory(
        "Megatron-Core + store_param_remainders (16-bit master remainder)",
        {"params": "2", "grads": "4", "opt_state": "8", "masters": "2"},
        "16",
        _REMAINDERS,
    ),
]
"""The anchors: stated by their sources (docs/memory.md), not measured here."""


# ---------------------------------------------------------------------------- measuring


def _walk(nodes: Iterable[Any]) -> Iterator[Any]:
    stack = list(nodes)
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children)


class _CpuTimeline:
    """The CPU allocator's events of a profiled run: bytes held at any instant, the most held in a range.

    Read from the profiler's event tree (``kineto_results.experimental_event_tree()``: allocation events with
    their time, size -- negative for a free -- and address), and the ranges named ``fp16kit.bench.memory.*``."""

    def __init__(self, prof: Any) -> None:
        from torch._C._profiler import _EventType

        nodes = list(_walk(prof.profiler.kineto_results.experimental_event_tree()))
        events = sorted(
            (n.start_time_ns, n.extra_fields.alloc_size, n.extra_fields.ptr)
            for n in nodes
            if n.tag == _EventType.Allocation and n.extra_fields.device.type == "cpu"
        )
        # only the run's own memory: a free of a block allocated before the run (another row's, collected
        # now) is left out, as torch leaves out those of blocks allocated before any profiling
        live: set[int] = set()
        allocs: list[tuple[int, int]] = []
        for t, nbytes, ptr in events:
            if nbytes > 0:
                live.add(ptr)
            elif ptr in live:
                live.discard(ptr)
            else:
                continue
            allocs.append((t, nbytes))
        self.times = [t for t, _ in allocs]
        self.held = list(itertools.accumulate(b for _, b in allocs))
        self.ranges: dict[str, list[tuple[int, int]]] = {}
        for n in nodes:
            if n.name.startswith("fp16kit.bench.memory."):
                self.ranges.setdefault(n.name, []).append((n.start_time_ns, n.end_time_ns))
        for spans in self.ranges.values():
            spans.sort()

    def at(self, t: int) -> int:
        """Bytes held at time ``t`` (ns): the running sum of the events up to it."""
        i = bisect.bisect_right(self.times, t)
        return self.held[i - 1] if i else 0

    def peak(self, start: int, end: int) -> int:
        """The most bytes held at any instant from ``start`` to ``end``."""
        lo, hi = bisect.bisect_right(self.times, start), bisect.bisect_right(self.times, end)
        return max([self.at(start), *self.held[lo:hi]])

    def span(self, name: str) -> tuple[int, int]:
        return self.ranges[f"fp16kit.bench.memory.{name}"][-1]


def _marker(name: str) -> None:
    with torch.profiler.record_function(f"fp16kit.bench.memory.{name}"):
        pass


@contextlib.contextmanager
def _profiled() -> Iterator[Any]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield prof


def _cpu_window() -> Window:
    """The step's bounds as a ``record_function`` range the timeline finds by its name."""
    ranges: list[Any] = []

    def begin() -> None:
        rf = torch.profiler.record_function("fp16kit.bench.memory.step")
        rf.__enter__()
        ranges.append(rf)

    def end() -> None:
        ranges.pop().__exit__(None, None, None)

    return Window(begin, end)


def measure(
    make: Callable[[nn.Module], Recipe],
    build: Callable[[], nn.Module],
    x: torch.Tensor,
    *,
    steps: int = STEPS,
    variant: str = "",
    shape: str = "",
) -> MemoryFigure:
    """Build the model and the recipe, train ``steps`` steps, count the last one (see the module docstring).

    ``build`` makes the model on its device (inside the counted run); ``x`` is the batch, made before it."""
    if steps < 2:
        raise ValueError(f"steps must be >= 2 (the first makes the optimizer's state), got {steps}")
    device = x.device
    if device.type == "cuda":
        return _measure_cuda(make, build, x, steps, variant, shape)
    window = _cpu_window()
    with _profiled() as prof:
        model = build()
        recipe = make(model)
        for i in range(steps):
            recipe.zero_grad()
            recipe.iteration(x, window if i == steps - 1 else _null_window())
        parts = parts_bytes(recipe)
        recipe.finish()
        _marker("after_step")
        recipe.zero_grad()
        _marker("after_zero_grad")
    timeline = _CpuTimeline(prof)
    start, end = timeline.span("step")
    after_step, after_zero = (
        timeline.at(timeline.span("after_step")[0]),
        timeline.at(timeline.span("after_zero_grad")[0]),
    )
    figure = _figure(
        recipe, parts, "cpu", shape, variant, after_step,
        after_zero_grad=after_zero, step_start=timeline.at(start), peak=timeline.peak(start, end), method=CPU_METHOD,
    )  # fmt: skip
    del recipe, model, prof, timeline
    gc.collect()  # (optimizers hold reference cycles: free this run's memory before the next one starts)
    return figure


def _figure(
    recipe: Recipe,
    parts: dict[str, dict[str, int]],
    device: str,
    shape: str,
    variant: str,
    after_step: int,
    **fields: Any,
) -> MemoryFigure:
    """The figure of a measured run: its parts' bytes on ``device``, and "other", what is held beyond them."""
    counted = {p: b.get(device, 0) for p, b in parts.items()}
    counted["other"] = after_step - sum(counted.values())
    numel = sum(p.numel() for p in recipe.params)
    return MemoryFigure(
        row="memory", device=device, shape=shape, variant=variant, numel=numel, parts=counted,
        held_after_step=after_step, note=recipe.note, **fields,
    )  # fmt: skip


def _measure_cuda(
    make: Callable[[nn.Module], Recipe],
    build: Callable[[], nn.Module],
    x: torch.Tensor,
    steps: int,
    variant: str,
    shape: str,
) -> MemoryFigure:
    gc.collect()  # (memory from before the run freed during it would lower the run's figures)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    marks: dict[str, int] = {}

    def begin() -> None:
        torch.cuda.synchronize()
        marks["start"] = torch.cuda.memory_allocated() - base
        torch.cuda.reset_peak_memory_stats()

    def end() -> None:
        torch.cuda.synchronize()
        marks["peak"] = torch.cuda.max_memory_allocated() - base
        marks["end"] = torch.cuda.memory_allocated() - base

    model = build()
    recipe = make(model)
    for i in range(steps):
        recipe.zero_grad()
        recipe.iteration(x, Window(begin, end) if i == steps - 1 else _null_window())
    parts = parts_bytes(recipe)
    recipe.finish()
    torch.cuda.synchronize()
    after_step = torch.cuda.memory_allocated() - base
    recipe.zero_grad()
    torch.cuda.synchronize()
    after_zero = torch.cuda.memory_allocated() - base
    host = sum(b.get("cpu", 0) for b in parts.values())
    figure = _figure(
        recipe, parts, "cuda", shape, variant, after_step,
        after_zero_grad=after_zero, step_start=marks["start"], peak=marks["peak"], method=CUDA_METHOD, host_bytes=host,
    )  # fmt: skip
    del recipe, model
    torch.cuda.empty_cache()
    return figure


def run_recipes(
    device: torch.device, quick: bool, specs: Sequence[RecipeSpec] | None = None
) -> tuple[list[MemoryFigure], list[tuple[str, str]]]:
    """Every recipe that runs on ``device`` (:func:`recipes_for`), measured; and (label, why) of those skipped."""
    runnable, skipped = recipes_for(device)
    mlp = memory_model(quick)
    g = torch.Generator().manual_seed(1)
    gc.collect()  # the previous rows' objects
    figures = []
    for spec in specs if specs is not None else runnable:
        x = torch.randn(mlp.batch, mlp.width, generator=g).to(device, spec.dtype)
        build = functools.partial(mlp.build, spec.dtype, device)
        try:
            figures.append(measure(spec.make, build, x, variant=spec.label(device), shape=mlp.name))
        except Exception as e:  # e.g. a torch whose profiler reports differently: the row says so, the rest run
            logger.warning("fp16kit bench: could not measure the memory of %s (%s: %s)", spec.name, type(e).__name__, e)
            skipped.append((spec.label(device), f"could not be measured ({type(e).__name__}: {e})"))
    return figures, skipped
