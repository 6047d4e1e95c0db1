"""amp O1 follows apex's op lists on every device (fp16kit/legacy/amp/o1_lists.py), not the
device's autocast: every name of apex's FP32 list runs in fp32 on fp16 inputs, every name of its
FP16 list in fp16 on fp32 inputs, in the functional, torch and Tensor-method forms, each compared
bit for bit with the op called by hand on inputs cast as apex's lists say. Then the promote and
in-place rules, apex's BCE error, and the loss that broke: an InfoNCE loss with temperature 0.05
(``exp(scores / 0.05)``), which CPU autocast alone ran into inf and NaN.
"""

from __future__ import annotations

import copy
import importlib
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fp16kit.legacy import amp

casts = importlib.import_module("fp16kit.legacy.amp.casts")
lists = importlib.import_module("fp16kit.legacy.amp.lists")
o1_lists = importlib.import_module("fp16kit.legacy.amp.o1_lists")
_list_rules = importlib.import_module("fp16kit.legacy.amp._list_rules")

_MODULES = (lists.functional_overrides, lists.torch_overrides, lists.tensor_overrides)
FP32_NAMES = {name for m in _MODULES for name in m.FP32_FUNCS}
# a @ b's reflected form goes with __matmul__; the RNN functions are fp16 outside the lists, as in apex
FP16_NAMES = {name for m in _MODULES for name in m.FP16_FUNCS} | {"__rmatmul__", *_list_rules.RNN_FUNCS}

CUDA = pytest.param(
    "cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
)


@pytest.fixture(params=["cpu", CUDA])
def device(request):
    casts.enable_o1(request.param)
    yield request.param
    casts._disable_o1_for_tests()


@pytest.fixture(autouse=True)
def _no_o1_left():
    yield
    casts._disable_o1_for_tests()  # even after a failure


def _t(device, *shape, dtype=torch.float32, positive=False, seed=0):
    g = torch.Generator().manual_seed(seed + sum(shape))
    t = torch.rand(*shape, generator=g) * 0.9 + 0.05 if positive else torch.randn(*shape, generator=g)
    return t.to(device=device, dtype=dtype)


def _cast(x, dtype):
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.to(dtype)
    if isinstance(x, (list, tuple)):
        return type(x)(_cast(y, dtype) for y in x)
    return x


def _by_hand(fn, args, kwargs, dtype):
    """``fn`` on the inputs cast to ``dtype``, with O1 (autocast and the lists) off."""
    with casts.disable_casts():
        return fn(*_cast(args, dtype), **{k: _cast(v, dtype) for k, v in kwargs.items()})


def _same(a, b):
    assert a.dtype == b.dtype
    assert torch.equal(a, b) or (a.isnan() == b.isnan()).all() and torch.equal(a.nan_to_num(), b.nan_to_num())


