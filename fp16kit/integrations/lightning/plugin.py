"""Lightning precision plugin for fp32 master weights: ``MasterWeightsPrecision``.

::

    from fp16kit.integrations.lightning import MasterWeightsPrecision
    trainer = L.Trainer(plugins=[MasterWeightsPrecision("16-true")], gradient_clip_val=1.0)
    trainer.fit(model)            # fp16 model, fp32 masters, fp16kit.GradScaler

The model is kept in fp16 (``"16-true"``) or bf16 (``"bf16-true"``), as Lightning's
``HalfPrecision`` keeps it; every optimizer from ``configure_optimizers`` is wrapped in
:class:`fp16kit.MixedPrecisionOptimizer` (one returned already wrapped is used as it is), so
the optimizer steps fp32 masters. What happens at each Lightning hook:

* ``convert_module`` / ``module_init_context`` / ``forward_context`` / ``convert_input``: the
  model, tensors created during ``__init__`` and the forward, and floating inputs are fp16/bf16.
* ``connect`` (after ``configure_optimizers``): wrap the optimizers (LR schedulers built on the
  inner optimizer keep working: they share its ``param_groups``; an optimizer returned already
  wrapped takes its scheduler built on the wrapper, since Lightning checks that a scheduler's
  optimizer is one ``configure_optimizers`` returned); fp16 gets an
  ``fp16kit.GradScaler`` (the one passed as ``scaler=`` -- e.g. with ``hysteresis`` -- or a
  default one on the model's device), bf16 none.
* ``pre_backward``: ``loss * scale`` (fp16).
* ``optimizer_step``: run the closure (forward, backward); :meth:`unscale_gradients` puts
  ``float(model.grad) / scale`` into the master grads (bf16: at scale 1, with the same
  inf/NaN check); ``on_before_optimizer_step`` and gradient clipping run (both see the unscaled
  master grads); ``scaler.step(opt)`` skips the step on inf/NaN. ``scaler.update()`` (which
  halves the scale then) is owed (:mod:`fp16kit.integrations._scale_updates`) and runs once per
  iteration: right after the step once every optimizer has stepped since the last update (one
  optimizer: after each step), else at the end of the training batch (``on_train_batch_end``,
  before the callbacks read the scale or save), the next ``pre_backward`` (before the loss is
  scaled), ``state_dict``/``load_state_dict``, ``teardown`` or
  :meth:`~MasterWeightsPrecision.settle_scale` -- never between two optimizers' steps after one
  ``manual_backward`` (torch.amp's rule: step every optimizer, then update once; one that steps
  every k-th batch unscales with the scale the others used). With a backward per optimizer it
  runs between them, at the second backward. bf16 skips a non-finite step too
  (``MixedPrecisionOptimizer.step`` does).
* ``clip_gradients`` (``gradient_clip_val``, also ``self.clip_gradients`` in manual
  optimization): clips the masters (``main_params`` are the param groups' params, i.e. the
  masters); by norm it records the unscaled total norm in :attr:`last_grad_norm`.
* An iteration that unscaled and never stepped -- an exception or Ctrl-C between the unscale
  and the step, or (manual optimization) ``clip_gradients`` with no ``opt.step()`` before the
  next backward -- is closed with the scale and its trackers unchanged (``scaler.update(
  new_scale=<the scale>)``), at that backward or at ``teardown``; with ``async_step`` a
  backward after such a clip raises (the unscale handed the grads to the step).
* ``val/test/predict_step_context`` and ``teardown`` (end of fit): with ``async_step=True``
  the step in flight lands first (``opt.synchronize()``), so they see the model after the last
  step. Landing early is what a plain loop's ``synchronize()`` does: the next forward then
  uses the newest weights.
* Checkpoints: the masters and the inner optimizer's state are the optimizer state
  (``MixedPrecisionOptimizer.state_dict``); the scaler state is this plugin's entry. With
  ``async_step=True`` a save lands nothing in the live model (it may be inside
  ``training_step``, and a run that saves trains the same numbers as one that does not): the
  checkpoint's weights are the masters rounded (consistent with them), the live params the
  next forward uses go to this plugin's entry and are put back on resume, so a resumed run
  continues bit for bit (:mod:`.lightning_checkpoint`). A checkpoint
  without masters (a plain ``"16-true"``/``"16-mixed"`` run) loads with a warning: the masters
  are rebuilt from the checkpoint's model weights (exact for a ``"16-mixed"`` run's fp32
  weights), a ``MixedPrecision`` scaler state is taken over.

Not supported (refused with an error naming the fix): a ``torch.amp.GradScaler`` (it cannot
unscale into masters), a scaler with bf16 (bf16 has float32's range: nothing to scale),
plugin options for masters together with an optimizer the user wrapped already, LBFGS-style
closure optimizers. Limits, documented rather than refused:

* ``async_step=True``: a weights-only save (``ModelCheckpoint(save_weights_only=True)``) runs
  no precision-plugin hook, so it holds the weights the next forward uses (one step behind the
  masters); full checkpoints hold the masters' weights. Training ends landed (a callback
  this plugin adds to ``trainer.callbacks`` at ``connect`` runs ``on_train_end``, before
  ``Strategy.teardown`` moves the optimizer state to the CPU); it is the first callback, so a
  user's ``on_train_end``
  that loads other weights (SWA's average, an EMA) keeps them. Callbacks that read the weights
  during training (an EMA at batch end) see the ones the next forward uses, one step behind
  the masters: call ``trainer.precision_plugin.synchronize()`` first for the newest.
* ``BaseFinetuning`` callbacks (``BackboneFinetuning``) name param groups by module param:
  adapted at ``connect`` to the masters (:mod:`.lightning_finetuning`), resume included.
* Tested with the single-device strategy on CPU (Lightning 2.6). DDP should work (the
  optimizers stay plain MixedPrecisionOptimizers; DDP all-reduces the grads so ranks skip
  together); ``strategy="ddp_spawn"`` on 2 CPU processes runs (the plugin pickles; a test
  checks it trains, not its numbers); FSDP/DeepSpeed strategies bring their own precision
  plugins and cannot take this one.
* ``pytorch_lightning`` (the old package name) has its own ``Precision`` class: its Trainer
  refuses this plugin (``MisconfigurationException: Found invalid type for plugin``).
"""

