"""Reading checkpoints written by apex-era code, without apex and without running its pickles.

apex's FP16_Optimizer stored its loss-scaler *object* in ``state_dict()["loss_scaler"]``,
Megatron-LM v1 its own scaler there and its ``args`` as an ``argparse.Namespace``, with numpy's
RNG state beside them (docs/apex-others.md §6). ``torch.load(weights_only=True)`` refuses those
objects and ``weights_only=False`` cannot import apex (it is gone) -- and must not be trusted
anyway. :func:`load_checkpoint` reads them with torch's restricted (weights-only) unpickler,
allowing exactly the paths of :mod:`fp16kit.legacy.checkpoints.records` in addition to what
``weights_only=True`` allows, each through an inert stand-in, and returns plain data:

==============================================  ==================================================
saved                                           returned
==============================================  ==================================================
apex / Megatron loss scaler                     ``{"__apex_class__": "apex.amp.scaler.LossScaler",
                                                "_loss_scale": 65536.0, ...}`` (attributes exactly
                                                as pickled, tensors included)
fp16kit's scaler of such a name (what           the same, ``"__apex_class__"`` the apex class it
``torch.load(..., weights_only=False)`` makes   stands for (fp16kit's scalers pickle apex's
of apex's under ``fp16kit run``, saved again)   attributes)
``argparse.Namespace`` (Megatron's ``args``)    an ``argparse.Namespace`` (the stdlib class, no
                                                code of the file's: Megatron reads ``args.foo``)
numpy array / number / dtype                    numpy's when numpy is installed; else a tensor of
                                                the same dtype and shape / a Python number /
                                                numpy's ``dtype.str``
tensors (any storage location)                  tensors on ``map_location`` (CPU when it is None
                                                and CUDA is missing), attributes such as
                                                Megatron's ``model_parallel`` kept
==============================================  ==================================================

Any other global is refused with ``pickle.UnpicklingError`` naming it: a crafted pickle cannot
run code (a whole pickled model or optimizer is refused with how to re-save its
``state_dict``). So is a file that is not a checkpoint written by ``torch.save``, one that is
truncated or corrupt (:mod:`fp16kit.legacy.checkpoints.errors`), and a structure whose rebuild
would not end: pickle shares repeated references, so a few KB can describe a DAG with 2**60
paths; each container is rebuilt once and stays shared, cycles are refused, and so is a file with
more than :data:`MAX_CONTAINERS` references to containers.

:func:`scaler_state` turns any form of a saved apex scaler (fp16kit's plain dict, those dicts,
or live apex objects) into fp16kit's plain form. :mod:`fp16kit.legacy.checkpoints.convert` writes a loaded
checkpoint back as a file ``torch.load(weights_only=True)`` reads.
"""

from __future__ import annotations

import math
import os
import pickle
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from .errors import CheckpointRefused, damaged, position, refusal, structure_refused
from .records import (
    APEX_SCALER_CLASSES,
    CLASS_KEY,
    MEGATRON_SCALER_CLASSES,
    NUMPY_RECORDS,
    SAFE_GLOBALS,
    DtypeRecord,
    NamespaceRecord,
    Record,
    ScalerRecord,
    decode,
    describe,
    namespace,
    numpy_available,
    reading,
    saved_scaler,
)
from .safe_globals import replacing
from .scan import bounded, check_regular, open_regular, scan

__all__ = [
    "APEX_SCALER_CLASSES",
    "MAX_CONTAINERS",
    "MEGATRON_SCALER_CLASSES",
    "load_checkpoint",
    "read_checkpoint",
    "scaler_state",
]

_ONE_AT_A_TIME = threading.Lock()


