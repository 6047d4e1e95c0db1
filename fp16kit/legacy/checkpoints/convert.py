"""Turning an apex-era checkpoint into plain data, once.

A file ``torch.load(weights_only=True)`` reads, and fp16kit's loaders too (``fp16kit
convert-checkpoint IN OUT``).

:func:`convert_checkpoint` works on what :func:`fp16kit.legacy.load_checkpoint` returned;
:func:`convert_file` reads, converts, checks and writes. What becomes what
(docs/apex-others.md §6)::

    apex scaler record {"__apex_class__": "apex...."}  -> fp16kit's scaler state (scaler_state):
                                                          FP16_Optimizer.load_state_dict reads it
    Megatron scaler record {"__apex_class__": ...}     -> kept: a dict of its attributes, which
                                                          fp16kit.legacy.megatron reads
    argparse.Namespace (Megatron's args)              -> dict of its attributes (torch dtypes
                                                          stay dtypes: weights_only reads them)
    numpy array / number / dtype                       -> tensor of the same dtype and shape /
                                                          Python number / dtype.str ("<u4")
    optimizer state with a per-group 'step'           -> kept, unless torch_optimizer_state:
      (apex FusedAdam / FusedLAMB)                        state[p]['step'] = float32 scalar tensor
                                                          of the group's count, for every param
                                                          with state; group 'step' dropped (a
                                                          stale copy would outlive torch's own
                                                          counts: fp16kit's Fused* take those
                                                          when it is missing); a tensor lr
                                                          (capturable) becomes a float
    legacy FusedAdam per-param int 'step'             -> float32 scalar tensor (same option)
    FusedAdagrad state ('sum' only, no count)          -> state[p]['step'] = tensor(0.0), group
                                                          lr_decay 0 (same option): torch's
                                                          Adagrad needs both
    tensors stored on cuda:N                           -> on map_location (CPU by default)

Each change is reported as a :class:`Conversion` (where in the checkpoint, what it was, what it
became). FusedNovoGrad keeps its second moments in the group (one tensor per dtype), which has
no torch counterpart: its state is left as it is and said so.
"""

from __future__ import annotations

import argparse
import collections
import errno
import os
import pathlib
import pickle
import shutil
import stat
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..loss_scaler import SavedScalerRefused, check_saved_scaler
from .errors import file_name
from .load import read_checkpoint, scaler_state
from .records import (
    APEX_SCALER_CLASSES,
    CLASS_KEY,
    MEGATRON_SCALER_CLASSES,
    NUMPY_RECORDS,
    decode,
    describe,
)
from .scan import check_file

__all__ = ["Conversion", "ConversionError", "OutputRefused", "WriteError", "convert_checkpoint", "convert_file"]

#: How deep :func:`convert_checkpoint` follows containers (checkpoints nest a few levels).
MAX_DEPTH = 200


class ConversionError(pickle.UnpicklingError, ValueError):
    """An item of a loaded checkpoint that :func:`convert_checkpoint` cannot convert.

    An item of a loaded checkpoint :func:`convert_checkpoint` cannot convert: at ``where``
    (e.g. ``optimizer.loss_scaler``), ``why``. A ValueError, and a ``pickle.UnpicklingError`` as
    every other refusal of a file :func:`convert_file` reads (one ``except`` for "not converted";
    from :func:`convert_file` the message names the file)."""

    def __init__(self, message: str, where: str, why: str) -> None:
        super().__init__(message)
        self.where, self.why = where, why


