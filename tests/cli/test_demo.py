"""`fp16kit demo` (fp16kit.demo and fp16kit.cli.demo) and the command line around it."""

from __future__ import annotations

import dataclasses
import io
import logging
import math
import os
import re
import subprocess
import sys

import pytest
import torch

import fp16kit
from fp16kit.cli import main
from fp16kit.demo import RECIPE_NAMES, RECIPES, DemoConfig, EpochRow, run_demo, runner, summarize
from fp16kit.demo.data import loss_fn, make_model, make_task
from fp16kit.demo.measure import STATE_PARTS
from fp16kit.legacy.amp._amp_state import _amp_state

# tiny runs: a few seconds for the whole file
TINY = dict(epochs=2, steps_per_epoch=12, batch_size=64, hidden=48, eval_size=256, lr=6e-3)
TINY_ARGS = ["--epochs", "2", "--steps", "4"]
NO_MASTERS = ("fp16-no-masters", "bf16-no-masters")
MIXED = [r for r in RECIPE_NAMES if r != "fp32" and r not in NO_MASTERS]  # in cfg.dtype, scaled in fp16
MASTERS = ("fp16-optimizer", "amp-o2", "master-weights", "async")


pytestmark = pytest.mark.usefixtures("amp_state_restored")  # (tests/conftest.py)


@pytest.fixture(scope="module")
def tiny_result():
    saved = dict(vars(_amp_state))
    try:
        return run_demo(DemoConfig(**TINY))
    finally:
        vars(_amp_state).clear()
        vars(_amp_state).update(saved)


def _rows(result, recipe):
    return [r for r in result.rows if r.recipe == recipe]


# ---------------------------------------------------------------------------- the runner


def test_recipes_are_registered_in_order():
    assert tuple(RECIPES) == RECIPE_NAMES
    assert {info.face for info in RECIPES.values()} == {"torch", "legacy", "modern"}


def test_rows_come_epoch_by_epoch_in_recipe_order(tiny_result):
    order = [(r.epoch, r.recipe) for r in tiny_result.rows]
    assert order == [(e, name) for e in (1, 2) for name in RECIPE_NAMES]
    assert [s.recipe for s in tiny_result.summaries] == list(RECIPE_NAMES)
    for r in tiny_result.rows:
        assert len(r.step_losses) == TINY["steps_per_epoch"] and r.step_scales == ()
        assert r.ms_per_step > 0 and 0 <= r.accuracy <= 1


def test_every_recipe_starts_from_the_same_weights_on_the_same_batches(tiny_result):
    # the first step of every recipe: same w0, same batch -> the same loss up to fp16 (bf16)
    # rounding
    first = {r.recipe: r.step_losses[0] for r in tiny_result.rows if r.epoch == 1}
    for name, loss in first.items():
        assert loss == pytest.approx(first["fp32"], rel=1e-2 if name == "bf16-no-masters" else 2e-3), name
    # ... and that batch is the one the task defines for epoch 1
    cfg = DemoConfig(**TINY)
    x, y = make_task(cfg).epoch_batches(1, 1)[0]
    assert loss_fn(make_model(cfg)(x), y).item() == pytest.approx(first["fp32"], rel=1e-6)


def test_each_synchronous_recipe_learns_and_tracks_fp32(tiny_result):
    ref = _rows(tiny_result, "fp32")
    assert ref[1].eval_loss < ref[0].eval_loss and ref[1].eval_loss < 0.9 * ref[0].step_losses[0]  # it learns
    for name in ("fp16-optimizer", "amp-o2", "autocast", "master-weights"):
        rows = _rows(tiny_result, name)
        for r, f in zip(rows, ref):
            assert r.eval_loss == pytest.approx(f.eval_loss, rel=0.01), (name, r.epoch)
            assert r.step_losses == pytest.approx(f.step_losses, rel=0.01), (name, r.epoch)
            assert r.skipped == 0 and r.scale == 2.0**16  # no overflow at 2**16, no growth in 24 steps
    assert _rows(tiny_result, "fp32")[-1].scale is None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_recipes_train_what_they_say(dtype):
    # model dtype; what the optimizer steps (masters: fp32 tensors that are not the model's);
    # the dtype its state is kept in
    cfg = DemoConfig(**TINY, dtype=dtype)
    seen = {}
    for name in RECIPE_NAMES:
        recipe = RECIPES[name].build(make_model(cfg), cfg)
        x, y = make_task(cfg).epoch_batches(1, 1)[0]
        recipe.step(x, y)
        recipe.synchronize()
        model_params = {id(p) for p in recipe.model.parameters()}
        stepped = [p for g in recipe.optimizer.param_groups for p in g["params"]]
        seen[name] = (
            {p.dtype for p in recipe.model.parameters()},
            all(id(p) in model_params for p in stepped),
            {p.dtype for p in stepped},
            {v.dtype for st in recipe.optimizer.state.values() for k, v in st.items() if k != "step"},
        )
    fp32 = ({torch.float32}, True, {torch.float32}, {torch.float32})
    assert seen["fp32"] == seen["autocast"] == fp32
    for name in MASTERS:
        assert seen[name] == ({dtype}, False, {torch.float32}, {torch.float32}), name
    assert seen["fp16-no-masters"] == ({torch.float16}, True, {torch.float16}, {torch.float16})
    assert seen["bf16-no-masters"] == ({torch.bfloat16}, True, {torch.bfloat16}, {torch.bfloat16})


