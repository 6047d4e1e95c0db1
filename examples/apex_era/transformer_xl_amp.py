"""NVIDIA DeepLearningExamples' Transformer-XL train.py (2019-2020), shrunk to a tiny causal LM on
CPU, with the availability guards apex-era code wrote instead of importing apex unconditionally:
`from apex import amp` inside `try/except ModuleNotFoundError: warnings.warn(...)`, parse_args()
refusing `--fp16 --amp apex` with "APEX AMP unavailable" when `'apex' not in sys.modules`,
`amp.register_half_function(torch, 'einsum')` behind `if 'apex' in sys.modules:` (the attention is
einsums), and, from other codebases, transformers' old `is_apex_available()`
(`importlib.util.find_spec("apex") is not None`), Lightning's `APEX_AVAILABLE` try-import flag, a
`find_spec("apex.amp")` probe, and a config-driven `use_amp = 'apex' in sys.modules and ...`.
Training is the script's: gradient accumulation over --batch_chunk chunks with
`amp.scale_loss(..., delay_unscale=...)` on all but the last, `clip_grad_norm_(amp.master_params(
optimizer), args.clip)`, and amp.state_dict() in the checkpoint.

Unmodified apex code: `fp16kit run examples/apex_era/transformer_xl_amp.py --fp16`.
Without apex (plain python, not migrated) `--fp16` stops at once: "APEX AMP unavailable".
"""

import argparse
import importlib.util
import math
import sys
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

try:
    from apex import amp
except ModuleNotFoundError:
    warnings.warn('APEX AMP is unavailable')

try:
    from apex import amp  # noqa: F811 -- the Lightning hooks' flag, as its own module wrote it

    APEX_AVAILABLE = True
except ImportError:
    APEX_AVAILABLE = False


def is_apex_available():
    return importlib.util.find_spec("apex") is not None


# the probe of a test suite's skip marks (find_spec of a submodule raises when its package is missing)
amp_found = importlib.util.find_spec("apex") is not None and importlib.util.find_spec("apex.amp") is not None


def parse_args():
    parser = argparse.ArgumentParser(description='PyTorch Transformer-XL Language Model')
    parser.add_argument('--fp16', action='store_true', help='Run training in fp16/mixed precision')
    parser.add_argument('--apex_amp_opt_level', type=str, default='O1', choices=['O0', 'O1', 'O2', 'O3'],
                        help='Optimization level for apex amp')
    parser.add_argument('--amp', choices=['apex', 'pytorch'], default='apex',
                        help='Implementation of automatic mixed precision')
    parser.add_argument('--max_step', type=int, default=40, help='Max number of training steps')
    parser.add_argument('--batch_size', type=int, default=16, help='Global batch size')
    parser.add_argument('--batch_chunk', type=int, default=2,
                        help='Split batch into chunks and train with gradient accumulation')
    parser.add_argument('--tgt_len', type=int, default=24, help='Number of tokens to predict')
    parser.add_argument('--lr', type=float, default=3e-3, help='Initial learning rate')
    parser.add_argument('--clip', type=float, default=0.25, help='Gradient clipping')
    parser.add_argument('--log_interval', type=int, default=10, help='Report interval')
    parser.add_argument('--seed', type=int, default=1111, help='Random seed')
    args = parser.parse_args()

    if args.batch_size % args.batch_chunk != 0:
        raise RuntimeError('Batch size needs to be divisible by batch chunk')

    if args.fp16 and args.amp == 'apex' and 'apex' not in sys.modules:
        raise RuntimeError(
            'APEX AMP unavailable, install APEX or switch to pytorch AMP'
        )

    return args


class MultiHeadAttn(nn.Module):
    def __init__(self, n_head, d_model, d_head):
        super().__init__()
        self.n_head, self.d_head = n_head, d_head
        self.qkv_net = nn.Linear(d_model, 3 * n_head * d_head, bias=False)
        self.o_net = nn.Linear(n_head * d_head, d_model, bias=False)
        self.layer_norm = nn.LayerNorm(d_model)
        self.scale = 1 / (d_head ** 0.5)

    def forward(self, h):
        qlen, bsz = h.size(0), h.size(1)
        head_q, head_k, head_v = torch.chunk(self.qkv_net(h), 3, dim=-1)
        head_q = head_q.view(qlen, bsz, self.n_head, self.d_head)
        head_k = head_k.view(qlen, bsz, self.n_head, self.d_head)
        head_v = head_v.view(qlen, bsz, self.n_head, self.d_head)
        attn_score = torch.einsum('ibnd,jbnd->ijbn', (head_q, head_k)) * self.scale
        mask = torch.triu(torch.ones(qlen, qlen, dtype=torch.bool), diagonal=1)[:, :, None, None]
        attn_score = attn_score.float().masked_fill(mask, -float('inf')).type_as(attn_score)
        attn_prob = F.softmax(attn_score, dim=1)
        attn_vec = torch.einsum('ijbn,jbnd->ibnd', (attn_prob, head_v))
        attn_out = self.o_net(attn_vec.contiguous().view(qlen, bsz, self.n_head * self.d_head))
        return self.layer_norm(h + attn_out)


