"""fp16kit.legacy: apex's API on fp16kit's core, for code written before apex deleted it.

Change ``from apex.fp16_utils import ...`` to ``from fp16kit.legacy import ...`` (and
``from apex import amp`` to ``from fp16kit.legacy import amp``, ``apex.optimizers`` to
``fp16kit.legacy.optimizers``, and so on -- ``fp16kit migrate`` does it for you, and
``fp16kit run`` runs a script unmodified): the names, signatures and numbers are apex's, minus
the bugs listed in MIGRATION.md. This package holds ``apex.fp16_utils``'s names (both eras, plus
the 2018 names; :mod:`.fp16_utils` holds exactly those, for ``from apex.fp16_utils import *``);
its subpackages are the other apex modules: :mod:`.amp`, :mod:`.optimizers`,
:mod:`.contrib.optimizers`, :mod:`.parallel`, :mod:`.normalization`, :mod:`.multi_tensor_apply`,
and Megatron-LM v1's copied ``fp16`` package, :mod:`.megatron`. Checkpoints written by
apex-era code load through :func:`load_checkpoint`. It holds no tensor math of its own: that
runs in :mod:`fp16kit.core` and the modern face (:mod:`fp16kit.optim`, :mod:`fp16kit.nn`,
:mod:`fp16kit.distributed`).
"""

from . import (
    amp,
    contrib,
    fp16_utils,
    megatron,
    multi_tensor_apply,
    normalization,
    optimizers,
    parallel,
)
from .apex_alias import install_apex_alias, uninstall_apex_alias
from .checkpoints.load import load_checkpoint
from .fp16_utils import *  # noqa: F403 -- apex.fp16_utils's names, both eras, are this package's too

__all__ = [
    *fp16_utils.__all__,
    "amp",
    "contrib",
    "install_apex_alias",
    "load_checkpoint",
    "megatron",
    "multi_tensor_apply",
    "normalization",
    "optimizers",
    "parallel",
    "uninstall_apex_alias",
]
