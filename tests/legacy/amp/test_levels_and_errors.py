"""amp O0 / O3 against plain training, initialize's options, errors (apex's texts, nothing
changed), and the layering rule for the amp package."""

from __future__ import annotations

import logging
import pathlib
import re

import pytest
import torch
from torch import nn

from _helpers.amp_reference import batches, plain_step, tiny_model
from fp16kit.legacy import FP16_Optimizer, amp
from fp16kit.legacy.amp._amp_state import _amp_state


def _train(model, opt, data):
    for x, y in data:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        with amp.scale_loss(loss, opt) as scaled:
            assert scaled.dtype == torch.float32
            scaled.backward()
        opt.step()


def test_o0_is_plain_fp32_training():
    model, ref = tiny_model(), tiny_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level="O0", verbosity=0)
    data = batches(6)
    _train(model, opt, data)
    for x, y in data:
        plain_step(ref, ref_opt, x, y)
    for a, b in zip(model.parameters(), ref.parameters()):
        assert a.dtype == torch.float32 and torch.equal(a, b)


def test_o3_is_pure_fp16_training():
    model, ref = tiny_model(), tiny_model().half()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level="O3", verbosity=0)
    assert model[1].weight.dtype == torch.float16  # O3: BatchNorm too
    data = batches(6)
    _train(model, opt, data)
    for x, y in data:
        plain_step(ref, ref_opt, x, y, dtype=torch.float16)
    for a, b in zip(model.parameters(), ref.parameters()):
        assert a.dtype == torch.float16 and torch.equal(a, b)
    assert amp.state_dict() == {"loss_scaler0": {"loss_scale": 1.0, "unskipped": 0}}


def test_o2_bf16_has_masters_and_trains():
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level="O2", cast_model_type=torch.bfloat16, loss_scale=1.0, verbosity=0)
    assert model[0].weight.dtype == torch.bfloat16 and model[1].weight.dtype == torch.float32
    _train(model, opt, batches(3))
    assert all(p.dtype == torch.float32 for p in amp.master_params(opt))
    for m, p in zip(amp.master_params(opt), model.parameters()):
        assert torch.equal(m.to(p.dtype), p)


def test_banner_and_options(caplog):
    with caplog.at_level(logging.INFO, logger="fp16kit"):
        amp.initialize(tiny_model(), opt_level="O2", loss_scale=128)
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs[0] == "Selected optimization level O2:  FP16 training with FP32 batchnorm and FP32 master weights.\n"
    assert "cast_model_type        : torch.float16" in msgs
    assert msgs[-1] == "loss_scale             : 128.0"
    p = _amp_state.opt_properties
    assert (p.opt_level, p.keep_batchnorm_fp32, p.master_weights, p.loss_scale) == ("O2", True, True, 128.0)
    assert _amp_state.loss_scalers[0].dynamic is False


def test_return_structure():
    m1, m2 = tiny_model(), tiny_model()
    o = torch.optim.SGD(m1.parameters(), lr=1)
    assert amp.initialize(m1, opt_level="O0", verbosity=0) is m1
    ms, os_ = amp.initialize([m1, m2], [o], opt_level="O0", verbosity=0)
    assert ms[0] is m1 and os_[0] is o
    with pytest.raises(TypeError, match="^optimizers must be either a single optimizer or a list of optimizers.$"):
        amp.initialize(m1, (torch.optim.SGD(m1.parameters(), lr=1),), opt_level="O0", verbosity=0)
    with pytest.raises(TypeError, match="^models must be either a single model or a list of models.$"):
        amp.initialize((m1,), opt_level="O0", verbosity=0)
    m, o2 = amp.initialize(m1, o, enabled=False)
    assert m is m1 and o2 is o


def _untouched(model, opt):
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert not hasattr(opt, "_amp_stash")


