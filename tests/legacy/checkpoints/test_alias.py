"""apex-era checkpoints read under fp16kit's apex alias (``fp16kit run``). The FULL unpickler,
``torch.load(f, weights_only=False)`` -- what torch's own error tells people to pass today --, and
torch.load's default, ``torch.load(f)`` -- what 2019 scripts wrote, weights_only=True since torch
2.6, for which the alias allow-lists fp16kit's scaler classes under apex's paths -- make fp16kit's
class of each pickled apex (or Megatron) scaler, with the apex object's attributes. Those objects
must work as apex's did and be accepted wherever apex's were: FP16_Optimizer.load_state_dict
(era-1 and era-2 scalers), amp.load_state_dict, Megatron's FP16_Optimizer, and -- saved again --
load_checkpoint and convert-checkpoint. A scaler whose attributes are not apex's, and any other
global, are still refused.

apex is not installed: the files are written by the ``fake_apex`` / ``stand_ins`` fixtures
(conftest.py: classes under apex's and Megatron's module paths with their attribute names), which
are removed before the alias is installed, as on a machine without apex. The scales expected
after a resume are worked out by hand from the rules (era 2: ``_unskipped`` counts clean steps up to
the window; era 1: grow when ``(cur_iter - last_overflow_iter) % scale_window == 0``); weights are
compared bit for bit with a run resumed from fp16kit's own state dict holding the same numbers.
"""

from __future__ import annotations

import copy
import io
import pickle
import sys

import pytest
import torch
from torch import nn

from _helpers.fp16_optimizer import loss_fn, make_model, two_groups
from fp16kit.cli import main as cli_main
from fp16kit.legacy import FP16_Optimizer, amp, load_checkpoint
from fp16kit.legacy.apex_alias import install_apex_alias, uninstall_apex_alias
from fp16kit.legacy.checkpoints.records import CLASS_KEY, FP16KIT_SCALER_CLASSES, SCALER_CLASSES
from fp16kit.legacy.megatron import FP16_Optimizer as MegatronOptimizer

INF = float("inf")


@pytest.fixture
def alias():
    """``alias(megatron=False)``: install fp16kit's apex alias (undone afterwards)."""
    yield lambda megatron=False: install_apex_alias(megatron=megatron)
    uninstall_apex_alias()


def _saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _apex_file(fakes, obj) -> bytes:
    """``obj`` saved while the stand-ins are registered, which are then removed (no apex here)."""
    data = _saved(obj)
    fakes.remove()
    assert "apex" not in sys.modules
    return data


def _full_load(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False)


def _default_load(data: bytes):
    """``torch.load(f)`` as 2019 scripts wrote it (torch >= 2.6: weights_only=True)."""
    return torch.load(io.BytesIO(data))


LOADS = {"full": _full_load, "default": _default_load}


# ------------------------------------------------------------------------------- a loop


def _optimizer(model) -> FP16_Optimizer:
    """fp16 layers in two groups, an fp32 param optimized in place, a frozen fp16 param."""
    return FP16_Optimizer(
        torch.optim.SGD(two_groups(model, 0.1, 0.05), lr=0.1, momentum=0.9), dynamic_loss_scale=True, verbose=False
    )


def _steps(model, opt, pattern, seed=5):
    """One backward and step per entry (True: an inf input, so the l1 grads are NaN); the scale
    and clean-step count after each."""
    g = torch.Generator().manual_seed(seed)
    seen = []
    for overflow in pattern:
        x, y = torch.randn(6, 8, generator=g).half(), torch.randn(6, 8, generator=g)
        if overflow:
            x[0, 0] = INF
        opt.zero_grad()
        opt.backward(loss_fn(model, x, y))
        opt.step()
        seen.append((opt.loss_scale, opt.loss_scaler._unskipped))
    return seen


def _trained():
    model = make_model(torch.float16, seed=0)
    opt = _optimizer(model)
    _steps(model, opt, [False, True, False], seed=1)
    return model, opt


def _apex_form(opt, scaler, dynamic=True) -> dict:
    """apex's FP16_Optimizer.state_dict(): the scaler object beside the same five keys."""
    return {
        "loss_scaler": scaler,
        "dynamic_loss_scale": dynamic,
        "overflow": False,
        "first_closure_call_this_step": True,
        "optimizer_state_dict": opt.optimizer.state_dict(),
        "fp32_from_fp16": [[m.detach().clone() for m in g] for g in opt.fp32_from_fp16_groups],
    }


