"""An apex-era (2018) language-model script: apex.fp16_utils' FP16_Module and FP16_Optimizer.

Kept as it was written for apex (only shortened): it imports apex. Run it unmodified with

    fp16kit run examples/apex_era/word_lm_fp16_utils.py --steps 30

or rewrite its imports once with `fp16kit migrate` and run it with python.
"""

import argparse
import os
import tempfile

import torch
import torch.nn as nn

import apex.fp16_utils as fp16_utils
from apex.fp16_utils import FP16_Module, FP16_Optimizer, fp32_to_fp16

parser = argparse.ArgumentParser(description="word LM (fp16)")
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--lr", type=float, default=2e-3)
parser.add_argument("--static-loss-scale", type=float, default=None)
parser.add_argument("--clip", type=float, default=0.25)
args = parser.parse_args()


class RNNModel(nn.Module):
    def __init__(self, ntoken=50, ninp=32, nhid=64):
        super().__init__()
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.GRU(ninp, nhid)
        self.decoder = nn.Linear(nhid, ntoken)

    def forward(self, tokens, hidden):
        out, hidden = self.rnn(self.encoder(tokens), hidden)
        return self.decoder(out), hidden


torch.manual_seed(1111)
corpus = torch.randint(0, 50, (2000,))
corpus[1::2] = (corpus[0::2] * 7 + 3) % 50  # every second token follows from the one before

model = FP16_Module(RNNModel())  # the model runs in fp16; its outputs come back as fp32
criterion = nn.CrossEntropyLoss()
if args.static_loss_scale:
    optimizer = FP16_Optimizer(torch.optim.Adam(model.parameters(), lr=args.lr), static_loss_scale=args.static_loss_scale)
else:
    optimizer = FP16_Optimizer(
        torch.optim.Adam(model.parameters(), lr=args.lr),
        dynamic_loss_scale=True,
        dynamic_loss_args={"scale_window": 100},
    )

bptt, batch = 20, 8
data = corpus[: (len(corpus) // batch) * batch].view(batch, -1).t().contiguous()
for step in range(args.steps):
    i = (step * bptt) % (data.size(0) - bptt - 1)
    x, y = data[i : i + bptt], data[i + 1 : i + 1 + bptt]
    hidden = fp32_to_fp16(torch.zeros(1, batch, 64))  # the 2018 helpers cast nested inputs
    optimizer.zero_grad()
    output, hidden = model(x, hidden)
    loss = criterion(output.view(-1, 50), y.reshape(-1))
    optimizer.backward(loss)
    optimizer.clip_master_grads(args.clip)
    optimizer.step()
    if step % 10 == 0 or step == args.steps - 1:
        print(f"step {step} loss {loss.item():.4f} scale {optimizer.loss_scale:g}")

path = os.path.join(tempfile.mkdtemp(), "lm.pt")
torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
ckpt = torch.load(path)
model.load_state_dict(ckpt["model"])
optimizer.load_state_dict(ckpt["optimizer"])
print("resumed at scale", optimizer.loss_scale, "- fp16_utils from", fp16_utils.__name__.split(".")[0])
print(f"final loss {loss.item():.4f}")
