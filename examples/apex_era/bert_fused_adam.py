"""A 2019 BERT fine-tuning script in the style of HF pytorch-pretrained-BERT's examples:
FusedLayerNorm as BertLayerNorm (with the usual fallback), the fused-era
`apex.optimizers.FP16_Optimizer` around the legacy `FusedAdam(bias_correction=False,
max_grad_norm=1.0)` with two param groups, and the learning rate written into
`param_groups` by hand (warmup_linear).

Unmodified apex code: `fp16kit run examples/apex_era/bert_fused_adam.py --fp16`.
"""

import argparse
import math

import torch
from torch import nn

try:
    from apex.normalization.fused_layer_norm import FusedLayerNorm as BertLayerNorm
except ImportError:
    print("Better speed can be achieved with apex installed from https://www.github.com/nvidia/apex.")

    class BertLayerNorm(nn.Module):
        def __init__(self, hidden_size, eps=1e-12):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(hidden_size))
            self.bias = nn.Parameter(torch.zeros(hidden_size))
            self.variance_epsilon = eps

        def forward(self, x):
            u = x.mean(-1, keepdim=True)
            s = (x - u).pow(2).mean(-1, keepdim=True)
            x = (x - u) / torch.sqrt(s + self.variance_epsilon)
            return self.weight * x + self.bias


def warmup_linear(x, warmup=0.002):
    if x < warmup:
        return x / warmup
    return 1.0 - x


class TinyBert(nn.Module):
    def __init__(self, vocab=64, hidden=32, labels=2):
        super().__init__()
        self.embeddings = nn.Embedding(vocab, hidden)
        self.dense = nn.Linear(hidden, hidden)
        self.LayerNorm = BertLayerNorm(hidden, eps=1e-12)
        self.classifier = nn.Linear(hidden, labels)

    def forward(self, input_ids, labels):
        h = self.LayerNorm(torch.tanh(self.dense(self.embeddings(input_ids))))
        logits = self.classifier(h.mean(1))
        return nn.functional.cross_entropy(logits.float(), labels)


parser = argparse.ArgumentParser()
parser.add_argument("--fp16", action="store_true")
parser.add_argument("--loss_scale", type=float, default=0)
parser.add_argument("--learning_rate", type=float, default=5e-3)
parser.add_argument("--num_train_steps", type=int, default=30)
parser.add_argument("--warmup_proportion", type=float, default=0.1)
args = parser.parse_args()

torch.manual_seed(42)
input_ids = torch.randint(0, 64, (256, 12))
labels = (input_ids[:, 0] < 32).long()  # learnable: the first token decides

model = TinyBert()
if args.fp16:
    model.half()
param_optimizer = list(model.named_parameters())
no_decay = ["bias", "LayerNorm.bias", "LayerNorm.weight"]
optimizer_grouped_parameters = [
    {"params": [p for n, p in param_optimizer if not any(nd in n for nd in no_decay)], "weight_decay": 0.01},
    {"params": [p for n, p in param_optimizer if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
]
t_total = args.num_train_steps
if args.fp16:
    try:
        from apex.optimizers import FP16_Optimizer
        from apex.optimizers import FusedAdam
    except ImportError:
        raise ImportError("Please install apex from https://www.github.com/nvidia/apex to use distributed and fp16 training.")

    optimizer = FusedAdam(optimizer_grouped_parameters, lr=args.learning_rate, bias_correction=False, max_grad_norm=1.0)
    if args.loss_scale == 0:
        optimizer = FP16_Optimizer(optimizer, dynamic_loss_scale=True)
    else:
        optimizer = FP16_Optimizer(optimizer, static_loss_scale=args.loss_scale)
else:
    optimizer = torch.optim.AdamW(optimizer_grouped_parameters, lr=args.learning_rate)

global_step = 0
for step in range(t_total):
    idx = torch.arange(step * 16, step * 16 + 16) % 256
    loss = model(input_ids[idx], labels[idx])
    if args.fp16:
        optimizer.backward(loss)
    else:
        loss.backward()
    lr_this_step = args.learning_rate * warmup_linear(global_step / t_total, args.warmup_proportion)
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr_this_step
    optimizer.step()
    optimizer.zero_grad()
    global_step += 1
    if step % 10 == 0:
        scale = getattr(optimizer, "cur_scale", 1)
        print(f"step {step} loss {loss.item():.4f} lr {lr_this_step:.2e} scale {scale}")
assert math.isfinite(loss.item())
print(f"final loss {loss.item():.4f}")
