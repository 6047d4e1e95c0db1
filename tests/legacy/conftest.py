"""Fixtures shared by the legacy checkpoint tests (test_checkpoint_load.py,
test_checkpoint_resume.py): ``fake_apex`` (apex's scaler classes under apex's module paths) and
``save`` (``torch.save`` returning the path).

pytest runs with ``--import-mode=importlib``: test modules cannot import each other or this file,
so what they share is handed to them as fixtures.
"""

from __future__ import annotations

import pathlib
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

    def era2(self, loss_scale=2.0**16, *, dynamic=True, window=2000, unskipped=0, min_loss_scale=None,
             max_loss_scale=2.0**24):
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