def load_checkpoint(f: Any, map_location: Any = None) -> Any:
    """``torch.load`` for files written by apex-era code, without apex installed.

    ``torch.load`` for files written by apex-era code (e.g. ``torch.save({"model": ...,
    "optimizer": fp16_optimizer.state_dict()}, f)``, Megatron-LM v1's checkpoints), without
    apex installed.

    Returns the saved object with each allowed non-torch object replaced by plain data (see
    the module docstring); pass ``["optimizer"]`` to ``FP16_Optimizer.load_state_dict``.
    ``map_location`` is torch's; when it is None and CUDA is not available, tensors saved on a
    GPU (``cuda:0`` in real files of that era) are loaded to the CPU.

    Every refusal is a :class:`~fp16kit.legacy.checkpoints.errors.CheckpointRefused`, a
    ``pickle.UnpicklingError`` (one ``except`` clause for "this file was not loaded") whose
    ``kind`` says which: a global other than the allowed ones, a whole pickled module or optimizer, a file
    that is not a checkpoint written by ``torch.save`` (a text file, a plain pickle, an empty
    file, ...), one truncated or corrupt, a cyclic structure, an allowed object where a
    checkpoint never holds one (a dict key, a set, a tensor attribute), more than
    :data:`MAX_CONTAINERS` references to containers. Errors torch raises for a readable
    checkpoint (a missing file, a CUDA tensor mapped to a missing device, ...) pass through as
    they are.
    """
    return read_checkpoint(f, map_location)[0]


def read_checkpoint(
    f: Any, map_location: Any = None, *, plain_numpy: bool | None = None
) -> tuple[Any, list[tuple[tuple[Any, ...], Record, Any]]]:
    """:func:`load_checkpoint`, also returning what each record became.

    ``(path, record, value)`` per record, ``path`` the keys from the root. ``plain_numpy``
    (default: whether numpy is missing) turns numpy objects into tensors and Python
    numbers."""
    if map_location is None and not torch.cuda.is_available():
        map_location = "cpu"
    if plain_numpy is None:
        plain_numpy = not numpy_available()
    start = position(f)
    safetensors = isinstance(f, (str, os.PathLike)) and os.fspath(f).endswith(".safetensors")
    opened, ours = (f, False) if safetensors else open_regular(f)
    try:
        # torch's allow-list is process-wide: one load at a time adds and removes the stand-ins, in
        # place of any other entry of their paths (the apex alias's live scaler classes, a user's own)
        with _ONE_AT_A_TIME, reading() as made, replacing(SAFE_GLOBALS):
            scanned = None
            if safetensors:  # torch hands these to safetensors, which bounds what it reads
                check_regular(f)
            else:
                scan_start = opened.tell()
                scanned = scan(f, opened)  # before torch reads anything: what the file may cost (checkpoint_scan)
            # the file as it was scanned: its bytes as the scan read them (a rewrite since is not seen)
            source = opened if scanned is None else bounded(opened, scanned)
            try:
                obj = torch.load(source, map_location=map_location, weights_only=True)
            finally:
                if source is not opened:
                    stopped = source.tell()  # where torch stopped, not where the read-ahead did
                    opened.seek(stopped)
            if scanned is not None:  # data.pkl's CRC, of the bytes torch read, from the same open file
                corrupt = damaged(bounded(opened, scanned), scan_start, records="pickle", name=f)
                opened.seek(stopped)
                if corrupt is not None:
                    raise corrupt
    except CheckpointRefused:
        raise
    except Exception as e:
        refused = refusal(e, f, start)
        if refused is None:
            raise
        raise refused from None
    finally:
        if ours:
            opened.close()
    corrupt = None if scanned is not None else damaged(f, start, records="pickle")
    if corrupt is not None:
        raise corrupt
    finished: list[tuple[tuple[Any, ...], Record, Any]] = []

    def finish(record: Record, attributes: dict[str, Any] | None, path: tuple[Any, ...]) -> Any:
        if isinstance(record, ScalerRecord):
            value: Any = {CLASS_KEY: record.reads_as, **(attributes or {})}
            value[CLASS_KEY] = record.reads_as  # the class it stands for, whatever its attributes claim
        elif isinstance(record, NamespaceRecord):
            value = namespace(attributes or {})
        else:
            value = decode(record, plain=plain_numpy)
        finished.append((path, record, value))
        return value

    try:
        out = _plain(obj, finish, f)
        _check_all_finished(made, finished, f)
    except CheckpointRefused:
        raise
    except (
        pickle.UnpicklingError,
        ValueError,
        TypeError,
        RuntimeError,
    ) as e:  # a record's data is not what its class pickles
        raise structure_refused(
            f, f"{type(e).__name__}: {e}", "Re-save the checkpoint where it loads, if you trust it."
        ) from None
    return out, finished


