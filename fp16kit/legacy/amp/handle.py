"""apex.amp.handle: ``scale_loss`` (docs/apex-amp.md §6), ``disable_casts``, and the 2018 handle API (§11).

``init``, ``AmpHandle`` / ``NoOpHandle`` and the ``wrap_optimizer`` wrapper.

The overflow check and the scale update run on the device at every non-delayed exit; the
skip is applied (and apex's line logged) when ``optimizer.step()`` runs, which reads the
flags once. ``delay_overflow_check=True`` leaves the scale alone at the exit, as apex, for the
script's own ``scaler.update_scale()`` (NVIDIA's BERT ``run_pretraining.py``), which then counts
the deferred flags once; a ``step()`` before any such call still skips on them and updates the
scale then (FIX: apex applied overflowed grads).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch

from ...core import kernels
from ...core.interrupts import COMPLETED, commit_methods, hold_interrupts
from .._messages import apex_logger
from ..loss_scaler import check_scale
from ._amp_state import _amp_state
from ._process_optimizer import unprepare, unscale_into_stash, within_commits
from .scaler import LossScaler, refuse_if_broken

__all__ = ["scale_loss", "disable_casts", "init", "AmpHandle", "NoOpHandle", "OptimWrapper", "WrapperScaleLoss"]

_NOT_INITIALIZED = (
    "Invoked 'with amp.scale_loss`, but internal Amp state has not been initialized.  "
    "model, optimizer = amp.initialize(model, optimizer, opt_level=...) must be called "
    "before `with amp.scale_loss`."
)


def _clear_cache(properties: Any) -> None:
    if properties.patch_torch_functions:
        from . import casts

        casts.clear_cache()


def scale_loss(
    loss: torch.Tensor,
    optimizers: Any,
    loss_id: int = 0,
    model: Any = None,
    delay_unscale: bool = False,
    delay_overflow_check: bool = False,
) -> ScaleLoss:
    """Yield the scaled loss; on exit, unscale this backward's grads and update the scale.

    Yield ``loss.float() * S``; on exit unscale this backward's grads into what the
    optimizers step (the masters at O2) and update the scale (see the module docstring and
    :class:`ScaleLoss`, what this returns)."""
    return ScaleLoss(loss, optimizers, loss_id, delay_unscale, delay_overflow_check)


_ENTRY = "the entry of amp.scale_loss"
_EXIT = "amp.scale_loss's exit (this backward's grads unscaled, the loss scale updated)"
_FAILED = "amp.scale_loss's exit after an error in its block (the grads put back)"


class ScaleLoss:
    """The context manager :func:`scale_loss` returns; each side of the ``with`` is all or nothing under Ctrl-C.

    A class, not a generator: contextlib's lines after the generator's end would run after
    the exit's commit, outside it.

    * entry: the grads are put aside under :func:`~fp16kit.core.interrupts.hold_interrupts`;
      a SIGINT there is raised after they are put back, so the block never started (repeat
      the ``with``);
    * exit after an error in the block (a KeyboardInterrupt in its backward included): the
      grads as they were before the ``with``, then the error (repeat the ``with``); a SIGINT at
      the exit's first line, before its commit, is raised from it with nothing put back: the
      next entry puts the grads back first;
    * exit after the block: the unscale and the scale update as one commit; a SIGINT during it
      is raised after it, saying it was completed (go on with ``optimizer.step()``).

    A second SIGINT breaks a side off and marks the optimizers (and, at the exit, the loss
    scaler): the next ``scale_loss`` / ``step()`` refuses until they are restored from a
    checkpoint (see :mod:`._process_optimizer`)."""

    def __init__(
        self, loss: torch.Tensor, optimizers: Any, loss_id: int, delay_unscale: bool, delay_overflow_check: bool
    ) -> None:
        self.loss = loss
        self.optimizers = optimizers
        self.loss_id = loss_id
        self.delay_unscale = delay_unscale
        self.delay_overflow_check = delay_overflow_check
        self.mode = ""  # "", "off" (amp disabled), "float" (no scaling) or "scaled", set at entry
        self.properties: Any = None
        self.prepared: list[Any] = []  # the optimizers whose grads the entry put aside

    def __enter__(self) -> torch.Tensor:
        properties = getattr(_amp_state, "opt_properties", None)
        if properties is None:
            raise RuntimeError(_NOT_INITIALIZED)
        self.properties = properties
        if not properties.enabled:
            self.mode = "off"
            return self.loss
        optimizers = self.optimizers
        if isinstance(optimizers, torch.optim.Optimizer) or type(optimizers).__name__ == "LARC":
            optimizers = [optimizers]
        self.optimizers = list(optimizers)  # FIX: a tuple is prepared too
        scaler = _amp_state.loss_scalers[self.loss_id]
        refuse_if_broken(_amp_state.loss_scalers)
        if not properties.master_weights and scaler.is_static_one():
            self.mode = "float"
            return self.loss.float()
        try:
            with hold_interrupts(_ENTRY):
                return within_commits(_ENTRY, self.optimizers, lambda: self._enter(scaler))
        except BaseException as e:
            self._put_back()  # the block never runs: nothing was changed
            if COMPLETED.format(what=_ENTRY) in getattr(e, "__notes__", ()):
                # it was not: repeat the with (__notes__: Python 3.11's, found just above)
                e.__notes__.remove(COMPLETED.format(what=_ENTRY))  # type: ignore[attr-defined]
            raise

    def _enter(self, scaler: LossScaler) -> torch.Tensor:
        if not self.delay_unscale:
            for opt in self.optimizers:
                if not opt._amp_stash.params_have_scaled_gradients:
                    self.prepared.append(opt)
                    opt._prepare_amp_backward()
        scaled = kernels.scale_outputs(self.loss.float(), scaler.scale_on)
        self.mode = "scaled"
        return scaled

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Literal[False]:
        if self.mode == "off":
            return False
        if self.mode == "float":
            _clear_cache(self.properties)
            return False
        if exc_type is not None:
            try:
                with hold_interrupts(_FAILED):  # the grads back whole (a Ctrl-C then: after it)
                    self._put_back()
                    _clear_cache(self.properties)
                    return False
            except KeyboardInterrupt as e:
                if COMPLETED.format(what=_FAILED) in getattr(e, "__notes__", ()):
                    # the with failed: repeat it (__notes__: Python 3.11's, found just above)
                    e.__notes__.remove(COMPLETED.format(what=_FAILED))  # type: ignore[attr-defined]
                raise
        # a second Ctrl-C marks the scaler this exit updates (the optimizers: within_commits)
        scaler = _amp_state.loss_scalers[self.loss_id]
        mark = None if self.delay_unscale else functools.partial(scaler.mark_broken, _EXIT)
        with hold_interrupts(_EXIT, on_abandon=mark):
            try:
                within_commits(_EXIT, self.optimizers, self._commit)
            finally:
                _clear_cache(self.properties)
            return False

    def _put_back(self) -> None:
        for opt in self.prepared:
            unprepare(opt)
        self.prepared = []

    def _commit(self) -> None:
        optimizers = self.optimizers
        if self.delay_unscale:
            for opt in optimizers:
                opt._amp_stash.params_have_scaled_gradients = True
                opt._amp_stash.grads_at_entry = []  # kept: the window's last exit unscales them
            return
        scaler = _amp_state.loss_scalers[self.loss_id]
        scaler.clear_overflow_state()
        for opt in optimizers:
            opt._post_amp_backward(scaler)
            opt._amp_stash.params_have_scaled_gradients = False
        found = scaler.take_found()
        if found is not None:  # recorded before the update: a floor policy "raise" still skips
            for opt in optimizers:
                opt._amp_stash.pending.append((self.loss_id, scaler, found))
        if not self.delay_overflow_check:
            scaler.update(found)
        elif found is not None:  # apex: no update here; the script's update_scale() (or step) applies it
            scaler.defer(found)


def disable_casts() -> Any:
    """Turn O1's casts off for the block (exception-safe); a no-op context at other levels.

    O1's casts off for the block (exception-safe); a no-op context at other levels (FIX:
    apex raised AttributeError without O1)."""
    properties = getattr(_amp_state, "opt_properties", None)
    handle = getattr(_amp_state, "handle", None)
    if handle is not None:  # O1, by initialize or init
        return handle._disable_casts()
    if properties is not None and properties.patch_torch_functions:
        from . import casts

        return casts.disable_casts()
    return contextlib.nullcontext()


# ---------------------------------------------------------------- the 2018 handle API (§11)
OLD_API_ERROR = (
    "The old Amp API is no longer supported.  Please move to the new API, documented here:  "
    "https://nvidia.github.io/apex/amp.html.  Transition guide:  "
    "https://nvidia.github.io/apex/amp.html#transition-guide-for-old-api-users"
)
CLOSURE_ERROR = "The `closure` argument is unsupported by the amp optimizer wrapper."


def init(
    enabled: bool = True,
    loss_scale: float | str = "dynamic",
    enable_caching: bool = True,
    verbose: bool = False,
    allow_banned: bool = False,
) -> AmpHandle | NoOpHandle:
    """apex's 2018 ``amp.init()``: switch O1 casting on and return a handle.

    O1 casting is ``torch.autocast(float16)`` and apex's op lists entered on the calling thread
    (:func:`fp16kit.legacy.amp.casts.enable_o1`) for **CUDA if it is available, else the CPU**
    (apex patched torch process-wide for CUDA tensors). Sets ``_amp_state.handle``; sets no
    ``opt_properties``, so ``amp.scale_loss`` still asks for ``amp.initialize``. Use
    ``handle.wrap_optimizer(optimizer)`` and its ``scale_loss(loss)``. ``enabled=False``
    returns a :class:`NoOpHandle` and casts nothing. ``verbose`` logs apex's line per cast;
    ``allow_banned=True`` runs ``F.binary_cross_entropy`` on fp16 inputs in fp32 instead of
    raising apex's error. ``enable_caching`` is accepted for apex's signature: the casts are
    cached until the next wrapper ``step()`` either way."""
    if not enabled:
        return NoOpHandle()
    from . import casts

    rules = casts.read_lists()  # amp.lists as edited until now; checked before anything changes
    handle = AmpHandle(loss_scale, enable_caching, verbose)
    casts.apply_registrations()  # amp.register_*_function calls queued before init
    casts.enable_o1(
        "cuda" if torch.cuda.is_available() else "cpu", allow_banned=allow_banned, verbose=verbose, rules=rules
    )
    _amp_state.handle = handle
    return handle


class AmpHandle:
    """apex's ``AmpHandle`` (the 2018 handle API).

    apex's ``AmpHandle``: ``is_active()``, ``wrap_optimizer()``, ``_disable_casts()``,
    ``_deactivate()``; ``scale_loss`` raises apex's "old API" error."""

    def __init__(self, loss_scale: float | str = "dynamic", enable_caching: bool = True, verbose: bool = False) -> None:
        self._loss_scale = loss_scale
        self._enable_caching = enable_caching
        self._verbose = verbose
        self._is_active = True

    def is_active(self) -> bool:
        return self._is_active

    @property
    def has_cache(self) -> bool:
        return self._enable_caching

    @property
    def verbose(self) -> bool:
        return self._verbose

    @contextlib.contextmanager
    def scale_loss(self, loss: torch.Tensor, optimizer: Any) -> Iterator[torch.Tensor]:
        raise RuntimeError(OLD_API_ERROR)
        yield loss  # pragma: no cover  (a generator, as apex's: raises at `with`)

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, num_loss: int = 1) -> OptimWrapper:
        return OptimWrapper(optimizer, self, num_loss)

    @contextlib.contextmanager
    def _disable_casts(self) -> Iterator[None]:
        """Casts off and the handle inactive for the block (exception-safe, unlike apex)."""
        from . import casts

        was, self._is_active = self._is_active, False
        try:
            with casts.disable_casts():
                yield
        finally:
            self._is_active = was

    def _clear_cache(self) -> None:
        from . import casts

        casts.clear_cache()

    def _deactivate(self) -> None:
        """Undo ``init`` on this thread (apex removed its patches): autocast back to its state
        before O1, the handle inactive (its wrappers pass straight through)."""
        from . import casts

        casts._disable_o1_for_tests()
        self._is_active = False