# ------------------------------------------------------------------------- the FP32 list
def _fp32_cases(d):
    """apex's FP32 names -> (args, kwargs), fp16 tensors (what a model's fp16 output hands them)."""
    h = lambda *s, **k: _t(d, *s, dtype=torch.float16, **k)  # noqa: E731
    labels = torch.tensor([0, 2, 1], device=d)
    signs = torch.tensor([1.0, -1.0, 1.0], device=d)
    return {
        # functional
        "interpolate": ((h(1, 2, 4, 4),), {"scale_factor": 2.0, "mode": "bilinear"}),
        "grid_sample": ((h(1, 1, 4, 4), h(1, 2, 2, 2)), {"align_corners": False}),
        "softplus": ((h(3, 4),), {}),
        "softmin": ((h(3, 4),), {"dim": -1}),
        "log_softmax": ((h(3, 4),), {"dim": -1}),
        "softmax": ((h(3, 4),), {"dim": -1}),
        "gelu": ((h(3, 4),), {}),
        "layer_norm": ((h(3, 4), (4,)), {}),
        "group_norm": ((h(3, 4), 2), {}),
        "local_response_norm": ((h(2, 4, 3), 2), {}),
        "normalize": ((h(3, 4),), {"dim": 1}),
        "cosine_similarity": ((h(3, 4), h(3, 4, seed=1)), {}),
        "poisson_nll_loss": ((h(3, 4), h(3, 4, positive=True)), {}),
        "cosine_embedding_loss": ((h(3, 4), h(3, 4, seed=1), signs), {}),
        "cross_entropy": ((h(3, 4), labels), {}),
        "hinge_embedding_loss": ((h(3), signs), {}),
        "kl_div": ((h(3, 4).log_softmax(-1), h(3, 4, seed=1).softmax(-1)), {"reduction": "batchmean"}),
        "l1_loss": ((h(3, 4), h(3, 4, seed=1)), {}),
        "mse_loss": ((h(3, 4), h(3, 4, seed=1)), {}),
        "margin_ranking_loss": ((h(3), h(3, seed=1), signs), {}),
        "multilabel_margin_loss": ((h(3, 4), torch.tensor([[1, -1, 0, 0]] * 3, device=d)), {}),
        "multilabel_soft_margin_loss": ((h(3, 4), (h(3, 4) > 0).half()), {}),
        "multi_margin_loss": ((h(3, 4), labels), {}),
        "nll_loss": ((h(3, 4).log_softmax(-1), labels), {}),
        "binary_cross_entropy_with_logits": ((h(3, 4), h(3, 4, positive=True)), {}),
        "smooth_l1_loss": ((h(3, 4), h(3, 4, seed=1)), {}),
        "soft_margin_loss": ((h(3), signs), {}),
        "triplet_margin_loss": ((h(3, 4), h(3, 4, seed=1), h(3, 4, seed=2)), {}),
        "ctc_loss": (
            (h(6, 1, 4).log_softmax(2), torch.tensor([[1, 2]], device=d), torch.tensor([6]), torch.tensor([2])),
            {},
        ),
        # torch and Tensor
        "acos": ((h(3, 4, positive=True),), {}),
        "asin": ((h(3, 4, positive=True),), {}),
        "cosh": ((h(3, 4),), {}),
        "erfinv": ((h(3, 4, positive=True),), {}),
        "exp": ((h(3, 4) * 20,), {}),  # e**20 > 65504: inf in fp16
        "expm1": ((h(3, 4) * 20,), {}),
        "log": ((h(3, 4, positive=True),), {}),
        "log10": ((h(3, 4, positive=True),), {}),
        "log2": ((h(3, 4, positive=True),), {}),
        "reciprocal": ((h(3, 4, positive=True) / 1000,), {}),  # > 65504 in fp16
        "rsqrt": ((h(3, 4, positive=True),), {}),
        "sinh": ((h(3, 4) * 12,), {}),
        "tan": ((h(3, 4),), {}),
        "pow": ((h(3, 4) * 100, 3), {}),
        "cumprod": ((h(3, 4) * 30, 0), {}),
        "cumsum": ((h(300, 4) * 300, 0), {}),
        "dist": ((h(3, 4), h(3, 4, seed=1)), {}),
        "norm": ((h(300, 4) * 30,), {}),
        "prod": ((h(3, 4) * 30,), {}),
        "std": ((h(3, 4),), {}),
        "sum": ((h(300, 4) * 300,), {}),
        "var": ((h(3, 4) * 300,), {}),
        "renorm": ((h(3, 4), 2, 0, 1.0), {}),
        "__pow__": ((h(3, 4) * 100, 3), {}),
        "__rpow__": ((h(3, 4) * 20, 2.7), {}),
        "__ipow__": ((h(3, 4) * 100, 3), {}),
        "cpu": ((h(3, 4),), {}),
    }


def _forms(name):
    """The callables apex patched for ``name``: ``F.<name>`` for its functional names, else
    ``torch.<name>`` and the Tensor method (``x.exp()``)."""
    if callable(getattr(F, name, None)):
        return [("F", getattr(F, name))]
    return [
        (form, getattr(ns, name))
        for form, ns in (("torch", torch), ("Tensor", torch.Tensor))
        if callable(getattr(ns, name, None))
    ]


def _cases(build, device):
    with casts.disable_casts():  # built as plain torch builds them (log_softmax of fp16: fp16)
        return build(device)


def test_every_fp32_name_torch_has_is_covered():
    assert {n for n in FP32_NAMES if _forms(n)} == set(_fp32_cases("cpu"))


@pytest.mark.parametrize("name", sorted(_fp32_cases("cpu")))
def test_fp32_list_runs_in_fp32(name, device):
    args, kwargs = _cases(_fp32_cases, device)[name]
    for form, fn in _forms(name):
        out = fn(*args, **kwargs)
        assert out.dtype == torch.float32, (form, name)
        _same(out, _by_hand(fn, args, kwargs, torch.float32))


def test_aliases_of_fp32_names_run_in_fp32(device):
    # apex patched only F.softmax; CUDA autocast runs the aliases in fp32 too, and so does O1
    h = _t(device, 3, 4, dtype=torch.float16) * 30
    for out in (
        torch.softmax(h, -1),
        h.softmax(-1),
        torch.log_softmax(h, -1),
        h.log_softmax(-1),
        torch.layer_norm(h, (4,)),
        torch.cosine_similarity(h, h),
    ):
        assert out.dtype == torch.float32


