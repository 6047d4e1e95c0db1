"""A MoCo-style contrastive script of the apex era (2020): a query encoder trained by SGD, a key
encoder following it by momentum, a queue of negative keys, and the InfoNCE loss written out with
its temperature -- `exp(logits / 0.05)` -- under `amp.initialize(model, optimizer, opt_level="O1")`.

The logits come out of an fp16 matmul (einsum), so `logits / T` is fp16 with values up to 1/T = 20,
and e**20 is far beyond fp16's 65504: apex O1 ran `exp`, `sum` and `log` in fp32, where the loss
stays finite. Shrunk to vectors on CPU: the two "augmented views" are noisy copies of one sample.

Unmodified apex code: `fp16kit run examples/apex_era/moco_o1.py`.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

from apex import amp

parser = argparse.ArgumentParser(description="MoCo (tiny)")
parser.add_argument("--opt-level", default="O1")
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--moco-dim", type=int, default=16)
parser.add_argument("--moco-k", type=int, default=64, help="queue size")
parser.add_argument("--moco-m", type=float, default=0.99, help="key encoder momentum")
parser.add_argument("--moco-t", type=float, default=0.05, help="softmax temperature")
args = parser.parse_args()


class MoCo(nn.Module):
    def __init__(self, base_encoder, dim=128, K=65536, m=0.999, T=0.07):
        super(MoCo, self).__init__()
        self.K = K
        self.m = m
        self.T = T
        self.encoder_q = base_encoder(num_classes=dim)
        self.encoder_k = base_encoder(num_classes=dim)
        for param_q, param_k in zip(self.encoder_q.parameters(), self.encoder_k.parameters()):
            param_k.data.copy_(param_q.data)  # initialize
            param_k.requires_grad = False  # not update by gradient
        self.register_buffer("queue", torch.randn(dim, K))
        self.queue = nn.functional.normalize(self.queue, dim=0)
        self.register_buffer("queue_ptr", torch.zeros(1, dtype=torch.long))

    @torch.no_grad()
    def _momentum_update_key_encoder(self):
        for param_q, param_k in zip(self.encoder_q.parameters(), self.encoder_k.parameters()):
            param_k.data = param_k.data * self.m + param_q.data * (1. - self.m)

    @torch.no_grad()
    def _dequeue_and_enqueue(self, keys):
        batch_size = keys.shape[0]
        ptr = int(self.queue_ptr)
        assert self.K % batch_size == 0  # for simplicity
        self.queue[:, ptr:ptr + batch_size] = keys.T
        ptr = (ptr + batch_size) % self.K  # move pointer
        self.queue_ptr[0] = ptr

    def forward(self, im_q, im_k):
        q = self.encoder_q(im_q)  # queries: NxC
        q = nn.functional.normalize(q, dim=1)
        with torch.no_grad():  # no gradient to keys
            self._momentum_update_key_encoder()  # update the key encoder
            k = self.encoder_k(im_k)  # keys: NxC
            k = nn.functional.normalize(k, dim=1)
        # positive logits: Nx1, negative logits: NxK
        l_pos = torch.einsum('nc,nc->n', [q, k]).unsqueeze(-1)
        l_neg = torch.einsum('nc,ck->nk', [q, self.queue.clone().detach()])
        logits = torch.cat([l_pos, l_neg], dim=1)
        self._dequeue_and_enqueue(k)
        return logits


def mlp_encoder(num_classes):
    return nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, num_classes))


def info_nce(logits, T):
    # the positive key is column 0: -log(exp(l_pos / T) / sum_j exp(l_j / T))
    exp_logits = torch.exp(logits / T)
    return -torch.log(exp_logits[:, 0] / exp_logits.sum(dim=1)).mean()


torch.manual_seed(0)
model = MoCo(mlp_encoder, args.moco_dim, args.moco_k, args.moco_m, args.moco_t)
optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=0.9, weight_decay=1e-4)
model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level)

samples = torch.randn(256, 32)
for step in range(args.steps):
    x = samples[(step * 16) % 256:(step * 16) % 256 + 16]
    im_q, im_k = x + 0.3 * torch.randn_like(x), x + 0.3 * torch.randn_like(x)  # two views
    logits = model(im_q, im_k)
    loss = info_nce(logits, args.moco_t)
    optimizer.zero_grad()
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
    if step % 10 == 0 or step == args.steps - 1:
        acc = (logits.argmax(dim=1) == 0).float().mean().item()
        print(f"step {step} loss {loss.item():.4f} acc@1 {acc:.3f}")

print(f"final loss {loss.item():.4f}")