class NoOpHandle:
    """apex's ``NoOpHandle`` (``amp.init(enabled=False)``): inactive, so nothing is scaled.

    apex's ``NoOpHandle`` (``amp.init(enabled=False)``): inactive, so ``scale_loss`` yields the
    loss as it is and wrapped optimizers step as they are."""

    def is_active(self) -> bool:
        return False

    has_cache = False
    verbose = False

    @contextlib.contextmanager
    def scale_loss(self, loss: torch.Tensor, optimizer: Any) -> Iterator[torch.Tensor]:
        yield loss

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, num_loss: int = 1) -> OptimWrapper:
        return OptimWrapper(optimizer, self, num_loss)

    @contextlib.contextmanager
    def _disable_casts(self) -> Iterator[None]:
        yield

    def _clear_cache(self) -> None:
        pass

    def _deactivate(self) -> None:
        pass


class OptimWrapper:
    """apex's ``handle.wrap_optimizer(optimizer, num_loss)``: one dynamic :class:`LossScaler` per loss.

    apex amp's rule, the scalers used in order, ``num_loss`` losses per step::

        with opt.scale_loss(loss) as scaled:   # loss * S_k, k = the loss's index since the step
            scaled.backward()                  # (entry: the grads before this loss kept aside)
        # exit: grad = new * (1/S_k) + the grad before this loss
        #       the scaler's overflow check and update (halve on overflow, as amp.scale_loss)
        opt.step()                             # skipped if any loss since the last step overflowed

    A skipped step logs "Gradient overflow, skipping update" (WARNING, verbosity >= 1) and leaves
    the grads as they are. Other attributes and methods are the optimizer's.

    FIX: grads left from before the first loss of a step are kept as they are (apex divided them
    by ``S_0`` again, as if scaled; torch's default ``zero_grad()`` leaves none, so the numbers
    are apex's). FIX: ``state_dict()`` also holds the loss scalers (``"amp_loss_scalers"``, a
    list of ``{"loss_scale", "unskipped"}``; torch's optimizers ignore the key), so a resumed run
    goes on with their scales (apex's restarted at 2**16); a checkpoint without them (apex's)
    leaves the scalers as they are.

    Ctrl-C: each side of ``scale_loss``'s ``with``, ``step()``, ``zero_grad()``,
    ``add_param_group()`` and ``load_state_dict()`` is one commit of this wrapper, as amp's
    (:class:`ScaleLoss`); after a second Ctrl-C broke one off, the wrapper (it carries the mark:
    its loss scalers are part of its state) refuses every one and ``state_dict()`` until
    ``load_state_dict`` restores it from a checkpoint (scalers included, or fresh ones for a
    checkpoint without them, as in a run resumed from it).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, amp_handle: Any, num_loss: int) -> None:
        self._optimizer = optimizer
        self._amp_handle = amp_handle
        self._num_loss = num_loss
        self._loss_idx = 0
        self._found: list[torch.Tensor] = []  # one device flag per loss since the last step
        self._loss_scaler = [LossScaler("dynamic") for _ in range(num_loss)]
        # (param, its grad) for each grad the last scale_loss entry put aside, until its exit
        self._at_entry: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self._loaded_scalers = True  # whether the last load_state_dict restored the scalers

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self._optimizer.param_groups for p in group["params"]]

    def _cur_loss_scaler(self) -> LossScaler:
        if not 0 <= self._loss_idx < self._num_loss:
            raise RuntimeError(
                f"scale_loss was used {self._loss_idx + 1} times since the last step(), but the "
                f"optimizer was wrapped for num_loss={self._num_loss}: pass "
                f"handle.wrap_optimizer(optimizer, num_loss={self._loss_idx + 1}) (or step() first)."
            )
        return self._loss_scaler[self._loss_idx]

    def scale_loss(self, loss: torch.Tensor) -> WrapperScaleLoss:
        """``loss * S_k`` for the ``with`` block; the exit unscales this loss's grads (class docstring)."""
        return WrapperScaleLoss(self, loss)

    def _put_back(self) -> None:
        """The grads as before the last entry (its exit did not run, or its block failed)."""
        for p, g in self._at_entry:
            p.grad = g
        self._at_entry = []

    def _enter(self, loss: torch.Tensor) -> torch.Tensor:
        self._put_back()  # a Ctrl-C at the last exit's first line, before its commit, raised from it
        scaler = self._cur_loss_scaler()
        self._at_entry = [(p, p.grad) for p in self._params()]
        for p, _ in self._at_entry:
            p.grad = None  # this loss's grads are unscaled alone, then added to the kept ones
        return kernels.scale_outputs(loss, scaler.scale_on)

    def _exit(self) -> None:
        scaler = self._cur_loss_scaler()
        scaler.clear_overflow_state()
        unscale_into_stash([p for p, _ in self._at_entry], [g for _, g in self._at_entry], scaler, scaler.inv_scale())
        self._at_entry = []
        found = scaler.take_found()
        assert found is not None
        self._found.append(found)
        self._loss_idx += 1
        scaler.update(found)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        if not self._amp_handle.is_active():
            return self._optimizer.step(closure=closure)
        if closure is not None:  # (before anything changes; apex had reset the loss index first)
            raise NotImplementedError(CLOSURE_ERROR)
        self._loss_idx = 0
        self._amp_handle._clear_cache()
        found, self._found = self._found, []
        flags = kernels.stack_flags(found, torch.device("cpu")).tolist()  # one host read per step
        if any(flags):
            if _amp_state.verbosity >= 1:
                apex_logger.warning("Gradient overflow, skipping update")
            return None
        from . import casts

        with casts.disable_casts():
            return self._optimizer.step()

    # the optimizer's own surface
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or "_optimizer" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self._optimizer, name)

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state dict, and the loss scalers under ``"amp_loss_scalers"``."""
        sd = self._optimizer.state_dict()
        sd[SCALERS_KEY] = [{"loss_scale": s.loss_scale(), "unskipped": s._unskipped} for s in self._loss_scaler]
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the optimizer's state, and the loss scalers if the checkpoint holds them.

        The optimizer's state, and the loss scalers if the checkpoint holds them (all checked
        first: an error loads nothing)."""
        saved = state_dict.get(SCALERS_KEY) if isinstance(state_dict, dict) else None
        scalers = None if saved is None else _saved_scalers(saved, self._num_loss)
        self._optimizer.load_state_dict(
            {k: v for k, v in state_dict.items() if k != SCALERS_KEY} if isinstance(state_dict, dict) else state_dict
        )
        for scaler, (scale, unskipped) in zip(self._loss_scaler, scalers or ()):
            scaler._loss_scale = scale
            scaler._unskipped = unskipped
        self._loaded_scalers = scalers is not None
        self._amp_handle._clear_cache()  # O1's fp16 copies of params a checkpoint may change in place

    def _recovered_from_interrupt(self) -> None:
        # A second Ctrl-C broke a commit off (fp16kit.core.interrupts): start the next step
        # afresh, as a run resumed from the checkpoint just loaded (fresh scalers if it had none).
        self._loss_idx = 0
        self._found = []
        self._at_entry = []
        if not self._loaded_scalers:
            self._loss_scaler = [LossScaler("dynamic") for _ in range(self._num_loss)]

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        return self._optimizer.zero_grad(*args, **kwargs)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        return self._optimizer.add_param_group(param_group)

    def __repr__(self) -> str:
        return repr(self._optimizer)