def _delayed_reference(cfg: DemoConfig, steps: int, delay: int) -> list[float]:
    """fp32 AdamW where the update at step k uses the gradient computed ``delay`` updates
    earlier (0: synchronous training) and the k-th lr of the schedule, on the demo's batches
    from the demo's initial weights; inputs rounded to fp16 as the fp16 model sees them."""
    model = make_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.peak_lr)
    params = list(model.parameters())
    pending, losses, updates = [], [], 0
    for x, y in make_task(cfg).epoch_batches(1, steps):
        loss = loss_fn(model(x.half().float()), y)
        losses.append(loss.item())
        pending.append(torch.autograd.grad(loss, params))
        if len(pending) > delay:
            for p, g in zip(params, pending.pop(0)):
                p.grad = g
            opt.param_groups[0]["lr"] = cfg.lr_at(updates)
            opt.step()
            updates += 1
    return losses


def test_async_steps_are_a_one_step_delayed_update():
    cfg = DemoConfig(**dict(TINY, epochs=1, steps_per_epoch=10, hidden=64), recipes=("master-weights", "async"))
    rows = {r.recipe: r for r in run_demo(cfg).rows}
    sync, delayed = _delayed_reference(cfg, 10, 0), _delayed_reference(cfg, 10, 1)
    assert max(abs(a - b) for a, b in zip(sync, delayed)) > 0.01  # the two references differ
    assert rows["master-weights"].step_losses == pytest.approx(sync, abs=1e-3)
    assert rows["async"].step_losses == pytest.approx(delayed, abs=1e-3)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_every_recipe_runs_on_cuda_and_tracks_fp32(capsys):
    result = run_demo(DemoConfig(**TINY, device="cuda"))
    by = {s.recipe: s for s in result.summaries}
    for name in ("fp16-optimizer", "amp-o2", "autocast", "master-weights"):
        assert by[name].eval_loss == pytest.approx(by["fp32"].eval_loss, rel=0.01), name
        assert by[name].skipped == 0 and by[name].scale == 2.0**16, name
    assert by["async"].eval_loss == pytest.approx(by["fp32"].eval_loss, rel=0.1)
    assert main(["demo", *TINY_ARGS, "--device", "cuda", "--recipes", "fp32", "async"]) == 0
    assert torch.cuda.get_device_name() in capsys.readouterr().out.splitlines()[0]


def test_bfloat16_recipes_track_fp32():
    cfg = DemoConfig(**dict(TINY, epochs=1), dtype=torch.bfloat16, recipes=("fp32", *MIXED))
    result = run_demo(cfg)
    ref = _rows(result, "fp32")[-1].eval_loss
    for s in result.summaries:
        assert s.eval_loss == pytest.approx(ref, rel=0.1 if s.recipe == "async" else 0.03), s.recipe


def test_skipped_steps_are_reported_when_the_init_scale_is_too_high():
    # 2**40 overflows the fp16 grads: every scaler halves and skips until the grads fit; no
    # growth within the run (growth_interval 1000), so final scale == start / 2**skipped, where
    # apex's scalers start at most at their max_loss_scale, 2**24, and torch's have no cap.
    cfg = DemoConfig(**dict(TINY, epochs=1, steps_per_epoch=30), init_scale=2.0**40, growth_interval=1000)
    result = run_demo(cfg)
    by = {s.recipe: s for s in result.summaries}
    for name in ("fp32", *NO_MASTERS):  # no loss scale: nothing to overflow
        assert by[name].skipped == 0 and by[name].scale is None, name
    for name in MIXED:
        s = by[name]
        start = 2.0**24 if name in ("fp16-optimizer", "amp-o2") else 2.0**40
        assert s.skipped >= 1, name
        assert s.scale == start / 2.0**s.skipped, (name, s.scale, s.skipped)
    # one rule per face, one result: the apex pair skip alike, and so do the torch-rule three
    assert (by["fp16-optimizer"].skipped, by["fp16-optimizer"].scale) == (by["amp-o2"].skipped, by["amp-o2"].scale)
    assert len({(by[n].skipped, by[n].scale) for n in ("autocast", "master-weights", "async")}) == 1


