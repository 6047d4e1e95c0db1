"""MasterWeightsTrainer (fp16kit.integrations.transformers) against the plain fp16kit loop.

The reference is the loop a user writes without the Trainer, on the same model (a 2-layer,
32-wide GPT2 built from a config, dropout off), the same batches (sequential sampler) and the
same optimizer (fused AdamW, the Trainer's default ``optim``) and linear LR schedule:
``model.to(dtype)``, ``MixedPrecisionOptimizer``, ``fp16kit.GradScaler`` (fp16), torch's
``clip_grad_norm_`` on the masters. The Trainer adds no arithmetic here -- GPT2 normalises its
loss by ``num_items_in_batch`` (the label count of the accumulated micro-batches), so the
Trainer does not divide by the accumulation steps, and the reference calls the model with the
same count -- so every comparison is bit for bit (``torch.equal``).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="needs transformers: pip install 'fp16kit[transformers]'")
pytest.importorskip("accelerate", reason="needs accelerate: pip install 'fp16kit[transformers]'")

import safetensors.torch  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments  # noqa: E402

import fp16kit  # noqa: E402
from fp16kit.integrations.accelerate import MasterWeightsAccelerator  # noqa: E402
from fp16kit.integrations.transformers import MasterWeightsTrainer  # noqa: E402

transformers.logging.set_verbosity_error()

ROOT = Path(__file__).resolve().parents[2]
BATCH, SEQ, VOCAB, LR = 4, 8, 64, 1e-3
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


# ---------------------------------------------------------------------------- setup
def tiny_model(seed: int = 0) -> GPT2LMHeadModel:
    config = GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=16,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config)
    # GPT2LMHeadModel's class name matches no LOSS_MAPPING key, so the Trainer would count the
    # unshifted labels for num_items_in_batch (the loss it computes is ForCausalLM's either way)
    model.loss_type = "ForCausalLM"
    return model


def dataset(n: int = 32) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": x, "labels": x.clone()} for x in ids]


def training_args(out: Path, precision: str, **kw) -> TrainingArguments:
    base = dict(
        output_dir=str(out),
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
        per_device_train_batch_size=BATCH,
        train_sampling_strategy="sequential",
        dataloader_num_workers=0,
        logging_steps=1,
        learning_rate=LR,
        seed=0,
        save_strategy="no",
        max_grad_norm=0.5,
    )
    base.update(kw)
    return TrainingArguments(**base, **{precision: True})


class Recorder(TrainerCallback):
    """Per optimizer step: was it skipped (the Trainer's own signal), the scale after it."""

    def __init__(self) -> None:
        self.skipped: list[bool] = []
        self.scales: list[float] = []
        self.trainer = None

    def on_step_end(self, args, state, control, **kwargs):
        acc = self.trainer.accelerator
        self.skipped.append(bool(acc.optimizer_step_was_skipped))
        self.scales.append(acc.scaler.get_scale() if acc.scaler is not None else 1.0)


class InfTrainer(MasterWeightsTrainer):
    """Injects inf into the first micro-batch's loss at optimizer step ``inf_step``; records the
    loss each training_step returns."""

    inf_step: int | None = None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if self.state.global_step == self.inf_step and not self._injected.get(self.state.global_step):
            self._injected[self.state.global_step] = True
            loss = loss * math.inf
        return loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.losses.append(loss)
        return loss


def run_trainer(
    out: Path,
    precision: str,
    *,
    max_steps: int,
    inf_step=None,
    resume=None,
    seed=0,
    async_step=False,
    eval_dataset=None,
    **kw,
):
    rec = Recorder()
    trainer = InfTrainer(
        model=tiny_model(seed),
        args=training_args(out, precision, max_steps=max_steps, **kw),
        train_dataset=dataset(),
        eval_dataset=eval_dataset,
        callbacks=[rec],
        async_step=async_step,
    )
    trainer.inf_step, trainer._injected, trainer.losses, rec.trainer = inf_step, {}, [], trainer
    trainer.train(resume_from_checkpoint=resume)
    return trainer, rec


def linear_lambda(max_steps: int):
    # transformers.get_linear_schedule_with_warmup with no warmup, as written there
    return lambda step: max(0.0, float(max_steps - step) / float(max(1, max_steps)))


def reference(
    precision: str,
    *,
    max_steps: int,
    accum: int = 1,
    inf_step=None,
    max_norm=0.5,
    async_step=False,
    sync_at=(),
    eval_batch=None,
    eval_at=(),
):
    """The plain fp16kit loop on the Trainer's batches; returns what the tests compare."""
    model = tiny_model(0).to(DTYPES[precision])
    inner = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, fused=True)
    opt = fp16kit.MixedPrecisionOptimizer(inner, async_step=async_step)
    scaler = fp16kit.GradScaler("cpu") if precision == "fp16" else None
    sched = torch.optim.lr_scheduler.LambdaLR(opt, linear_lambda(max_steps))
    master_of = {id(p): m for p, m in zip(opt.model_params, opt.master_params)}
    masters = [master_of[id(p)] for p in model.parameters()]
    data = dataset()
    out = {"losses": [], "norms": [], "lrs": [], "skipped": [], "scales": []}
    for step in range(max_steps):
        micro = [data[(step * accum + i) * BATCH : (step * accum + i + 1) * BATCH] for i in range(accum)]
        batches = [{k: torch.stack([row[k] for row in rows]) for k in rows[0]} for rows in micro]
        n_items = sum(b["labels"][..., 1:].ne(-100).sum() for b in batches)
        for i, b in enumerate(batches):
            loss = model(**b, num_items_in_batch=n_items).loss
            if step == inf_step and i == 0:
                loss = loss * math.inf
            out["losses"].append(loss.detach())
            (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(opt)
            norm = torch.nn.utils.clip_grad_norm_(masters, max_norm)
            scaler.step(opt)
            scaler.update()
            skipped = scaler.last_step_skipped()
        else:
            norm = opt.clip_grad_norm_(max_norm, params=model.parameters())
            skipped = not all(torch.isfinite(m.grad).all() for m in masters)
            opt.step()
        out["norms"].append(norm.item())
        out["lrs"].append(opt.param_groups[0]["lr"])
        out["skipped"].append(skipped)
        out["scales"].append(scaler.get_scale() if scaler else 1.0)
        if not skipped:
            sched.step()
        model.zero_grad()
        if step + 1 in sync_at or step + 1 == max_steps:
            evaluate = step + 1 in eval_at
            if evaluate:  # the loss on the weights an eval without the wait would see
                with torch.no_grad():
                    out.setdefault("stale_eval", []).append(model(**eval_batch).loss.item())
            opt.synchronize()
            if evaluate:
                with torch.no_grad():
                    out.setdefault("eval", []).append(model(**eval_batch).loss.item())
    out.update(model=model, opt=opt, scaler=scaler)
    return out


def same_floats(a, b) -> bool:
    return len(a) == len(b) and all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b))


