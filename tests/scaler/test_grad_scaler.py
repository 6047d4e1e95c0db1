"""fp16kit.GradScaler: what goes beyond torch's scaler (extras) and how it stays a drop-in.

Parity with torch.amp.GradScaler itself is covered by test_grad_scaler_differential.py and
test_grad_scaler_torch_scenarios.py.
"""

from __future__ import annotations

import inspect
import pickle
import textwrap

import pytest
import torch

import fp16kit
from _helpers.gloo import run_two_ranks
from fp16kit import GradScaler


def _model_opt(seed=0, fused=False):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=fused or None)
    return model, opt


def _iteration(model, opt, scaler, overflow=False):
    opt.zero_grad()
    loss = model(torch.randn(3, 4)).pow(2).mean()
    scaler.scale(loss).backward()
    if overflow:
        model[1].weight.grad[0, 0] = float("inf")
    ret = scaler.step(opt)
    scaler.update()
    return ret


def test_is_a_torch_grad_scaler_and_overrides_every_method():
    assert issubclass(GradScaler, torch.amp.GradScaler)
    torch_methods = {
        name
        for name, value in vars(torch.amp.GradScaler).items()
        if callable(value) and not name.startswith("__") or name in ("__init__", "__getstate__", "__setstate__")
    }
    not_overridden = sorted(n for n in torch_methods if n not in vars(GradScaler))
    assert not_overridden == [], f"torch code would run for: {not_overridden}"


def test_signature_extends_torchs_with_keyword_only_extras():
    ours = inspect.signature(GradScaler.__init__).parameters
    theirs = inspect.signature(torch.amp.GradScaler.__init__).parameters
    assert list(ours)[: len(theirs)] == list(theirs)
    for name in theirs:
        assert ours[name].default == theirs[name].default and ours[name].kind == theirs[name].kind
    extras = list(ours)[len(theirs) :]
    assert extras == ["hysteresis", "min_scale", "max_scale", "on_min_scale", "process_group"]
    assert all(ours[e].kind is inspect.Parameter.KEYWORD_ONLY for e in extras)


def test_hysteresis_through_the_scaler():
    model, opt = _model_opt()
    scaler = GradScaler("cpu", init_scale=64.0, hysteresis=2, growth_interval=100)
    scales = []
    for overflow in [True, True, False, True]:
        _iteration(model, opt, scaler, overflow)
        scales.append(scaler.get_scale())
    assert scales == [64.0, 32.0, 32.0, 16.0]  # hysteresis is refilled only by growth


def test_bounds_through_the_scaler():
    model, opt = _model_opt()
    scaler = GradScaler("cpu", init_scale=4.0, min_scale=2.0, max_scale=16.0, growth_interval=1)
    seen = []
    for overflow in [True, True, False, False, False, False]:
        _iteration(model, opt, scaler, overflow)
        seen.append(scaler.get_scale())
    assert seen == [2.0, 2.0, 4.0, 8.0, 16.0, 16.0]


def test_floor_policy_raise_leaves_the_scaler_usable():
    model, opt = _model_opt()
    scaler = GradScaler("cpu", init_scale=1.0, min_scale=1.0, on_min_scale="raise")
    with pytest.raises(FloatingPointError, match="loss is probably exploding"):
        _iteration(model, opt, scaler, overflow=True)
    _iteration(model, opt, scaler)  # no "step() has already been called" left behind
    assert scaler.get_scale() == 1.0


def test_skip_reporting():
    model, opt = _model_opt()
    scaler = GradScaler("cpu", init_scale=8.0)
    assert scaler.last_step_skipped() is False and scaler.skipped_steps() == 0
    for overflow in [True, False, True, True]:
        _iteration(model, opt, scaler, overflow)
    assert scaler.last_step_skipped() is True
    assert scaler.skipped_steps() == 3 and scaler.consecutive_skipped_steps() == 2
    # mid-iteration: answers for this iteration once grads are checked
    opt.zero_grad()
    scaler.scale(model(torch.randn(3, 4)).sum()).backward()
    scaler.unscale_(opt)
    t = scaler.last_step_skipped_tensor()
    assert t.dtype == torch.bool and t.shape == () and not t.item()
    scaler.step(opt)
    scaler.update()
    assert scaler.last_step_skipped() is False and scaler.consecutive_skipped_steps() == 0
    disabled = GradScaler("cpu", enabled=False)
    assert disabled.last_step_skipped() is False and disabled.skipped_steps() == 0


