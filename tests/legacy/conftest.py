"""Fixtures shared by the legacy checkpoint tests (test_checkpoint_*.py): ``fake_apex`` (apex's
scaler classes under apex's module paths), ``save`` (``torch.save`` returning the path),
``stand_ins`` (classes under any module path: Megatron's, numpy's, torch.nn subclasses'),
``megatron`` (Megatron's DynamicLossScaler objects), ``fake_numpy`` (numpy's pickle format
without numpy) and ``save_on`` (``torch.save`` recording storages as saved on ``cuda:0``).

pytest runs with ``--import-mode=importlib``: test modules cannot import each other or this file,
so what they share is handed to them as fixtures.
"""

from __future__ import annotations

import pathlib
import struct
import sys
import types

import pytest
import torch


def _save(obj, path) -> pathlib.Path:
    torch.save(obj, path)
    return pathlib.Path(path)


@pytest.fixture
def save():
    """``save(obj, path)``: ``torch.save(obj, path)``, returning ``path`` as a ``pathlib.Path``."""
    return _save


# ---------------------------------------------------------------------------- fake apex

APEX_MODULES = ("apex", "apex.fp16_utils", "apex.fp16_utils.loss_scaler", "apex.amp", "apex.amp.scaler")


class FakeApex:
    """Stand-ins for apex's three scaler classes, registered under apex's module paths so
    that ``torch.save`` pickles them by those names (as apex-era checkpoints do)."""

    def __init__(self) -> None:
        self.modules = {name: types.ModuleType(name) for name in APEX_MODULES}
        for name, mod in self.modules.items():
            if "." in name:
                parent, child = name.rsplit(".", 1)
                setattr(self.modules[parent], child, mod)
        self.Era1LossScaler = self.add_class("apex.fp16_utils.loss_scaler", "LossScaler")
        self.Era1DynamicLossScaler = self.add_class("apex.fp16_utils.loss_scaler", "DynamicLossScaler")
        self.AmpLossScaler = self.add_class("apex.amp.scaler", "LossScaler")
        self._prior: dict = {}
        self.installed = False

    def add_class(self, module: str, name: str, namespace: dict | None = None) -> type:
        cls = type(name, (), {**(namespace or {}), "__module__": module, "__qualname__": name})
        setattr(self.modules[module], name, cls)
        return cls

    def install(self) -> None:
        self._prior = {n: sys.modules[n] for n in APEX_MODULES if n in sys.modules}
        sys.modules.update(self.modules)
        self.installed = True

    def remove(self) -> None:
        for name, mod in self.modules.items():
            if sys.modules.get(name) is mod:
                del sys.modules[name]
        sys.modules.update(self._prior)
        self._prior = {}
        self.installed = False

    # apex's attribute sets, in the order apex's __init__ assigned them
    def era1_static(self, cur_scale=1):
        o = self.Era1LossScaler()
        o.cur_scale = cur_scale
        return o

    def era1_dynamic(self, cur_scale=2**32, cur_iter=0, last_overflow_iter=-1, scale_factor=2.0, scale_window=1000):
        o = self.Era1DynamicLossScaler()
        o.cur_scale = cur_scale
        o.cur_iter = cur_iter
        o.last_overflow_iter = last_overflow_iter
        o.scale_factor = scale_factor
        o.scale_window = scale_window
        return o

    def era2(
        self, loss_scale=2.0**16, *, dynamic=True, window=2000, unskipped=0, min_loss_scale=None, max_loss_scale=2.0**24
    ):
        o = self.AmpLossScaler()
        o.dynamic = dynamic
        o._loss_scale = loss_scale
        o._max_loss_scale = max_loss_scale
        o._min_loss_scale = min_loss_scale
        o._scale_seq_len = window
        o._unskipped = unskipped
        o._has_overflow = False
        o._overflow_buf = torch.IntTensor([0])
        return o


@pytest.fixture
def fake_apex():
    apex = FakeApex()
    apex.install()
    try:
        yield apex
    finally:
        apex.remove()
    assert all(sys.modules.get(n) is not m for n, m in apex.modules.items())


# ------------------------------------------------------------------- other stand-in modules


class StandIns:
    """Classes registered under any module path (parents created), removed afterwards: what
    Megatron-LM, its forks and other libraries pickled, without those libraries."""

    def __init__(self) -> None:
        self.modules: dict[str, types.ModuleType] = {}
        self._prior: dict = {}

    def module(self, name: str) -> types.ModuleType:
        if name not in self.modules:
            if name in sys.modules and name not in self._prior:
                self._prior[name] = sys.modules[name]
            mod = self.modules[name] = types.ModuleType(name)
            sys.modules[name] = mod
            if "." in name:
                parent, child = name.rsplit(".", 1)
                setattr(self.module(parent), child, mod)
        return self.modules[name]

    def add(self, path: str, obj=None, namespace: dict | None = None, bases: tuple = ()):
        """Register ``obj`` (default: a new class) as ``path``; returns it."""
        module, name = path.rsplit(".", 1)
        if obj is None:
            obj = type(name, bases or (object,), {**(namespace or {})})
        obj.__module__, obj.__qualname__ = module, name
        if hasattr(obj, "__name__"):
            obj.__name__ = name
        setattr(self.module(module), name, obj)
        return obj

    def remove(self) -> None:
        for name, mod in self.modules.items():
            if sys.modules.get(name) is mod:
                del sys.modules[name]
        sys.modules.update(self._prior)
        self.modules, self._prior = {}, {}


@pytest.fixture
def stand_ins():
    s = StandIns()
    try:
        yield s
    finally:
        s.remove()


