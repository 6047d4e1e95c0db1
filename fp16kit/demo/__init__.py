"""The demo behind ``fp16kit demo``: one small real model trained side by side by every recipe.

The demo behind ``fp16kit demo``: one small real model trained side by side in fp32, the
apex way (through :mod:`fp16kit.legacy`), the modern way (``torch.autocast``,
:class:`fp16kit.GradScaler`, :class:`fp16kit.MixedPrecisionOptimizer`, asynchronous steps), and
as fp16 and bf16 models without fp32 masters.

An application above both faces (so it may import :mod:`fp16kit.legacy`). It computes; the
command line (:mod:`fp16kit.cli.demo`) prints.

- :mod:`.config`: :class:`DemoConfig`, checked before anything runs;
- :mod:`.data`: the task (a fixed random teacher's labels) and the MLP, deterministic;
- :mod:`.recipes`: one function per training recipe, written as the docs tell users to (and
  the 16-bit models without masters a user might train instead);
- :mod:`.measure`: the updates lost to rounding (step hooks) and the bytes of training state;
- :mod:`.runner`: :func:`train` yields a row per epoch per recipe as it goes,
  :func:`run_demo` collects them and the per-recipe summaries;
- :mod:`.plot`: loss and loss-scale curves (matplotlib, an optional extra: ``fp16kit[plot]``).
"""

from .config import RECIPE_NAMES, DemoConfig
from .recipes import RECIPES, Recipe
from .runner import DemoResult, EpochRow, Summary, run_demo, summarize, train

__all__ = [
    "DemoConfig",
    "DemoResult",
    "EpochRow",
    "RECIPES",
    "RECIPE_NAMES",
    "Recipe",
    "Summary",
    "run_demo",
    "summarize",
    "train",
]