from __future__ import annotations

from .._requires import require

require("lightning.pytorch", extra="lightning", tested=("2.6", "2.7"))

import contextlib  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
import weakref  # noqa: E402
from collections.abc import Callable, Generator, Iterator  # noqa: E402
from typing import Any, Literal  # noqa: E402

import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from lightning.pytorch.plugins.precision import Precision  # noqa: E402
from lightning.pytorch.utilities import GradClipAlgorithmType  # noqa: E402
from lightning_utilities import apply_to_collection  # noqa: E402

from ... import GradScaler, MixedPrecisionOptimizer  # noqa: E402
from ...core import kernels  # noqa: E402
from .._scale_updates import OwedUpdate  # noqa: E402
from .checkpoint import adopt_plain_checkpoint, landed_weights, restore_next_forward  # noqa: E402
from .finetuning import adapt_finetuning  # noqa: E402
from .grad_norm import grad_norm, trainer_of  # noqa: E402
from .wrapping import is_mock, wrap, wrapped_before  # noqa: E402
from .wrapping import master_optimizer as _master_optimizer  # noqa: E402
from .wrapping import state_to_masters as _state_to_masters  # noqa: E402

__all__ = ["MasterWeightsPrecision", "grad_norm"]

logger = logging.getLogger("fp16kit")

_DTYPES = {"16-true": torch.float16, "bf16-true": torch.bfloat16}


