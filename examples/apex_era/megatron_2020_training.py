"""Megatron-LM's megatron/training.py (v1.1, 2020), shrunk to a tiny GPT-ish MLP on CPU:
`from megatron.fp16 import FP16_Module` / `FP16_Optimizer`, `from apex.optimizers import
FusedAdam as Adam`, FusedLayerNorm as LayerNorm, get_model / get_optimizer (the model_parallel
attribute defaults, Adam with adam_beta1/beta2/eps, FP16_Optimizer with dynamic_loss_args
scale_window / min_scale / delayed_shift) / AnnealingLR; train_step -> backward_step
(`optimizer.zero_grad(set_grads_to_None=True)`, `backward(loss, update_master_grads=False)`,
`update_master_grads()`, `clip_master_grads`), the lr scheduler skipped on `optimizer.overflow`;
save_checkpoint / load_checkpoint (args, checkpoint_version, iteration,
state_dict_for_save_checkpoint, optimizer, lr_scheduler, rng states, the tracker file), then a
second run that resumes from it (`--load`).

Unmodified Megatron code: `fp16kit run --megatron examples/apex_era/megatron_2020_training.py --fp16`.
"""

import argparse
import math
import os
import random
import sys
import tempfile

import torch
from torch.nn.parallel.distributed import DistributedDataParallel as torchDDP

from apex.optimizers import FusedAdam as Adam
from apex.normalization.fused_layer_norm import FusedLayerNorm as LayerNorm

from megatron.fp16 import FP16_Module
from megatron.fp16 import FP16_Optimizer

_GLOBAL_ARGS = None


def get_args():
    return _GLOBAL_ARGS


def print_rank_0(message):
    if torch.distributed.is_initialized():
        if torch.distributed.get_rank() == 0:
            print(message, flush=True)
    else:
        print(message, flush=True)


def parse_args():
    parser = argparse.ArgumentParser(description='Megatron-LM Arguments', allow_abbrev=False)
    group = parser.add_argument_group(title='training')
    group.add_argument('--batch-size', type=int, default=8)
    group.add_argument('--train-iters', type=int, default=20)
    group.add_argument('--log-interval', type=int, default=5)
    group.add_argument('--clip-grad', type=float, default=1.0)
    group.add_argument('--weight-decay', type=float, default=0.01)
    group.add_argument('--adam-beta1', type=float, default=0.9)
    group.add_argument('--adam-beta2', type=float, default=0.999)
    group.add_argument('--adam-eps', type=float, default=1e-08)
    group.add_argument('--lr', type=float, default=1e-3)
    group.add_argument('--min-lr', type=float, default=0.0)
    group.add_argument('--lr-decay-style', type=str, default='linear', choices=['constant', 'linear', 'cosine'])
    group.add_argument('--lr-decay-iters', type=int, default=None)
    group.add_argument('--warmup', type=float, default=0.1)
    group.add_argument('--override-lr-scheduler', action='store_true')
    group.add_argument('--use-checkpoint-lr-scheduler', action='store_true')
    group.add_argument('--fp16', action='store_true')
    group.add_argument('--loss-scale', type=float, default=None)
    group.add_argument('--loss-scale-window', type=float, default=1000)
    group.add_argument('--min-scale', type=float, default=1)
    group.add_argument('--hysteresis', type=int, default=2)
    group.add_argument('--save', type=str, default=None)
    group.add_argument('--load', type=str, default=None)
    group.add_argument('--no-save-optim', action='store_true')
    group.add_argument('--no-save-rng', action='store_true')
    group.add_argument('--seed', type=int, default=1234)
    group.add_argument('--hidden-size', type=int, default=32)
    args = parser.parse_args()
    args.dynamic_loss_scale = False
    if args.loss_scale is None:
        args.dynamic_loss_scale = True
    args.rank = 0
    args.world_size = 1
    return args


