"""Resuming from checkpoints of the legacy face: apex-era files read by
``fp16kit.legacy.load_checkpoint`` and loaded into ``FP16_Optimizer``, fp16kit's own state dicts
through ``torch.load(weights_only=True)``, structure mismatches refused without side effects, and
``map_location``. What ``load_checkpoint`` refuses (crafted pickles, files that are not
checkpoints) is tested in test_checkpoint_load.py; the ``fake_apex`` and ``save`` fixtures are in
conftest.py.

apex is not installed. Apex-format checkpoints are built here: small stand-in classes are
registered in ``sys.modules`` under apex's real module paths (``apex.fp16_utils.loss_scaler``,
``apex.amp.scaler``), pickled with ``torch.save`` and then *removed* before loading, which is
the situation of a user with an old checkpoint and no apex.

The scale sequences expected after loading are worked out by hand from the rules in
``docs/apex-fp16-optimizer.md`` (era 2: the clean-step counter ``_unskipped`` grows to ``scale_window``; era 1:
``(cur_iter - last_overflow_iter) % scale_window == 0``), and the weights are compared bit for
bit with a run that continues from the same numbers through fp16kit's own state dict.
"""

from __future__ import annotations

import copy
import io
import pathlib
import pickle
import sys
from collections import OrderedDict

import pytest
import torch
from torch import nn

from fp16kit import GradScaler, MixedPrecisionOptimizer
from fp16kit.legacy import FP16_Optimizer, load_checkpoint

INF = float("inf")

# ---------------------------------------------------------------------------------- a model


