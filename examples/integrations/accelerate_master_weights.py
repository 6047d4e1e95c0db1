"""HF Accelerate with an fp16 model and fp32 master weights: fp16kit's MasterWeightsAccelerator.

The usual Accelerate loop; ``prepare`` casts the model to fp16 and steps fp32 masters behind
fp16kit.GradScaler. ``clip_grad_norm_`` clips the masters and returns the unscaled norm, the
overflow step is skipped (and the LR scheduler waits), and save_state/load_state resume exactly.

    python examples/integrations/accelerate_master_weights.py     # CPU, a few seconds
"""

import math
import tempfile

import torch
from accelerate.utils import GradScalerKwargs

from fp16kit.integrations.accelerate import MasterWeightsAccelerator


def main() -> None:
    accelerator = MasterWeightsAccelerator(
        mixed_precision="fp16",  # the model's dtype; the optimizer steps fp32 masters
        gradient_accumulation_steps=2,
        kwargs_handlers=[GradScalerKwargs(init_scale=1024.0)],
        cpu=True,
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    data = torch.utils.data.TensorDataset(torch.randn(64, 16), torch.randn(64, 4))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    def epoch(overflow_at: int | None = None, log: bool = True) -> None:
        for i, (x, y) in enumerate(loader):
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x.half()), y.half())
                if i == overflow_at:
                    loss = loss * math.inf  # as if the fp16 grads overflowed
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)  # unscaled
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients and log:
                print(f"step {i // 2}: loss {loss.item():.4f}  clipped norm {norm.item():.4f}  "
                      f"skipped {optimizer.step_was_skipped}  scale {accelerator.scaler.get_scale():g}  "
                      f"lr {scheduler.get_last_lr()[0]:.4f}")

    epoch(overflow_at=3)
    print(f"skipped steps: {accelerator.scaler.skipped_steps()}")
    with tempfile.TemporaryDirectory() as ckpt:
        accelerator.save_state(ckpt)  # model, masters + AdamW state, scaler, scheduler, RNG
        epoch(log=False)
        after = [p.detach().clone() for p in model.parameters()]
        accelerator.load_state(ckpt)
        epoch(log=False)
    same = all(torch.equal(a, p) for a, p in zip(after, model.parameters()))
    print(f"resumed bit for bit: {same}")


if __name__ == "__main__":
    main()
