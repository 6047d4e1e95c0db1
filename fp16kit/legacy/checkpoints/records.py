"""The non-tensor objects apex-era checkpoints pickle, and the inert stand-ins they load as.

The non-tensor objects apex-era checkpoints pickle, and the inert stand-ins
:func:`fp16kit.legacy.load_checkpoint` unpickles them into (docs/apex-others.md §6).

torch's weights-only unpickler resolves a pickle's globals through an allow-list. For each path
below this module registers a stand-in under that path, so a pickle that asks for it gets the
stand-in, never the real class (which may not be installed, and whose code must not run on
untrusted data):

=========================================================  ===================================
pickled global                                              stand-in, what it becomes
=========================================================  ===================================
``apex.fp16_utils.loss_scaler.{LossScaler,                  :class:`ScalerRecord`: a dict of the
DynamicLossScaler}``, ``apex.amp.scaler.LossScaler``,       pickled attributes plus
``megatron.fp16.loss_scaler.{LossScaler,                    ``"__apex_class__": <path>``
DynamicLossScaler}``, ``fp16.loss_scaler.{...}``
fp16kit's classes of those names                            the same, ``<path>`` the class
(:data:`FP16KIT_SCALER_CLASSES`: what ``fp16kit run``       it stands for
unpickles apex's as, saved again)
``argparse.Namespace`` (Megatron's ``args``)                :class:`NamespaceRecord`: an
                                                            ``argparse.Namespace``
``numpy.ndarray``, ``numpy.dtype``,                         :class:`NdarrayRecord`,
``numpy[._]core.multiarray._reconstruct`` / ``.scalar``    :class:`DtypeRecord`,
(``np_rng_state``, numpy numbers in metrics)                :class:`ScalarRecord`: numpy objects
                                                            when numpy is installed, else a
                                                            tensor / Python number
``builtins.bytes`` (how protocol 2 writes ``b""``)          ``b""`` only
=========================================================  ===================================

Records only store what the pickle gave them, after checking its shape; they have no behaviour
a pickle can reach (no ``__init__`` side effects, attributes kept apart from the record's own).
Every record made while a file is read is counted (:func:`reading`), so the loader can refuse a
file that hides one where a checkpoint never holds one (a dict key, a set, a tensor attribute).

numpy arrays (``ndarray.__reduce__``, protocol 2)::

    _reconstruct(ndarray, (0,), b"b")  -> empty array;  BUILD (1, shape, dtype, is_fortran, raw bytes)
    dtype("u4", False, True)           -> dtype;        BUILD (3, "<", None, None, None, -1, -1, 0)
    scalar(dtype, raw bytes)           -> one number
"""

from __future__ import annotations

import argparse
import array
import contextlib
import math
import pickle
import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch

APEX_SCALER_CLASSES = (
    "apex.fp16_utils.loss_scaler.LossScaler",
    "apex.fp16_utils.loss_scaler.DynamicLossScaler",
    "apex.amp.scaler.LossScaler",
)
#: Megatron-LM v1's scalers (``megatron/fp16`` 2019-10 -> 2020-12, and ``fp16/`` before that, as
#: copied into GLM, sentiment-discovery and other forks): docs/apex-others.md §2.3.
MEGATRON_SCALER_CLASSES = (
    "megatron.fp16.loss_scaler.LossScaler",
    "megatron.fp16.loss_scaler.DynamicLossScaler",
    "fp16.loss_scaler.LossScaler",
    "fp16.loss_scaler.DynamicLossScaler",
)
SCALER_CLASSES = APEX_SCALER_CLASSES + MEGATRON_SCALER_CLASSES
#: fp16kit's classes at the paths fp16kit's apex alias (``fp16kit run``) maps those to -> the
#: class each stands for. ``pickle`` (``torch.load(..., weights_only=False)``) under the alias
#: makes one of these of an apex or Megatron scaler; each pickles apex's (Megatron's) attributes,
#: so a file that saved one again reads as if it held the original.
FP16KIT_SCALER_CLASSES = {
    "fp16kit.legacy.loss_scaler.LossScaler": "apex.fp16_utils.loss_scaler.LossScaler",
    "fp16kit.legacy.loss_scaler.DynamicLossScaler": "apex.fp16_utils.loss_scaler.DynamicLossScaler",
    "fp16kit.legacy.amp.scaler.LossScaler": "apex.amp.scaler.LossScaler",
    "fp16kit.legacy.megatron.loss_scaler.LossScaler": "megatron.fp16.loss_scaler.LossScaler",
    "fp16kit.legacy.megatron.loss_scaler.DynamicLossScaler": "megatron.fp16.loss_scaler.DynamicLossScaler",
}
CLASS_KEY = "__apex_class__"


