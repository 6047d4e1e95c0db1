"""`fp16kit demo` (fp16kit.demo and fp16kit.cli.demo) and the command line around it."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys

import pytest
import torch

import fp16kit
from fp16kit.cli import main
from fp16kit.demo import RECIPE_NAMES, RECIPES, DemoConfig, EpochRow, run_demo, summarize
from fp16kit.demo import runner
from fp16kit.demo.data import loss_fn, make_model, make_task
from fp16kit.legacy.amp._amp_state import _amp_state

# tiny runs: a few seconds for the whole file
TINY = dict(epochs=2, steps_per_epoch=12, batch_size=64, hidden=48, eval_size=256)
TINY_ARGS = ["--epochs", "2", "--steps", "4"]
SCALED = [r for r in RECIPE_NAMES if r != "fp32"]


@pytest.fixture(autouse=True)
def _amp_state_restored():
    """The amp-o2 recipe calls amp.initialize, which sets process-wide state (as in apex)."""
    saved = dict(vars(_amp_state))
    yield
    vars(_amp_state).clear()
    vars(_amp_state).update(saved)


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
    # the first step of every recipe: same w0, same batch -> the same loss up to fp16 rounding
    first = {r.recipe: r.step_losses[0] for r in tiny_result.rows if r.epoch == 1}
    for name, loss in first.items():
        assert loss == pytest.approx(first["fp32"], rel=2e-3), name
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


def test_the_recipes_train_what_they_say():
    cfg = DemoConfig(**TINY)
    dtypes = {}
    for name in RECIPE_NAMES:
        recipe = RECIPES[name].build(make_model(cfg), cfg)
        dtypes[name] = {p.dtype for p in recipe.model.parameters()}
    assert dtypes["fp32"] == dtypes["autocast"] == {torch.float32}
    for name in ("fp16-optimizer", "amp-o2", "master-weights", "async"):
        assert dtypes[name] == {torch.float16}, name


def _delayed_reference(cfg: DemoConfig, steps: int, delay: int) -> list[float]:
    """fp32 AdamW where the update at step k uses the gradient computed ``delay`` updates
    earlier (0: synchronous training), on the demo's batches from the demo's initial weights;
    inputs rounded to fp16 as the fp16 model sees them."""
    model = make_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    params = list(model.parameters())
    pending, losses = [], []
    for x, y in make_task(cfg).epoch_batches(1, steps):
        loss = loss_fn(model(x.half().float()), y)
        losses.append(loss.item())
        pending.append(torch.autograd.grad(loss, params))
        if len(pending) > delay:
            for p, g in zip(params, pending.pop(0)):
                p.grad = g
            opt.step()
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
    cfg = DemoConfig(**dict(TINY, epochs=1), dtype=torch.bfloat16)
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
    assert by["fp32"].skipped == 0 and by["fp32"].scale is None
    for name in SCALED:
        s = by[name]
        start = 2.0**24 if name in ("fp16-optimizer", "amp-o2") else 2.0**40
        assert s.skipped >= 1, name
        assert s.scale == start / 2.0**s.skipped, (name, s.scale, s.skipped)
    # one rule per face, one result: the apex pair skip alike, and so do the torch-rule three
    assert (by["fp16-optimizer"].skipped, by["fp16-optimizer"].scale) == (by["amp-o2"].skipped, by["amp-o2"].scale)
    assert len({(by[n].skipped, by[n].scale) for n in ("autocast", "master-weights", "async")}) == 1


def test_trace_records_the_scale_after_every_step():
    cfg = DemoConfig(**dict(TINY, epochs=1, steps_per_epoch=6), init_scale=2.0**40, growth_interval=1000,
                     recipes=("fp32", "autocast"), trace=True)
    rows = {r.recipe: r for r in run_demo(cfg).rows}
    assert rows["fp32"].step_scales == ()
    scales = rows["autocast"].step_scales
    assert len(scales) == 6 and scales[-1] == rows["autocast"].scale
    assert all(b in (a, a / 2) for a, b in zip((2.0**40,) + scales, scales))  # halved or kept, per step
    assert scales[0] == 2.0**39


def test_summaries_follow_their_formulas():
    def row(recipe, epoch, loss, ms, skipped=0, scale=None):
        return EpochRow(recipe, epoch, loss, loss, 0.5, scale, skipped, ms, (loss,))

    rows = [
        row("fp32", 1, 2.0, 10.0), row("x", 1, 2.5, 30.0, 2, 8.0),
        row("fp32", 2, 1.0, 14.0), row("x", 2, 1.5, 20.0, 1, 4.0),
        row("fp32", 3, 0.5, 12.0), row("x", 3, 0.6, 90.0, 0, 4.0),
    ]
    fp32, x = summarize(rows)
    assert (fp32.recipe, x.recipe) == ("fp32", "x")
    assert fp32.ms_per_step == 12.0 and x.ms_per_step == 30.0  # medians
    assert x.time_vs_fp32 == pytest.approx(30.0 / 12.0) and fp32.time_vs_fp32 == 1.0
    assert x.loss_vs_fp32 == pytest.approx(0.6 / 0.5 - 1) and x.eval_loss == 0.6
    assert x.skipped == 3 and x.scale == 4.0 and fp32.scale is None
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
    ],
)
def test_bad_configs_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DemoConfig(**kwargs)


# ---------------------------------------------------------------------------- the command


def _table_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.strip()[:1].isdigit()]


def test_cli_prints_a_header_rows_and_a_table(capsys):
    assert main(["demo", *TINY_ARGS]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith(f"fp16kit {fp16kit.__version__} demo: torch ")  # no warning first
    for name in RECIPE_NAMES:
        assert f"  {name} " in out
    assert "fp16kit.legacy.FP16_Optimizer" in out and 'opt_level="O2"' in out and "async_step=True" in out
    assert len(_table_lines(out)) == 2 * len(RECIPE_NAMES)
    table = out[out.index("after 2 epochs"):].splitlines()
    assert "eval loss" in table[1] and "skipped" in table[1] and "ms/step" in table[1]
    final = {line.split()[0]: line.split() for line in table[2 : 2 + len(RECIPE_NAMES)]}
    assert set(final) == set(RECIPE_NAMES)
    assert final["fp32"][2] == "-" and final["fp32"][-1] == "1.00x"
    assert final["master-weights"][4] == "0" and final["master-weights"][5] == "65536"
    assert "done in" in out


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
        elif line.strip()[:1].isdigit():
            events.append("row " + " ".join(line.split()[:2]))
    assert events == [
        "<step fp32>", "<step fp32>", "row 1 fp32", "<step autocast>", "<step autocast>", "row 1 autocast",
        "<step fp32>", "<step fp32>", "row 2 fp32", "<step autocast>", "<step autocast>", "row 2 autocast",
    ]


def test_cli_recipes_subset(capsys):
    assert main(["demo", *TINY_ARGS, "--recipes", "amp-o2", "fp32"]) == 0
    out = capsys.readouterr().out
    rows = _table_lines(out)
    assert [line.split()[1] for line in rows] == ["amp-o2", "fp32"] * 2
    assert "master-weights" not in out and "async" not in out


def test_cli_subset_without_fp32_has_no_ratios(capsys):
    assert main(["demo", *TINY_ARGS, "--recipes", "autocast"]) == 0
    out = capsys.readouterr().out
    final = out[out.index("after 2 epochs"):].splitlines()[2].split()
    assert final[0] == "autocast" and final[2] == "-" and final[-1] == "-"


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


def test_cli_counts_and_hides_overflow_warnings_unless_verbose(capsys, caplog):
    args = ["demo", "--epochs", "1", "--steps", "3", "--recipes", "fp16-optimizer", "--init-scale", str(2.0**40)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "3 of apex's \"Gradient overflow. Skipping step\" messages" in " ".join(out.split())  # 3 overflows
    assert not [r for r in caplog.records if r.name == "fp16kit"]
    assert main([*args, "--verbose"]) == 0
    assert "hidden" not in capsys.readouterr().out
    assert sum("Gradient overflow" in r.getMessage() for r in caplog.records) == 3


@pytest.mark.parametrize("args, message", [
    (["--epochs", "0"], "must be >= 1"),
    (["--init-scale", "inf"], "must be a finite number > 0"),
    (["--init-scale", "nan"], "must be a finite number > 0"),
])
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
    done = _python("-m", "fp16kit", "demo", "--epochs", "1", "--steps", "3", "--init-scale", str(2.0**40),
                   "--recipes", "fp32", "fp16-optimizer", "amp-o2")
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert done.stdout.startswith(f"fp16kit {fp16kit.__version__} demo:")
    assert "overflow. Skipping step\" messages (fp16kit logger) hidden" in " ".join(done.stdout.split())
