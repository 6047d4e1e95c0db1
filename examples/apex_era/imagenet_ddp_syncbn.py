"""An apex-era distributed script in the style of apex's ImageNet example: apex.parallel's
DistributedDataParallel and convert_syncbn_model, FusedLAMB, LARC, FusedLayerNorm, and amp O1.
Launched like the old `python -m torch.distributed.launch` scripts (env:// rendezvous); runs in
one process by default (gloo on CPU).

Unmodified apex code: `fp16kit run examples/apex_era/imagenet_ddp_syncbn.py`.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn

import apex
from apex import amp
from apex.normalization import FusedLayerNorm
from apex.optimizers import FusedLAMB
from apex.parallel import DistributedDataParallel as DDP
from apex.parallel import convert_syncbn_model
from apex.parallel.LARC import LARC

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", default=0, type=int)
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--sync_bn", action="store_true", default=True)
parser.add_argument("--larc", action="store_true")
args = parser.parse_args()

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29517")
os.environ.setdefault("RANK", "0")
os.environ.setdefault("WORLD_SIZE", "1")
dist.init_process_group(backend="gloo", init_method="env://")
torch.manual_seed(0)

model = nn.Sequential(
    nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
    nn.AdaptiveAvgPool2d(2), nn.Flatten(), FusedLayerNorm(32), nn.Linear(32, 10),
)
if args.sync_bn:
    print("using apex synced BN")
    model = apex.parallel.convert_syncbn_model(model)
optimizer = FusedLAMB(model.parameters(), lr=1e-2, weight_decay=1e-4)
if args.larc:
    optimizer = LARC(optimizer)
model, optimizer = amp.initialize(model, optimizer, opt_level="O1", loss_scale="dynamic", verbosity=0)
model = DDP(model, delay_allreduce=True)

images = torch.randn(64, 3, 8, 8)
labels = (images.mean((1, 2, 3)) > 0).long() + 2 * (images[:, 0].mean((1, 2)) > 0).long()
criterion = nn.CrossEntropyLoss()
for i in range(args.steps):
    idx = torch.arange(i * 16, i * 16 + 16) % 64
    output = model(images[idx])
    loss = criterion(output.float(), labels[idx])
    optimizer.zero_grad()
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
    if i % 5 == 0:
        print(f"step {i} loss {loss.item():.4f}")
assert isinstance(model.module[1], apex.parallel.SyncBatchNorm)
print(f"final loss {loss.item():.4f}")
dist.destroy_process_group()