@pytest.mark.parametrize(
    "kw, exc, text",
    [
        (
            {"opt_level": "o2"},
            RuntimeError,
            "Unexpected optimization level o2. Options are 'O0', 'O1', 'O2', 'O3'.  Note that in `O0`, `O1`, etc., the prefix O is the letter O, not the number zero.",
        ),
        (
            {"opt_level": "O1", "cast_model_type": torch.float16},
            RuntimeError,
            "O1 inserts casts around Torch functions rather than model weights, so with O1, the model weights themselves should remain FP32. If you wish to cast the model to a different type, use opt_level='O2' or 'O3'. cast_model_type was torch.float16",
        ),
        (
            {"opt_level": "O1", "keep_batchnorm_fp32": False},
            RuntimeError,
            "With opt_level O1, batchnorm functions are automatically patched to run in FP32, so keep_batchnorm_fp32 should be None. keep_batchnorm_fp32 was False",
        ),
        (
            {"opt_level": "O1", "master_weights": False},
            RuntimeError,
            "It doesn't make sense to use master_weights with O1. With O1, your model weights themselves should be FP32.",
        ),
        (
            {"opt_level": "O2", "patch_torch_functions": True},
            RuntimeError,
            "Currently, patch_torch_functions=True should only be set by selecting opt_level='O1'.",
        ),
        (
            {"opt_level": "O2", "keep_batchnorm_fp32": "yes"},
            AssertionError,
            "keep_batchnorm_fp32 must be a boolean, the string 'True' or 'False', or None, found keep_batchnorm_fp32=yes",
        ),
    ],
)
def test_bad_options_change_nothing(kw, exc, text):
    amp.initialize(tiny_model(), opt_level="O0", verbosity=0)
    before = _amp_state.opt_properties
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=1)
    with pytest.raises(exc) as info:
        amp.initialize(model, opt, verbosity=0, **kw)
    assert str(info.value) == text
    _untouched(model, opt)
    assert _amp_state.opt_properties is before


def test_initialize_twice():
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=1)
    amp.initialize(model, opt, opt_level="O0", verbosity=0)
    with pytest.raises(RuntimeError, match="^A given optimizer should only be passed through amp.initialize once.$"):
        amp.initialize(model, opt, opt_level="O0", verbosity=0)
    model2 = tiny_model()
    amp.initialize(model2, opt_level="O2", verbosity=0)
    with pytest.raises(RuntimeError) as info:
        amp.initialize(model2, opt_level="O2", verbosity=0)
    assert str(info.value) == (
        "Found param 0.weight with type torch.HalfTensor, expected torch.FloatTensor.\n"
        "When using amp.initialize, you do not need to call .half() on your model\n"
        "before passing it, no matter what optimization level you choose."
    )


@pytest.mark.parametrize("as_list", [False, True])
def test_fp16_optimizer_refused(as_list):
    model = tiny_model()
    fp16 = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=1), verbose=False)
    with pytest.raises(RuntimeError) as info:
        amp.initialize(model, [fp16] if as_list else fp16, opt_level="O2", verbosity=0)
    assert str(info.value).startswith("An incoming optimizer is an instance of apex.fp16_utils.FP16_Optimizer. ")
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_parallel_model_refused():
    model = nn.DataParallel(tiny_model())
    with pytest.raises(RuntimeError) as info:
        amp.initialize(model, opt_level="O2", verbosity=0)
    assert str(info.value) == (
        "Incoming model is an instance of torch.nn.parallel.DataParallel. Parallel wrappers should only "
        "be applied to the model(s) AFTER \nthe model(s) have been returned from amp.initialize."
    )
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_scale_loss_before_initialize(monkeypatch):
    monkeypatch.delattr(_amp_state, "opt_properties", raising=False)
    with pytest.raises(RuntimeError, match="internal Amp state has not been initialized"):
        with amp.scale_loss(torch.ones(()), []):
            pass


def test_o2_keeps_affine_bn_fp32_only():
    model = nn.Sequential(nn.Linear(2, 4), nn.BatchNorm1d(4), nn.BatchNorm1d(4, affine=False), nn.GroupNorm(2, 4))
    amp.initialize(model, opt_level="O2", verbosity=0)
    assert [m.weight.dtype for m in (model[0], model[1], model[3])] == [torch.float16, torch.float32, torch.float16]
    assert model[2].running_mean.dtype == torch.float16


def test_io_types_are_kept():
    from collections import OrderedDict, namedtuple

    Pair = namedtuple("Pair", "a b")

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, pair, extra=None):
            out = self.lin(pair.a) + pair.b
            return OrderedDict(out=out, n=Pair(out, torch.ones(1, dtype=torch.long)))

    net = amp.initialize(Net(), opt_level="O2", verbosity=0)
    res = net(Pair(torch.ones(1, 2), torch.zeros(1, 2)), extra={"k": torch.ones(1)})
    assert type(res) is OrderedDict and type(res["n"]) is Pair
    assert res["out"].dtype == torch.float32 and res["n"].b.dtype == torch.long


def test_amp_package_holds_no_tensor_math():
    import fp16kit.legacy.amp as pkg

    pattern = re.compile(r"torch\._amp_|torch\._foreach_|\.mul_\(|\.copy_\(|\.add_\(|\.div_\(")
    for path in pathlib.Path(pkg.__file__).parent.glob("*.py"):
        hits = [i + 1 for i, line in enumerate(path.read_text().splitlines()) if pattern.search(line)]
        assert not hits, f"tensor math in legacy/amp/{path.name} at lines {hits}"


