"""MasterWeightsTrainer on the paths a user moving a real fine-tuning script takes.

Each numeric check compares against an independent reference: the plain fp16kit loop written out
below (``model.to(dtype)``, ``MixedPrecisionOptimizer`` over fused AdamW, ``fp16kit.GradScaler``
for fp16, the masters clipped through ``clip_grad_norm_(params=model.parameters())``, the linear
schedule not stepping after a skipped step) on the Trainer's sequential batches -- grouped into
optimizer steps with the last accumulation window short, the loss normalised as the Trainer does
(``num_items_in_batch`` for models taking loss kwargs, ``/ len(window)`` for the others). The
Trainer adds no arithmetic of its own, so everything is compared bit for bit (``torch.equal``).
"""

from __future__ import annotations

import math
import os

import pytest

pytest.importorskip("transformers", reason="needs transformers: pip install 'fp16kit[transformers]'")
pytest.importorskip("accelerate", reason="needs accelerate: pip install 'fp16kit[transformers]'")

import safetensors.torch  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import (  # noqa: E402
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.modeling_outputs import SequenceClassifierOutput  # noqa: E402

import fp16kit  # noqa: E402
from fp16kit.integrations.transformers import MasterWeightsTrainer  # noqa: E402

transformers.logging.set_verbosity_error()

VOCAB, BATCH, LR = 64, 4, 1e-3
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


# ---------------------------------------------------------------------------- models and data
def gpt2(seed: int = 0) -> GPT2LMHeadModel:
    """lm_head.weight is tied to transformer.wte.weight."""
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(
        GPT2Config(
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
    )
    model.loss_type = "ForCausalLM"  # see test_transformers.tiny_model
    return model


def bert(seed: int = 0) -> BertForSequenceClassification:
    torch.manual_seed(seed)
    return BertForSequenceClassification(
        BertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=16,
            num_labels=3,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
    )


class BNNet(torch.nn.Module):
    """A user's own module: BatchNorm (fp16 running stats), LayerNorm, a frozen embedding, and a
    forward without ``**kwargs`` (so the Trainer divides the loss by the accumulation steps)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(VOCAB, 16)
        self.fc = torch.nn.Linear(16, 32)
        self.bn = torch.nn.BatchNorm1d(32)
        self.ln = torch.nn.LayerNorm(32)
        self.head = torch.nn.Linear(32, 3)
        self.emb.weight.requires_grad_(False)

    def forward(self, input_ids, labels=None):
        h = self.ln(torch.relu(self.bn(self.fc(self.emb(input_ids).mean(1)))))
        logits = self.head(h)
        loss = None if labels is None else torch.nn.functional.cross_entropy(logits, labels)
        return SequenceClassifierOutput(loss=loss, logits=logits)


def lm_data(n: int = 32) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, VOCAB, (n, 8), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": x, "labels": x.clone()} for x in ids]


def cls_data(n: int = 20) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    ids, labels = torch.randint(0, VOCAB, (n, 8), generator=g), torch.randint(0, 3, (n,), generator=g)
    return [{"input_ids": x, "labels": y} for x, y in zip(ids, labels)]


def targs(out, precision: str | None = "fp16", **kw) -> TrainingArguments:
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
    if precision:
        base[precision] = True
    return TrainingArguments(**base)


# ---------------------------------------------------------------------------- the reference loop
def windows(data, accum: int, epochs: int):
    """The Trainer's sequential micro-batches, grouped into optimizer steps (last window short)."""
    out = []
    for _ in range(epochs):
        micro = [data[i : i + BATCH] for i in range(0, len(data), BATCH)]
        micro = [{k: torch.stack([row[k] for row in rows]) for k in rows[0]} for rows in micro]
        out += [micro[i : i + accum] for i in range(0, len(micro), accum)]
    return out


def reference(
    model,
    data,
    precision: str,
    *,
    accum: int = 1,
    epochs: int = 1,
    loss_kwargs: bool = True,
    causal: bool = False,
    max_norm: float = 0.5,
    inf_steps=(),
    **options,
):
    model = model.to(DTYPES[precision])
    params = [p for p in model.parameters() if p.requires_grad]
    inner = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, fused=True)
    opt = fp16kit.MixedPrecisionOptimizer(inner, **options)
    scaler = fp16kit.GradScaler("cpu") if precision == "fp16" else None
    steps = windows(data, accum, epochs)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, (len(steps) - s) / max(1, len(steps))))
    out = {"norms": [], "lrs": []}
    for k, window in enumerate(steps):
        n_items = sum((b["labels"][..., 1:] if causal else b["labels"]).ne(-100).sum() for b in window)
        for i, b in enumerate(window):
            loss = model(**b, num_items_in_batch=n_items).loss if loss_kwargs else model(**b).loss / len(window)
            loss = loss * math.inf if k in inf_steps and i == 0 else loss
            (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(opt)
        norm = opt.clip_grad_norm_(max_norm, params=model.parameters())
        if scaler:
            scaler.step(opt)
            scaler.update()
            skipped = scaler.last_step_skipped()
        else:
            skipped = not all(torch.isfinite(p.grad).all() for p in params)
            opt.step()
        out["norms"].append(norm.item())
        out["lrs"].append(opt.param_groups[0]["lr"])
        if not skipped:
            sched.step()
        model.zero_grad()
    opt.synchronize()
    out.update(model=model, opt=opt, scaler=scaler)
    return out


def assert_same(trainer, ref) -> None:
    for (name, p), q in zip(trainer.model.named_parameters(), ref["model"].parameters()):
        assert p.dtype == q.dtype and torch.equal(p, q), name
    for (name, b), c in zip(trainer.model.named_buffers(), ref["model"].buffers()):
        assert b.dtype == c.dtype and torch.equal(b, c), name
    logged = [h for h in trainer.state.log_history if "grad_norm" in h]
    norms = [h["grad_norm"] for h in logged]  # nan on an overflow step
    assert len(norms) == len(ref["norms"])
    assert all(a == b or (math.isnan(a) and math.isnan(b)) for a, b in zip(norms, ref["norms"]))
    assert [h["learning_rate"] for h in logged] == ref["lrs"]


# ---------------------------------------------------------------------------- what held up
@pytest.mark.parametrize("which, precision", [("bert", "fp16"), ("bnnet", "fp16"), ("bnnet", "bf16")])
def test_two_epochs_with_a_short_last_accumulation_window(tmp_path, precision, which):
    # 20 samples = 5 micro-batches an epoch: windows of 2, 2, 1; the schedule spans both epochs
    factory, loss_kwargs = (bert, True) if which == "bert" else (BNNet, False)
    trainer = MasterWeightsTrainer(
        model=factory(),
        args=targs(tmp_path, precision, gradient_accumulation_steps=2, num_train_epochs=2),
        train_dataset=cls_data(),
    )
    trainer.train()
    assert trainer.state.global_step == 6 and trainer.model_accepts_loss_kwargs is loss_kwargs
    ref = reference(factory(), cls_data(), precision, accum=2, epochs=2, loss_kwargs=loss_kwargs)
    assert_same(trainer, ref)
    if which == "bnnet":  # frozen: not in the optimizer, cast, untouched
        assert trainer.model.emb.weight.dtype == DTYPES[precision]
        assert torch.equal(trainer.model.emb.weight, BNNet().emb.weight.to(DTYPES[precision]))
        assert trainer.model.bn.num_batches_tracked.item() == 10


def test_user_param_groups_and_scheduler(tmp_path):
    """An optimizer with two LRs and a StepLR built on the fp32 model, passed as optimizers=."""

    def build(model):
        top = [p for n, p in model.named_parameters() if n.startswith("transformer.h.1")]
        rest = [p for n, p in model.named_parameters() if not n.startswith("transformer.h.1")]
        opt = torch.optim.AdamW([{"params": rest, "lr": 1e-4}, {"params": top, "lr": 1e-3}], fused=True)
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    model = gpt2()
    trainer = MasterWeightsTrainer(
        model=model, args=targs(tmp_path, max_steps=3), train_dataset=lm_data(), optimizers=build(model)
    )
    trainer.train()

    ref_model = gpt2().half()
    inner, _ = build(ref_model)
    opt = fp16kit.MixedPrecisionOptimizer(inner)
    sched, scaler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5), fp16kit.GradScaler("cpu")
    for (batch,) in windows(lm_data(), 1, 1)[:3]:
        n_items = batch["labels"][..., 1:].ne(-100).sum()
        scaler.scale(ref_model(**batch, num_items_in_batch=n_items).loss).backward()
        scaler.unscale_(opt)
        opt.clip_grad_norm_(0.5, params=ref_model.parameters())
        scaler.step(opt)
        scaler.update()
        if not scaler.last_step_skipped():
            sched.step()
        ref_model.zero_grad()
    for p, q in zip(trainer.model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)
    assert (
        [g["lr"] for g in trainer.optimizer.param_groups] == [g["lr"] for g in opt.param_groups] == [1.25e-5, 1.25e-4]
    )