SCALERS_KEY = "amp_loss_scalers"
"""The extra ``OptimWrapper.state_dict()`` entry holding its loss scalers."""

# Each of these calls is one commit of the wrapper (fp16kit.core.interrupts); scale_loss's two
# sides are, through WrapperScaleLoss.
commit_methods(
    OptimWrapper,
    {
        "step": "the wrapped optimizer's step()",
        "zero_grad": "the wrapped optimizer's zero_grad()",
        "add_param_group": "the wrapped optimizer's add_param_group()",
        "state_dict": "the wrapped optimizer's state_dict()",
        "load_state_dict": "the wrapped optimizer's load_state_dict()",
    },
    recovers=("load_state_dict",),
)


def _saved_scalers(saved: Any, num_loss: int) -> list[tuple[float, int]]:
    if not isinstance(saved, list) or len(saved) != num_loss:
        raise ValueError(
            f"The checkpoint's {SCALERS_KEY!r} holds "
            f"{len(saved) if isinstance(saved, list) else type(saved).__name__} loss scalers, the optimizer "
            f"was wrapped for num_loss={num_loss}: load a checkpoint of the same wrapped optimizer."
        )
    entries = []
    for i, entry in enumerate(saved):
        if not isinstance(entry, dict) or "loss_scale" not in entry or "unskipped" not in entry:
            raise ValueError(f"{SCALERS_KEY}[{i}] must be a dict with 'loss_scale' and 'unskipped', got {entry!r:.80}.")
        scale, unskipped = entry["loss_scale"], entry["unskipped"]
        check_scale(f"{SCALERS_KEY}[{i}]['loss_scale']", scale)
        if isinstance(unskipped, bool) or not isinstance(unskipped, int) or unskipped < 0:
            raise ValueError(
                f"{SCALERS_KEY}[{i}]['unskipped'] (clean steps counted) must be an int >= 0, got {unskipped!r:.80}."
            )
        entries.append((float(scale), unskipped))
    return entries


