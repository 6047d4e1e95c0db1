"""An apex-era training script, migrated by changing one import line.

Before: `from apex.fp16_utils import FP16_Optimizer, network_to_half`. The rest is the loop
apex documented: an fp16 model, FP16_Optimizer with dynamic loss scaling, optimizer.backward,
a checkpoint saved mid-way and resumed. Runs on CPU (or CUDA when available).

    python examples/apex_fp16_optimizer.py --steps 60
"""

import argparse
import os
import tempfile

import torch
from torch import nn

from fp16kit.legacy import FP16_Optimizer, network_to_half  # was: from apex.fp16_utils import ...


def build(device):
    torch.manual_seed(0)
    model = network_to_half(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    optimizer = FP16_Optimizer(optimizer, dynamic_loss_scale=True, dynamic_loss_args={"init_scale": 2.0**20}, verbose=False)
    return model, optimizer


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 16, generator=g)
    y = (x[:, :4].sum(dim=1, keepdim=True) / 2).tanh()
    x, y = x.to(device), y.to(device)

    model, optimizer = build(device)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=max(1, args.steps // 2), gamma=0.5)
    ckpt = os.path.join(tempfile.mkdtemp(), "ckpt.pt")
    skipped = 0
    for step in range(args.steps):
        idx = torch.randint(0, 512, (64,), generator=g).to(device)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x[idx]).float(), y[idx])
        optimizer.backward(loss)
        skipped += optimizer.overflow
        optimizer.step()
        scheduler.step()
        if step == args.steps // 2:  # save, then resume into fresh objects
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, ckpt)
            state = torch.load(ckpt, weights_only=True)
            model, optimizer = build(device)
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=max(1, args.steps // 2), gamma=0.5)
        if step % max(1, args.steps // 5) == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}  loss scale {optimizer.loss_scale:g}")
    with torch.no_grad():
        final = nn.functional.mse_loss(model(x).float(), y).item()
    print(f"final loss {final:.4f}; skipped {skipped} overflowing steps while the scale calibrated")


if __name__ == "__main__":
    main()