def _fp16kit_form(opt, **scaler) -> dict:
    sd = _apex_form(opt, None)
    sd["loss_scaler"] = {
        "dynamic": True,
        "loss_scale": 1024.0,
        "scale_factor": 2.0,
        "scale_window": 3,
        "min_loss_scale": None,
        "max_loss_scale": 2.0**24,
        "unskipped": 1,
        **scaler,
    }
    return sd


def _resumed(ckpt, pattern):
    model = make_model(torch.float16, seed=1)  # another init: everything must come from the checkpoint
    opt = _optimizer(model)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optimizer"])
    return model, opt, _steps(model, opt, pattern)


def _same_run(a, b) -> None:
    (model_a, opt_a, seen_a), (model_b, opt_b, seen_b) = a, b
    assert seen_a == seen_b
    for p, q in zip(model_a.state_dict().values(), model_b.state_dict().values()):
        assert torch.equal(p, q)
    for ga, gb in zip(opt_a.fp32_from_fp16_groups, opt_b.fp32_from_fp16_groups):
        assert all(torch.equal(m, n) for m, n in zip(ga, gb))
    state_a, state_b = opt_a.optimizer.state_dict()["state"], opt_b.optimizer.state_dict()["state"]
    assert all(torch.equal(state_a[k]["momentum_buffer"], state_b[k]["momentum_buffer"]) for k in state_a)


# era 2, window 3, one clean step counted: clean (2), clean (3 = window: doubles, 0), overflow
# (halves, 0), clean (1)
ERA2_PATTERN = [False, False, True, False]
ERA2_SEEN = [(1024.0, 2), (2048.0, 0), (1024.0, 0), (1024.0, 1)]
# era 1: cur_iter 7, last overflow at 4, window 3: (7 - 4) % 3 == 0 grows at the next clean
# step; after the overflow at iteration 8 the next growth is at iteration 11 (the fifth step)
ERA1_PATTERN = [False, True, False, False, False]
ERA1_SEEN = [(2048.0, 0), (1024.0, 0), (1024.0, 1), (1024.0, 2), (2048.0, 0)]


# ------------------------------------------------------------------- what the alias makes


def test_each_apex_scaler_becomes_the_fp16kit_class_the_table_names(fake_apex, alias):
    data = _apex_file(
        fake_apex,
        [
            fake_apex.era1_static(128.0),
            fake_apex.era1_dynamic(2.0**10, 7, 4, 2.0, 3),
            fake_apex.era2(1024.0, window=3, unskipped=1),
        ],
    )
    alias()
    loaded = _full_load(data)
    paths = [f"{type(o).__module__}.{type(o).__qualname__}" for o in loaded]
    assert [FP16KIT_SCALER_CLASSES[p] for p in paths] == [
        "apex.fp16_utils.loss_scaler.LossScaler",
        "apex.fp16_utils.loss_scaler.DynamicLossScaler",
        "apex.amp.scaler.LossScaler",
    ]
    static, era1, era2 = loaded
    assert static.cur_scale == 128.0 and static.loss_scale == 128.0
    assert (era1.cur_scale, era1.cur_iter, era1.last_overflow_iter, era1.scale_factor, era1.scale_window) == (
        1024.0,
        7,
        4,
        2.0,
        3,
    )
    # apex's era-2 attributes read back (this object used to lack everything its methods need)
    assert (
        era2.dynamic,
        era2.loss_scale(),
        era2._loss_scale,
        era2._unskipped,
        era2._scale_seq_len,
        era2._min_loss_scale,
        era2._max_loss_scale,
    ) == (True, 1024.0, 1024.0, 1, 3, None, 2.0**24)
    assert repr(era2) == "LossScaler(dynamic=True, loss_scale=1024.0, unskipped=1)"


@pytest.mark.parametrize("megatron", [False, True])
def test_the_table_is_what_the_alias_resolves_apex_paths_to(alias, megatron):
    alias(megatron)
    unpickler = pickle.Unpickler(io.BytesIO(b""))
    for path in SCALER_CLASSES:
        if path.startswith(("megatron.", "fp16.")) and not megatron:
            continue
        cls = unpickler.find_class(*path.rsplit(".", 1))
        mine = f"{cls.__module__}.{cls.__qualname__}"
        assert mine in FP16KIT_SCALER_CLASSES, path
        # the apex class it stands for: the one pickled, or (Megatron's two module paths) its twin
        assert FP16KIT_SCALER_CLASSES[mine].rpartition(".")[2] == path.rpartition(".")[2]
        assert FP16KIT_SCALER_CLASSES[mine] in SCALER_CLASSES