class AnnealingLR(object):
    """Anneals the learning rate"""

    def __init__(self, optimizer, start_lr, warmup_iter, total_iters,
                 decay_style, last_iter, min_lr=0.0,
                 use_checkpoint_lr_scheduler=True,
                 override_lr_scheduler=False):

        # Class values.
        self.optimizer = optimizer
        self.start_lr = start_lr
        self.min_lr = min_lr
        self.warmup_iter = warmup_iter
        self.num_iters = last_iter
        self.end_iter = total_iters
        assert self.end_iter > 0
        self.decay_style = decay_style
        self.override_lr_scheduler = override_lr_scheduler
        self.use_checkpoint_lr_scheduler = use_checkpoint_lr_scheduler
        if self.override_lr_scheduler:
            assert not self.use_checkpoint_lr_scheduler, 'both override and '\
                'use-checkpoint are set.'
        # Set the learning rate
        self.step(self.num_iters)

        print_rank_0('> learning rate decay style: {}'.format(self.decay_style))

    def get_lr(self):
        """Learning rate decay functions from:
              https://openreview.net/pdf?id=BJYwwY9ll pg. 4"""

        num_iters_ = min(self.num_iters, self.end_iter - self.warmup_iter)
        # Warmup.
        if self.warmup_iter > 0 and self.num_iters <= self.warmup_iter:
            return float(self.start_lr) * num_iters_ / self.warmup_iter

        num_iters_ = num_iters_ - self.warmup_iter
        if self.decay_style == 'linear':
            lr = self.start_lr * (self.end_iter - num_iters_) / self.end_iter
        elif self.decay_style == 'cosine':
            lr = self.start_lr / 2.0 * (math.cos(
                math.pi * num_iters_ / self.end_iter) + 1)
        else:
            lr = self.start_lr
        return max(lr, self.min_lr)

    def step(self, step_num=None):
        """Set lr for all parameters groups."""
        if step_num is None:
            step_num = self.num_iters + 1
        self.num_iters = step_num
        new_lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group['lr'] = new_lr

    def state_dict(self):
        state_dict = {
            'start_lr': self.start_lr,
            'warmup_iter': self.warmup_iter,
            'num_iters': self.num_iters,
            'decay_style': self.decay_style,
            'end_iter': self.end_iter,
            'min_lr': self.min_lr
        }
        return state_dict

    def _check_and_set(self, cls_value, sd_value, name):
        """Auxiliary function for checking the values in the checkpoint and
        setting them."""
        if self.override_lr_scheduler:
            print_rank_0(' > overriding {} value to {}'.format(name, cls_value))
            return cls_value

        if not self.use_checkpoint_lr_scheduler:
            assert cls_value == sd_value, 'AnnealingLR: class input value' \
                'and checkpoint values for {} do not match'.format(name)
        print_rank_0(' > using checkpoint value {} for {}'.format(sd_value,
                                                                  name))
        return sd_value

    def load_state_dict(self, sd):

        self.start_lr = self._check_and_set(self.start_lr, sd['start_lr'],
                                            'learning rate')
        self.min_lr = self._check_and_set(self.min_lr, sd['min_lr'],
                                          'minimum learning rate')
        self.warmup_iter = self._check_and_set(self.warmup_iter,
                                               sd['warmup_iter'],
                                               'warmup iterations')
        self.end_iter = self._check_and_set(self.end_iter, sd['end_iter'],
                                            'total number of iterations')
        self.decay_style = self._check_and_set(self.decay_style,
                                               sd['decay_style'],
                                               'decay style')

        self.num_iters = sd['num_iters']
        self.step(self.num_iters)


class GPT2Model(torch.nn.Module):
    def __init__(self, hidden_size):
        super().__init__()
        self.dense_h_to_4h = torch.nn.Linear(hidden_size, 4 * hidden_size)
        self.dense_4h_to_h = torch.nn.Linear(4 * hidden_size, hidden_size)
        self.final_layernorm = LayerNorm(hidden_size)
        self.dense_h_to_4h.weight.model_parallel = True
        self.dense_h_to_4h.bias.model_parallel = True

    def state_dict_for_save_checkpoint(self, destination=None, prefix='',
                                       keep_vars=False):
        return self.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def forward(self, x):
        h = self.dense_4h_to_h(torch.nn.functional.gelu(self.dense_h_to_4h(x)))
        return self.final_layernorm(h + x)


