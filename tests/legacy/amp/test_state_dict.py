"""amp.state_dict / load_state_dict (apex's format, FIXes of docs/apex-amp.md §9) and the exact O2 resume
(option (b): the fp32 masters travel in optimizer.state_dict())."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from _helpers.amp_reference import batches, tiny_model
from fp16kit.legacy import amp
from fp16kit.legacy.amp._amp_state import _amp_state
from fp16kit.legacy.amp._process_optimizer import MASTERS_KEY


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _setup(num_losses=1):
    model = tiny_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return amp.initialize(model, opt, opt_level="O2", verbosity=0, num_losses=num_losses)


def _run(model, opt, data, overflow_at=()):
    for i, (x, y) in enumerate(data):
        bad = float("inf") if i in overflow_at else 1.0
        with amp.scale_loss(nn.functional.mse_loss(model(x), y) * bad, opt) as s:
            s.backward()
        opt.step()
        opt.zero_grad()


def test_state_dict_format_and_roundtrip():
    model, opt = _setup(num_losses=2)
    _run(model, opt, batches(3), overflow_at={1})
    sd = amp.state_dict()
    assert list(sd) == ["loss_scaler0", "loss_scaler1"]
    assert sd["loss_scaler0"] == {"loss_scale": 32768.0, "unskipped": 1}
    back = _roundtrip(sd)
    _setup(num_losses=2)
    amp.load_state_dict(back)
    assert amp.state_dict() == sd


def test_state_dict_before_initialize_is_empty(monkeypatch):
    monkeypatch.delattr(_amp_state, "loss_scalers", raising=False)
    assert amp.state_dict() == {}


def test_load_state_dict_matches_by_index_and_validates_first():
    _setup(num_losses=2)
    amp.load_state_dict(
        {"loss_scaler1": {"loss_scale": 8.0, "unskipped": 3}, "loss_scaler0": {"loss_scale": 4.0, "unskipped": 1}}
    )
    assert amp.state_dict() == {
        "loss_scaler0": {"loss_scale": 4.0, "unskipped": 1},
        "loss_scaler1": {"loss_scale": 8.0, "unskipped": 3},
    }
    with pytest.raises(RuntimeError) as info:
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 2.0, "unskipped": 0}, "extra": 1})
    assert str(info.value) == 'Error(s) in loading state_dict. Unexpected key(s) in state_dict: "extra". '
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 4.0, "unskipped": 1}  # nothing changed
    with pytest.raises(RuntimeError, match="must be a dict"):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 2.0, "unskipped": 0}, "loss_scaler1": 5})
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 4.0, "unskipped": 1}


def test_o2_resume_is_bit_for_bit():
    data = batches(10)
    model, opt = _setup()
    _run(model, opt, data, overflow_at={2})
    want = [p.detach().clone() for p in model.parameters()]
    want_masters = [p.detach().clone() for p in amp.master_params(opt)]
    want_amp = amp.state_dict()

    model, opt = _setup()
    _run(model, opt, data[:5], overflow_at={2})
    ck = _roundtrip({"model": model.state_dict(), "optimizer": opt.state_dict(), "amp": amp.state_dict()})
    assert MASTERS_KEY in ck["optimizer"]

    model, opt = _setup()
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["optimizer"])
    amp.load_state_dict(ck["amp"])
    assert all(v.dtype == torch.float32 for s in opt.state.values() for v in s.values() if v.is_floating_point())
    _run(model, opt, data[5:])
    for a, b in zip(model.parameters(), want):
        assert torch.equal(a, b)
    for a, b in zip(amp.master_params(opt), want_masters):
        assert torch.equal(a, b)
    assert amp.state_dict() == want_amp


def test_apex_checkpoint_without_masters_rebuilds_from_fp16_weights():
    model, opt = _setup()
    _run(model, opt, batches(3))
    ck = _roundtrip({"model": model.state_dict(), "optimizer": opt.state_dict()})
    del ck["optimizer"][MASTERS_KEY]
    model2, opt2 = _setup()
    model2.load_state_dict(ck["model"])
    opt2.load_state_dict(ck["optimizer"])
    for m, p in zip(amp.master_params(opt2), model2.parameters()):
        assert m.dtype == torch.float32 and torch.equal(m, p.float())
    assert all(v.dtype == torch.float32 for s in opt2.state.values() for v in s.values() if v.is_floating_point())


def test_optimizer_state_loaded_before_initialize_stays_fp32():
    model = tiny_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for x, y in batches(2):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    exact = {k: v.clone() for k, v in opt.state[model[0].weight].items()}
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    opt._amp_lazy_init()
    master = opt.param_groups[0]["params"][0]
    for k, v in exact.items():
        assert torch.equal(opt.state[master][k], v), k  # apex: round trip through fp16


def test_mismatched_masters_refused_before_change():
    model, opt = _setup()
    _run(model, opt, batches(1))
    sd = opt.state_dict()
    sd[MASTERS_KEY] = [sd[MASTERS_KEY][0][:-1]]
    before = [m.detach().clone() for m in amp.master_params(opt)]
    with pytest.raises(ValueError, match="Param group 0: the checkpoint holds"):
        opt.load_state_dict(sd)
    assert all(torch.equal(a, b) for a, b in zip(amp.master_params(opt), before))


def test_load_state_dict_count_mismatch_warns_whatever_the_verbosity(caplog):
    _setup(num_losses=1)  # verbosity=0
    with caplog.at_level("WARNING", logger="fp16kit"):
        amp.load_state_dict(
            {"loss_scaler0": {"loss_scale": 2.0, "unskipped": 0}, "loss_scaler1": {"loss_scale": 4.0, "unskipped": 0}}
        )
    assert [r.getMessage() for r in caplog.records] == [
        "Warning: state_dict contains 2 entries, while 1 loss_scalers are used",
        "Skipping loss_scaler[1], since num_losses was set to 1",
    ]
    assert amp.state_dict() == {"loss_scaler0": {"loss_scale": 2.0, "unskipped": 0}}


NAN, INF = float("nan"), float("inf")
BAD_ENTRIES = {
    # apex set _loss_scale to whatever the file held: NaN or 0 reached the weights, inf skipped
    # every step; an era-1 window of 0 was a ZeroDivisionError
    "loss_scale nan": ({"loss_scale": NAN, "unskipped": 0}, "loss_scale must be a finite number > 0, got nan"),
    "loss_scale 0": ({"loss_scale": 0.0, "unskipped": 0}, "loss_scale must be a finite number > 0, got 0.0"),
    "loss_scale -1": ({"loss_scale": -1.0, "unskipped": 0}, "loss_scale must be a finite number > 0, got -1.0"),
    "loss_scale inf": ({"loss_scale": INF, "unskipped": 0}, "loss_scale must be a finite number > 0, got inf"),
    "loss_scale None": ({"loss_scale": None, "unskipped": 0}, "loss_scale must be a finite number > 0, got None"),
    "unskipped -3": ({"loss_scale": 2.0, "unskipped": -3}, "unskipped .* must be a whole number >= 0, got -3"),
    "unskipped 1.5": ({"loss_scale": 2.0, "unskipped": 1.5}, "unskipped .* must be a whole number >= 0, got 1.5"),
    "apex era-2 _loss_scale nan": (
        {
            "__apex_class__": "apex.amp.scaler.LossScaler",
            "dynamic": True,
            "_loss_scale": NAN,
            "_max_loss_scale": 2.0**24,
            "_scale_seq_len": 2000,
            "_unskipped": 0,
        },
        "apex.amp.scaler.LossScaler in this file is not one apex pickled: its _loss_scale is nan",
    ),
    "apex era-1 scale_window 0": (
        {
            "__apex_class__": "apex.fp16_utils.loss_scaler.DynamicLossScaler",
            "cur_scale": 2.0**16,
            "cur_iter": 3,
            "last_overflow_iter": -1,
            "scale_factor": 2.0,
            "scale_window": 0,
        },
        "its scale_window is 0, not a whole number >= 1",
    ),
}


@pytest.mark.parametrize("case", list(BAD_ENTRIES))
def test_an_entry_that_cannot_train_is_refused_naming_the_field_and_nothing_is_loaded(case):
    entry, said = BAD_ENTRIES[case]
    model, opt = _setup(num_losses=2)
    _run(model, opt, batches(3), overflow_at={1})
    before = amp.state_dict()
    with pytest.raises(RuntimeError, match=r"Error\(s\) in loading state_dict\. 'loss_scaler1'.*" + said):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 8.0, "unskipped": 1}, "loss_scaler1": entry})
    assert amp.state_dict() == before  # loss_scaler0 was not applied either
    _run(model, opt, batches(1))
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("value", [0, NAN, -4.0], ids=repr)
def test_writing_a_scale_that_cannot_train_into_a_scaler_is_refused(value):
    _setup()
    scaler = _amp_state.loss_scalers[0]
    with pytest.raises(ValueError, match="_loss_scale must be a finite number > 0"):
        scaler._loss_scale = value
    with pytest.raises(ValueError, match="_scale_seq_len must be a whole number >= 1"):
        scaler._scale_seq_len = 0
    assert scaler.loss_scale() == 65536.0 and scaler._scale_seq_len == 2000
    scaler._loss_scale = 2**20  # what scripts write
    assert scaler.loss_scale() == 2.0**20
