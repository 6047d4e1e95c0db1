"""The step-state machine: its table is the whole truth, and the docstring states it."""

from __future__ import annotations

import pytest
import torch

from fp16kit.master_weights import step_state
from fp16kit.master_weights.step_state import TRANSITIONS, Stage, StepState

EVENTS = {
    "reset": lambda s: s.reset(),
    "handed_off": lambda s: s.handed_off(),
    "checked": lambda s: s.checked({}, prepared=("plan",), verdict=False),
    "unscaled": lambda s: s.unscaled({}, by_scaler=True),
    "skip_decided": lambda s: s.skip_decided(),
    "stepped": lambda s: s.stepped(),
    "submitted": lambda s: s.submitted(),
}

# a path from MODEL_GRADS to each stage, through legal events only
PATHS = {
    Stage.MODEL_GRADS: [],
    Stage.HANDED_OFF: ["handed_off"],
    Stage.CHECKED: ["checked"],
    Stage.UNSCALED: ["unscaled"],
    Stage.SKIP_DECIDED: ["unscaled", "skip_decided"],
    Stage.STEPPED: ["unscaled", "stepped"],
}


def _in(stage: Stage) -> StepState:
    s = StepState()
    for event in PATHS[stage]:
        EVENTS[event](s)
    assert s.stage is stage
    return s


def test_every_event_names_an_event_method():
    assert set(TRANSITIONS) == set(EVENTS)


@pytest.mark.parametrize("stage", list(Stage))
@pytest.mark.parametrize("event", sorted(TRANSITIONS))
def test_each_edge_moves_as_the_table_says_and_no_other_edge_exists(event, stage):
    s = _in(stage)
    to = TRANSITIONS[event].get(stage)
    if to is None:
        with pytest.raises(
            RuntimeError, match=rf"^internal: step-state event '{event}' is not allowed in stage {stage.name}"
        ):
            EVENTS[event](s)
        assert s.stage is stage  # an illegal edge changes nothing
    else:
        EVENTS[event](s)
        assert s.stage is to


def _docstring_table() -> dict[str, dict[Stage, Stage]]:
    doc = step_state.__doc__
    assert doc is not None
    rows = doc.split("---------------  ", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
    table: dict[str, dict[Stage, Stage]] = {}
    event = ""
    for row in rows:
        # columns: event (blank: the one above), from stages, to stage
        event = row[4:21].strip() or event
        froms = [x.strip() for x in row[21:75].split(",")]
        stages = list(Stage) if froms == ["any"] else [Stage[x] for x in froms]
        table.setdefault(event, {}).update(dict.fromkeys(stages, Stage[row[75:].strip()]))
    return table


def test_the_docstring_table_is_the_transition_table():
    assert _docstring_table() == TRANSITIONS


def test_stepped_keeps_the_grads_and_flags_but_no_scaler_decision():
    s = StepState()
    flags = {torch.device("cpu"): torch.zeros(())}
    s.unscaled(flags, by_scaler=True)
    s.skip_decided()
    s.stepped()
    assert s.in_masters and s.spent and not s.by_scaler and s.flags is flags and not s.read_since_step


def test_the_verdict_is_read_from_the_device_once_and_outlives_the_stage():
    s = StepState()
    s.checked({}, prepared=None, verdict=torch.tensor(1.0) != 0)
    assert s.read_since_step and s.verdict is True
    assert s._verdict is True  # cached as a Python bool: no second host read
    s.submitted()
    s.reset(cleared="zero")
    assert s.verdict is True and s.cleared == "zero" and s.prepared is None


def test_submitted_ends_the_step_what_it_prepared_and_how_grads_were_cleared():
    s = StepState()
    s.reset(cleared="none")
    s.checked({torch.device("cpu"): torch.zeros(())}, prepared=("inv", "found", None), verdict=False)
    assert s.cleared == "none" and s.prepared == ("inv", "found", None)
    s.submitted()
    assert s.stage is Stage.STEPPED and s.prepared is None and s.cleared is None and s.flags == {}
