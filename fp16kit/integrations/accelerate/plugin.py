"""``MasterWeightsAccelerator``: HF Accelerate with an fp16/bf16 model and fp32 master weights.

"O2 without apex", on :class:`fp16kit.MixedPrecisionOptimizer` and :class:`fp16kit.GradScaler`.

::

    from fp16kit.integrations.accelerate import MasterWeightsAccelerator

    accelerator = MasterWeightsAccelerator(mixed_precision="fp16")    # or "bf16"
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(loss_fn(model(x), y))
            if accelerator.sync_gradients:
                norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)  # the unscaled norm
            optimizer.step(); scheduler.step(); optimizer.zero_grad()
    accelerator.save_state("ckpt")         # scaler.pt + the masters in optimizer.bin

``mixed_precision`` names the dtype the *model* is cast to; the optimizer steps fp32 masters.
What each Accelerate hook does here (Accelerate 1.15):

* ``__init__``: Accelerate's, then no autocast (``native_amp`` off: the model already computes
  in its own dtype -- Accelerate's autocast would also cast the outputs to fp32 and change the
  numbers) and ``scaler`` = a :class:`fp16kit.GradScaler` for fp16 (built from a
  ``GradScalerKwargs`` handler if given), None for bf16. (Accelerate itself silently gives
  ``mixed_precision="fp16"`` on CPU neither a scaler nor autocast; this class scales there too.)
* ``prepare(...)``: every model first -- cast to the dtype (``model.to(dtype)``; params keep
  their identity, so optimizers built on them stay valid), then Accelerate's placement and DDP
  wrapping; then every optimizer is wrapped in a MixedPrecisionOptimizer (``async_step``,
  ``master_device``, ``master_dtype``; one you built yourself is used as is, and
  these three must then be set on it, not here: refused otherwise) and in
  :class:`~fp16kit.integrations.accelerate.optimizer.MasterWeightsAcceleratedOptimizer`;
  schedulers as Accelerate's (they do not step when the optimizer step was skipped).
* ``backward(loss)``: Accelerate's -- ``scaler.scale(loss / accumulation_steps).backward()``;
  refused while a clip's unscaled grads wait for ``optimizer.step()`` (a step the user skips
  ends with ``optimizer.zero_grad()``: it counts as skipped and the scaler updates).
* ``unscale_gradients()`` / ``clip_grad_norm_(params, max_norm)`` / ``clip_grad_value_``:
  ``scaler.unscale_`` puts the unscaled grads into the masters, and the clip acts there -- each
  model param stands for its master (``MixedPrecisionOptimizer.clip_grad_norm_(params=...)``);
  the returned norm is the unscaled one. Params of several prepared optimizers give one total
  norm over all of them. Call them on sync steps only (``if accelerator.sync_gradients:``).
* ``scaler.update()``: once per iteration, however many optimizers step after a backward, and
  never between two of their steps (torch.amp's rule: step every optimizer, then update once;
  one that steps every k-th iteration unscales with the scale the others used). A step marks
  the update as owed (:mod:`fp16kit.integrations._scale_updates`); it runs right after the step
  once every prepared optimizer has stepped since the last update (one optimizer: after each
  step), else at the next ``backward`` (before the loss is scaled), ``save_state``/``load_state``,
  or :meth:`settle_scale` -- call that before reading ``accelerator.scaler.get_scale()`` after
  an iteration in which not every optimizer stepped. With a backward per optimizer (GAN-style)
  the update runs between them, at the second backward.
* ``optimizer.step()`` / ``step_was_skipped`` / ``optimizer_step_was_skipped``: see
  :mod:`fp16kit.integrations.accelerate.optimizer` (the scaler's flag; one host read per query).
* ``save_state`` / ``load_state``: Accelerate's. ``optimizer.bin`` holds the wrapped optimizer's
  state and the exact fp32 masters (plain data), ``scaler.pt`` the scaler's state (plain data:
  Accelerate reloads both with ``weights_only=True``). With ``async_step`` the optimizer's
  ``state_dict`` waits for the step in flight; the saved model params are then one step behind
  the saved masters, exactly as in the running model, and the resumed run lands them at the
  same step the uninterrupted one does (bit for bit).
* ``save_model`` / ``get_state_dict(model)``: with ``async_step``, the last step's weights
  (the masters rounded; the step in flight is waited for, not landed). ``model.state_dict()``,
  ``unwrap_model(model).save_pretrained(...)`` and evaluation read the model itself, one step
  behind until ``accelerator.synchronize()``: call it first (or pass
  ``state_dict=accelerator.get_state_dict(model)``).
* ``accumulate(model)``: Accelerate's; micro-steps neither step nor zero the grads.

Not supported (refused at construction): DeepSpeed, FSDP (Accelerate's plugin: FSDP keeps its
own sharded fp32 params), Megatron-LM, tensor/context parallelism, fp8, ``mixed_precision``
other than "fp16"/"bf16". Closures in ``optimizer.step``.
"""

