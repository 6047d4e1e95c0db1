"""Megatron-LM v1 ``fp16/fp16.py``: ``FP16_Module`` and Megatron's ``FP16_Optimizer``.

Megatron-LM v1 ``fp16/fp16.py`` (``megatron/fp16/fp16.py``): ``FP16_Module`` and the
``FP16_Optimizer`` Megatron copied from apex's era-1 ``fp16_utils`` and extended.

Megatron's training loop, which this optimizer reproduces::

    optimizer = FP16_Optimizer(FusedAdam(params, lr), static_loss_scale=None or S,
                               dynamic_loss_scale=args.loss_scale is None,
                               dynamic_loss_args={"scale_window": 1000., "min_scale": 1.,
                                                  "delayed_shift": 2})
    optimizer.zero_grad()
    optimizer.backward(loss, update_master_grads=False)   # (loss.float() * scale).backward()
    <data-parallel all-reduce of the fp16 grads>
    optimizer.update_master_grads()     # fp16 grads -> fp32 master grads * 1/scale; sets overflow
    optimizer.clip_master_grads(args.clip_grad)           # -1 on overflow
    optimizer.step()                    # the scale update, every call; skipped on overflow
    if not optimizer.overflow: lr_scheduler.step()

It is fp16kit's :class:`~fp16kit.legacy.FP16_Optimizer` (the masters, the one unscale path,
closures, checkpoints of the masters) driving Megatron's scalers
(:mod:`fp16kit.legacy.megatron.loss_scaler`), with Megatron's differences:
``update_master_grads`` sets ``overflow`` but leaves the scale alone; ``step()`` updates the
scale, every call, and logs "OVERFLOW! Skipping step. Attempted loss scale: {}, reducing to {}"
(at WARNING with ``verbose=True``, at DEBUG otherwise: Megatron printed it only when verbose);
``verbose=False`` by default; masters copy the params' ``model_parallel``,
``tensor_model_parallel``, ``partition_dim`` and ``partition_stride`` attributes;
``clip_master_grads`` uses Megatron's ``clip_grad_norm`` (a Python float); ``state_dict()``
stores the scaler's attributes and ``load_state_dict`` replaces the scaler with the saved one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ...core import kernels
from .._messages import apex_logger
from ..fp16_module import conversion_helper, fp16_to_fp32, fp32_to_fp16
from ..fp16_optimizer import FP16_Optimizer as _FP16_Optimizer
from ..fp16_optimizer import check_dynamic_loss_args
from .fp16util import clip_grad_norm
from .loss_scaler import DynamicLossScaler, LossScaler, check_number, scaler_from_state

__all__ = ["FP16_Module", "FP16_Optimizer", "conversion_helper", "fp16_to_fp32", "fp32_to_fp16"]

MODEL_PARALLEL_ATTRIBUTES = ("model_parallel", "tensor_model_parallel", "partition_dim", "partition_stride")
"""Attributes Megatron's model-parallel layers set on their params; masters copy them."""


