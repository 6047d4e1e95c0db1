"""NVIDIA DeepLearningExamples' BERT run_pretraining.py (2019-2020), shrunk to a tiny masked-LM on
CPU: FusedLAMB over two weight-decay groups, a PolyWarmUpScheduler built before amp,
`amp.initialize(model, optimizer, opt_level="O2", loss_scale="dynamic", cast_model_outputs=torch.float16)`,
`amp._amp_state.loss_scalers[0]._loss_scale = args.init_loss_scale`, gradient accumulation with
`amp.scale_loss(loss, optimizer, delay_overflow_check=args.allreduce_post_accumulation)`, the
accumulated grads scaled with `multi_tensor_applier(amp_C.multi_tensor_scale, overflow_buf,
[grads, grads], 1./accumulate)`, grads set to None by hand, a checkpoint with
'master params' = list(amp.master_params(optimizer)) and the resume path that restores them
(`optimizer._lazy_init_maybe_master_weights()`, `optimizer._amp_stash.lazy_init_called = True`).

Unmodified apex code: `fp16kit run examples/apex_era/bert_run_pretraining.py --fp16`.
`--local_rank 0` adds one gloo rank: apex DDP with gradient_predivide_factor, or with
--allreduce_post_accumulation, `flat_dist_call(..., torch.distributed.broadcast, (0,))`.
(The real script also imports apex_C for apex_C.unflatten of a flat all-reduce buffer; this
one-process version leaves that buffer and its all-reduce out. fp16kit.legacy.apex_c provides
apex_C's flatten/unflatten, and migrate rewrites `import apex_C`.)
"""

import argparse
import math
import os
import tempfile

import torch
from torch.optim.lr_scheduler import _LRScheduler

from apex import amp
import amp_C
from apex.amp import _amp_state
from apex.optimizers import FusedLAMB
from apex.parallel import DistributedDataParallel as DDP
from apex.parallel.distributed import flat_dist_call
from apex.multi_tensor_apply import multi_tensor_applier
from apex.normalization.fused_layer_norm import FusedLayerNorm as BertLayerNorm

skipped_steps = 0


class LRScheduler(_LRScheduler):
    def __init__(self, optimizer, last_epoch=-1):
        # Check if using mixed precision training
        self.mixed_training = False
        base_optimizer = optimizer

        # Check that optimizer param is valid
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError('{} is not an Optimizer'.format(
                type(optimizer).__name__))

        super(LRScheduler, self).__init__(base_optimizer, last_epoch)

    def step(self, epoch=None):
        # Set the current training step
        # ('epoch' is used to be consistent with _LRScheduler)
        if self.mixed_training:
            # The assumption is that the step will be constant
            state_dict = self.optimizer.state[self.optimizer.param_groups[0]['params'][0]]
            if 'step' in state_dict:
                self.last_epoch = state_dict['step'] + 1
            else:
                self.last_epoch = 1
        else:
            self.last_epoch = epoch if epoch is not None else self.last_epoch + 1

        for param_group, lr in zip(self.optimizer.param_groups, self.get_lr()):
            param_group['lr'] = lr


class PolyWarmUpScheduler(LRScheduler):
    """
    Applies a warm up period to the learning rate.
    """

    def __init__(self, optimizer, warmup, total_steps, degree=0.5, last_epoch=-1):
        self.warmup = warmup
        self.total_steps = total_steps
        self.degree = degree
        super(PolyWarmUpScheduler, self).__init__(optimizer, last_epoch)

    def step(self, epoch=None):
        param_group = self.optimizer.param_groups[0]
        if 'step' in param_group:
            self.last_epoch = param_group['step'] + 1
        else:
            self.last_epoch = 1

        for param_group, lr in zip(self.optimizer.param_groups, self.get_lr()):
            param_group['lr'] = lr

    def get_lr(self):
        progress = self.last_epoch / self.total_steps
        if progress < self.warmup:
            return [base_lr * progress / self.warmup for base_lr in self.base_lrs]
        else:
            return [base_lr * ((1.0 - progress) ** self.degree) for base_lr in self.base_lrs]


class BertForPreTraining(torch.nn.Module):
    def __init__(self, vocab_size=32, hidden_size=32):
        super().__init__()
        self.word_embeddings = torch.nn.Embedding(vocab_size, hidden_size)
        self.dense = torch.nn.Linear(hidden_size, hidden_size)
        self.LayerNorm = BertLayerNorm(hidden_size, eps=1e-12)
        self.decoder = torch.nn.Linear(hidden_size, vocab_size)
        self.seq_relationship = torch.nn.Linear(hidden_size, 2)

    def checkpoint_activations(self, val):
        self.checkpoint = val

    def forward(self, input_ids, token_type_ids, attention_mask):
        h = self.LayerNorm(torch.nn.functional.gelu(self.dense(self.word_embeddings(input_ids))))
        return self.decoder(h), self.seq_relationship(h[:, 0])


