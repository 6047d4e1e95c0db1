"""fp16kit.bench.machine: the header's facts and the load warning."""

from __future__ import annotations

import torch

from fp16kit.bench import machine


def test_load_warning_only_above_the_core_count():
    assert machine.load_warning((1.9, 5.0, 5.0), 2) is None
    assert machine.load_warning((2.0, 0.0, 0.0), 2) is None
    assert machine.load_warning(None, 2) is None
    warning = machine.load_warning((2.5, 1.0, 1.0), 2)
    assert warning is not None and "2.50" in warning and "unreliable" in warning


def test_describe_names_the_machine():
    info = machine.describe(3, ["cpu"])
    assert info["torch"] == torch.__version__
    assert info["torch_threads"] == 3
    assert info["cores"] >= 1 and info["cpu"]
    assert "gpu" not in info


def test_oversubscribed_note_between_quiet_and_overloaded():
    assert machine.oversubscribed_note((0.1, 0, 0), 2, 2) is None  # quiet
    assert machine.oversubscribed_note((1.0, 0, 0), 2, 1) is None  # one busy core, one thread
    note = machine.oversubscribed_note((1.0, 0, 0), 2, 2)
    assert note is not None and "--threads 1" in note
    assert machine.oversubscribed_note((3.0, 0, 0), 2, 2) is None  # load_warning's case
