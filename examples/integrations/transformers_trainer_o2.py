"""Fine-tune "O2 style" through the Transformers Trainer: fp16 weights, fp32 master weights,
fp16kit's loss scaler -- then resume from a checkpoint and check the run continues bit for bit.

    python examples/integrations/transformers_trainer_o2.py [--async-step] [--output-dir DIR]

A tiny GPT2 built from a config (no download) trains on random token ids on the CPU in a few
seconds. The scaler starts at 2**20, too high for this model's fp16 gradients: the first steps
overflow, are skipped (the LR schedule does not advance) and the scale backs off.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

import fp16kit
from fp16kit.integrations.transformers import MasterWeightsTrainer


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def train(output_dir: str, async_step: bool, resume: str | None = None) -> MasterWeightsTrainer:
    ids = torch.randint(0, 64, (48, 8), generator=torch.Generator().manual_seed(1))
    args = TrainingArguments(
        output_dir=output_dir, fp16=True,            # fp16 weights; bf16=True for bfloat16
        max_steps=8, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        learning_rate=1e-3, max_grad_norm=1.0,       # clips the fp32 master grads
        save_strategy="steps", save_steps=4, logging_steps=1,
        use_cpu=True, report_to="none", disable_tqdm=True, dataloader_num_workers=0,
    )
    trainer = MasterWeightsTrainer(
        model=tiny_gpt2(), args=args, train_dataset=[{"input_ids": x, "labels": x} for x in ids],
        scaler=fp16kit.GradScaler("cpu", init_scale=2.0**20),  # default: GradScaler's 2**16
        async_step=async_step,                                 # optimizer step on a thread
    )
    trainer.remove_callback(transformers.PrinterCallback)  # the example prints its own lines
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--async-step", action="store_true", help="run optimizer steps on fp16kit's thread")
    parser.add_argument("--output-dir", default=None, help="where checkpoints go (default: a temp dir)")
    cli = parser.parse_args()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as tmp:
        out = cli.output_dir or tmp
        trainer = train(out, cli.async_step)
        steps = [h for h in trainer.state.log_history if "grad_norm" in h]
        for h in steps:
            print(f"step {h['step']}: loss {h['loss']:.4f}  grad_norm {h['grad_norm']:.4f}  lr {h['learning_rate']:.2e}")
        scaler = trainer.accelerator.scaler
        print(f"train loss: {trainer.state.log_history[-1]['train_loss']:.4f}")
        print(f"skipped steps: {scaler.skipped_steps()} (scale now {scaler.get_scale():.0f})")
        print(f"weights: {trainer.model.dtype}, masters: {trainer.optimizer.optimizer.master_params[0].dtype}")

        resumed = train(out, cli.async_step, resume=f"{out}/checkpoint-4")
        same = all(torch.equal(a, b) for a, b in zip(trainer.model.parameters(), resumed.model.parameters()))
        same &= all(torch.equal(a, b) for a, b in zip(trainer.optimizer.optimizer.master_params,
                                                      resumed.optimizer.optimizer.master_params))
        same &= scaler.state_dict() == resumed.accelerator.scaler.state_dict()
        print("resume: bit-identical" if same else "resume: DIFFERENT")
        if not same:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