class MasterWeightsPrecision(Precision):
    """fp16/bf16 model, fp32 master weights, ``fp16kit.GradScaler`` (see the module docstring).

    Args:
        precision: ``"16-true"`` (fp16 model, loss scaling) or ``"bf16-true"`` (no scaler).
        scaler: an :class:`fp16kit.GradScaler` for fp16 (default: one on the model's device,
            made at ``connect``); refused with bf16.
        async_step, master_device, master_dtype, flat: passed to each
            :class:`fp16kit.MixedPrecisionOptimizer` this plugin builds.
    """

    def __init__(
        self,
        precision: Literal["16-true", "bf16-true"] = "16-true",
        *,
        scaler: GradScaler | None = None,
        async_step: bool = False,
        master_device: torch.device | str | None = None,
        master_dtype: torch.dtype = torch.float32,
        flat: bool = False,
    ) -> None:
        if precision not in _DTYPES:
            raise ValueError(
                f"MasterWeightsPrecision(precision={precision!r}): use '16-true' (fp16 model) or "
                "'bf16-true' (bf16 model); for autocast with an fp32 model use Lightning's "
                "MixedPrecision('16-mixed', device, scaler=fp16kit.GradScaler(device))."
            )
        if scaler is not None and precision == "bf16-true":
            raise ValueError(
                "MasterWeightsPrecision('bf16-true') takes no scaler: bf16 has float32's exponent "
                "range, so losses need no scaling (non-finite steps are still skipped). Drop "
                "scaler=, or use '16-true' for an fp16 model."
            )
        if scaler is not None and not isinstance(scaler, GradScaler):
            raise TypeError(
                f"scaler must be an fp16kit.GradScaler, got {type(scaler).__name__}: torch's "
                "GradScaler unscales param.grad in place and cannot reach the fp32 masters. Pass "
                "fp16kit.GradScaler(device, ...) (same arguments)."
            )
        self.precision = precision
        self.dtype = _DTYPES[precision]
        self.scaler: GradScaler | None = scaler
        self._mpo_options: dict[str, Any] = {
            "async_step": async_step,
            "master_device": master_device,
            "master_dtype": master_dtype,
            "flat": flat,
        }
        self._custom_options = bool(async_step or master_device is not None or flat or master_dtype != torch.float32)
        self.optimizers: list[MixedPrecisionOptimizer] = []
        self._built: weakref.WeakSet[MixedPrecisionOptimizer] = weakref.WeakSet()  # wrapped here
        self.last_grad_norm: torch.Tensor | None = None
        self._unscaled: dict[int, dict[torch.device, torch.Tensor]] = {}  # id(opt) -> flags, this iteration
        self._owed = OwedUpdate()  # the iteration's scaler.update() (see _scale_updates)
        self._last_flags: dict[torch.device, torch.Tensor] | None = None  # bf16: the last step's
        self._check_state: set[int] = set()  # id(opt): state may have been moved off its masters
        self._skipping = False  # in optimizer_step, for a training_step that returned None
        self._trainer: Any = None

    def __getstate__(self) -> dict[str, Any]:
        """Picklable (``strategy="ddp_spawn"`` sends the Trainer to its processes): the options
        and the scaler travel; what a fit attached (optimizers, trainer) does not -- each
        process's fit wraps its own at ``connect``."""
        state = self.__dict__.copy()
        state.update(optimizers=[], _built=None, _unscaled={}, _last_flags=None, _check_state=set(), _trainer=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _built=weakref.WeakSet())

    # ------------------------------------------------------------------ dtype
    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module.to(dtype=self.dtype)

    def tensor_init_context(self) -> contextlib.AbstractContextManager:
        return _default_dtype(self.dtype)

    def module_init_context(self) -> contextlib.AbstractContextManager:
        return _default_dtype(self.dtype)

    def forward_context(self) -> contextlib.AbstractContextManager:
        return _default_dtype(self.dtype)

    def convert_input(self, data: Any) -> Any:
        return apply_to_collection(data, torch.Tensor, self._cast)

    def _cast(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.dtype) if torch.is_floating_point(t) else t

    # ------------------------------------------------------------------ setup
    def connect(self, model: torch.nn.Module, optimizers: list[Any], lr_schedulers: list[Any]) -> tuple[Any, ...]:
        """Wrap the optimizers in MixedPrecisionOptimizer (all checked before any is wrapped)."""
        for i, opt in enumerate(optimizers):
            if isinstance(opt, MixedPrecisionOptimizer) and self._custom_options and opt not in self._built:
                raise ValueError(
                    f"configure_optimizers returned a MixedPrecisionOptimizer (optimizer {i}) and "
                    "MasterWeightsPrecision was given options for the masters it builds "
                    f"({self._mpo_options}). Set them in one place: return the plain optimizer, or "
                    "drop the plugin's options."
                )
            inner = opt.optimizer if isinstance(opt, MixedPrecisionOptimizer) else opt
            if inner is opt:
                wrapped_before(opt, self._mpo_options)  # (raises if other options wrapped it)
            if isinstance(inner, torch.optim.LBFGS):
                raise TypeError(
                    "MasterWeightsPrecision does not support LBFGS (a closure optimizer re-evaluates "
                    "the model inside its step). Use a first-order optimizer, or train in float32."
                )
        # validate/test/predict after fit get the optimizers wrapped then: used as they are
        returned = [
            o if isinstance(o, MixedPrecisionOptimizer) or is_mock(o) else wrap(o, self._mpo_options)
            for o in optimizers
        ]
        self.optimizers = [o for o in returned if isinstance(o, MixedPrecisionOptimizer)]
        self._built.update(o for o in self.optimizers if o not in optimizers)
        if self.dtype == torch.float16 and self.scaler is None:
            device = next((p.device.type for p in model.parameters()), "cpu")
            self.scaler = GradScaler(device)
        self._trainer = trainer_of(model)
        self._install_callback()
        adapt_finetuning(getattr(self._trainer, "callbacks", None), lambda: self.optimizers)
        # a second fit: Strategy.teardown moved the state to the CPU (GPU runs)
        self._check_state = {id(o) for o in self.optimizers}
        return model, returned, lr_schedulers

    def _install_callback(self) -> None:
        # No precision-plugin hook runs at the end of a training batch or of training, so a
        # callback (trainer.callbacks is public) -- the first one: the user's come after it --
        # settles the owed scale update at on_train_batch_end and lands the step in flight at
        # on_train_end. (Strategy.teardown, lightning 2.6.6, moves the optimizer state to the
        # CPU *before* it calls this plugin's teardown: a step still in flight there would write
        # state that was just copied away, on GPU runs. A user's on_train_end that loads other
        # weights -- SWA's average, EMA -- keeps them.)
        callbacks = getattr(self._trainer, "callbacks", None)
        if isinstance(callbacks, list) and not any(isinstance(c, _PluginHooks) and c.plugin is self for c in callbacks):
            callbacks.insert(0, _PluginHooks(self))

    # ------------------------------------------------------------------ backward, step
    def pre_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:
        if self._owed.settle(self.scaler):  # the last iteration's update, once (torch.amp's rule)
            self._unscaled.clear()  # (an unscale without a step: that one update closed it too)
        if self._unscaled:  # manual optimization: clip_gradients (unscaled), then no opt.step()
            self._unscaled_without_step()
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        return super().pre_backward(tensor, module)

    def unscale_gradients(self, optimizer: Any) -> None:
        """Put this iteration's unscaled grads into the masters.

        ``scaler.unscale_``; bf16 at scale 1. Idempotent until the step."""
        opt = _master_optimizer(optimizer)
        if id(opt) in self._unscaled:
            return
        if self.scaler is not None:
            self.scaler.unscale_(opt)
            self._unscaled[id(opt)] = {}
        else:
            device = next((m.device for m in opt.master_params), torch.device("cpu"))
            self._unscaled[id(opt)] = opt.unscale_grads_(kernels.one(device), kernels.new_found_inf(device))

    def unscaled(self, optimizer: Any) -> bool:
        """Whether the master grads hold this iteration's unscaled grads.

        From :meth:`unscale_gradients` to the step."""
        return id(_master_optimizer(optimizer)) in self._unscaled

    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        """Closure (forward/backward), unscale into the masters, hooks and clipping, step."""
        if is_mock(optimizer):  # configure_optimizers returned None: nothing to step
            return super().optimizer_step(optimizer, model, closure, **kwargs)
        opt = _master_optimizer(optimizer)
        if id(opt) in self._check_state:
            self._check_state.discard(id(opt))
            _state_to_masters(opt)
        try:
            closure_result = closure()
            # training_step returned None: no backward ran, no step (as Lightning's MixedPrecision)
            skip = closure_result is None and model.automatic_optimization
            if not skip:
                self.unscale_gradients(opt)
            # Precision._after_closure (lightning 2.6.6, used by its MixedPrecision too): the
            # on_before_optimizer_step hooks, then configure_gradient_clipping -> clip_gradients
            # (which, on a skipped step, must not unscale: no scaler.update() would follow).
            self._skipping = skip
            self._after_closure(model, optimizer)
            if skip:
                return closure_result
            if self.scaler is not None:
                out = self.scaler.step(opt, **kwargs)
                # the update waits while another optimizer may step on these grads (_scale_updates)
                self._owed.stepped(self.scaler, opt, self.optimizers)
                return out
            self._last_flags = self._unscaled.get(id(opt))
            return opt.step(**kwargs)
        except BaseException:  # e.g. Ctrl-C in on_before_optimizer_step, an error refusing the step
            self._discard_iteration()
            raise
        finally:
            self._unscaled.pop(id(opt), None)
            self._skipping = False

    def _unscaled_without_step(self) -> None:
        # A new backward: the iteration that unscaled is over. Synchronous steps: closed as if
        # it had not begun; the next unscale re-reads the model grads (zeroed, or -- no
        # zero_grad -- accumulated: both as in a plain loop that unscales once). Asynchronous
        # steps handed the grads off at the unscale: accumulating would lose them.
        if any(o.async_step for o in self.optimizers if id(o) in self._unscaled):
            raise RuntimeError(
                "MasterWeightsPrecision(async_step=True): clip_gradients unscaled an optimizer's "
                "gradients (handing them to its step) and another backward followed without "
                "opt.step(). Call opt.step() after clip_gradients in every iteration (it skips a "
                "non-finite step itself), and clip only after the last backward of a step."
            )
        self._discard_iteration()

    def _discard_iteration(self) -> None:
        # Unscaled, never stepped (an exception between): the scaler would hold this
        # optimizer's iteration open, and its next unscale_ -- a fit after a Ctrl-C -- raise
        # "unscale_() has already been called". update(new_scale=the scale) closes it with
        # the scale and its trackers unchanged, as if the iteration had not begun.
        if self._owed.settle(self.scaler):  # a step of this iteration ran: its update closes it
            self._unscaled.clear()
        if self._unscaled and self.scaler is not None:
            self.scaler.update(new_scale=self.scaler.get_scale())
        self._unscaled.clear()

    def last_step_skipped(self) -> bool:
        """Whether the last optimizer step was skipped for inf/NaN gradients (a host read)."""
        if self.scaler is not None:
            return self.scaler.last_step_skipped()
        return any(bool(f.item()) for f in (self._last_flags or {}).values())

    # ------------------------------------------------------------------ clipping
    def clip_gradients(
        self,
        optimizer: Any,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Clip the unscaled master grads.

        By norm, :attr:`last_grad_norm` is the total norm (unscaled, before clipping; a
        0-dim tensor on the masters' device: no host sync)."""
        if clip_val <= 0 or self._skipping or is_mock(optimizer):  # (training_step returned None: no grads)
            return
        opt = _master_optimizer(optimizer)
        self.unscale_gradients(opt)  # manual optimization clips before opt.step()
        if gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            torch.nn.utils.clip_grad_value_(list(self.main_params(opt)), clip_value=clip_val)
        else:
            self.last_grad_norm = opt.clip_grad_norm_(clip_val)

    # ------------------------------------------------------------------ landing async steps
    def synchronize(self) -> None:
        """Land every optimizer's step in flight (``opt.synchronize()``).

        The model params then hold the masters' values. The hooks below call it; a no-op
        without ``async_step``."""
        for opt in self.optimizers:
            opt.synchronize()

    def _landing(self, context: Callable[[], Any]) -> Generator[None, None, None]:
        self.synchronize()
        with context():
            yield

    @contextlib.contextmanager
    def val_step_context(self) -> Generator[None, None, None]:
        yield from self._landing(super().val_step_context)

    @contextlib.contextmanager
    def test_step_context(self) -> Generator[None, None, None]:
        yield from self._landing(super().test_step_context)

    @contextlib.contextmanager
    def predict_step_context(self) -> Generator[None, None, None]:
        yield from self._landing(super().predict_step_context)

    def teardown(self) -> None:
        """End of fit/validate/...: land the step in flight (the model is current)."""
        failing = sys.exc_info()[1] is not None  # Lightning tears down inside its except block
        if self._owed.settle(self.scaler):
            self._unscaled.clear()
        self._discard_iteration()  # (manual optimization: unscaled by clip_gradients, no step)
        try:
            self.synchronize()
        except Exception:
            if not failing:
                raise
            logger.warning("The asynchronous step in flight failed during teardown", exc_info=True)
        super().teardown()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The plugin's state, ``{"precision", "scaler"}``, as plain data.

        ``{"precision", "scaler"}`` (plain data; ``"next_forward"`` added by
        :meth:`on_save_checkpoint`). Lands nothing: see :mod:`.lightning_checkpoint`. Runs the
        owed ``scaler.update()`` first: the saved scale is the one the next backward uses."""
        self.settle_scale()
        return {"precision": self.precision, "scaler": None if self.scaler is None else self.scaler.state_dict()}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Save the masters' weights in the checkpoint, and in this plugin's entry the live params."""
        # Lightning dumps the model state dict, then the optimizers, then this plugin: the
        # checkpoint gets the masters' weights; the live params, where a step has not landed
        # in them yet, go to this plugin's entry (lightning_checkpoint's docstring).
        own = checkpoint.get(type(self).__qualname__)
        module = self._trainer.lightning_module if self._trainer is not None else None
        if module is None or not isinstance(own, dict) or not isinstance(checkpoint.get("state_dict"), dict):
            return
        next_forward = landed_weights(checkpoint["state_dict"], module, self.optimizers)
        if next_forward:
            own["next_forward"] = next_forward

    def settle_scale(self) -> None:
        """Run the ``scaler.update()`` the last steps owe, if not run yet.

        The end of the training batch, the next backward, ``state_dict`` and ``teardown`` run it
        by themselves:
        call it to read ``scaler.get_scale()`` inside ``training_step`` after an iteration's
        steps when not every optimizer stepped."""
        if self._owed.settle(self.scaler):
            self._unscaled.clear()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s scaler, and the live params a step had not landed yet."""
        self.settle_scale()  # close the iteration; the load then sets the scale
        saved = state_dict.get("scaler")
        if saved is not None and self.scaler is not None:
            self.scaler.load_state_dict(saved)
        elif saved is None and self.scaler is not None:
            logger.warning("The checkpoint has no loss-scaler state (a bf16 run?): the fp16 scaler starts fresh.")
        if state_dict.get("next_forward") and self._trainer is not None:
            restore_next_forward(self._trainer.lightning_module, state_dict["next_forward"])

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """A checkpoint without masters or without this plugin's entry: see the module docstring."""
        self._check_state = {id(o) for o in self.optimizers}  # Lightning moves loaded state to the root device
        module = self._trainer.lightning_module if self._trainer is not None else None
        adopt_plain_checkpoint(checkpoint, self.optimizers, module, self.scaler, own_key=type(self).__qualname__)


class _PluginHooks(Callback):
    """The hooks of a MasterWeightsPrecision that only callbacks get (see ``_install_callback``):
    at the end of each training batch -- every step of its ``training_step`` has run -- the
    iteration's owed scale update, so that the callbacks after this one (loggers,
    ``ModelCheckpoint``) read the scale the next batch uses; at the end of training, the step in
    flight landed."""

    def __init__(self, plugin: MasterWeightsPrecision) -> None:
        self.plugin = plugin

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.plugin.settle_scale()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.plugin.synchronize()


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)