class BertPretrainingCriterion(torch.nn.Module):
    def __init__(self, vocab_size):
        super(BertPretrainingCriterion, self).__init__()
        self.loss_fn = torch.nn.CrossEntropyLoss(ignore_index=-1)
        self.vocab_size = vocab_size

    def forward(self, prediction_scores, seq_relationship_score, masked_lm_labels, next_sentence_labels):
        masked_lm_loss = self.loss_fn(prediction_scores.view(-1, self.vocab_size), masked_lm_labels.view(-1))
        next_sentence_loss = self.loss_fn(seq_relationship_score.view(-1, 2), next_sentence_labels.view(-1))
        total_loss = masked_lm_loss + next_sentence_loss
        return total_loss


def parse_arguments():
    parser = argparse.ArgumentParser()
    parser.add_argument("--learning_rate", default=6e-3, type=float)
    parser.add_argument("--max_steps", default=8, type=float)
    parser.add_argument("--warmup_proportion", default=0.2, type=float)
    parser.add_argument('--gradient_accumulation_steps', type=int, default=2)
    parser.add_argument('--fp16', default=False, action='store_true')
    parser.add_argument('--loss_scale', type=float, default=0.0)
    parser.add_argument('--init_loss_scale', type=int, default=2**20)
    parser.add_argument('--allreduce_post_accumulation', default=False, action='store_true')
    parser.add_argument("--resume_from_checkpoint", default=False, action='store_true')
    parser.add_argument('--checkpoint_activations', default=False, action='store_true')
    parser.add_argument("--output_dir", default=None, type=str)
    parser.add_argument("--local_rank", type=int, default=os.getenv('LOCAL_RANK', -1))
    args = parser.parse_args()
    return args


def prepare_model_and_optimizer(args, device):
    global_step = 0
    checkpoint = None
    model = BertForPreTraining()
    if args.resume_from_checkpoint:
        model_names = [f for f in os.listdir(args.output_dir) if f.endswith(".pt")]
        global_step = max([int(x.split('.pt')[0].split('_')[1].strip()) for x in model_names])
        print("resume step from ", global_step)
        checkpoint = torch.load(os.path.join(args.output_dir, "ckpt_{}.pt".format(global_step)), map_location="cpu")
        model.load_state_dict(checkpoint['model'], strict=False)

    model.to(device)
    param_optimizer = list(model.named_parameters())
    no_decay = ['bias', 'gamma', 'beta', 'LayerNorm']

    optimizer_grouped_parameters = [
        {'params': [p for n, p in param_optimizer if not any(nd in n for nd in no_decay)], 'weight_decay': 0.01},
        {'params': [p for n, p in param_optimizer if any(nd in n for nd in no_decay)], 'weight_decay': 0.0}]

    optimizer = FusedLAMB(optimizer_grouped_parameters,
                          lr=args.learning_rate)
    lr_scheduler = PolyWarmUpScheduler(optimizer,
                                       warmup=args.warmup_proportion,
                                       total_steps=args.max_steps)
    if args.fp16:

        if args.loss_scale == 0:
            model, optimizer = amp.initialize(model, optimizer, opt_level="O2", loss_scale="dynamic",
                                              cast_model_outputs=torch.float16)
        else:
            model, optimizer = amp.initialize(model, optimizer, opt_level="O2", loss_scale=args.loss_scale,
                                              cast_model_outputs=torch.float16)
        amp._amp_state.loss_scalers[0]._loss_scale = args.init_loss_scale

    model.checkpoint_activations(args.checkpoint_activations)

    if args.resume_from_checkpoint:
        optimizer.load_state_dict(checkpoint['optimizer'])  # , strict=False)

        # Restore AMP master parameters
        if args.fp16:
            optimizer._lazy_init_maybe_master_weights()
            optimizer._amp_stash.lazy_init_called = True
            optimizer.load_state_dict(checkpoint['optimizer'])
            for param, saved_param in zip(amp.master_params(optimizer), checkpoint['master params']):
                param.data.copy_(saved_param.data)

    if args.local_rank != -1:
        if not args.allreduce_post_accumulation:
            model = DDP(model, message_size=250000000, gradient_predivide_factor=torch.distributed.get_world_size())
        else:
            flat_dist_call([param.data for param in model.parameters()], torch.distributed.broadcast, (0,))

    criterion = BertPretrainingCriterion(32)

    return model, optimizer, lr_scheduler, checkpoint, global_step, criterion


