"""OpenNMT-py's onmt/utils/optimizers.py (v1.0-v1.2, 2019-2020) fp16 paths, shrunk to a tiny
seq2seq-ish model with a separate `model.generator` on CPU:

- `-optim adam -model_dtype fp16`: `apex.amp.initialize([model, model.generator], optimizer,
  opt_level=opt.apex_opt_level, loss_scale=loss_scale, keep_batchnorm_fp32=None)` with
  loss_scale "dynamic" when `-loss_scale 0`, and `apex.amp.scale_loss` in Optimizer.backward;
- `-optim fusedadam -model_dtype fp16`: the old fused FP16_Optimizer around FusedAdam with
  `static_loss_scale=opt.loss_scale, dynamic_loss_scale=opt.loss_scale == 0`
  (`-fp16_impl optimizers`: v1.0's apex.optimizers.FusedAdam + apex.optimizers.FP16_Optimizer;
  `-fp16_impl contrib`: v1.1's copy of the old apex FusedAdam, here apex.contrib.optimizers',
  + apex.contrib.optimizers.FP16_Optimizer), driven by feature detection: `update_master_grads`
  passed to backward only if `fn_args(self._optimizer.backward)` names it,
  `hasattr(self._optimizer, "update_master_grads")`, `hasattr(..., "clip_master_grads")`;
- the Optimizer's state_dict (training_step, decay_step, optimizer) saved in the checkpoint and
  restored with `Optimizer.from_opt(model, opt, checkpoint)` (`-train_from`).

Unmodified apex code: `fp16kit run examples/apex_era/onmt_optimizers_fp16.py -model_dtype fp16`.
"""

import argparse
import inspect
import os
import tempfile

import torch
import torch.nn as nn
import torch.optim as optim
from torch.nn.utils import clip_grad_norm_


def fn_args(fun):
    """Returns the list of function arguments name."""
    return inspect.getfullargspec(fun).args


def noam_decay(step, warmup_steps, model_size):
    """Learning rate schedule described in
    https://arxiv.org/pdf/1706.03762.pdf.
    """
    return (
        model_size ** (-0.5) *
        min(step ** (-0.5), step * warmup_steps**(-1.5)))


def build_torch_optimizer(model, opt):
    params = [p for p in model.parameters() if p.requires_grad]
    betas = [opt.adam_beta1, opt.adam_beta2]
    if opt.optim == 'sgd':
        optimizer = optim.SGD(params, lr=opt.learning_rate)
    elif opt.optim == 'adam':
        optimizer = optim.Adam(
            params,
            lr=opt.learning_rate,
            betas=betas,
            eps=1e-9)
    elif opt.optim == 'fusedadam':
        import apex
        if opt.fp16_impl == 'contrib':
            # we use here a FusedAdam() copy of an old Apex repo
            optimizer = apex.contrib.optimizers.FusedAdam(
                params,
                lr=opt.learning_rate,
                betas=betas)
        else:
            optimizer = apex.optimizers.FusedAdam(
                params,
                lr=opt.learning_rate,
                betas=betas)
    else:
        raise ValueError('Invalid optimizer type: ' + opt.optim)

    if opt.model_dtype == 'fp16':
        import apex
        if opt.optim != 'fusedadam':
            # In this case use the new AMP API from apex
            loss_scale = "dynamic" if opt.loss_scale == 0 else opt.loss_scale
            model, optimizer = apex.amp.initialize(
                [model, model.generator],
                optimizer,
                opt_level=opt.apex_opt_level,
                loss_scale=loss_scale,
                keep_batchnorm_fp32=None)
        else:
            # In this case use the old FusedAdam with FP16_optimizer wrapper
            static_loss_scale = opt.loss_scale
            dynamic_loss_scale = opt.loss_scale == 0
            if opt.fp16_impl == 'contrib':
                optimizer = apex.contrib.optimizers.FP16_Optimizer(
                    optimizer,
                    static_loss_scale=static_loss_scale,
                    dynamic_loss_scale=dynamic_loss_scale)
            else:
                optimizer = apex.optimizers.FP16_Optimizer(
                    optimizer,
                    static_loss_scale=static_loss_scale,
                    dynamic_loss_scale=dynamic_loss_scale)
    return optimizer


def make_learning_rate_decay_fn(opt):
    """Returns the learning decay function from options."""
    if opt.decay_method == 'noam':
        return lambda step: noam_decay(step, opt.warmup_steps, opt.rnn_size)


