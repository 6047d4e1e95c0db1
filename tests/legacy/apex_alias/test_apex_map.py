"""The one apex -> fp16kit table: its targets exist, both tools read it, and every name it does not
cover comes with a replacement."""

from __future__ import annotations

import importlib
import os
import pathlib
import subprocess
import sys

import pytest

import fp16kit.legacy
from fp16kit.legacy.apex_alias import apex_map

_ENV = dict(os.environ, PYTHONPATH=str(pathlib.Path(fp16kit.legacy.__file__).parents[2]))


def test_every_mapped_target_imports():
    missing = []
    for apex_name, target in sorted(apex_map.module_map(megatron=True).items()):
        try:
            importlib.import_module(target)
        except ImportError as e:
            missing.append(f"{apex_name} -> {target} ({e})")
    assert not missing, "\n".join(missing)


@pytest.mark.slow
def test_import_apex_rewritten_to_fp16kit_legacy_reaches_every_covered_submodule():
    # `import apex; apex.optimizers.FusedAdam(...)` becomes `import fp16kit.legacy;
    # fp16kit.legacy.optimizers.FusedAdam(...)`: apex's __init__ imported its submodules, so must ours
    # (a fresh interpreter: in this one other tests have imported the submodules already)
    children = sorted(k.split(".")[1] for k in apex_map.APEX_MODULES if k.count(".") == 1 and k != "apex.fp16_utils")
    code = f"import fp16kit.legacy as L; print([c for c in {children!r} if not hasattr(L, c)])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_ENV, check=True).stdout
    assert out.strip() == "[]", f"fp16kit.legacy lacks the attributes {out.strip()}"


def test_2018_fp16_utils_names_come_from_fp16kit_legacy():
    for name in ("FP16_Module", "fp32_to_fp16", "fp16_to_fp32", "Fused_Weight_Norm", "FP16_Optimizer"):
        assert hasattr(fp16kit.legacy, name), name


def test_table_shape():
    table = apex_map.module_map(megatron=True)
    for apex_name, target in table.items():
        assert target == "fp16kit.legacy" or target.startswith("fp16kit.legacy."), target
        parent = apex_name.rpartition(".")[0]
        assert parent in ("", "megatron") or parent in table, f"{apex_name}: its package {parent} is not mapped"
        assert apex_name not in apex_map.UNCOVERED
    assert set(apex_map.module_map()) == set(apex_map.APEX_MODULES)  # megatron names only on request
    assert "fp16" not in apex_map.module_map()
    for closed in apex_map.CLOSED:
        assert closed in table


@pytest.mark.parametrize(
    "path,new",
    [
        ("apex.amp.initialize", "fp16kit.legacy.amp.initialize"),
        ("apex.fp16_utils.FP16_Optimizer", "fp16kit.legacy.FP16_Optimizer"),
        ("apex.fp16_utils.loss_scaler.LossScaler", "fp16kit.legacy.loss_scaler.LossScaler"),
        ("apex.parallel.LARC.LARC", "fp16kit.legacy.parallel.LARC.LARC"),
        ("apex.contrib.optimizers.fused_adam.FusedAdam", "fp16kit.legacy.contrib.optimizers.fused_adam.FusedAdam"),
        ("apex", "fp16kit.legacy"),
        ("amp_C.multi_tensor_l2norm", "fp16kit.legacy.multi_tensor_apply.multi_tensor_l2norm"),
        ("apex.amp.lists.functional_overrides.FP32_FUNCS", "fp16kit.legacy.amp.lists.functional_overrides.FP32_FUNCS"),
    ],
)
def test_resolve_longest_prefix(path, new):
    res = apex_map.resolve(path)
    assert res is not None and res.covered and res.new_path == new


def test_resolve_megatron_only_on_request():
    assert apex_map.resolve("fp16.FP16_Module") is None
    assert apex_map.resolve("fp16.FP16_Module", megatron=True).new_path == "fp16kit.legacy.megatron.FP16_Module"
    assert (
        apex_map.resolve("megatron.fp16.loss_scaler", megatron=True).new_path == "fp16kit.legacy.megatron.loss_scaler"
    )
    assert apex_map.resolve("megatron.mpu", megatron=True) is None  # the rest of Megatron is not ours
    assert apex_map.resolve("fp16kit.legacy", megatron=True) is None  # migrated code is never touched again


@pytest.mark.parametrize(
    "path,replacement",
    [
        ("apex.RNN.LSTM", "torch.nn.LSTM"),
        ("apex.reparameterization.apply_weight_norm", "torch.nn.utils.parametrizations.weight_norm"),
        ("apex.transformer.tensor_parallel", "megatron.core"),
        ("apex.mlp.MLP", "torch.nn.Sequential"),
        ("apex.fused_dense.FusedDense", "torch.nn.Linear"),
        ("apex.optimizers.FusedMixedPrecisionLamb", "FusedLAMB"),
        ("apex.contrib.xentropy.SoftmaxCrossEntropyLoss", "cross_entropy"),
        ("apex.contrib.optimizers.DistributedFusedAdam", "ZeroRedundancyOptimizer"),
        ("apex.contrib.whatever_new", "apex.contrib.optimizers"),  # closed package: nothing guessed
        ("apex.bogus", "apex.optimizers"),
        ("fused_adam_cuda.adam", "FusedAdam"),
    ],
)
def test_uncovered_names_have_a_replacement(path, replacement):
    res = apex_map.resolve(path)
    assert res is not None and not res.covered
    assert replacement in res.hint and replacement in apex_map.hint_for(path)
    assert "fp16kit" in res.hint


def test_the_alias_and_the_codemod_read_the_same_table():
    from fp16kit.legacy.apex_alias.finder import _ApexAliasFinder

    finder = _ApexAliasFinder(megatron=True, shadow=False, synthetic_megatron=False)
    # the alias's module for apex.fp16_utils is the narrower one its star import needs (codemod: `import *` only)
    assert dict(finder.table) == {**apex_map.module_map(megatron=True), **apex_map.STAR_MODULES}
    codemod = pytest.importorskip("fp16kit.migrate.codemod")
    assert dict(codemod._ApexRewriter(megatron=True).table) == dict(apex_map.module_map(megatron=True))
