"""Reading checkpoints written by apex-era code, without apex and without running its pickles.

apex's FP16_Optimizer stored its loss-scaler *object* in ``state_dict()["loss_scaler"]``, so
its checkpoints pickle one of three apex classes, which ``torch.load(weights_only=True)``
refuses and ``weights_only=False`` cannot import (apex is gone) -- and must not be trusted
anyway. :func:`load_checkpoint` reads them with torch's restricted (weights-only) unpickler,
allowing exactly those three class paths in addition to what ``weights_only=True`` allows, and
turns each such object into a plain dict::

    {"__apex_class__": "apex.amp.scaler.LossScaler", "_loss_scale": 65536.0, ...}

Any other global is refused with ``pickle.UnpicklingError`` naming it: a crafted pickle cannot
run code. So is a file that is not a checkpoint written by ``torch.save`` (the message names the
file and what was expected) and a structure whose rebuild would not end: pickle shares repeated
references, so a few KB can describe a DAG with 2**60 paths; each container is rebuilt once and
stays shared, cycles are refused, and so is a file with more than :data:`MAX_CONTAINERS`
references to containers.

:func:`scaler_state` turns any form of a saved scaler (fp16kit's plain dict, those dicts, or live
apex objects) into fp16kit's plain form.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import pickletools
import re
import struct
import zipfile
from collections import OrderedDict
from typing import Any

import torch

__all__ = ["APEX_SCALER_CLASSES", "MAX_CONTAINERS", "load_checkpoint", "scaler_state"]

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

    Every refusal is a ``pickle.UnpicklingError`` (one ``except`` clause for "this file was not
    loaded"): a global other than apex's scalers, a file that is not a checkpoint written by
    ``torch.save`` (a text file, a plain pickle, an empty file, ...) or one cut short, a cyclic
    structure, more than :data:`MAX_CONTAINERS` references to containers. Errors torch raises for
    a readable checkpoint (a missing file, a CUDA tensor without CUDA, ...) pass through as they are.
    """
    if map_location is None and not torch.cuda.is_available():
        map_location = "cpu"
    start = _position(f)
    try:
        with torch.serialization.safe_globals(list(_RECORD_CLASSES)):
            obj = torch.load(f, map_location=map_location, weights_only=True)
    except Exception as e:
        refusal = _refusal(e, f, start)
        if refusal is None:
            raise
        raise refusal from None
    return _plain(obj)


_LOADER = "fp16kit.legacy.load_checkpoint"


def _refusal(e: Exception, f: Any, start: int | None) -> pickle.UnpicklingError | None:
    """What ``load_checkpoint`` raises for ``torch.load``'s error ``e`` (None: ``e`` itself)."""
    torch_said = f"(torch said: {type(e).__name__}: {e})"
    found = re.search(r"GLOBAL (\S+)", str(e)) or re.search(r"got <class '([^']+)'>", str(e))
    what = found.group(1) if found else "an object it does not allow"
    not_checkpoint = _not_a_checkpoint(f, start)
    if not_checkpoint:
        asked = f" {_LOADER} refused to load {what}, which its pickle asks for; nothing was run."
        return pickle.UnpicklingError(
            f"{_LOADER}: {_name(f)} is not a checkpoint written by torch.save: {not_checkpoint}. "
            "Expected a zip archive holding a data.pkl record (torch >= 1.6) or torch's legacy "
            "format, which starts with torch's magic number (older torch, or "
            "_use_new_zipfile_serialization=False). Check that this is the file you meant; one "
            "written with pickle.dump is read with pickle.load, and only if you trust it."
            f"{asked if found else ''}\n{torch_said}"
        )
    if isinstance(e, pickle.UnpicklingError):
        return pickle.UnpicklingError(
            f"{_LOADER} refused to load {what}: only tensors, plain containers and apex's loss "
            f"scalers ({', '.join(APEX_SCALER_CLASSES)}) are read. If you trust this file and need "
            f"that object, use torch.load(..., weights_only=False) yourself.\n{torch_said}"
        )
    if isinstance(e, EOFError):
        return pickle.UnpicklingError(
            f"{_LOADER}: {_name(f)} ends early: it starts like a checkpoint written by torch.save but "
            "is cut short (an interrupted save or copy?). Save or copy it again.\n" + torch_said
        )
    if isinstance(e, (TypeError, AttributeError, RecursionError)):  # e.g. a REDUCE on a record class
        return pickle.UnpicklingError(f"{_LOADER} could not read this file: {type(e).__name__}: {e}")
    return None


_HEAD_BYTES = 512  # enough for a tar header's "ustar" at offset 257


def _position(f: Any) -> int | None:
    """Where ``torch.load`` starts reading a file object (None for a path or an unseekable file)."""
    if isinstance(f, (str, os.PathLike)):
        return None
    try:
        return f.tell()
    except (AttributeError, OSError, ValueError):
        return None


def _name(f: Any) -> str:
    if isinstance(f, (str, os.PathLike)):
        return repr(os.fspath(f))
    name = getattr(f, "name", None)
    return repr(name) if isinstance(name, str) else f"the {type(f).__name__} it was given"


def _not_a_checkpoint(f: Any, start: int | None) -> str:
    """Why ``f`` is not a file ``torch.save`` wrote, or "" when it looks like one (or cannot be
    read again to tell)."""
    try:
        if isinstance(f, (str, os.PathLike)):
            if os.fspath(f).endswith(".safetensors"):  # torch.load hands these to safetensors
                return ""
            with open(f, "rb") as opened:
                return _not_torch_save(opened)
        if start is None:
            return ""
        f.seek(start)
        try:
            return _not_torch_save(f)
        finally:
            f.seek(start)  # where the caller had it
    except (OSError, ValueError, AttributeError, TypeError):
        return ""