def take_optimizer_step(args, optimizer, model, overflow_buf, global_step):
    global skipped_steps
    if args.allreduce_post_accumulation:
        # manually allreduce gradients after all accumulation steps
        # check for Inf/NaN
        # (one process: the flat buffer and its all_reduce are left out; the grads
        # are scaled in place, as the script's two multi_tensor_scale calls did through it)
        loss_scale = _amp_state.loss_scalers[0].loss_scale() if args.fp16 else 1
        master_grads = [p.grad for p in amp.master_params(optimizer) if p.grad is not None]
        # 2. combine unflattening and predivision of unscaled 'raw' gradient
        overflow_buf.zero_()
        multi_tensor_applier(amp_C.multi_tensor_scale,
                             overflow_buf,
                             [master_grads, master_grads],
                             loss_scale / (1 * args.gradient_accumulation_steps))
        # 4. combine unscaling and unflattening of allreduced gradient
        overflow_buf.zero_()
        multi_tensor_applier(amp_C.multi_tensor_scale,
                             overflow_buf,
                             [master_grads, master_grads],
                             1./loss_scale)
        # 5. update loss scale
        if args.fp16:
            scaler = _amp_state.loss_scalers[0]
            old_overflow_buf = scaler._overflow_buf
            scaler._overflow_buf = overflow_buf
            had_overflow = scaler.update_scale()
            scaler._overfloat_buf = old_overflow_buf
        else:
            had_overflow = 0
        if had_overflow == 0:
            optimizer.step()
            global_step += 1
        else:
            # Overflow detected, print message and clear gradients
            skipped_steps += 1
            scaler = _amp_state.loss_scalers[0]
            print("skipped step, loss_scale {}".format(scaler.loss_scale()))
            if _amp_state.opt_properties.master_weights:
                for param in optimizer._amp_stash.all_fp32_from_fp16_params:
                    param.grad = None
        for param in model.parameters():
            param.grad = None
    else:
        optimizer.step()
        # optimizer.zero_grad()
        for param in model.parameters():
            param.grad = None
        global_step += 1

    return global_step


def main():
    global skipped_steps
    args = parse_arguments()
    torch.manual_seed(42)
    device = torch.device("cpu")
    if args.local_rank != -1:  # (CPU shrink: one gloo rank, as torch.distributed.launch --nproc_per_node=1)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29531")
        torch.distributed.init_process_group(backend='gloo', init_method='env://', rank=0, world_size=1)
    if args.output_dir is None:
        args.output_dir = tempfile.mkdtemp()

    for phase in ("train", "resume"):
        args.resume_from_checkpoint = phase == "resume"
        if args.resume_from_checkpoint:
            args.max_steps = args.max_steps * 2
        model, optimizer, lr_scheduler, checkpoint, global_step, criterion = prepare_model_and_optimizer(args, device)
        model.train()
        overflow_buf = None
        if args.allreduce_post_accumulation:
            overflow_buf = torch.zeros(1, dtype=torch.int, device=device)

        g = torch.Generator().manual_seed(global_step)
        average_loss = 0.0
        training_steps = 0
        while global_step < args.max_steps:
            input_ids = torch.randint(0, 32, (8, 6), generator=g)
            segment_ids = torch.zeros_like(input_ids)
            input_mask = torch.ones_like(input_ids)
            masked_lm_labels = (input_ids * 3 + 1) % 32
            next_sentence_labels = (input_ids[:, 0] % 2)

            training_steps += 1
            prediction_scores, seq_relationship_score = model(
                input_ids=input_ids, token_type_ids=segment_ids, attention_mask=input_mask)
            loss = criterion(prediction_scores, seq_relationship_score, masked_lm_labels, next_sentence_labels)

            divisor = args.gradient_accumulation_steps
            if args.gradient_accumulation_steps > 1:
                if not args.allreduce_post_accumulation:
                    # this division was merged into predivision
                    loss = loss / args.gradient_accumulation_steps
                    divisor = 1.0
            if args.fp16:
                with amp.scale_loss(loss, optimizer, delay_overflow_check=args.allreduce_post_accumulation) as scaled_loss:
                    scaled_loss.backward()
            else:
                loss.backward()
            average_loss += loss.item()

            if training_steps % args.gradient_accumulation_steps == 0:
                lr_scheduler.step()  # learning rate warmup
                global_step = take_optimizer_step(args, optimizer, model, overflow_buf, global_step)
                loss_scale = amp._amp_state.loss_scalers[0]._loss_scale if args.fp16 else 1
                print("step {} average_loss {:.4f} step_loss {:.4f} learning_rate {:.6f} loss_scale {}".format(
                    global_step, average_loss / divisor, loss.item() * divisor,
                    optimizer.param_groups[0]['lr'], loss_scale))
                last_loss = average_loss / divisor
                average_loss = 0

        model_to_save = model.module if hasattr(model, 'module') else model  # Only save the model it-self
        output_save_file = os.path.join(args.output_dir, "ckpt_{}.pt".format(global_step))
        torch.save({'model': model_to_save.state_dict(),
                    'optimizer': optimizer.state_dict(),
                    'master params': list(amp.master_params(optimizer)),
                    'files': [0],
                    'epoch': 0,
                    'data_loader': None}, output_save_file)
    if args.local_rank != -1:
        torch.distributed.destroy_process_group()
    print("skipped steps {}".format(skipped_steps))
    print("final loss {:.4f}".format(last_loss))


if __name__ == "__main__":
    main()