def test_an_unpickled_era2_scaler_works_as_apex_s(fake_apex, alias):
    """Kept by a script (or amp), it scales and updates by apex's rule from the saved numbers."""
    data = _apex_file(fake_apex, fake_apex.era2(1024.0, window=3, unskipped=1, min_loss_scale=512.0))
    alias()
    scaler = _full_load(data)
    seen = []
    for overflow in [False, False, True, True, False]:
        scaler.clear_overflow_state()
        if overflow:
            scaler._overflow_buf.fill_(1)  # what apex's kernels set on inf/NaN
        skipped = scaler.update_scale()
        seen.append((skipped, scaler.loss_scale(), scaler._unskipped))
    # the floor of 512 holds the second overflow (apex: max(min_loss_scale, scale / 2))
    assert seen == [(False, 1024.0, 2), (False, 2048.0, 0), (True, 1024.0, 0), (True, 512.0, 0), (False, 512.0, 1)]


def test_an_era2_scaler_pickled_before_min_loss_scale_existed_has_no_floor(fake_apex, alias):
    old = fake_apex.era2(2.0, window=3)
    del old._min_loss_scale
    data = _apex_file(fake_apex, old)
    alias()
    scaler = _full_load(data)
    assert scaler._min_loss_scale is None
    scaler._overflow_buf.fill_(1)
    scaler.update_scale()
    assert scaler.loss_scale() == 1.0  # halved below any floor apex later defaulted to


def test_a_scaler_without_apex_s_attributes_is_refused_by_name(fake_apex, alias):
    broken = fake_apex.era2(1024.0)
    del broken._scale_seq_len
    data = _apex_file(fake_apex, broken)
    alias()
    with pytest.raises(
        ValueError, match=r"apex.amp.scaler.LossScaler in this file was pickled without \['_scale_seq_len'\]"
    ):
        _full_load(data)


def test_fp16kit_s_own_scaler_pickles_as_apex_s_and_back():
    from fp16kit.legacy.amp.scaler import LossScaler

    scaler = LossScaler("dynamic", init_scale=2.0**10, scale_window=5, min_loss_scale=4.0, on_min_scale="warn")
    scaler._unskipped = 3
    state = scaler.__getstate__()
    assert {k: v for k, v in state.items() if k != "_overflow_buf"} == {
        "dynamic": True,
        "_loss_scale": 1024.0,
        "_max_loss_scale": 2.0**24,
        "_min_loss_scale": 4.0,
        "_scale_seq_len": 5,
        "_unskipped": 3,
        "_has_overflow": False,
        "on_min_scale": "warn",
    }
    twin = copy.deepcopy(scaler)
    assert twin.state_dict() == scaler.state_dict() and twin._state.on_min_scale == "warn"
    static = pickle.loads(pickle.dumps(LossScaler(128.0)))
    assert (static.dynamic, static.loss_scale(), static.is_static_one()) == (False, 128.0, False)


# ---------------------------------------------------------------- FP16_Optimizer resumes


@pytest.mark.parametrize("load", LOADS)
@pytest.mark.parametrize("era", ["era2", "era1"])
def test_fp16_optimizer_resumes_from_an_apex_file_under_the_alias(fake_apex, alias, era, load):
    model, opt = _trained()
    if era == "era2":
        scaler, pattern, want = fake_apex.era2(1024.0, window=3, unskipped=1), ERA2_PATTERN, ERA2_SEEN
        same = {}
    else:
        scaler, pattern, want = fake_apex.era1_dynamic(2.0**10, 7, 4, 2.0, 3), ERA1_PATTERN, ERA1_SEEN
        same = {"unskipped": 2, "min_loss_scale": 1.0, "max_loss_scale": None}  # era 1: floor 1, no cap
    data = _apex_file(fake_apex, {"model": model.state_dict(), "optimizer": _apex_form(opt, scaler)})
    reference = _resumed({"model": model.state_dict(), "optimizer": _fp16kit_form(opt, **same)}, pattern)
    assert reference[2] == want
    alias()
    # full: used to raise ValueError("Cannot read the saved loss scaler ...") at load_state_dict;
    # default: used to refuse "Unsupported global: GLOBAL apex.amp.scaler.LossScaler"
    ckpt = LOADS[load](data)
    resumed = _resumed(ckpt, pattern)
    _same_run(resumed, reference)
    # the checkpoint's object is only read: not the optimizer's scaler, and as it was saved
    kept = ckpt["optimizer"]["loss_scaler"]
    assert resumed[1].loss_scaler is not kept
    assert (kept.loss_scale() if era == "era2" else kept.cur_scale) == 1024.0


