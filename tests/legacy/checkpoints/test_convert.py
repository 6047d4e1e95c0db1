"""``fp16kit.legacy.checkpoints.convert``: apex-era checkpoints -> plain data ``torch.load(weights_only=True)``
reads and fp16kit loads. Each format's converted form is checked against values worked out here
from docs/apex-fp16-optimizer.md (era-1 -> era-2 counter: ``unskipped = (cur_iter - last_overflow_iter - 1) %
scale_window``) and docs/apex-others.md §6 (FusedAdam's group ``step`` into torch's per-param
``state[p]['step']``), and the converted optimizer state is stepped by torch's AdamW against a
hand-written AdamW update using that step count.
"""

from __future__ import annotations

import argparse
import math
import pickle

import pytest
import torch

from fp16kit.legacy import FP16_Optimizer, load_checkpoint
from fp16kit.legacy.checkpoints.convert import Conversion, ConversionError, convert_checkpoint, convert_file


def _reloaded(obj, tmp_path):
    path = tmp_path / "converted.pt"
    torch.save(obj, path)
    return torch.load(path, weights_only=True)


# ------------------------------------------------------------------------------ scalers


def test_apex_scalers_of_both_eras_become_fp16kits_scaler_state(tmp_path, fake_apex, save):
    saved = {
        "era1_dynamic": {
            "loss_scaler": fake_apex.era1_dynamic(
                cur_scale=2.0**20, cur_iter=1010, last_overflow_iter=3, scale_window=1000
            )
        },
        "era1_static": {"loss_scaler": fake_apex.era1_static(cur_scale=128)},
        "era2": {"loss_scaler": fake_apex.era2(2.0**15, unskipped=41, window=500, min_loss_scale=1.0)},
    }
    path = save(saved, tmp_path / "apex.pt")
    fake_apex.remove()
    out, report = convert_checkpoint(load_checkpoint(path))

    assert out["era1_dynamic"]["loss_scaler"] == {
        "dynamic": True,
        "loss_scale": 2.0**20,
        "scale_factor": 2.0,
        "scale_window": 1000,
        "unskipped": (1010 - 3 - 1) % 1000,  # 6 clean steps towards the next growth
        "min_loss_scale": 1.0,
        "max_loss_scale": None,
    }
    assert out["era1_static"]["loss_scaler"] == {
        "dynamic": False,
        "loss_scale": 128.0,
        "scale_factor": 2.0,
        "scale_window": 2000,
        "unskipped": 0,
        "min_loss_scale": None,
        "max_loss_scale": 2.0**24,
    }  # fp16_utils' FP16_Optimizer's own settings
    assert out["era2"]["loss_scaler"] == {
        "dynamic": True,
        "loss_scale": 2.0**15,
        "scale_factor": 2.0,
        "scale_window": 500,
        "unskipped": 41,
        "min_loss_scale": 1.0,
        "max_loss_scale": 2.0**24,
    }
    assert [str(r) for r in report] == [
        "converted  era1_dynamic.loss_scaler: apex.fp16_utils.loss_scaler.DynamicLossScaler -> fp16kit's scaler "
        "state (dynamic, loss_scale 1.04858e+06; FP16_Optimizer.load_state_dict reads it)",
        "converted  era1_static.loss_scaler: apex.fp16_utils.loss_scaler.LossScaler -> fp16kit's scaler state "
        "(static, loss_scale 128; FP16_Optimizer.load_state_dict reads it)",
        "converted  era2.loss_scaler: apex.amp.scaler.LossScaler -> fp16kit's scaler state (dynamic, loss_scale "
        "32768; FP16_Optimizer.load_state_dict reads it)",
    ]
    assert _reloaded(out, tmp_path) == out


def test_a_converted_fp16_optimizer_checkpoint_resumes_like_the_original(tmp_path, fake_apex, save):
    """The era-1 file loaded directly (load_checkpoint) and after conversion gives an
    FP16_Optimizer in the same state: same scale, and the same scale after 2000 more steps."""
    model = torch.nn.Linear(3, 2).half()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.0), dynamic_loss_scale=True, verbose=False)
    sd = opt.state_dict()
    sd["loss_scaler"] = fake_apex.era1_dynamic(cur_scale=2.0**10, cur_iter=1500, last_overflow_iter=600)
    path = save({"optimizer": sd}, tmp_path / "e1.pt")
    fake_apex.remove()
    original = load_checkpoint(path)
    converted = _reloaded(convert_checkpoint(original)[0], tmp_path)

    scales = []
    for state in (original, converted):
        o = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.0), dynamic_loss_scale=True, verbose=False)
        o.load_state_dict(state["optimizer"])
        seen = [o.loss_scale]
        for _ in range(200):  # era 1: grows when (cur_iter - 600) % 1000 == 0, i.e. at cur_iter 1600
            o.zero_grad()
            o.backward(model(torch.ones(1, 3).half()).float().sum())
            o.step()
            seen.append(o.loss_scale)
        scales.append(seen)
    assert scales[0] == scales[1]
    assert scales[0][100] == 2.0**10 and scales[0][101] == 2.0**11  # the growth at cur_iter 1600