_WRAPPER_ENTRY = "the entry of the wrapped optimizer's scale_loss"
_WRAPPER_EXIT = "the wrapped optimizer's scale_loss exit (this loss's grads unscaled, its loss scale updated)"
_WRAPPER_FAILED = "the wrapped optimizer's scale_loss exit after an error in its block (the grads put back)"


class WrapperScaleLoss:
    """The context manager ``OptimWrapper.scale_loss`` returns: each side of the ``with`` is one commit of the wrapper.

    As :class:`ScaleLoss`'s -- a Ctrl-C at the entry is raised after the grads
    are back (repeat the ``with``); an error in the block (a Ctrl-C in the backward included)
    puts them back; a Ctrl-C at the exit's first line, before its commit, is raised with nothing
    changed (the next entry puts the grads back first); one during the exit's commit is raised
    after it, saying it was completed (go on with the next loss or ``step()``)."""

    def __init__(self, wrapper: OptimWrapper, loss: torch.Tensor) -> None:
        self.wrapper = wrapper
        self.loss = loss
        self.active = False

    def __enter__(self) -> torch.Tensor:
        if not self.wrapper._amp_handle.is_active():
            return self.loss
        started = []  # (a refusal, before _enter, changes nothing: not even a put-back)

        def enter() -> torch.Tensor:
            started.append(True)
            return self.wrapper._enter(self.loss)

        try:
            with hold_interrupts(_WRAPPER_ENTRY):
                scaled = within_commits(_WRAPPER_ENTRY, [self.wrapper], enter)
                self.active = True
                return scaled
        except BaseException as e:
            if started:
                self.wrapper._put_back()  # the block never runs: nothing was changed
            _drop_note(e, _WRAPPER_ENTRY)  # it was not completed: repeat the with
            raise

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Literal[False]:
        if not self.active:
            return False
        if exc_type is not None:
            try:
                with hold_interrupts(_WRAPPER_FAILED):
                    within_commits(_WRAPPER_FAILED, [self.wrapper], self.wrapper._put_back)
                    return False
            except KeyboardInterrupt as e:
                _drop_note(e, _WRAPPER_FAILED)  # the with failed: repeat it
                raise
        with hold_interrupts(_WRAPPER_EXIT):
            within_commits(_WRAPPER_EXIT, [self.wrapper], self.wrapper._exit)
            return False


def _drop_note(error: BaseException, what: str) -> None:
    if COMPLETED.format(what=what) in getattr(error, "__notes__", ()):
        error.__notes__.remove(COMPLETED.format(what=what))  # type: ignore[attr-defined]  # 3.11's, found above
