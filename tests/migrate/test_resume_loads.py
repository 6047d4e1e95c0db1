"""fp16kit migrate reports, with its line, each torch.load that resumes apex's FP16_Optimizer state
(its checkpoints pickle apex's scaler, which nothing can unpickle after migrate), naming
`fp16kit convert-checkpoint OLD NEW` -- and not a model's weights, nor amp's plain state, nor files
whose optimizer never pickled a scaler. The sources are the shapes of real apex-era scripts: apex's
ImageNet example (examples/apex_era/fp16_optimizer_resume.py), Megatron-LM v1's utils.py
load_checkpoint, an amp script, a fine-tuning script that loads pretrained weights."""

from __future__ import annotations

import pathlib

import pytest

pytest.importorskip("libcst")

import fp16kit  # noqa: E402
from fp16kit.cli import main as cli_main  # noqa: E402
from fp16kit.migrate.codemod import migrate_source  # noqa: E402

ROOT = pathlib.Path(fp16kit.__file__).resolve().parent.parent
FIX = "convert old checkpoints once: fp16kit convert-checkpoint OLD NEW"


def _reported(source: str, megatron: bool = False) -> list[tuple[int, str]]:
    """(line, the source line) of each torch.load report."""
    lines = source.splitlines()
    return [
        (p.line, lines[p.line - 1].strip())
        for p in migrate_source(source, megatron=megatron).unmigratable
        if FIX in p.message
    ]


def test_the_imagenet_style_resume_is_reported_on_its_lines():
    source = (ROOT / "examples" / "apex_era" / "fp16_optimizer_resume.py").read_text()
    loads = [(i, line.strip()) for i, line in enumerate(source.splitlines(), 1) if "checkpoint = torch.load(" in line]
    assert len(loads) == 2 and _reported(source) == loads  # its default load and its --full-unpickler one
    message = next(p.message for p in migrate_source(source).unmigratable if FIX in p.message)
    assert message.startswith("torch.load(...) resumes apex-era optimizer state (optimizer.load_state_dict): ")


FINE_TUNE = """\
import torch
from apex.fp16_utils import FP16_Optimizer, network_to_half


def load_pretrained(model, path):
    state = torch.load(path, map_location="cpu")  # a model's weights: plain tensors
    model.load_state_dict(state["model"] if "model" in state else state)


def resume(model, optimizer, path):
    checkpoint = torch.load(path)
    opt_state = checkpoint["optimizer"]
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(opt_state)
    return checkpoint["epoch"]


model = network_to_half(build())
optimizer = FP16_Optimizer(torch.optim.SGD(model.parameters(), 0.1), dynamic_loss_scale=True)
model.load_state_dict(torch.load("pretrained.pt"))
"""


def test_only_the_load_that_reaches_the_optimizer_is_reported():
    assert _reported(FINE_TUNE) == [(11, "checkpoint = torch.load(path)")]


# NVIDIA DeepLearningExamples' RN50v1.5 main.py (2019): the optimizer state is taken out of the
# checkpoint here and handed to training.py's get_optimizer, which calls load_state_dict there
RN50_MAIN = """\
import torch
from apex.fp16_utils import *
from image_classification.training import *


def main(args):
    if args.resume:
        checkpoint = torch.load(args.resume, map_location=lambda storage, loc: storage.cuda(args.gpu))
        start_epoch = checkpoint['epoch']
        model_state = checkpoint['state_dict']
        optimizer_state = checkpoint['optimizer']
    optimizer = get_optimizer(list(model.named_parameters()), args.fp16, args.lr, state=optimizer_state)
    pretrained = torch.load(args.pretrained_weights)
    model.load_state_dict(pretrained.get('model'))
"""


def test_a_load_whose_optimizer_entry_goes_to_another_file_is_reported():
    assert _reported(RN50_MAIN) == [
        (8, "checkpoint = torch.load(args.resume, map_location=lambda storage, loc: storage.cuda(args.gpu))")
    ]
    message = next(p.message for p in migrate_source(RN50_MAIN).unmigratable if FIX in p.message)
    assert message.startswith("torch.load(...) resumes apex-era optimizer state (its 'optimizer' entry): ")
    getter = RN50_MAIN.replace("checkpoint['optimizer']", "checkpoint.get('optimizer')")
    assert [line for line, _ in _reported(getter)] == [8]