def _not_torch_save(opened: Any) -> str:
    start = opened.tell()
    head = opened.read(_HEAD_BYTES)
    if not isinstance(head, bytes):
        return ""
    if not head:
        return "it is empty"
    if head.startswith(b"PK\x03\x04"):  # what torch.load takes for its zip format
        opened.seek(start)
        try:
            with zipfile.ZipFile(opened) as archive:
                records = archive.namelist()
        except zipfile.BadZipFile:
            return ""  # a damaged checkpoint, as torch says
        if any(n.endswith("/data.pkl") for n in records):
            return ""
        return f"it is a zip archive without a data.pkl record (it holds {records[:3]!r}...)"
    if head[257:262] == b"ustar" or _starts_with_magic_number(head):  # torch's legacy formats
        return ""
    if head.startswith(b"\x80"):
        return f"it is a plain pickle (protocol {head[1]}), not torch.save's format"
    return f"it starts with {head[:24]!r}"


def _starts_with_magic_number(head: bytes) -> bool:
    """Whether ``head`` begins with torch's legacy-format magic number, pickled (any protocol)."""
    try:
        for op, arg, _ in pickletools.genops(io.BytesIO(head)):
            if op.name not in ("PROTO", "FRAME"):
                return type(arg) is int and arg == torch.serialization.MAGIC_NUMBER
    except (ValueError, struct.error):  # not pickle opcodes, or cut off at the end of the head
        return False
    return False


#: The most references to containers (dicts, lists, tuples, apex scalers; a shared one counted
#: each time it is referred to) :func:`load_checkpoint` walks. Real checkpoints hold far fewer: a
#: model state dict is one dict of tensors, an optimizer's state one small dict per parameter
#: tensor, so a model with 100,000 parameter tensors needs a few hundred thousand. Each reference
#: is visited once (about 2-4 us on a CPU), so the walk costs less than torch.load spends reading
#: a pickle that holds that many references; 10 million is a wide margin that still stops the walk
#: within a minute. Raise it if you trust a file that needs more.
MAX_CONTAINERS = 10_000_000

_CONTAINERS = (_ApexRecord, dict, list, tuple)
_PENDING = object()


def _items(obj: Any) -> Any:
    if isinstance(obj, _ApexRecord):
        return obj.attributes.values()
    return obj.values() if isinstance(obj, dict) else obj


def _plain(root: Any) -> Any:
    """``root`` with each apex record turned into a dict (see the module docstring).

    pickle memoizes: a container referred to twice is one object in ``root`` (``b = [a, a]; c =
    [b, b]; ...`` is a small file whose paths double at each level). Each container is rebuilt
    once and its plain form shared wherever the original was; a container in which nothing
    changed is kept as it is (an ``OrderedDict`` state dict keeps its ``_metadata``). The walk
    uses its own stack, not Python's, so deep nesting is no ``RecursionError``. Refused with
    ``pickle.UnpicklingError``: a container met again while it is being rebuilt (a cycle), and
    more than :data:`MAX_CONTAINERS` references to containers.
    """
    done: dict[int, Any] = {}  # id(container) -> its plain form
    being_rebuilt: set[int] = set()
    stack: list[list[Any]] = []  # [container, iterator over its items, their plain forms, changed]
    references = 0

    def visit(obj: Any) -> Any:
        """Container ``obj``'s plain form, or _PENDING after pushing it on the stack."""
        nonlocal references
        references += 1
        if references > MAX_CONTAINERS:
            raise pickle.UnpicklingError(
                f"{_LOADER} refused this file: it refers to containers (dicts, lists, tuples) more "
                f"than fp16kit.legacy.checkpoint.MAX_CONTAINERS = {MAX_CONTAINERS:,} times, far more "
                "than a checkpoint holds. If you trust the file, raise that limit."
            )
        if id(obj) in done:
            return done[id(obj)]
        if id(obj) in being_rebuilt:
            raise pickle.UnpicklingError(
                f"{_LOADER} refused a cyclic structure (a container that contains itself); "
                "a checkpoint's state dicts never hold one. Re-save the checkpoint without the cycle."
            )
        being_rebuilt.add(id(obj))
        stack.append([obj, iter(_items(obj)), [], isinstance(obj, _ApexRecord)])
        return _PENDING

    if not isinstance(root, _CONTAINERS):
        return root
    out = visit(root)
    while stack:
        frame = stack[-1]
        plain = frame[2]
        for item in frame[1]:
            value = visit(item) if isinstance(item, _CONTAINERS) else item
            if value is _PENDING:
                break  # rebuild that one first
            plain.append(value)
            if value is not item:
                frame[3] = True
        else:
            obj = stack.pop()[0]
            being_rebuilt.discard(id(obj))
            out = done[id(obj)] = _rebuilt(obj, plain) if frame[3] else obj
            if stack:
                stack[-1][2].append(out)
                if out is not obj:
                    stack[-1][3] = True
    return out


def _rebuilt(obj: Any, plain: list[Any]) -> Any:
    """``obj`` with its items replaced by their plain forms ``plain`` (in ``_items`` order)."""
    if isinstance(obj, _ApexRecord):
        return {_CLASS_KEY: obj._path, **dict(zip(obj.attributes, plain))}
    if isinstance(obj, OrderedDict):
        out = OrderedDict(zip(obj, plain))
        if hasattr(obj, "_metadata"):  # module versions in a model's state dict
            out._metadata = obj._metadata  # type: ignore[attr-defined]
        return out
    if isinstance(obj, dict):
        return dict(zip(obj, plain))
    return plain if isinstance(obj, list) else tuple(plain)


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