from __future__ import annotations

from .._requires import require

require("accelerate", extra="accelerate", tested=("1.15", "1.16"))

import math  # noqa: E402
import os  # noqa: E402
from collections.abc import Iterable  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.scheduler import AcceleratedScheduler  # noqa: E402
from accelerate.utils import SCALER_NAME  # noqa: E402

from ... import GradScaler, MixedPrecisionOptimizer  # noqa: E402
from ...core import kernels  # noqa: E402
from .._common import find_master_optimizer  # noqa: E402
from .checks import SUPPORTED_TYPES, check_arguments, check_user_built, launched_precision  # noqa: E402
from .optimizer import MasterWeightsAcceleratedOptimizer, UnscaledThisIteration  # noqa: E402

__all__ = ["MasterWeightsAccelerator", "MasterWeightsAcceleratedOptimizer"]

# Accelerate internals this class relies on (read in 1.15; tests/integrations/test_accelerate.py
# fails if they change): ``native_amp`` gates prepare_model's autocast wrapping
# (test_no_autocast_on_the_cast_model); ``scaler`` is what backward/save_state/load_state use,
# ``scaler_handler`` holds a GradScalerKwargs (same test); ``_optimizers``/``_schedulers`` are
# the lists save_state/load_state walk (test_save_state_load_state_resumes_bit_for_bit);
# AcceleratedOptimizer(optimizer, device_placement, scaler) and AcceleratedScheduler(scheduler,
# optimizers, step_with_optimizer, split_batches) construct as in prepare_optimizer /
# prepare_scheduler, the latter reading ``step_was_skipped`` (the training tests' LR history).