# ---------------------------------------------------------------------------- defects found
class StopAt(TrainerCallback):
    """A user's budget callback: stop training at ``step`` (not an eval/save step)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


@pytest.mark.parametrize("async_step", [False, True])
def test_load_best_model_at_end_keeps_the_best_weights(tmp_path, async_step):
    # Was: with async_step, training stopped by a callback left the last step in flight; the
    # Trainer loaded the best checkpoint, then the end-of-training wait landed that step's masters
    # over it -- the "best" model was the last step's. Now the step lands before the best loads.
    args = targs(
        tmp_path,
        max_steps=12,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps",
        save_steps=2,
        load_best_model_at_end=True,
        metric_for_best_model="eval_loss",
        greater_is_better=True,
        per_device_eval_batch_size=BATCH,
    )
    trainer = MasterWeightsTrainer(
        model=gpt2(),
        args=args,
        train_dataset=lm_data(64),
        eval_dataset=lm_data(8),
        callbacks=[StopAt(5)],
        async_step=async_step,
    )
    trainer.train()
    assert trainer.state.global_step == 5
    best = trainer.state.best_model_checkpoint
    assert best.endswith("checkpoint-2")  # the highest eval loss: the first one
    saved = safetensors.torch.load_file(os.path.join(best, "model.safetensors"))
    weights = trainer.model.state_dict()
    for name, value in saved.items():
        assert torch.equal(weights[name], value), name
    # and it stays so: the trainer's waits after training land nothing over it
    trainer.evaluate()
    trainer.save_model(str(tmp_path / "final"))
    final = safetensors.torch.load_file(str(tmp_path / "final" / "model.safetensors"))
    assert all(torch.equal(final[name], value) for name, value in saved.items())


def test_resuming_a_plain_trainer_checkpoint_is_refused_before_anything_changes(tmp_path):
    # Was: the model was loaded from the checkpoint, then MixedPrecisionOptimizer.load_state_dict
    # raised about its own dict keys -- no fix named, and the trainer's model already replaced.
    Trainer(
        model=gpt2(),
        args=targs(tmp_path, None, max_steps=2, save_strategy="steps", save_steps=2),
        train_dataset=lm_data(),
    ).train()
    model = gpt2(5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = MasterWeightsTrainer(model=model, args=targs(tmp_path, max_steps=4), train_dataset=lm_data())
    for resume in (str(tmp_path / "checkpoint-2"), tmp_path / "checkpoint-2", True):
        with pytest.raises(ValueError, match="saved by transformers.Trainer.*from_pretrained"):
            trainer.train(resume_from_checkpoint=resume)
    assert trainer.optimizer is None and trainer.state.global_step == 0
    assert all(torch.equal(v, before[k]) for k, v in trainer.model.state_dict().items())


class RecordMasters(TrainerCallback):
    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        self.masters = [m.clone() for m in optimizer.optimizer.master_params]


def test_bf16_resumes_an_fp16_checkpoint(tmp_path):
    # Was: AttributeError 'NoneType' object has no attribute 'load_state_dict' (the Trainer
    # loads scaler.pt into the accelerator's scaler, which bf16 has not). Now scaler.pt is ignored.
    MasterWeightsTrainer(
        model=gpt2(), args=targs(tmp_path, max_steps=2, save_strategy="steps", save_steps=2), train_dataset=lm_data()
    ).train()
    ckpt = tmp_path / "checkpoint-2"
    assert (ckpt / "scaler.pt").exists()
    rec = RecordMasters()
    trainer = MasterWeightsTrainer(
        model=gpt2(5),
        train_dataset=lm_data(),
        callbacks=[rec],
        args=targs(tmp_path / "bf16", "bf16", max_steps=3, save_strategy="steps", save_steps=3),
    )
    trainer.train(resume_from_checkpoint=str(ckpt))
    assert trainer.state.global_step == 3 and trainer.model.dtype == torch.bfloat16
    saved = [m for group in torch.load(ckpt / "optimizer.pt", weights_only=True)["masters"] for m in group]
    assert len(saved) == len(rec.masters) and all(torch.equal(a, b) for a, b in zip(saved, rec.masters))
    # and back: an fp16 run resumes the bf16 checkpoint (no scaler.pt) with a new scaler
    fp16 = MasterWeightsTrainer(model=gpt2(), args=targs(tmp_path / "fp16", max_steps=4), train_dataset=lm_data())
    fp16.train(resume_from_checkpoint=str(tmp_path / "bf16" / "checkpoint-3"))
    assert fp16.state.global_step == 4 and fp16.model.dtype == torch.float16


def test_mixed_precision_optimizer_built_on_the_fp32_model_is_refused_at_construction(tmp_path):
    # Was: accepted; train() then cast the model to fp16 and Accelerate's check raised, naming
    # accelerator.prepare() -- the model already cast, the trainer unusable.
    model = gpt2()
    opt = fp16kit.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters()))
    with pytest.raises(ValueError, match=r"built on the float32 model.*optimizers=\(torch.optim.AdamW"):
        MasterWeightsTrainer(
            model=model, args=targs(tmp_path, max_steps=1), train_dataset=lm_data(), optimizers=(opt, None)
        )
    assert model.dtype == torch.float32 and not any(tmp_path.iterdir())


class FreezeHeadThisStep(TrainerCallback):
    """A user's on_pre_optimizer_step edit, done the documented way: on the master grads."""

    def __init__(self) -> None:
        self.ratios: list[float] = []

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, model=None, **kwargs):
        mpo = optimizer.optimizer
        master = dict(zip(map(id, mpo.model_params), mpo.master_params))[id(model.head.weight)]
        # the model's .grad still holds the scaled fp16 grads; the masters the unscaled ones
        if torch.isfinite(master.grad).all():
            self.ratios.append((model.head.weight.grad.float().norm() / master.grad.norm()).item())
        master.grad.zero_()