def _check_all_finished(made: list[Record], finished: list[tuple[tuple[Any, ...], Record, Any]], f: Any) -> None:
    """Refuse a record the walk never reached: one hidden in a dict key, a set or a tensor
    attribute would come back as a stand-in object, not plain data."""
    done = set()
    for _path, record, _value in finished:
        done.add(id(record))
        dtype = record.__dict__.get("dtype")
        if isinstance(dtype, DtypeRecord):
            done.add(id(dtype))
    for record in made:
        if id(record) not in done:
            raise structure_refused(
                f,
                f"it holds a {describe(record)} where a checkpoint never holds one (a dict key, a set "
                "member, a tensor attribute, or nowhere at all)",
                "Re-save the checkpoint with that object in a state dict's value, or without it.",
            )


#: The most references to containers (dicts, lists, tuples, apex scalers; a shared one counted
#: each time it is referred to) :func:`load_checkpoint` walks. Real checkpoints hold far fewer: a
#: model state dict is one dict of tensors, an optimizer's state one small dict per parameter
#: tensor, so a model with 100,000 parameter tensors needs a few hundred thousand. Each reference
#: is visited once (about 2-4 us on a CPU), so the walk costs less than torch.load spends reading
#: a pickle that holds that many references; 10 million is a wide margin that still stops the walk
#: within a minute. Raise it if you trust a file that needs more.
MAX_CONTAINERS = 10_000_000

_CONTAINERS = (ScalerRecord, NamespaceRecord, dict, list, tuple)
_PENDING = object()


def _items(obj: Any) -> Any:
    if isinstance(obj, (ScalerRecord, NamespaceRecord)):
        return obj.attributes.items()
    return obj.items() if isinstance(obj, dict) else enumerate(obj)


def _plain(root: Any, finish: Callable[[Record, dict[str, Any] | None, tuple[Any, ...]], Any], f: Any = None) -> Any:
    """``root`` with each record replaced by ``finish(record, its plain attributes or None,
    path)``, ``path`` the keys from ``root`` to it (``f``: the file, for the refusals).

    pickle memoizes: a container referred to twice is one object in ``root`` (``b = [a, a]; c =
    [b, b]; ...`` is a small file whose paths double at each level). Each container (and each
    numpy record) is rebuilt once and its plain form shared wherever the original was; a
    container in which nothing changed is kept as it is (an ``OrderedDict`` state dict keeps
    its ``_metadata``). The walk uses its own stack, not Python's, so deep nesting is no
    ``RecursionError``. Refused with ``pickle.UnpicklingError``: a container met again while it
    is being rebuilt (a cycle), and more than :data:`MAX_CONTAINERS` references to containers.
    """
    done: dict[int, Any] = {}  # id(container or numpy record) -> its plain form
    being_rebuilt: set[int] = set()
    # [container, iterator over its (key, item), their plain forms, changed, key in its parent]
    stack: list[list[Any]] = []
    references = 0

    def path(key: Any) -> tuple[Any, ...]:
        return tuple(frame[4] for frame in stack[1:]) + (key,)

    def visit(obj: Any, key: Any) -> Any:
        """Container ``obj``'s plain form, or _PENDING after pushing it on the stack."""
        nonlocal references
        references += 1
        if references > MAX_CONTAINERS:
            raise structure_refused(
                f,
                f"it refers to containers (dicts, lists, tuples) more than "
                f"fp16kit.legacy.checkpoints.load.MAX_CONTAINERS = {MAX_CONTAINERS:,} times, far more than a "
                "checkpoint holds",
                "If you trust the file, raise that limit.",
            )
        if id(obj) in done:
            return done[id(obj)]
        if id(obj) in being_rebuilt:
            raise structure_refused(
                f,
                "it holds a cyclic structure (a container that contains itself), which a "
                "checkpoint's state dicts never hold",
                "Re-save the checkpoint without the cycle.",
            )
        being_rebuilt.add(id(obj))
        stack.append([obj, iter(_items(obj)), [], isinstance(obj, Record), key])
        return _PENDING

    def leaf(obj: Any, key: Any) -> Any:
        if id(obj) not in done:
            done[id(obj)] = finish(obj, None, path(key))
        return done[id(obj)]

    if isinstance(root, NUMPY_RECORDS):
        return finish(root, None, ())
    if not isinstance(root, _CONTAINERS):
        return root
    out = visit(root, None)
    while stack:
        frame = stack[-1]
        plain = frame[2]
        for key, item in frame[1]:
            if isinstance(item, _CONTAINERS):
                value = visit(item, key)
            elif isinstance(item, NUMPY_RECORDS):
                value = leaf(item, key)
            else:
                value = item
            if value is _PENDING:
                break  # rebuild that one first
            plain.append(value)
            if value is not item:
                frame[3] = True
        else:
            obj = frame[0]
            if isinstance(obj, (ScalerRecord, NamespaceRecord)):  # its path, while its frame is still on the stack
                out = finish(obj, dict(zip(obj.attributes, plain)), path(None)[:-1])
            else:
                out = _rebuilt(obj, plain) if frame[3] else obj
            stack.pop()
            being_rebuilt.discard(id(obj))
            done[id(obj)] = out
            if stack:
                stack[-1][2].append(out)
                if out is not obj:
                    stack[-1][3] = True
    return out


