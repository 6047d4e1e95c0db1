"""An apex.fp16_utils-era (2019) training script that checkpoints and resumes, written the way
apex's ImageNet example (main_fp16_optimizer.py) and examples/FP16_Optimizer_simple/save_load.py
did: `network_to_half`, FP16_Optimizer with a dynamic loss scale, a checkpoint per epoch holding
`optimizer.state_dict()` (in which apex pickled its loss-scaler object), and `--resume PATH`.

Kept as it was written for apex (only shortened): it imports apex. Run it unmodified with

    fp16kit run examples/apex_era/fp16_optimizer_resume.py --epochs 3 --dynamic-loss-scale --checkpoint-dir ckpt
    fp16kit run examples/apex_era/fp16_optimizer_resume.py --epochs 6 --dynamic-loss-scale --resume ckpt/checkpoint.pth.tar

It resumes with `torch.load(args.resume, ...)`, as apex's example did (torch.load's default was then
the full unpickler; since torch 2.6 it is weights_only=True). A checkpoint saved by apex itself
resumes the same way under `fp16kit run`: its scaler loads as fp16kit's, which the alias allows
torch.load's default to read (`--full-unpickler` passes weights_only=False instead, as torch's error
advises for trusted files: the same result). After `fp16kit migrate`, which reports that
torch.load, plain python cannot read apex's classes any more: convert such a file once with
`fp16kit convert-checkpoint OLD NEW` and resume from NEW.
"""

import argparse
import os
import shutil
import tempfile

import torch
import torch.nn as nn

from apex.fp16_utils import FP16_Optimizer, network_to_half

parser = argparse.ArgumentParser(description="fp16 training with checkpoints")
parser.add_argument("--epochs", default=6, type=int, metavar="N", help="number of total epochs to run")
parser.add_argument("--start-epoch", default=0, type=int, metavar="N", help="manual epoch number (useful on restarts)")
parser.add_argument("--lr", default=0.02, type=float, metavar="LR", help="initial learning rate")
parser.add_argument("--momentum", default=0.9, type=float, metavar="M", help="momentum")
parser.add_argument("--resume", default="", type=str, metavar="PATH", help="path to latest checkpoint (default: none)")
parser.add_argument("--checkpoint-dir", default="", type=str, metavar="DIR", help="where checkpoint.pth.tar goes")
parser.add_argument("--static-loss-scale", type=float, default=1,
                    help="Static loss scale, positive power of 2 values can improve fp16 convergence.")
parser.add_argument("--dynamic-loss-scale", action="store_true",
                    help="Use dynamic loss scaling.  If supplied, this argument supersedes --static-loss-scale.")
parser.add_argument("--scale-window", default=4, type=int, help="clean iterations before the loss scale grows")
parser.add_argument("--full-unpickler", action="store_true",
                    help="resume with torch.load(..., weights_only=False) (only for checkpoints you trust)")
args = parser.parse_args()


def save_checkpoint(state, filename="checkpoint.pth.tar"):
    torch.save(state, filename)


torch.manual_seed(0)
model = network_to_half(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
criterion = nn.MSELoss()
optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=args.momentum)
optimizer = FP16_Optimizer(optimizer,
                           static_loss_scale=args.static_loss_scale,
                           dynamic_loss_scale=args.dynamic_loss_scale,
                           dynamic_loss_args={"scale_window": args.scale_window},
                           verbose=False)

# optionally resume from a checkpoint
if args.resume:
    if os.path.isfile(args.resume):
        print("=> loading checkpoint '{}'".format(args.resume))
        if args.full_unpickler:
            checkpoint = torch.load(args.resume, map_location=lambda storage, loc: storage, weights_only=False)
        else:
            checkpoint = torch.load(args.resume, map_location=lambda storage, loc: storage)
        args.start_epoch = checkpoint["epoch"]
        model.load_state_dict(checkpoint["state_dict"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        print("=> loaded checkpoint '{}' (epoch {}, loss scale {:g})".format(
            args.resume, checkpoint["epoch"], optimizer.loss_scale))
    else:
        print("=> no checkpoint found at '{}'".format(args.resume))

checkpoint_dir = args.checkpoint_dir or tempfile.mkdtemp()
w = torch.randn(16, 4)
for epoch in range(args.start_epoch, args.epochs):
    data = torch.Generator().manual_seed(1000 + epoch)  # each epoch its own batches: a resume sees the same
    for i in range(4):
        x = torch.randn(32, 16, generator=data)
        y = x @ w
        output = model(x)
        loss = criterion(output.float(), y)
        optimizer.zero_grad()
        optimizer.backward(loss)
        optimizer.step()
    print("epoch {} loss {:.6f} loss scale {:g}".format(epoch, loss.item(), optimizer.loss_scale))
    save_checkpoint({"epoch": epoch + 1, "state_dict": model.state_dict(), "optimizer": optimizer.state_dict()},
                    os.path.join(checkpoint_dir, "checkpoint.pth.tar"))
if not args.checkpoint_dir:
    shutil.rmtree(checkpoint_dir)
print(f"final loss {loss.item():.6f}")
