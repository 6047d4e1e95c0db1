"""The apex-era scripts in examples/apex_era/ (fp16_utils, amp, fused optimizers, apex.parallel,
Megatron-LM v1) run unmodified under `fp16kit run`, and after `fp16kit migrate` under plain
python, with the same output."""

from __future__ import annotations

import ast
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

import fp16kit
from fp16kit.cli import main as cli_main

ROOT = pathlib.Path(fp16kit.__file__).resolve().parent.parent
SCRIPTS = ROOT / "examples" / "apex_era"

# script -> (arguments, whether it imports Megatron's `fp16` package)
CASES = {
    "word_lm_fp16_utils.py": (["--steps", "30"], False),
    "dcgan_amp.py": (["--opt_level", "O1", "--niter", "12"], False),
    "bert_fused_adam.py": (["--fp16", "--num_train_steps", "30"], False),
    "megatron_v1.py": (["--fp16", "--train-iters", "30"], True),
    "imagenet_ddp_syncbn.py": (["--steps", "12"], False),
    "imagenet_main_amp.py": (
        ["--opt-level", "O1", "--sync_bn", "--dist", "--loss-scale", "dynamic", "--lr", "3.2"],
        False,
    ),
    "bert_run_pretraining.py": (["--fp16", "--allreduce_post_accumulation", "--local_rank", "0"], False),
    "hf_run_glue_fp16.py": (["--fp16", "--fp16_opt_level", "O1"], False),
    "onmt_optimizers_fp16.py": (["-model_dtype", "fp16", "-optim", "fusedadam"], False),
    "megatron_2020_training.py": (["--fp16"], True),
    "transformer_xl_amp.py": (["--fp16"], False),
    "fp16_optimizer_resume.py": (["--epochs", "4", "--dynamic-loss-scale"], False),
    "gnmt_rank_logging.py": ([], False),
    "moco_o1.py": ([], False),
}
EXTRA_RUNS = {  # more flags of the same scripts, run unmodified only
    "dcgan_amp.py": [["--opt_level", "O2", "--niter", "12"]],
    "word_lm_fp16_utils.py": [["--steps", "12", "--static-loss-scale", "128"]],
    "imagenet_ddp_syncbn.py": [["--steps", "6", "--larc"]],
    "imagenet_main_amp.py": [
        ["--opt-level", "O2", "--keep-batchnorm-fp32", "True", "--loss-scale", "128.0"],
        ["--opt-level", "O3", "--keep-batchnorm-fp32", "False", "--epochs", "1"],
    ],
    "bert_run_pretraining.py": [
        ["--fp16"],
        ["--fp16", "--loss_scale", "128", "--init_loss_scale", "128", "--gradient_accumulation_steps", "1"],
    ],
    "hf_run_glue_fp16.py": [["--fp16", "--fp16_opt_level", "O2"]],
    "onmt_optimizers_fp16.py": [
        ["-model_dtype", "fp16", "-apex_opt_level", "O2"],
        ["-model_dtype", "fp16", "-optim", "fusedadam", "-fp16_impl", "optimizers", "-loss_scale", "128"],
    ],
    "megatron_2020_training.py": [["--fp16", "--loss-scale", "1024"], []],
    "transformer_xl_amp.py": [["--fp16", "--apex_amp_opt_level", "O2"], ["--fp16", "--amp", "pytorch"]],
    "fp16_optimizer_resume.py": [["--epochs", "3", "--static-loss-scale", "128"]],
    "gnmt_rank_logging.py": [["--init-scale", "8192", "--train-iters", "8"]],
    "moco_o1.py": [["--moco-t", "0.2", "--steps", "12"]],
}


def _python(*args, cwd=None, env_port=None):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    if env_port:
        env["MASTER_PORT"] = str(env_port)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=300, cwd=cwd)


def _final_loss(stdout: str) -> float:
    found = re.findall(r"final loss (\S+)", stdout)
    assert found, stdout
    return float(found[-1])


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_every_apex_era_script_is_tested():
    assert {p.name for p in SCRIPTS.glob("*.py")} == set(CASES)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_runs_unmodified_and_after_migrate_with_the_same_output(name, tmp_path, capsys):
    args, megatron = CASES[name]
    flag = ["--megatron"] if megatron else []
    unmodified = _python("-m", "fp16kit", "run", *flag, str(SCRIPTS / name), *args, env_port=_free_port())
    assert unmodified.returncode == 0, unmodified.stderr
    loss = _final_loss(unmodified.stdout)
    assert loss == loss and loss < 10  # finite, and trained

    copy = tmp_path / name
    shutil.copy(SCRIPTS / name, copy)
    # the command in-process (tests/cli/test_migrate.py spawns it): a torch import saved per call
    assert cli_main(["migrate", *flag, str(copy)]) == 0, capsys.readouterr()
    tree = ast.parse(copy.read_text())
    left = [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        and any(a.name.split(".")[0] in ("apex", "fp16") for a in node.names)
        or isinstance(node, ast.ImportFrom)
        and (node.module or "").split(".")[0] in ("apex", "fp16")
    ]
    assert not left, f"apex imports left on lines {left}:\n{copy.read_text()}"
    assert cli_main(["migrate", "--check", *flag, str(copy)]) == 0, capsys.readouterr()  # idempotent

    after = _python(str(copy), *args, env_port=_free_port())
    assert after.returncode == 0, after.stderr
    assert after.stdout == unmodified.stdout


@pytest.mark.slow
@pytest.mark.parametrize("name,args", [(n, a) for n, runs in sorted(EXTRA_RUNS.items()) for a in runs])
def test_other_flags_run_unmodified(name, args):
    flag = ["--megatron"] if CASES[name][1] else []
    r = _python("-m", "fp16kit", "run", *flag, str(SCRIPTS / name), *args, env_port=_free_port())
    assert r.returncode == 0, r.stderr
    _final_loss(r.stdout)