def _rebuilt(obj: Any, plain: list[Any]) -> Any:
    """Container ``obj`` with its items replaced by their plain forms ``plain`` (in ``_items``
    order)."""
    if isinstance(obj, OrderedDict):
        out = OrderedDict(zip(obj, plain))
        if hasattr(obj, "_metadata"):  # module versions in a model's state dict
            out._metadata = obj._metadata  # type: ignore[attr-defined]
        return out
    if isinstance(obj, dict):
        return dict(zip(obj, plain))
    return plain if isinstance(obj, list) else tuple(plain)


def _attributes(saved: Any) -> tuple[str, dict[str, Any]]:
    saved = saved_scaler(saved) or saved  # one of fp16kit's scalers: read as the apex one it stands for
    if isinstance(saved, dict):
        return str(saved.get(CLASS_KEY, "")), saved
    if isinstance(saved, ScalerRecord):
        return saved.reads_as, saved.attributes
    cls = type(saved)  # a live apex object (apex installed)
    if not hasattr(saved, "__dict__"):
        raise ValueError(f"a {cls.__name__} is not a loss scaler")
    return f"{cls.__module__}.{cls.__qualname__}", vars(saved)


def scaler_state(saved: Any, *, current: dict[str, Any]) -> dict[str, Any]:
    """The plain scaler state (fp16kit's form) of any saved scaler form.

    The plain scaler state (fp16kit's form, see ``AmpLossScaler.state_dict``) of any saved
    form: fp16kit's dict, an apex era-2 ``apex.amp.scaler.LossScaler`` or an era-1
    ``apex.fp16_utils.loss_scaler.LossScaler``/``DynamicLossScaler`` (apex's object, the
    fp16kit object of that name ``torch.load(..., weights_only=False)`` makes of it under
    ``fp16kit run``, or the dict :func:`load_checkpoint` makes of it; the object is only read).
    Settings an era does not store are taken from
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
                # pickled before apex's scaler took min_loss_scale (2019): no floor, as it had none
                "min_loss_scale": a.get("_min_loss_scale"),
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
        elif path in MEGATRON_SCALER_CLASSES:
            raise ValueError(
                f"{path} is Megatron-LM's scaler (delayed_shift, min_scale): load this state dict "
                "into fp16kit.legacy.megatron.FP16_Optimizer"
            )
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
        try:
            state[key] = None if v is None or (isinstance(v, float) and math.isinf(v)) else float(v)
        except (TypeError, ValueError, OverflowError):
            state[key] = math.nan
        if isinstance(v, bool) or state[key] is not None and math.isnan(state[key]):
            raise ValueError(
                f"Cannot read the saved loss scaler: its {key} is {v!r:.80}, not a number or None (None: no "
                f"{'floor' if key == 'min_loss_scale' else 'cap'}). Re-save the optimizer's state_dict() where it "
                "loads; load apex files with fp16kit.legacy.load_checkpoint."
            )
    return state
