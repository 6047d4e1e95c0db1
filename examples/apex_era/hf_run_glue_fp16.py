"""HF transformers' examples/run_glue.py (2019-2020, same in run_squad.py), shrunk to a tiny
classifier on CPU: `--fp16 --fp16_opt_level O1`, `from apex import amp` inside train() behind
`try/except ImportError: raise ImportError("Please install apex ...")`, AdamW with two
weight-decay groups, the linear-warmup scheduler built BEFORE amp.initialize (as the script
did), gradient accumulation, `torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer),
args.max_grad_norm)`, and the checkpoint (model, optimizer.pt, scheduler.pt, training_args.bin)
reloaded for a second run.

Unmodified apex code: `fp16kit run examples/apex_era/hf_run_glue_fp16.py --fp16`.
"""

import argparse
import logging
import os
import random
import tempfile

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

logger = logging.getLogger(__name__)


def get_linear_schedule_with_warmup(optimizer, num_warmup_steps, num_training_steps, last_epoch=-1):
    def lr_lambda(current_step):
        if current_step < num_warmup_steps:
            return float(current_step) / float(max(1, num_warmup_steps))
        return max(
            0.0, float(num_training_steps - current_step) / float(max(1, num_training_steps - num_warmup_steps))
        )

    return LambdaLR(optimizer, lr_lambda, last_epoch)


class BertForSequenceClassification(nn.Module):
    def __init__(self, vocab_size=50, hidden_size=32, num_labels=2):
        super().__init__()
        self.embeddings = nn.Embedding(vocab_size, hidden_size)
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.LayerNorm = nn.LayerNorm(hidden_size, eps=1e-12)
        self.classifier = nn.Linear(hidden_size, num_labels)
        self.num_labels = num_labels

    def forward(self, input_ids=None, attention_mask=None, labels=None):
        h = self.LayerNorm(torch.tanh(self.dense(self.embeddings(input_ids))))
        logits = self.classifier((h * attention_mask.unsqueeze(-1)).mean(1))
        outputs = (logits,)
        if labels is not None:
            loss_fct = nn.CrossEntropyLoss()
            loss = loss_fct(logits.view(-1, self.num_labels), labels.view(-1))
            outputs = (loss,) + outputs
        return outputs


def set_seed(args):
    random.seed(args.seed)
    torch.manual_seed(args.seed)


