"""fp16kit.integrations.accelerate (issue 11, Accelerate) against the plain fp16kit loop.

The reference, written out here: ``model.to(fp16/bf16)``, ``MixedPrecisionOptimizer(SGD)``,
``fp16kit.GradScaler`` (fp16), clipping on the masters, ``scaler.step``/``update``, the LR
scheduler stepped only on applied steps (Accelerate's rule for skipped steps). Accelerate adds
no arithmetic on this path (no autocast: the model computes in its own dtype; the loss divided
by gradient_accumulation_steps = 1 or 2, which the reference does too), so every comparison is
bit for bit (torch.equal). Overflows are injected by multiplying one step's loss by inf.
"""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("accelerate", reason="Accelerate adapter: pip install 'fp16kit[accelerate]'")

import torch  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from accelerate.utils import GradScalerKwargs  # noqa: E402

import fp16kit  # noqa: E402
from fp16kit.integrations.accelerate import MasterWeightsAccelerator  # noqa: E402

ROOT = Path(fp16kit.__file__).resolve().parent.parent
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
STEPS, LR, MAX_NORM, SCALE = 6, 0.05, 0.5, 1024.0


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    # Accelerate's states are process-wide singletons; each test builds its own accelerators.
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def net(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def batch(step: int, micro: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randn(8, 6, generator=g).to(dtype), torch.randn(8, 3, generator=g).to(dtype)


def loss_of(model, step, micro, dtype, overflow_at):
    x, y = batch(step, micro, dtype)
    loss = torch.nn.functional.mse_loss(model(x), y)
    return loss * math.inf if step == overflow_at else loss


def schedule(sgd):
    return torch.optim.lr_scheduler.LambdaLR(sgd, lambda s: 1.0 / (1 + s))


class Record:
    def __init__(self):
        self.losses, self.norms, self.skipped, self.scales, self.lrs = [], [], [], [], []

    def final(self, model, mixed, scaler):
        self.params = [p.detach().clone() for p in model.parameters()]
        self.masters = [m.detach().clone() for m in mixed.master_params]
        self.scale = None if scaler is None else scaler.get_scale()
        return self


def plain_loop(mp, *, async_step=False, overflow_at=None, accum=1, steps=STEPS):
    """The plain fp16kit loop (no Accelerate), with Accelerate's scheduler rule."""
    dtype = DTYPES[mp]
    model = net().to(dtype)
    sgd = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    sched = schedule(sgd)
    opt = fp16kit.MixedPrecisionOptimizer(sgd, async_step=async_step)
    scaler = fp16kit.GradScaler("cpu", init_scale=SCALE, growth_interval=2) if mp == "fp16" else None
    rec = Record()
    for step in range(steps):
        for micro in range(accum):
            loss = loss_of(model, step, micro, dtype, overflow_at) / accum
            (scaler.scale(loss) if scaler else loss).backward()
        rec.losses.append(loss.detach().clone())
        if scaler is not None:
            scaler.unscale_(opt)
            if async_step:
                rec.norms.append(opt.clip_grad_norm_(MAX_NORM))
            else:  # torch's clip on the masters
                rec.norms.append(torch.nn.utils.clip_grad_norm_(opt.master_params, MAX_NORM))
            scaler.step(opt)
            scaler.update()
            skipped = scaler.last_step_skipped()
            rec.scales.append(scaler.get_scale())
        else:
            rec.norms.append(opt.clip_grad_norm_(MAX_NORM))
            opt.step()
            skipped = step == overflow_at
        rec.skipped.append(skipped)
        if not skipped:
            sched.step()
        rec.lrs.append(sgd.param_groups[0]["lr"])
        opt.zero_grad()
    opt.synchronize()
    return rec.final(model, opt, scaler)


def make_accelerator(mp, **kw):
    handlers = [GradScalerKwargs(init_scale=SCALE, growth_interval=2)] if mp == "fp16" else None
    return MasterWeightsAccelerator(mp, cpu=True, kwargs_handlers=handlers, **kw)


def accelerated_loop(
    mp,
    *,
    async_step=False,
    overflow_at=None,
    accum=1,
    steps=STEPS,
    start=0,
    save_at=None,
    save_dir=None,
    load_dir=None,
    seed=0,
):
    """The same training through MasterWeightsAccelerator, as an Accelerate user writes it."""
    dtype = DTYPES[mp]
    acc = make_accelerator(mp, async_step=async_step, gradient_accumulation_steps=accum)
    model = net(seed)
    sgd = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    model, opt, sched = acc.prepare(model, sgd, schedule(sgd))
    if load_dir is not None:
        acc.load_state(load_dir)
    rec = Record()
    for step in range(start, steps):
        for micro in range(accum):
            with acc.accumulate(model):
                loss = loss_of(model, step, micro, dtype, overflow_at)
                acc.backward(loss)
                if acc.sync_gradients:
                    rec.norms.append(acc.clip_grad_norm_(model.parameters(), MAX_NORM))
                opt.step()
                sched.step()
                opt.zero_grad()
        rec.losses.append((loss / accum).detach().clone())
        rec.skipped.append(opt.step_was_skipped)
        assert acc.optimizer_step_was_skipped == opt.step_was_skipped
        if acc.scaler is not None:
            rec.scales.append(acc.scaler.get_scale())
        rec.lrs.append(sgd.param_groups[0]["lr"])
        if step == save_at:
            acc.save_state(save_dir)  # with async_step: a step is in flight here
    acc.synchronize()
    rec.accelerator, rec.optimizer = acc, opt
    return rec.final(model, opt.optimizer, acc.scaler)


def same(x, y):
    """Bit for bit, NaN equal to NaN (an overflowing step's loss and norm)."""
    return (
        x.dtype == y.dtype
        and torch.equal(torch.nan_to_num(x, nan=7.0), torch.nan_to_num(y, nan=7.0))
        and torch.equal(x.isnan(), y.isnan())
    )


def assert_same(a, b, *, history=True):
    assert all(torch.equal(x, y) for x, y in zip(a.params, b.params, strict=True))
    assert all(torch.equal(x, y) for x, y in zip(a.masters, b.masters, strict=True))
    assert a.scale == b.scale
    if history:
        assert all(same(x, y) for x, y in zip(a.losses, b.losses, strict=True))
        assert all(same(x, y) for x, y in zip(a.norms, b.norms, strict=True))
        assert a.skipped == b.skipped and a.scales == b.scales and a.lrs == b.lrs


# ---------------------------------------------------------------------------- training equality
@pytest.mark.parametrize("async_step", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("mp", ["fp16", "bf16"])
def test_training_equals_plain_loop_through_an_overflow(mp, async_step):
    ref = plain_loop(mp, async_step=async_step, overflow_at=2)
    got = accelerated_loop(mp, async_step=async_step, overflow_at=2)
    assert_same(got, ref)
    assert got.skipped == [False, False, True, False, False, False]  # the overflow step only
    assert got.lrs[2] == got.lrs[1] and got.lrs[3] < got.lrs[2]  # no scheduler step when skipped
    assert got.params[0].dtype == DTYPES[mp] and got.masters[0].dtype == torch.float32
    finite = [n for n, s in zip(got.norms, got.skipped) if not s]
    assert all(0 < float(n) < 100 for n in finite)  # unscaled (the scale is ~1e3)
    if mp == "fp16":
        assert got.scales[2] == got.scales[1] / 2


def test_clip_reaches_the_masters_and_reports_the_unscaled_norm():
    # The finding: Accelerate unscaled into the masters, then clipped the still-scaled
    # fp16 model grads and returned a norm * 65536.
    acc = make_accelerator("fp16")
    model = net()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
    x, y = batch(0, 0, torch.float16)
    acc.backward(torch.nn.functional.mse_loss(model(x), y) / 8)
    norm = acc.clip_grad_norm_(model.parameters(), 1e-3)
    masters = opt.optimizer.master_params
    assert acc.scaler.get_scale() == SCALE and 1e-3 < float(norm) < 100
    assert float(torch.nn.utils.get_total_norm([m.grad for m in masters])) <= 1e-3 * (1 + 1e-5)
    opt.step()
    assert not opt.step_was_skipped


def test_two_optimizers_one_total_norm():
    def run(accelerated):
        dtype = torch.float16
        model = net()
        if not accelerated:
            model = model.half()
        sgds = [
            torch.optim.SGD(model[0].parameters(), lr=LR, momentum=0.9),
            torch.optim.SGD(model[2].parameters(), lr=LR),
        ]
        if accelerated:
            acc = make_accelerator("fp16")
            model, o1, o2 = acc.prepare(model, *sgds)
            opts, scaler = [o1, o2], acc.scaler
            mixed = [o.optimizer for o in opts]
        else:
            mixed = [fp16kit.MixedPrecisionOptimizer(s) for s in sgds]
            scaler = fp16kit.GradScaler("cpu", init_scale=SCALE, growth_interval=2)
        norms = []
        for step in range(4):
            loss = loss_of(model, step, 0, dtype, overflow_at=1)
            if accelerated:
                acc.backward(loss)
                norms.append(acc.clip_grad_norm_(model.parameters(), MAX_NORM))
                for o in opts:
                    o.step()
                assert [o.step_was_skipped for o in opts] == [step == 1] * 2
                for o in opts:
                    o.zero_grad()
            else:
                scaler.scale(loss).backward()
                for m in mixed:
                    scaler.unscale_(m)
                norms.append(torch.nn.utils.clip_grad_norm_([p for m in mixed for p in m.master_params], MAX_NORM))
                for m in mixed:
                    scaler.step(m)
                scaler.update()  # once per iteration
                for m in mixed:
                    m.zero_grad()
        return norms, [p.detach().clone() for p in model.parameters()], scaler.get_scale()

    got, ref = run(True), run(False)
    assert all(same(a, b) for a, b in zip(got[0], ref[0], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(got[1], ref[1]))
    assert got[2] == ref[2]


def test_clip_grad_value_clamps_the_unscaled_master_grads():
    acc = make_accelerator("fp16")
    model = net()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
    x, y = batch(0, 0, torch.float16)
    acc.backward(torch.nn.functional.mse_loss(model(x), y))
    acc.clip_grad_value_(model.parameters(), 1e-3)
    grads = [m.grad for m in opt.optimizer.master_params]
    limit = torch.tensor(1e-3)  # the clamp bound, in the masters' float32
    assert all(bool(g.abs().max() <= limit) for g in grads)
    assert any(bool(g.abs().max() == limit) for g in grads)
    acc.clip_grad_norm_(model.parameters(), 1.0)  # a second clip this iteration: no second unscale
    opt.step()
    assert not opt.step_was_skipped


# ---------------------------------------------------------------------------- accumulation
@pytest.mark.parametrize("mp,async_step", [("fp16", False), ("fp16", True), ("bf16", False)])
def test_accumulate_equals_two_backward_passes_per_step(mp, async_step):
    ref = plain_loop(mp, async_step=async_step, overflow_at=2, accum=2, steps=4)
    got = accelerated_loop(mp, async_step=async_step, overflow_at=2, accum=2, steps=4)
    assert_same(got, ref)
    assert got.skipped == [False, False, True, False]


def test_micro_steps_do_not_step_and_refuse_clipping():
    acc = make_accelerator("fp16", gradient_accumulation_steps=2)
    model = net()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
    before = [p.detach().clone() for p in model.parameters()]
    with acc.accumulate(model):
        acc.backward(loss_of(model, 0, 0, torch.float16, None))
        assert not acc.sync_gradients
        with pytest.raises(RuntimeError, match="sync_gradients"):
            acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert all(p.grad is not None for p in model.parameters())  # still accumulating
    assert not opt.step_was_skipped


# ---------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("mp,async_step", [("fp16", False), ("fp16", True), ("bf16", False), ("bf16", True)])
def test_save_state_load_state_resumes_bit_for_bit(mp, async_step, tmp_path):
    ckpt = tmp_path / "ckpt"
    whole = accelerated_loop(mp, async_step=async_step, overflow_at=4, save_at=2, save_dir=ckpt)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    assert_same(whole, accelerated_loop(mp, async_step=async_step, overflow_at=4))  # saving changed nothing
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    # fresh objects (another init seed: everything must come from the checkpoint)
    resumed = accelerated_loop(mp, async_step=async_step, overflow_at=4, start=3, load_dir=ckpt, seed=7)
    assert_same(resumed, whole, history=False)
    assert resumed.skipped == whole.skipped[3:] and resumed.lrs == whole.lrs[3:]
    assert all(same(a, b) for a, b in zip(resumed.losses, whole.losses[3:], strict=True))
    # Accelerate reloads these with weights_only=True: plain data
    opt_state = torch.load(ckpt / "optimizer.bin", weights_only=True)
    assert set(opt_state) == {"optimizer", "masters"}
    assert opt_state["masters"][0][0].dtype == torch.float32
    if mp == "fp16":
        assert torch.load(ckpt / "scaler.pt", weights_only=True)["scale"] == whole.scales[2]
    else:
        assert not (ckpt / "scaler.pt").exists()


# ---------------------------------------------------------------------------- the model's numbers
@pytest.mark.parametrize("mp", ["fp16", "bf16"])
def test_no_autocast_on_the_cast_model(mp):
    # Accelerate 1.15 on CPU: "fp16" gets no scaler and no autocast; "bf16" wraps forward in a
    # CPU autocast that returns fp32 outputs. Here the model computes in its own dtype.
    acc = make_accelerator(mp)
    model = net()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
    x, _ = batch(0, 0, DTYPES[mp])
    ref = net().to(DTYPES[mp])
    with acc.autocast():
        out = model(x)
    assert out.dtype == DTYPES[mp] and torch.equal(out, ref(x))
    if mp == "fp16":
        assert type(acc.scaler) is fp16kit.GradScaler and acc.scaler.get_scale() == SCALE
        assert acc.scaler.get_growth_interval() == 2  # the GradScalerKwargs handler
    else:
        assert acc.scaler is None
    assert acc.mixed_precision == mp


def test_user_built_mixed_precision_optimizer_is_used_as_is():
    acc = make_accelerator("fp16")
    model = net().half()
    mixed = fp16kit.MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=LR), flat=True)
    model, opt = acc.prepare(model, mixed)
    assert opt.optimizer is mixed
    acc.backward(loss_of(model, 0, 0, torch.float16, None))
    opt.step()
    assert not opt.step_was_skipped


def test_prepare_order_does_not_matter():
    # the model is cast and placed before the optimizer is wrapped, whatever the order
    acc = make_accelerator("bf16")
    model = net()
    sgd = torch.optim.SGD(model.parameters(), lr=LR)
    sched, opt, model, again = acc.prepare(schedule(sgd), sgd, model, model)
    assert opt.optimizer.optimizer is sgd and sched.scheduler.optimizer is sgd and again is model
    assert len(opt.optimizer.master_params) == 4 and model[0].weight.dtype == torch.bfloat16
    assert sched.optimizers == [opt]


# ---------------------------------------------------------------------------- wrong use
@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"mixed_precision": "fp8"}, ValueError, "'fp16' or 'bf16'"),
        ({"mixed_precision": "no"}, ValueError, "'fp16' or 'bf16'"),
        ({"mixed_precision": "bf16", "scaler": fp16kit.GradScaler("cpu")}, ValueError, "bf16 needs no loss scaling"),
        ({"scaler": torch.amp.GradScaler("cpu")}, TypeError, "fp16kit.GradScaler"),
        ({"scaler": fp16kit.GradScaler("cpu"), "kwargs_handlers": [GradScalerKwargs()]}, ValueError, "not both"),
        ({"fsdp_plugin": object()}, ValueError, "fsdp_plugin"),
        ({"deepspeed_plugin": object()}, ValueError, "deepspeed_plugin"),
        ({"megatron_lm_plugin": object()}, ValueError, "megatron_lm_plugin"),
    ],
)
def test_refused_settings_fail_before_touching_accelerate_state(kwargs, error, match):
    with pytest.raises(error, match=match):
        MasterWeightsAccelerator(cpu=True, **kwargs)
    assert AcceleratorState._shared_state == {}


