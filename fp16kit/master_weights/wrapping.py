"""``WrappingOptimizer``: a ``torch.optim.Optimizer`` that is a view of another optimizer.

Both faces' master-weight optimizers (``MixedPrecisionOptimizer``, the legacy
``FP16_Optimizer``) wrap a user's torch optimizer. Deriving from this class keeps what torch
and its ecosystem expect of an optimizer object -- ``isinstance`` checks, LR schedulers, step
hooks, the profiled ``step`` -- while the param groups, state and defaults stay the wrapped
optimizer's own, so an lr set on the wrapper reaches the optimizer that steps.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from ..core.interrupts import commit

__all__ = ["WrappingOptimizer"]


class WrappingOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` whose param groups and state are those of a wrapped optimizer.

    The wrapped one is ``self.optimizer``: LR schedulers, step hooks and ``isinstance`` checks work on the
    wrapper, and changes to ``param_groups`` (e.g. the lr) reach the wrapped optimizer."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        # torch.optim.Optimizer.__init__ minus the param groups, which live in the wrapped
        # optimizer: hooks, the profiled step, and the flags torch reads.
        self.optimizer = optimizer
        self._optimizer_step_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._patch_step_function()
        _step_commits(type(self))
        self._warned_capturable_if_run_uncaptured = True

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value


def _step_commits(cls: type) -> None:
    """Make each ``step()`` of ``cls`` one commit (:func:`fp16kit.core.interrupts.commit`),
    torch's profiling wrapper and step hooks included: a Ctrl-C after the step, inside that
    wrapper, would otherwise not say that the step was done. Once per class, as torch patches."""
    step = cls.step  # type: ignore[attr-defined]
    if not step.__dict__.get("commits"):
        cls.step = commit("optimizer.step()")(step)  # type: ignore[attr-defined]
        cls.step.commits = True  # type: ignore[attr-defined]