class Optimizer(object):
    """
    Controller class for optimization. Mostly a thin
    wrapper for `optim`, but also useful for implementing
    rate scheduling beyond what is currently available.
    Also implements necessary methods for training RNNs such
    as grad manipulations.
    """

    def __init__(self,
                 optimizer,
                 learning_rate,
                 learning_rate_decay_fn=None,
                 max_grad_norm=None):
        self._optimizer = optimizer
        self._learning_rate = learning_rate
        self._learning_rate_decay_fn = learning_rate_decay_fn
        self._max_grad_norm = max_grad_norm or 0
        self._training_step = 1
        self._decay_step = 1
        self._fp16 = None

    @classmethod
    def from_opt(cls, model, opt, checkpoint=None):
        optim_opt = opt
        optim_state_dict = None

        if opt.train_from and checkpoint is not None:
            optim = checkpoint['optim']
            ckpt_opt = checkpoint['opt']
            ckpt_state_dict = {}
            if isinstance(optim, Optimizer):  # Backward compatibility.
                ckpt_state_dict['training_step'] = optim._step + 1
                ckpt_state_dict['decay_step'] = optim._step + 1
                ckpt_state_dict['optimizer'] = optim.optimizer.state_dict()
            else:
                ckpt_state_dict = optim

            if opt.reset_optim == 'none':
                # Load everything from the checkpoint.
                optim_opt = ckpt_opt
                optim_state_dict = ckpt_state_dict
            elif opt.reset_optim == 'all':
                # Build everything from scratch.
                pass
            elif opt.reset_optim == 'states':
                # Reset optimizer, keep options.
                optim_opt = ckpt_opt
                optim_state_dict = ckpt_state_dict
                del optim_state_dict['optimizer']
            elif opt.reset_optim == 'keep_states':
                # Reset options, keep optimizer.
                optim_state_dict = ckpt_state_dict

        optimizer = cls(
            build_torch_optimizer(model, optim_opt),
            optim_opt.learning_rate,
            learning_rate_decay_fn=make_learning_rate_decay_fn(optim_opt),
            max_grad_norm=optim_opt.max_grad_norm)
        if opt.model_dtype == "fp16":
            if opt.optim == "fusedadam":
                optimizer._fp16 = "legacy"
            else:
                optimizer._fp16 = "amp"
        if optim_state_dict:
            optimizer.load_state_dict(optim_state_dict)
        return optimizer

    @property
    def training_step(self):
        """The current training step."""
        return self._training_step

    def learning_rate(self):
        """Returns the current learning rate."""
        if self._learning_rate_decay_fn is None:
            return self._learning_rate
        scale = self._learning_rate_decay_fn(self._decay_step)
        return scale * self._learning_rate

    def state_dict(self):
        return {
            'training_step': self._training_step,
            'decay_step': self._decay_step,
            'optimizer': self._optimizer.state_dict()
        }

    def load_state_dict(self, state_dict):
        self._training_step = state_dict['training_step']
        # State can be partially restored.
        if 'decay_step' in state_dict:
            self._decay_step = state_dict['decay_step']
        if 'optimizer' in state_dict:
            self._optimizer.load_state_dict(state_dict['optimizer'])

    def zero_grad(self):
        """Zero the gradients of optimized parameters."""
        self._optimizer.zero_grad()

    def backward(self, loss):
        """Wrapper for backward pass. Some optimizer requires ownership of the
        backward pass."""
        if self._fp16 == "amp":
            import apex
            with apex.amp.scale_loss(loss, self._optimizer) as scaled_loss:
                scaled_loss.backward()
        elif self._fp16 == "legacy":
            kwargs = {}
            if "update_master_grads" in fn_args(self._optimizer.backward):
                kwargs["update_master_grads"] = True
            self._optimizer.backward(loss, **kwargs)
        else:
            loss.backward()

    def step(self):
        """Update the model parameters based on current gradients.

        Optionally, will employ gradient modification or update learning
        rate.
        """
        learning_rate = self.learning_rate()
        if self._fp16 == "legacy":
            if hasattr(self._optimizer, "update_master_grads"):
                self._optimizer.update_master_grads()
            if hasattr(self._optimizer, "clip_master_grads") and \
               self._max_grad_norm > 0:
                self._optimizer.clip_master_grads(self._max_grad_norm)

        for group in self._optimizer.param_groups:
            group['lr'] = learning_rate
            if self._fp16 is None and self._max_grad_norm > 0:
                clip_grad_norm_(group['params'], self._max_grad_norm)
        self._optimizer.step()
        self._decay_step += 1
        self._training_step += 1