# ------------------------------------------------------------------------- the FP16 list
def _fp16_cases(d):
    """apex's FP16 names -> (callable, args): fp32 tensors (an fp32 model's params and inputs)."""
    f = lambda *s, seed=0: _t(d, *s, seed=seed)  # noqa: E731
    mm = (f(3, 4), f(4, 5, seed=1))
    return {
        "conv1d": [(F.conv1d, (f(1, 2, 5), f(3, 2, 2), f(3)))],
        "conv2d": [(F.conv2d, (f(1, 2, 5, 5), f(3, 2, 2, 2), f(3)))],
        "conv3d": [(F.conv3d, (f(1, 2, 4, 4, 4), f(3, 2, 2, 2, 2)))],
        "conv_transpose1d": [(F.conv_transpose1d, (f(1, 2, 5), f(2, 3, 2)))],
        "conv_transpose2d": [(F.conv_transpose2d, (f(1, 2, 5, 5), f(2, 3, 2, 2)))],
        "conv_transpose3d": [(F.conv_transpose3d, (f(1, 2, 4, 4, 4), f(2, 3, 2, 2, 2)))],
        "conv_tbc": [(torch.conv_tbc, (f(5, 1, 2), f(2, 2, 3), f(3)))],
        "linear": [(F.linear, (f(3, 4), f(5, 4), f(5)))],
        "prelu": [(F.prelu, (f(2, 3), f(1)))],
        "addmm": [(torch.addmm, (f(3, 5), *mm)), (torch.Tensor.addmm, (f(3, 5), *mm))],
        "addmv": [(torch.addmv, (f(3), f(3, 4), f(4))), (torch.Tensor.addmv, (f(3), f(3, 4), f(4)))],
        "addr": [(torch.addr, (f(3, 4), f(3), f(4))), (torch.Tensor.addr, (f(3, 4), f(3), f(4)))],
        "matmul": [(torch.matmul, mm), (torch.Tensor.matmul, mm)],
        "mm": [(torch.mm, mm), (torch.Tensor.mm, mm)],
        "mv": [(torch.mv, (f(3, 4), f(4))), (torch.Tensor.mv, (f(3, 4), f(4)))],
        "addbmm": [(torch.addbmm, (f(3, 5), f(2, 3, 4), f(2, 4, 5)))],
        "baddbmm": [(torch.baddbmm, (f(2, 3, 5), f(2, 3, 4), f(2, 4, 5)))],
        "bmm": [(torch.bmm, (f(2, 3, 4), f(2, 4, 5))), (torch.Tensor.bmm, (f(2, 3, 4), f(2, 4, 5)))],
        "__matmul__": [(lambda a, b: a @ b, mm)],
        "__rmatmul__": [(lambda a, b: b.__rmatmul__(a), mm)],
    }


_RNNS = {
    "lstm": nn.LSTM,
    "gru": nn.GRU,
    "rnn_tanh": lambda i, h: nn.RNN(i, h),
    "rnn_relu": lambda i, h: nn.RNN(i, h, nonlinearity="relu"),
    "lstm_cell": nn.LSTMCell,
    "gru_cell": nn.GRUCell,
    "rnn_tanh_cell": nn.RNNCell,
    "rnn_relu_cell": lambda i, h: nn.RNNCell(i, h, nonlinearity="relu"),
}


def test_every_fp16_name_torch_has_is_covered():
    assert {n for n in FP16_NAMES if _forms(n)} == set(_fp16_cases("cpu")) | set(_RNNS)


@pytest.mark.parametrize("name", sorted(_fp16_cases("cpu")))
def test_fp16_list_runs_in_fp16(name, device):
    for fn, args in _cases(_fp16_cases, device)[name]:
        out = fn(*args)
        assert out.dtype == torch.float16, name
        _same(out, _by_hand(fn, args, {}, torch.float16))


@pytest.mark.parametrize("name", sorted(_RNNS))
def test_rnns_run_in_fp16(name, device):
    torch.manual_seed(0)
    rnn = _RNNS[name](4, 5).to(device)
    x = _t(device, 3, 4) if name.endswith("cell") else _t(device, 2, 3, 4)
    out = rnn(x)
    out = out[0] if isinstance(out, tuple) else out
    assert out.dtype == torch.float16
    with casts.disable_casts():
        expected = rnn.half()(x.half())
    _same(out, expected[0] if isinstance(expected, tuple) else expected)