def test_trace_records_the_scale_after_every_step():
    cfg = DemoConfig(
        **dict(TINY, epochs=1, steps_per_epoch=6),
        init_scale=2.0**40,
        growth_interval=1000,
        recipes=("fp32", "autocast"),
        trace=True,
    )
    rows = {r.recipe: r for r in run_demo(cfg).rows}
    assert rows["fp32"].step_scales == ()
    scales = rows["autocast"].step_scales
    assert len(scales) == 6 and scales[-1] == rows["autocast"].scale
    assert all(b in (a, a / 2) for a, b in zip((2.0**40,) + scales, scales))  # halved or kept, per step
    assert scales[0] == 2.0**39


def test_summaries_follow_their_formulas():
    def row(recipe, epoch, loss, ms, skipped=0, scale=None, lost=0, state=(4, 4, 8, 0)):
        return EpochRow(
            recipe,
            epoch,
            loss,
            loss,
            0.5,
            scale,
            skipped,
            ms,
            (loss,),
            lost=lost,
            stepped=10,
            finite=epoch < 3 or recipe == "fp32",
            state=dict(zip(STATE_PARTS, state)),
            params=2,
        )

    rows = [
        row("fp32", 1, 2.0, 10.0),
        row("x", 1, 2.5, 30.0, 2, 8.0, lost=1, state=(2, 2, 8, 8)),
        row("fp32", 2, 1.0, 14.0),
        row("x", 2, 1.5, 20.0, 1, 4.0, lost=4, state=(2, 2, 8, 8)),
        row("fp32", 3, 0.5, 12.0),
        row("x", 3, 0.6, 90.0, 0, 4.0, lost=1, state=(2, 0, 8, 8)),
    ]
    fp32, x = summarize(rows)
    assert (fp32.recipe, x.recipe) == ("fp32", "x")
    assert fp32.ms_per_step == 12.0 and x.ms_per_step == 30.0  # medians
    assert x.time_vs_fp32 == pytest.approx(30.0 / 12.0) and fp32.time_vs_fp32 == 1.0
    assert x.loss_vs_fp32 == pytest.approx(0.6 / 0.5 - 1) and x.eval_loss == 0.6
    assert x.skipped == 3 and x.scale == 4.0 and fp32.scale is None
    assert x.updates_lost == pytest.approx(6 / 30) and fp32.updates_lost == 0.0  # over the run
    assert [r.updates_lost for r in rows if r.recipe == "x"] == [0.1, 0.4, 0.1]  # per epoch
    assert x.state == dict(zip(STATE_PARTS, (2, 0, 8, 8))) and x.bytes_per_param == 9.0  # after the last
    assert fp32.bytes_per_param == 8.0
    assert fp32.finite and not x.finite  # the last epoch's
    (alone,) = summarize([r for r in rows if r.recipe == "x"])
    assert alone.loss_vs_fp32 is None and alone.time_vs_fp32 is None


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(dtype=torch.float32), "torch.float16 or torch.bfloat16"),
        (dict(recipes=("fp32", "apex")), r"unknown demo recipe\(s\) \['apex'\]"),
        (dict(recipes=("fp32", "fp32")), "names a recipe twice"),
        (dict(recipes=()), "is empty"),
        (dict(epochs=0), "epochs must be an int >= 1"),
        (dict(device="mps"), "'cpu' or 'cuda'"),
        (dict(init_scale=0.0), "init_scale must be a finite number > 0"),
        (dict(init_scale=math.inf), "init_scale must be a finite number > 0"),
        (dict(optimizer="lamb"), r"unknown demo optimizer 'lamb'; choose from \['adamw', 'sgd'\]"),
        (dict(lr=0.0), "lr must be a finite number > 0"),
        (dict(lr=math.nan), "lr must be a finite number > 0"),
    ],
)
def test_bad_configs_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DemoConfig(**kwargs)


# ------------------------------------------------------- the rows a user decides on


def _summaries(cfg: DemoConfig) -> dict:
    return {s.recipe: s for s in run_demo(cfg).summaries}


