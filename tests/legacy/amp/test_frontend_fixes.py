"""amp's FIXes over apex (docs/apex-amp.md §6, §8, §12, §13) and the O1 frontend wiring to casts."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from _helpers.amp_reference import ApexO2, batches, tiny_model
from fp16kit.legacy import amp
from fp16kit.legacy.amp import casts


@pytest.fixture
def o1_cleanup():
    yield
    casts._disable_o1_for_tests()


def test_o1_trains_fp32_params_with_dynamic_scale(o1_cleanup):
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
    before = [p.detach().clone() for p in model.parameters()]
    for x, y in batches(3):
        with amp.scale_loss(nn.functional.mse_loss(model(x), y), opt) as s:
            s.backward()
        opt.step()
        opt.zero_grad()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), before))
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 65536.0, "unskipped": 3}
    with amp.disable_casts():
        pass


def test_delay_overflow_check_still_checks():
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    x, y = batches(1)[0]
    before = [p.detach().clone() for p in model.parameters()]
    with amp.scale_loss(nn.functional.mse_loss(model(x), y) * float("inf"), opt, delay_overflow_check=True) as s:
        s.backward()
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    assert amp._amp_state.loss_scalers[0].loss_scale() == 32768.0


def test_tuple_of_optimizers_is_prepared():
    m1, m2 = tiny_model(), tiny_model(1)
    o1, o2 = torch.optim.SGD(m1.parameters(), lr=0.1), torch.optim.SGD(m2.parameters(), lr=0.1)
    [m1, m2], [o1, o2] = amp.initialize([m1, m2], [o1, o2], opt_level="O2", verbosity=0)
    x, y = batches(1)[0]
    for _ in range(2):
        with amp.scale_loss(nn.functional.mse_loss(m1(x) + m2(x), y), (o1, o2)) as s:
            s.backward()
    assert o1._amp_stash.lazy_init_called and o2._amp_stash.lazy_init_called


def test_static_one_with_masters_keeps_accumulated_fp32_grads():
    model = tiny_model()
    ref = ApexO2(model, lambda ps: torch.optim.SGD(ps, lr=0.1), loss_scale=1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", loss_scale=1.0, verbosity=0)
    for x, y in batches(2):  # two backward passes, one step
        with amp.scale_loss(nn.functional.mse_loss(model(x), y), opt) as s:
            s.backward()
        ref.backward(nn.functional.mse_loss(ref.forward(x), y))
    assert torch.equal(model[1].weight.grad, ref.model[1].weight.grad)  # apex kept only the last
    opt.step()
    ref.step()
    for a, b in zip(model.parameters(), ref.model.parameters()):
        assert torch.equal(a, b)


def test_model_load_state_dict_after_lazy_init_refreshes_masters():
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    opt._amp_lazy_init()
    other = tiny_model(5)
    model.load_state_dict(other.state_dict())
    for m, p in zip(amp.master_params(opt), model.parameters()):
        assert torch.equal(m, p.float())
    import copy
    import pickle

    copy.deepcopy(model).load_state_dict(tiny_model(6).state_dict())  # the copy is tied to no optimizer
    assert all(torch.equal(m, p.float()) for m, p in zip(amp.master_params(opt), model.parameters()))
    pickle.loads(pickle.dumps(model))


def test_scale_loss_exception_propagates_and_cleans():
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    x, y = batches(1)[0]
    with pytest.raises(KeyError):
        with amp.scale_loss(nn.functional.mse_loss(model(x), y), opt):
            raise KeyError("boom")
    with amp.scale_loss(nn.functional.mse_loss(model(x), y), opt) as s:
        s.backward()
    opt.step()


def test_scripts_write_internals():
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    sc = amp._amp_state.loss_scalers[0]
    sc._loss_scale = 2.0**20
    sc._scale_seq_len = 5
    assert sc.loss_scale() == 2.0**20 and sc._scale_seq_len == 5 and sc.dynamic
    assert sc._max_loss_scale == 2.0**24 and sc._min_loss_scale is None
    # DLE BERT's O2 restore recipe
    opt._lazy_init_maybe_master_weights()
    opt._amp_stash.lazy_init_called = True
    masters = list(amp.master_params(opt))
    opt._lazy_init_maybe_master_weights()  # idempotent
    assert list(amp.master_params(opt)) == masters
    x, y = batches(1)[0]
    with amp.scale_loss(nn.functional.mse_loss(model(x), y), opt) as s:
        assert s.item() == pytest.approx(nn.functional.mse_loss(model(x), y).item() * 2**20, rel=1e-3)
        s.backward()
    assert sc.update_scale() is False


def test_apex_era_checkpoint_with_amp_state(tmp_path):
    import collections

    from fp16kit.legacy import load_checkpoint

    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    for x, y in batches(2):
        with amp.scale_loss(nn.functional.mse_loss(model(x), y), opt) as s:
            s.backward()
        opt.step()
    sd = opt.state_dict()
    del sd["amp_fp32_masters"]  # apex never saved the masters
    amp_sd = collections.OrderedDict(loss_scaler0={"loss_scale": 1024.0, "unskipped": 17})
    torch.save({"model": model.state_dict(), "optimizer": sd, "amp": amp_sd}, tmp_path / "apex.pt")
    ck = load_checkpoint(tmp_path / "apex.pt")
    model2, opt2 = amp.initialize(
        tiny_model(), torch.optim.SGD(tiny_model().parameters(), lr=0.1, momentum=0.9), opt_level="O2", verbosity=0
    )
    model2.load_state_dict(ck["model"])
    opt2.load_state_dict(ck["optimizer"])
    amp.load_state_dict(ck["amp"])
    assert amp.state_dict() == {"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 17}}
    for a, b in zip(model2.parameters(), model.parameters()):
        assert torch.equal(a, b)


def test_lr_scheduler_built_before_initialize_and_skips(recwarn):
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    x, y = batches(1)[0]
    with amp.scale_loss(nn.functional.mse_loss(model(x), y), opt) as s:
        s.backward()
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.05 and isinstance(opt, torch.optim.SGD)
    assert not [w for w in recwarn if "lr_scheduler.step()" in str(w.message)]


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_lr_scheduler_built_after_initialize(opt_level, recwarn, o1_cleanup):
    # the common order in migrated scripts; torch's scheduler wraps step.__func__, so amp's
    # patched step must be a bound method (it was a plain function: AttributeError)
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=opt_level, verbosity=0)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    for x, y in batches(2):
        opt.zero_grad()
        with amp.scale_loss(nn.functional.mse_loss(model(x).float(), y), opt) as s:
            s.backward()
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == 0.025
    assert not [w for w in recwarn if "lr_scheduler.step()" in str(w.message)]


def test_model_halved_before_initialize_is_refused():
    model = tiny_model().half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="you do not need to call .half\\(\\) on your model"):
        amp.initialize(model, opt, opt_level="O2", verbosity=0)
    assert not hasattr(opt, "_amp_stash")


def test_amp_state_paths():
    from fp16kit.legacy.amp import frontend
    from fp16kit.legacy.amp._amp_state import _amp_state

    assert amp._amp_state is _amp_state and amp._amp_state._amp_state is _amp_state
    assert frontend._amp_state is _amp_state


def test_skip_survives_a_refused_closure(caplog):
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=1)
    x, y = batches(1)[0]
    before = [p.detach().clone() for p in model.parameters()]
    with amp.scale_loss(nn.functional.mse_loss(model(x), y) * float("nan"), opt) as s:
        s.backward()
    with pytest.raises(RuntimeError, match="closure"):
        opt.step(lambda: 0)
    caplog.clear()  # amp.initialize's banner (INFO, on stdout as apex printed it)
    with caplog.at_level("WARNING", logger="fp16kit.apex"):
        assert opt.step() is None
    assert [r.getMessage() for r in caplog.records] == [
        "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 32768.0"
    ]
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    opt.step()  # the next step is a real one again
    assert all(
        p.grad is None for p in amp.master_params(opt) if p.dtype == torch.float32 and p not in set(model.parameters())
    )


def test_static_scaler_short_circuit_follows_writes():
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O3", verbosity=0)
    x, y = batches(1)[0]
    loss = nn.functional.mse_loss(model(x), y)
    with amp.scale_loss(loss, opt) as s:
        assert torch.equal(s, loss.float())
    amp._amp_state.loss_scalers[0]._loss_scale = 4.0
    with amp.scale_loss(nn.functional.mse_loss(model(x), y), opt) as s:
        assert torch.equal(s, loss.float() * 4)
        s.backward()