class FP16_Module(nn.Module):
    """Megatron's FP16_Module: ``module.half()`` behind fp32 inputs and outputs.

    Kwargs never cast; integer inputs unchanged. ``state_dict``/``load_state_dict`` are the
    child's (keys without a ``module.`` prefix), as is ``state_dict_for_save_checkpoint``;
    inside another module, the keys its wrapper saved load back (FIX, see
    :meth:`_load_from_state_dict`).

    ``pipeline_first_stage`` / ``pipeline_last_stage`` (keyword only; Megatron asked its
    ``mpu``): only the first pipeline stage casts its inputs and only the last its outputs."""

    module: nn.Module  # registered by add_module: a submodule, not what nn.Module.__getattr__ may return

    def __init__(
        self, module: nn.Module, *, pipeline_first_stage: bool = True, pipeline_last_stage: bool = True
    ) -> None:
        super().__init__()
        self.add_module("module", module.half())
        self.pipeline_first_stage = pipeline_first_stage
        self.pipeline_last_stage = pipeline_last_stage

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Megatron's own FP16_Module (pickled whole, torch.save(model)) asked mpu instead: one stage
        super().__setstate__({"pipeline_first_stage": True, "pipeline_last_stage": True, **state})

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self.pipeline_first_stage:
            inputs = fp32_to_fp16(inputs)
        outputs = self.module(*inputs, **kwargs)
        return fp16_to_fp32(outputs) if self.pipeline_last_stage else outputs

    def state_dict(self, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        return self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def state_dict_for_save_checkpoint(self, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        """The child's ``state_dict_for_save_checkpoint`` (a MegatronModule's), else its ``state_dict``."""
        child = getattr(self.module, "state_dict_for_save_checkpoint", None)
        if child is None:
            return self.state_dict(destination, prefix, keep_vars)
        return child(destination, prefix, keep_vars)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def _load_from_state_dict(self, state_dict: Any, prefix: str, *args: Any) -> None:
        """Inside another module (a DDP or DataParallel wrapper, a container), torch's loader
        reaches this module by recursion and expects ``<prefix>module.<key>``, but
        :meth:`state_dict` wrote ``<prefix><key>``: such keys are moved under ``module.``
        here, so ``outer.load_state_dict(outer.state_dict())`` works (FIX: Megatron's raised
        "Missing key(s)"). Keys already under ``module.`` load as they are."""
        child_keys = list(self.module.state_dict(keep_vars=True))
        if any(prefix + k in state_dict for k in child_keys) and not any(
            prefix + "module." + k in state_dict for k in child_keys
        ):
            for key in [k for k in state_dict if k.startswith(prefix)]:
                state_dict[prefix + "module." + key[len(prefix) :]] = state_dict.pop(key)
        super()._load_from_state_dict(state_dict, prefix, *args)


def _megatron_scaler(
    static_loss_scale: float | None, dynamic_loss_scale: bool, dynamic_loss_args: dict[str, Any] | None, group: Any
) -> LossScaler | DynamicLossScaler:
    if dynamic_loss_scale:
        return DynamicLossScaler(**(dynamic_loss_args or {}), model_parallel_group=group)
    if static_loss_scale is None:
        raise ValueError(
            "static_loss_scale=None needs dynamic_loss_scale=True (Megatron passes "
            "dynamic_loss_scale=args.loss_scale is None); or give a number."
        )
    try:
        check_number("static_loss_scale", static_loss_scale, positive=True)
    except ValueError as e:
        # Megatron divided by it (0: ZeroDivisionError) or trained into NaN (inf, nan) silently
        raise ValueError(f"{e} Pass the static scale (e.g. 128.0), or dynamic_loss_scale=True.") from None
    return LossScaler(static_loss_scale)


class FP16_Optimizer(_FP16_Optimizer):
    """Megatron-LM v1's FP16_Optimizer. See the module docstring and docs/apex-others.md §2.2.

    Args:
        init_optimizer: a torch optimizer over the (fp16/bf16/fp32) model params.
        static_loss_scale: the scale when ``dynamic_loss_scale`` is False.
        dynamic_loss_scale: use Megatron's :class:`DynamicLossScaler`.
        dynamic_loss_args: its arguments: any of ``init_scale, scale_factor, scale_window,
            min_scale, delayed_shift, consecutive_hysteresis``.
        verbose: log the ingestion lines (INFO) and the overflow lines (WARNING).
        model_parallel_group: a ``torch.distributed`` group (keyword only): the overflow flag
            and the clipping norm are reduced over it, as Megatron did over ``mpu``'s group.
    """

    DYNAMIC_LOSS_ARGS = (
        "init_scale",
        "scale_factor",
        "scale_window",
        "min_scale",
        "delayed_shift",
        "consecutive_hysteresis",
    )

    def __init__(
        self,
        init_optimizer: torch.optim.Optimizer,
        static_loss_scale: float | None = 1.0,
        dynamic_loss_scale: bool = False,
        dynamic_loss_args: dict[str, Any] | None = None,
        verbose: bool = False,
        *,
        model_parallel_group: Any = None,
    ) -> None:
        check_dynamic_loss_args(dynamic_loss_args, self.DYNAMIC_LOSS_ARGS)
        # the scaler (its settings checked) is built before anything changes; the parent then
        # wraps the optimizer and takes it from _new_loss_scaler
        self._model_parallel_group = model_parallel_group
        self._built_scaler: LossScaler | DynamicLossScaler | None = _megatron_scaler(
            static_loss_scale, dynamic_loss_scale, dynamic_loss_args, model_parallel_group
        )
        super().__init__(
            init_optimizer,
            static_loss_scale,  # type: ignore[arg-type]  # None is Megatron's; only its _new_loss_scaler reads it
            dynamic_loss_scale,
            dynamic_loss_args,
            verbose,
        )
        self._copy_model_parallel_attributes(self.all_fp16_params, self.all_fp32_from_fp16_params)

    def _new_loss_scaler(
        self, static_loss_scale: float, dynamic_loss_scale: bool, dynamic_loss_args: dict[str, Any] | None
    ) -> LossScaler | DynamicLossScaler:
        scaler, self._built_scaler = self._built_scaler, None
        if scaler is not None:
            return scaler
        return _megatron_scaler(static_loss_scale, dynamic_loss_scale, dynamic_loss_args, self._model_parallel_group)

    def clip_grad_norm(self, parameters: Any, max_norm: float, norm_type: float = 2) -> float:
        """Megatron's :func:`~fp16kit.legacy.megatron.clip_grad_norm` over ``model_parallel_group``.

        What :meth:`clip_master_grads` calls; returns the total norm, a Python float."""
        return clip_grad_norm(parameters, max_norm, norm_type, model_parallel_group=self._model_parallel_group)

    @staticmethod
    def _copy_model_parallel_attributes(params: list[torch.Tensor], masters: list[torch.Tensor]) -> None:
        for param, master in zip(params, masters):
            for name in MODEL_PARALLEL_ATTRIBUTES:
                if hasattr(param, name):
                    setattr(master, name, getattr(param, name))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As the parent's; the new masters copy the model-parallel attributes too."""
        before = len(self.all_fp16_params)
        super().add_param_group(param_group)
        self._copy_model_parallel_attributes(self.all_fp16_params[before:], self.all_fp32_from_fp16_params[before:])

    # ------------------------------------------------------------------ the scale
    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.loss_scale

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        check_number("loss_scale", value, positive=True)  # a static scaler's cur_scale is a plain attribute
        self.loss_scaler.cur_scale = value

    def _checks_overflow(self) -> bool:
        return self.dynamic_loss_scale and isinstance(self.loss_scaler, DynamicLossScaler)

    def _log_overflow(self, message: str) -> None:
        apex_logger.log(logging.WARNING if self.verbose else logging.DEBUG, message)

    # ------------------------------------------------------------------ the loop
    def backward(
        self,
        loss: Any,
        update_master_grads: bool = True,
        retain_graph: bool = False,
        output_tensor_grad: Any = None,
    ) -> None:
        """Backward the scaled loss, then :meth:`update_master_grads` unless told not to.

        ``(loss.float() * loss_scale).backward(retain_graph=...)``, then
        :meth:`update_master_grads` unless told not to. With ``output_tensor_grad`` (a pipeline
        middle stage): ``torch.autograd.backward(loss, output_tensor_grad)``, unscaled (the
        later stage scaled those grads already)."""
        if output_tensor_grad is None and isinstance(loss, torch.Tensor) and loss.is_floating_point():
            loss = loss.float()  # Megatron's fp32 losses; an fp16 loss times 2**32 would be inf
        self.loss_scaler.backward(loss, retain_graph=retain_graph, output_tensor_grad=output_tensor_grad)
        if update_master_grads:
            self.update_master_grads()

    def update_master_grads(self) -> None:
        """Unscale the fp16 model grads into the fp32 master grads and check them for inf/NaN.

        fp16 model grads -> fp32 master grads * 1/scale (None where the model grad is None),
        fp32 params' grads * 1/scale in place, one non-finite check (max-reduced over the
        model-parallel group if given) setting ``overflow``; only a dynamic scaler checks.
        The scale itself changes in :meth:`step`."""
        # Megatron's scale is a Python number: filled in on the device, no host tensor copied
        scale = torch.full((), float(self.loss_scaler.loss_scale), dtype=torch.float64, device=self._device)
        flags = self._mpo.grads_to_masters(
            kernels.inv_scale(scale), kernels.new_found_inf(self._device), clear_missing=True
        )
        if not self._checks_overflow():
            self._step.unscaled(flags, by_scaler=False, verdict=False)  # Megatron never checked a static scale
            return
        group = self._model_parallel_group
        if group is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
            flags = kernels.all_reduce_found_inf(flags, self._device, group)
        self._step.unscaled(
            flags, by_scaler=False, verdict=kernels.combine_found_inf(flags.values(), self._device) != 0
        )

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Update the scale; on overflow skip the step, else step the masters and copy them into the model.

        Update the scale with ``overflow`` (every call); on overflow log Megatron's line and
        return None; else step the masters (with the closure if given) and copy them into the
        fp16 params, returning the inner step's value."""
        if closure is None and not self._step.read_since_step:
            self._warn_no_backward()
        self._step.stepped()
        attempted = self.loss_scaler.loss_scale
        self.loss_scaler.update_scale(self.overflow)
        if self.overflow:
            self._log_overflow(
                f"OVERFLOW! Skipping step. Attempted loss scale: {attempted}, reducing to {self.loss_scaler.loss_scale}"
            )
            return None
        if closure is not None:
            return self._step_with_closure(closure)
        return self._mpo.inner_step()

    def _step_with_closure(self, closure: Callable[[], Any]) -> Any:
        def wrapped_closure() -> Any:
            if self.first_closure_call_this_step:
                self.first_closure_call_this_step = False
            else:
                self._mpo.masters_to_model()  # LBFGS re-evaluates where it moved the masters
            temp_loss = closure()
            retries = 0
            # the hysteresis absorbs delayed_shift - 1 overflows before the first reduction
            limit = self.MAX_CLOSURE_RETRIES + getattr(self.loss_scaler, "delayed_shift", 1) - 1
            while self.overflow:
                retries += 1
                if retries > limit:
                    raise FloatingPointError(
                        f"The closure's backward overflowed {limit} times in a "
                        f"row (loss scale now {self.loss_scale}): the loss is not finite at any "
                        "scale. Check the loss and the inputs for inf/NaN."
                    )
                attempted = self.loss_scaler.loss_scale
                self.loss_scaler.update_scale(self.overflow)
                self._log_overflow(
                    f"OVERFLOW within closure! Skipping step. Attempted loss scale: {attempted}, reducing to {self.loss_scaler.loss_scale}"
                )
                temp_loss = closure()
            return temp_loss

        try:
            return self._mpo.inner_step(wrapped_closure)
        finally:
            self.first_closure_call_this_step = True
            self._step.stepped()  # (the closure's backwards were this step's)

    # ------------------------------------------------------------------ checkpoints
    def _loaded_scaler(self, state_dict: dict[str, Any]) -> tuple[Any, bool]:
        """Megatron replaces its scaler with the saved one: its settings beat the
        constructor's. Accepts this class's plain form and what ``load_checkpoint`` makes of a
        pickled Megatron (or apex era-1) scaler."""
        try:
            scaler = scaler_from_state(state_dict["loss_scaler"], model_parallel_group=self._model_parallel_group)
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"Cannot read the saved loss scaler ({e}). Expected the dict of "
                "fp16kit.legacy.megatron.FP16_Optimizer.state_dict() or a Megatron scaler as "
                "fp16kit.legacy.load_checkpoint reads it from an old file."
            ) from None
        dynamic = state_dict["dynamic_loss_scale"]
        if not isinstance(dynamic, bool):
            raise ValueError(f"The saved dynamic_loss_scale must be True or False, got {dynamic!r}.")
        return scaler, dynamic

    def __repr__(self) -> str:
        return (
            f"megatron.FP16_Optimizer(dynamic_loss_scale={self.dynamic_loss_scale}, "
            f"loss_scaler={self.loss_scaler!r}, optimizer={self.optimizer!r})"
        )