def test_without_masters_adamw_loses_bf16_updates_and_fp16_weights():
    # a fast variant of the default run (AdamW at its default lr, cosine-decayed)
    by = _summaries(DemoConfig(**dict(TINY, lr=None)))
    for name in ("fp32", *MASTERS, "autocast"):  # fp32 weights lose next to nothing (2**-24 |w|)
        assert by[name].updates_lost < 1e-4 and by[name].finite, name
    assert by["bf16-no-masters"].finite and by["bf16-no-masters"].updates_lost > 0.15
    assert not by["fp16-no-masters"].finite  # Adam's fp16 state: see the next test


def test_fp16_adamw_without_masters_divides_by_zero_at_its_first_step():
    # why the fp16-no-masters row is inf/NaN with AdamW: torch keeps Adam's state in the
    # params' dtype; in fp16 (1 - beta2) * g**2 underflows to 0 and so does eps (1e-8), so
    # m / (sqrt(v) + eps) divides by zero. The same first step with fp32 masters stays finite.
    cfg = DemoConfig(**dict(TINY, lr=None))
    x, y = make_task(cfg).epoch_batches(1, 1)[0]
    assert torch.tensor(1e-8, dtype=torch.float16) == 0
    recipe = RECIPES["fp16-no-masters"].build(make_model(cfg), cfg)
    recipe.step(x, y)
    for p in recipe.model.parameters():
        v = recipe.optimizer.state[p]["exp_avg_sq"]
        assert torch.equal(~p.isfinite(), v == 0)  # inf exactly where the second moment underflowed
    assert sum(int((~p.isfinite()).sum()) for p in recipe.model.parameters()) > 0.5 * sum(
        p.numel() for p in recipe.model.parameters()
    )
    masters = RECIPES["master-weights"].build(make_model(cfg), cfg)
    masters.step(x, y)
    assert all(bool(p.isfinite().all()) for p in masters.model.parameters())


def test_without_masters_sgd_loses_fp16_and_more_bf16_updates():
    by = _summaries(DemoConfig(**dict(TINY, lr=None), optimizer="sgd"))
    # fp32 and the masters leave unchanged only the few elements whose gradient is 0
    assert by["fp32"].updates_lost < 1e-3
    for name in MASTERS:
        assert by[name].updates_lost < 1e-3, name
    fp16, bf16 = by["fp16-no-masters"], by["bf16-no-masters"]
    assert fp16.finite and bf16.finite
    assert 0.2 < fp16.updates_lost < bf16.updates_lost  # 11 significant bits lose fewer than 8


@pytest.mark.slow
def test_the_default_run_shows_what_masters_are_for():
    # the demo's real config (what `fp16kit demo` prints; each recipe trains on its own, so a
    # subset gives the same rows)
    by = _summaries(DemoConfig(recipes=("fp32", "master-weights", *NO_MASTERS)))
    for name in ("fp32", "master-weights"):
        assert by[name].updates_lost < 1e-4 and by[name].finite, name
        assert by[name].eval_loss == pytest.approx(by["fp32"].eval_loss, rel=0.01), name
    bf16 = by["bf16-no-masters"]
    assert bf16.updates_lost > 0.3
    assert bf16.loss_vs_fp32 > 2 * by["master-weights"].loss_vs_fp32 > 0  # visibly worse than with masters
    assert not by["fp16-no-masters"].finite


