"""MasterWeightsAccelerator on the paths a user moving an ``accelerate`` script onto fp16kit walks.

Each test compares against an independent reference written out here: the plain fp16kit loop
(``model.to(fp16/bf16)``, ``MixedPrecisionOptimizer``, ``fp16kit.GradScaler``, torch's
``clip_grad_norm_`` on the masters in ``model.parameters()`` order), with Accelerate's rules
where Accelerate adds them (loss / gradient_accumulation_steps, the scheduler not stepping on a
skipped step, a short last accumulation window synced by the end of the dataloader).
Accelerate adds no arithmetic on these paths, so every comparison is bit for bit (torch.equal).
"""

from __future__ import annotations

import math
import threading

import pytest

pytest.importorskip("accelerate", reason="Accelerate adapter: pip install 'fp16kit[accelerate]'")

import torch  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from accelerate.utils import GradScalerKwargs  # noqa: E402

import fp16kit  # noqa: E402
from fp16kit.integrations.accelerate import MasterWeightsAccelerator  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
SCALE, VOCAB = 1024.0, 20


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def reset() -> None:
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def accelerator(mp: str, **kw) -> MasterWeightsAccelerator:
    handlers = [GradScalerKwargs(init_scale=SCALE, growth_interval=2)] if mp == "fp16" else None
    return MasterWeightsAccelerator(mp, cpu=True, kwargs_handlers=handlers, **kw)


def plain_scaler(mp: str):
    return fp16kit.GradScaler("cpu", init_scale=SCALE, growth_interval=2) if mp == "fp16" else None