@pytest.mark.parametrize("async_step", [False, True])
def test_callback_edits_master_grads_at_on_pre_optimizer_step(tmp_path, async_step):
    model = BNNet()
    head = model.head.weight.detach().half()
    cb = FreezeHeadThisStep()
    trainer = MasterWeightsTrainer(
        model=model,
        args=targs(tmp_path, max_steps=3, optim="sgd", max_grad_norm=0.0),
        train_dataset=cls_data(),
        callbacks=[cb],
        async_step=async_step,
    )
    trainer.train()
    assert torch.equal(trainer.model.head.weight, head)
    assert not torch.equal(trainer.model.fc.weight, BNNet().fc.weight.half())
    scales = [32768.0, 32768.0]  # step 1 overflows at 65536 (BatchNorm's backward): skipped
    assert len(cb.ratios) == 2 and all(math.isclose(r, s, rel_tol=1e-2) for r, s in zip(cb.ratios, scales))


class ZeroHeadModelGrad(TrainerCallback):
    """A callback ported from a plain Trainer script: edits the model's grads."""

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        model.head.weight.grad.zero_()


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_callback_editing_model_grads_at_on_pre_optimizer_step_is_an_error(tmp_path, precision):
    # Was (bf16): the step read the edited model grads again, unclipped -- the clip silently
    # lost (a 1000x larger update here); (fp16) a generic scaler error. Now both name the masters.
    model = BNNet()
    trainer = MasterWeightsTrainer(
        model=model,
        args=targs(tmp_path, precision, max_steps=2, max_grad_norm=0.01),
        train_dataset=cls_data(),
        callbacks=[ZeroHeadModelGrad()],
    )
    with pytest.raises(RuntimeError, match=r"changed the model's gradients at on_pre_optimizer_step.*master_params"):
        trainer.train()
    assert trainer.state.global_step == 0  # raised before the first step
    assert torch.equal(trainer.model.fc.weight, BNNet().fc.weight.to(DTYPES[precision]))


