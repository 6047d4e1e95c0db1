"""NVIDIA DeepLearningExamples' GNMT v2 (PyTorch, 2019), shrunk to a tiny seq2seq on CPU: its
`setup_logging` (a `RankFilter` that adds `record.rank` on the ROOT LOGGER, a DEBUG log file
formatted `%(asctime)s - %(levelname)s - %(rank)s - %(message)s`, a console handler on stdout
formatted `%(rank)s: %(message)s`), `amp.initialize(model, optimizer, cast_model_outputs=torch.float16,
keep_batchnorm_fp32=False, opt_level='O2')` with apex's banner, and its `AMPOptimizer`, which sets
`amp._amp_state.loss_scalers[0]._loss_scale = loss_scale` (`--init-scale`, high enough here for the
first backward passes to overflow) and steps under `amp.scale_loss`.

A filter on a logger applies only to records logged on that logger: records that come up from
other loggers reach the root's handlers without `rank`. apex print()ed its banner and its
"Gradient overflow" lines, so this setup worked with apex; they must not turn into
"--- Logging error ---" tracebacks now.

Unmodified apex code: `fp16kit run examples/apex_era/gnmt_rank_logging.py`.
"""

import argparse
import logging
import os
import sys

import torch
import torch.nn as nn
from torch.nn.utils import clip_grad_norm_

from apex import amp


def get_rank():
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


def setup_logging(log_all_ranks=True, log_file=os.devnull):
    """
    Configures logging.
    By default logs from all workers are printed to the console, entries are
    prefixed with "N: " where N is the rank of the worker. Logs printed to the
    console don't include timestaps.
    Full logs with timestamps are saved to the log_file file.
    """
    class RankFilter(logging.Filter):
        def __init__(self, rank, log_all_ranks):
            self.rank = rank
            self.log_all_ranks = log_all_ranks

        def filter(self, record):
            record.rank = self.rank
            if self.log_all_ranks:
                return True
            else:
                return (self.rank == 0)

    rank = get_rank()
    rank_filter = RankFilter(rank, log_all_ranks)

    logging_format = "%(asctime)s - %(levelname)s - %(rank)s - %(message)s"
    logging.basicConfig(level=logging.DEBUG,
                        format=logging_format,
                        datefmt="%Y-%m-%d %H:%M:%S",
                        filename=log_file,
                        filemode='w')
    console = logging.StreamHandler(sys.stdout)
    console.setLevel(logging.INFO)
    formatter = logging.Formatter('%(rank)s: %(message)s')
    console.setFormatter(formatter)
    logging.getLogger('').addHandler(console)
    logging.getLogger('').addFilter(rank_filter)


class AMPOptimizer:
    """
    Implements mixed precision training with Apex AMP.
    """
    def __init__(self, model, grad_clip=None, loss_scale=8192,
                 dls_upscale_interval=128):
        self.model = model
        self.grad_clip = grad_clip
        loss_scaler = amp._amp_state.loss_scalers[0]
        loss_scaler._loss_scale = loss_scale
        loss_scaler._scale_seq_len = dls_upscale_interval

    def step(self, loss, optimizer, scheduler, update=True):
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()

        if update:
            if self.grad_clip != float('inf'):
                clip_grad_norm_(amp.master_params(optimizer), self.grad_clip)
            scheduler.step()
            optimizer.step()
            self.model.zero_grad()


class Seq2Seq(nn.Module):
    def __init__(self, vocab=32, hidden=32):
        super().__init__()
        self.embedder = nn.Embedding(vocab, hidden)
        self.encoder = nn.LSTM(hidden, hidden, batch_first=True)
        self.decoder = nn.LSTM(hidden, hidden, batch_first=True)
        self.classifier = nn.Linear(hidden, vocab)

    def forward(self, src, tgt):
        _, state = self.encoder(self.embedder(src))
        out, _ = self.decoder(self.embedder(tgt), state)
        return self.classifier(out)


parser = argparse.ArgumentParser(description="GNMT (tiny)")
parser.add_argument("--train-iters", type=int, default=40)
parser.add_argument("--lr", type=float, default=2e-2)
parser.add_argument("--init-scale", type=float, default=2.0**20)
parser.add_argument("--upscale-interval", type=int, default=128)
parser.add_argument("--grad-clip", type=float, default=5.0)
parser.add_argument("--log-all-ranks", action="store_true")
args = parser.parse_args()

setup_logging(args.log_all_ranks)
logging.info(f"Run arguments: {args}")

torch.manual_seed(1)
vocab, seq = 32, 10
model = Seq2Seq(vocab)
criterion = nn.CrossEntropyLoss(reduction="sum")
optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda it: min(1.0, (it + 1) / 8))
model, optimizer = amp.initialize(model, optimizer, cast_model_outputs=torch.float16,
                                  keep_batchnorm_fp32=False, opt_level='O2')
fp_optimizer = AMPOptimizer(model, args.grad_clip, loss_scale=args.init_scale,
                            dls_upscale_interval=args.upscale_interval)
logging.info(f"Using optimizer: {optimizer.__class__.__name__}")

source = torch.randint(1, vocab, (64, seq))
target = (source.flip(1) * 3 + 1) % vocab  # translate: reverse and map every token
for i in range(args.train_iters):
    rows = slice((i * 16) % 64, (i * 16) % 64 + 16)
    src, tgt = source[rows], target[rows]
    output = model(src, tgt[:, :-1])
    loss_per_batch = criterion(output.float().reshape(-1, vocab), tgt[:, 1:].reshape(-1))
    loss_per_token = loss_per_batch.item() / tgt[:, 1:].numel()
    fp_optimizer.step(loss_per_batch / src.size(0), optimizer, scheduler)
    if i % 8 == 0 or i == args.train_iters - 1:
        logging.info(f"TRAIN [0][{i}/{args.train_iters}]\tLoss/tok {loss_per_token:.4f}\t"
                     f"Scale {amp._amp_state.loss_scalers[0].loss_scale():g}")

logging.info("Finished training")
print(f"final loss {loss_per_token:.4f}")