MEGATRON_UTILS = """\
import os
import torch
from fp16 import FP16_Optimizer
import mpu


def load_checkpoint(model, optimizer, lr_scheduler, args):
    checkpoint_name = get_checkpoint_name(args.load, iteration)
    sd = torch.load(checkpoint_name, map_location='cpu')
    if isinstance(model, torchDDP):
        model = model.module
    model.load_state_dict(sd['model'])
    if not args.finetune and not args.no_load_optim:
        if optimizer is not None:
            optimizer.load_state_dict(sd['optimizer'])
"""


def test_megatron_s_load_checkpoint_is_reported_with_megatron_only():
    assert _reported(MEGATRON_UTILS, megatron=True) == [(9, "sd = torch.load(checkpoint_name, map_location='cpu')")]
    assert _reported(MEGATRON_UTILS) == []  # without --megatron, `fp16` is not apex's and stays as it is


@pytest.mark.parametrize(
    "imports",
    [
        "from apex import amp",  # amp.state_dict() is plain data
        "from apex.parallel import DistributedDataParallel as DDP",
        "from apex.optimizers import FusedAdam, FP16_Optimizer",  # the fused-era wrapper: numbers and tensors only
    ],
)
def test_files_whose_optimizer_state_is_plain_data_are_not_reported(imports):
    source = (
        f"import torch\n{imports}\n"
        "ckpt = torch.load(args.resume)\n"
        "model.load_state_dict(ckpt['model'])\n"
        "optimizer.load_state_dict(ckpt['optimizer'])\n"
        "amp.load_state_dict(ckpt['amp'])\n"
    )
    assert _reported(source) == []


@pytest.mark.parametrize(
    ("imports", "build"),
    [
        ("import torch as th\nimport apex", "apex.fp16_utils.FP16_Optimizer(opt)"),
        ("import torch as th\nimport apex.fp16_utils as fp16_utils", "fp16_utils.FP16_Optimizer(opt)"),
        ("import torch as th\nfrom apex.fp16_utils import *", "FP16_Optimizer(opt)"),
        ("import torch as th\nfrom apex.fp16_utils.fp16_optimizer import FP16_Optimizer as Wrapper", "Wrapper(opt)"),
    ],
)
def test_each_spelling_of_the_optimizer_and_of_torch_load(imports, build):
    """The receiver's name says nothing here: it is what the module assigns the optimizer to."""
    source = f"{imports}\n\nself.trainer = {build}\nself.trainer.load_state_dict(th.load(path)['optimizer'])\n"
    assert _reported(source) == [(5, "self.trainer.load_state_dict(th.load(path)['optimizer'])")]
    bare = source.replace("import torch as th", "from torch import load").replace("th.load(", "load(")
    assert _reported(bare) == [(5, "self.trainer.load_state_dict(load(path)['optimizer'])")]


def test_a_name_from_another_function_does_not_carry_a_load():
    source = (
        "import torch\nfrom apex.fp16_utils import FP16_Optimizer\n\n"
        "def weights(path):\n    state = torch.load(path)\n    return state\n\n"
        "def resume(optimizer, state):\n    optimizer.load_state_dict(state)\n"
    )
    assert _reported(source) == []


def test_migrate_prints_one_line_per_call_in_its_file_line_form(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(
        FINE_TUNE.replace(
            "    return checkpoint", "    optimizer.load_state_dict(torch.load(path + '.bak'))\n    return checkpoint"
        )
    )
    assert cli_main(["migrate", str(script)]) == 0
    out = capsys.readouterr().out.splitlines()
    reports = [line for line in out if FIX in line]
    assert [line.split(": ", 1)[0] for line in reports] == [f"{script}:11", f"{script}:15"]
    assert all(line.count(FIX) == 1 for line in reports)
    assert "from fp16kit.legacy import FP16_Optimizer" in script.read_text()