def test_state_dict_is_torchs_by_default_and_carries_extras_when_set(tmp_path):
    plain = GradScaler("cpu")
    assert list(plain.state_dict()) == list(torch.amp.GradScaler("cpu").state_dict())
    model, opt = _model_opt()
    extra = GradScaler("cpu", init_scale=32.0, hysteresis=3, min_scale=0.5, on_min_scale="warn")
    _iteration(model, opt, extra, overflow=True)
    sd = extra.state_dict()
    assert list(sd) == [
        "scale",
        "growth_factor",
        "backoff_factor",
        "growth_interval",
        "_growth_tracker",
        "hysteresis",
        "_hysteresis_tracker",
        "min_scale",
        "max_scale",
        "on_min_scale",
    ]
    assert sd["_hysteresis_tracker"] == 2 and sd["scale"] == 32.0
    torch.save(sd, tmp_path / "s.pt")
    restored = GradScaler("cpu")
    restored.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True))
    assert restored.state_dict() == sd
    theirs = torch.amp.GradScaler("cpu")
    theirs.load_state_dict(sd)  # torch ignores the extra keys
    assert theirs.state_dict() == {k: sd[k] for k in theirs.state_dict()}


def test_loading_torchs_state_dict_keeps_extras_with_a_full_hysteresis():
    scaler = GradScaler("cpu", hysteresis=4)
    scaler.load_state_dict(
        {"scale": 8.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 10, "_growth_tracker": 3}
    )
    sd = scaler.state_dict()
    assert sd["hysteresis"] == 4 and sd["_hysteresis_tracker"] == 4 and sd["_growth_tracker"] == 3