def get_params_for_weight_decay_optimization(module):
    """Divide params into with-weight-decay and without-weight-decay groups.
    Layernorms and baises will have no weight decay but the rest will.
    """
    weight_decay_params = {'params': []}
    no_weight_decay_params = {'params': [], 'weight_decay': 0.0}
    for module_ in module.modules():
        if isinstance(module_, LayerNorm):
            no_weight_decay_params['params'].extend(
                [p for p in list(module_._parameters.values())
                 if p is not None])
        else:
            weight_decay_params['params'].extend(
                [p for n, p in list(module_._parameters.items())
                 if p is not None and n != 'bias'])
            no_weight_decay_params['params'].extend(
                [p for n, p in list(module_._parameters.items())
                 if p is not None and n == 'bias'])

    return weight_decay_params, no_weight_decay_params


def get_model(model_provider_func):
    """Build the model."""
    args = get_args()

    # Build model on cpu.
    model = model_provider_func()

    # Print number of parameters.
    print(' > number of parameters on model parallel rank {}: {}'.format(
        0, sum([p.nelement() for p in model.parameters()])), flush=True)

    # Fp16 conversion.
    if args.fp16:
        model = FP16_Module(model)

    return model


def get_optimizer(model):
    """Set up the optimizer."""
    args = get_args()

    # Build parameter groups (weight decay and non-decay).
    while isinstance(model, (torchDDP, FP16_Module)):
        model = model.module
    param_groups = get_params_for_weight_decay_optimization(model)

    # Add model parallel attribute if it is not set.
    for param_group in param_groups:
        for param in param_group['params']:
            if not hasattr(param, 'model_parallel'):
                param.model_parallel = False

    # Use Adam.
    optimizer = Adam(param_groups, lr=args.lr, weight_decay=args.weight_decay,
                     betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps)

    # Wrap into fp16 optimizer.
    if args.fp16:
        optimizer = FP16_Optimizer(optimizer,
                                   static_loss_scale=args.loss_scale,
                                   dynamic_loss_scale=args.dynamic_loss_scale,
                                   dynamic_loss_args={
                                       'scale_window': args.loss_scale_window,
                                       'min_scale': args.min_scale,
                                       'delayed_shift': args.hysteresis})

    return optimizer


def get_learning_rate_scheduler(optimizer):
    """Build the learning rate scheduler."""
    args = get_args()

    # Add linear learning rate scheduler.
    if args.lr_decay_iters is not None:
        num_iters = args.lr_decay_iters
    else:
        num_iters = args.train_iters
    num_iters = max(1, num_iters)
    init_step = 0
    warmup_iter = args.warmup * num_iters
    lr_scheduler = AnnealingLR(
        optimizer,
        start_lr=args.lr,
        warmup_iter=warmup_iter,
        total_iters=num_iters,
        decay_style=args.lr_decay_style,
        last_iter=init_step,
        min_lr=args.min_lr,
        use_checkpoint_lr_scheduler=args.use_checkpoint_lr_scheduler,
        override_lr_scheduler=args.override_lr_scheduler)

    return lr_scheduler


def get_checkpoint_name(checkpoints_path, iteration, release=False):
    if release:
        directory = 'release'
    else:
        directory = 'iter_{:07d}'.format(iteration)
    return os.path.join(checkpoints_path, directory, 'mp_rank_{:02d}'.format(0), 'model_optim_rng.pt')


def get_checkpoint_tracker_filename(checkpoints_path):
    return os.path.join(checkpoints_path, 'latest_checkpointed_iteration.txt')