def test_forward_casting_survives_copies_and_direct_calls():
    import copy
    import pickle

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.me = [self]  # a reference back to the model

        def forward(self, x):
            assert x.dtype == torch.float16
            return self.lin(x)

    net = amp.initialize(Net(), opt_level="O3", verbosity=0)
    x = torch.ones(1, 2)
    assert type(net).__name__ == "Net" and isinstance(net, Net)
    assert net(x).dtype == torch.float32 and net.forward(x).dtype == torch.float32
    assert net.forward.__func__ is type(net).forward
    seq = amp.initialize(nn.Sequential(nn.Linear(2, 2)), opt_level="O2", verbosity=0)
    back = pickle.loads(pickle.dumps(seq))
    assert type(back) is type(seq) and back(x).dtype == torch.float32 and back[0].weight.dtype == torch.float16
    for twin in (copy.deepcopy(net), net._replicate_for_data_parallel()):
        assert type(twin) is type(net) and twin(x).dtype == torch.float32
    twin = copy.deepcopy(net)
    assert twin.me[0] is twin
    with torch.no_grad():
        twin.lin.bias.fill_(9)
    assert not torch.equal(twin(x), net(x))


@pytest.mark.parametrize("level, dtype", [("O0", torch.float32), ("O3", torch.float16)])
def test_dynamic_scale_without_masters_accumulates_through_the_stash(level, dtype, caplog):
    from _helpers.amp_reference import ApexNoMasters

    model = tiny_model()
    ref = ApexNoMasters(model, lambda ps: torch.optim.SGD(ps, lr=0.01), dtype=dtype, window=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = amp.initialize(model, opt, opt_level=level, loss_scale="dynamic", verbosity=0)
    amp._amp_state.loss_scalers[0]._scale_seq_len = 2
    data = batches(12)
    for i in range(0, 12, 2):  # two backward passes (no zero_grad between), one step
        for j in (i, i + 1):
            x, y = data[j]
            bad = float("inf") if j in (3, 6) else 1.0
            with amp.scale_loss(nn.functional.mse_loss(model(x), y) * bad, opt) as s:
                s.backward()
            ref.backward(nn.functional.mse_loss(ref.forward(x), y) * bad)
        opt.step()
        ref.step()
        opt.zero_grad(set_to_none=True)
        ref.opt.zero_grad(set_to_none=True)
        assert amp._amp_state.loss_scalers[0].loss_scale() == ref.scaler.scale
        for a, b in zip(model.parameters(), ref.model.parameters()):
            assert a.dtype == dtype and torch.equal(a, b)


NAN, INF = float("nan"), float("inf")
BAD_SCALER_OPTIONS = [
    # apex made the scalers anyway: 0 wrote NaN into the weights (1/0), NaN and inf too, and a
    # negative scale grows without bound; num_losses=0 failed at the first scale_loss (IndexError)
    ({"loss_scale": 0}, 'loss_scale must be "dynamic" or a finite number > 0 (e.g. 128.0), got 0.0.'),
    ({"loss_scale": NAN}, 'loss_scale must be "dynamic" or a finite number > 0 (e.g. 128.0), got nan.'),
    ({"loss_scale": INF}, 'loss_scale must be "dynamic" or a finite number > 0 (e.g. 128.0), got inf.'),
    ({"loss_scale": -128.0}, 'loss_scale must be "dynamic" or a finite number > 0 (e.g. 128.0), got -128.0.'),
    (
        {"num_losses": 0},
        "num_losses must be an int >= 1 (one loss scaler per loss, picked by amp.scale_loss(..., loss_id=i)), got 0.",
    ),
    (
        {"num_losses": -1},
        "num_losses must be an int >= 1 (one loss scaler per loss, picked by amp.scale_loss(..., loss_id=i)), got -1.",
    ),
    (
        {"num_losses": 2.0},
        "num_losses must be an int >= 1 (one loss scaler per loss, picked by amp.scale_loss(..., loss_id=i)), got 2.0.",
    ),
    ({"min_loss_scale": NAN}, "min_loss_scale must be None or a finite number >= 0 (0 or None: no floor), got nan."),
    ({"min_loss_scale": -1.0}, "min_loss_scale must be None or a finite number >= 0 (0 or None: no floor), got -1.0."),
    ({"max_loss_scale": NAN}, "max_loss_scale must be a number > 0 (inf or None: no cap), got nan."),
    ({"max_loss_scale": 0.0}, "max_loss_scale must be a number > 0 (inf or None: no cap), got 0.0."),
    (
        {"min_loss_scale": 2.0**10, "max_loss_scale": 2.0**8},
        "min_loss_scale (1024.0) is above max_loss_scale (256.0); pass min_loss_scale <= max_loss_scale.",
    ),
]


@pytest.mark.parametrize("kw, text", BAD_SCALER_OPTIONS, ids=[repr(kw) for kw, _ in BAD_SCALER_OPTIONS])
def test_scaler_options_that_cannot_train_are_refused_at_initialize_and_change_nothing(kw, text):
    amp.initialize(tiny_model(), opt_level="O0", verbosity=0)
    before = (_amp_state.opt_properties, _amp_state.loss_scalers)
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=1)
    with pytest.raises(ValueError) as info:
        amp.initialize(model, opt, opt_level="O2", verbosity=0, **kw)
    assert str(info.value) == text
    _untouched(model, opt)
    assert (_amp_state.opt_properties, _amp_state.loss_scalers) == before