class Net(nn.Module):
    """fp16 layers in two param groups, an fp32 param and a frozen fp16 param."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.l1 = nn.Linear(4, 8).half()
            self.l2 = nn.Linear(8, 3).half()
            self.gain = nn.Parameter(torch.rand(3) + 0.5)  # fp32: optimized in place
            self.frozen = nn.Parameter(torch.full((3,), 1.0, dtype=torch.half), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.l1(x.half()))
        return self.l2(h).float() * self.gain * self.frozen.float()


def _inner(model: Net, kind: str = "sgd") -> torch.optim.Optimizer:
    groups = [
        {"params": list(model.l1.parameters())},
        {"params": [model.l2.weight, model.l2.bias, model.gain, model.frozen], "lr": 0.05},
    ]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=0.1, momentum=0.9)
    return torch.optim.Adam(groups, lr=1e-2)


def _legacy(model: Net, kind: str = "sgd", **kwargs) -> FP16_Optimizer:
    kwargs.setdefault("dynamic_loss_scale", True)
    return FP16_Optimizer(_inner(model, kind), verbose=False, **kwargs)


def _batches(n: int, seed: int = 123) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, 4, generator=g), torch.randn(6, 3, generator=g)) for _ in range(n)]


def _poison(x: torch.Tensor) -> torch.Tensor:
    """An inf input: the forward stays finite (tanh), the l1 weight grad is NaN (0 * inf)."""
    x = x.clone()
    x[0, 0] = INF
    return x


def _legacy_step(model, opt, x, y, overflow=False) -> bool:
    opt.zero_grad()
    loss = (model(_poison(x) if overflow else x) - y).pow(2).mean()
    opt.backward(loss)
    opt.step()
    return opt.overflow


def _trained(kind="sgd", seed=0, pattern=(False, False, True, False), **kwargs):
    model = Net(seed)
    opt = _legacy(model, kind, **kwargs)
    for (x, y), ov in zip(_batches(len(pattern), seed=7), pattern):
        _legacy_step(model, opt, x, y, ov)
    return model, opt


def _continue(model, opt, pattern, seed=99):
    scales, overflows, unskipped = [], [], []
    for (x, y), ov in zip(_batches(len(pattern), seed=seed), pattern):
        overflows.append(_legacy_step(model, opt, x, y, ov))
        scales.append(opt.loss_scale)
        unskipped.append(opt.loss_scaler._unskipped)
    return scales, overflows, unskipped


def _masters(opt) -> list[list[torch.Tensor]]:
    return [[m.detach().clone() for m in g] for g in opt.fp32_from_fp16_groups]


def _snapshot(model, opt) -> dict:
    return {
        "loss_scale": opt.loss_scale,
        "unskipped": opt.loss_scaler._unskipped,
        "scale_window": opt.loss_scaler._scale_seq_len,
        "scaler": opt.loss_scaler.state_dict(),
        "dynamic": opt.dynamic_loss_scale,
        "overflow": opt.overflow,
        "first_closure": opt.first_closure_call_this_step,
        "masters": _masters(opt),
        "fp32_params": [[p.detach().clone() for p in g] for g in opt.fp32_from_fp32_groups],
        "inner": copy.deepcopy(opt.optimizer.state_dict()),
        "model": {k: v.clone() for k, v in model.state_dict().items()},
    }


def _same(a, b, where="") -> None:
    """Exact (bitwise for tensors: dtype, shape, device, values) recursive equality."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), where
        assert (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device), where
        assert torch.equal(a, b), f"{where}: {a} != {b}"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            _same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{where}: {a!r} != {b!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert type(a) is type(b) and a == b, f"{where}: {a!r} != {b!r}"


def _fp16kit_form(src_opt, scaler: dict, dynamic: bool) -> dict:
    """An FP16_Optimizer state dict in fp16kit's own form with the given scaler numbers and
    the source's masters and inner optimizer state."""
    sd = src_opt.state_dict()
    sd["loss_scaler"] = dict(scaler)
    sd["dynamic_loss_scale"] = dynamic
    sd["overflow"] = False
    sd["first_closure_call_this_step"] = True
    return sd


def _apex_form(src_opt, scaler_obj, dynamic: bool) -> dict:
    """apex's FP16_Optimizer.state_dict(): the scaler *object* and the same six keys."""
    return {
        "loss_scaler": scaler_obj,
        "dynamic_loss_scale": dynamic,
        "overflow": False,
        "first_closure_call_this_step": True,
        "optimizer_state_dict": src_opt.optimizer.state_dict(),
        "fp32_from_fp16": _masters(src_opt),
    }


def _scaler_dict(
    loss_scale, *, dynamic=True, scale_factor=2.0, window=2000, unskipped=0, min_loss_scale=None, max_loss_scale=2.0**24
) -> dict:
    return {
        "dynamic": dynamic,
        "loss_scale": float(loss_scale),
        "scale_factor": scale_factor,
        "scale_window": window,
        "min_loss_scale": min_loss_scale,
        "max_loss_scale": max_loss_scale,
        "unskipped": unskipped,
    }


def _write_apex_checkpoint(apex, path, model, src_opt, scaler_obj, dynamic) -> pathlib.Path:
    """Save an apex-era checkpoint, then unregister apex (the user's situation)."""
    assert apex.installed
    torch.save({"model": model.state_dict(), "optimizer": _apex_form(src_opt, scaler_obj, dynamic)}, path)
    apex.remove()
    assert "apex" not in sys.modules and "apex.amp.scaler" not in sys.modules
    return pathlib.Path(path)


def _load_fresh(ckpt, kind="sgd", seed=1):
    """A new model/optimizer (different init) restored from ``ckpt`` in apex's load order."""
    model = Net(seed)
    opt = _legacy(model, kind)  # default dynamic args: window 2000, scale 2**16
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optimizer"])
    return model, opt


def _reference(tmp_path, src_model, src_opt, scaler: dict, dynamic: bool, kind="sgd"):
    """The same numbers through fp16kit's own state dict (a weights_only file)."""
    path = tmp_path / "fp16kit.pt"
    torch.save({"model": src_model.state_dict(), "optimizer": _fp16kit_form(src_opt, scaler, dynamic)}, path)
    return _load_fresh(torch.load(path, weights_only=True), kind)


# ================================================================ 1. apex-format checkpoints


def test_apex_scalers_come_back_as_plain_dicts(tmp_path, fake_apex, save):
    objs = [
        fake_apex.era1_static(128),
        fake_apex.era1_dynamic(512.0, 10, 5, 2.0, 4),
        fake_apex.era2(1024.0, window=4, unskipped=2),
    ]
    path = tmp_path / "scalers.pt"
    save({"scalers": objs, "t": torch.arange(3)}, path)
    fake_apex.remove()

    with pytest.raises(pickle.UnpicklingError, match=r"apex\.fp16_utils\.loss_scaler\.LossScaler"):
        torch.load(path, weights_only=True)  # why load_checkpoint exists

    out = load_checkpoint(path)
    assert all(type(d) is dict for d in out["scalers"])
    _same(out["scalers"][0], {"__apex_class__": "apex.fp16_utils.loss_scaler.LossScaler", "cur_scale": 128})
    _same(
        out["scalers"][1],
        {
            "__apex_class__": "apex.fp16_utils.loss_scaler.DynamicLossScaler",
            "cur_scale": 512.0,
            "cur_iter": 10,
            "last_overflow_iter": 5,
            "scale_factor": 2.0,
            "scale_window": 4,
        },
    )
    _same(
        out["scalers"][2],
        {
            "__apex_class__": "apex.amp.scaler.LossScaler",
            "dynamic": True,
            "_loss_scale": 1024.0,
            "_max_loss_scale": 2.0**24,
            "_min_loss_scale": None,
            "_scale_seq_len": 4,
            "_unskipped": 2,
            "_has_overflow": False,
            "_overflow_buf": torch.IntTensor([0]),
        },
    )
    _same(out["t"], torch.arange(3))
    assert "apex" not in sys.modules  # nothing imported or registered apex


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_era2_dynamic_checkpoint_continues_identically(tmp_path, fake_apex, kind):
    src_model, src_opt = _trained(kind)
    scaler = fake_apex.era2(1024.0, window=4, unskipped=2)
    path = _write_apex_checkpoint(fake_apex, tmp_path / "apex.pt", src_model, src_opt, scaler, True)

    with pytest.raises(pickle.UnpicklingError, match=r"apex\.amp\.scaler\.LossScaler"):
        torch.load(path, weights_only=True)
    ckpt = load_checkpoint(path)
    assert ckpt["optimizer"]["loss_scaler"]["__apex_class__"] == "apex.amp.scaler.LossScaler"

    model, opt = _load_fresh(ckpt, kind)
    assert (opt.loss_scale, opt.loss_scaler._unskipped, opt.loss_scaler._scale_seq_len) == (1024.0, 2, 4)
    assert opt.dynamic_loss_scale is True and opt.overflow is False
    # masters restored exactly (not re-derived from the fp16 model)
    _same(_masters(opt), _masters(src_opt))
    assert any(not torch.equal(m, p.float()) for m, p in zip(opt.all_fp32_from_fp16_params, opt.all_fp16_params))
    _same(opt.optimizer.state_dict()["state"], src_opt.optimizer.state_dict()["state"])

    ref_model, ref_opt = _reference(
        tmp_path, src_model, src_opt, _scaler_dict(1024.0, window=4, unskipped=2), True, kind
    )
    _same(_snapshot(model, opt), _snapshot(ref_model, ref_opt))

    pattern = [False, False, True, False, False, False, False, False]
    got = _continue(model, opt, pattern)
    want = _continue(ref_model, ref_opt, pattern)
    # era 2 by hand: unskipped 2 -> 3 -> 4 == window: x2, reset; overflow /2; four clean: x2
    assert got[0] == [1024.0, 2048.0, 1024.0, 1024.0, 1024.0, 1024.0, 2048.0, 2048.0]
    assert got[2] == [3, 0, 0, 1, 2, 3, 0, 1]
    assert got[1] == pattern
    assert got == want
    _same(_snapshot(model, opt), _snapshot(ref_model, ref_opt))


def test_era2_static_checkpoint_continues_identically(tmp_path, fake_apex):
    src_model, src_opt = _trained("sgd")
    scaler = fake_apex.era2(128.0, dynamic=False)
    path = _write_apex_checkpoint(fake_apex, tmp_path / "apex.pt", src_model, src_opt, scaler, False)
    model, opt = _load_fresh(load_checkpoint(path))  # built dynamic; the checkpoint is static
    assert opt.dynamic_loss_scale is False and opt.loss_scale == 128.0

    ref_model, ref_opt = _reference(tmp_path, src_model, src_opt, _scaler_dict(128.0, dynamic=False), False)
    pattern = [False] * 5
    got = _continue(model, opt, pattern)
    assert got[0] == [128.0] * 5 and got[1] == [False] * 5
    assert got == _continue(ref_model, ref_opt, pattern)
    _same(_snapshot(model, opt), _snapshot(ref_model, ref_opt))


def _apex_era1_scales(cur_scale, cur_iter, last_overflow_iter, factor, window, pattern):
    """apex's era-1 DynamicLossScaler.update_scale, verbatim from docs/apex-fp16-optimizer.md §5."""
    out = []
    for overflow in pattern:
        if overflow:
            cur_scale = max(cur_scale / factor, 1)
            last_overflow_iter = cur_iter
        elif (cur_iter - last_overflow_iter) % window == 0:
            cur_scale *= factor
        cur_iter += 1
        out.append(cur_scale)
    return out


ERA1_CASES = {
    # (cur_scale, cur_iter, last_overflow_iter, scale_factor, scale_window), pattern, scales by hand
    # (10-5)%4=1, 2, 3, then (13-5)%4==0 grows; overflow at 14; (18-14)%4==0 grows
    "mid-window": (
        (512.0, 10, 5, 2.0, 4),
        [0, 0, 0, 0, 1, 0, 0, 0, 0, 0],
        [512, 512, 512, 1024, 512, 512, 512, 512, 1024, 1024],
    ),
    # never overflowed (last=-1), int scale as apex kept it: (8)%3, (9)%3==0 grows, (12)%3==0 grows
    "never-overflowed-int-scale": ((1024, 7, -1, 2.0, 3), [0, 0, 0, 0, 0], [1024, 2048, 2048, 2048, 4096]),
    # scale_factor 4 carried: (1)%2, overflow /4 at 4, (5-4)%2, (6-4)%2==0 x4
    "factor-4": ((256.0, 3, 2, 4.0, 2), [0, 1, 0, 0], [256, 64, 64, 256]),
    # just grew at cur_iter-1 ((9-1)%4==0): next growth 4 clean steps later
    "just-grew": ((64.0, 10, 1, 2.0, 4), [0, 0, 0, 0, 0], [64, 64, 64, 128, 128]),
}


@pytest.mark.parametrize("case", list(ERA1_CASES))
def test_era1_dynamic_checkpoint_grows_when_apex_would_and_continues_identically(tmp_path, fake_apex, case):
    (cur_scale, cur_iter, last, factor, window), pattern, by_hand = ERA1_CASES[case]
    pattern = [bool(p) for p in pattern]
    assert _apex_era1_scales(cur_scale, cur_iter, last, factor, window, pattern) == by_hand

    src_model, src_opt = _trained("sgd")
    scaler = fake_apex.era1_dynamic(cur_scale, cur_iter, last, factor, window)
    path = _write_apex_checkpoint(fake_apex, tmp_path / "apex.pt", src_model, src_opt, scaler, True)
    with pytest.raises(pickle.UnpicklingError, match=r"apex\.fp16_utils\.loss_scaler\.DynamicLossScaler"):
        torch.load(path, weights_only=True)
    ckpt = load_checkpoint(path)
    assert ckpt["optimizer"]["loss_scaler"]["__apex_class__"] == "apex.fp16_utils.loss_scaler.DynamicLossScaler"

    model, opt = _load_fresh(ckpt)  # apex itself crashed here ("'float' object is not callable")
    assert opt.dynamic_loss_scale is True
    assert opt.loss_scale == cur_scale and opt.loss_scaler._scale_seq_len == window
    _same(_masters(opt), _masters(src_opt))

    got = _continue(model, opt, pattern)
    assert got[1] == pattern
    assert got[0] == [float(s) for s in by_hand]

    # the same numbers through fp16kit's own form: clean steps since the last overflow,
    # modulo the window, are era 2's counter; era 1's floor of 1 and no cap come along
    ref_model, ref_opt = _reference(
        tmp_path,
        src_model,
        src_opt,
        _scaler_dict(
            cur_scale,
            scale_factor=factor,
            window=window,
            unskipped=(cur_iter - last - 1) % window,
            min_loss_scale=1.0,
            max_loss_scale=None,
        ),
        True,
    )
    assert got == _continue(ref_model, ref_opt, pattern)
    _same(_snapshot(model, opt), _snapshot(ref_model, ref_opt))


@pytest.mark.parametrize("cur_scale", [128, 0.5])
def test_era1_static_checkpoint_continues_identically(tmp_path, fake_apex, cur_scale):
    src_model, src_opt = _trained("sgd")
    scaler = fake_apex.era1_static(cur_scale)
    path = _write_apex_checkpoint(fake_apex, tmp_path / "apex.pt", src_model, src_opt, scaler, False)
    with pytest.raises(pickle.UnpicklingError, match=r"apex\.fp16_utils\.loss_scaler\.LossScaler"):
        torch.load(path, weights_only=True)

    model, opt = _load_fresh(load_checkpoint(path))
    assert opt.dynamic_loss_scale is False and opt.loss_scale == cur_scale
    ref_model, ref_opt = _reference(tmp_path, src_model, src_opt, _scaler_dict(cur_scale, dynamic=False), False)
    pattern = [False] * 4
    got = _continue(model, opt, pattern)
    assert got[0] == [float(cur_scale)] * 4 and got[1] == [False] * 4
    assert got == _continue(ref_model, ref_opt, pattern)
    _same(_snapshot(model, opt), _snapshot(ref_model, ref_opt))


def test_live_apex_objects_load_like_their_dicts(tmp_path, fake_apex, save):
    """With apex installed (torch.load(weights_only=False) gives live objects), the same
    checkpoint loads to the same state as through load_checkpoint's dicts."""
    src_model, src_opt = _trained("sgd")
    for scaler in (
        fake_apex.era2(512.0, window=3, unskipped=1),
        fake_apex.era1_dynamic(512.0, 9, 4, 2.0, 3),
        fake_apex.era1_static(64),
    ):
        live = {"model": src_model.state_dict(), "optimizer": _apex_form(src_opt, scaler, True)}
        path = save(live, tmp_path / "x.pt")
        fake_apex.remove()
        via_file = _load_fresh(load_checkpoint(path))
        fake_apex.install()
        via_live = _load_fresh(live)
        _same(_snapshot(*via_live), _snapshot(*via_file))


@pytest.mark.parametrize("form", ["fp16kit", "era2", "era1"])
def test_loaded_scale_is_the_saved_scale_even_above_max_loss_scale(tmp_path, fake_apex, form, save):
    """load_state_dict restores the scale it is given. Scales above FP16_Optimizer's
    max_loss_scale (2**24) occur in real checkpoints: apex's loss_scale setter wrote any value
    (era 2), and era-1 FP16_Optimizer started at DynamicLossScaler's 2**32 with no cap."""
    src_model, src_opt = _trained("sgd")
    if form == "fp16kit":
        src_opt.loss_scale = 2.0**30  # the documented setter
        assert src_opt.loss_scale == 2.0**30
        sd = src_opt.state_dict()
        path = save({"model": src_model.state_dict(), "optimizer": sd}, tmp_path / "own.pt")
        expected = 2.0**30
    elif form == "era2":
        path = _write_apex_checkpoint(
            fake_apex, tmp_path / "apex.pt", src_model, src_opt, fake_apex.era2(2.0**30, unskipped=5), True
        )
        expected = 2.0**30
    else:  # era-1 default: a checkpoint written before the first step
        path = _write_apex_checkpoint(
            fake_apex, tmp_path / "apex.pt", src_model, src_opt, fake_apex.era1_dynamic(), True
        )
        expected = 2.0**32
    model, opt = _load_fresh(load_checkpoint(path))
    assert opt.loss_scale == expected


# ======================================================== 3. fp16kit's own state dicts


@pytest.mark.parametrize("loader", ["weights_only", "load_checkpoint"])
@pytest.mark.parametrize("dynamic", [True, False])
def test_fp16_optimizer_state_dict_round_trip_and_bitwise_resume(tmp_path, loader, dynamic, save):
    kw = {"dynamic_loss_args": {"init_scale": 2.0**10, "scale_window": 3}} if dynamic else {"static_loss_scale": 64.0}
    pattern = (False, True, False, False) if dynamic else (False, False, False)
    src_model, src_opt = _trained("adam", dynamic_loss_scale=dynamic, pattern=pattern, **kw)
    sd = src_opt.state_dict()
    assert list(sd) == [
        "loss_scaler",
        "dynamic_loss_scale",
        "overflow",
        "first_closure_call_this_step",
        "optimizer_state_dict",
        "fp32_from_fp16",
    ]
    assert type(sd["loss_scaler"]) is dict
    path = save({"model": src_model.state_dict(), "optimizer": sd}, tmp_path / "own.pt")
    ckpt = torch.load(path, weights_only=True) if loader == "weights_only" else load_checkpoint(path)

    model, opt = _load_fresh(ckpt, "adam")
    _same(_snapshot(model, opt), _snapshot(src_model, src_opt))
    cont = [False, False, True, False, False, False]
    if not dynamic:
        cont = [False] * 4
    assert _continue(model, opt, cont) == _continue(src_model, src_opt, cont)
    _same(_snapshot(model, opt), _snapshot(src_model, src_opt))


def test_fp16_optimizer_state_saved_in_overflow_state_restores_it(tmp_path, save):
    src_model, src_opt = _trained("sgd", pattern=(False, True))
    assert src_opt.overflow is True
    path = save({"model": src_model.state_dict(), "optimizer": src_opt.state_dict()}, tmp_path / "own.pt")
    model, opt = _load_fresh(torch.load(path, weights_only=True))
    assert opt.overflow is True
    assert opt.step() is None  # skipped, as the source would
    _same(_snapshot(model, opt), _snapshot(src_model, src_opt))


def test_load_checkpoint_returns_what_weights_only_load_returns(tmp_path, save):
    src_model, src_opt = _trained("sgd")
    path = save({"model": src_model.state_dict(), "optimizer": src_opt.state_dict(), "epoch": 3}, tmp_path / "own.pt")
    a = torch.load(path, weights_only=True)
    b = load_checkpoint(path)
    _same(b, a)
    assert type(b["model"]) is OrderedDict
    # module state_dict versions (used by _load_from_state_dict) survive, as with torch.load
    assert getattr(a["model"], "_metadata", None) is not None
    assert getattr(b["model"], "_metadata", None) == a["model"]._metadata


def _amp_step(model, mpo, scaler, x, y, overflow=False):
    mpo.zero_grad()
    loss = (model(_poison(x) if overflow else x) - y).pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(mpo)
    scaler.update()
    return scaler.get_scale()


def _amp_setup(seed):
    model = Net(seed)
    mpo = MixedPrecisionOptimizer(_inner(model, "adam"))
    scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    return model, mpo, scaler


def _mpo_snapshot(model, mpo):
    return {
        "masters": [m.detach().clone() for m in mpo.master_params],
        "inner": copy.deepcopy(mpo.optimizer.state_dict()),
        "model": {k: v.clone() for k, v in model.state_dict().items()},
    }


def _amp_snapshot(model, mpo, scaler):
    return {**_mpo_snapshot(model, mpo), "scaler": scaler.state_dict()}


@pytest.mark.parametrize("loader", ["weights_only", "load_checkpoint"])
def test_mixed_precision_optimizer_and_grad_scaler_round_trip_and_bitwise_resume(tmp_path, loader, save):
    src = _amp_setup(0)
    for (x, y), ov in zip(_batches(4, seed=7), (False, True, False, False)):
        _amp_step(*src, x, y, ov)
    sd = src[1].state_dict()
    assert list(sd) == ["optimizer", "masters"]
    path = save({"model": src[0].state_dict(), "optimizer": sd, "scaler": src[2].state_dict()}, tmp_path / "amp.pt")
    ckpt = torch.load(path, weights_only=True) if loader == "weights_only" else load_checkpoint(path)

    dst = _amp_setup(1)
    dst[0].load_state_dict(ckpt["model"])
    dst[1].load_state_dict(ckpt["optimizer"])
    dst[2].load_state_dict(ckpt["scaler"])
    _same(_amp_snapshot(*dst), _amp_snapshot(*src))
    cont = [False, False, True, False, False, False]
    scales_src = [_amp_step(*src, x, y, ov) for (x, y), ov in zip(_batches(6, 99), cont)]
    scales_dst = [_amp_step(*dst, x, y, ov) for (x, y), ov in zip(_batches(6, 99), cont)]
    assert scales_dst == scales_src
    assert len(set(scales_src)) > 1  # the scale moved (growth and backoff)
    _same(_amp_snapshot(*dst), _amp_snapshot(*src))


@pytest.mark.parametrize("loader", ["weights_only", "load_checkpoint"])
@pytest.mark.parametrize("extras", [{}, {"hysteresis": 2, "min_scale": 1.0, "max_scale": 2.0**20}])
def test_grad_scaler_state_dict_round_trip(tmp_path, loader, extras, save):
    src = GradScaler("cpu", init_scale=2.0**12, growth_interval=2, **extras)
    # drive the state through the public API: overflow via inf grads
    p = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.0)
    for bad in (False, True, False, False, True):
        opt.zero_grad()
        src.scale((p * (INF if bad else 1.0)).sum()).backward()
        src.step(opt)
        src.update()
    sd = src.state_dict()
    path = save({"scaler": sd}, tmp_path / "s.pt")
    loaded = torch.load(path, weights_only=True) if loader == "weights_only" else load_checkpoint(path)
    _same(loaded["scaler"], sd)
    dst = GradScaler("cpu", **extras)
    dst.load_state_dict(loaded["scaler"])
    _same(dst.state_dict(), sd)
    assert dst.get_scale() == src.get_scale()


