"""`from apex.fp16_utils import *` binds apex's names and nothing else, under `fp16kit run` and
after `fp16kit migrate`: fp16kit.legacy (which is apex.fp16_utils for named imports) also holds
amp, optimizers, parallel, load_checkpoint, ..., and a star import of it replaced a script's own
objects of those names (a utils module's `load_checkpoint`, `import torch.optim as optimizers`)."""

from __future__ import annotations

import sys
import textwrap

import pytest

from fp16kit.legacy.apex_alias.finder import install_apex_alias, uninstall_apex_alias
from fp16kit.migrate.codemod import migrate_source
from fp16kit.migrate.runner import run_script

# what apex/fp16_utils/__init__.py bound (no __all__: its imports and the submodules they loaded)
APEX_2019 = {
    "BN_convert_float",
    "network_to_half",
    "prep_param_lists",
    "model_grads_to_master_grads",
    "master_params_to_model_params",
    "tofp16",
    "to_python_float",
    "clip_grad_norm",
    "convert_module",
    "convert_network",
    "FP16Model",
    "FP16_Optimizer",
    "LossScaler",
    "DynamicLossScaler",
    "fp16util",
    "fp16_optimizer",
    "loss_scaler",
}
APEX_2018_EXTRA = {"Fused_Weight_Norm", "fused_weight_norm", "fp32_to_fp16", "fp16_to_fp32", "FP16_Module"}

# the pattern: the script's own helpers first, then apex's star import (imagenet-style), then use both
SCRIPT = """
import sys
import torch
import torch.optim as optimizers
from utils import load_checkpoint
from apex.fp16_utils import *

model = network_to_half(torch.nn.Linear(2, 2))
opt = FP16_Optimizer(optimizers.SGD(model.parameters(), lr=0.1), static_loss_scale=8.0)
sys.modules["__main__"].RESULT = (load_checkpoint("x"), type(opt).__module__, optimizers.__name__)
"""


def _star_names(module: str) -> set[str]:
    ns: dict = {}
    exec(f"from {module} import *", ns)
    return set(ns) - {"__builtins__"}


@pytest.fixture
def project(tmp_path, monkeypatch):
    (tmp_path / "utils.py").write_text("def load_checkpoint(path):\n    return 'the script own ' + path\n")
    (tmp_path / "train.py").write_text(textwrap.dedent(SCRIPT))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("utils", None)


def test_the_alias_star_import_binds_apex_names_only():
    install_apex_alias()
    try:
        assert _star_names("apex.fp16_utils") == APEX_2019 | APEX_2018_EXTRA
        # a named import of an fp16kit.legacy name from apex.fp16_utils was never apex's either
        with pytest.raises(ImportError):
            exec("from apex.fp16_utils import load_checkpoint", {})
    finally:
        uninstall_apex_alias()


def test_the_migrated_star_import_binds_the_same_names():
    result = migrate_source("from apex.fp16_utils import *\nfrom apex.fp16_utils import FP16_Optimizer\n")
    module = result.code.splitlines()[0].split()[1]
    assert module == "fp16kit.legacy.fp16_utils"
    assert result.code.splitlines()[1] == "from fp16kit.legacy import FP16_Optimizer"  # named: unchanged
    assert _star_names(module) == APEX_2019 | APEX_2018_EXTRA


def _expected():
    return ("the script own x", "fp16kit.legacy.fp16_optimizer", "torch.optim")


def test_a_script_keeps_its_own_names_under_run(project):
    main = sys.modules["__main__"]
    try:
        assert run_script(str(project / "train.py"), restore=False) == 0
        assert sys.modules["__main__"].RESULT == _expected()
    finally:
        uninstall_apex_alias()
        sys.modules["__main__"] = main


def test_a_script_keeps_its_own_names_after_migrate(project):
    migrated = migrate_source((project / "train.py").read_text()).code
    ns: dict = {"__name__": "__main__"}
    main = sys.modules["__main__"]
    sys.modules["__main__"] = type(sys)("__main__")
    try:
        exec(compile(migrated, "train.py", "exec"), ns)
        assert sys.modules["__main__"].RESULT == _expected()
    finally:
        sys.modules["__main__"] = main