def test_bad_extras_in_a_state_dict_change_nothing():
    scaler = GradScaler("cpu", init_scale=8.0)
    before = scaler.state_dict()
    with pytest.raises(ValueError, match="hysteresis must be an int >= 1"):
        scaler.load_state_dict({**before, "scale": 1.0, "hysteresis": -1})
    assert scaler.state_dict() == before


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"hysteresis": 0}, "hysteresis must be an int >= 1"),
        ({"on_min_scale": "raise"}, "also pass min_scale"),
        ({"min_scale": 4.0, "max_scale": 2.0}, "above max_scale"),
        ({"process_group": "world"}, "process_group must be a torch.distributed.ProcessGroup"),
    ],
)
def test_bad_extras_raise_at_construction_even_when_disabled(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        GradScaler("cpu", **kwargs)
    with pytest.raises((ValueError, TypeError), match=match):
        GradScaler("cpu", enabled=False, **kwargs)


def test_pickle_carries_extras_and_drops_the_process_group():
    scaler = GradScaler("cpu", init_scale=16.0, hysteresis=2)
    model, opt = _model_opt()
    _iteration(model, opt, scaler, overflow=True)
    scaler._process_group = object()  # a group is bound to this process; it cannot travel
    clone = pickle.loads(pickle.dumps(scaler))
    assert clone._process_group is None
    assert clone.state_dict() == scaler.state_dict() and clone.skipped_steps() == 1


def test_repr_mentions_state():
    assert "enabled=False" in repr(GradScaler("cpu", enabled=False))
    assert "lazy" in repr(GradScaler("cpu"))


def test_public_names():
    assert fp16kit.GradScaler is GradScaler
    assert fp16kit.OptState is torch.amp.grad_scaler.OptState


# ------------------------------------------------------------------ process_group
_WORKER = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist
    import fp16kit

    def main(rank, world, init_file, out_file):
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = fp16kit.GradScaler("cpu", init_scale=8.0, process_group=dist.group.WORLD)
        log = []
        for it in range(3):
            opt.zero_grad()
            scaler.scale(model(torch.randn(2, 4)).sum()).backward()
            if it == 1 and rank == 1:  # only rank 1 overflows
                model.weight.grad[0, 0] = float("inf")
            before = model.weight.detach().clone()
            scaler.step(opt)
            scaler.update()
            log.append((scaler.get_scale(), bool(torch.equal(before, model.weight))))
        # an optimizer with no grads on this rank still joins the collective
        empty = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        scaler.unscale_(empty)
        scaler.step(empty)
        scaler.update()
        torch.save(log, f"{out_file}.{rank}")
        dist.destroy_process_group()

    if __name__ == "__main__":
        import torch.multiprocessing as mp
        mp.spawn(main, args=(2, sys.argv[1], sys.argv[2]), nprocs=2)
    """
)


@pytest.mark.slow
def test_process_group_ranks_skip_together(tmp_path):
    logs = run_two_ranks(_WORKER, tmp_path)
    # both ranks: clean step, skipped step (rank 1's overflow), clean step; same scales
    for log in logs:
        assert [skipped for _, skipped in log] == [False, True, False]
        assert [s for s, _ in log] == [8.0, 4.0, 4.0]


def test_fields_follow_how_the_scaler_was_built_not_later_flips():
    built_on = GradScaler("cpu")
    built_on._enabled = False
    assert built_on.get_growth_factor() == 2.0  # torch keeps its fields
    built_on.set_growth_factor(4.0)
    built_on._enabled = True
    assert built_on.get_growth_factor() == 4.0
    built_off = GradScaler("cpu", enabled=False)
    with pytest.raises(AttributeError, match="no attribute '_growth_factor'"):
        built_off.get_growth_factor()
    built_off.set_growth_factor(3.0)
    assert built_off.get_growth_factor() == 3.0


def test_copies_keep_the_process_group_pickles_cannot():
    import copy

    scaler = GradScaler("cpu")
    group = object()
    scaler._process_group = group  # stands in for a ProcessGroup
    assert copy.copy(scaler)._process_group is group
    assert copy.deepcopy(scaler)._process_group is group
    clone = pickle.loads(pickle.dumps(scaler))
    model, opt = _model_opt()
    opt.zero_grad()
    clone.scale(model(torch.randn(3, 4)).sum()).backward()
    with pytest.raises(RuntimeError, match=r"scaler.set_process_group\(group\)"):
        clone.unscale_(opt)
    clone.set_process_group(None)  # explicitly single-process from now on
    clone.unscale_(opt)


def test_the_grad_scaler_keyword_is_looked_up_per_function_and_warned_at_every_step():
    # fp16kit keeps inspect.signature's answer per step function (torch asks at every step):
    # each optimizer still gets the protocol its own step() takes, and the FutureWarning every time.
    import warnings as _warnings

    class Old(torch.optim.SGD):
        _step_supports_amp_scaling = True

        def step(self, closure=None, *, grad_scaler=None):
            self.got = grad_scaler
            return super().step(closure)

    class New(torch.optim.SGD):
        _step_supports_amp_scaling = True

        def step(self, closure=None):
            self.got = (self.grad_scale.item(), self.found_inf.item())  # (a fused kernel would step here)

    model = torch.nn.Linear(3, 1)
    old, new = Old(model.parameters(), lr=0.1), New(model.parameters(), lr=0.1)
    scaler = fp16kit.GradScaler("cpu", init_scale=4.0)
    for _ in range(3):
        old.zero_grad()
        scaler.scale(model(torch.ones(2, 3)).sum()).backward()
        with _warnings.catch_warnings(record=True) as rec:
            _warnings.simplefilter("always")
            scaler.step(old)
            scaler.step(new)
        assert [w.category for w in rec] == [FutureWarning]
        assert old.got is scaler and new.got == (4.0, 0.0)
        old.step = lambda closure=None: "patched"  # an instance's own step: its own signature
        assert fp16kit.scaler.stepping._takes_grad_scaler(old.step) is False
        del old.step
        scaler.update()