@pytest.mark.parametrize("load", LOADS)
def test_a_static_era1_scaler_loads_as_a_static_scale(fake_apex, alias, load):
    model, opt = _trained()
    data = _apex_file(
        fake_apex,
        {"model": model.state_dict(), "optimizer": _apex_form(opt, fake_apex.era1_static(128.0), dynamic=False)},
    )
    alias()
    model2, opt2, seen = _resumed(LOADS[load](data), [False, False])
    assert opt2.dynamic_loss_scale is False and seen == [(128.0, 1), (128.0, 2)]


def test_the_default_load_makes_what_the_full_unpickler_makes(fake_apex, alias):
    data = _apex_file(
        fake_apex,
        [
            fake_apex.era1_static(128),
            fake_apex.era1_dynamic(2**32, 7, 4, 2, 3),
            fake_apex.era2(1024.0, window=3, unskipped=1, min_loss_scale=4.0),
        ],
    )
    alias()
    full, default = _full_load(data), _default_load(data)
    assert [type(o) for o in default] == [type(o) for o in full]
    for a, b in zip(full, default):
        state_a, state_b = a.__getstate__(), b.__getstate__()
        assert state_a.keys() == state_b.keys()
        for key, value in state_a.items():  # apex's Python types too (the int 2**32, the int factor 2)
            assert type(state_b[key]) is type(value) and (
                torch.equal(value, state_b[key]) if isinstance(value, torch.Tensor) else state_b[key] == value
            ), key


def test_a_file_converted_once_resumes_as_the_original_read_under_the_alias(fake_apex, alias, tmp_path, capsys):
    """What `fp16kit migrate` scripts (no alias) need: the converted file, read with torch.load's
    default, resumes exactly as the apex file read under the alias."""
    model, opt = _trained()
    old = tmp_path / "old.pt"
    old.write_bytes(
        _apex_file(
            fake_apex,
            {"model": model.state_dict(), "optimizer": _apex_form(opt, fake_apex.era2(1024.0, window=3, unskipped=1))},
        )
    )
    assert cli_main(["convert-checkpoint", str(old), str(tmp_path / "new.pt")]) == 0
    capsys.readouterr()
    converted = _resumed(torch.load(tmp_path / "new.pt"), ERA2_PATTERN)
    alias()
    _same_run(converted, _resumed(torch.load(old), ERA2_PATTERN))


# ------------------------------------------------------------- what the default load refuses


def test_without_the_alias_the_default_load_still_refuses_apex_s_scaler(fake_apex, alias):
    data = _apex_file(fake_apex, {"loss_scaler": fake_apex.era2(1024.0)})
    alias()
    uninstall_apex_alias()
    with pytest.raises(pickle.UnpicklingError, match="GLOBAL apex.amp.scaler.LossScaler was not an allowed global"):
        _default_load(data)