def train(args, train_dataset, model):
    """ Train the model """
    train_sampler = RandomSampler(train_dataset)
    train_dataloader = DataLoader(train_dataset, sampler=train_sampler, batch_size=args.train_batch_size)

    t_total = len(train_dataloader) // args.gradient_accumulation_steps * args.num_train_epochs

    # Prepare optimizer and schedule (linear warmup and decay)
    no_decay = ["bias", "LayerNorm.weight"]
    optimizer_grouped_parameters = [
        {
            "params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
            "weight_decay": args.weight_decay,
        },
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]

    optimizer = torch.optim.AdamW(optimizer_grouped_parameters, lr=args.learning_rate, eps=args.adam_epsilon)
    scheduler = get_linear_schedule_with_warmup(
        optimizer, num_warmup_steps=args.warmup_steps, num_training_steps=t_total
    )

    # Check if saved optimizer or scheduler states exist
    if os.path.isfile(os.path.join(args.model_name_or_path, "optimizer.pt")) and os.path.isfile(
        os.path.join(args.model_name_or_path, "scheduler.pt")
    ):
        # Load in optimizer and scheduler states
        optimizer.load_state_dict(torch.load(os.path.join(args.model_name_or_path, "optimizer.pt")))
        scheduler.load_state_dict(torch.load(os.path.join(args.model_name_or_path, "scheduler.pt")))

    if args.fp16:
        try:
            from apex import amp
        except ImportError:
            raise ImportError("Please install apex from https://www.github.com/nvidia/apex to use fp16 training.")
        model, optimizer = amp.initialize(model, optimizer, opt_level=args.fp16_opt_level)

    # multi-gpu training (should be after apex fp16 initialization)
    if args.n_gpu > 1:
        model = torch.nn.DataParallel(model)

    # Train!
    logger.info("***** Running training *****")
    print("  Num examples = %d" % len(train_dataset))
    print("  Total optimization steps = %d" % t_total)

    global_step = 0
    epochs_trained = 0
    steps_trained_in_current_epoch = 0
    # Check if continuing training from a checkpoint
    if os.path.exists(args.model_name_or_path):
        # set global_step to gobal_step of last saved checkpoint from model path
        try:
            global_step = int(args.model_name_or_path.split("-")[-1].split("/")[0])
        except ValueError:
            global_step = 0
        epochs_trained = global_step // (len(train_dataloader) // args.gradient_accumulation_steps)
        steps_trained_in_current_epoch = global_step % (len(train_dataloader) // args.gradient_accumulation_steps)

        print("  Continuing training from checkpoint, will skip to saved global_step")
        print("  Continuing training from epoch %d" % epochs_trained)
        print("  Continuing training from global step %d" % global_step)

    tr_loss, logging_loss = 0.0, 0.0
    model.zero_grad()
    set_seed(args)  # Added here for reproductibility
    for _ in range(epochs_trained, int(args.num_train_epochs)):
        for step, batch in enumerate(train_dataloader):

            # Skip past any already trained steps if resuming training
            if steps_trained_in_current_epoch > 0:
                steps_trained_in_current_epoch -= 1
                continue

            model.train()
            inputs = {"input_ids": batch[0], "attention_mask": batch[1], "labels": batch[2]}
            outputs = model(**inputs)
            loss = outputs[0]  # model outputs are always tuple in transformers (see doc)

            if args.n_gpu > 1:
                loss = loss.mean()  # mean() to average on multi-gpu parallel training
            if args.gradient_accumulation_steps > 1:
                loss = loss / args.gradient_accumulation_steps

            if args.fp16:
                with amp.scale_loss(loss, optimizer) as scaled_loss:
                    scaled_loss.backward()
            else:
                loss.backward()

            tr_loss += loss.item()
            if (step + 1) % args.gradient_accumulation_steps == 0:
                if args.fp16:
                    torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), args.max_grad_norm)
                else:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)

                optimizer.step()
                scheduler.step()  # Update learning rate schedule
                model.zero_grad()
                global_step += 1

                if args.logging_steps > 0 and global_step % args.logging_steps == 0:
                    logs = {}
                    loss_scalar = (tr_loss - logging_loss) / args.logging_steps
                    learning_rate_scalar = scheduler.get_lr()[0]
                    logs["learning_rate"] = learning_rate_scalar
                    logs["loss"] = loss_scalar
                    logging_loss = tr_loss
                    print({**logs, **{"step": global_step}})
                    args.last_loss = loss_scalar

                if args.save_steps > 0 and global_step % args.save_steps == 0:
                    # Save model checkpoint
                    output_dir = os.path.join(args.output_dir, "checkpoint-{}".format(global_step))
                    if not os.path.exists(output_dir):
                        os.makedirs(output_dir)
                    model_to_save = (
                        model.module if hasattr(model, "module") else model
                    )  # Take care of distributed/parallel training
                    torch.save(model_to_save.state_dict(), os.path.join(output_dir, "pytorch_model.bin"))
                    torch.save(args, os.path.join(output_dir, "training_args.bin"))
                    print("Saving model checkpoint to %s" % output_dir)

                    torch.save(optimizer.state_dict(), os.path.join(output_dir, "optimizer.pt"))
                    torch.save(scheduler.state_dict(), os.path.join(output_dir, "scheduler.pt"))
                    print("Saving optimizer and scheduler states to %s" % output_dir)

    return global_step, tr_loss / global_step


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_name_or_path", default="", type=str)
    parser.add_argument("--output_dir", default=None, type=str)
    parser.add_argument("--train_batch_size", default=8, type=int)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
    parser.add_argument("--learning_rate", default=5e-3, type=float)
    parser.add_argument("--weight_decay", default=0.0, type=float)
    parser.add_argument("--adam_epsilon", default=1e-8, type=float)
    parser.add_argument("--max_grad_norm", default=1.0, type=float)
    parser.add_argument("--num_train_epochs", default=2.0, type=float)
    parser.add_argument("--warmup_steps", default=2, type=int)
    parser.add_argument("--logging_steps", type=int, default=2)
    parser.add_argument("--save_steps", type=int, default=4)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument(
        "--fp16",
        action="store_true",
        help="Whether to use 16-bit (mixed) precision (through NVIDIA apex) instead of 32-bit",
    )
    parser.add_argument(
        "--fp16_opt_level",
        type=str,
        default="O1",
        help="For fp16: Apex AMP optimization level selected in ['O0', 'O1', 'O2', and 'O3']."
        "See details at https://nvidia.github.io/apex/amp.html",
    )
    args = parser.parse_args()
    args.n_gpu = 0
    if args.output_dir is None:  # (a scratch directory: the checkpoints go to ./output)
        os.chdir(tempfile.mkdtemp())
        args.output_dir = "output"

    # Setup logging
    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s -   %(message)s",
        datefmt="%m/%d/%Y %H:%M:%S",
        level=logging.WARN,
    )
    set_seed(args)

    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 50, (64, 8), generator=g)
    attention_mask = torch.ones_like(input_ids)
    labels = (input_ids[:, 0] >= 25).long()
    train_dataset = TensorDataset(input_ids, attention_mask, labels)

    model = BertForSequenceClassification()
    global_step, tr_loss = train(args, train_dataset, model)
    print(" global_step = %s, average loss = %s" % (global_step, tr_loss))

    # a second run, from the last checkpoint (--model_name_or_path output_dir/checkpoint-N)
    checkpoint = os.path.join(args.output_dir, "checkpoint-{}".format(args.save_steps))
    args.model_name_or_path = checkpoint
    model = BertForSequenceClassification()
    model.load_state_dict(torch.load(os.path.join(checkpoint, "pytorch_model.bin")))
    saved_args = torch.load(os.path.join(checkpoint, "training_args.bin"), weights_only=False)
    assert saved_args.fp16_opt_level == args.fp16_opt_level
    global_step, tr_loss = train(args, train_dataset, model)
    print(" global_step = %s, average loss = %s" % (global_step, tr_loss))
    print("final loss {:.4f}".format(args.last_loss))


if __name__ == "__main__":
    main()