BAD_BOUNDS = [
    # set on the scaler apex amp exposes (_amp_state.loss_scalers[i]): apex took any value, so a
    # NaN or negative floor, or a NaN or 0 cap, reached the scale at the next overflow or growth
    ("_min_loss_scale", NAN, "min_loss_scale must be None or a finite number >= 0 (0 or None: no floor), got nan."),
    ("_min_loss_scale", -1.0, "min_loss_scale must be None or a finite number >= 0 (0 or None: no floor), got -1.0."),
    ("_min_loss_scale", INF, "min_loss_scale must be None or a finite number >= 0 (0 or None: no floor), got inf."),
    (
        "_min_loss_scale",
        2.0**10,
        "min_loss_scale (1024.0) is above max_loss_scale (256.0); pass min_loss_scale <= max_loss_scale.",
    ),
    ("_max_loss_scale", NAN, "max_loss_scale must be a number > 0 (inf or None: no cap), got nan."),
    ("_max_loss_scale", 0.0, "max_loss_scale must be a number > 0 (inf or None: no cap), got 0.0."),
    ("_max_loss_scale", -256.0, "max_loss_scale must be a number > 0 (inf or None: no cap), got -256.0."),
    (
        "_max_loss_scale",
        2.0,
        "min_loss_scale (4.0) is above max_loss_scale (2.0); pass min_loss_scale <= max_loss_scale.",
    ),
]


@pytest.mark.parametrize("name, value, text", BAD_BOUNDS, ids=[f"{n}={v}" for n, v, _ in BAD_BOUNDS])
def test_scaler_bounds_set_on_the_scaler_are_checked_as_at_initialize(name, value, text):
    model = tiny_model()
    model, opt = amp.initialize(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        opt_level="O2",
        verbosity=0,
        min_loss_scale=4.0,
        max_loss_scale=256.0,
        on_min_scale="warn",
    )
    scaler = _amp_state.loss_scalers[0]
    with pytest.raises(ValueError) as info:
        setattr(scaler, name, value)
    assert str(info.value) == text
    assert (scaler._min_loss_scale, scaler._max_loss_scale, scaler.loss_scale()) == (4.0, 256.0, 256.0)
    # a floor policy that watches the floor needs one: taking it away is refused too
    with pytest.raises(ValueError, match="on_min_scale='warn' needs a floor to watch"):
        scaler._min_loss_scale = None
    assert scaler._min_loss_scale == 4.0


def test_scaler_bounds_apex_trained_with_are_accepted_on_the_scaler():
    model = tiny_model()
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", verbosity=0)
    scaler = _amp_state.loss_scalers[0]
    scaler._min_loss_scale = 0  # apex's "no floor"
    scaler._max_loss_scale = INF  # no cap
    assert (scaler._min_loss_scale, scaler._max_loss_scale) == (None, None)
    scaler._max_loss_scale, scaler._min_loss_scale = 2.0**10, 2.0**10  # a floor equal to the cap
    assert (scaler._min_loss_scale, scaler._max_loss_scale) == (2.0**10, 2.0**10)
    scaler._scale_seq_len = 1  # the cap applies at the next growth, as apex's
    _train(model, opt, batches(2))
    assert scaler.loss_scale() == 2.0**10 and all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize(
    "kw",
    [
        {"loss_scale": 128},
        {"loss_scale": "128.0"},
        {"loss_scale": "dynamic"},
        {"num_losses": 3},
        {"min_loss_scale": 0},
        {"max_loss_scale": INF},
    ],
    ids=repr,
)
def test_scaler_options_apex_trained_with_are_accepted(kw):
    model = tiny_model()
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", verbosity=0, **kw)
    _train(model, opt, batches(2))
    assert len(_amp_state.loss_scalers) == kw.get("num_losses", 1)
    assert all(torch.isfinite(p).all() for p in model.parameters())