class _Call:
    """Pickles as ``fn(*args)`` (a REDUCE): what a crafted checkpoint does to run code."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


@pytest.mark.parametrize("payload", ["os.system", "builtins.eval", "apex DDP", "apex FusedAdam", "megatron"])
def test_under_the_alias_the_default_load_refuses_every_other_global(stand_ins, fake_apex, alias, payload):
    import os

    if payload == "os.system":
        obj, said = _Call(os.system, "echo pwned"), "is blocked"
    elif payload == "builtins.eval":
        obj, said = _Call(eval, "1 + 1"), "GLOBAL eval was not an allowed global"
    elif payload == "megatron":  # Megatron's scalers are allowed only with megatron=True
        obj, said = stand_ins.add("megatron.fp16.loss_scaler.DynamicLossScaler")(), "GLOBAL megatron.fp16.loss_scaler"
    else:
        path = (
            "apex.parallel.distributed.DistributedDataParallel"
            if payload == "apex DDP"
            else "apex.optimizers.fused_adam.FusedAdam"
        )
        obj, said = stand_ins.add(path)(), f"GLOBAL {path} was not an allowed global"
    data = _saved({"optimizer": {"loss_scaler": fake_apex.era2(1024.0)}, "extra": obj})
    stand_ins.remove()
    fake_apex.remove()
    alias()
    with pytest.raises(pickle.UnpicklingError, match=said):
        _default_load(data)


# (maker, attribute, a value apex never pickled there)
BAD_FIELDS = [
    ("era2", "_loss_scale", "65536"),
    ("era2", "_loss_scale", float("nan")),
    ("era2", "_loss_scale", -1.0),
    ("era2", "_loss_scale", torch.tensor(1024.0)),
    ("era2", "dynamic", "yes"),
    ("era2", "_scale_seq_len", 2.5),
    ("era2", "_scale_seq_len", [3]),
    ("era2", "_unskipped", -1),
    ("era2", "_max_loss_scale", "inf"),
    ("era2", "_min_loss_scale", {"x": 1}),
    ("era2", "_overflow_buf", [0]),
    ("era2", "on_min_scale", "explode"),
    ("era1_dynamic", "cur_scale", "1024"),
    ("era1_dynamic", "cur_iter", 1.5),
    ("era1_dynamic", "scale_window", 0),
    ("era1_dynamic", "scale_factor", None),
    ("era1_dynamic", "last_overflow_iter", True),
    ("era1_static", "cur_scale", "128"),
    ("era1_static", "cur_scale", 0),
    # ints too large for a float (math.isfinite raises OverflowError on them)
    ("era2", "_loss_scale", 10**400),
    ("era1_dynamic", "scale_window", 10**400),
    ("era1_static", "cur_scale", 10**400),
]


@pytest.mark.parametrize("load", LOADS)
@pytest.mark.parametrize(("maker", "field", "value"), BAD_FIELDS, ids=[f"{m}-{f}-{v!r}" for m, f, v in BAD_FIELDS])
def test_a_scaler_whose_attributes_are_not_apex_s_is_refused_naming_the_attribute(
    fake_apex, alias, load, maker, field, value
):
    scaler = getattr(fake_apex, maker)()
    setattr(scaler, field, value)
    data = _apex_file(fake_apex, {"optimizer": {"loss_scaler": scaler}})
    alias()
    with pytest.raises(ValueError, match=rf"in this file is not one apex pickled: its {field} is "):
        LOADS[load](data)


def test_a_static_scaler_reads_cur_scale_and_nothing_else(fake_apex, alias):
    """apex's static scaler pickled ``cur_scale`` alone; other attributes in the file (here one that
    would shadow a method) are not read."""
    scaler = fake_apex.era1_static(128.0)
    scaler.has_overflow = 1
    data = _apex_file(fake_apex, scaler)
    alias()
    for load in LOADS.values():
        loaded = load(data)
        assert loaded.cur_scale == 128.0 and loaded.has_overflow([]) is False and "has_overflow" not in vars(loaded)


def test_a_crafted_constructor_call_makes_no_scaler_of_what_is_not_a_scale(fake_apex, alias):
    """A REDUCE of the allowed class calls its constructor (on plain data, no other code), which
    checks its scale as every LossScaler(scale) call does: the load refuses it, naming the value."""
    model, opt = _trained()
    sd = _apex_form(opt, _Call(fake_apex.Era1LossScaler, ["not", "a", "number"]), dynamic=False)
    data = _apex_file(fake_apex, sd)
    alias()
    with pytest.raises(ValueError, match=r"scale must be a finite number > 0 .*got \['not', 'a', 'number'\]"):
        _default_load(data)


@pytest.mark.parametrize("load", LOADS)
@pytest.mark.parametrize("cls", ["Era1LossScaler", "Era1DynamicLossScaler", "AmpLossScaler"])
def test_a_scaler_unpickled_without_its_state_is_refused_by_every_load_state_dict(fake_apex, alias, cls, load):
    """An object with no attributes pickles as NEWOBJ with no BUILD: the allowed class is built
    but its validating __setstate__ never runs. Every reader refuses it by name, state unchanged."""
    model, opt = _trained()
    data = _apex_file(fake_apex, _apex_form(opt, getattr(fake_apex, cls)()))
    alias()
    ckpt = LOADS[load](data)
    assert vars(ckpt["loss_scaler"]) == {}
    target = _optimizer(make_model(torch.float16, seed=1))
    before = copy.deepcopy(target.state_dict())
    with pytest.raises(ValueError, match="in this file holds no attributes .* not one apex pickled"):
        target.load_state_dict(ckpt)
    after = target.state_dict()
    assert after["loss_scaler"] == before["loss_scaler"]
    assert all(
        torch.equal(a, b) for ga, gb in zip(after["fp32_from_fp16"], before["fp32_from_fp16"]) for a, b in zip(ga, gb)
    )
    if cls == "AmpLossScaler":
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        amp.initialize(net, torch.optim.SGD(net.parameters(), lr=0.1), opt_level="O2", verbosity=0)
        before_amp = amp.state_dict()
        with pytest.raises(RuntimeError, match="holds no attributes"):
            amp.load_state_dict({"loss_scaler0": ckpt["loss_scaler"]})
        assert amp.state_dict() == before_amp


def test_an_unpickled_amp_scaler_never_writes_into_the_file_s_other_tensors(fake_apex, alias):
    """The file's overflow buffer may be a view of another tensor in it (a crafted file, or one
    saved with the buffer aliased): the restored scaler clears its own buffer, never that one."""
    weight = torch.ones(4, dtype=torch.int32)
    scaler = fake_apex.era2(1024.0)
    scaler._overflow_buf = weight[:1]
    data = _apex_file(fake_apex, {"weight": weight, "scaler": scaler})
    alias()
    for load in LOADS.values():
        ckpt = load(data)
        ckpt["scaler"].clear_overflow_state()  # what amp does at each backward
        assert ckpt["weight"].tolist() == [1, 1, 1, 1]
        assert ckpt["scaler"]._overflow_buf.tolist() == [0]


def test_load_checkpoint_under_the_alias_still_reads_records_not_live_scalers(fake_apex, alias):
    """load_checkpoint's stand-ins share the alias's paths on torch's list: for its load they
    alone answer them (plain data, attributes as pickled, no __setstate__ check)."""
    data = _apex_file(
        fake_apex,
        {
            "a": fake_apex.era1_static(128.0),
            "b": fake_apex.era1_dynamic(),
            "c": fake_apex.era2(1024.0),
            "d": fake_apex.era2("bad"),
        },
    )
    alias()
    again = _saved(_full_load(_saved({k: v for k, v in load_checkpoint(io.BytesIO(data)).items() if k != "d"})))
    before = torch.serialization.get_safe_globals()
    for ckpt in (load_checkpoint(io.BytesIO(data)), load_checkpoint(io.BytesIO(again))):
        assert all(isinstance(v, dict) and CLASS_KEY in v for v in ckpt.values())
    assert load_checkpoint(io.BytesIO(data))["d"]["_loss_scale"] == "bad"
    assert set(torch.serialization.get_safe_globals()) == set(before)


# -------------------------------------------------------------- saved again, then read back


@pytest.mark.parametrize("era", ["era2", "era1"])
def test_a_checkpoint_saved_again_under_the_alias_reads_as_apex_s(fake_apex, alias, tmp_path, capsys, era):
    """A script run with `fp16kit run` that loads an apex file and saves it again (a copy for
    fine-tuning, a checkpoint carrying the old optimizer entry) pickles fp16kit's classes: they
    read as the apex classes they stand for, in load_checkpoint and convert-checkpoint."""
    model, opt = _trained()
    if era == "era2":
        scaler, pattern, path = (
            fake_apex.era2(1024.0, window=3, unskipped=1),
            ERA2_PATTERN,
            "apex.amp.scaler.LossScaler",
        )
    else:
        scaler, pattern, path = (
            fake_apex.era1_dynamic(2.0**10, 7, 4, 2.0, 3),
            ERA1_PATTERN,
            "apex.fp16_utils.loss_scaler.DynamicLossScaler",
        )
    original = _apex_file(fake_apex, {"model": model.state_dict(), "optimizer": _apex_form(opt, scaler)})
    alias()
    again = tmp_path / "again.pt"
    torch.save(_full_load(original), again)
    # under the alias, torch.load's default reads fp16kit's classes by their own paths too
    resaved = torch.load(again)
    assert type(resaved["optimizer"]["loss_scaler"]) is type(_full_load(original)["optimizer"]["loss_scaler"])
    under_alias = _resumed(resaved, pattern)
    uninstall_apex_alias()  # read back in a plain process

    via_alias = load_checkpoint(again)
    via_apex = load_checkpoint(io.BytesIO(original))
    assert via_alias["optimizer"]["loss_scaler"][CLASS_KEY] == path
    attributes = {k: v for k, v in via_alias["optimizer"]["loss_scaler"].items() if k != "_overflow_buf"}
    assert attributes == {k: v for k, v in via_apex["optimizer"]["loss_scaler"].items() if k != "_overflow_buf"}
    reference = _resumed(via_apex, pattern)  # (the run moves the loaded tensors: one load per run)
    _same_run(_resumed(via_alias, pattern), reference)
    _same_run(under_alias, reference)

    assert cli_main(["convert-checkpoint", str(again), str(tmp_path / "plain.pt")]) == 0
    assert f"  converted  optimizer.loss_scaler: {path} -> fp16kit's scaler state" in capsys.readouterr().out
    _same_run(_resumed(torch.load(tmp_path / "plain.pt", weights_only=True), pattern), reference)


# --------------------------------------------------------------------- amp and Megatron


def test_amp_load_state_dict_takes_an_unpickled_apex_scaler(fake_apex, alias):
    data = _apex_file(fake_apex, {"loss_scaler0": fake_apex.era2(512.0, unskipped=7)})
    alias()
    saved = _full_load(data)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", verbosity=0)
    amp.load_state_dict(saved)
    assert amp.state_dict() == {"loss_scaler0": {"loss_scale": 512.0, "unskipped": 7}}


def _megatron_model():
    from fp16kit.legacy.megatron import FP16_Module

    torch.manual_seed(0)
    model = FP16_Module(nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2)))
    opt = MegatronOptimizer(
        torch.optim.Adam(model.parameters(), lr=1e-2),
        dynamic_loss_scale=True,
        dynamic_loss_args={"scale_window": 3.0, "delayed_shift": 2},
    )
    return model, opt


def _megatron_steps(model, opt, pattern):
    seen = []
    for i, overflow in enumerate(pattern):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(4, 5, generator=g), torch.randn(4, 2, generator=g)
        if overflow:
            x[1, 2] = INF
        opt.zero_grad()
        opt.backward(((model(x) - y) ** 2).mean())
        opt.step()
        seen.append(opt.loss_scaler.state_dict())
    return seen


@pytest.mark.parametrize("load", LOADS)
@pytest.mark.parametrize("module", ["megatron.fp16.loss_scaler", "fp16.loss_scaler"])
def test_megatron_resumes_from_a_megatron_file_under_fp16kit_run_megatron(stand_ins, megatron, alias, module, load):
    model, opt = _megatron_model()
    _megatron_steps(model, opt, [False, True])
    sd = opt.state_dict()
    sd["loss_scaler"] = megatron(
        module, cur_scale=2.0**10, cur_iter=6, last_overflow_iter=4, scale_window=3.0, delayed_shift=2, cur_hysteresis=1
    )
    data = _saved({"model": model.state_dict(), "optimizer": sd})
    stand_ins.remove()
    reference = load_checkpoint(io.BytesIO(data))
    alias(megatron=True)
    full = LOADS[load](data)
    assert type(full["optimizer"]["loss_scaler"]).__module__ == "fp16kit.legacy.megatron.loss_scaler"
    runs = []
    for ckpt in (full, reference):
        model2, opt2 = _megatron_model()
        model2.load_state_dict(ckpt["model"])
        opt2.load_state_dict(ckpt["optimizer"])
        runs.append(
            (
                _megatron_steps(model2, opt2, [False, True, False, True, False]),
                [p.detach().clone() for p in model2.parameters()],
            )
        )
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(p, q) for p, q in zip(runs[0][1], runs[1][1]))


def test_megatron_refuses_an_unpickled_amp_scaler_as_it_refuses_its_record(fake_apex, alias):
    model, opt = _megatron_model()
    sd = dict(opt.state_dict(), loss_scaler=fake_apex.era2(1024.0))
    data = _apex_file(fake_apex, sd)
    messages = []
    for ckpt in (load_checkpoint(io.BytesIO(data)), (alias(), _full_load(data))[1]):
        with pytest.raises(ValueError) as info:
            _megatron_model()[1].load_state_dict(ckpt)
        messages.append(str(info.value))
    assert messages[0] == messages[1]
    assert "apex.amp.scaler.LossScaler is not a Megatron loss scaler" in messages[0]


# ----------------------------------------------------------- whole objects apex pickled


def test_a_megatron_fp16_module_pickled_whole_runs(stand_ins, alias):
    """Megatron's FP16_Module asked mpu for the pipeline stage; its pickle has no such attributes."""
    cls = stand_ins.add("megatron.fp16.fp16.FP16_Module", bases=(nn.Module,))
    module = cls.__new__(cls)
    nn.Module.__init__(module)
    module.add_module("module", nn.Linear(3, 2).half())
    data = _saved(module)
    stand_ins.remove()
    alias(megatron=True)
    loaded = _full_load(data)
    out = loaded(torch.ones(2, 3))
    assert out.dtype == torch.float32 and torch.equal(out, module.module(torch.ones(2, 3).half()).float())