def test_core_bf16_edit_after_clip_keeps_the_clip_or_raises():
    # core fca1c4f: without a scaler, model grads edited after clip_grad_norm_(params=...) raise
    # at the step (before, the step read them again, unclipped: the clip silently lost)
    model = BNNet().bfloat16()
    opt = fp16kit.MixedPrecisionOptimizer(torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1))
    batch = windows(cls_data(), 1, 1)[0][0]
    model(**batch).loss.backward()
    opt.clip_grad_norm_(0.01, params=model.parameters())
    model.head.weight.grad.zero_()  # an edit, after the clip
    before = [m.detach().clone() for m in opt.master_params]
    try:
        opt.step()
    except RuntimeError:
        return  # refusing the edit is fine too
    update = torch.stack([(m - b).norm() for m, b in zip(opt.master_params, before)]).norm()
    assert update <= 0.1 * 0.01 * 1.001  # lr * max_norm: the clip held


class CtrlCBeforeStep(TrainerCallback):
    """Ctrl-C once, between the clip (grads unscaled into the masters) and optimizer.step()."""

    def __init__(self, step: int) -> None:
        self.step, self.fired = step, False

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if state.global_step == self.step and not self.fired:
            self.fired = True
            raise KeyboardInterrupt


@pytest.mark.parametrize("async_step", [False, True])
def test_ctrl_c_between_clip_and_step_then_rerun_resumes_bit_for_bit(tmp_path, async_step):
    # Was (fp16): the rerun train(resume_from_checkpoint=True) on the same trainer (a notebook
    # cell run again) failed at its first backward -- "the grads of this iteration are unscaled
    # already" -- the trainer unusable. Now the interrupted iteration is dropped as a skipped step.
    kw = dict(max_steps=5, save_strategy="steps", save_steps=2)
    trainer = MasterWeightsTrainer(
        model=gpt2(),
        args=targs(tmp_path / "a", **kw),
        train_dataset=lm_data(),
        callbacks=[CtrlCBeforeStep(3)],
        async_step=async_step,
    )
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert trainer.state.global_step == 3
    trainer.train(resume_from_checkpoint=True)
    whole = MasterWeightsTrainer(
        model=gpt2(), args=targs(tmp_path / "b", **kw), train_dataset=lm_data(), async_step=async_step
    )
    whole.train()
    for p, q in zip(trainer.model.parameters(), whole.model.parameters()):
        assert torch.equal(p, q)
    for m, n in zip(trainer.optimizer.optimizer.master_params, whole.optimizer.optimizer.master_params):
        assert torch.equal(m, n)
    assert trainer.accelerator.scaler.state_dict() == whole.accelerator.scaler.state_dict()
    norms = [[h["grad_norm"] for h in t.state.log_history if "grad_norm" in h][-3:] for t in (trainer, whole)]
    assert norms[0] == norms[1]