class OutputRefused(FileExistsError):
    """:func:`convert_file` will not write ``dst`` (nothing written).

    ``reason`` is "exists", "is_input" (both allowed by ``overwrite=True``), "is_directory" or
    "not_regular" (a FIFO, a device)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Conversion:
    """One item of a conversion report.

    At ``path`` in the checkpoint, ``before`` became ``after`` (``changed`` False: kept as
    it was, with why in ``after``)."""

    path: str
    before: str
    after: str
    changed: bool = True

    def __str__(self) -> str:
        return f"{'converted' if self.changed else 'kept':<9}  {self.path}: {self.before} -> {self.after}"


def format_path(path: tuple[Any, ...]) -> str:
    """``("optimizer", "param_groups", 0, "step")`` -> ``optimizer.param_groups[0].step``."""
    out = ""
    for key in path:
        if isinstance(key, str) and key.isidentifier():
            out += f".{key}" if out else key
        else:
            out += f"[{key!r}]"
    return out or "(the checkpoint itself)"


def _default_scaler_state() -> dict[str, Any]:
    """Settings apex's era-1 scalers did not store: those of ``FP16_Optimizer``'s own scaler."""
    from ..fp16_optimizer import AmpLossScaler

    return AmpLossScaler(1.0).state_dict()


class _Converter:
    """One pass over a loaded checkpoint; shared containers are converted once and stay shared."""

    def __init__(self, torch_optimizer_state: bool) -> None:
        self.torch_optimizer_state = torch_optimizer_state
        self.report: list[Conversion] = []
        self.done: dict[int, Any] = {}
        self.active: set[int] = set()
        self.default_scaler: dict[str, Any] | None = None

    def note(self, path: tuple[Any, ...], before: str, after: str, changed: bool = True) -> None:
        self.report.append(Conversion(format_path(path), before, after, changed))

    def convert(self, obj: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(obj, (dict, list, tuple, argparse.Namespace)):
            if id(obj) in self.done:
                return self.done[id(obj)]
            if id(obj) in self.active:
                raise ConversionError(
                    f"{format_path(path)}: a container that contains itself; a checkpoint never holds "
                    "one. Load the file with fp16kit.legacy.load_checkpoint, which refuses cycles.",
                    format_path(path),
                    "a container that contains itself",
                )
            if len(path) > MAX_DEPTH:
                raise ConversionError(
                    f"{format_path(path[:4])}...: containers nested deeper than {MAX_DEPTH} levels "
                    f"(fp16kit.legacy.checkpoints.convert.MAX_DEPTH); a checkpoint's state dicts nest a few. Convert "
                    "the parts you need (convert_checkpoint(loaded['model']), ...) and save those.",
                    format_path(path[:4]) + "...",
                    f"containers nested deeper than {MAX_DEPTH} levels",
                )
            self.active.add(id(obj))
            try:
                out = self._container(obj, path)
            finally:
                self.active.discard(id(obj))
            self.done[id(obj)] = out
            return out
        if type(obj).__module__.partition(".")[0] == "numpy" or isinstance(obj, NUMPY_RECORDS):
            return self._numpy(obj, path)
        return obj

    def _container(self, obj: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(obj, argparse.Namespace):
            attrs = {k: self.convert(v, (*path, k)) for k, v in vars(obj).items()}
            self.note(
                path,
                f"argparse.Namespace ({len(attrs)} attributes)",
                "dict (argparse.Namespace(**that_dict) gives code reading args.foo its Namespace back)",
            )
            return attrs
        if isinstance(obj, dict):
            items = {k: self.convert(v, (*path, k)) for k, v in obj.items()}
            if isinstance(items.get(CLASS_KEY), str):
                return self._scaler(items, path)
            if _is_optimizer_state(items):
                items = self._optimizer_state(items, path)
            if all(items[k] is obj[k] for k in obj):
                return obj  # unchanged: keep its type (an OrderedDict's _metadata included)
            out = type(obj)(items) if type(obj) in (dict, collections.OrderedDict) else dict(items)
            if hasattr(obj, "_metadata"):
                out._metadata = obj._metadata  # type: ignore[attr-defined]
            return out
        converted = [self.convert(v, (*path, i)) for i, v in enumerate(obj)]
        if all(a is b for a, b in zip(converted, obj)):
            return obj
        return converted if isinstance(obj, list) else tuple(converted)

    def _scaler(self, record: dict[str, Any], path: tuple[Any, ...]) -> Any:
        cls = record[CLASS_KEY]
        if cls in APEX_SCALER_CLASSES:
            if self.default_scaler is None:
                self.default_scaler = _default_scaler_state()
            try:
                check_saved_scaler(record)  # a NaN scale or a window of 0 is not written on
            except SavedScalerRefused as e:
                raise ConversionError(
                    f"{format_path(path)}: {e}",
                    format_path(path),
                    f"the {cls} there holds {e.name} = {e.value!r:.40}, not {e.what} (no apex run writes that)",
                ) from None
            try:
                state = scaler_state(record, current=self.default_scaler)
            except ValueError as e:
                raise ConversionError(
                    f"{format_path(path)}: {e}",
                    format_path(path),
                    f"the {cls} there lacks that class's attributes, or holds ones that are "
                    "not numbers (apex did not write it)",
                ) from None
            kind = "dynamic" if state["dynamic"] else "static"
            self.note(
                path,
                cls,
                f"fp16kit's scaler state ({kind}, loss_scale {state['loss_scale']:g}; "
                "FP16_Optimizer.load_state_dict reads it)",
            )
            return state
        if cls in MEGATRON_SCALER_CLASSES:
            self.note(
                path, cls, "a dict of its attributes (fp16kit.legacy.megatron's FP16_Optimizer reads it)", changed=False
            )
        return record

    # ----------------------------------------------------------------------------- numpy
    def _numpy(self, obj: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(obj, NUMPY_RECORDS):  # never left by load_checkpoint; decoded as it would be
            before, value = describe(obj), decode(obj, plain=True)
        else:
            before, value = _numpy_plain(obj)
        self.note(path, before, _describe_value(value))
        return value

    # ------------------------------------------------------------------ optimizer state
    def _optimizer_state(self, sd: dict[str, Any], path: tuple[Any, ...]) -> dict[str, Any]:
        groups = sd["param_groups"]
        grouped = [i for i, g in enumerate(groups) if "step" in g]
        per_param_ints = [
            k
            for k, s in sd["state"].items()
            if isinstance(s, dict) and "step" in s and not isinstance(s["step"], torch.Tensor)
        ]
        if not self.torch_optimizer_state:
            for i in grouped:
                self.note(
                    (*path, "param_groups", i, "step"),
                    f"per-group step {_number(groups[i]['step'])} (apex Fused*)",
                    "kept (--torch-optimizer-state / torch_optimizer_state=True moves "
                    "it into each param's state for torch.optim.Adam/AdamW)",
                    changed=False,
                )
            return sd
        state = {k: dict(s) if isinstance(s, dict) else s for k, s in sd["state"].items()}
        new_groups = []
        for i, group in enumerate(groups):
            group = dict(group)
            where = (*path, "param_groups", i)
            if i in grouped and ("exp_avg_sq" in group or "norm_type" in group):
                self.note(
                    (*where, "step"),
                    "FusedNovoGrad group state (step, exp_avg_sq per group)",
                    "kept: torch has no NovoGrad; load it into fp16kit's FusedNovoGrad",
                    changed=False,
                )
            elif i in grouped:
                step = _number(group.pop("step"))
                moved = 0
                for pid in group["params"]:
                    if isinstance(state.get(pid), dict) and "step" not in state[pid]:
                        state[pid]["step"] = torch.tensor(float(step), dtype=torch.float32)
                        moved += 1
                self.note(
                    (*where, "step"),
                    f"per-group step {step} (apex Fused*)",
                    f"state[p]['step'] = tensor({float(step)}) for the group's {moved} params with state",
                )
                if isinstance(group.get("lr"), torch.Tensor):
                    group["lr"] = float(group["lr"].item())
                    self.note((*where, "lr"), "tensor lr (capturable)", f"float {group['lr']}")
            new_groups.append(group)
        for pid in per_param_ints:
            state[pid]["step"] = torch.tensor(float(state[pid]["step"]), dtype=torch.float32)
        if per_param_ints:
            self.note(
                (*path, "state"),
                f"per-param int 'step' of {len(per_param_ints)} params (legacy FusedAdam)",
                "float32 scalar tensors (torch's form)",
            )
        # apex FusedAdagrad keeps 'sum' only; torch's Adagrad refuses a state without 'step'
        # (KeyError in load_state_dict) and uses it only for lr_decay, which apex's lacks
        sums = [k for k, s in state.items() if isinstance(s, dict) and set(s) == {"sum"}]
        if sums and not grouped and len(sums) == len(state):
            for pid in sums:
                state[pid]["step"] = torch.tensor(0.0, dtype=torch.float32)
            for group in new_groups:
                group.setdefault("lr_decay", 0.0)  # torch's Adagrad reads it at each step
            self.note(
                (*path, "state"),
                f"'sum' only, no count, for {len(sums)} params (apex FusedAdagrad)",
                "state[p]['step'] = tensor(0.0) and group lr_decay 0: torch.optim.Adagrad needs "
                "both; the count matters only with lr_decay, which apex's lacked",
            )
        return {**sd, "state": state, "param_groups": new_groups}


def _is_optimizer_state(d: dict[str, Any]) -> bool:
    groups = d.get("param_groups")
    return (
        isinstance(d.get("state"), dict)
        and isinstance(groups, list)
        and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups)
    )


def _number(value: Any) -> Any:
    """A step count as a Python number (an int when it is whole)."""
    if isinstance(value, torch.Tensor):
        value = value.item()  # offline conversion, not a training step
    return int(value) if float(value).is_integer() else float(value)


def _numpy_plain(obj: Any) -> tuple[str, Any]:
    """A live numpy object (numpy installed) as plain data, and what it was."""
    import numpy as np

    if isinstance(obj, np.dtype):
        return f"numpy.dtype {obj.str}", obj.str
    if isinstance(obj, np.generic):
        return f"numpy scalar {obj.dtype.str}", obj.item()
    if isinstance(obj, np.ndarray):
        before = f"numpy.ndarray {obj.dtype.str} {obj.shape}"
        if obj.dtype.kind not in "biufc":
            return before, obj.tolist()
        native = np.ascontiguousarray(obj, dtype=obj.dtype.newbyteorder("="))
        return before, torch.from_numpy(native.copy())
    raise ValueError(f"a {type(obj).__name__} from numpy is not plain data; convert it before saving")


def _describe_value(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).replace('torch.', '')} tensor {tuple(value.shape)}"
    return type(value).__name__


def convert_checkpoint(obj: Any, *, torch_optimizer_state: bool = False) -> tuple[Any, list[Conversion]]:
    """Return the plain-data form of ``obj`` and the report of what changed.

    The plain-data form of ``obj`` (what :func:`fp16kit.legacy.load_checkpoint` returned),
    and the report of what changed. ``obj`` itself is not modified. See the module docstring.
    Raises :class:`ConversionError` (a ValueError) for a scaler record whose attributes do not
    match its class, and for a cycle or containers nested deeper than :data:`MAX_DEPTH`."""
    converter = _Converter(torch_optimizer_state)
    return converter.convert(obj, ()), converter.report


def _locations(map_location: Any, seen: collections.Counter[str]) -> Callable[[Any, str], Any] | Any:
    """``map_location`` as a callable that also counts where each storage was saved (a string
    or device; anything else is handed to torch as it is, uncounted)."""
    if not isinstance(map_location, (str, torch.device)):
        return map_location
    target = str(map_location)

    def restore(storage: Any, location: str) -> Any:
        seen[location] += 1
        return torch.serialization.default_restore_location(storage, target)

    return restore


def _same_file(a: pathlib.Path, b: pathlib.Path) -> bool:
    try:
        return b.exists() and os.path.samefile(a, b)
    except OSError:
        return a.resolve() == b.resolve()


def convert_file(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    map_location: Any = "cpu",
    torch_optimizer_state: bool = False,
    overwrite: bool = False,
) -> list[Conversion]:
    """Convert the checkpoint ``src`` and write the result to ``dst``, atomically.

    Read ``src`` with :func:`fp16kit.legacy.load_checkpoint`, convert it
    (:func:`convert_checkpoint`) and write ``dst`` (zip format), which is checked to load with
    ``torch.load(weights_only=True)`` before it replaces anything: ``dst`` is written to a
    temporary file beside it and renamed, so a failure leaves no partial file.

    Refuses (:class:`OutputRefused`, a ``FileExistsError``) an existing ``dst`` and ``dst`` being
    ``src`` unless ``overwrite``, and ``dst`` being a directory or another file that is not a regular
    one (a FIFO, a device: never replaced); ``NotADirectoryError`` when
    ``dst``'s folder is missing; errors reading ``src`` are load_checkpoint's
    (:class:`~fp16kit.legacy.checkpoints.errors.CheckpointRefused` for a file it refuses) and leave
    ``dst`` untouched, as does a :class:`ConversionError`; a failure to write ``dst`` (a full disk)
    is a :class:`WriteError` (an ``OSError``) saying so. Unlike ``torch.load``, every record of
    a zip checkpoint is CRC-checked first (a damaged tensor is refused, not copied on)."""
    src, dst = pathlib.Path(src), pathlib.Path(dst)
    if dst.is_dir():  # overwrite or not: the rename onto a folder would fail once converted
        raise OutputRefused(
            f"{dst} is a directory; name the file to write in it, e.g. {dst / src.name}", "is_directory"
        )
    if dst.exists() and not dst.is_file():  # a FIFO, a device, a socket: --force or not, never replaced
        raise OutputRefused(
            f"{dst} is not a regular file (a FIFO, a device or a socket); name a file to write", "not_regular"
        )
    if not overwrite and _same_file(src, dst):
        raise OutputRefused(
            f"{dst} is the input file; write the converted checkpoint elsewhere "
            "(or pass overwrite=True to replace it once converted)",
            "is_input",
        )
    if not overwrite and dst.exists():
        raise OutputRefused(f"{dst} exists; choose another name or pass overwrite=True", "exists")
    if not dst.parent.is_dir():
        raise NotADirectoryError(f"{dst.parent} is not a directory: create it first, or write {dst.name} elsewhere")
    # a regular file, whose zip directory and pickle cost only what they claim, then every record's
    # CRC (torch reads tensor records unchecked), all from one open file
    check_file(src, crc=True)
    seen: collections.Counter[str] = collections.Counter()
    # torch.load hands a .safetensors file to safetensors, which takes a device, not a function
    where = map_location if src.suffix == ".safetensors" else _locations(map_location, seen)
    obj, finished = read_checkpoint(src, where, plain_numpy=True)
    report = [
        Conversion(format_path(path), describe(record), _describe_value(value))
        for path, record, value in finished
        if isinstance(record, NUMPY_RECORDS)
    ]
    try:
        converted, more = convert_checkpoint(obj, torch_optimizer_state=torch_optimizer_state)
    except ConversionError as e:
        raise ConversionError(
            f"fp16kit.legacy.convert_file: {file_name(src)} was not converted: {e}", e.where, e.why
        ) from None
    report += more
    target = str(map_location)
    for location, count in sorted(seen.items()):
        if location != target:
            report.append(Conversion("(tensors)", f"{count} storages saved on {location}", f"loaded to {target}"))
    tmp = dst.with_name(f".{dst.name}.fp16kit-{os.getpid()}.tmp")
    try:
        try:
            torch.save(converted, tmp)
            torch.load(tmp, map_location="cpu", weights_only=True, mmap=True)  # what the reader will do
            if dst.exists():  # replaced (overwrite): keep its permissions (a private 0600 file stays so)
                os.chmod(tmp, stat.S_IMODE(dst.stat().st_mode))
            os.replace(tmp, dst)
        except (OSError, RuntimeError) as e:
            raise _write_error(src, dst, e) from e
    finally:
        if tmp.exists():
            tmp.unlink()
    return report


class WriteError(OSError):
    """``convert_file`` read and converted ``src`` but could not write ``dst`` (nothing written)."""


def _write_error(src: pathlib.Path, dst: pathlib.Path, e: Exception) -> WriteError:
    # torch's zip writer reports a full disk as "[enforce fail at inline_container.cc] unexpected
    # pos 704 vs 598" or "file write failed": say what it most likely is
    why = f"{type(e).__name__}: {e}"
    try:
        free, needed = shutil.disk_usage(dst.parent).free, src.stat().st_size
    except OSError:
        free = needed = 0
    if isinstance(e, OSError) and e.errno == errno.ENOSPC or (needed and free < needed):
        why = (
            f"the disk holding {dst.parent} is full or nearly ({free:,} bytes free; {src.name} is "
            f"{needed:,} bytes): free some space or write OUT elsewhere ({why})"
        )
    elif isinstance(e, PermissionError):
        why = f"no permission to write in {dst.parent} ({why})"
    return WriteError(f"could not write {dst}, nothing was written: {why}")
