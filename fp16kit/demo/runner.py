"""The demo's runner: every recipe trains epoch by epoch, side by side.

A row per epoch per recipe as soon as it is measured, then one summary per recipe.

Order (recipes interleaved per epoch, so that noise on a shared machine falls on all of them
alike and the time ratios compare like with like)::

    task, model0 = make_task(cfg), make_model(cfg)            # fp32, seeded
    recipes = [build(name, deepcopy(model0), cfg) for name in cfg.recipes]
    lost = [LostUpdates(recipe.optimizer) for recipe in recipes]   # step hooks
    for epoch in 1..epochs:
        for recipe in recipes:
            t0 = clock()
            for x, y in batches[epoch]:                       # the same batches for every recipe
                recipe.optimizer's lr = cfg.lr_at(step)       # the same schedule for every recipe
                loss = recipe.step(x, y)                      # kept as a tensor: no host read
                if trace: scales += recipe.loss_scale()
            recipe.synchronize(); device sync; t1 = clock()   # an async step in flight counts
            yield EpochRow(epoch, mean(losses), eval loss and accuracy, scale, skipped this epoch,
                           ms/step = (t1 - t0) / steps, elements lost / stepped this epoch,
                           weights finite?, state bytes now)

The lost-update hooks run inside the timed region, in every recipe alike (a copy and a
compare of the weights the optimizer steps, per step). Evaluation (outside it): the held-out
set through the recipe's own forward (an fp16 model computes in fp16), cross-entropy in fp32.
See :mod:`.measure` for what "lost" and the state bytes count.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from .config import DemoConfig
from .data import Task, loss_fn, make_model, make_task
from .measure import LostUpdates, state_bytes
from .recipes import Recipe, build

__all__ = ["EpochRow", "Summary", "DemoResult", "train", "run_demo", "summarize"]


@dataclass(frozen=True)
class EpochRow:
    """One recipe's figures for one epoch.

    ``scale`` is None for a recipe without a loss scale; ``skipped`` counts this epoch's
    skipped steps; ``step_scales`` is empty unless ``cfg.trace``. ``lost`` of the ``stepped``
    weight elements this epoch's steps updated were left unchanged
    (:class:`~.measure.LostUpdates`); ``finite``: the model's weights are all finite after the
    epoch; ``state``: bytes of training state held after its last step, per part
    (:func:`~.measure.state_bytes`), for a model of ``params`` elements."""

    recipe: str
    epoch: int
    train_loss: float
    eval_loss: float
    accuracy: float
    scale: float | None
    skipped: int
    ms_per_step: float
    step_losses: tuple[float, ...]
    step_scales: tuple[float, ...] = ()
    lost: int = 0
    stepped: int = 0
    finite: bool = True
    state: dict[str, int] = field(default_factory=dict)
    params: int = 0

    @property
    def updates_lost(self) -> float | None:
        """``lost / stepped``; None when no step was taken this epoch."""
        return _ratio(self.lost, self.stepped)


@dataclass(frozen=True)
class Summary:
    """One recipe after the last epoch.

    ``loss_vs_fp32`` is ``eval_loss / fp32's - 1`` and ``time_vs_fp32`` the ratio of the
    ms/step (None without the fp32 recipe in the run); ``ms_per_step`` is the median over the
    epochs (robust to a busy machine). ``updates_lost`` is over the whole run (elements lost
    / elements stepped; None if no step was taken), ``finite`` the last epoch's, ``state``
    the bytes after the last step and ``bytes_per_param`` their sum over the model's
    parameter count."""

    recipe: str
    eval_loss: float
    loss_vs_fp32: float | None
    accuracy: float
    skipped: int
    scale: float | None
    ms_per_step: float
    time_vs_fp32: float | None
    updates_lost: float | None = None
    finite: bool = True
    state: dict[str, int] = field(default_factory=dict)
    bytes_per_param: float | None = None


@dataclass(frozen=True)
class DemoResult:
    config: DemoConfig
    rows: list[EpochRow]
    summaries: list[Summary]
    seconds: float


def _evaluate(recipe: Recipe, task: Task, batch_size: int) -> tuple[float, float]:
    total = torch.zeros((), device=task.x_eval.device)
    correct = torch.zeros((), device=task.x_eval.device)
    with torch.no_grad():
        for start in range(0, task.x_eval.shape[0], batch_size):
            x, y = task.x_eval[start : start + batch_size], task.y_eval[start : start + batch_size]
            logits = recipe.predict(x)
            total += loss_fn(logits, y) * y.shape[0]
            correct += (logits.argmax(dim=1) == y).sum()
    n = task.x_eval.shape[0]
    return total.item() / n, correct.item() / n


def _device_sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(cfg: DemoConfig) -> Iterator[EpochRow]:
    """Train every recipe of ``cfg``; yield each :class:`EpochRow` as soon as it is measured.

    Epoch 1 of every recipe, in ``cfg.recipes`` order, then epoch 2, ...."""
    cfg.check()
    device = torch.device(cfg.device)
    task = make_task(cfg)
    model0 = make_model(cfg)
    recipes = {name: build(name, copy.deepcopy(model0), cfg) for name in cfg.recipes}
    counters = {name: LostUpdates(recipe.optimizer) for name, recipe in recipes.items()}
    params = sum(p.numel() for p in model0.parameters())
    skipped_so_far = dict.fromkeys(recipes, 0)
    counted_so_far = dict.fromkeys(recipes, (0, 0))
    for epoch in range(1, cfg.epochs + 1):
        batches = task.epoch_batches(epoch, cfg.steps_per_epoch)
        first = (epoch - 1) * cfg.steps_per_epoch
        lrs = [cfg.lr_at(first + i) for i in range(cfg.steps_per_epoch)]
        for name, recipe in recipes.items():
            losses: list[torch.Tensor] = []
            scales: list[float] = []
            groups = recipe.optimizer.param_groups
            _device_sync(device)
            start = time.perf_counter()
            for lr, (x, y) in zip(lrs, batches):
                for group in groups:  # what a training loop's schedule does before its step
                    group["lr"] = lr
                losses.append(recipe.step(x, y))
                if cfg.trace and recipe.loss_scale is not None:
                    scales.append(recipe.loss_scale())
            recipe.synchronize()
            _device_sync(device)
            elapsed = time.perf_counter() - start
            step_losses = torch.stack(losses).tolist()
            eval_loss, accuracy = _evaluate(recipe, task, cfg.batch_size)
            skipped = recipe.skipped_steps()
            lost, stepped = counters[name].counts()
            lost_before, stepped_before = counted_so_far[name]
            yield EpochRow(
                recipe=name,
                epoch=epoch,
                train_loss=sum(step_losses) / len(step_losses),
                eval_loss=eval_loss,
                accuracy=accuracy,
                scale=None if recipe.loss_scale is None else recipe.loss_scale(),
                skipped=skipped - skipped_so_far[name],
                ms_per_step=elapsed * 1e3 / cfg.steps_per_epoch,
                step_losses=tuple(step_losses),
                step_scales=tuple(scales),
                lost=lost - lost_before,
                stepped=stepped - stepped_before,
                finite=all(bool(p.isfinite().all()) for p in recipe.model.parameters()),
                state=state_bytes(recipe.model, recipe.optimizer),
                params=params,
            )
            skipped_so_far[name] = skipped
            counted_so_far[name] = lost, stepped


def summarize(rows: list[EpochRow]) -> list[Summary]:
    """One :class:`Summary` per recipe, in the order the rows name them."""
    by_recipe: dict[str, list[EpochRow]] = {}
    for row in rows:
        by_recipe.setdefault(row.recipe, []).append(row)
    ms = {name: statistics.median(r.ms_per_step for r in rs) for name, rs in by_recipe.items()}
    ref = by_recipe.get("fp32")
    out = []
    for name, rs in by_recipe.items():
        last = rs[-1]
        out.append(
            Summary(
                recipe=name,
                eval_loss=last.eval_loss,
                loss_vs_fp32=None if ref is None else last.eval_loss / ref[-1].eval_loss - 1.0,
                accuracy=last.accuracy,
                skipped=sum(r.skipped for r in rs),
                scale=last.scale,
                ms_per_step=ms[name],
                time_vs_fp32=None if ref is None else ms[name] / ms["fp32"],
                updates_lost=_ratio(sum(r.lost for r in rs), sum(r.stepped for r in rs)),
                finite=last.finite,
                state=dict(last.state),
                bytes_per_param=sum(last.state.values()) / last.params if last.params else None,
            )
        )
    return out


def _ratio(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def run_demo(cfg: DemoConfig | None = None, on_epoch: Callable[[EpochRow], None] | None = None) -> DemoResult:
    """Run :func:`train` to the end; return all rows and the summaries.

    Run :func:`train` to the end, calling ``on_epoch(row)`` as each row arrives; return all
    rows and the summaries."""
    cfg = DemoConfig() if cfg is None else cfg
    start = time.perf_counter()
    rows = []
    for row in train(cfg):
        rows.append(row)
        if on_epoch is not None:
            on_epoch(row)
    return DemoResult(cfg, rows, summarize(rows), time.perf_counter() - start)
