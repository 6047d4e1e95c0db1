"""apex's printed lines (fp16kit/legacy/_messages.py): on stdout, apex's text, through the
``fp16kit.apex`` logger, which never reaches the script's own logging.

The pattern that broke: NVIDIA DeepLearningExamples' GNMT ``setup_logging`` puts a ``RankFilter``
(``record.rank = rank``) on the ROOT LOGGER and formats its handlers with ``%(rank)s``. A logger's
filter sees only records logged on that logger, so every line that came up from the ``fp16kit``
logger reached those handlers without ``rank``: "--- Logging error ---" on stderr, the line lost.
"""

from __future__ import annotations

import contextlib
import io
import logging

import pytest
import torch
from torch import nn

from fp16kit.legacy import FP16_Optimizer, amp
from fp16kit.legacy._messages import APEX_LOGGER, CurrentStdoutHandler
from fp16kit.legacy.amp import casts
from fp16kit.legacy.amp._amp_state import _amp_state
from fp16kit.legacy.contrib.optimizers import FP16_Optimizer as FusedEraFP16_Optimizer
from fp16kit.legacy.contrib.optimizers import FusedAdam
from fp16kit.legacy.megatron import FP16_Module
from fp16kit.legacy.megatron import FP16_Optimizer as MegatronFP16_Optimizer

_O2_OPTIONS = [
    "enabled                : True",
    "opt_level              : O2",
    "cast_model_type        : torch.float16",
    "patch_torch_functions  : False",
    "keep_batchnorm_fp32    : True",
    "master_weights         : True",
    "loss_scale             : dynamic",
]
BANNER_O2 = [  # the options twice: the level's defaults, then after the (here: no) overrides
    "Selected optimization level O2:  FP16 training with FP32 batchnorm and FP32 master weights.",
    "",
    "Defaults for this optimization level are:",
    *_O2_OPTIONS,
    "Processing user overrides (additional kwargs that are not None)...",
    "After processing overrides, optimization options are:",
    *_O2_OPTIONS,
]


@pytest.fixture
def apex_log():
    """The ``fp16kit.apex`` logger, put back as fp16kit set it up after the test."""
    log = logging.getLogger(APEX_LOGGER)
    saved = (list(log.handlers), log.propagate, log.level, log.disabled, list(log.filters))
    yield log
    log.handlers[:], log.propagate, log.level, log.disabled, log.filters[:] = saved


class RankFilter(logging.Filter):
    """GNMT's (DeepLearningExamples, seq2seq/utils.py)."""

    def __init__(self, rank, log_all_ranks=True):
        self.rank = rank
        self.log_all_ranks = log_all_ranks

    def filter(self, record):
        record.rank = self.rank
        return True if self.log_all_ranks else self.rank == 0


@pytest.fixture(params=["root logger", "root handler"])
def dle_logging(request):
    """The script's logging, DeepLearningExamples style: a root handler formatted with
    ``%(rank)s``, the RankFilter on the root logger (GNMT) or on the handler. Yields the
    handler's stream (what the script's log holds)."""
    root = logging.getLogger()
    saved = (list(root.handlers), list(root.filters), root.level)
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(asctime)s - %(levelname)s - %(rank)s - %(message)s"))
    root.handlers[:] = [handler]
    (root if request.param == "root logger" else handler).addFilter(RankFilter(0))
    root.setLevel(logging.DEBUG)
    try:
        yield stream
    finally:
        root.handlers[:], root.filters[:] = saved[0], saved[1]
        root.setLevel(saved[2])


def _script_logs(stream):
    return [line.split(" - ", 1)[1] for line in stream.getvalue().splitlines()]


# ------------------------------------------------------------------- one overflow per face


def _fp16_utils():
    torch.manual_seed(0)
    model = nn.Linear(4, 2).half()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True)  # verbose=True
    opt.backward(model(torch.randn(3, 4).half()).float().sum() * float("inf"))
    opt.step()
    return [
        "FP16_Optimizer processing param group 0:",
        "FP16_Optimizer received torch.HalfTensor with torch.Size([2, 4])",
        "FP16_Optimizer received torch.HalfTensor with torch.Size([2])",
        "Gradient overflow.  Skipping step, reducing loss scale to 32768.0",
    ]


def _amp_o2():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=1)
    with amp.scale_loss(model(torch.randn(3, 4).half()).float().sum() * float("nan"), opt) as scaled:
        scaled.backward()
    opt.step()
    return [*BANNER_O2, "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 32768.0"]


def _amp_handle_api(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("handle", "opt_properties"):
        if hasattr(_amp_state, name):
            monkeypatch.setattr(_amp_state, name, getattr(_amp_state, name))
    monkeypatch.setattr(_amp_state, "verbosity", 1)
    handle = amp.init()
    try:
        lin = nn.Linear(4, 2)
        opt = handle.wrap_optimizer(torch.optim.SGD(lin.parameters(), lr=0.1))
        with opt.scale_loss(lin(torch.randn(3, 4)).float().sum() * float("inf")) as scaled:
            scaled.backward()
        opt.step()
    finally:
        casts._disable_o1_for_tests()
    return ["Gradient overflow, skipping update"]


def _megatron():
    torch.manual_seed(0)
    model = FP16_Module(nn.Linear(4, 2))
    opt = MegatronFP16_Optimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        static_loss_scale=None,
        dynamic_loss_scale=True,
        dynamic_loss_args={"init_scale": 2.0**20},
        verbose=True,
    )
    opt.backward(model(torch.randn(3, 4)).sum() * float("inf"))
    opt.step()
    return [
        "FP16_Optimizer processing param group 0:",
        "FP16_Optimizer received torch.HalfTensor with torch.Size([2, 4])",
        "FP16_Optimizer received torch.HalfTensor with torch.Size([2])",
        "OVERFLOW! Skipping step. Attempted loss scale: 1048576.0, reducing to 524288.0",
    ]