def test_megatron_scalers_stay_dicts_of_their_attributes(tmp_path, megatron, save):
    scaler = megatron(cur_scale=2.0**20, cur_hysteresis=1)
    path = save({"optimizer": {"loss_scaler": scaler}}, tmp_path / "m.pt")
    loaded = load_checkpoint(path)
    out, report = convert_checkpoint(loaded)
    assert out["optimizer"]["loss_scaler"] == loaded["optimizer"]["loss_scaler"]
    assert report == [
        Conversion(
            "optimizer.loss_scaler",
            "megatron.fp16.loss_scaler.DynamicLossScaler",
            "a dict of its attributes (fp16kit.legacy.megatron's FP16_Optimizer reads it)",
            changed=False,
        )
    ]
    assert str(report[0]).startswith("kept       optimizer.loss_scaler: megatron.fp16.loss_scaler.")


def test_a_scaler_record_with_missing_attributes_is_a_valueerror(tmp_path):
    broken = {"__apex_class__": "apex.amp.scaler.LossScaler", "_loss_scale": 8.0}
    with pytest.raises(ValueError, match="Cannot read the saved loss scaler"):
        convert_checkpoint({"s": broken})


# ------------------------------------------------------------------ Namespace and numpy


def test_a_namespace_becomes_a_dict_that_weights_only_reads(tmp_path, save):
    args = argparse.Namespace(params_dtype=torch.bfloat16, lr=1e-4, layers=[1, 2], fp16=False)
    loaded = load_checkpoint(save({"args": args, "iteration": 5}, tmp_path / "a.pt"))
    out, report = convert_checkpoint(loaded)
    assert out == {
        "args": {"params_dtype": torch.bfloat16, "lr": 1e-4, "layers": [1, 2], "fp16": False},
        "iteration": 5,
    }
    assert _reloaded(out, tmp_path) == out  # torch dtypes are read by weights_only
    assert [(r.path, r.before) for r in report] == [("args", "argparse.Namespace (4 attributes)")]
    assert argparse.Namespace(**out["args"]) == args
    assert isinstance(loaded["args"], argparse.Namespace)  # the input is left as it was


def test_numpy_rng_state_becomes_tensors_and_numbers(tmp_path, fake_numpy, save):
    key = list(range(1000, 1624))
    path = save({"np_rng_state": fake_numpy.rng_state(key), "acc": fake_numpy.scalar(0.75, "<f8")}, tmp_path / "n.pt")
    report = convert_file(path, tmp_path / "out.pt")
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert out["np_rng_state"][0] == "MT19937" and out["np_rng_state"][2:] == (624, 0, 0.0)
    assert out["np_rng_state"][1].dtype == torch.uint32 and out["np_rng_state"][1].tolist() == key
    assert out["acc"] == 0.75 and type(out["acc"]) is float
    assert [str(r) for r in report] == [
        "converted  np_rng_state[1]: numpy.ndarray <u4 (624,) -> uint32 tensor (624,)",
        "converted  acc: numpy scalar <f8 -> float",
    ]


# ----------------------------------------------------------------- optimizer 'step'


def _fused_adam_state(step, lr=1e-3, capturable=False) -> dict:
    """apex FusedAdam.state_dict(): a per-group step, per-param exp_avg/exp_avg_sq (docs/apex-others.md §3)."""
    torch.manual_seed(1)
    group = {
        "lr": torch.tensor(lr) if capturable else lr,
        "bias_correction": True,
        "betas": (0.9, 0.999),
        "eps": 1e-8,
        "weight_decay": 0.01,
        "step": torch.tensor(step) if capturable else step,
        "params": [0, 1, 2],
    }
    return {
        "state": {
            0: {"exp_avg": torch.randn(3), "exp_avg_sq": torch.rand(3)},
            1: {"exp_avg": torch.randn(2), "exp_avg_sq": torch.rand(2)},
        },  # param 2: no grad yet
        "param_groups": [group],
    }


def test_fused_adam_group_step_is_kept_unless_asked_and_torch_needs_it(tmp_path):
    sd = _fused_adam_state(41)
    out, report = convert_checkpoint({"optimizer": sd})
    assert out["optimizer"] is sd
    assert [str(r) for r in report] == [
        "kept       optimizer.param_groups[0].step: per-group step 41 (apex Fused*) -> kept (--torch-optimizer-state "
        "/ torch_optimizer_state=True moves it into each param's state for torch.optim.Adam/AdamW)"
    ]
    params = [
        torch.zeros(3, requires_grad=True),
        torch.zeros(2, requires_grad=True),
        torch.zeros(1, requires_grad=True),
    ]
    adam = torch.optim.AdamW(params)
    with pytest.raises(KeyError, match="step"):  # why the option exists (docs/apex-others.md §6)
        adam.load_state_dict(sd)
        for p in params:
            p.grad = torch.ones_like(p)
        adam.step()


