"""Lightning Fabric precision plugin for fp32 master weights: ``MasterWeightsFabricPrecision``.

::

    fabric = L.Fabric(accelerator="cpu", plugins=[MasterWeightsFabricPrecision("16-true")])
    with fabric.init_module():
        model = Net()                                  # fp16 params
    opt = fp16kit.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters()))
    model, opt = fabric.setup(model, opt)
    ...
    fabric.backward(loss)                              # loss * scale
    fabric.clip_gradients(model, opt, max_norm=1.0, error_if_nonfinite=False)  # the masters
    opt.step()                                         # scaler.step; update at next backward

Fabric has no hook that sees the optimizers before the loop (Lightning's ``connect``), so the
user wraps the optimizer in :class:`fp16kit.MixedPrecisionOptimizer` -- built on the fp16/bf16
params, i.e. after ``fabric.init_module()`` or ``fabric.setup_module(model)``; one built on the
fp32 params before ``fabric.setup`` casts them would have no masters, and its first step
raises saying so. What happens at each Fabric hook:

* ``convert_module`` / ``init_module`` / ``forward_context`` / inputs and outputs: as Fabric's
  ``HalfPrecision`` (fp16/bf16 model and inputs; outputs back to the default dtype).
* ``backward``: ``loss * scale`` (fp16), then backward.
* ``unscale_gradients`` (``fabric.clip_gradients`` calls it): ``scaler.unscale_(opt)`` -- the
  unscaled grads land in the masters, which are ``main_params`` (the param groups' params), so
  Fabric's clipping clips the masters and returns the unscaled norm. bf16: the grads move into
  the masters at scale 1 (``opt.unscale_grads_``, the scaler protocol's call).
* ``optimizer_step`` (``opt.step()``): ``scaler.step(opt)`` (skips on inf/NaN); the
  ``scaler.update()`` is owed (:mod:`fp16kit.integrations._scale_updates`) and runs once per
  iteration, never between two optimizers' steps on one backward's grads (torch.amp's rule:
  step every optimizer, then update once): right after the step once no other optimizer can
  step on them -- every param of the modules set up here that holds a grad belongs to an
  optimizer that stepped since the last update (one optimizer: after each step) --, else at the
  next ``backward`` (before the loss is scaled), ``state_dict``/``load_state_dict`` or
  :meth:`~MasterWeightsFabricPrecision.settle_scale`. (Fabric shows the plugin no list of
  optimizers, so the grads tell: a param holding a grad that no optimizer seen so far steps may
  belong to one still to step. Not told apart: an optimizer over params of a module not set up
  through Fabric, or over params another optimizer steps too -- the update may run before its
  step.) With a backward per optimizer it runs between them, at the second backward. bf16:
  ``opt.step()`` (skips a non-finite step itself).
* ``state_dict`` / ``load_state_dict``: the scaler's, after the owed update. Save the plugin
  itself with the rest -- ``state = {"model": model, "optimizer": opt, "scaler": plugin}``;
  ``fabric.save``/``fabric.load`` call these --: the saved scale is then the one the next
  backward uses. (``plugin.scaler`` saved directly holds the scale before an update still owed
  -- an iteration in which not every optimizer stepped --: call ``plugin.settle_scale()``
  first.) The masters are in ``opt.state_dict()``.

With ``async_step=True`` call ``opt.synchronize()`` before evaluating or saving, as in a plain loop.
"""

from __future__ import annotations

from .._requires import require

require("lightning.fabric", extra="lightning", tested=("2.6", "2.7"))

import weakref  # noqa: E402
from typing import Any, Literal  # noqa: E402

import torch  # noqa: E402
from lightning.fabric.plugins.precision import HalfPrecision  # noqa: E402

from ... import GradScaler, MixedPrecisionOptimizer  # noqa: E402
from ...core import kernels  # noqa: E402
from ...core.master import LOW_PRECISION  # noqa: E402
from .._scale_updates import OwedUpdate  # noqa: E402

__all__ = ["MasterWeightsFabricPrecision"]