def _fused_era():
    w = torch.randn(4, 3).half().requires_grad_()
    opt = FusedEraFP16_Optimizer(FusedAdam([w], lr=1e-2), dynamic_loss_scale=True, verbose=True)
    w.grad = torch.full_like(w, float("inf"))
    opt.step()
    return ["", "Grad overflow on iteration 0", "Using dynamic loss scale of 65536.0"]


FACES = {
    "fp16_utils": _fp16_utils,
    "amp O2": _amp_o2,
    "amp handle API": _amp_handle_api,
    "Megatron-LM fp16": _megatron,
    "fused-era FP16_Optimizer": _fused_era,
}


@pytest.mark.parametrize("face", sorted(FACES))
def test_apex_lines_leave_a_rank_logging_setup_alone(face, dle_logging, capsys, monkeypatch):
    run = FACES[face]
    logging.info("starting")  # the script's own lines: on the root logger, as GNMT logs
    expected = run(monkeypatch) if face == "amp handle API" else run()
    logging.info("done")
    out, err = capsys.readouterr()
    assert "--- Logging error ---" not in err
    assert out.splitlines() == expected  # apex's text, on stdout, as apex printed it
    assert _script_logs(dle_logging) == ["INFO - 0 - starting", "INFO - 0 - done"]


def test_apex_lines_follow_the_current_stdout(apex_log, capsys):
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        expected = _fp16_utils()
    assert buffer.getvalue() == "".join(line + "\n" for line in expected)
    assert capsys.readouterr() == ("", "")


def test_fp16kits_own_notes_stay_on_the_fp16kit_logger(caplog, capsys):
    # a step without optimizer.backward(loss): fp16kit's warning, not an apex line
    model = nn.Linear(4, 2).half()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), verbose=False)
    with caplog.at_level(logging.WARNING, logger="fp16kit"):
        opt.step()
    assert [r.name for r in caplog.records] == ["fp16kit"]
    assert capsys.readouterr().out == ""


# ------------------------------------------------------------------------ apex's switches


def test_amp_verbosity_0_silences_what_apex_silenced(capsys):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    with amp.scale_loss(model(torch.randn(3, 4).half()).float().sum() * float("inf"), opt) as scaled:
        scaled.backward()
    opt.step()
    assert capsys.readouterr().out == ""  # no banner, no skip line
    amp.load_state_dict(
        {"loss_scaler0": {"loss_scale": 8.0, "unskipped": 0}, "loss_scaler1": {"loss_scale": 8.0, "unskipped": 0}}
    )
    assert capsys.readouterr().out.splitlines() == [  # apex printed these whatever the verbosity
        "Warning: state_dict contains 2 entries, while 1 loss_scalers are used",
        "Skipping loss_scaler[1], since num_losses was set to 1",
    ]


def test_fp16_optimizer_verbose_false_keeps_only_the_skip_line(capsys):
    model = nn.Linear(4, 2).half()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True, verbose=False)
    opt.backward(model(torch.randn(3, 4).half()).float().sum() * float("inf"))
    opt.step()
    assert capsys.readouterr().out == "Gradient overflow.  Skipping step, reducing loss scale to 32768.0\n"


# ------------------------------------------------------------------------ logging's switches


def test_set_up_as_apex_printed(apex_log):
    assert apex_log.propagate is False and apex_log.level == logging.INFO
    # (pytest adds its capture handler to loggers that do not propagate)
    [handler] = [h for h in apex_log.handlers if isinstance(h, CurrentStdoutHandler)]
    assert handler.formatter._fmt == "%(message)s"


def test_set_level_warning_hides_the_banner_and_keeps_the_skip_lines(apex_log, capsys):
    apex_log.setLevel(logging.WARNING)
    assert capsys.readouterr().out == ""
    _amp_o2()
    assert (
        capsys.readouterr().out == "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 32768.0\n"
    )


def test_disabled_silences_every_line(apex_log, capsys):
    apex_log.disabled = True
    _amp_o2()
    _fp16_utils()
    assert capsys.readouterr().out == ""


def test_routed_into_the_scripts_logging(apex_log, capsys):
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(rank)s|%(name)s|%(levelname)s|%(message)s"))
    handler.addFilter(RankFilter(3))  # on the handler: every record gets its rank
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    apex_log.handlers.clear()
    apex_log.propagate = True
    try:
        expected = _fp16_utils()
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    out, err = capsys.readouterr()
    assert (out, err) == ("", "")
    levels = ["INFO"] * 3 + ["WARNING"]
    assert stream.getvalue().splitlines() == [f"3|fp16kit.apex|{lv}|{line}" for lv, line in zip(levels, expected)]


def test_handler_writes_nothing_without_a_stdout(apex_log, monkeypatch):
    monkeypatch.setattr("sys.stdout", None)  # pythonw: print() drops the line too
    _fp16_utils()
