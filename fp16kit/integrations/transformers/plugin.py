"""Fine-tune "O2 style" through the Transformers ``Trainer``: fp16/bf16 weights, fp32 masters.

``pip install "fp16kit[transformers]"``. The recipe is one ``Trainer`` subclass::

    args = TrainingArguments(output_dir, fp16=True, max_grad_norm=1.0, save_steps=100)
    trainer = MasterWeightsTrainer(model=model, args=args, train_dataset=ds)   # async_step=...,
    trainer.train()                                                            # master_device=...
    trainer.train(resume_from_checkpoint=True)    # masters, scaler, optimizer, LR, RNG restored

``args.fp16=True`` trains the model's weights in float16 behind :class:`fp16kit.GradScaler`,
``args.bf16=True`` in bfloat16 (no scaler); either way the optimizer steps fp32 master weights
(:class:`fp16kit.MixedPrecisionOptimizer`). The flags keep their Trainer meaning -- "train in
this precision" -- but select fp16kit's master-weight mode instead of the Trainer's autocast mode:
a ``MasterWeightsTrainer`` never falls back to autocast. The model may be given in float32 (it is
cast when the Trainer prepares it) or already converted: a model with params in the chosen dtype
keeps its dtypes -- e.g. ``T5ForConditionalGeneration.from_pretrained(..., dtype=torch.float16)``
keeps its ``_keep_in_fp32_modules`` in fp32 --, and its fp32 params are stepped as they are (no
masters needed). (A float32 model is cast whole: load it in the half dtype to keep such modules.)

What happens at each Trainer hook (transformers 5.24):

* ``create_accelerator_and_postprocess`` (Trainer construction) builds a
  :class:`~fp16kit.integrations.accelerate.MasterWeightsAccelerator` from the same arguments
  the Trainer builds its ``Accelerator`` from, plus ``async_step``, ``master_device``,
  ``master_dtype`` and ``scaler``. Everything below is that accelerator's work:
* ``accelerator.prepare(model, optimizer)`` (start of ``train()``): the model is cast to
  fp16/bf16; the Trainer's optimizer (``args.optim``; or the one passed in ``optimizers=``) is
  wrapped in a ``MixedPrecisionOptimizer`` -- one you built yourself is used as is.
* ``training_step`` -> ``accelerator.backward(loss)``: the loss (divided by the accumulation
  steps by the Trainer unless the model normalises it by ``num_items_in_batch``) is scaled by
  the fp16 scaler and back-propagated into the fp16 grads, which accumulate across micro-batches.
* ``accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)``: unscales the fp16 grads
  into the fp32 master grads and clips *those*; the returned (and logged) ``grad_norm`` is the
  unscaled norm. ``max_grad_norm=0`` still reports the norm, clipping nothing.
* ``on_pre_optimizer_step`` callbacks: the unscaled, clipped grads the step will use are the
  masters' (``optimizer.optimizer.master_params``, paired with ``.model_params``): read or edit
  those. The model's ``.grad`` still holds the *scaled* fp16/bf16 grads (with the Trainer's own
  fp16 mode they would be unscaled by now); a callback that edits them gets a RuntimeError
  naming the masters (after the callbacks, before the step).
* ``optimizer.step()``: ``scaler.step`` + ``scaler.update``; on an overflow the step is skipped,
  the scale backs off and ``accelerator.optimizer_step_was_skipped`` is True, so the Trainer
  does not step the LR scheduler (its own rule).
* Checkpoints (``save_steps``): ``optimizer.pt`` is the ``MixedPrecisionOptimizer`` state dict
  (inner optimizer state + fp32 masters), ``scaler.pt`` the scaler's (fp16 only), both plain
  data the Trainer reloads with ``torch.load(weights_only=True)``; the model weights are saved
  in their training dtype (an fp16 model saves fp16 safetensors). ``resume_from_checkpoint``
  loads the model weights, then the masters, optimizer, scheduler, scaler and RNG states: the
  resumed run continues bit for bit. Such a checkpoint resumes with ``MasterWeightsTrainer``
  only (``transformers.Trainer`` cannot read its ``optimizer.pt``: start a plain run from its
  weights instead), and a plain Trainer's checkpoint is refused here (see below).

``async_step=True`` (:mod:`fp16kit.master_weights.async_step`): each optimizer step runs on the optimizer
thread while the next forward/backward runs, a one-step delayed update. Whatever reads the
weights waits for the step in flight first (``optimizer.synchronize()``): ``evaluate``,
``predict``, ``save_model`` (so every checkpoint's weights match its masters), the end of
training (after the last step, before ``on_train_end`` callbacks) and ``load_best_model_at_end``
(before the best checkpoint is loaded, so no step lands over it). Each such wait lands the step
early, so the next forward sees weights one step fresher than with no wait: the save and eval
steps are part of an asynchronous run's trajectory, and a run resumed with the same ones
continues bit for bit. Logging reads no weights and does not wait. :meth:`synchronize` is
there for your own reads (e.g. a callback that inspects the weights).

Refused, before any state changes (``ValueError``/``TypeError`` naming the fix): neither or both
of ``fp16``/``bf16``; DeepSpeed or FSDP (they keep their own fp32 params and scaler); LOMO
optimizers (they fuse the update into backward); more than one GPU without ``torchrun``
(``nn.DataParallel``); ``fp16_full_eval``/``bf16_full_eval`` naming the other dtype, or on a
model given with fp32 params it keeps (either would cast weights in place); a model already in
the other half dtype or already wrapped (DDP, DataParallel); ``async_step``/``master_device``/
``master_dtype`` beside a ``MixedPrecisionOptimizer`` you built (set them on it), or one you
built on the float32 model (no masters of the params the trainer casts: pass the plain
optimizer); at ``train()``, resuming a checkpoint saved by ``transformers.Trainer`` (its
``optimizer.pt`` has no masters). A bf16 run may resume an fp16 checkpoint (its ``scaler.pt``
is ignored), and an fp16 run a bf16 one (a new scaler).

After ``load_best_model_at_end`` the model holds the best checkpoint's weights while the
optimizer keeps the last step's masters: build a new trainer (or resume) to train on from there.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
from collections.abc import Iterator
from typing import Any

from .._requires import require

transformers = require("transformers", extra="transformers", tested=("5.24", "5.25"))

import torch  # noqa: E402
import transformers.trainer as _trainer_module  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from .._common import find_master_optimizer  # noqa: E402
from ..accelerate.optimizer import MasterWeightsAcceleratedOptimizer  # noqa: E402
from ..accelerate.plugin import MasterWeightsAccelerator  # noqa: E402
from .checks import DTYPES, casts_model, check_arguments, check_checkpoint  # noqa: E402

__all__ = ["MasterWeightsTrainer"]

_log = logging.getLogger("fp16kit")


class MasterWeightsTrainer(Trainer):
    """A ``transformers.Trainer`` that trains fp16/bf16 weights through fp32 master weights.

    Takes the ``Trainer``'s arguments unchanged, plus (keyword-only):

    Args:
        async_step: run each optimizer step on fp16kit's optimizer thread (one-step delayed
            update); see the module docstring for where the trainer waits for it.
        master_device: device of the masters and optimizer state (e.g. ``"cpu"`` for a CUDA
            model); default: each param's device.
        master_dtype: dtype of the masters (default ``torch.float32``).
        scaler: an :class:`fp16kit.GradScaler` to use for ``fp16`` (e.g. with another
            ``init_scale``); default: a new one. Refused with ``bf16``.

    ``args.fp16`` or ``args.bf16`` (exactly one) chooses the weights' dtype. See the module
    docstring for the algorithm at each Trainer hook and what is refused.
    """

    def __init__(
        self,
        *args: Any,
        async_step: bool = False,
        master_device: torch.device | str | None = None,
        master_dtype: torch.dtype = torch.float32,
        scaler: Any = None,
        **kwargs: Any,
    ) -> None:
        # the next __init__ in the MRO: Trainer's, or a Trainer subclass's mixed in after this one
        bound = inspect.signature(super().__init__).bind(*args, **kwargs)
        var_kw = next((n for n, p in bound.signature.parameters.items() if p.kind is p.VAR_KEYWORD), None)
        extra = bound.arguments.get(var_kw, {}) if var_kw else {}
        named = {**bound.arguments, **extra}
        mixed_precision = check_arguments(
            named, async_step=async_step, master_device=master_device, master_dtype=master_dtype
        )
        model = named.get("model")
        self._master_options: dict[str, Any] = {
            "async_step": async_step,
            "master_device": master_device,
            "master_dtype": master_dtype,
            "scaler": scaler,
            # a model given with params in the chosen dtype was converted by the user (e.g.
            # from_pretrained(dtype=torch.float16), which keeps _keep_in_fp32_modules in fp32):
            # its dtypes are kept, and its fp32 params stepped as they are
            "cast_model": casts_model(model, DTYPES[mixed_precision]),
        }
        self._weights_precision = mixed_precision
        callbacks = [_SynchronizeAtTrainEnd(self), *(named.get("callbacks") or [])]
        if "callbacks" in bound.signature.parameters:
            bound.arguments["callbacks"] = callbacks
        elif var_kw is not None:  # (with neither, bound.kwargs would not carry them either)
            bound.arguments[var_kw] = {**extra, "callbacks": callbacks}
        super().__init__(*bound.args, **bound.kwargs)
        # wraps the handler's method on the instance: keeps its class (a subclass's own handler)
        # and its attributes
        handler = self.callback_handler
        handler.on_pre_optimizer_step = functools.partial(  # type: ignore[method-assign]  # this instance's only
            _checked_pre_optimizer_step, self, handler.on_pre_optimizer_step
        )

    # ------------------------------------------------------------------ construction
    def create_accelerator_and_postprocess(self) -> None:
        """Build a :class:`MasterWeightsAccelerator` where the Trainer builds its ``Accelerator``.

        transformers 5.24's ``Trainer.create_accelerator_and_postprocess`` computes the
        accelerator's arguments and then calls ``Accelerator(**args)`` by the module-level name
        ``transformers.trainer.Accelerator``, with no hook to choose the class; the name is
        rebound for that call only (checked after it, and by
        ``test_transformers.py::test_trainer_builds_master_weights_accelerator``)."""
        factory = functools.partial(_build_accelerator, precision=self._weights_precision, options=self._master_options)
        with _rebind(_trainer_module, "Accelerator", factory):
            super().create_accelerator_and_postprocess()
        if not isinstance(self.accelerator, MasterWeightsAccelerator):
            raise RuntimeError(
                "MasterWeightsTrainer could not install its accelerator: transformers "
                f"{transformers.__version__} no longer builds it through transformers.trainer.Accelerator. "
                "Use transformers >= 5.24, < 5.25, or report it to fp16kit."
            )

    # ------------------------------------------------------------------ resume
    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
        **kwargs: Any,
    ) -> Any:
        """``Trainer.train``, checking a checkpoint to resume first.

        ``Trainer.train``; a checkpoint to resume is checked first (before any state changes):
        one saved by ``transformers.Trainer`` holds no fp32 master weights and is refused."""
        check_checkpoint(resume_from_checkpoint, self.args.output_dir)
        try:
            return super().train(resume_from_checkpoint, trial, ignore_keys_for_eval, **kwargs)
        except BaseException:
            self._discard_interrupted_iteration()
            raise

    def _discard_interrupted_iteration(self) -> None:
        """Training interrupted (Ctrl-C, an exception from a callback) between the clip and
        ``optimizer.step()`` leaves this iteration's grads unscaled, waiting for a step, and the
        next ``train()`` would refuse its first backward: drop them, as a skipped step
        (``optimizer.zero_grad()``), so that the trainer trains on or resumes."""
        opt = self.optimizer
        if isinstance(opt, MasterWeightsAcceleratedOptimizer) and opt.gradient_state.sync_gradients:
            try:
                opt.zero_grad()
            except Exception:  # the original error propagates; this one is only logged
                _log.warning("could not drop the interrupted iteration's gradients", exc_info=True)

    def _load_scaler(self, checkpoint: str | None) -> None:
        """The Trainer's, except that a bf16 run resuming an fp16 checkpoint ignores its
        ``scaler.pt`` (bf16 has no scaler; the Trainer would call ``None.load_state_dict``).
        ``Trainer._load_scaler`` is a transformers 5.24 internal, guarded by
        ``test_transformers_user_paths.py::test_bf16_resumes_an_fp16_checkpoint``."""
        if self.accelerator.scaler is None:
            if checkpoint is not None and os.path.isfile(os.path.join(checkpoint, _trainer_module.SCALER_NAME)):
                _log.info("bf16 run resuming %s: its fp16 loss-scaler state is not used", checkpoint)
            return
        super()._load_scaler(checkpoint)

    # ------------------------------------------------------------------ reads of the weights
    def synchronize(self) -> None:
        """Wait for an optimizer step in flight and copy its masters into the model.

        Wait for an optimizer step in flight (``async_step=True``) and copy its masters into
        the model; a no-op otherwise, or before ``train()`` created the optimizer."""
        opt = find_master_optimizer(self.optimizer)
        if opt is not None:
            opt.synchronize()

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        """``Trainer.evaluate`` on the weights after the last optimizer step."""
        self.synchronize()
        return super().evaluate(*args, **kwargs)

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.predict`` on the weights after the last optimizer step."""
        self.synchronize()
        return super().predict(*args, **kwargs)

    def save_model(self, *args: Any, **kwargs: Any) -> None:
        """``Trainer.save_model`` of the weights after the last optimizer step.

        Also what a checkpoint saves, so its weights match its masters."""
        self.synchronize()
        super().save_model(*args, **kwargs)

    def _load_best_model(self) -> None:
        """``load_best_model_at_end``: land the step in flight first, or the end-of-training wait
        would copy its masters over the best checkpoint's weights (training stopped by a callback
        at a step with no eval/save leaves one in flight). ``Trainer._load_best_model`` is a
        transformers 5.24 internal (called by ``_finalize_training``), guarded by
        ``test_transformers_user_paths.py::test_load_best_model_at_end_keeps_the_best_weights``."""
        self.synchronize()
        super()._load_best_model()


