"""A Megatron-LM v1 (2019) style training step: its copied `fp16` package (FP16_Module,
FP16_Optimizer with hysteresis `delayed_shift` and `min_scale`), apex's FusedAdam as Adam,
`backward(loss, update_master_grads=False)` then `update_master_grads()`, master-grad clipping,
and the LR scheduler skipped while `optimizer.overflow` is set. Saves a Megatron-style
checkpoint (args Namespace, RNG states) and resumes from it.

Unmodified Megatron code: `fp16kit run --megatron examples/apex_era/megatron_v1.py --fp16`.
"""

import argparse
import os
import random
import tempfile

import torch
from torch import nn

from apex.optimizers import FusedAdam as Adam
from fp16 import FP16_Module
from fp16 import FP16_Optimizer

parser = argparse.ArgumentParser()
parser.add_argument("--fp16", action="store_true")
parser.add_argument("--train-iters", type=int, default=30)
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--weight-decay", type=float, default=0.01)
parser.add_argument("--clip-grad", type=float, default=1.0)
parser.add_argument("--loss-scale", type=float, default=None)
parser.add_argument("--loss-scale-window", type=float, default=1000)
parser.add_argument("--min-scale", type=float, default=1)
parser.add_argument("--hysteresis", type=int, default=2)
args = parser.parse_args()
args.dynamic_loss_scale = args.loss_scale is None


class ColumnParallelLinear(nn.Linear):
    """mpu's layers marked their weights as model-parallel."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.weight.model_parallel = True
        self.bias.model_parallel = True


def get_params_for_weight_decay_optimization(module):
    weight_decay_params = {"params": []}
    no_weight_decay_params = {"params": [], "weight_decay": 0.0}
    for module_ in module.modules():
        if isinstance(module_, nn.LayerNorm):
            no_weight_decay_params["params"].extend([p for p in module_._parameters.values() if p is not None])
        else:
            weight_decay_params["params"].extend([p for n, p in module_._parameters.items() if p is not None and n != "bias"])
            no_weight_decay_params["params"].extend([p for n, p in module_._parameters.items() if p is not None and n == "bias"])
    return weight_decay_params, no_weight_decay_params


torch.manual_seed(1234)
random.seed(1234)
model = nn.Sequential(ColumnParallelLinear(16, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 16))
for p in model.parameters():
    if not hasattr(p, "model_parallel"):
        p.model_parallel = False
if args.fp16:
    model = FP16_Module(model)

param_groups = get_params_for_weight_decay_optimization(model)
optimizer = Adam(param_groups, lr=args.lr, weight_decay=args.weight_decay)
if args.fp16:
    optimizer = FP16_Optimizer(
        optimizer,
        static_loss_scale=args.loss_scale,
        dynamic_loss_scale=args.dynamic_loss_scale,
        dynamic_loss_args={
            "scale_window": args.loss_scale_window,
            "min_scale": args.min_scale,
            "delayed_shift": args.hysteresis,
        },
    )
lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
    optimizer.optimizer if args.fp16 else optimizer, lambda it: min(1.0, (it + 1) / 10)
)

x = torch.randn(256, 16)
target = torch.sin(x @ torch.randn(16, 16))
skipped_iters = 0
for iteration in range(args.train_iters):
    idx = torch.arange(iteration * 32, iteration * 32 + 32) % 256
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(x[idx]).float(), target[idx])
    if args.fp16:
        optimizer.backward(loss, update_master_grads=False)
    else:
        loss.backward()
    # (the data-parallel all-reduce of the fp16 grads ran here)
    if args.fp16:
        optimizer.update_master_grads()
    if args.clip_grad > 0:
        if not args.fp16:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
        else:
            optimizer.clip_master_grads(args.clip_grad)
    optimizer.step()
    if not (args.fp16 and optimizer.overflow):
        lr_scheduler.step()
    else:
        skipped_iters += 1
    if iteration % 10 == 0:
        scale = optimizer.loss_scale if args.fp16 else 1
        print(f"iteration {iteration} loss {loss.item():.4f} loss scale {scale} skipped {skipped_iters}")

sd = {
    "iteration": args.train_iters,
    "model": model.state_dict_for_save_checkpoint() if args.fp16 else model.state_dict(),
    "optimizer": optimizer.state_dict(),
    "lr_scheduler": lr_scheduler.state_dict(),
    "random_rng_state": random.getstate(),
    "torch_rng_state": torch.get_rng_state(),
    "args": args,
}
path = os.path.join(tempfile.mkdtemp(), "model_optim_rng.pt")
torch.save(sd, path)
# Megatron 2019 called torch.load(path, map_location='cpu'); torch >= 2.6 needs weights_only=False
# for the pickled args Namespace (fp16kit.legacy.load_checkpoint reads it without that).
sd = torch.load(path, map_location="cpu", weights_only=False)
model.load_state_dict(sd["model"])
optimizer.load_state_dict(sd["optimizer"])
print(f"resumed at iteration {sd['iteration']} (skipped {skipped_iters})")
print(f"final loss {loss.item():.4f}")
