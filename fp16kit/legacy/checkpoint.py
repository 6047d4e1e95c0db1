"""Reading checkpoints written by apex-era code, without apex and without running its pickles.

apex's FP16_Optimizer stored its loss-scaler *object* in ``state_dict()["loss_scaler"]``, so
its checkpoints pickle one of three apex classes, which ``torch.load(weights_only=True)``
refuses and ``weights_only=False`` cannot import (apex is gone) -- and must not be trusted
anyway. :func:`load_checkpoint` reads them with torch's restricted (weights-only) unpickler,
allowing exactly those three class paths in addition to what ``weights_only=True`` allows, and
turns each such object into a plain dict::

    {"__apex_class__": "apex.amp.scaler.LossScaler", "_loss_scale": 65536.0, ...}

Any other global is refused with ``pickle.UnpicklingError`` naming it: a crafted pickle cannot
run code. :func:`scaler_state` turns any form of a saved scaler (fp16kit's plain dict, those
dicts, or live apex objects) into fp16kit's plain form.
"""

from __future__ import annotations

import math
import pickle
import re
from collections import OrderedDict
from typing import Any

import torch

__all__ = ["APEX_SCALER_CLASSES", "load_checkpoint", "scaler_state"]

APEX_SCALER_CLASSES = (
    "apex.fp16_utils.loss_scaler.LossScaler",
    "apex.fp16_utils.loss_scaler.DynamicLossScaler",
    "apex.amp.scaler.LossScaler",
)
_CLASS_KEY = "__apex_class__"


class _ApexRecord:
    """What an apex scaler object unpickles into: its attributes, kept apart from the
    record's own (a crafted pickle cannot overwrite ``_path`` or methods)."""

    _path = ""

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots)
            state = {**(state[0] or {}), **(state[1] or {})}
        if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
            raise pickle.UnpicklingError(
                f"{self._path}: expected a dict of attributes, got {type(state).__name__}."
            )
        object.__setattr__(self, "_attrs", dict(state))

    @property
    def attributes(self) -> dict[str, Any]:
        return self.__dict__.get("_attrs", {})


def _record_class(path: str) -> type:
    module, name = path.rsplit(".", 1)
    # The unpickler finds allowed globals by "{__module__}.{__qualname__}".
    return type(name, (_ApexRecord,), {"__module__": module, "__qualname__": name, "_path": path})


_RECORD_CLASSES = tuple(_record_class(p) for p in APEX_SCALER_CLASSES)


def load_checkpoint(f: Any, map_location: Any = None) -> Any:
    """``torch.load`` for files written by apex-era code (e.g. ``torch.save({"model": ...,
    "optimizer": fp16_optimizer.state_dict()}, f)``), without apex installed.

    Returns the saved object with each apex scaler replaced by a plain dict (see the module
    docstring); pass ``["optimizer"]`` to ``FP16_Optimizer.load_state_dict``. When CUDA is not
    available and ``map_location`` is None, tensors saved on a GPU are loaded to the CPU.
    """
    if map_location is None and not torch.cuda.is_available():
        map_location = "cpu"
    try:
        with torch.serialization.safe_globals(list(_RECORD_CLASSES)):
            obj = torch.load(f, map_location=map_location, weights_only=True)
    except (TypeError, AttributeError, RecursionError) as e:  # e.g. a REDUCE on a record class
        raise pickle.UnpicklingError(
            f"fp16kit.legacy.load_checkpoint could not read this file: {type(e).__name__}: {e}"
        ) from None
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL (\S+)", str(e)) or re.search(r"got <class '([^']+)'>", str(e))
        what = found.group(1) if found else "an object it does not allow"
        raise pickle.UnpicklingError(
            f"fp16kit.legacy.load_checkpoint refused to load {what}: only tensors, plain "
            f"containers and apex's loss scalers ({', '.join(APEX_SCALER_CLASSES)}) are read. "
            "If you trust this file and need that object, use torch.load(..., "
            f"weights_only=False) yourself.\n(torch said: {e})"
        ) from None
    return _plain(obj, set())