def megatron_scaler(stand_ins: StandIns, module: str = "megatron.fp16.loss_scaler", **attrs):
    """A Megatron ``DynamicLossScaler`` with docs/apex-others.md §2.3's attributes (``attrs`` override; pass
    ``None`` to leave one out, as older code pickled)."""
    cls = getattr(stand_ins.modules.get(module), "DynamicLossScaler", None)
    cls = cls or stand_ins.add(f"{module}.DynamicLossScaler")
    defaults = dict(
        cur_scale=2**32,
        cur_iter=0,
        last_overflow_iter=-1,
        scale_factor=2.0,
        scale_window=1000,
        min_scale=1,
        delayed_shift=2,
        cur_hysteresis=2,
        consecutive_hysteresis=False,
    )
    o = cls()
    for k, v in {**defaults, **attrs}.items():
        if v is not None:
            setattr(o, k, v)
    return o


@pytest.fixture
def megatron(stand_ins):
    """``megatron(**attrs)``: a Megatron DynamicLossScaler object (see :func:`megatron_scaler`)."""
    return lambda module="megatron.fp16.loss_scaler", **attrs: megatron_scaler(stand_ins, module, **attrs)


# --------------------------------------------------------------------------------- numpy

# (kind, item size) -> struct format character (numpy's raw data is these, packed)
_STRUCT = {
    ("b", 1): "?",
    ("i", 1): "b",
    ("u", 1): "B",
    ("i", 2): "h",
    ("u", 2): "H",
    ("i", 4): "i",
    ("u", 4): "I",
    ("i", 8): "q",
    ("u", 8): "Q",
    ("f", 2): "e",
    ("f", 4): "f",
    ("f", 8): "d",
}


class FakeNumpy:
    """numpy's pickle format without numpy: ``ndarray``, ``dtype`` and ``multiarray.scalar``
    objects whose ``__reduce__`` return what numpy's do (docs/apex-others.md §6; checked byte for byte against
    a pickle numpy 2.4 wrote in test_checkpoint_formats.py). ``core`` is "core" (numpy 1.x) or
    "_core" (numpy 2)."""

    def __init__(self, stand_ins: StandIns, core: str = "_core") -> None:
        multiarray = f"numpy.{core}.multiarray"
        fake = self

        class dtype:
            def __init__(self, typestr: str) -> None:  # e.g. "<u4", "|b1", ">f8"
                self.typestr = typestr

            def __reduce__(self):
                return (type(self), (self.typestr[1:], False, True), (3, self.typestr[0], None, None, None, -1, -1, 0))

        class ndarray:
            def __init__(self, shape, typestr, raw, fortran=False) -> None:
                self.args = (1, tuple(shape), dtype(typestr), fortran, raw)

            def __reduce__(self):
                return (fake._reconstruct, (type(self), (0,), b"b"), self.args)

        class Scalar:
            def __init__(self, typestr, raw) -> None:
                self.args = (dtype(typestr), raw)

            def __reduce__(self):
                return (fake.scalar_fn, self.args)

        def _reconstruct(*args):
            raise AssertionError("only pickled here")

        def scalar(*args):
            raise AssertionError("only pickled here")

        self.dtype = stand_ins.add("numpy.dtype", dtype)
        self.ndarray = stand_ins.add("numpy.ndarray", ndarray)
        self._reconstruct = stand_ins.add(f"{multiarray}._reconstruct", _reconstruct)
        self.scalar_fn = stand_ins.add(f"{multiarray}.scalar", scalar)
        self.Scalar = Scalar

    @staticmethod
    def pack(values, typestr: str) -> bytes:
        order, kind, size = typestr[0], typestr[1], int(typestr[2:])
        if kind == "c":
            fmt = {8: "f", 16: "d"}[size]
            flat = [part for v in values for part in (v.real, v.imag)]
            return struct.pack(f"{'>' if order == '>' else '<'}{len(flat)}{fmt}", *flat)
        return struct.pack(f"{'>' if order == '>' else '<'}{len(values)}{_STRUCT[(kind, size)]}", *values)

    def array(self, values, typestr: str, shape=None, fortran=False):
        """An array of the flat ``values`` (in memory order: Fortran order when ``fortran``)."""
        return self.ndarray(
            shape if shape is not None else (len(values),), typestr, self.pack(values, typestr), fortran
        )

    def scalar(self, value, typestr: str):
        return self.Scalar(typestr, self.pack([value], typestr))

    def rng_state(self, key, pos=624, has_gauss=0, cached=0.0):
        """``np.random.get_state()``: ('MT19937', uint32[624], pos, has_gauss, cached_gaussian)."""
        return ("MT19937", self.array(key, "<u4"), pos, has_gauss, cached)


@pytest.fixture(params=["_core", "core"])
def fake_numpy(request, stand_ins):
    """numpy 2's (``numpy._core``) and numpy 1's (``numpy.core``) pickles, numpy not needed."""
    return FakeNumpy(stand_ins, request.param)


# ----------------------------------------------------------------------- device locations


@pytest.fixture
def save_on():
    """``save_on(obj, path, location="cuda:0", legacy=False)``: ``torch.save`` recording every
    storage under ``location`` -- what a file saved from a GPU holds (no GPU needed)."""
    from unittest import mock

    def save(obj, path, location="cuda:0", legacy=False):
        with mock.patch("torch.serialization.location_tag", lambda storage: location):
            torch.save(obj, path, _use_new_zipfile_serialization=not legacy)
        return pathlib.Path(path)

    return save


@pytest.fixture
def fake_numpy_2(stand_ins):
    """numpy 2's pickles only (``numpy._core``)."""
    return FakeNumpy(stand_ins, "_core")