# ========================================================= 4. mismatched structure


def _target():
    model, opt = _trained("sgd", seed=3, dynamic_loss_args={"init_scale": 2.0**8, "scale_window": 5})
    return model, opt


def _bad_scaler_forms():
    return {
        "fp16kit": _scaler_dict(4.0, window=7, unskipped=3),
        "era2": {
            "__apex_class__": "apex.amp.scaler.LossScaler",
            "dynamic": True,
            "_loss_scale": 4.0,
            "_max_loss_scale": 2.0**24,
            "_min_loss_scale": None,
            "_scale_seq_len": 7,
            "_unskipped": 3,
            "_has_overflow": False,
            "_overflow_buf": torch.IntTensor([0]),
        },
        "era1": {
            "__apex_class__": "apex.fp16_utils.loss_scaler.DynamicLossScaler",
            "cur_scale": 4.0,
            "cur_iter": 9,
            "last_overflow_iter": 2,
            "scale_factor": 2.0,
            "scale_window": 7,
        },
    }


def _assert_load_refused_unchanged(model, opt, bad, match):
    before = _snapshot(model, opt)
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(bad)
    _same(_snapshot(model, opt), before)


@pytest.mark.parametrize("form", ["fp16kit", "era2", "era1"])
def test_wrong_number_of_groups_raises_and_changes_nothing(form):
    model, opt = _target()
    one_group = Net(5)
    src = FP16_Optimizer(torch.optim.SGD(one_group.parameters(), lr=0.1, momentum=0.9), verbose=False)
    bad = src.state_dict()
    bad["loss_scaler"] = _bad_scaler_forms()[form]
    assert len(bad["fp32_from_fp16"]) == 1
    _assert_load_refused_unchanged(model, opt, bad, r"\b1 param groups\b.*\b2\b")

    bad = opt.state_dict()
    bad["loss_scaler"] = _bad_scaler_forms()[form]
    bad["fp32_from_fp16"] = bad["fp32_from_fp16"] + [[torch.zeros(3)]]
    _assert_load_refused_unchanged(model, opt, bad, r"\b3 param groups\b.*\b2\b")