def _whole_optimizer(stand_ins, path, defaults):
    cls = stand_ins.add(path, bases=(torch.optim.Optimizer,))
    opt = cls.__new__(cls)
    torch.optim.Optimizer.__init__(opt, [nn.Parameter(torch.ones(3))], defaults)
    return opt


@pytest.mark.parametrize("what", ["FusedAdam", "FusedSGD", "FP16_Optimizer"])
def test_fused_era_objects_apex_pickled_whole_are_refused_at_load_not_later(stand_ins, alias, what):
    """torch's pickling of an optimizer keeps its groups and state, not the settings its step reads
    (apex's own unpickled FusedAdam failed at its first step); fp16kit's wrapper keeps its masters
    and scale in objects apex's pickle lacks. Refused when loaded, naming the fix."""
    if what == "FusedAdam":
        obj = _whole_optimizer(
            stand_ins,
            "apex.contrib.optimizers.fused_adam.FusedAdam",
            dict(lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, max_grad_norm=0.0),
        )
    elif what == "FusedSGD":
        obj = _whole_optimizer(
            stand_ins,
            "apex.contrib.optimizers.fused_sgd.FusedSGD",
            dict(lr=0.1, momentum=0.9, dampening=0, weight_decay=0, nesterov=False),
        )
    else:
        cls = stand_ins.add("apex.contrib.optimizers.fp16_optimizer.FP16_Optimizer")
        obj = cls()
        master = nn.Parameter(torch.ones(3))
        obj.__dict__.update(
            optimizer=torch.optim.SGD([master], lr=0.1),
            fp16_groups=[[torch.ones(3).half()]],
            fp32_groups=[[master]],
            dynamic_loss_scale=True,
            cur_scale=2**16,
            cur_iter=0,
            last_overflow_iter=-1,
            scale_factor=2,
            scale_window=1000,
            verbose=True,
        )
    data = _saved({"optimizer": obj})
    stand_ins.remove()
    alias()
    with pytest.raises(pickle.UnpicklingError) as info:
        _full_load(data)
    assert f"apex.contrib.optimizers.{what} object apex pickled (torch.save(optimizer)" in str(info.value)
    assert "torch.save(optimizer.state_dict(), NEW_PATH)" in str(info.value)


def test_fp16kit_s_own_fused_era_objects_still_pickle_and_load_state_dicts():
    from fp16kit.legacy.contrib.optimizers import FP16_Optimizer as FusedEra
    from fp16kit.legacy.contrib.optimizers import FusedAdam, FusedSGD

    wrapper = FusedEra(
        FusedAdam([nn.Parameter(torch.ones(3).half())], lr=0.1, eps_inside_sqrt=True), dynamic_loss_scale=True
    )
    twin = pickle.loads(pickle.dumps(wrapper))
    assert twin.cur_scale == 2.0**16 and twin.optimizer.eps_inside_sqrt is True
    copy.deepcopy(wrapper).optimizer.load_state_dict(wrapper.optimizer.state_dict())
    sgd = FusedSGD([nn.Parameter(torch.ones(2))], lr=0.1, wd_after_momentum=True)
    assert copy.deepcopy(sgd).wd_after_momentum is True
    sgd.load_state_dict(sgd.state_dict())