def test_fp32_model_params_keep_fp32_grads(device):
    lin = nn.Linear(4, 3).to(device)
    loss = F.cross_entropy(lin(_t(device, 5, 4)), torch.tensor([0, 1, 2, 0, 1], device=device))
    assert loss.dtype == torch.float32
    loss.backward()
    assert lin.weight.grad.dtype == lin.bias.grad.dtype == torch.float32


# ---------------------------------------------------------------- promote, in place, BCE
def test_promote_list_mixes_half_and_float_to_float(device):
    h = _t(device, 3, dtype=torch.float16)
    scale = torch.tensor(0.1, device=device)  # a 0-dim fp32 tensor: torch alone keeps half
    assert (h * scale).dtype == torch.float32
    assert (h + scale).dtype == (h - scale).dtype == (h / scale).dtype == torch.float32
    assert (1 - h).dtype == torch.float16  # one type: as it is
    assert torch.addcmul(h, h, scale).dtype == torch.float32
    point_one = torch.tensor([0.1], device=device, dtype=torch.float16)
    # apex compared in fp32 (fp16's 0.1 is not fp32's); torch alone would compare in fp16
    assert not (point_one == torch.tensor(0.1, device=device)).item()
    assert not torch.eq(point_one, torch.tensor(0.1, device=device)).item()
    assert (h.double() + h).dtype == torch.float64  # fp64 never touched


def test_explicit_float_inside_the_region(device):
    x = _t(device, 3, 4)
    w = _t(device, 4, 4, seed=1)
    h = x @ w
    assert h.dtype == torch.float16
    f = h.float()
    assert f.dtype == torch.float32 and f.exp().dtype == torch.float32
    assert (f @ w).dtype == torch.float16  # matmul is on apex's FP16 list whatever its inputs


def test_in_place_fp32_ops_on_fp16_raise_apex_errors(device):
    h = _t(device, 3, dtype=torch.float16)
    before = h.clone()
    with pytest.raises(NotImplementedError, match=r"^Cannot call in-place method exp_ on fp16 Tensors\.$"):
        h.exp_()
    with pytest.raises(NotImplementedError, match=r"^Cannot call in-place function exp_ with fp16 arguments\.$"):
        torch.exp_(h)
    assert torch.equal(h, before)
    f = _t(device, 3)
    assert torch.equal(f.clone().log_(), f.log())  # fp32: fine
    g = h
    g **= 2  # __ipow__ is on the FP32 list: a new fp32 tensor, as in apex
    assert g.dtype == torch.float32 and h.dtype == torch.float16


_BCE = dict(lists.functional_overrides.BANNED_FUNCS)["binary_cross_entropy"]


def test_binary_cross_entropy_on_fp16_raises_apexs_error(device):
    probs = torch.sigmoid(_t(device, 3, 4) @ _t(device, 4, 4, seed=1))  # fp16: a Linear then Sigmoid
    target = _t(device, 3, 4, positive=True)
    with pytest.raises(NotImplementedError) as e:
        F.binary_cross_entropy(probs, target)
    assert str(e.value) == _BCE
    with pytest.raises(NotImplementedError):
        nn.BCELoss()(probs, target)
    # fp32 inputs pass, as in apex (CUDA autocast alone raises for them too)
    loss = F.binary_cross_entropy(probs.float(), target)
    assert loss.dtype == torch.float32
    _same(loss, _by_hand(F.binary_cross_entropy, (probs, target), {}, torch.float32))


def test_allow_banned_runs_binary_cross_entropy_in_fp32(device):
    casts.enable_o1(device, allow_banned=True)
    probs = torch.sigmoid(_t(device, 3, 4) @ _t(device, 4, 4, seed=1))
    target = _t(device, 3, 4, positive=True)
    loss = F.binary_cross_entropy(probs, target)
    _same(loss, _by_hand(F.binary_cross_entropy, (probs, target), {}, torch.float32))


def test_bce_message_is_apexs():
    assert _BCE.startswith("\namp does not work out-of-the-box with `F.binary_cross_entropy` or `torch.nn.BCELoss.` ")
    assert (
        "\n    torch.nn.BCEWithLogitsLoss\n" in _BCE and "\n    amp.register_float_function(torch, 'sigmoid')\n" in _BCE
    )
    assert _BCE.endswith("by passing allow_banned=True to `amp.init()`.")


# --------------------------------------------------------------------- where the lists apply
def test_lists_follow_autocast_off(device):
    h, x = _t(device, 3, dtype=torch.float16), _t(device, 3, 4)
    w = _t(device, 4, 4, seed=1)
    with casts.disable_casts():  # what amp.disable_casts() enters at O1
        assert torch.exp(h).dtype == torch.float16 and (x @ w).dtype == torch.float32
    with torch.autocast(device, enabled=False):  # a script's own fp32 region
        assert torch.exp(h).dtype == torch.float16 and (x @ w).dtype == torch.float32
    assert torch.exp(h).dtype == torch.float32 and (x @ w).dtype == torch.float16