class NMTModel(nn.Module):
    def __init__(self, vocab=40, rnn_size=32):
        super().__init__()
        self.embeddings = nn.Embedding(vocab, rnn_size)
        self.encoder = nn.Linear(rnn_size, rnn_size)
        self.decoder = nn.Linear(rnn_size, rnn_size)

    def forward(self, src):
        return torch.tanh(self.decoder(torch.relu(self.encoder(self.embeddings(src)))))


def build_model(opt, checkpoint=None):
    model = NMTModel(rnn_size=opt.rnn_size)
    generator = nn.Sequential(nn.Linear(opt.rnn_size, 40), nn.LogSoftmax(dim=-1))
    if checkpoint is not None:
        model.load_state_dict(checkpoint['model'], strict=False)
        generator.load_state_dict(checkpoint['generator'], strict=False)
    model.generator = generator
    if opt.model_dtype == 'fp16' and opt.optim == 'fusedadam':
        model.half()
    return model


def train(opt, checkpoint=None):
    torch.manual_seed(opt.seed)
    model = build_model(opt, checkpoint)
    optim = Optimizer.from_opt(model, opt, checkpoint=checkpoint)
    g = torch.Generator().manual_seed(opt.seed + optim.training_step)
    criterion = nn.NLLLoss(reduction='sum')
    while optim.training_step <= opt.train_steps:
        src = torch.randint(0, 40, (8, 5), generator=g)
        tgt = (src + 1) % 40
        optim.zero_grad()
        output = model(src)
        scores = model.generator(output.view(-1, output.size(2)))
        loss = criterion(scores.float(), tgt.view(-1))
        optim.backward(loss.div(float(src.numel())))
        optim.step()
        if optim.training_step % 5 == 0:
            print("Step %d; lr: %7.5f; xent: %4.4f" % (optim.training_step - 1, optim.learning_rate(),
                                                      loss.item() / src.numel()))
        last = loss.item() / src.numel()

    # onmt/models/model_saver.py
    model_state_dict = model.state_dict()
    model_state_dict = {k: v for k, v in model_state_dict.items() if 'generator' not in k}
    generator_state_dict = model.generator.state_dict()
    chkpt = {
        'model': model_state_dict,
        'generator': generator_state_dict,
        'vocab': None,
        'opt': opt,
        'optim': optim.state_dict(),
    }
    checkpoint_path = '%s_step_%d.pt' % (opt.save_model, optim.training_step - 1)
    print("Saving checkpoint %s" % checkpoint_path)
    torch.save(chkpt, checkpoint_path)
    return checkpoint_path, last


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('-optim', default='adam', choices=['sgd', 'adam', 'fusedadam'])
    parser.add_argument('-adam_beta1', type=float, default=0.9)
    parser.add_argument('-adam_beta2', type=float, default=0.998)
    parser.add_argument('-learning_rate', type=float, default=2.0)
    parser.add_argument('-decay_method', type=str, default='noam')
    parser.add_argument('-warmup_steps', type=int, default=8)
    parser.add_argument('-rnn_size', type=int, default=32)
    parser.add_argument('-max_grad_norm', type=float, default=5)
    parser.add_argument('-model_dtype', default='fp32', choices=['fp32', 'fp16'])
    parser.add_argument('-loss_scale', type=float, default=0)
    parser.add_argument('-apex_opt_level', type=str, default='O1', choices=['O0', 'O1', 'O2', 'O3'])
    parser.add_argument('-fp16_impl', default='contrib', choices=['optimizers', 'contrib'])
    parser.add_argument('-train_steps', type=int, default=20)
    parser.add_argument('-train_from', default='', type=str)
    parser.add_argument('-reset_optim', default='none', choices=['none', 'all', 'states', 'keep_states'])
    parser.add_argument('-save_model', default=None)
    parser.add_argument('-seed', type=int, default=3435)
    opt = parser.parse_args()
    if opt.save_model is None:  # (a scratch directory: the checkpoints go to ./model_step_N.pt)
        os.chdir(tempfile.mkdtemp())
        opt.save_model = 'model'

    path, _ = train(opt)
    # -train_from the checkpoint, 10 more steps
    checkpoint = torch.load(path, map_location=lambda storage, loc: storage, weights_only=False)
    opt.train_from = path
    opt.train_steps += 10
    checkpoint['opt'].train_steps = opt.train_steps
    _, last = train(opt, checkpoint)
    print("final loss %.4f" % last)


if __name__ == '__main__':
    main()