def _recorded_recipes(monkeypatch) -> dict:
    built = {}
    real_build = runner.build

    def build(name, model, cfg):
        built[name] = real_build(name, model, cfg)
        return built[name]

    monkeypatch.setattr(runner, "build", build)
    return built


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_the_state_bytes_are_the_tensors_bytes(monkeypatch):
    built = _recorded_recipes(monkeypatch)
    result = run_demo(DemoConfig(**TINY))
    n = sum(p.numel() for p in make_model(DemoConfig(**TINY)).parameters())
    by = {s.recipe: s for s in result.summaries}
    for name, recipe in built.items():
        params = list(recipe.model.parameters())
        ids = {id(p) for p in params}
        masters = [p for g in recipe.optimizer.param_groups for p in g["params"] if id(p) not in ids]
        expected = {
            "weights": _tensor_bytes(params),
            "grads": _tensor_bytes(p.grad for p in params if p.grad is not None),
            "optimizer state": _tensor_bytes(
                v for st in recipe.optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)
            ),
            "masters": _tensor_bytes(masters) + _tensor_bytes(m.grad for m in masters if m.grad is not None),
        }
        assert by[name].state == expected, name
        assert by[name].bytes_per_param == sum(expected.values()) / n, name
    # the autocast baseline holds what fp32 holds; masters hold more; 16-bit without them, half
    assert by["autocast"].state == by["fp32"].state
    assert by["master-weights"].bytes_per_param > by["fp32"].bytes_per_param
    assert by["bf16-no-masters"].bytes_per_param == pytest.approx(by["fp32"].bytes_per_param / 2, rel=1e-3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_only_fp16_runs_scale_the_loss(dtype):
    # the first backward's grads, measured on the model's first weight: init_scale times the
    # fp32 recipe's in fp16, the same in bf16 (no recipe scales the loss)
    cfg = DemoConfig(**TINY, dtype=dtype)
    x, y = make_task(cfg).epoch_batches(1, 1)[0]
    norms = {}
    for name in ("fp32", *MIXED):
        recipe = RECIPES[name].build(make_model(cfg), cfg)
        weight = next(recipe.model.parameters())
        seen = []
        weight.register_hook(lambda g: seen.append(g.float().norm().item()))
        recipe.step(x, y)
        recipe.synchronize()
        norms[name] = seen[0]
        assert name == "fp32" or (recipe.loss_scale is None) is (dtype == torch.bfloat16), name
    expected = cfg.init_scale if dtype == torch.float16 else 1.0
    for name in MIXED:
        assert norms[name] / norms["fp32"] == pytest.approx(expected, rel=0.05), name


def test_every_recipe_steps_with_the_same_lr_schedule(monkeypatch):
    cfg = DemoConfig(**TINY)
    real_build = runner.build
    lrs = {}

    def build(name, model, cfg):
        recipe = real_build(name, model, cfg)
        lrs[name] = []

        def step(x, y):
            lrs[name].append(recipe.optimizer.param_groups[0]["lr"])
            return recipe.step(x, y)

        return dataclasses.replace(recipe, step=step)

    monkeypatch.setattr(runner, "build", build)
    run_demo(cfg)
    schedule = [cfg.lr_at(i) for i in range(cfg.total_steps)]
    assert set(lrs) == set(RECIPE_NAMES) and all(v == schedule for v in lrs.values())
    assert schedule[0] == cfg.peak_lr == 6e-3
    assert all(a > b for a, b in zip(schedule, schedule[1:]))
    assert cfg.lr_at(cfg.total_steps) == pytest.approx(cfg.peak_lr / 10)


def test_the_optimizer_is_the_run_s(monkeypatch):
    built = _recorded_recipes(monkeypatch)
    cfg = DemoConfig(**dict(TINY, epochs=1, steps_per_epoch=1), optimizer="sgd")
    run_demo(cfg)
    for name, recipe in built.items():
        assert type(recipe.optimizer) is torch.optim.SGD, name
        assert recipe.optimizer.param_groups[0]["momentum"] == 0.9, name
    assert DemoConfig(optimizer="sgd").peak_lr == 0.02 and DemoConfig().peak_lr == 3e-3


# ---------------------------------------------------------------------------- the command


def _table_lines(out: str) -> list[str]:
    """The per-epoch lines: an epoch number, two spaces, a recipe."""
    return [line for line in out.splitlines() if re.match(r" *\d+  [a-z]", line)]


_CELL = re.compile(r"\S+(?: \S+)*")  # a table's cells: text two or more spaces apart


def _parse(lines: list[str]) -> list[dict[str, str]]:
    """A two-line header and its rows -> one {column name: cell} per row. A cell belongs to
    the header cell it is aligned with (same end: right-aligned; same start: left-aligned); a
    column's name is its two header lines joined."""
    top = {m.end(): m.group() for m in _CELL.finditer(lines[0])}
    columns = [(m.start(), m.end(), f"{top.get(m.end(), '')} {m.group()}".strip()) for m in _CELL.finditer(lines[1])]
    rows = []
    for line in lines[2:]:
        row = {}
        for m in _CELL.finditer(line):
            (name,) = [n for start, end, n in columns if m.end() == end or m.start() == start]
            row[name] = m.group()
        assert len(row) == len(columns), line
        rows.append(row)
    return rows


def _final_table(out: str) -> dict[str, dict[str, str]]:
    lines = out[out.index("\nafter ") :].splitlines()[2:]
    lines = lines[: lines.index("")]
    return {row["recipe"]: row for row in _parse(lines)}


def _epoch_table(out: str) -> list[dict[str, str]]:
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.lstrip().startswith("epoch  recipe"))
    return _parse(lines[at - 1 : at + 1] + _table_lines(out))