def test_lists_are_per_thread(device):
    seen = {}
    h = _t(device, 3, dtype=torch.float16)

    def worker():
        seen["exp"] = torch.exp(h).dtype

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen["exp"] == torch.float16  # no O1 on that thread (MIGRATION.md: apex patched every thread)
    assert torch.exp(h).dtype == torch.float32


def test_without_o1_nothing_changes():
    h = _t("cpu", 3, dtype=torch.float16)
    assert torch.exp(h).dtype == torch.float16
    assert F.softmax(h, -1).dtype == torch.float16


def test_a_registered_function_follows_its_registration(device, monkeypatch):
    monkeypatch.setattr(casts, "_pending", [])
    monkeypatch.setattr(o1_lists, "_EXEMPT", set())
    monkeypatch.setattr(F, "softmax", F.softmax)  # put back after the test
    amp.register_half_function(F, "softmax")  # apex: the user's registration wins over its lists
    casts.apply_registrations()
    x = _t(device, 3, 4)
    assert F.softmax(x, -1).dtype == torch.float16
    assert torch.exp(x.half()).dtype == torch.float32  # the other names keep apex's rule


def test_verbosity_2_logs_apexs_line_per_cast(device, caplog):
    casts.enable_o1(device, verbose=True)
    lin = nn.Linear(4, 4).to(device)
    with caplog.at_level("INFO", logger="fp16kit.apex"):
        torch.exp(lin(_t(device, 2, 4)))
    assert [r.getMessage() for r in caplog.records] == ["Float->Half (linear)"] * 3 + ["Half->Float (exp)"]


# --------------------------------------------------------------------- the loss that broke
def _encoder(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def _views(device, n=12):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, 16, generator=g)
    return x.to(device), (x + 0.1 * torch.randn(n, 16, generator=g)).to(device)


def _info_nce(z1, z2, t=0.05):
    """A SimCLR/MoCo-style InfoNCE written out as such code writes it: positives on the diagonal."""
    z1, z2 = F.normalize(z1, dim=1), F.normalize(z2, dim=1)
    scores = torch.mm(z1, z2.t())
    exp_scores = torch.exp(scores / t)
    return -torch.log(exp_scores.diag() / exp_scores.sum(dim=1)).mean()


def _info_nce_by_apexs_lists(model, x1, x2, t=0.05):
    """The same loss with every op in the dtype apex's O1 lists give it, cast by hand."""

    def encoder(x):
        lin1, _, lin2 = model
        h = F.linear(x.half(), lin1.weight.half(), lin1.bias.half())  # FP16: linear
        h = F.relu(h)  # unlisted: its input's dtype
        return F.linear(h, lin2.weight.half(), lin2.bias.half())

    z1, z2 = F.normalize(encoder(x1).float(), dim=1), F.normalize(encoder(x2).float(), dim=1)  # FP32
    scores = torch.mm(z1.half(), z2.t().half())  # FP16: mm
    exp_scores = torch.exp((scores / t).float())  # a Python float: no promotion; FP32: exp
    return -torch.log((exp_scores.diag() / exp_scores.sum(dim=1).float()).float()).mean()  # FP32


def test_info_nce_with_temperature_stays_finite_and_equals_apexs_lists(device):
    casts._disable_o1_for_tests()  # amp.initialize switches O1 on itself
    model = _encoder().to(device)
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
    x1, x2 = _views(device)
    loss = _info_nce(model(x1), model(x2))
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    with casts.disable_casts():
        expected = _info_nce_by_apexs_lists(reference, x1, x2)
    assert torch.equal(loss, expected)

    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    with casts.disable_casts():
        (expected.float() * 2.0**16).backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad * 2.0**-16)  # amp unscaled by 1/S
    opt.step()  # not skipped: the grads were finite
    assert not torch.equal(model[0].weight, reference[0].weight)


def test_info_nce_under_cpu_autocast_alone_is_not_finite():
    # why the lists are needed on CPU: autocast alone runs exp in fp16 (here on a thread
    # without O1, as a script using torch.autocast directly would)
    model = _encoder()
    x1, x2 = _views("cpu")
    seen = {}

    def autocast_only():
        with torch.autocast("cpu", dtype=torch.float16):
            seen["loss"] = _info_nce(model(x1), model(x2))

    t = threading.Thread(target=autocast_only)
    t.start()
    t.join()
    assert not torch.isfinite(seen["loss"])