# ---------------------------------------------------------------------------- more that held up
class NonFiniteFor(MasterWeightsTrainer):
    """The loss is multiplied by ``factor`` (inf or nan) for the first ``steps`` optimizer steps."""

    steps, factor = 0, math.inf

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        return loss * self.factor if self.state.global_step < self.steps else loss


@pytest.mark.parametrize("precision, factor, steps", [("fp16", math.inf, 5), ("bf16", math.nan, 4)])
def test_overflow_storm_and_nan_from_the_start(tmp_path, precision, factor, steps):
    model = gpt2()
    start = [p.detach().to(DTYPES[precision]) for p in model.parameters()]
    trainer = NonFiniteFor(model=model, args=targs(tmp_path, precision, max_steps=steps + 1), train_dataset=lm_data())
    trainer.steps, trainer.factor = steps, factor
    trainer.train()
    logged = [h for h in trainer.state.log_history if "grad_norm" in h]
    lrs = [h["learning_rate"] for h in logged]
    assert lrs == [LR] * (steps + 1)  # the schedule waits for the first real step
    assert all(math.isnan(h["grad_norm"]) or math.isinf(h["grad_norm"]) for h in logged[:steps])
    assert math.isfinite(logged[-1]["grad_norm"])
    scaler = trainer.accelerator.scaler
    if precision == "fp16":
        assert scaler.skipped_steps() == steps and scaler.get_scale() == 65536.0 / 2**steps
    # only the last step moved the weights
    masters = trainer.optimizer.optimizer
    assert trainer.lr_scheduler.last_epoch == 1 and masters.optimizer.state[masters.master_params[0]]["step"] == 1
    assert not all(torch.equal(p, q) for p, q in zip(trainer.model.parameters(), start))