@pytest.mark.parametrize("form", ["fp16kit", "era2", "era1"])
def test_wrong_number_of_masters_in_a_group_raises_and_changes_nothing(form):
    model, opt = _target()
    bad = opt.state_dict()
    bad["loss_scaler"] = _bad_scaler_forms()[form]
    bad["fp32_from_fp16"] = [list(bad["fp32_from_fp16"][0]), bad["fp32_from_fp16"][1][:1]]
    _assert_load_refused_unchanged(model, opt, bad, r"[Gg]roup 1\b.*\b1 master.*\b2\b")

    bad = opt.state_dict()
    bad["loss_scaler"] = _bad_scaler_forms()[form]
    bad["fp32_from_fp16"] = [bad["fp32_from_fp16"][0] + [torch.zeros(8)], list(bad["fp32_from_fp16"][1])]
    _assert_load_refused_unchanged(model, opt, bad, r"[Gg]roup 0\b.*\b3 master.*\b2\b")


@pytest.mark.parametrize("form", ["fp16kit", "era2", "era1"])
def test_wrong_master_shape_raises_and_changes_nothing(form):
    model, opt = _target()
    bad = opt.state_dict()
    bad["loss_scaler"] = _bad_scaler_forms()[form]
    bad["fp32_from_fp16"] = [[torch.zeros(8, 5), bad["fp32_from_fp16"][0][1]], list(bad["fp32_from_fp16"][1])]
    _assert_load_refused_unchanged(model, opt, bad, r"[Gg]roup 0\b.*\(8, 5\).*\(8, 4\)")

    bad = opt.state_dict()
    bad["loss_scaler"] = _bad_scaler_forms()[form]
    bad["fp32_from_fp16"] = [list(bad["fp32_from_fp16"][0]), [bad["fp32_from_fp16"][1][0], torch.zeros(4)]]
    _assert_load_refused_unchanged(model, opt, bad, r"[Gg]roup 1\b.*\(4,\).*\(3,\)")