class TiedLM(torch.nn.Module):
    """GPT-2's shape in miniature: lm_head tied to the token embedding, a LayerNorm."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.wte = torch.nn.Embedding(VOCAB, 8)
        self.h = torch.nn.Linear(8, 8)
        self.ln = torch.nn.LayerNorm(8)
        self.lm_head = torch.nn.Linear(8, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln(torch.tanh(self.h(self.wte(ids)))))


def lm_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), ids[:, 1:].reshape(-1))


def token_batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, 6), generator=torch.Generator().manual_seed(step))


def hf_groups(model: torch.nn.Module) -> list[dict]:
    """The HF fine-tuning recipe: no weight decay on biases and LayerNorm weights."""
    no_decay = ("bias", "ln.weight")
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if not any(k in n for k in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in named if any(k in n for k in no_decay)], "weight_decay": 0.0},
    ]


def plain_lm_loop(mp, *, async_step, steps, overflow_at=None):
    """The plain fp16kit loop for TiedLM; returns the model (synchronized) and the norms."""
    model = TiedLM().to(DTYPES[mp])
    opt = fp16kit.MixedPrecisionOptimizer(torch.optim.AdamW(hf_groups(model), lr=1e-2), async_step=async_step)
    scaler = plain_scaler(mp)
    master_of = dict(zip(map(id, opt.model_params), opt.master_params))
    norms = []
    for step in range(steps):
        loss = lm_loss(model, token_batch(step)) * (math.inf if step == overflow_at else 1.0)
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(opt)
        if async_step or not scaler:  # (async: the master grads belong to the step job; bf16:
            # no unscale_ read them into the masters yet) the optimizer's own clip
            norms.append(opt.clip_grad_norm_(1.0, params=model.parameters()))
        else:
            norms.append(torch.nn.utils.clip_grad_norm_([master_of[id(p)] for p in model.parameters()], 1.0))
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
    opt.synchronize()
    return model, norms


def accelerated_lm_steps(acc, model, opt, steps, overflow_at=None, norms=None):
    for step in steps:
        loss = lm_loss(model, token_batch(step)) * (math.inf if step == overflow_at else 1.0)
        acc.backward(loss)
        norm = acc.clip_grad_norm_(model.parameters(), 1.0)
        if norms is not None:
            norms.append(norm)
        opt.step()
        opt.zero_grad()


def same(x: torch.Tensor, y: torch.Tensor) -> bool:
    return torch.equal(torch.nan_to_num(x, nan=7.0), torch.nan_to_num(y, nan=7.0)) and torch.equal(x.isnan(), y.isnan())


# ---------------------------------------------------------------------------- saving the model
@pytest.mark.parametrize("mp", ["fp16", "bf16"])
def test_save_model_with_async_step_saves_the_last_steps_weights(mp, tmp_path):
    # Defect: with async_step=True, accelerator.save_model / get_state_dict (the "save the
    # final model for inference" call of every accelerate example) returned the model params,
    # which are one step behind until the step in flight lands: the last step was lost.
    from safetensors.torch import load_file

    ref, _ = plain_lm_loop(mp, async_step=True, steps=4, overflow_at=1)
    acc = accelerator(mp, async_step=True)
    model = TiedLM()
    model, opt = acc.prepare(model, torch.optim.AdamW(hf_groups(model), lr=1e-2))
    accelerated_lm_steps(acc, model, opt, range(4), overflow_at=1)
    acc.save_model(model, tmp_path / "final")
    saved = load_file(tmp_path / "final" / "model.safetensors")
    state = acc.get_state_dict(model)
    expected = ref.state_dict()
    assert set(saved) == {"wte.weight", "h.weight", "h.bias", "ln.weight", "ln.bias"}  # tied: saved once
    assert all(torch.equal(saved[k], expected[k]) for k in saved)
    assert all(torch.equal(state[k], expected[k]) for k in expected)
    assert state["lm_head.weight"] is state["wte.weight"]
    # nothing landed: training goes on exactly as in a run that saved nothing
    accelerated_lm_steps(acc, model, opt, range(4, 6))
    acc.synchronize()
    again, _ = plain_lm_loop(mp, async_step=True, steps=6, overflow_at=1)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True))


# ---------------------------------------------------------------------------- GPT-2 style model
@pytest.mark.parametrize("async_step", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("mp", ["fp16", "bf16"])
def test_tied_lm_with_no_decay_groups_equals_plain_loop(mp, async_step):
    ref, ref_norms = plain_lm_loop(mp, async_step=async_step, steps=5, overflow_at=2)
    acc = accelerator(mp, async_step=async_step)
    model = TiedLM()
    model, opt = acc.prepare(model, torch.optim.AdamW(hf_groups(model), lr=1e-2))
    assert model.lm_head.weight is model.wte.weight and len(opt.optimizer.master_params) == 5
    norms = []
    accelerated_lm_steps(acc, model, opt, range(5), overflow_at=2, norms=norms)
    acc.synchronize()
    assert model.lm_head.weight is model.wte.weight
    assert all(same(a, b) for a, b in zip(norms, ref_norms, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters(), strict=True))


# ---------------------------------------------------------------------------- schedulers
def test_scheduler_built_on_the_prepared_optimizer_follows_its_own_skips():
    # A scheduler built on the prepared optimizer (the `get_..._schedule(optimizer)` after
    # prepare pattern) was tied to every prepared optimizer: a skip of another optimizer
    # held its LR back. bf16: each optimizer checks its own grads, so one can skip alone.
    acc = accelerator("bf16")
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    model, o1, o2 = acc.prepare(
        model, torch.optim.SGD(model[0].parameters(), lr=0.1), torch.optim.SGD(model[2].parameters(), lr=0.1)
    )
    s1 = acc.prepare(torch.optim.lr_scheduler.StepLR(o1, 1, 0.5))
    s2 = acc.prepare(torch.optim.lr_scheduler.StepLR(o2, 1, 0.5))
    poison = {"on": False}
    model[2].weight.register_hook(lambda g: g * math.inf if poison["on"] else g)
    history = []
    for step in range(3):
        poison["on"] = step == 1
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(step)).bfloat16()
        acc.backward(model(x).float().pow(2).mean())
        o1.step(), s1.step(), o2.step(), s2.step()
        o1.zero_grad(), o2.zero_grad()
        history.append((o1.step_was_skipped, o2.step_was_skipped, o1.param_groups[0]["lr"], o2.param_groups[0]["lr"]))
    assert s1.optimizers == [o1] and s2.optimizers == [o2]
    assert history == [(False, False, 0.05, 0.05), (False, True, 0.025, 0.05), (False, False, 0.0125, 0.025)]


# ---------------------------------------------------------------------------- prepare twice
@pytest.mark.parametrize("async_step", [False, True], ids=["sync", "async"])
def test_preparing_an_optimizer_again_gives_the_prepared_one(async_step):
    # Defect: a torch optimizer prepared a second time (a helper that calls prepare again)
    # got a second MixedPrecisionOptimizer around its masters with async_step (masters of
    # masters, two optimizers stepping the same weights), or a misleading TypeError without.
    acc = accelerator("fp16", async_step=async_step)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, sgd)
    assert acc.prepare(sgd) is opt and acc.prepare(opt.optimizer) is opt and acc.prepare(opt) is opt
    assert acc._optimizers == [opt] and len(opt.optimizer.master_params) == 4
    user_built = fp16kit.MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), async_step=async_step)
    if async_step:  # the accelerator's options beside a user-built optimizer: refused
        with pytest.raises(ValueError, match="set them on it"):
            acc.prepare(user_built)
        assert acc._optimizers == [opt]
        return
    again = acc.prepare(user_built)
    assert acc.prepare(user_built) is again and acc._optimizers == [opt, again]


@pytest.mark.parametrize("option", [{"async_step": True}, {"master_device": "cpu"}, {"master_dtype": torch.float64}])
def test_master_options_beside_a_user_built_optimizer_are_refused(option):
    # Before: silently ignored (the user-built optimizer is used as is), e.g. async_step=True
    # on the accelerator trained synchronously. Same rule as MasterWeightsTrainer.
    acc = accelerator("fp16", **option)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).half()
    user_built = fp16kit.MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="set them on it, not on MasterWeightsAccelerator"):
        acc.prepare(model, user_built)
    assert acc._optimizers == [] and not user_built.async_step


# ---------------------------------------------------------------------------- user-skipped steps
@pytest.mark.parametrize("async_step", [False, True], ids=["sync", "async"])
def test_user_skipping_a_non_finite_norm_step_equals_torch_amp_rule(async_step):
    # Defect: `norm = accelerator.clip_grad_norm_(...); if not torch.isfinite(norm):
    # optimizer.zero_grad(); continue` left the unscale pending: the next iteration skipped its
    # unscale, reported a norm * scale and skipped its (clean) step on the old inf flag.
    # Reference: torch.amp's version of the same loop (scaler.update() on the skip path).
    def plain():
        model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).half()
        opt = fp16kit.MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), async_step=async_step)
        scaler = plain_scaler("fp16")
        log = []
        for step in range(5):
            scaler.scale(mlp_loss(model, step, overflow_at=1)).backward()
            scaler.unscale_(opt)
            norm = opt.clip_grad_norm_(0.5, params=model.parameters())
            if not torch.isfinite(norm):
                scaler.update()
                opt.zero_grad()
                log.append((float(norm), True, scaler.get_scale()))
                continue
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            log.append((float(norm), scaler.last_step_skipped(), scaler.get_scale()))
        opt.synchronize()
        return log, [p.detach().clone() for p in model.parameters()]

    def accelerated():
        acc = accelerator("fp16", async_step=async_step)
        model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
        model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        log = []
        for step in range(5):
            acc.backward(mlp_loss(model, step, overflow_at=1))
            norm = acc.clip_grad_norm_(model.parameters(), 0.5)
            if not torch.isfinite(norm):
                opt.zero_grad()
                log.append((float(norm), opt.step_was_skipped, acc.scaler.get_scale()))
                continue
            opt.step()
            opt.zero_grad()
            log.append((float(norm), opt.step_was_skipped, acc.scaler.get_scale()))
        acc.synchronize()
        return log, [p.detach().clone() for p in model.parameters()]

    torch.manual_seed(0)
    ref = plain()
    torch.manual_seed(0)
    got = accelerated()
    assert repr(got[0]) == repr(ref[0])  # (nan == nan in repr)
    assert [s for _, s, _ in got[0]] == [False, True, False, False, False]
    assert got[0][1][2] == SCALE / 2 and 0 < got[0][2][0] < 100  # halved; the next norm unscaled
    assert all(torch.equal(a, b) for a, b in zip(got[1], ref[1], strict=True))


def mlp_loss(model: torch.nn.Module, step: int, overflow_at: int | None = None, dtype=torch.float16) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 6, generator=g).to(dtype), torch.randn(8, 3, generator=g).to(dtype)
    return torch.nn.functional.mse_loss(model(x), y) * (math.inf if step == overflow_at else 1.0)


def test_backward_after_a_clip_without_step_is_refused_before_anything_changes():
    # the same skip written without zero_grad (`continue` jumps over it): the next backward
    # would add to unscaled-away grads; refused with the fix named, grads left as they were
    acc = accelerator("fp16")
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    acc.backward(mlp_loss(model, 0, overflow_at=0))
    assert not torch.isfinite(acc.clip_grad_norm_(model.parameters(), 0.5))
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"call optimizer.zero_grad\(\) instead of step\(\)"):
        acc.backward(mlp_loss(model, 1))
    assert all(same(g, p.grad) for g, p in zip(grads, model.parameters(), strict=True))
    opt.zero_grad()  # the fix: the step counts as skipped, the scale halves
    assert opt.step_was_skipped and acc.scaler.get_scale() == SCALE / 2
    acc.backward(mlp_loss(model, 1))
    assert 0 < float(acc.clip_grad_norm_(model.parameters(), 0.5)) < 100
    opt.step()
    assert not opt.step_was_skipped


# ---------------------------------------------------------------------------- checkpoints
def test_bf16_checkpoint_into_an_fp16_accelerator_is_refused_before_loading(tmp_path):
    # Before: Accelerate's FileNotFoundError for scaler.pt, after the model and the masters
    # had been overwritten by the bf16 run's.
    acc = accelerator("bf16")
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    acc.save_state(tmp_path / "bf16")
    reset()
    acc = accelerator("fp16")
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = [p.detach().clone() for p in (*model.parameters(), *opt.optimizer.master_params)]
    with pytest.raises(ValueError, match=r"mixed_precision='bf16'"):
        acc.load_state(str(tmp_path / "bf16"))
    after = [*model.parameters(), *opt.optimizer.master_params]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


# ---------------------------------------------------------------------------- held up (guards)
def mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def plain_step(opt, scaler, model, max_norm):
    """One optimizer step of the plain loop: unscale, clip on the masters, step, update."""
    if scaler:
        scaler.unscale_(opt)
    norm = opt.clip_grad_norm_(max_norm, params=model.parameters())
    if scaler:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    opt.zero_grad()
    return norm


@pytest.mark.parametrize("mp,async_step", [("fp16", True), ("bf16", False)])
def test_short_last_accumulation_window_of_a_prepared_dataloader(mp, async_step):
    # 5 batches, gradient_accumulation_steps=2, two epochs: the 5th batch syncs alone (end of
    # the dataloader); Accelerate still divides its loss by 2. StepLR stepped per sync step.
    dtype = DTYPES[mp]
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(40, 6, generator=g), torch.randn(40, 3, generator=g))
    acc = accelerator(mp, async_step=async_step, gradient_accumulation_steps=2)
    model = mlp()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    model, opt, loader, sched = acc.prepare(model, sgd, loader, torch.optim.lr_scheduler.StepLR(sgd, 1, 0.5))
    syncs, norms = [], []
    for _ in range(2):
        for x, y in loader:
            with acc.accumulate(model):
                acc.backward(torch.nn.functional.mse_loss(model(x.to(dtype)), y.to(dtype)))
                syncs.append(acc.sync_gradients)
                if acc.sync_gradients:
                    norms.append(acc.clip_grad_norm_(model.parameters(), 0.5))
                opt.step(), sched.step(), opt.zero_grad()
    acc.synchronize()

    ref = mlp().to(dtype)
    ref_sgd = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_sgd, 1, 0.5)
    ref_opt = fp16kit.MixedPrecisionOptimizer(ref_sgd, async_step=async_step)
    scaler, ref_norms = plain_scaler(mp), []
    for _ in range(2):
        for i in range(5):
            x, y = data[8 * i : 8 * i + 8]
            loss = torch.nn.functional.mse_loss(ref(x.to(dtype)), y.to(dtype)) / 2
            (scaler.scale(loss) if scaler else loss).backward()
            if i % 2 == 1 or i == 4:
                ref_norms.append(plain_step(ref_opt, scaler, ref, 0.5))
                ref_sched.step()
    ref_opt.synchronize()
    assert syncs == [False, True, False, True, True] * 2
    assert all(same(a, b) for a, b in zip(norms, ref_norms, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters(), strict=True))
    assert sgd.param_groups[0]["lr"] == ref_sgd.param_groups[0]["lr"] == 0.1 * 0.5**6


@pytest.mark.parametrize("mp,async_step", [("fp16", False), ("fp16", True), ("bf16", True)])
def test_unfreezing_a_layer_mid_training_with_fused_adamw(mp, async_step):
    # fine-tuning schedule: layer 0 frozen, then unfrozen in a new param group with its own LR;
    # fused AdamW (the HF Trainer's default optimizer) steps on the device with found_inf.
    def run(accelerated):
        model = mlp()
        for p in model[0].parameters():
            p.requires_grad_(False)
        adamw = torch.optim.AdamW(model[2].parameters(), lr=1e-2, fused=True)
        if accelerated:
            acc = accelerator(mp, async_step=async_step)
            model, opt = acc.prepare(model, adamw)
        else:
            model = model.to(DTYPES[mp])
            opt, scaler = fp16kit.MixedPrecisionOptimizer(adamw, async_step=async_step), plain_scaler(mp)
        norms = []
        for step in range(5):
            if step == 2:
                for p in model[0].parameters():
                    p.requires_grad_(True)
                opt.add_param_group({"params": list(model[0].parameters()), "lr": 1e-3})
            loss = mlp_loss(model, step, overflow_at=3, dtype=DTYPES[mp])
            if accelerated:
                acc.backward(loss)
                norms.append(acc.clip_grad_norm_(model.parameters(), 0.5))
                opt.step(), opt.zero_grad()
            else:
                (scaler.scale(loss) if scaler else loss).backward()
                norms.append(plain_step(opt, scaler, model, 0.5))
        (acc if accelerated else opt).synchronize()
        return norms, [p.detach().clone() for p in model.parameters()]

    got, ref = run(True), run(False)
    assert all(same(a, b) for a, b in zip(got[0], ref[0], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(got[1], ref[1], strict=True))
    assert not torch.equal(got[1][0], mlp().to(DTYPES[mp])[0].weight)  # the unfrozen layer moved


@pytest.mark.parametrize("where", ["after_backward", "after_clip", "after_step"])
def test_ctrl_c_mid_step_then_save_resume_equals_the_uninterrupted_run(where, tmp_path):
    # KeyboardInterrupt raised at three points of step 4 (async fp16), caught by the user's
    # `except KeyboardInterrupt: accelerator.save_state(...)`; fresh objects resume.
    def steps(acc, model, opt, todo, interrupt_at=None):
        for step in todo:
            acc.backward(mlp_loss(model, step, overflow_at=3))
            if step == interrupt_at and where == "after_backward":
                raise KeyboardInterrupt
            acc.clip_grad_norm_(model.parameters(), 0.5)
            if step == interrupt_at and where == "after_clip":
                raise KeyboardInterrupt
            opt.step()
            if step == interrupt_at and where == "after_step":
                raise KeyboardInterrupt
            opt.zero_grad()

    def fresh(seed):
        reset()
        acc = accelerator("fp16", async_step=True)
        model = mlp(seed)
        model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        return acc, model, opt

    threads_before = {t.name for t in threading.enumerate() if t.name.startswith("fp16kit")}
    acc, model, opt = fresh(0)
    with pytest.raises(KeyboardInterrupt):
        steps(acc, model, opt, range(8), interrupt_at=4)
    acc.save_state(tmp_path / "interrupted")
    acc, model, opt = fresh(7)
    acc.load_state(str(tmp_path / "interrupted"))
    steps(acc, model, opt, range(5 if where == "after_step" else 4, 8))
    acc.synchronize()
    whole = fresh(0)
    steps(*whole, range(8))
    whole[0].synchronize()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), whole[1].parameters(), strict=True))
    assert acc.scaler.get_scale() == whole[0].scaler.get_scale()
    # no thread left behind (other tests' threads may be alive in a full run)
    assert {t.name for t in threading.enumerate() if t.name.startswith("fp16kit")} <= threads_before | {
        "fp16kit-optimizer"
    }


# ---------------------------------------------------------------------------- edits after the clip
def test_core_bf16_grad_edit_after_accelerator_clip_keeps_the_clip_or_raises():
    acc = accelerator("bf16")
    model = mlp()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    acc.backward(mlp_loss(model, 0, dtype=torch.bfloat16))
    acc.clip_grad_norm_(model.parameters(), 0.01)
    model[2].bias.grad.mul_(0.5)  # a user's edit between the clip and the step
    before = [m.detach().clone() for m in opt.optimizer.master_params]
    with pytest.raises(RuntimeError, match="changed after optimizer.clip_grad_norm_"):
        opt.step()  # re-reading the model grads would drop the clip silently
    assert all(torch.equal(m, b) for m, b in zip(opt.optimizer.master_params, before))


# ---------------------------------------------------------------------------- accelerate launch
@pytest.mark.parametrize(
    "launched,explicit,expected",
    [
        ("bf16", None, "bf16"),
        ("fp16", None, "fp16"),
        ("no", None, "fp16"),
        (None, None, "fp16"),
        ("bf16", "fp16", "fp16"),  # an explicit argument wins, as in Accelerator
    ],
)
def test_accelerate_launch_mixed_precision_is_honoured(monkeypatch, launched, explicit, expected):
    # Before: `accelerate launch --mixed_precision bf16 train.py` with MasterWeightsAccelerator()
    # silently trained in fp16 (the argument's default replaced the launcher's choice).
    if launched is None:
        monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    else:
        monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", launched)
    acc = MasterWeightsAccelerator(explicit, cpu=True)
    assert acc.mixed_precision == expected and acc.model_dtype == DTYPES[expected]
    assert (acc.scaler is None) == (expected == "bf16")


def test_accelerate_launch_fp8_is_refused_before_touching_accelerate_state(monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")
    with pytest.raises(ValueError, match="--mixed_precision fp16/bf16"):
        MasterWeightsAccelerator(cpu=True)
    assert AcceleratorState._shared_state == {}


def test_free_memory_forgets_a_pending_unscale():
    # find_executable_batch_size's retry: the failed attempt stopped between the clip and the
    # step (an OOM there); the retry prepares new objects after accelerator.free_memory().
    acc = accelerator("fp16")
    model = mlp()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    acc.backward(mlp_loss(model, 0))
    acc.clip_grad_norm_(model.parameters(), 0.5)
    acc.free_memory()
    model = mlp()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    acc.backward(mlp_loss(model, 0))  # before: refused, an unscale of the old optimizer pending
    assert 0 < float(acc.clip_grad_norm_(model.parameters(), 0.5)) < 100
    opt.step()
    assert not opt.step_was_skipped and acc._optimizers == [opt]


@pytest.mark.parametrize("async_step", [False, True], ids=["sync", "async"])
def test_rollback_with_load_state_after_ctrl_c_between_clip_and_step(async_step, tmp_path):
    # A notebook: Ctrl-C between the clip and the step of an overflowing iteration, then
    # accelerator.load_state(last checkpoint) into the same objects and train on. Before: the
    # loop's first zero_grad updated the *loaded* scaler with the abandoned iteration's inf
    # (the scale then differed from a resume in fresh objects).
    def steps(acc, model, opt, todo, stop=None):
        scales = []
        for step in todo:
            opt.zero_grad()
            acc.backward(mlp_loss(model, step, overflow_at=4))
            acc.clip_grad_norm_(model.parameters(), 0.5)
            if step == stop:
                raise KeyboardInterrupt
            opt.step()
            scales.append(acc.scaler.get_scale())
        return scales

    def fresh(seed):
        reset()
        acc = accelerator("fp16", async_step=async_step)
        model = mlp(seed)
        model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        return acc, model, opt

    acc, model, opt = fresh(0)
    steps(acc, model, opt, range(3))
    acc.save_state(tmp_path / "ckpt")
    with pytest.raises(KeyboardInterrupt):
        steps(acc, model, opt, range(3, 8), stop=4)
    acc.load_state(str(tmp_path / "ckpt"))
    scales = steps(acc, model, opt, range(3, 8))
    acc.synchronize()
    ref = fresh(5)
    ref[0].load_state(str(tmp_path / "ckpt"))
    ref_scales = steps(*ref, range(3, 8))
    ref[0].synchronize()
    assert scales == ref_scales and ref_scales[1] == ref_scales[0] / 2
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref[1].parameters(), strict=True))


@pytest.mark.parametrize("async_step", [False, True], ids=["sync", "async"])
def test_clip_after_the_step_is_refused(async_step):
    # Before: `optimizer.step(); norm = accelerator.clip_grad_norm_(...)` (logging the norm in
    # the wrong place) unscaled spent grads -- a tiny wrong norm -- and the following zero_grad
    # updated the scaler a second time each iteration (the scale doubled every growth_interval/2).
    acc = accelerator("fp16", async_step=async_step)
    model = mlp()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for step in range(3):
        acc.backward(mlp_loss(model, step))
        opt.step()
        with pytest.raises(RuntimeError, match="Clip between backward and optimizer.step"):
            acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.zero_grad()
    assert acc.scaler.get_scale() == SCALE * 2  # growth_interval=2: one update per iteration
    acc.backward(mlp_loss(model, 3))  # the right order goes on working
    assert 0 < float(acc.clip_grad_norm_(model.parameters(), 1.0)) < 100
    opt.step()
    assert not opt.step_was_skipped


# ---------------------------------------------------------------- several optimizers, one scaler
def _two_models():
    torch.manual_seed(3)
    return torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)


def _two_opt_data():
    torch.manual_seed(4)
    return [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(5)]


def _loss(a, b, x, y, i, gan):
    if gan:  # one loss per model; the second model's loss does not reach the first
        la = torch.nn.functional.mse_loss(b(a(x.half())).float(), y)
        return la * (math.inf if i == 2 else 1.0), la
    loss = torch.nn.functional.mse_loss(b(a(x.half())).float(), y)
    return loss * (math.inf if i == 2 else 1.0), None  # an overflow at iteration 2


@pytest.mark.parametrize("gan", [False, True], ids=["one_backward", "backward_per_optimizer"])
@pytest.mark.parametrize("async_step", [False, True], ids=["sync", "async"])
def test_two_optimizers_update_the_scale_once_per_iteration(gan, async_step):
    """One backward, then two optimizers step: torch.amp's rule (step both, update once) --
    the second optimizer unscales with this iteration's scale. With a backward per optimizer
    (GAN-style) the update runs between them, as torch.amp's loop with an update per step."""
    data = _two_opt_data()
    acc = MasterWeightsAccelerator(
        "fp16",
        cpu=True,
        async_step=async_step,
        kwargs_handlers=[GradScalerKwargs(init_scale=SCALE, growth_interval=1)],
    )
    a, b = _two_models()
    a, b, oa, ob = acc.prepare(a, b, torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1))
    skipped = []
    for i, (x, y) in enumerate(data):
        if gan:
            loss, _ = _loss(a, b, x, y, i, gan)
            acc.backward(loss)
            oa.step()
            skipped.append(oa.step_was_skipped)
            acc.backward(torch.nn.functional.mse_loss(b(a(x.half()).detach()).float(), y))
            ob.step()
        else:
            loss, _ = _loss(a, b, x, y, i, gan)
            acc.backward(loss)
            oa.step()
            skipped.append(oa.step_was_skipped)
            ob.step()
        oa.zero_grad()
        ob.zero_grad()
    acc.synchronize()
    acc.settle_scale()

    a2, b2 = _two_models()
    a2.half()
    b2.half()
    pa = fp16kit.MixedPrecisionOptimizer(torch.optim.SGD(a2.parameters(), lr=0.1), async_step=async_step)
    pb = fp16kit.MixedPrecisionOptimizer(torch.optim.SGD(b2.parameters(), lr=0.1), async_step=async_step)
    sc = fp16kit.GradScaler("cpu", init_scale=SCALE, growth_interval=1)
    ref_skipped = []
    for i, (x, y) in enumerate(data):
        loss, _ = _loss(a2, b2, x, y, i, gan)
        sc.scale(loss).backward()
        sc.step(pa)
        ref_skipped.append(sc.last_step_skipped())
        if gan:
            sc.update()
            sc.scale(torch.nn.functional.mse_loss(b2(a2(x.half()).detach()).float(), y)).backward()
        sc.step(pb)
        sc.update()
        pa.zero_grad()
        pb.zero_grad()
    pa.synchronize()
    pb.synchronize()

    assert skipped == ref_skipped and skipped[2]
    assert acc.scaler.get_scale() == sc.get_scale()
    for p, q in zip([*a.parameters(), *b.parameters()], [*a2.parameters(), *b2.parameters()]):
        assert torch.equal(p, q)
    for o, r in ((oa.optimizer, pa), (ob.optimizer, pb)):
        for m, n in zip(o.master_params, r.master_params):
            assert torch.equal(m, n)