class MasterWeightsAccelerator(Accelerator):
    """An ``accelerate.Accelerator`` that trains an fp16/bf16 model through fp32 master weights.

    See the module docstring for what happens at each hook.

    Args:
        mixed_precision: ``"fp16"`` or ``"bf16"``: the dtype ``prepare`` casts the model to.
            Default: ``accelerate launch --mixed_precision`` / the accelerate config
            (``ACCELERATE_MIXED_PRECISION``) when it says fp16 or bf16, else ``"fp16"``.
        async_step, master_device, master_dtype: for the :class:`fp16kit.MixedPrecisionOptimizer`
            ``prepare`` wraps each optimizer in (``async_step=True``: a one-step delayed update
            on the optimizer thread; call ``optimizer.optimizer.synchronize()`` -- or
            :meth:`synchronize` -- before evaluating).
        scaler: the :class:`fp16kit.GradScaler` for fp16 (default: ``GradScaler(device)`` with
            the arguments of a ``GradScalerKwargs`` handler, if one is given). None for bf16.
        cast_model: False leaves the model's dtypes to you (e.g. norms kept in fp32); the
            optimizer's fp16/bf16 params get masters, others are stepped as they are.
        **kwargs: ``accelerate.Accelerator``'s (``gradient_accumulation_steps``,
            ``kwargs_handlers``, ``cpu``, ``project_dir``, ...).
    """

    def __init__(
        self,
        mixed_precision: str | None = None,
        *,
        async_step: bool = False,
        master_device: torch.device | str | None = None,
        master_dtype: torch.dtype = torch.float32,
        scaler: GradScaler | None = None,
        cast_model: bool = True,
        **kwargs: Any,
    ) -> None:
        mixed_precision = launched_precision(mixed_precision)
        dtype = check_arguments(mixed_precision, scaler, kwargs)
        super().__init__(mixed_precision=mixed_precision, **kwargs)
        if self.distributed_type not in SUPPORTED_TYPES:
            raise ValueError(
                f"MasterWeightsAccelerator does not support Accelerate's {self.distributed_type} "
                "(from your accelerate config or environment): use DDP (multi-GPU/CPU), or the "
                "plain Accelerator with that backend's own mixed precision."
            )
        self.model_dtype = dtype
        self.cast_model = cast_model
        self.master_options: dict[str, Any] = {
            "async_step": async_step,
            "master_device": master_device,
            "master_dtype": master_dtype,
        }
        # Accelerate's autocast (and its fp32 outputs) would change an fp16/bf16 model's numbers.
        self.native_amp = False
        if dtype is torch.float16 and scaler is None:
            handler = self.scaler_handler.to_kwargs() if self.scaler_handler is not None else {}
            scaler = GradScaler(self.device.type, **handler)
        elif scaler is not None and torch.device(scaler._device).type != self.device.type:
            # (``_device``: torch.amp.GradScaler's attribute; Accelerate 1.15 reads it too)
            raise ValueError(
                f"scaler is a GradScaler for {scaler._device!r} but the accelerator trains on "
                f"{self.device.type!r}: build it as fp16kit.GradScaler({self.device.type!r}, ...)."
            )
        self.scaler = scaler
        self._unscaled = UnscaledThisIteration()

    # ------------------------------------------------------------------ prepare
    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """Accelerate's ``prepare``, with every model cast and placed before any optimizer is wrapped.

        Whatever the order of ``args``: the masters are made from the final params."""
        for obj in args:
            if isinstance(obj, torch.nn.Module):
                self._cast(obj)
        order = sorted(range(len(args)), key=lambda i: not isinstance(args[i], torch.nn.Module))
        placement = None if device_placement is None else [device_placement[i] for i in order]
        if device_placement is not None and len(device_placement) != len(args):
            placement = device_placement  # Accelerate raises its own error for this
        result = super().prepare(*(args[i] for i in order), device_placement=placement)
        result = result if len(args) > 1 else (result,)
        out: list[Any] = [None] * len(args)
        for j, i in enumerate(order):
            out[i] = result[j]
        return tuple(out) if len(args) > 1 else out[0]

    def prepare_model(
        self, model: torch.nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> Any:
        """Cast the model to ``mixed_precision``'s dtype, then Accelerate's ``prepare_model``."""
        self._cast(model)
        return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None) -> Any:
        """Wrap ``optimizer`` in a MixedPrecisionOptimizer and a :class:`MasterWeightsAcceleratedOptimizer`.

        Wrap ``optimizer`` in a MixedPrecisionOptimizer (unless it is one) and in
        :class:`MasterWeightsAcceleratedOptimizer`; one this accelerator prepared already gives
        the same prepared optimizer again. ``device_placement`` is ignored: the masters live
        where the params (or ``master_device``) are."""
        if getattr(optimizer, "_is_accelerate_prepared", False):
            return super().prepare_optimizer(optimizer, device_placement)
        for prepared in self._optimizers:  # prepared before: its params are masters by now
            if optimizer is prepared.optimizer or optimizer is getattr(prepared.optimizer, "optimizer", None):
                return prepared
        if isinstance(optimizer, MixedPrecisionOptimizer):
            check_user_built(optimizer, self.master_options)
            mixed = optimizer
        else:
            self._check_plain(optimizer)
            mixed = MixedPrecisionOptimizer(optimizer, **self.master_options)
        prepared = MasterWeightsAcceleratedOptimizer(mixed, self.scaler, self._unscaled)
        self._optimizers.append(prepared)
        self._unscaled.members = lambda: [
            o.optimizer for o in self._optimizers if isinstance(o, MasterWeightsAcceleratedOptimizer)
        ]
        return prepared

    def prepare_scheduler(self, scheduler: Any) -> Any:
        """Accelerate's, matching a scheduler to the prepared optimizer it was built on.

        Accelerate's, matching a scheduler built on the plain torch optimizer (or on the
        prepared one) to that prepared optimizer (so it skips with its skipped steps only)."""
        if getattr(scheduler, "_is_accelerate_prepared", False):
            return super().prepare_scheduler(scheduler)
        target = getattr(scheduler, "optimizer", None)
        optimizers: Any = self._optimizers
        for opt in self._optimizers:
            if target is opt or target is opt.optimizer or target is getattr(opt.optimizer, "optimizer", None):
                optimizers = opt
                break
        prepared = AcceleratedScheduler(
            scheduler,
            optimizers,
            step_with_optimizer=self.step_scheduler_with_optimizer,
            split_batches=self.split_batches,
        )
        self._schedulers.append(prepared)
        return prepared

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Accelerate's ``backward``, refused while a clip's unscaled grads wait for ``optimizer.step()``.

        Accelerate's (``scaler.scale(loss / accumulation_steps).backward()``); refused, before
        anything changes, while a clip's unscaled grads wait for ``optimizer.step()``."""
        if self._unscaled.any_pending():
            raise RuntimeError(
                "accelerator.backward() after accelerator.clip_grad_norm_/clip_grad_value_/"
                "unscale_gradients() and before optimizer.step(): the grads of this iteration are "
                "unscaled already. Run every backward of an iteration before clipping; to skip a "
                "step (e.g. on a non-finite norm) call optimizer.zero_grad() instead of step()."
            )
        self._unscaled.owed.settle(self.scaler)  # the last iteration's update, once (torch.amp's rule)
        super().backward(loss, **kwargs)
        self._unscaled.backward()

    # ------------------------------------------------------------------ unscale and clip
    def unscale_gradients(self, optimizer: Any = None) -> None:
        """``scaler.unscale_`` on the prepared optimizers (default: all): the unscaled grads go into the masters.

        Once per optimizer per iteration (a second call does nothing); only on a sync
        step. A no-op for bf16 (no scaler)."""
        self._check_sync_step("unscale_gradients")
        if self.scaler is None or not self.scaler.is_enabled():
            return
        for opt in self._mixed_optimizers(optimizer):
            self._unscaled.unscale(self.scaler, opt)

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """Unscale, then clip the unscaled grads the optimizers will use by their total norm.

        Unscale, then clip the unscaled grads the optimizers will use for ``parameters``
        (each model param standing for its master) by their total norm; returns that norm."""
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        owners = self._owners(params)
        self.unscale_gradients(owners)
        if len(owners) == 1:
            return owners[0].clip_grad_norm_(max_norm, norm_type, params=params)
        return kernels.clip_grad_norm_(self._masters_of(owners, params), max_norm, norm_type)

    def clip_grad_value_(self, parameters: Iterable[torch.Tensor], clip_value: float) -> None:
        """Unscale, then clamp the unscaled grads the optimizers will use to ``[-clip_value, clip_value]``.

        Unscale, then clamp the unscaled grads the optimizers will use for ``parameters``
        (each model param standing for its master) to ``[-clip_value, clip_value]``."""
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        owners = self._owners(params)
        self.unscale_gradients(owners)
        torch.nn.utils.clip_grad_value_(self._masters_of(owners, params), clip_value)

    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> Any:
        """Accelerate's ``get_state_dict``, giving the weights of the last step with ``async_step``.

        Accelerate's. With ``unwrap`` (``save_model``, exporting) and ``async_step``: the
        weights of the last step, even while it is still in flight -- it waits for the step
        and gives each param with a master that master rounded to the param's dtype (what the
        model holds once the step lands), without landing it, so training goes on exactly as
        without the call. ``unwrap=False`` (``save_state``'s) is Accelerate's as is: the saved
        model is then one step behind the saved masters, as the running one."""
        state = super().get_state_dict(model, unwrap=unwrap)
        mixed = [opt for opt in self._mixed_optimizers(None) if opt.async_step]
        if not unwrap or not mixed:
            return state
        master_of: dict[int, torch.Tensor] = {}
        for opt in mixed:
            opt.wait_for_step()
            master_of.update({id(p): m for p, m in zip(opt.model_params, opt.master_params)})
        landed: dict[int, torch.Tensor] = {}  # one tensor per param: tied weights stay shared
        for name, p in self.unwrap_model(model).named_parameters(remove_duplicate=False):
            if name in state and id(p) in master_of:
                if id(p) not in landed:
                    landed[id(p)] = master_of[id(p)].detach().to(p.device, p.dtype, copy=True)
                state[name] = landed[id(p)]
        return state

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None, **kwargs: Any) -> None:
        """Accelerate's ``load_state``, refusing a checkpoint without ``scaler.pt`` before loading anything.

        Accelerate's; an fp16 accelerator refuses, before loading anything, a checkpoint
        directory without ``scaler.pt`` (saved by a bf16 run), which Accelerate would report as a
        missing file after the model and the masters were overwritten. Loaded into objects
        interrupted between a clip and its step, it leaves none of that iteration behind."""
        if input_dir is not None and self.scaler is not None:
            folder = os.path.expanduser(input_dir)
            if os.path.isdir(folder) and not os.path.isfile(os.path.join(folder, SCALER_NAME)):
                raise ValueError(
                    f"{input_dir} holds no {SCALER_NAME}: it was saved without a loss scaler (a bf16 "
                    "run?). Resume it with MasterWeightsAccelerator(mixed_precision='bf16'), the "
                    "precision it was trained in."
                )
        settled = self._unscaled.owed.settle(self.scaler)  # closes the iteration; the load sets the scale
        super().load_state(input_dir, load_kwargs, **kwargs)
        if self._unscaled.any_pending():
            # A clip's unscale waiting for its step (Ctrl-C between them) belongs to the iteration
            # the load abandoned: close it in the scaler (its update resets the per-optimizer
            # "unscaled" states), then restore the loaded scale, growth tracker and counters.
            self._unscaled.clear()
            if self.scaler is not None and not settled:  # (a settled update closed it already)
                loaded = self.scaler.state_dict()
                self.scaler.update()
                self.scaler.load_state_dict(loaded)

    def save_state(self, *args: Any, **kwargs: Any) -> Any:
        """Accelerate's ``save_state``, after the iteration's owed ``scaler.update()`` runs.

        Accelerate's, after the iteration's owed ``scaler.update()`` runs: ``scaler.pt``
        holds the scale the next backward uses (a resume continues bit for bit)."""
        self.settle_scale()
        return super().save_state(*args, **kwargs)

    def settle_scale(self) -> None:
        """Run the ``scaler.update()`` the last iteration's steps owe.

        It runs by itself at the next ``backward`` and ``save_state``: call it before reading
        ``scaler.get_scale()`` between the steps and the next backward, e.g. to log the scale."""
        self._unscaled.owed.settle(self.scaler)

    def free_memory(self, *objects: Any) -> Any:
        """Accelerate's ``free_memory``, also forgetting a clip's unscale still waiting for a step.

        Accelerate's (forgets the prepared objects: ``find_executable_batch_size`` retries
        call it), and forgets a clip's unscale still waiting for a step of those optimizers."""
        self._unscaled.clear()
        return super().free_memory(*objects)

    def synchronize(self) -> None:
        """Wait for every prepared optimizer's step in flight and copy its masters into the model.

        ``async_step=True``: call before evaluating or exporting; a no-op otherwise."""
        for opt in self._mixed_optimizers(None):
            opt.synchronize()

    # ------------------------------------------------------------------ helpers
    def _cast(self, model: torch.nn.Module) -> None:
        if self.cast_model and not getattr(model, "_is_accelerate_prepared", False):
            model.to(self.model_dtype)

    def _mixed_optimizers(self, optimizer: Any) -> list[MixedPrecisionOptimizer]:
        chosen = self._optimizers if optimizer is None else optimizer
        chosen = chosen if isinstance(chosen, (list, tuple)) else [chosen]
        out = []
        for given in chosen:
            opt = find_master_optimizer(given)
            if opt is None:
                raise TypeError(f"{type(given).__name__} was not prepared by this MasterWeightsAccelerator.")
            out.append(opt)
        return out

    def _owners(self, params: list[torch.Tensor]) -> list[MixedPrecisionOptimizer]:
        """The prepared optimizers that step any of ``params`` (all of them if none does)."""
        ids = {id(p) for p in params}
        mixed = self._mixed_optimizers(None)
        owners = [
            opt
            for opt in mixed
            if any(id(p) in ids for p in opt.model_params)
            or any(id(p) in ids for g in opt.param_groups for p in g["params"])
        ]
        return owners or mixed

    @staticmethod
    def _masters_of(owners: list[MixedPrecisionOptimizer], params: list[torch.Tensor]) -> list[torch.Tensor]:
        """``params`` with each model param replaced by its master, once every owner has read
        this step's grads into its masters (a clip of nothing reads them: it is public API)."""
        master_of: dict[int, torch.Tensor] = {}
        for opt in owners:
            opt.clip_grad_norm_(math.inf, params=())
            master_of.update({id(p): m for p, m in zip(opt.model_params, opt.master_params)})
        return [master_of.get(id(p), p) for p in params]

    def _check_sync_step(self, what: str) -> None:
        if not self.sync_gradients:
            raise RuntimeError(
                f"accelerator.{what}() on a gradient-accumulation micro-step: the grads are not "
                "complete yet, and unscaling them now would move them out of the model. Call it "
                "under `if accelerator.sync_gradients:`."
            )

    def _check_plain(self, optimizer: torch.optim.Optimizer) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"prepare() got {type(optimizer).__name__}; expected a torch.optim.Optimizer.")
        trainable = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        low = {p.dtype for p in trainable if p.dtype in (torch.float16, torch.bfloat16)}
        if low - {self.model_dtype}:
            raise TypeError(
                f"The optimizer holds {sorted(map(str, low))} params but mixed_precision casts to "
                f"{self.model_dtype}: build MasterWeightsAccelerator(mixed_precision=...) matching the model."
            )
        if (
            trainable
            and not low
            and self.master_options["master_device"] is None
            and not self.master_options["async_step"]
        ):
            raise TypeError(
                "The optimizer's params are not fp16/bf16, so there is nothing to keep fp32 masters of: "
                "pass the model to the same accelerator.prepare(model, optimizer, ...) call (it casts "
                "the model first), or cast the model before building the optimizer."
            )