class _SynchronizeAtTrainEnd(TrainerCallback):
    """Lands the last step in flight when training ends, before the callbacks that follow see the
    model (this callback comes right after the Trainer's defaults): at the step that reaches
    ``max_steps`` and at ``on_train_end`` (training stopped early)."""

    def __init__(self, trainer: MasterWeightsTrainer) -> None:
        self.trainer = trainer

    def on_step_end(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step >= state.max_steps:
            self.trainer.synchronize()

    def on_train_end(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer.synchronize()


def _checked_pre_optimizer_step(
    trainer: MasterWeightsTrainer, call: Any, args: TrainingArguments, state: Any, control: Any, **kwargs: Any
) -> Any:
    """The Trainer's ``callback_handler.on_pre_optimizer_step`` (``call``, after the clip, before
    the step), then: a callback that changed a model param's ``.grad`` is an error -- the step
    uses the masters' grads, read at the clip (fp16: the scaler would raise a generic error at
    the step; bf16: the step would read the edited grads again, unclipped, silently)."""
    opt = find_master_optimizer(trainer.optimizer)
    params = [] if opt is None else list(opt.model_params)
    grads = [p.grad for p in params]
    versions = [None if g is None else g._version for g in grads]
    control = call(args, state, control, **kwargs)
    for p, g, v in zip(params, grads, versions):
        if p.grad is not g or (g is not None and g._version != v):
            raise RuntimeError(
                "A callback changed the model's gradients at on_pre_optimizer_step. "
                "MasterWeightsTrainer has unscaled and clipped them into the fp32 master weights "
                "already, and the optimizer steps those: edit the masters' grads instead "
                "(kwargs['optimizer'].optimizer.master_params, paired with .model_params)."
            )
    return control


def _build_accelerator(*, precision: str, options: dict[str, Any], **accelerator_args: Any) -> Any:
    # the Trainer passes args.mixed_precision, which also reads ACCELERATE_MIXED_PRECISION;
    # the choice checked in __init__ (args.fp16 / args.bf16) wins
    accelerator_args["mixed_precision"] = precision
    return MasterWeightsAccelerator(**accelerator_args, **options)


@contextlib.contextmanager
def _rebind(module: Any, name: str, value: Any) -> Iterator[None]:
    if not hasattr(module, name):
        raise RuntimeError(
            f"MasterWeightsTrainer expects {module.__name__}.{name} (transformers >= 5.24, < 5.25); "
            "this transformers version changed how the Trainer builds its accelerator."
        )
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)