def test_final_model_for_inference_and_predict(tmp_path):
    trainer = MasterWeightsTrainer(
        model=gpt2(),
        args=targs(tmp_path, max_steps=3, per_device_eval_batch_size=BATCH),
        train_dataset=lm_data(),
        async_step=True,
    )
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    loaded = GPT2LMHeadModel.from_pretrained(str(tmp_path / "final"))
    assert loaded.dtype == torch.float16 and loaded.lm_head.weight is loaded.transformer.wte.weight
    opt = trainer.optimizer.optimizer
    name_of = {id(p): n for n, p in trainer.model.named_parameters()}
    weights = dict(loaded.named_parameters())
    for p, master in zip(opt.model_params, opt.master_params):
        assert torch.equal(weights[name_of[id(p)]], master.half())  # the masters, rounded
    out = trainer.predict(lm_data(8))
    with torch.no_grad():
        batch = windows(lm_data(8), 1, 1)[0][0]
        assert torch.equal(torch.from_numpy(out.predictions[:BATCH]), loaded.eval()(**batch).logits)


def test_fp32_modules_of_a_model_loaded_in_fp16_are_kept(tmp_path):
    # Was: T5 loaded with from_pretrained(dtype=torch.float16) keeps its `wo` layers in fp32
    # (_keep_in_fp32_modules, against fp16 overflow); the trainer cast them to fp16 silently.
    # Now a model given with params in the chosen dtype keeps its dtypes; fp32 params are
    # stepped as they are. Compared with the plain loop on the same mixed model.
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=1,
        num_heads=2,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    T5ForConditionalGeneration(config).save_pretrained(str(tmp_path / "t5"))

    def load():
        return T5ForConditionalGeneration.from_pretrained(str(tmp_path / "t5"), dtype=torch.float16)

    fp32 = {n for n, p in load().named_parameters() if p.dtype == torch.float32}
    assert fp32 and all(".wo." in n for n in fp32)
    trainer = MasterWeightsTrainer(model=load(), args=targs(tmp_path / "out", max_steps=3), train_dataset=lm_data())
    trainer.train()
    assert {n for n, p in trainer.model.named_parameters() if p.dtype == torch.float32} == fp32

    model = load()
    inner = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, fused=True)
    opt, scaler = fp16kit.MixedPrecisionOptimizer(inner), fp16kit.GradScaler("cpu")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, (3 - s) / 3))
    for (batch,) in windows(lm_data(), 1, 1)[:3]:
        loss = model(**batch, num_items_in_batch=batch["labels"].ne(-100).sum()).loss
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        opt.clip_grad_norm_(0.5, params=model.parameters())
        scaler.step(opt)
        scaler.update()
        if not scaler.last_step_skipped():
            sched.step()
        model.zero_grad()
    for (name, p), q in zip(trainer.model.named_parameters(), model.parameters()):
        assert p.dtype == q.dtype and torch.equal(p, q), name
    # a MixedPrecisionOptimizer built on such a model (fp32 params stepped directly) is accepted
    model = load()
    mine = fp16kit.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters()))
    MasterWeightsTrainer(model=model, args=targs(tmp_path / "out"), train_dataset=lm_data(), optimizers=(mine, None))
    # fp16_full_eval would cast the kept fp32 params in place at evaluation: refused
    with pytest.raises(ValueError, match="fp16_full_eval=True would cast the model's torch.float32 params"):
        MasterWeightsTrainer(model=model, args=targs(tmp_path / "out", fp16_full_eval=True), train_dataset=lm_data())
    assert {n for n, p in model.named_parameters() if p.dtype == torch.float32} == fp32