def _plain(obj: Any, active: set[int]) -> Any:
    """Containers rebuilt with apex records turned into dicts. A container met again while
    it is being rebuilt (a cyclic pickle) is refused."""
    if not isinstance(obj, (_ApexRecord, dict, list, tuple)):
        return obj
    if id(obj) in active:
        raise pickle.UnpicklingError("fp16kit.legacy.load_checkpoint refused a cyclic structure.")
    active.add(id(obj))
    try:
        if isinstance(obj, _ApexRecord):
            return {_CLASS_KEY: obj._path, **{k: _plain(v, active) for k, v in obj.attributes.items()}}
        if isinstance(obj, OrderedDict):
            out = OrderedDict((k, _plain(v, active)) for k, v in obj.items())
            if hasattr(obj, "_metadata"):  # module versions in a model's state dict
                out._metadata = obj._metadata  # type: ignore[attr-defined]
            return out
        if isinstance(obj, dict):
            return {k: _plain(v, active) for k, v in obj.items()}
        if isinstance(obj, list):
            return [_plain(v, active) for v in obj]
        return tuple(_plain(v, active) for v in obj)
    finally:
        active.discard(id(obj))


def _attributes(saved: Any) -> tuple[str, dict[str, Any]]:
    if isinstance(saved, dict):
        return str(saved.get(_CLASS_KEY, "")), saved
    if isinstance(saved, _ApexRecord):
        return saved._path, saved.attributes
    cls = type(saved)  # a live apex object (apex installed)
    if not hasattr(saved, "__dict__"):
        raise ValueError(f"a {cls.__name__} is not a loss scaler")
    return f"{cls.__module__}.{cls.__qualname__}", vars(saved)


def scaler_state(saved: Any, *, current: dict[str, Any]) -> dict[str, Any]:
    """The plain scaler state (fp16kit's form, see ``AmpLossScaler.state_dict``) of any saved
    form: fp16kit's dict, an apex era-2 ``apex.amp.scaler.LossScaler`` or an era-1
    ``apex.fp16_utils.loss_scaler.LossScaler``/``DynamicLossScaler`` (object or the dict
    :func:`load_checkpoint` makes of it). Settings an era does not store are taken from
    ``current`` (the loading optimizer's state). Raises ValueError for anything else."""
    try:
        path, a = _attributes(saved)
        if not path and "loss_scale" in a and "dynamic" in a:  # fp16kit's own form
            state = {k: a[k] for k in current}
        elif path == "apex.amp.scaler.LossScaler":
            state = {
                "dynamic": bool(a["dynamic"]),
                "loss_scale": float(a["_loss_scale"]),
                "scale_factor": 2.0,  # apex's era-2 scaler always used 2
                "scale_window": int(a["_scale_seq_len"]),
                "min_loss_scale": a["_min_loss_scale"],
                "max_loss_scale": a["_max_loss_scale"],
                "unskipped": int(a["_unskipped"]),
            }
        elif path == "apex.fp16_utils.loss_scaler.DynamicLossScaler":
            window = int(a["scale_window"])
            since = int(a["cur_iter"]) - int(a["last_overflow_iter"]) - 1
            state = {
                **current,
                "dynamic": True,
                "loss_scale": float(a["cur_scale"]),
                "scale_factor": float(a["scale_factor"]),
                "scale_window": window,
                # era 1 grows when (cur_iter - last_overflow_iter) % window == 0; era 2 when
                # the clean-step counter reaches the window: the same next growth. With era 1's
                # floor of 1 and no cap, the era-2 rule then continues exactly as era 1 would.
                "unskipped": since % window,
                "min_loss_scale": 1.0,
                "max_loss_scale": None,
            }
        elif path == "apex.fp16_utils.loss_scaler.LossScaler":
            state = {**current, "dynamic": False, "loss_scale": float(a["cur_scale"]), "unskipped": 0}
        else:
            raise ValueError(f"unrecognized loss scaler {path or type(saved).__name__}")
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(
            f"Cannot read the saved loss scaler ({e}). Expected fp16kit's dict or one of apex's "
            f"scalers ({', '.join(APEX_SCALER_CLASSES)}); load apex files with "
            "fp16kit.legacy.load_checkpoint."
        ) from None
    for key in ("min_loss_scale", "max_loss_scale"):
        v = state[key]
        state[key] = None if v is None or (isinstance(v, float) and math.isinf(v)) else float(v)
    return state