def save_checkpoint(iteration, model, optimizer, lr_scheduler):
    """Save a model checkpoint."""
    args = get_args()

    # Only rank zero of the data parallel writes to the disk.
    if isinstance(model, torchDDP):
        model = model.module
    if torch.distributed.get_rank() == 0:

        # Arguments, iteration, and model.
        state_dict = {}
        state_dict['args'] = args
        state_dict['checkpoint_version'] = 2.0
        state_dict['iteration'] = iteration
        state_dict['model'] = model.state_dict_for_save_checkpoint()

        # Optimizer stuff.
        if not args.no_save_optim:
            if optimizer is not None:
                state_dict['optimizer'] = optimizer.state_dict()
            if lr_scheduler is not None:
                state_dict['lr_scheduler'] = lr_scheduler.state_dict()

        # RNG states.
        if not args.no_save_rng:
            state_dict['random_rng_state'] = random.getstate()
            state_dict['torch_rng_state'] = torch.get_rng_state()

        # Save.
        checkpoint_name = get_checkpoint_name(args.save, iteration)
        print('global rank {} is saving checkpoint at iteration {:7d} to {}'.
              format(torch.distributed.get_rank(), iteration, checkpoint_name))
        os.makedirs(os.path.dirname(checkpoint_name), exist_ok=True)
        torch.save(state_dict, checkpoint_name)
        print('  successfully saved {}'.format(checkpoint_name))

    # Wait so everyone is done (necessary)
    torch.distributed.barrier()
    # And update the latest iteration
    if torch.distributed.get_rank() == 0:
        tracker_filename = get_checkpoint_tracker_filename(args.save)
        with open(tracker_filename, 'w') as f:
            f.write(str(iteration))
    # Wait so everyone is done (not necessary)
    torch.distributed.barrier()


def load_checkpoint(model, optimizer, lr_scheduler, load_arg='load'):
    """Load a model checkpoint and return the iteration."""
    args = get_args()
    load_dir = getattr(args, load_arg)

    if isinstance(model, torchDDP):
        model = model.module
    # Read the tracker file and set the iteration.
    tracker_filename = get_checkpoint_tracker_filename(load_dir)

    # If no tracker file, return iretation zero.
    if not os.path.isfile(tracker_filename):
        print_rank_0('WARNING: could not find the metadata file {} '.format(
            tracker_filename))
        print_rank_0('    will not load any checkpoints and will start from '
                     'random')
        return 0

    # Otherwise, read the tracker file and either set the iteration or
    # mark it as a release checkpoint.
    iteration = 0
    release = False
    with open(tracker_filename, 'r') as f:
        metastring = f.read().strip()
        try:
            iteration = int(metastring)
        except ValueError:
            release = metastring == 'release'

    # Checkpoint.
    checkpoint_name = get_checkpoint_name(load_dir, iteration, release)
    print_rank_0(' loading checkpoint from {} at iteration {}'.format(
        args.load, iteration))

    # Load the checkpoint.
    # (torch >= 2.6: weights_only=False for the pickled args Namespace; Megatron called
    # torch.load(checkpoint_name, map_location='cpu'))
    state_dict = torch.load(checkpoint_name, map_location='cpu', weights_only=False)

    # Set iteration.
    iteration = state_dict['iteration']

    # Model.
    model.load_state_dict(state_dict['model'])

    # Optimizer.
    if optimizer is not None:
        optimizer.load_state_dict(state_dict['optimizer'])
    if lr_scheduler is not None:
        lr_scheduler.load_state_dict(state_dict['lr_scheduler'])

    # rng states.
    random.setstate(state_dict['random_rng_state'])
    torch.set_rng_state(state_dict['torch_rng_state'])

    torch.distributed.barrier()
    print('  successfully loaded {}'.format(checkpoint_name))

    return iteration


def setup_model_and_optimizer(model_provider_func):
    """Setup model and optimizer."""
    args = get_args()

    model = get_model(model_provider_func)
    optimizer = get_optimizer(model)
    lr_scheduler = get_learning_rate_scheduler(optimizer)

    if args.load is not None:
        args.iteration = load_checkpoint(model, optimizer, lr_scheduler)
    else:
        args.iteration = 0

    return model, optimizer, lr_scheduler


def backward_step(optimizer, model, loss):
    """Backward step."""
    args = get_args()

    # Backward pass.
    if args.fp16:
        optimizer.zero_grad(set_grads_to_None=True)
    else:
        optimizer.zero_grad()
    if args.fp16:
        optimizer.backward(loss, update_master_grads=False)
    else:
        loss.backward()

    # Update master gradients.
    if args.fp16:
        optimizer.update_master_grads()

    # Clipping gradients helps prevent the exploding gradient.
    if args.clip_grad > 0:
        if not args.fp16:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
        else:
            optimizer.clip_master_grads(args.clip_grad)