def test_core_overflow_storm_then_a_finite_step_keeps_weights_finite():
    # ~170 overflows in a row take torch's scale to 0.0; the next finite step then unscales
    # zero grads by 1/0. torch.amp writes the NaNs into the weights; the master-weight path
    # flags the step (skipped) instead.
    model = BNNet().half()
    opt = fp16kit.MixedPrecisionOptimizer(torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1))
    scaler = fp16kit.GradScaler("cpu")
    batch = windows(cls_data(), 1, 1)[0][0]
    for _ in range(200):  # a loss that is inf for 200 steps (e.g. a bad data shard)
        scaler.scale(model(**batch).loss * math.inf).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    scaler.scale(model(**batch).loss).backward()
    scaler.step(opt)
    scaler.update()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_train_twice_continues_like_the_plain_loop(tmp_path):
    """A second trainer.train() (no resume) goes on with the same optimizer, masters and scaler
    and a new LR schedule, as transformers.Trainer does. (Each train() calls
    accelerator.free_memory(): the prepared optimizer must keep working with the accelerator.)"""
    trainer = MasterWeightsTrainer(model=gpt2(), args=targs(tmp_path, max_steps=2), train_dataset=lm_data())
    trainer.train()
    trainer.train()
    model = gpt2().half()
    opt = fp16kit.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, fused=True))
    scaler = fp16kit.GradScaler("cpu")
    for _ in range(2):
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, (2 - s) / 2))
        for (batch,) in windows(lm_data(), 1, 1)[:2]:
            scaler.scale(model(**batch, num_items_in_batch=batch["labels"][..., 1:].ne(-100).sum()).loss).backward()
            scaler.unscale_(opt)
            opt.clip_grad_norm_(0.5, params=model.parameters())
            scaler.step(opt)
            scaler.update()
            if not scaler.last_step_skipped():
                sched.step()
            model.zero_grad()
    for p, q in zip(trainer.model.parameters(), model.parameters()):
        assert torch.equal(p, q)
    assert trainer.accelerator.scaler.state_dict() == scaler.state_dict()