def test_mismatched_inner_optimizer_state_raises_and_changes_nothing():
    model, opt = _target()
    bad = opt.state_dict()
    bad["loss_scaler"] = _bad_scaler_forms()["fp16kit"]
    inner = copy.deepcopy(bad["optimizer_state_dict"])
    inner["param_groups"][1]["params"] = inner["param_groups"][1]["params"][:-1]
    bad["optimizer_state_dict"] = inner
    _assert_load_refused_unchanged(model, opt, bad, r"(?i)group")


class _Unknown:
    def __init__(self) -> None:
        self.cur_scale = 8.0


UNRECOGNIZED = {
    "unknown-class-object": _Unknown(),
    "unknown-apex-class": {"__apex_class__": "apex.amp.scaler.Evil", "_loss_scale": 8.0},
    "era2-missing-attrs": {"__apex_class__": "apex.amp.scaler.LossScaler", "_loss_scale": 8.0},
    "era1-missing-attrs": {"__apex_class__": "apex.fp16_utils.loss_scaler.DynamicLossScaler", "cur_scale": 8.0},
    "fp16kit-incomplete": {"dynamic": True, "loss_scale": 8.0},
    "empty-dict": {},
    "float": 65536.0,
    "none": None,
    "plain-object": object(),
}


@pytest.mark.parametrize("name", list(UNRECOGNIZED))
def test_unrecognized_loss_scaler_raises_value_error_and_changes_nothing(name):
    model, opt = _target()
    bad = opt.state_dict()
    bad["loss_scaler"] = UNRECOGNIZED[name]
    before = _snapshot(model, opt)
    with pytest.raises(ValueError, match="loss scaler"):
        opt.load_state_dict(bad)
    _same(_snapshot(model, opt), before)


