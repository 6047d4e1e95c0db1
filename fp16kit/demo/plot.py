"""``fp16kit demo --plot FILE.png``: the loss and loss-scale curves of a demo run.

matplotlib is an optional extra (``pip install "fp16kit[plot]"``), imported only here and only
when a plot is asked for; :func:`require` says how to get it, before any training starts. The
figure is drawn on a ``matplotlib.figure.Figure`` directly (no pyplot, no global backend).
"""

from __future__ import annotations

import os
from typing import Any

from .runner import DemoResult

__all__ = ["PlotUnavailable", "INSTALL_HINT", "require", "check_path", "plot"]

INSTALL_HINT = 'pip install "fp16kit[plot]"'


class PlotUnavailable(ImportError):
    """matplotlib is missing; the message names the extra that installs it."""


def require() -> Any:
    """Import matplotlib (its Figure class) or raise :class:`PlotUnavailable` naming the fix."""
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise PlotUnavailable(
            f"--plot needs matplotlib, which is not installed ({e}). Install the optional extra: "
            f"{INSTALL_HINT}  (or: pip install matplotlib)"
        ) from None
    return Figure


def check_path(path: str | os.PathLike[str]) -> None:
    """Raise ``ValueError`` if the plot cannot be written to ``path`` (its folder is missing)."""
    folder = os.path.dirname(os.path.abspath(os.fspath(path)))
    if not os.path.isdir(folder):
        raise ValueError(f"cannot write the plot to {os.fspath(path)!r}: the folder {folder!r} does not exist.")


def _smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average over ``window`` steps (a readable curve from noisy batch losses)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot(result: DemoResult, path: str | os.PathLike[str]) -> None:
    """Plot each recipe's losses and loss scale in two panels, written to ``path``.

    Two panels: each recipe's training loss per step (moving average) with its held-out loss
    per epoch; each scaled recipe's loss scale (log2 axis), per step when the run traced it,
    else per epoch. Written to ``path`` (the format from its extension)."""
    figure_cls = require()
    check_path(path)
    cfg = result.config
    steps = cfg.steps_per_epoch
    fig = figure_cls(figsize=(12, 4.8), layout="constrained")
    ax_loss, ax_scale = fig.subplots(1, 2)
    styles = ["-", "--", "-.", ":", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1))]
    for i, name in enumerate(cfg.recipes):
        rows = [r for r in result.rows if r.recipe == name]
        style = styles[i % len(styles)]
        color = f"C{i}"
        losses = [v for r in rows for v in r.step_losses]
        ax_loss.plot(
            range(1, len(losses) + 1),
            _smooth(losses, max(1, steps // 5)),
            linestyle=style,
            color=color,
            linewidth=1.2,
            label=name,
        )  # what each is: the printed header
        ax_loss.plot([r.epoch * steps for r in rows], [r.eval_loss for r in rows], "o", color=color, markersize=4)
        if rows and rows[0].scale is not None:
            if any(r.step_scales for r in rows):
                scales = [v for r in rows for v in r.step_scales]
                xs: list[int] = list(range(1, len(scales) + 1))
            else:
                scales = [r.scale for r in rows if r.scale is not None]
                xs = [r.epoch * steps for r in rows]
            ax_scale.step(xs, scales, where="post", linestyle=style, color=color, label=name)
    dtype = str(cfg.dtype).replace("torch.", "")
    ax_loss.set(
        title=f"loss ({dtype}, {cfg.device}): training (moving average), held-out (dots)",
        xlabel="step",
        ylabel="cross-entropy",
    )
    ax_loss.legend(fontsize="small", loc="upper right")  # the curves fall from the upper left
    ax_scale.set(title="dynamic loss scale", xlabel="step", ylabel="scale")
    ax_scale.set_yscale("log", base=2)
    if ax_scale.get_legend_handles_labels()[0]:
        ax_scale.legend(fontsize="small")
    fig.savefig(os.fspath(path), dpi=110)