@pytest.mark.filterwarnings("ignore:torch.cuda.amp.GradScaler is enabled, but CUDA is not available")
def test_scaler_for_another_device_is_refused():
    with pytest.raises(ValueError, match=r"fp16kit.GradScaler\('cpu'"):
        MasterWeightsAccelerator("fp16", cpu=True, scaler=fp16kit.GradScaler("cuda"))


def test_disabled_scaler_still_reports_skipped_steps():
    acc = MasterWeightsAccelerator("fp16", cpu=True, kwargs_handlers=[GradScalerKwargs(enabled=False)])
    model = net()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
    skipped = []
    for step in range(2):
        acc.backward(loss_of(model, step, 0, torch.float16, overflow_at=1))
        acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        skipped.append(opt.step_was_skipped)
    assert skipped == [False, True]


def test_refused_launch_environment(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ValueError, match="ACCELERATE_USE_DEEPSPEED"):
        MasterWeightsAccelerator("fp16", cpu=True)


def test_wrong_optimizers_are_refused():
    acc = make_accelerator("fp16")
    early = net()  # a MixedPrecisionOptimizer built on the fp32 model: no masters
    with pytest.raises(TypeError, match="built before the model was cast"):
        acc.prepare(early, fp16kit.MixedPrecisionOptimizer(torch.optim.SGD(early.parameters(), lr=LR)))
    alone = net()  # the optimizer prepared without its model
    with pytest.raises(TypeError, match="same accelerator.prepare"):
        acc.prepare(torch.optim.SGD(alone.parameters(), lr=LR))
    bf = net().bfloat16()
    with pytest.raises(TypeError, match="mixed_precision"):
        acc.prepare(torch.optim.SGD(bf.parameters(), lr=LR))
    model = net()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
    acc.backward(loss_of(model, 0, 0, torch.float16, None))
    with pytest.raises(RuntimeError, match="no closure"):
        opt.step(lambda: None)