def test_mixed_precision_optimizer_mismatch_raises_and_changes_nothing():
    model = Net(0)
    mpo = MixedPrecisionOptimizer(_inner(model, "sgd"))
    for x, y in _batches(2):
        mpo.zero_grad()
        (model(x) - y).pow(2).mean().backward()
        mpo.step()
    before = _mpo_snapshot(model, mpo)
    for masters, match in (
        ([list(mpo.state_dict()["masters"][0])], r"\b1 param groups\b.*\b2\b"),
        ([list(mpo.state_dict()["masters"][0]), []], r"[Gg]roup 1\b.*\b0 master.*\b2\b"),
        (
            [[torch.zeros(2, 2), mpo.state_dict()["masters"][0][1]], list(mpo.state_dict()["masters"][1])],
            r"[Gg]roup 0\b.*\(2, 2\).*\(8, 4\)",
        ),
    ):
        bad = {"optimizer": copy.deepcopy(mpo.optimizer.state_dict()), "masters": masters}
        bad["optimizer"]["param_groups"][0]["lr"] = 123.0
        with pytest.raises(ValueError, match=match):
            mpo.load_state_dict(bad)
        _same(_mpo_snapshot(model, mpo), before)


# ============================================================================ 5. map_location


@pytest.mark.parametrize(
    "map_location",
    [None, "cpu", torch.device("cpu"), {"cpu": "cpu"}, lambda storage, loc: storage],
    ids=["none", "str", "device", "dict", "callable"],
)
def test_cpu_saved_apex_checkpoint_loads_with_map_location(tmp_path, fake_apex, map_location):
    src_model, src_opt = _trained("sgd")
    path = _write_apex_checkpoint(
        fake_apex, tmp_path / "apex.pt", src_model, src_opt, fake_apex.era2(512.0, window=3), True
    )
    ckpt = load_checkpoint(path, map_location=map_location)
    assert ckpt["optimizer"]["loss_scaler"]["_overflow_buf"].device.type == "cpu"
    assert all(t.device.type == "cpu" for g in ckpt["optimizer"]["fp32_from_fp16"] for t in g)
    model, opt = _load_fresh(ckpt)
    _same(_masters(opt), _masters(src_opt))
    assert opt.loss_scale == 512.0