class MasterWeightsFabricPrecision(HalfPrecision):
    """Fabric's ``HalfPrecision`` plus fp32 masters behind ``fp16kit.GradScaler`` (see the module docstring).

    ``scaler``: an :class:`fp16kit.GradScaler` for fp16 (default ``GradScaler(device)``);
    refused with bf16."""

    def __init__(
        self,
        precision: Literal["16-true", "bf16-true"] = "16-true",
        *,
        scaler: GradScaler | None = None,
        device: str = "cpu",
    ) -> None:
        if precision not in ("16-true", "bf16-true"):
            raise ValueError(f"MasterWeightsFabricPrecision(precision={precision!r}): use '16-true' or 'bf16-true'.")
        if scaler is not None and precision == "bf16-true":
            raise ValueError("MasterWeightsFabricPrecision('bf16-true') takes no scaler: bf16 needs no loss scaling.")
        if scaler is not None and not isinstance(scaler, GradScaler):
            raise TypeError(
                f"scaler must be an fp16kit.GradScaler, got {type(scaler).__name__}: torch's GradScaler "
                "cannot unscale into the fp32 masters."
            )
        super().__init__(precision)
        self.scaler = scaler if scaler is not None or precision == "bf16-true" else GradScaler(device)
        self._unscaled: dict[int, MixedPrecisionOptimizer] = {}  # unscaled since their last step
        self._checked: weakref.WeakSet[MixedPrecisionOptimizer] = weakref.WeakSet()  # seen, params checked
        self._modules: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()  # set up (converted) here
        self._owed = OwedUpdate()  # the iteration's scaler.update() (see _scale_updates)

    def __getstate__(self) -> dict[str, Any]:
        """Picklable (``strategy="ddp_spawn"`` sends the plugin to its processes): what a run
        attached -- the modules, the optimizers seen -- stays behind."""
        state = self.__dict__.copy()
        state.update(_unscaled={}, _checked=None, _modules=None, _owed=OwedUpdate())
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _checked=weakref.WeakSet(), _modules=weakref.WeakSet())

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Fabric's ``convert_module`` (the module to fp16/bf16), remembering the module.

        Fabric's (the module to fp16/bf16), remembered: its grads tell which optimizers may
        step on a backward (:meth:`_sharing`)."""
        module = super().convert_module(module)
        self._modules.add(module)
        return module

    def backward(self, tensor: torch.Tensor, model: Any, *args: Any, **kwargs: Any) -> None:
        if self._owed.settle(self.scaler):
            self._unscaled.clear()  # (an unscale without a step: that one update closed it too)
        if self._unscaled:
            self._unscaled_without_step()
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        super().backward(tensor, model, *args, **kwargs)

    def unscale_gradients(self, optimizer: Any) -> None:
        opt = self._check(optimizer)
        if id(opt) in self._unscaled:
            return
        if self.scaler is not None:
            self.scaler.unscale_(opt)
        else:  # bf16: the grads into the masters at scale 1 (with the inf/NaN check), so
            # that clipping main_params (the masters) sees them; the step then uses them as they are
            device = next((m.device for m in opt.master_params), torch.device("cpu"))
            opt.unscale_grads_(kernels.one(device), kernels.new_found_inf(device))
        self._unscaled[id(opt)] = opt

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        opt = self._check(optimizer)
        self._unscaled.pop(id(opt), None)
        if self.scaler is None:
            return opt.step(**kwargs)
        out = self.scaler.step(opt, **kwargs)
        self._owed.stepped(self.scaler, opt, self._sharing())  # (_scale_updates)
        return out

    def _sharing(self) -> list[MixedPrecisionOptimizer] | None:
        """The optimizers that may step on this backward's grads: those seen that own a param
        (of a module set up here) holding a grad; None -- not known -- if no module was set up
        or such a param belongs to no optimizer seen yet."""
        if not self._modules:
            return None
        owners: dict[int, list[MixedPrecisionOptimizer]] = {}
        for opt in self._checked:
            for p in [*opt.model_params, *(p for g in opt.param_groups for p in g["params"])]:
                owners.setdefault(id(p), []).append(opt)
        sharing: dict[int, MixedPrecisionOptimizer] = {}
        for module in self._modules:
            for p in module.parameters():
                if p.grad is None:
                    continue
                if id(p) not in owners:
                    return None
                sharing.update((id(o), o) for o in owners[id(p)])
        return list(sharing.values())

    def _unscaled_without_step(self) -> None:
        # fabric.clip_gradients unscaled, no opt.step() followed (a batch dropped after looking
        # at its norm, Ctrl-C caught, or clipping before each accumulated backward): the
        # scaler's iteration is closed with the scale and its trackers unchanged, and the next
        # unscale re-reads the model grads (zeroed, or accumulated: both as a plain loop that
        # unscales once). Asynchronous steps took the grads at the unscale: refused.
        if any(o.async_step for o in self._unscaled.values()):
            raise RuntimeError(
                "MasterWeightsFabricPrecision: fabric.clip_gradients unscaled the gradients of an "
                "async_step optimizer (handing them to its step) and another backward followed "
                "without opt.step(). Call opt.step() after clipping in every iteration (it skips a "
                "non-finite step itself), and clip only after the last backward of a step."
            )
        if self.scaler is not None:
            self.scaler.update(new_scale=self.scaler.get_scale())
        self._unscaled.clear()

    def settle_scale(self) -> None:
        """Run the ``scaler.update()`` the last steps owe, if not run yet.

        ``fabric.backward`` and ``state_dict`` run it by themselves: call it at the end of an iteration in which not
        every optimizer stepped before reading ``scaler.get_scale()`` or saving ``plugin.scaler``."""
        self._owed.settle(self.scaler)

    def state_dict(self) -> dict[str, Any]:
        self._owed.settle(self.scaler)  # the saved scale is the one the next backward uses
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._owed.settle(self.scaler)  # close the iteration; the load then sets the scale
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)

    def _check(self, optimizer: Any) -> MixedPrecisionOptimizer:
        """The MixedPrecisionOptimizer (Fabric passes it unwrapped); one without masters for the
        model's fp16/bf16 params is refused at its first unscale or step, before anything changes."""
        if optimizer not in self._checked:
            _check_masters(optimizer)
            self._checked.add(optimizer)
        return optimizer


def _check_masters(optimizer: Any) -> None:
    if not isinstance(optimizer, MixedPrecisionOptimizer):
        raise TypeError(
            f"MasterWeightsFabricPrecision steps a fp16kit.MixedPrecisionOptimizer, got "
            f"{type(optimizer).__name__}: wrap it -- fp16kit.MixedPrecisionOptimizer(opt) -- built on "
            "the fp16/bf16 params (after fabric.init_module() or fabric.setup_module(model))."
        )
    if any(p.dtype in LOW_PRECISION for g in optimizer.param_groups for p in g["params"]):
        raise TypeError(
            "The MixedPrecisionOptimizer steps fp16/bf16 params directly (it was built on the "
            "fp32 params, which fabric.setup then cast): build it after the model is fp16/bf16 -- "
            "inside fabric.init_module() or after fabric.setup_module(model)."
        )