def masters_by_name(model, opt):
    """name -> master (the Trainer groups params by weight decay: compare by name, not order)."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    return {name_of[id(p)]: m for p, m in zip(opt.model_params, opt.master_params)}


def assert_same_training(trainer, rec, ref, *, steps=None):
    """Bit for bit: model weights, masters, optimizer state, scaler; per step norms/lr/skips."""
    opt = trainer.optimizer.optimizer
    for (name, p), q in zip(trainer.model.named_parameters(), ref["model"].parameters()):
        assert p.dtype == q.dtype and torch.equal(p, q), name
    got, want = masters_by_name(trainer.model, opt), masters_by_name(ref["model"], ref["opt"])
    assert got.keys() == want.keys()
    for name, m in got.items():
        assert m.dtype == torch.float32 and torch.equal(m, want[name]), name
        assert opt.state[m].keys() == ref["opt"].state[want[name]].keys()
        for key, value in opt.state[m].items():
            assert torch.equal(value, ref["opt"].state[want[name]][key]), (name, key)
    if ref["scaler"] is not None:
        got, want = trainer.accelerator.scaler.state_dict(), ref["scaler"].state_dict()
        assert got == want
    # log_history: a resumed run carries the saved run's entries (trainer_state.json) on
    logged = [h for h in trainer.state.log_history if "grad_norm" in h]
    assert same_floats([h["grad_norm"] for h in logged], ref["norms"])
    assert [h["learning_rate"] for h in logged] == ref["lrs"]
    sl = slice(steps, None) if steps else slice(None)
    assert rec.skipped == ref["skipped"][sl]
    assert rec.scales == ref["scales"][sl]


# ---------------------------------------------------------------------------- fp16: one run shared
MAX_STEPS, INF_STEP, ACCUM = 4, 1, 2


@pytest.fixture(scope="module")
def fp16_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp16")
    trainer, rec = run_trainer(
        out,
        "fp16",
        max_steps=MAX_STEPS,
        inf_step=INF_STEP,
        gradient_accumulation_steps=ACCUM,
        save_strategy="steps",
        save_steps=2,
    )
    ref = reference("fp16", max_steps=MAX_STEPS, accum=ACCUM, inf_step=INF_STEP)
    return out, trainer, rec, ref


def test_fp16_accumulation_clipping_matches_plain_loop(fp16_run):
    _, trainer, rec, ref = fp16_run
    assert trainer.model.dtype == torch.float16
    assert isinstance(trainer.optimizer.optimizer, fp16kit.MixedPrecisionOptimizer)
    assert_same_training(trainer, rec, ref)
    assert len(trainer.losses) == MAX_STEPS * ACCUM
    assert all(torch.equal(a, b) or (a.isnan() and b.isnan()) or a == b for a, b in zip(trainer.losses, ref["losses"]))
    # clipping bit: the unscaled norms are above max_grad_norm (a scaled norm would be ~65536x)
    finite = [n for n in ref["norms"] if math.isfinite(n)]
    assert all(0.5 < n < 100 for n in finite), finite
    # and clipping changed the trajectory (Adam's first step ignores it, later ones do not)
    unclipped = reference("fp16", max_steps=MAX_STEPS, accum=ACCUM, inf_step=INF_STEP, max_norm=math.inf)
    assert not all(torch.equal(a, b) for a, b in zip(unclipped["opt"].master_params, ref["opt"].master_params))


def test_fp16_overflow_skips_step_and_lr(fp16_run):
    _, trainer, rec, ref = fp16_run
    assert rec.skipped == [False, True, False, False]
    assert rec.scales[0] == 65536.0 and rec.scales[1] == 32768.0
    assert trainer.accelerator.scaler.skipped_steps() == 1
    lrs = [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h and "loss" in h]
    # the scheduler does not step after the skipped step: steps 1 and 2 share their lr
    assert lrs[1] == lrs[2] == LR * linear_lambda(MAX_STEPS)(1) and lrs[0] == LR


def test_fp16_checkpoint_files_are_plain_data(fp16_run):
    out, *_ = fp16_run
    ckpt = out / "checkpoint-2"
    scaler_state = torch.load(ckpt / "scaler.pt", weights_only=True)
    assert scaler_state["scale"] == 32768.0
    opt_state = torch.load(ckpt / "optimizer.pt", weights_only=True)
    assert opt_state  # masters + inner AdamW state, read without unpickling classes
    weights = safetensors.torch.load_file(str(ckpt / "model.safetensors"))
    assert {t.dtype for t in weights.values()} == {torch.float16}


def test_fp16_resume_continues_bit_for_bit(fp16_run, tmp_path):
    out, trainer, rec, ref = fp16_run
    resumed, rec2 = run_trainer(
        out,
        "fp16",
        max_steps=MAX_STEPS,
        inf_step=INF_STEP,
        seed=123,
        gradient_accumulation_steps=ACCUM,
        resume=str(out / "checkpoint-2"),
    )
    assert resumed.state.global_step == MAX_STEPS
    assert_same_training(resumed, rec2, ref, steps=2)


# ---------------------------------------------------------------------------- bf16, async
def test_bf16_matches_plain_loop_and_skips_nonfinite(tmp_path):
    trainer, rec = run_trainer(tmp_path, "bf16", max_steps=3, inf_step=1)
    ref = reference("bf16", max_steps=3, inf_step=1)
    assert trainer.model.dtype == torch.bfloat16
    assert trainer.accelerator.scaler is None
    assert ref["skipped"] == [False, True, False]
    assert_same_training(trainer, rec, ref)
    assert not (tmp_path / "checkpoint-3" / "scaler.pt").exists()


# save at 2, evaluate at 3 (and, the Trainer's rule, at the end)
ASYNC_RUN = dict(
    save_strategy="steps",
    save_steps=2,
    eval_strategy="steps",
    eval_steps=3,
    eval_dataset=dataset(BATCH),
    per_device_eval_batch_size=BATCH,
)


@pytest.fixture(scope="module")
def async_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("async")
    trainer, rec = run_trainer(out, "fp16", max_steps=4, async_step=True, **ASYNC_RUN)
    eval_batch = {k: torch.stack([row[k] for row in dataset(BATCH)]) for k in ("input_ids", "labels")}
    # the trainer waits for the step in flight at the save (2), the eval (3) and the end (4)
    ref = reference("fp16", max_steps=4, async_step=True, sync_at=(2, 3), eval_batch=eval_batch, eval_at=(3, 4))
    return out, trainer, rec, ref


def test_async_matches_plain_async_loop(async_run):
    out, trainer, rec, ref = async_run
    assert_same_training(trainer, rec, ref)
    opt = trainer.optimizer.optimizer
    # evaluate waited for the step in flight: it saw step 3's weights, not step 2's. (The
    # Trainer averages per-sample copies of the batch loss in numpy: equal to a few ulps.)
    evals = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
    assert len(evals) == 2 and len(ref["eval"]) == 2
    for got, fresh, stale in zip(evals, ref["eval"], ref["stale_eval"]):
        assert math.isclose(got, fresh, rel_tol=1e-6) and not math.isclose(got, stale, rel_tol=1e-4)
    # landed at the end of training: the model holds the last step's masters
    for p, m in zip(opt.model_params, opt.master_params):
        assert torch.equal(p, m.to(p.dtype))
    # the checkpoint's weights are its masters' (saved after the step in flight landed)
    ckpt = out / "checkpoint-2"
    weights = safetensors.torch.load_file(str(ckpt / "model.safetensors"))
    saved = [m for group in torch.load(ckpt / "optimizer.pt", weights_only=True)["masters"] for m in group]
    name_of = {id(p): n for n, p in trainer.model.named_parameters()}
    names = [name_of[id(p)] for p in opt.model_params]
    assert len(saved) == len(names) and sum(n in weights for n in names) >= len(names) - 1
    for name, master in zip(names, saved):
        if name in weights:  # lm_head.weight is tied to wte and saved once
            assert torch.equal(weights[name], master.half()), name


def test_async_resume_continues_bit_for_bit(async_run):
    out, trainer, rec, ref = async_run
    # the same save/eval steps: each wait lands a step early, so they are part of the trajectory
    resumed, rec2 = run_trainer(
        out, "fp16", max_steps=4, async_step=True, seed=7, resume=str(out / "checkpoint-2"), **ASYNC_RUN
    )
    assert_same_training(resumed, rec2, ref, steps=2)


# ---------------------------------------------------------------------------- errors, internals
def test_trainer_builds_master_weights_accelerator(tmp_path):
    # guards the one transformers internal: Trainer.create_accelerator_and_postprocess builds
    # `Accelerator(**args)` by the module-level name transformers.trainer.Accelerator (5.24)
    import accelerate
    import transformers.trainer as trainer_module

    assert trainer_module.Accelerator is accelerate.Accelerator
    trainer = MasterWeightsTrainer(model=tiny_model(), args=training_args(tmp_path, "fp16"), train_dataset=dataset(8))
    assert isinstance(trainer.accelerator, MasterWeightsAccelerator)
    assert trainer.accelerator.mixed_precision == "fp16"
    assert isinstance(trainer.accelerator.scaler, fp16kit.GradScaler)
    assert not trainer.accelerator.native_amp  # no autocast: the Trainer's own fp16 mode is off
    assert trainer_module.Accelerator is accelerate.Accelerator  # restored


def test_says_so_when_the_trainer_stops_building_through_that_name(tmp_path, monkeypatch):
    import accelerate

    def builds_its_own(self):  # a future Trainer that builds its Accelerator another way
        self.accelerator = accelerate.Accelerator(cpu=True)

    monkeypatch.setattr(transformers.Trainer, "create_accelerator_and_postprocess", builds_its_own)
    with pytest.raises(RuntimeError, match="no longer builds it through transformers.trainer.Accelerator"):
        MasterWeightsTrainer(model=tiny_model(), args=training_args(tmp_path, "fp16"), train_dataset=dataset(8))


@pytest.mark.parametrize(
    "case, match",
    [
        ("no_precision", "fp16=True"),
        ("deepspeed", "DeepSpeed"),
        ("fsdp", "FSDP"),
        ("lomo", "LOMO"),
        ("full_eval", "bf16_full_eval"),
        ("wrong_dtype", "bfloat16"),
        ("wrapped", "DataParallel"),
        ("mpo_and_options", "set them on it"),
        ("scaler_bf16", "bf16 needs no loss scaling"),
    ],
)
def test_clear_errors_before_any_change(tmp_path, case, match):
    model = tiny_model()
    kwargs = {}
    args = training_args(tmp_path, "fp16")
    if case == "no_precision":
        args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    elif case == "deepspeed":
        args.deepspeed = "ds_config.json"
    elif case == "fsdp":
        args.fsdp = ["full_shard"]
    elif case == "lomo":
        args.optim = "lomo"
    elif case == "full_eval":
        args.bf16_full_eval = True
    elif case == "wrong_dtype":
        model = model.bfloat16()
    elif case == "wrapped":
        model = torch.nn.DataParallel(model)
    elif case == "mpo_and_options":
        kwargs = dict(
            optimizers=(fp16kit.MixedPrecisionOptimizer(torch.optim.AdamW(model.half().parameters())), None),
            async_step=True,
        )
    elif case == "scaler_bf16":
        args = training_args(tmp_path, "bf16")
        kwargs = dict(scaler=fp16kit.GradScaler("cpu"))
    dtypes = {p.dtype for p in model.parameters()}
    with pytest.raises((ValueError, TypeError), match=match):
        MasterWeightsTrainer(model=model, args=args, train_dataset=dataset(8), **kwargs)
    assert {p.dtype for p in model.parameters()} == dtypes
    assert not any(tmp_path.iterdir()) or case == "no_precision"


def test_user_built_optimizer_is_used_as_is(tmp_path):
    model = tiny_model().half()
    opt = fp16kit.MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    trainer = MasterWeightsTrainer(
        model=model, args=training_args(tmp_path, "fp16", max_steps=1), train_dataset=dataset(8), optimizers=(opt, None)
    )
    trainer.train()
    assert trainer.optimizer.optimizer is opt
    assert trainer.state.global_step == 1


class OtherTrainer(transformers.Trainer):
    """Stands for a Trainer subclass from another library (its own keyword arguments)."""

    def __init__(self, model, args, *, extra_option=0, **kwargs):
        self.extra_option = extra_option
        super().__init__(model=model, args=args, **kwargs)


def test_mixes_into_trainer_subclass_and_lands_last_async_step(tmp_path):
    class Mixed(MasterWeightsTrainer, OtherTrainer):
        pass

    trainer = Mixed(
        tiny_model(),
        training_args(tmp_path, "fp16", max_steps=2),
        train_dataset=dataset(),
        extra_option=5,
        async_step=True,
    )  # no callbacks= given: the wait is still installed
    trainer.train()
    assert trainer.extra_option == 5
    opt = trainer.optimizer.optimizer
    assert opt.master_params[0].dtype == torch.float32
    for p, m in zip(opt.model_params, opt.master_params):
        assert torch.equal(p, m.to(p.dtype))


# ---------------------------------------------------------------------------- example
def test_example_runs(tmp_path):
    script = ROOT / "examples" / "integrations" / "transformers_trainer_o2.py"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(
        [sys.executable, str(script), "--output-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "skipped steps: 2" in done.stdout
    assert "resume: bit-identical" in done.stdout