def saved_scaler(obj: Any) -> dict[str, Any] | None:
    """What :func:`fp16kit.legacy.load_checkpoint` makes of a pickled apex or Megatron scaler.

    That is ``{CLASS_KEY: path, attributes...}``, here made for a live object of one of
    :data:`FP16KIT_SCALER_CLASSES` (e.g. what ``torch.load(..., weights_only=False)`` returned
    under ``fp16kit run``); None for anything else. The object is only read. ValueError if it
    holds none of its attributes: a pickle may build one without its state (NEWOBJ with no
    BUILD), which its validating ``__setstate__`` then never saw."""
    cls = type(obj)
    path = FP16KIT_SCALER_CLASSES.get(f"{cls.__module__}.{cls.__qualname__}")
    if path is None:
        return None
    try:
        state = obj.__getstate__()
    except AttributeError:
        state = None
    if not isinstance(state, dict) or not state:
        raise ValueError(
            f"the {path} in this file holds no attributes (it was unpickled without its state): it is "
            "not one apex pickled. To see what the file holds without running it, read it with "
            "fp16kit.legacy.load_checkpoint(path), which returns each scaler's attributes as plain data."
        )
    return {**state, CLASS_KEY: path}


_LOADING = threading.local()


@contextlib.contextmanager
def reading() -> Iterator[list[Record]]:
    """While a file is unpickled: the list every new record is appended to."""
    made: list[Record] = []
    outer = getattr(_LOADING, "made", None)
    _LOADING.made = made
    try:
        yield made
    finally:
        _LOADING.made = outer


class Record:
    """Base of the stand-ins: counted when made (see :func:`reading`)."""

    _path = ""

    def __new__(cls, *args: Any, **kwargs: Any) -> Record:
        self = object.__new__(cls)
        made = getattr(_LOADING, "made", None)
        if made is not None:
            made.append(self)
        return self

    def _refuse(self, what: str) -> pickle.UnpicklingError:
        return pickle.UnpicklingError(f"{self._path} in this file is not what that class pickles: {what}.")


def _attribute_dict(record: Record, state: Any) -> dict[str, Any]:
    if isinstance(state, tuple) and len(state) == 2 and all(s is None or isinstance(s, dict) for s in state):
        state = {**(state[0] or {}), **(state[1] or {})}  # (__dict__, __slots__)
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise record._refuse(f"expected a dict of attributes, got {type(state).__name__}")
    return dict(state)


