"""amp O2 against the hand-written apex reference (tests/_helpers/amp_reference.py), bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from _helpers.amp_reference import ApexO2, batches, tiny_model
from fp16kit.legacy import amp

OPTS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
}


def _same(model: nn.Module, ref: ApexO2) -> None:
    for (name, a), b in zip(model.named_parameters(), ref.model.parameters()):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    for (name, a), b in zip(model.named_buffers(), ref.model.buffers()):
        assert torch.equal(a, b), name


def _init(opt_name="sgd", **kw):
    model = tiny_model()
    ref = ApexO2(
        model,
        OPTS[opt_name],
        num_losses=kw.get("num_losses", 1),
        **{k: v for k, v in kw.items() if k in ("min_loss_scale", "max_loss_scale")},
    )
    opt = OPTS[opt_name](model.parameters())
    kw.setdefault("verbosity", 0)
    model, opt = amp.initialize(model, opt, opt_level="O2", **kw)
    return model, opt, ref


@pytest.mark.parametrize("opt_name", sorted(OPTS))
def test_o2_matches_apex_bit_for_bit_with_overflows(opt_name):
    model, opt, ref = _init(opt_name)
    amp._amp_state.loss_scalers[0]._scale_seq_len = 3
    for s in ref.scalers:
        s.window = 3
    overflow_at = {2, 3, 9}
    for i, (x, y) in enumerate(batches(16)):
        bad = float("inf") if i in overflow_at else 1.0
        loss = nn.functional.mse_loss(model(x), y) * bad
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
        ref.backward(nn.functional.mse_loss(ref.forward(x), y) * bad)
        ref.step()
        ref.zero_grad()
        assert amp._amp_state.loss_scalers[0].loss_scale() == ref.scalers[0].scale
        assert amp._amp_state.loss_scalers[0]._unskipped == ref.scalers[0].unskipped
        _same(model, ref)
    for m, r in zip(amp.master_params(opt), ref.masters):
        assert torch.equal(m, r)
    assert all(p.dtype == torch.float32 for p in amp.master_params(opt))
    assert type(opt) is type(ref.opt)


def test_scale_trajectory_backoff_growth_and_clamps(caplog):
    model, opt, ref = _init(min_loss_scale=2.0**13, max_loss_scale=2.0**17, verbosity=1)
    sc = amp._amp_state.loss_scalers[0]
    sc._scale_seq_len = 2
    ref.scalers[0].window = 2
    pattern = [0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0]
    seen = []
    for i, (x, y) in enumerate(batches(len(pattern))):
        bad = float("nan") if pattern[i] else 1.0
        with amp.scale_loss(nn.functional.mse_loss(model(x), y) * bad, opt) as scaled:
            scaled.backward()
        with caplog.at_level("WARNING", logger="fp16kit"):
            opt.step()
        opt.zero_grad()
        ref.backward(nn.functional.mse_loss(ref.forward(x), y) * bad)
        ref.step()
        ref.zero_grad()
        seen.append(sc.loss_scale())
        _same(model, ref)
    assert seen == ref.scalers[0].history
    assert max(seen) == 2.0**17 and min(seen) == 2.0**13
    lines = [r.getMessage() for r in caplog.records if "Gradient overflow" in r.getMessage()]
    assert len(lines) == 5
    assert lines[0] == "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 65536.0"


def test_two_losses_with_their_own_scalers():
    model, opt, ref = _init(num_losses=2)
    assert len(amp._amp_state.loss_scalers) == 2
    for i, (x, y) in enumerate(batches(8)):
        out = model(x)
        bad = float("inf") if i == 3 else 1.0
        l0, l1 = nn.functional.mse_loss(out, y), out.abs().mean() * bad
        with amp.scale_loss(l0, opt, loss_id=0) as s:
            s.backward(retain_graph=True)
        with amp.scale_loss(l1, opt, loss_id=1) as s:
            s.backward()
        opt.step()
        opt.zero_grad()
        rout = ref.forward(x)
        ref.backward(nn.functional.mse_loss(rout, y), loss_id=0, retain_graph=True)
        ref.backward(rout.abs().mean() * bad, loss_id=1)
        ref.step()
        ref.zero_grad()
        _same(model, ref)
    assert amp._amp_state.loss_scalers[0].loss_scale() == 65536.0
    assert amp._amp_state.loss_scalers[1].loss_scale() == 32768.0
    assert amp.state_dict()["loss_scaler1"] == {"loss_scale": 32768.0, "unskipped": 4}


@pytest.mark.parametrize("delay", [True, False])
def test_accumulation(delay):
    model, opt, ref = _init()
    k = 3
    for i, (x, y) in enumerate(batches(12)):
        last = (i + 1) % k == 0
        with amp.scale_loss(nn.functional.mse_loss(model(x), y), opt, delay_unscale=delay and not last) as s:
            s.backward()
        ref.backward(nn.functional.mse_loss(ref.forward(x), y), delay_unscale=delay and not last)
        if last:
            opt.step()
            opt.zero_grad()
            ref.step()
            ref.zero_grad()
            _same(model, ref)


def test_master_params_clipping():
    model, opt, ref = _init()
    for x, y in batches(6):
        with amp.scale_loss(nn.functional.mse_loss(model(x), y), opt) as s:
            s.backward()
        n = torch.nn.utils.clip_grad_norm_(amp.master_params(opt), 0.05)
        opt.step()
        opt.zero_grad()
        ref.backward(nn.functional.mse_loss(ref.forward(x), y))
        rn = torch.nn.utils.clip_grad_norm_(ref.masters, 0.05)
        ref.step()
        ref.zero_grad()
        assert torch.equal(n, rn)
        _same(model, ref)


def test_model_io_casting_and_fp32_state_dict():
    model, opt, _ = _init()
    assert model[0].weight.dtype == torch.float16 and model[1].weight.dtype == torch.float32
    assert model[4].weight.dtype == torch.float16  # LayerNorm is cast (only affine BN stays)
    x = torch.randn(4, 6)
    assert model(x).dtype == torch.float32
    assert all(v.dtype != torch.float16 for v in model.state_dict().values())
    import copy
    import pickle

    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin[6].bias.fill_(100)
    assert not torch.equal(twin.eval()(x), model.eval()(x))  # the copy runs itself (apex ran the original)
    assert pickle.loads(pickle.dumps(model))(x).dtype == torch.float32


def test_step_and_zero_grad_before_backward_and_set_to_none():
    model, opt, _ = _init()
    opt.step()  # apex#341: AttributeError
    opt.zero_grad(set_to_none=True)  # apex: TypeError
    x, y = batches(1)[0]
    with amp.scale_loss(nn.functional.mse_loss(model(x), y), opt) as s:
        s.backward()
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in model.parameters())
    assert all(p.grad is None for p in amp.master_params(opt))


def test_closure_refused():
    model, opt, _ = _init()
    with pytest.raises(RuntimeError, match="^Currently, Amp does not support closure use with optimizers.$"):
        opt.step(lambda: 0.0)


def test_add_param_group_gets_masters():
    torch.manual_seed(0)
    model = tiny_model()
    extra = nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    [model, extra], opt = amp.initialize([model, extra], opt, opt_level="O2", verbosity=0)
    opt.add_param_group({"params": extra.parameters(), "lr": 0.01})
    assert all(p.dtype == torch.float32 for p in opt.param_groups[1]["params"])
    with pytest.raises(TypeError, match="ordered collections"):
        opt.add_param_group({"params": {nn.Parameter(torch.ones(1))}})
    with pytest.raises(AssertionError, match="param group must be a dict"):
        opt.add_param_group([nn.Parameter(torch.ones(1))])