class TransformerLM(nn.Module):
    def __init__(self, n_token=50, n_layer=2, n_head=2, d_model=32, d_head=16, d_inner=64):
        super().__init__()
        self.word_emb = nn.Embedding(n_token, d_model)
        self.layers = nn.ModuleList()
        for _ in range(n_layer):
            self.layers.append(nn.ModuleDict({
                'attn': MultiHeadAttn(n_head, d_model, d_head),
                'ff': nn.Sequential(nn.Linear(d_model, d_inner), nn.ReLU(), nn.Linear(d_inner, d_model)),
                'ln': nn.LayerNorm(d_model),
            }))
        self.out_layer = nn.Linear(d_model, n_token)
        self.out_layer.weight = self.word_emb.weight  # tied
        nn.init.normal_(self.word_emb.weight, 0.0, 0.02)  # args.init_std

    def forward(self, data, target):
        core_out = self.word_emb(data)
        for layer in self.layers:
            core_out = layer['attn'](core_out)
            core_out = layer['ln'](core_out + layer['ff'](core_out))
        logit = self.out_layer(core_out)
        return F.cross_entropy(logit.float().view(-1, logit.size(-1)), target.reshape(-1))


def train_iteration(model, data_i, target_i, optimizer, delay_unscale, args):
    enable_autocast = args.fp16 and args.amp == 'pytorch'
    with torch.autocast('cpu', dtype=torch.bfloat16, enabled=enable_autocast):
        loss = model(data_i, target_i)
        loss = loss.float().mean().type_as(loss) / args.batch_chunk

    if args.fp16 and args.amp == 'apex':
        with amp.scale_loss(loss, optimizer, delay_unscale=delay_unscale) as scaled_loss:
            scaled_loss.backward()
    else:
        loss.backward()
    return loss.float().item()


def main():
    args = parse_args()
    torch.manual_seed(args.seed)

    print(f'apex available: {is_apex_available()}, APEX_AVAILABLE: {APEX_AVAILABLE}, '
          f'apex.amp: {amp_found}')

    # a repeating synthetic corpus: token t+1 follows from token t
    stream = torch.randint(0, 50, (args.batch_size, 1))
    for _ in range(args.tgt_len * 8):
        stream = torch.cat([stream, (stream[:, -1:] * 7 + 3) % 50], dim=1)
    corpus = stream.t().contiguous()  # [len, batch], as Transformer-XL's LMOrderedIterator

    model = TransformerLM()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    # the config-driven switch of other apex-era trainers: amp only when apex imported
    use_amp = ('apex' in sys.modules) and args.fp16 and args.amp == 'apex'
    if use_amp:
        model, optimizer = amp.initialize(model, optimizer, opt_level=args.apex_amp_opt_level, verbosity=0)
    print(f'amp: {"apex " + args.apex_amp_opt_level if use_amp else "off"}')

    train_step, train_loss, log_step = 0, 0.0, 0
    while train_step < args.max_step:
        i = (train_step * args.tgt_len) % (corpus.size(0) - args.tgt_len - 1)
        data, target = corpus[i:i + args.tgt_len], corpus[i + 1:i + 1 + args.tgt_len]
        optimizer.zero_grad()
        data_chunks = torch.chunk(data, args.batch_chunk, 1)
        target_chunks = torch.chunk(target, args.batch_chunk, 1)
        for c in range(args.batch_chunk):
            train_loss += train_iteration(model, data_chunks[c], target_chunks[c], optimizer,
                                          c < args.batch_chunk - 1, args)
        if use_amp:
            torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), args.clip)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        train_step += 1
        log_step += 1
        if train_step % args.log_interval == 0:
            cur_loss = train_loss / log_step
            print(f'| step {train_step:>4d} | loss {cur_loss:5.2f} | ppl {math.exp(cur_loss):9.3f}')
            train_loss, log_step = 0.0, 0

    amp_state = amp.state_dict() if use_amp else None
    print('amp state:', sorted(amp_state) if amp_state is not None else None)
    print(f'final loss {cur_loss:.4f}')


if __name__ == "__main__":
    # Before we do anything with models, we want to ensure that we get fp16
    # execution of torch.einsum in APEX AMP.
    # Otherwise it'll default to "promote" mode, and we'll get fp32 operations.
    # Note that running `--apex_amp_opt_level O2` will remove the need for this
    # code, but it is still valid.
    if 'apex' in sys.modules:
        amp.register_half_function(torch, 'einsum')

    main()