def train_step(forward_step_func, data_iterator, model, optimizer, lr_scheduler):
    """Single training step."""
    args = get_args()

    # Forward model for one step.
    loss, loss_reduced = forward_step_func(data_iterator, model)

    # Calculate gradients, reduce across processes, and clip.
    backward_step(optimizer, model, loss)

    # Update parameters.
    optimizer.step()

    # Update learning rate.
    skipped_iter = 0
    if not (args.fp16 and optimizer.overflow):
        lr_scheduler.step()
    else:
        skipped_iter = 1

    return loss_reduced, skipped_iter


def train(forward_step_func, model, optimizer, lr_scheduler, train_data_iterator):
    """Train the model function."""
    args = get_args()

    # Turn on training mode which enables dropout.
    model.train()

    # Tracking loss.
    total_loss_dict = {}

    # Iterations.
    iteration = args.iteration
    skipped_iters = 0
    while iteration < args.train_iters:
        loss_dict, skipped_iter = train_step(forward_step_func, train_data_iterator, model, optimizer, lr_scheduler)
        skipped_iters += skipped_iter
        iteration += 1

        for key in loss_dict:
            total_loss_dict[key] = total_loss_dict.get(key, 0.) + loss_dict[key]
        if iteration % args.log_interval == 0:
            learning_rate = optimizer.param_groups[0]['lr']
            log_string = ' iteration {:8d}/{:8d} |'.format(iteration, args.train_iters)
            log_string += ' learning rate: {:.3E} |'.format(learning_rate)
            for key in total_loss_dict:
                avg = total_loss_dict[key].item() / args.log_interval
                log_string += ' {}: {:.6E} |'.format(key, avg)
                total_loss_dict[key] = 0.0
            if args.fp16:
                log_string += ' loss scale: {:.1f} |'.format(optimizer.loss_scale)
            log_string += ' skipped: {} |'.format(skipped_iters)
            print_rank_0(log_string)
            args.last_loss = avg

    save_checkpoint(iteration, model, optimizer, lr_scheduler)
    return iteration


def model_provider():
    print_rank_0('building GPT2 model ...')
    return GPT2Model(get_args().hidden_size)


def get_batch(data_iterator):
    return next(data_iterator)


def forward_step(data_iterator, model):
    """Forward step."""
    tokens, labels = get_batch(data_iterator)
    output = model(tokens)
    loss = torch.nn.functional.mse_loss(output.float(), labels)
    return loss, {'lm loss': loss.detach()}


def data_iterator(args):
    g = torch.Generator().manual_seed(args.seed)
    w = torch.randn(args.hidden_size, args.hidden_size, generator=g)
    while True:
        x = torch.randn(args.batch_size, args.hidden_size, generator=g)
        yield (x.half() if args.fp16 else x), torch.tanh(x @ w)


def pretrain(model_provider, forward_step_func):
    global _GLOBAL_ARGS
    args = parse_args()
    _GLOBAL_ARGS = args
    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29541")
        torch.distributed.init_process_group(backend='gloo', world_size=1, rank=0)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    if args.save is None:  # (a scratch directory: the checkpoints go to ./checkpoints)
        os.chdir(tempfile.mkdtemp())
        args.save = 'checkpoints'

    model, optimizer, lr_scheduler = setup_model_and_optimizer(model_provider)
    iteration = train(forward_step_func, model, optimizer, lr_scheduler, data_iterator(args))
    return iteration


if __name__ == "__main__":
    pretrain(model_provider, forward_step)
    # resume: the same command with --load <save> and more iterations
    first = get_args()
    sys.argv[1:] = sys.argv[1:] + ['--load', first.save, '--save', first.save,
                                   '--train-iters', str(first.train_iters + 10),
                                   '--lr-decay-iters', str(first.train_iters)]
    pretrain(model_provider, forward_step)
    print("final loss {:.4f}".format(get_args().last_loss))
    torch.distributed.destroy_process_group()