# ---------------------------------------------------------------------------- two processes
_WORKER = textwrap.dedent(
    """
    import os, sys, torch, torch.distributed as dist

    def main(rank, init_file, out_file):
        os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
        # Accelerate's PartialState uses an initialized default group as it is (state.py, 1.15)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
        from accelerate.utils import GradScalerKwargs
        from fp16kit.integrations.accelerate import MasterWeightsAccelerator
        acc = MasterWeightsAccelerator("fp16", cpu=True, kwargs_handlers=[GradScalerKwargs(init_scale=1024.0)])
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
        model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
        log = []
        for step in range(4):
            g = torch.Generator().manual_seed(100 * step + rank)
            x, y = torch.randn(4, 6, generator=g).half(), torch.randn(4, 3, generator=g).half()
            loss = torch.nn.functional.mse_loss(model(x), y)
            if step == 2 and rank == 1:
                loss = loss * float("inf")  # one rank overflows
            acc.backward(loss)
            norm = acc.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
            log.append((opt.step_was_skipped, acc.scaler.get_scale(), float(norm)))
        res = {"log": log, "distributed": str(acc.distributed_type), "wrapped": type(model).__name__,
               "params": [p.detach().clone() for p in model.parameters()],
               "masters": [m.detach().clone() for m in opt.optimizer.master_params]}
        torch.save(res, f"{out_file}.{rank}")
        dist.barrier()
        dist.destroy_process_group()

    if __name__ == "__main__":
        import torch.multiprocessing as mp
        mp.spawn(main, args=(sys.argv[1], sys.argv[2]), nprocs=2)
    """
)


@pytest.mark.slow
def test_two_gloo_ranks_stay_identical_through_a_one_rank_overflow(tmp_path):
    from _helpers.gloo import run_two_ranks

    r0, r1 = run_two_ranks(_WORKER, tmp_path)
    assert r0["distributed"] == r1["distributed"] == "DistributedType.MULTI_CPU"
    assert r0["wrapped"] == "DistributedDataParallel"
    assert [s for s, _, _ in r0["log"]] == [s for s, _, _ in r1["log"]] == [False, False, True, False]
    assert [repr(entry) for entry in r0["log"]] == [repr(entry) for entry in r1["log"]]  # (nan norms too)
    assert all(torch.equal(a, b) for a, b in zip(r0["params"], r1["params"]))
    assert all(torch.equal(a, b) for a, b in zip(r0["masters"], r1["masters"]))
    assert r0["log"][2][1] == r0["log"][1][1] / 2


# ---------------------------------------------------------------------------- the example
def test_example_runs():
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "integrations" / "accelerate_master_weights.py")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(ROOT),
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "skipped steps: 1" in out and "clipped norm" in out
    assert "resumed bit for bit: True" in out