class InfAt(MasterWeightsTrainer):
    """inf in the first micro-batch's loss of the optimizer steps in ``inf_steps``."""

    inf_steps: tuple = ()

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        first = self.state.global_step not in self.seen
        self.seen.add(self.state.global_step)
        return loss * math.inf if first and self.state.global_step in self.inf_steps else loss


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_async_cpu_masters_accumulation_overflow_short_window(tmp_path, precision):
    """async_step + master_device="cpu" + 2-step accumulation with a short last window + an
    overflow at step 1, over 36 GPT2 samples (tied weights): the plain async loop, bit for bit."""
    trainer = InfAt(
        model=gpt2(),
        args=targs(tmp_path, precision, gradient_accumulation_steps=2, num_train_epochs=1),
        train_dataset=lm_data(36),
        async_step=True,
        master_device="cpu",
    )
    trainer.inf_steps, trainer.seen = (1,), set()
    trainer.train()
    assert trainer.state.global_step == 5
    ref = reference(
        gpt2(), lm_data(36), precision, accum=2, causal=True, inf_steps=(1,), async_step=True, master_device="cpu"
    )
    assert_same(trainer, ref)
    logged = [h["learning_rate"] for h in trainer.state.log_history if "grad_norm" in h]
    assert logged[1] == logged[2]  # the schedule did not step after the overflow


class UnfreezeAt(TrainerCallback):
    """A fine-tuning schedule: the first block trains from step ``step`` on."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step == self.step:
            model.transformer.h[0].requires_grad_(True)


@pytest.mark.parametrize("async_step", [False, True])
def test_frozen_block_unfrozen_mid_training(tmp_path, async_step):
    """The user's optimizer holds every param (frozen ones too); a callback unfreezes block 0 at
    step 2. Compared with the plain loop doing the same."""

    def frozen_model():
        model = gpt2()
        model.transformer.h[0].requires_grad_(False)
        return model

    model = frozen_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, fused=True)
    trainer = MasterWeightsTrainer(
        model=model,
        args=targs(tmp_path, max_steps=4),
        train_dataset=lm_data(),
        optimizers=(opt, None),
        callbacks=[UnfreezeAt(2)],
        async_step=async_step,
    )
    trainer.train()

    ref = frozen_model().half()
    mpo = fp16kit.MixedPrecisionOptimizer(
        torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0, fused=True), async_step=async_step
    )
    sched, scaler = torch.optim.lr_scheduler.LambdaLR(mpo, lambda s: max(0.0, (4 - s) / 4)), fp16kit.GradScaler("cpu")
    for k, (batch,) in enumerate(windows(lm_data(), 1, 1)[:4]):
        if k == 2:
            ref.transformer.h[0].requires_grad_(True)
        scaler.scale(ref(**batch, num_items_in_batch=batch["labels"][..., 1:].ne(-100).sum()).loss).backward()
        scaler.unscale_(mpo)
        mpo.clip_grad_norm_(0.5, params=ref.parameters())
        scaler.step(mpo)
        scaler.update()
        if not scaler.last_step_skipped():
            sched.step()
        ref.zero_grad()
    mpo.synchronize()
    for (name, p), q in zip(trainer.model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), name
    assert not torch.equal(
        trainer.model.transformer.h[0].mlp.c_fc.weight, frozen_model().half().transformer.h[0].mlp.c_fc.weight
    )


def test_core_bf16_loop_zeroing_the_model_clips_every_iteration():
    # core fca1c4f refused this (a new backward after a step, zeroed with model.zero_grad() as
    # the Trainer does, counted as an edit of the clipped grads); 4f27584 restored it
    model = BNNet().bfloat16()
    opt = fp16kit.MixedPrecisionOptimizer(torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1))
    for (batch,) in windows(cls_data(), 1, 1)[:2]:
        model(**batch).loss.backward()
        opt.clip_grad_norm_(1.0, params=model.parameters())
        opt.step()
        model.zero_grad()