FINAL_COLUMNS = [
    "recipe",
    "eval loss",
    "loss vs fp32",
    "accuracy",
    "updates lost",
    "skipped (total)",
    "final loss scale",
    "bytes /param",
    "time/step (x fp32)",
]
EPOCH_COLUMNS = [
    "epoch",
    "recipe",
    "train loss",
    "eval loss",
    "accuracy",
    "updates lost",
    "loss scale",
    "skipped (epoch)",
    "ms /step",
]


def test_cli_prints_a_header_rows_and_a_table(capsys):
    assert main(["demo", *TINY_ARGS]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith(f"fp16kit {fp16kit.__version__} demo: torch ")  # no warning first
    for name in RECIPE_NAMES:
        assert f"  {name} " in out
    assert "fp16kit.legacy.FP16_Optimizer" in out and 'opt_level="O2"' in out and "async_step=True" in out
    assert "float16 model + AdamW on its own weights: no masters" in out
    assert "bfloat16 model + AdamW on its own weights: no masters" in out
    assert "AdamW lr 0.003 cosine-decayed to 0.0003" in out
    epochs = _epoch_table(out)
    assert list(epochs[0]) == EPOCH_COLUMNS  # labelled, each value under its label
    assert [(r["epoch"], r["recipe"]) for r in epochs] == [(str(e), n) for e in (1, 2) for n in RECIPE_NAMES]
    final = _final_table(out)
    assert list(final) == list(RECIPE_NAMES)
    assert all(list(row) == FINAL_COLUMNS for row in final.values())
    assert final["fp32"]["loss vs fp32"] == "-" and final["fp32"]["time/step (x fp32)"] == "1.00x"
    assert final["fp32"]["final loss scale"] == "no loss scale" and final["fp32"]["skipped (total)"] == "-"
    assert final["master-weights"]["skipped (total)"] == "0"
    assert final["master-weights"]["final loss scale"] == "65536"
    for name in NO_MASTERS:
        assert final[name]["final loss scale"] == "no loss scale" and final[name]["skipped (total)"] == "-"
    assert "done in" in out


def test_cli_shows_what_the_no_master_rows_lose(capsys):
    assert main(["demo", *TINY_ARGS]) == 0
    out = capsys.readouterr().out
    final = _final_table(out)
    assert final["fp16-no-masters"]["updates lost"] == "nan" and final["fp16-no-masters"]["eval loss"] == "nan"
    assert re.fullmatch(r"\d+\.\d%", final["bf16-no-masters"]["updates lost"])
    for name in ("fp32", *MASTERS, "autocast"):
        assert final[name]["updates lost"] == "0.0%", name
    notes = " ".join(out[out.index("\nafter ") :].split())
    assert "fp16-no-masters: its weights are inf/NaN after epoch 1: AdamW keeps its state" in notes
    assert "--optimizer sgd shows fp16's rounding instead" in notes
    assert "bytes/param = weights + grads + optimizer state + masters: fp32, autocast 4+4+8+0;" in notes


def test_cli_bfloat16_runs_without_a_loss_scale(capsys):
    assert main(["demo", *TINY_ARGS, "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "loss scales: none -- bf16 has float32's exponent range" in " ".join(out.split())
    assert "GradScaler" not in out.split("\n\n")[1]  # the recipe list: no scaler anywhere
    assert "bfloat16 model, fp32 masters: MixedPrecisionOptimizer, no loss scale" in out
    for row in [*_final_table(out).values(), *_epoch_table(out)]:
        scale = row.get("final loss scale", row.get("loss scale"))
        assert scale == "no loss scale", row
        assert row.get("skipped (total)", row.get("skipped (epoch)")) == "-", row


def test_cli_optimizer_and_lr(capsys):
    assert main(["demo", *TINY_ARGS, "--optimizer", "sgd", "--lr", "0.05", "--recipes", "fp32", "fp16-no-masters"]) == 0
    out = capsys.readouterr().out
    assert "SGD momentum 0.9 lr 0.05 cosine-decayed to 0.005" in " ".join(out.split())
    assert "torch.optim.SGD(momentum=0.9), float32 throughout" in out
    assert "float16 model + SGD(momentum=0.9) on its own weights: no masters" in out
    assert _final_table(out)["fp16-no-masters"]["updates lost"] != "nan"  # SGD keeps fp16 finite


def test_cli_help_documents_the_rows_and_the_columns(capsys):
    with pytest.raises(SystemExit) as e:
        main(["demo", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    rows = out[out.index("the rows") : out.index("the final table's columns")]
    for name in RECIPE_NAMES:
        assert re.search(rf"^  {re.escape(name)} +\S", rows, re.M), name
    assert "no masters" in rows and "no loss scale" in " ".join(rows.split())
    columns = " ".join(out[out.index("the final table's columns") :].split())
    for text in (
        "eval loss, vs fp32",
        "accuracy",
        "updates lost",
        "skipped (total)",
        "loss scale",
        "bytes/param",
        "weights + grads + optimizer state + masters",
        "time/step (x fp32)",
        "multiple of fp32's",
        "per-epoch lines: in that epoch",
        '"no loss scale"',
    ):
        assert text in columns, text


def test_cli_prints_each_row_as_soon_as_it_is_measured(capsys, monkeypatch):
    # every training step writes a marker to the same stream: epoch 1's rows must be out
    # before epoch 2's first step
    real_build = runner.build

    def build(name, model, cfg):
        recipe = real_build(name, model, cfg)

        def step(x, y):
            sys.stdout.write(f"<step {name}>\n")
            return recipe.step(x, y)

        return dataclasses.replace(recipe, step=step)

    monkeypatch.setattr(runner, "build", build)
    assert main(["demo", "--epochs", "2", "--steps", "2", "--recipes", "fp32", "autocast"]) == 0
    events = []
    for line in capsys.readouterr().out.splitlines():
        if line.startswith("<step"):
            events.append(line)
        elif line in _table_lines(line):
            events.append("row " + " ".join(line.split()[:2]))
    assert events == [
        "<step fp32>",
        "<step fp32>",
        "row 1 fp32",
        "<step autocast>",
        "<step autocast>",
        "row 1 autocast",
        "<step fp32>",
        "<step fp32>",
        "row 2 fp32",
        "<step autocast>",
        "<step autocast>",
        "row 2 autocast",
    ]


def test_cli_recipes_subset(capsys):
    assert main(["demo", *TINY_ARGS, "--recipes", "amp-o2", "fp32"]) == 0
    out = capsys.readouterr().out
    rows = _table_lines(out)
    assert [line.split()[1] for line in rows] == ["amp-o2", "fp32"] * 2
    assert "master-weights" not in out and "async" not in out


def test_cli_subset_without_fp32_has_no_ratios(capsys):
    assert main(["demo", *TINY_ARGS, "--recipes", "autocast"]) == 0
    (final,) = _final_table(capsys.readouterr().out).values()
    assert final["recipe"] == "autocast" and final["loss vs fp32"] == "-" and final["time/step (x fp32)"] == "-"


def test_cli_device_cuda_without_cuda_is_refused_before_training(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["demo", "--device", "cuda"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("fp16kit demo: error: CUDA is not available")
    assert "--device cpu" in captured.err


def test_cli_rejects_an_unknown_recipe(capsys):
    with pytest.raises(SystemExit) as e:
        main(["demo", "--recipes", "apex"])
    assert e.value.code == 2
    assert "invalid choice: 'apex'" in capsys.readouterr().err


def test_cli_plot_without_matplotlib_names_the_extra(capsys, monkeypatch, tmp_path):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    target = tmp_path / "curves.png"
    assert main(["demo", *TINY_ARGS, "--plot", str(target)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # refused before training
    assert 'pip install "fp16kit[plot]"' in captured.err and "matplotlib" in captured.err
    assert not target.exists()


def test_cli_plot_into_a_missing_folder_is_refused(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    assert main(["demo", *TINY_ARGS, "--plot", str(tmp_path / "nope" / "curves.png")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_plot_writes_a_png(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    target = tmp_path / "curves.png"
    assert main(["demo", *TINY_ARGS, "--recipes", "fp32", "autocast", "--plot", str(target)]) == 0
    assert f"plot written to {target}" in capsys.readouterr().out
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _overflow_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("Gradient overflow.")]


def test_cli_counts_and_hides_overflow_warnings_unless_verbose(capsys, caplog):
    # the real path: FP16_Optimizer logs apex's line on each overflow, wherever the legacy face logs it
    args = ["demo", "--epochs", "1", "--steps", "3", "--recipes", "fp16-optimizer", "--init-scale", str(2.0**40)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert '3 of apex\'s "Gradient overflow. Skipping step" messages hidden' in " ".join(out.split())  # 3 overflows
    assert _overflow_lines(out) == []
    assert not [r for r in caplog.records if r.name.startswith("fp16kit")]  # nor in the script's logging
    assert main([*args, "--verbose"]) == 0
    out = capsys.readouterr().out
    assert "hidden" not in out
    # where the legacy face puts them: stdout (the fp16kit.apex logger), or the fp16kit logger's
    # records in the versions before it
    shown = [r for r in caplog.records if r.name == "fp16kit" and r.getMessage().startswith("Gradient overflow.")]
    assert len(_overflow_lines(out)) + len(shown) == 3


@pytest.fixture
def apex_logger(monkeypatch):
    """The legacy faces' own logger as set up for apex's lines: a stdout-like handler of its own
    (here a StringIO), no propagation, INFO lines (amp's banner) on."""
    logger = logging.getLogger("fp16kit.apex")
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    monkeypatch.setattr(logger, "handlers", [handler])
    monkeypatch.setattr(logger, "propagate", False)
    monkeypatch.setattr(logger, "level", logging.INFO)
    return logger, handler, stream


def _logging_steps(monkeypatch, *records):
    real_build = runner.build

    def build(name, model, cfg):
        recipe = real_build(name, model, cfg)

        def step(x, y):
            for level, message in records:
                logging.getLogger("fp16kit.apex").log(level, message)
            return recipe.step(x, y)

        return dataclasses.replace(recipe, step=step)

    monkeypatch.setattr(runner, "build", build)


@pytest.mark.parametrize("verbose", [False, True])
def test_overflow_lines_on_the_apex_logger_are_counted_and_kept_out_of_the_table(
    capsys, monkeypatch, apex_logger, verbose
):
    logger, handler, stream = apex_logger
    overflow = "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 32768.0"
    other = "Warning:  something the demo does not expect"
    banner = "Selected optimization level O2:  ..."
    _logging_steps(monkeypatch, (logging.WARNING, overflow), (logging.WARNING, other), (logging.INFO, banner))
    args = ["demo", "--epochs", "1", "--steps", "2", "--recipes", "fp32", "autocast"]
    before = list(logger.handlers)  # with pytest's capture handlers: it attaches them to non-propagating loggers
    assert handler in before
    assert main([*args, "--verbose"] if verbose else args) == 0
    out = capsys.readouterr().out
    assert ("4 of apex's" in out) is not verbose  # 2 steps x 2 recipes
    assert _overflow_lines(out) == [] and banner not in out  # nothing cuts the table
    # the unexpected warning went where it would have gone; with --verbose, every line
    assert stream.getvalue().splitlines() == ([overflow, other, banner] if verbose else [other]) * 4
    assert logger.handlers == before  # put back
    assert logging.getLogger("fp16kit").filters == []


def test_the_apex_logger_is_put_back_after_an_interrupt(capsys, monkeypatch, apex_logger):
    logger, handler, _ = apex_logger
    real_build = runner.build

    def build(name, model, cfg):
        def step(x, y):
            raise KeyboardInterrupt

        return dataclasses.replace(real_build(name, model, cfg), step=step)

    monkeypatch.setattr(runner, "build", build)
    before = list(logger.handlers)
    assert handler in before
    assert main(["demo", "--epochs", "1", "--steps", "2", "--recipes", "fp32"]) == 130
    assert "interrupted" in capsys.readouterr().err
    assert logger.handlers == before and logging.getLogger("fp16kit").filters == []


@pytest.mark.parametrize(
    "args, message",
    [
        (["--epochs", "0"], "must be >= 1"),
        (["--init-scale", "inf"], "must be a finite number > 0"),
        (["--init-scale", "nan"], "must be a finite number > 0"),
    ],
)
def test_cli_rejects_bad_arguments(capsys, args, message):
    with pytest.raises(SystemExit) as e:
        main(["demo", *args])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_without_command_prints_help(capsys):
    assert main([]) == 2
    assert "demo" in capsys.readouterr().out


def _python(*args: str) -> subprocess.CompletedProcess:
    root = os.path.dirname(os.path.dirname(os.path.abspath(fp16kit.__file__)))
    # torch without numpy warns at import (torch's warning, not ours): silenced here only
    env = dict(os.environ, PYTHONPATH=root, PYTHONWARNINGS="ignore:Failed to initialize NumPy")
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=120)


def test_cli_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"fp16kit {fp16kit.__version__}"


@pytest.mark.slow
def test_python_dash_m_fp16kit_demo_writes_no_warning():
    # `python -m fp16kit` runs the command line; an init scale that overflows: apex's overflow
    # messages would go to stderr
    done = _python(
        "-m",
        "fp16kit",
        "demo",
        "--epochs",
        "1",
        "--steps",
        "3",
        "--init-scale",
        str(2.0**40),
        "--recipes",
        "fp32",
        "fp16-optimizer",
        "amp-o2",
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert done.stdout.startswith(f"fp16kit {fp16kit.__version__} demo:")
    assert 'overflow. Skipping step" messages hidden' in " ".join(done.stdout.split())