class _AttributeRecord(Record):
    """Made by NEWOBJ (no arguments) and given its attributes by BUILD, as protocol 2 pickles
    an object; a constructor call with arguments (a crafted REDUCE) is refused."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if args or kwargs:
            raise self._refuse("it is pickled without constructor arguments")

    def __setstate__(self, state: Any) -> None:
        object.__setattr__(self, "_attrs", _attribute_dict(self, state))

    @property
    def attributes(self) -> dict[str, Any]:
        return self.__dict__.get("_attrs", {})


class ScalerRecord(_AttributeRecord):
    """An apex or Megatron loss scaler: its attributes, exactly as pickled.

    ``reads_as`` is the class it stands for (its own path, or for one of fp16kit's classes
    the apex one)."""

    reads_as = ""


class NamespaceRecord(_AttributeRecord):
    """``argparse.Namespace``: an attribute bag (Megatron's ``args``)."""

    _path = "argparse.Namespace"


def namespace(attributes: dict[str, Any]) -> argparse.Namespace:
    ns = argparse.Namespace()
    ns.__dict__.update(attributes)  # not setattr: a key such as "__class__" stays plain data
    return ns


def _stand_in(base: type, path: str, **attrs: Any) -> type:
    module, name = path.rsplit(".", 1)
    # torch's unpickler finds allowed globals by "{__module__}.{__qualname__}".
    return type(name, (base,), {"__module__": module, "__qualname__": name, "_path": path, **attrs})


SCALER_RECORDS = {
    **{path: _stand_in(ScalerRecord, path, reads_as=path) for path in SCALER_CLASSES},
    **{path: _stand_in(ScalerRecord, path, reads_as=apex) for path, apex in FP16KIT_SCALER_CLASSES.items()},
}
NAMESPACE_RECORD = _stand_in(NamespaceRecord, "argparse.Namespace")

# ---------------------------------------------------------------------------------- numpy

# numpy kind + item size -> torch dtype (what an array becomes without numpy)
_TORCH_DTYPES = {
    ("b", 1): torch.bool,
    ("i", 1): torch.int8,
    ("i", 2): torch.int16,
    ("i", 4): torch.int32,
    ("i", 8): torch.int64,
    ("u", 1): torch.uint8,
    ("u", 2): torch.uint16,
    ("u", 4): torch.uint32,
    ("u", 8): torch.uint64,
    ("f", 2): torch.float16,
    ("f", 4): torch.float32,
    ("f", 8): torch.float64,
    ("c", 8): torch.complex64,
    ("c", 16): torch.complex128,
}
_KINDS = "biufcSU"  # numbers (a tensor without numpy), bytes and text (lists without numpy)
_ARRAY_SWAP_CODES = {2: "H", 4: "I" if array.array("I").itemsize == 4 else "L", 8: "Q"}
_LITTLE = sys.byteorder == "little"


class DtypeRecord(Record):
    """A pickled simple ``numpy.dtype``.

    ``numpy.dtype(obj, align, copy)`` then ``BUILD (version, byteorder, subarray, names,
    fields, elsize, alignment, flags[, metadata])``. Simple dtypes only: a kind in "biufcSU",
    no fields, no sub-array."""

    _path = "numpy.dtype"

    def __init__(self, obj: Any = None, align: Any = False, copy: Any = True) -> None:
        if not isinstance(obj, str) or len(obj) < 2 or obj[0] not in _KINDS or not obj[1:].isdigit():
            raise self._refuse(f"dtype {obj!r} is not a number, bytes or text type")
        self.kind, self.itemsize = obj[0], int(obj[1:])
        if self.kind == "U":
            self.itemsize *= 4  # "U3": 3 UCS-4 characters
        if self.itemsize <= 0 or (self.kind in "biufc" and (self.kind, self.itemsize) not in _TORCH_DTYPES):
            raise self._refuse(f"dtype {obj!r} has no counterpart in torch")
        self.byteorder = "="

    def __setstate__(self, state: Any) -> None:
        if not (isinstance(state, tuple) and len(state) in (8, 9) and state[0] in (3, 4)):
            raise self._refuse(f"unexpected dtype state {state!r:.80}")
        if state[1] not in ("<", ">", "=", "|") or any(s is not None for s in state[2:5]):
            raise self._refuse("only plain dtypes (no fields, no sub-arrays) are read")
        if len(state) == 9 and state[8] is not None:
            raise self._refuse("dtypes with metadata are not read")
        self.byteorder = state[1]

    @property
    def str(self) -> str:
        """numpy's ``dtype.str`` (e.g. ``"<u4"``)."""
        order = "|" if self.itemsize == 1 or self.kind in "bS" else self.byteorder
        if order == "=":
            order = "<" if _LITTLE else ">"
        size = self.itemsize // 4 if self.kind == "U" else self.itemsize
        return f"{order}{self.kind}{size}"

    def swapped(self) -> bool:
        """Whether the raw bytes are in the other byte order than this machine's."""
        return self.str[0] == (">" if _LITTLE else "<") and self.kind != "S"


class NdarrayRecord(Record):
    """``numpy.ndarray``, as ``_reconstruct`` and ``BUILD`` hand it over."""

    _path = "numpy.ndarray"

    def __setstate__(self, state: Any) -> None:
        if not (isinstance(state, tuple) and len(state) == 5):
            raise self._refuse(f"unexpected array state of type {type(state).__name__}")
        _version, shape, dtype, fortran, raw = state
        if not (isinstance(shape, tuple) and all(type(n) is int and n >= 0 for n in shape)):
            raise self._refuse(f"bad array shape {shape!r:.80}")
        if (
            isinstance(dtype, DtypeRecord)
            and "kind" in dtype.__dict__
            and (math.prod(n for n in shape if n) * dtype.itemsize >= 2**63)
        ):
            # numpy's limit, zeros left out: an empty array's strides still multiply the others
            raise self._refuse(f"bad array shape {shape!r:.80}: no array has dimensions that large")
        if not (isinstance(dtype, DtypeRecord) and "kind" in dtype.__dict__ and isinstance(fortran, bool)):
            raise self._refuse("bad array dtype or order")
        if not isinstance(raw, bytes) or len(raw) != math.prod(shape) * dtype.itemsize:
            raise self._refuse(f"{math.prod(shape)} items of {dtype.itemsize} bytes, got raw data of another size")
        self.shape, self.dtype, self.fortran, self.raw = shape, dtype, fortran, raw


class ScalarRecord(Record):
    """A numpy number (``numpy.core.multiarray.scalar(dtype, raw bytes)``)."""

    _path = "numpy.core.multiarray.scalar"
    # set by _scalar; annotated only, so a record unpickled without them has neither in __dict__
    dtype: DtypeRecord
    raw: bytes


def _reconstruct(cls: Any, shape: Any, typecode: Any) -> NdarrayRecord:
    if cls is not NDARRAY_RECORD:
        raise pickle.UnpicklingError(f"numpy's _reconstruct is only read for numpy.ndarray, not {cls!r:.80}")
    return NDARRAY_RECORD()


def _scalar(dtype: Any, raw: Any) -> ScalarRecord:
    if not (
        isinstance(dtype, DtypeRecord)
        and "kind" in dtype.__dict__
        and isinstance(raw, bytes)
        and len(raw) == dtype.itemsize
    ):
        raise pickle.UnpicklingError("a numpy scalar is read only with a plain dtype and its raw bytes")
    record = ScalarRecord()
    record.dtype, record.raw = dtype, raw
    return record


def _empty_bytes(*args: Any) -> bytes:
    """``bytes()``: how protocol 2 pickles ``b""`` (an empty array's data). Nothing else."""
    if args:
        raise pickle.UnpicklingError("bytes(...) is only read without arguments (b'')")
    return b""


def _function(fn: Any, path: str) -> Any:
    def stand_in(*args: Any) -> Any:
        return fn(*args)

    stand_in.__module__, stand_in.__qualname__ = path.rsplit(".", 1)
    stand_in.__name__ = stand_in.__qualname__
    return stand_in


NDARRAY_RECORD = _stand_in(NdarrayRecord, "numpy.ndarray")
DTYPE_RECORD = _stand_in(DtypeRecord, "numpy.dtype")
NUMPY_RECORDS = (NdarrayRecord, DtypeRecord, ScalarRecord)

#: Everything :func:`fp16kit.legacy.load_checkpoint` allows beyond ``torch.load(weights_only=True)``.
SAFE_GLOBALS = [
    *SCALER_RECORDS.values(),
    NAMESPACE_RECORD,
    NDARRAY_RECORD,
    DTYPE_RECORD,
    *(_function(_reconstruct, f"numpy.{core}.multiarray._reconstruct") for core in ("core", "_core")),
    *(_function(_scalar, f"numpy.{core}.multiarray.scalar") for core in ("core", "_core")),
    _function(_empty_bytes, "builtins.bytes"),
]


def _numpy() -> Any:
    """numpy if it is installed (imported only then: it is not a dependency)."""
    try:
        import numpy
    except ImportError:
        return None
    return numpy if hasattr(numpy, "frombuffer") else None  # not a stand-in module of that name


def numpy_available() -> bool:
    return _numpy() is not None


def _native_bytes(raw: bytes, dtype: DtypeRecord) -> bytes:
    if not dtype.swapped() or dtype.itemsize == 1:
        return raw
    # complex: each half swaps on its own; text: each UCS-4 character
    part = dtype.itemsize // 2 if dtype.kind == "c" else 4 if dtype.kind == "U" else dtype.itemsize
    items = array.array(_ARRAY_SWAP_CODES[part], raw)
    items.byteswap()
    return items.tobytes()


def _plain_array(shape: tuple[int, ...], dtype: DtypeRecord, raw: bytes, fortran: bool) -> Any:
    """An array's values without numpy: a tensor of the same dtype and shape (numbers), or
    nested lists of ``bytes``/``str`` (``S``/``U``)."""
    data = _native_bytes(raw, dtype)
    dims = shape[::-1] if fortran else shape
    if dtype.kind in "SU":
        if fortran and len(dims) > 1:
            raise pickle.UnpicklingError("a Fortran-ordered text array is read only with numpy installed")
        n = dtype.itemsize
        items: list[Any] = [data[i : i + n] for i in range(0, len(data), n)]
        if dtype.kind == "U":
            items = [it.decode("utf-32-le" if _LITTLE else "utf-32-be").rstrip("\0") for it in items]
        else:
            items = [it.rstrip(b"\0") for it in items]
        return _nested(items, dims) if dims else items[0]
    tdtype = _TORCH_DTYPES[(dtype.kind, dtype.itemsize)]
    if not data:
        t = torch.empty(dims, dtype=tdtype)
    else:
        t = torch.frombuffer(bytearray(data), dtype=tdtype).reshape(dims)
    if fortran:
        t = t.permute(*reversed(range(t.dim()))).contiguous()
    return t


#: The most lists a text array may need beyond one per item (an empty array of shape
#: (2**40, 0) holds no item but would be 2**40 empty lists, as numpy's tolist() makes them).
MAX_EMPTY_LISTS = 2**20


def _nested(items: list[Any], dims: tuple[int, ...]) -> list[Any]:
    """``items`` (C order) as nested lists of shape ``dims``, as numpy's ``tolist()`` (a zero
    dimension gives empty lists: (2, 0) -> [[], []])."""
    counts = [1]  # counts[k] = prod(dims[:k]): how many lists hold dims[k] items each
    for d in dims[:-1]:
        counts.append(counts[-1] * d)
    lists = sum(counts[1:])
    if lists > len(items) + MAX_EMPTY_LISTS:
        raise pickle.UnpicklingError(
            f"a numpy text array of shape {dims!r:.80} would be {lists:,} nested lists for {len(items)} "
            "items; read it with numpy installed"
        )
    level: list[Any] = items
    for k in range(len(dims) - 1, 0, -1):  # innermost first: prod(dims[:k]) lists of dims[k]
        d = dims[k]
        level = [level[i * d : (i + 1) * d] for i in range(counts[k])]
    return level


def _numpy_dtype(np: Any, dtype: DtypeRecord) -> Any:
    return np.dtype(dtype.str)


def decode(record: Record, *, plain: bool) -> Any:
    """A numpy record's value, as a numpy object or as plain data.

    A numpy record's value: a numpy object when numpy is installed and ``plain`` is False;
    otherwise a tensor (arrays of numbers), a Python number (scalars), nested lists (text
    arrays) or numpy's ``dtype.str`` (a dtype)."""
    np = None if plain else _numpy()
    if isinstance(record, DtypeRecord) and "kind" in record.__dict__:
        return record.str if np is None else _numpy_dtype(np, record)
    if isinstance(record, ScalarRecord) and "dtype" in record.__dict__:
        if np is not None:
            return np.frombuffer(record.raw, dtype=_numpy_dtype(np, record.dtype))[0]
        value = _plain_array((), record.dtype, record.raw, False)
        return value.item() if isinstance(value, torch.Tensor) else value
    if isinstance(record, NdarrayRecord) and "raw" in record.__dict__:
        if np is not None:
            flat = np.frombuffer(record.raw, dtype=_numpy_dtype(np, record.dtype))
            return np.array(flat.reshape(record.shape, order="F" if record.fortran else "C"), copy=True)
        return _plain_array(record.shape, record.dtype, record.raw, record.fortran)
    raise record._refuse("the object was never given its data")


def describe(record: Record) -> str:
    """e.g. ``numpy.ndarray <u4 (624,)``, for reports."""
    if isinstance(record, NdarrayRecord) and "raw" in record.__dict__:
        return f"numpy.ndarray {record.dtype.str} {record.shape}"
    if isinstance(record, ScalarRecord) and "dtype" in record.__dict__:
        return f"numpy scalar {record.dtype.str}"
    return record._path