@pytest.mark.parametrize("how", ["str", "path", "file", "bytesio"])
def test_load_checkpoint_takes_paths_and_file_objects(tmp_path, fake_apex, how):
    src_model, src_opt = _trained("sgd")
    path = _write_apex_checkpoint(fake_apex, tmp_path / "apex.pt", src_model, src_opt, fake_apex.era1_static(32), False)
    if how == "str":
        ckpt = load_checkpoint(str(path))
    elif how == "path":
        ckpt = load_checkpoint(path)
    elif how == "file":
        with open(path, "rb") as f:
            ckpt = load_checkpoint(f)
    else:
        ckpt = load_checkpoint(io.BytesIO(path.read_bytes()))
    assert ckpt["optimizer"]["loss_scaler"] == {
        "__apex_class__": "apex.fp16_utils.loss_scaler.LossScaler",
        "cur_scale": 32,
    }


def _save_tagged_cuda(obj, path, monkeypatch):
    """torch.save with every storage recorded as saved on cuda:0 (what apex's GPU-only code
    wrote: masters, optimizer state and ``_overflow_buf`` were CUDA tensors)."""
    with monkeypatch.context() as m:
        m.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        torch.save(obj, path)
    return pathlib.Path(path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only default of map_location")
def test_cuda_tagged_apex_checkpoint_loads_on_a_cpu_only_machine(tmp_path, fake_apex, monkeypatch):
    src_model, src_opt = _trained("sgd")
    ckpt_obj = {
        "model": src_model.state_dict(),
        "optimizer": _apex_form(src_opt, fake_apex.era2(256.0, window=3, unskipped=1), True),
    }
    path = _save_tagged_cuda(ckpt_obj, tmp_path / "gpu.pt", monkeypatch)
    fake_apex.remove()
    tensors_only = _save_tagged_cuda({"t": torch.arange(3.0)}, tmp_path / "t.pt", monkeypatch)
    with pytest.raises(RuntimeError, match="CUDA"):
        torch.load(tensors_only, weights_only=True)  # torch's default map_location
    assert load_checkpoint(tensors_only)["t"].device.type == "cpu"
    for ml in (None, "cpu"):
        ckpt = load_checkpoint(path, map_location=ml)
        assert ckpt["optimizer"]["loss_scaler"]["_overflow_buf"].device.type == "cpu"
        model, opt = _load_fresh(ckpt)
        _same(_masters(opt), _masters(src_opt))
        assert (opt.loss_scale, opt.loss_scaler._unskipped) == (256.0, 1)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_saved_apex_checkpoint_maps_to_cpu_and_loads_on_cuda(tmp_path, fake_apex):
    src_model = Net(0).cuda()
    src_opt = _legacy(src_model, "sgd")
    for x, y in _batches(2, seed=7):
        _legacy_step(src_model, src_opt, x.cuda(), y.cuda())
    scaler = fake_apex.era2(512.0, window=3, unskipped=1)
    scaler._overflow_buf = scaler._overflow_buf.cuda()
    path = _write_apex_checkpoint(fake_apex, tmp_path / "gpu.pt", src_model, src_opt, scaler, True)

    on_cpu = load_checkpoint(path, map_location="cpu")
    assert on_cpu["optimizer"]["loss_scaler"]["_overflow_buf"].device.type == "cpu"
    assert all(t.device.type == "cpu" for g in on_cpu["optimizer"]["fp32_from_fp16"] for t in g)
    cpu_model, cpu_opt = _load_fresh(on_cpu)
    _same(_masters(cpu_opt), [[m.cpu() for m in g] for g in _masters(src_opt)])

    on_gpu = load_checkpoint(path)
    assert on_gpu["optimizer"]["loss_scaler"]["_overflow_buf"].device.type == "cuda"
    gpu_model = Net(1).cuda()
    gpu_opt = _legacy(gpu_model, "sgd")
    gpu_model.load_state_dict(on_gpu["model"])
    gpu_opt.load_state_dict(on_gpu["optimizer"])
    _same(_masters(gpu_opt), _masters(src_opt))
    assert (gpu_opt.loss_scale, gpu_opt.loss_scaler._unskipped) == (512.0, 1)


def test_era1_scale_keeps_growing_past_era2s_cap(tmp_path, fake_apex):
    from fp16kit.legacy.checkpoints.load import scaler_state
    from fp16kit.legacy.fp16_optimizer import AmpLossScaler

    saved = {
        "__apex_class__": "apex.fp16_utils.loss_scaler.DynamicLossScaler",
        "cur_scale": 2**30,
        "cur_iter": 10,
        "last_overflow_iter": 9,
        "scale_factor": 2.0,
        "scale_window": 1,
    }
    current = AmpLossScaler("dynamic").state_dict()
    state = scaler_state(saved, current=current)
    assert state["min_loss_scale"] == 1.0 and state["max_loss_scale"] is None
    scaler = AmpLossScaler.from_state(state, "cpu")
    seen = []
    for found in [0.0, 0.0, 1.0]:
        scaler.update(torch.tensor(found))
        seen.append(scaler.loss_scale())
    assert seen == [2.0**31, 2.0**32, 2.0**31]  # era 1: no cap (era 2 would stop at 2**24)
    floor = AmpLossScaler.from_state({**state, "loss_scale": 1.5}, "cpu")
    floor.update(torch.tensor(1.0))
    assert floor.loss_scale() == 1.0  # era 1's floor