@pytest.mark.parametrize("capturable", [False, True])
def test_fused_adam_group_step_moves_into_torchs_per_param_state(tmp_path, capturable):
    sd = _fused_adam_state(41, capturable=capturable)
    out, report = convert_checkpoint({"optimizer": sd}, torch_optimizer_state=True)
    state, group = out["optimizer"]["state"], out["optimizer"]["param_groups"][0]
    assert "step" not in group and group["lr"] == pytest.approx(1e-3) and type(group["lr"]) is float
    for pid in (0, 1):
        assert (
            state[pid]["step"].dtype == torch.float32 and state[pid]["step"].shape == () and state[pid]["step"] == 41.0
        )
    assert 2 not in state  # a param without state starts its own count in torch
    assert "step" in sd["param_groups"][0] and "step" not in sd["state"][0]  # the input is left as it was
    expected = [
        "converted  optimizer.param_groups[0].step: per-group step 41 (apex Fused*) -> state[p]['step'] = "
        "tensor(41.0) for the group's 2 params with state"
    ]
    if capturable:
        expected.append(
            "converted  optimizer.param_groups[0].lr: tensor lr (capturable) -> float 0.0010000000474974513"
        )
    assert [str(r) for r in report] == expected

    loaded = _reloaded(out, tmp_path)["optimizer"]
    params = [torch.linspace(-1, 1, 3).requires_grad_(), torch.tensor([0.5, -2.0], requires_grad=True)]
    adam = torch.optim.AdamW([{"params": params}])
    adam.load_state_dict({"state": loaded["state"], "param_groups": [{**loaded["param_groups"][0], "params": [0, 1]}]})
    grads = [torch.tensor([0.1, -0.2, 0.3]), torch.tensor([1.0, -1.0])]
    before = [p.detach().clone() for p in params]
    for p, g in zip(params, grads):
        p.grad = g
    adam.step()
    lr, (b1, b2), eps, wd, t = group["lr"], (0.9, 0.999), 1e-8, 0.01, 42  # the 42nd step of the group
    for i, p in enumerate(params):
        for j in range(p.numel()):  # AdamW by hand, in double
            m = b1 * sd["state"][i]["exp_avg"][j].item() + (1 - b1) * grads[i][j].item()
            v = b2 * sd["state"][i]["exp_avg_sq"][j].item() + (1 - b2) * grads[i][j].item() ** 2
            w = before[i][j].item() * (1 - lr * wd)
            w -= lr / (1 - b1**t) * m / (math.sqrt(v) / math.sqrt(1 - b2**t) + eps)
            assert p[j].item() == pytest.approx(w, rel=1e-6, abs=1e-7)


def test_legacy_fused_adam_per_param_int_steps_become_tensors():
    sd = {
        "state": {0: {"step": 9, "exp_avg": torch.zeros(2), "exp_avg_sq": torch.zeros(2)}},
        "param_groups": [{"lr": 5e-5, "max_grad_norm": 1.0, "bias_correction": False, "params": [0]}],
    }
    out, report = convert_checkpoint({"optimizer_state_dict": sd}, torch_optimizer_state=True)
    assert out["optimizer_state_dict"]["state"][0]["step"].dtype == torch.float32
    assert out["optimizer_state_dict"]["state"][0]["step"].item() == 9.0
    assert [r.path for r in report] == ["optimizer_state_dict.state"]


def test_fused_novograd_group_state_is_left_as_it_is():
    sd = {
        "state": {0: {"exp_avg": torch.zeros(2)}},
        "param_groups": [
            {"lr": 1e-3, "step": 5, "norm_type": 2, "exp_avg_sq": [torch.zeros(0), torch.ones(1)], "params": [0]}
        ],
    }
    out, report = convert_checkpoint({"opt": sd}, torch_optimizer_state=True)
    assert out["opt"]["param_groups"][0]["step"] == 5 and "step" not in out["opt"]["state"][0]
    assert report[0].changed is False and "torch has no NovoGrad" in report[0].after


def test_torch_optimizer_state_is_untouched(tmp_path):
    p = torch.nn.Parameter(torch.ones(2))
    adam = torch.optim.Adam([p])
    p.grad = torch.ones(2)
    adam.step()
    sd = adam.state_dict()
    out, report = convert_checkpoint({"opt": sd}, torch_optimizer_state=True)
    assert report == [] and torch.equal(out["opt"]["state"][0]["step"], sd["state"][0]["step"])


