"""torch.amp-style training of an fp16 model with fp32 master weights.

torch.amp.GradScaler refuses fp16 gradients; fp16kit.MixedPrecisionOptimizer keeps fp32
masters and fp16kit.GradScaler unscales the fp16 grads straight into them. Runs on CPU (or
CUDA when available); `--bf16` trains a bfloat16 model instead.

    python examples/fp16_model_grad_scaler.py --steps 100
"""

import argparse

import torch
from torch import nn

import fp16kit


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--bf16", action="store_true")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if args.bf16 else torch.float16

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 10)).to(device, dtype)
    optimizer = fp16kit.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-3))
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    scaler = fp16kit.GradScaler(device, growth_interval=50)

    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(32, 10, generator=g)
    for step in range(args.steps):
        x = torch.randn(128, 32, generator=g)
        target = (x @ teacher).argmax(dim=1)
        x, target = x.to(device, dtype), target.to(device)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x).float(), target)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        optimizer.clip_grad_norm_(1.0)  # clips the fp32 master grads
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        if step % max(1, args.steps // 5) == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}  scale {scaler.get_scale():g}")
    n = sum(m.numel() for m in optimizer.master_params)
    print(f"{str(dtype).replace('torch.', '')} model trained through {n} fp32 master weights; "
          f"skipped steps: {scaler.skipped_steps()}")


if __name__ == "__main__":
    main()