# ------------------------------------------------------------------------------ structure


def test_shared_containers_stay_shared_and_cycles_are_refused():
    shared = {"ns": argparse.Namespace(a=1)}
    out, report = convert_checkpoint({"x": shared, "y": shared, "z": [shared, shared]})
    assert out["x"] is out["y"] is out["z"][0] is out["z"][1] and out["x"] == {"ns": {"a": 1}}
    assert len(report) == 1  # converted once
    cyc: list = []
    cyc.append(cyc)
    with pytest.raises(ValueError, match="contains itself"):
        convert_checkpoint({"c": cyc})


NAN, INF = float("nan"), float("inf")
# (maker, attribute, a value no apex run writes there): ZeroDivisionError / OverflowError
# tracebacks before, or written into the converted file as they were (a NaN scale)
IMPOSSIBLE_SCALERS = [
    ("era1_dynamic", "scale_window", 0),
    ("era1_dynamic", "scale_window", INF),
    ("era1_dynamic", "scale_window", -3),
    ("era1_dynamic", "cur_scale", NAN),
    ("era1_dynamic", "cur_scale", 0),
    ("era1_dynamic", "scale_factor", 0.0),
    ("era1_static", "cur_scale", -1.0),
    ("era1_static", "cur_scale", INF),
    ("era2", "_loss_scale", NAN),
    ("era2", "_loss_scale", 0.0),
    ("era2", "_loss_scale", -(2.0**16)),
    ("era2", "_scale_seq_len", INF),
    ("era2", "_scale_seq_len", 0),
    ("era2", "_unskipped", -1),
]


@pytest.mark.parametrize(
    ("maker", "field", "value"), IMPOSSIBLE_SCALERS, ids=[f"{m}-{f}-{v!r}" for m, f, v in IMPOSSIBLE_SCALERS]
)
def test_a_scaler_record_no_apex_run_writes_is_refused_naming_the_field_and_nothing_is_written(
    tmp_path, fake_apex, save, maker, field, value
):
    scaler = getattr(fake_apex, maker)()
    setattr(scaler, field, value)
    path = save({"model": {"w": torch.ones(2)}, "optimizer": {"loss_scaler": scaler}}, tmp_path / "apex.pt")
    fake_apex.remove()
    assert load_checkpoint(path)["optimizer"]["loss_scaler"][field] is not None  # read as it is, for a look
    with pytest.raises(ConversionError, match=rf"optimizer\.loss_scaler: .*its {field} is {value!r}, not ") as info:
        convert_file(path, tmp_path / "out.pt")
    assert f"{str(path)!r} was not converted: optimizer.loss_scaler: " in str(info.value)
    assert isinstance(info.value, pickle.UnpicklingError)  # one except clause for "not converted"
    # what the command line prints after "IN was not converted: {where}: "
    assert info.value.where == "optimizer.loss_scaler" and info.value.why.startswith(
        f"the {load_checkpoint(path)['optimizer']['loss_scaler']['__apex_class__']} there holds {field} = {value!r}, not "
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["apex.pt"]  # no output, no temporary file
    # and the file itself, loaded into an optimizer, is refused as plainly
    opt = FP16_Optimizer(torch.optim.SGD(torch.nn.Linear(2, 2).half().parameters(), lr=0.1), verbose=False)
    sd = {**opt.state_dict(), "loss_scaler": load_checkpoint(path)["optimizer"]["loss_scaler"]}
    with pytest.raises(ValueError, match=rf"Cannot load the saved loss scaler: .*its {field} is {value!r}, not "):
        opt.load_state_dict(sd)
    assert opt.loss_scale == 1.0


def test_convert_file_refuses_hostile_input_and_writes_nothing(tmp_path):
    class Evil:
        def __reduce__(self):
            return (eval, (f"open({str(tmp_path / 'pwned')!r}, 'w').close()",))

    torch.save({"x": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(pickle.UnpicklingError, match="refused to load"):
        convert_file(tmp_path / "evil.pt", tmp_path / "out.pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["evil.pt"]  # no output, no temporary file


def test_nesting_deeper_than_any_checkpoint_is_a_valueerror_not_a_recursionerror():
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(ValueError, match="nested deeper than 200 levels") as info:
        convert_checkpoint({"d": deep, "args": argparse.Namespace(a=1)})
    # the path is cut short (it was 600 characters of [0][0]...), no advice about cycles
    assert str(info.value).startswith("d[0][0][0]...: containers nested") and len(str(info.value)) < 300
    assert "cycle" not in str(info.value) and "Convert the parts you need" in str(info.value)
    shallow = [[[argparse.Namespace(a=1)]]]
    assert convert_checkpoint(shallow)[0] == [[[{"a": 1}]]]
