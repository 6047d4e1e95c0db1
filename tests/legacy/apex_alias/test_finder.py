"""install_apex_alias(): `import apex...` resolves to the fp16kit.legacy module objects, uncovered
names raise ImportError naming fp16kit and a replacement, a real apex is not hidden by accident,
and uninstalling leaves sys.modules and sys.meta_path as they were."""

from __future__ import annotations

import importlib
import importlib.metadata
import pickle
import pkgutil
import sys
import warnings

import pytest

import fp16kit.legacy
import fp16kit.legacy.amp
from fp16kit.legacy.apex_alias import apex_alias_installed, apex_map, install_apex_alias, uninstall_apex_alias


def _ours(name: str) -> bool:
    root = name.partition(".")[0]
    return root in ("apex", "amp_C", "fp16") or name == "megatron" or name.startswith("megatron.")


@pytest.fixture
def alias():
    """Install/uninstall around a test; checks it leaves no trace."""
    before_modules = {k for k in sys.modules if _ours(k)}
    before_path = list(sys.meta_path)
    assert not before_modules
    yield install_apex_alias
    uninstall_apex_alias()
    assert not apex_alias_installed()
    assert {k for k in sys.modules if _ours(k)} == set()
    assert sys.meta_path == before_path


def test_apex_modules_are_the_fp16kit_modules(alias):
    alias()
    import apex
    import apex.amp
    import apex.fp16_utils.loss_scaler as ls
    from apex import amp
    from apex.fp16_utils import FP16_Optimizer

    assert amp is fp16kit.legacy.amp is apex.amp
    assert ls is sys.modules["fp16kit.legacy.loss_scaler"]
    assert FP16_Optimizer is fp16kit.legacy.FP16_Optimizer
    assert apex.fp16_utils is fp16kit.legacy.fp16_utils
    # the module keeps its own identity: spec, name and file are fp16kit's
    assert amp.__spec__.name == "fp16kit.legacy.amp" and amp.__name__ == "fp16kit.legacy.amp"
    assert importlib.util.find_spec("fp16kit.legacy.amp").origin == amp.__spec__.origin
    assert not hasattr(sys.modules["fp16kit.legacy.fp16util"], "__path__")  # a plain module stays one


def test_amp_C_is_the_multi_tensor_apply_module(alias):
    alias()
    import amp_C
    from apex.multi_tensor_apply import multi_tensor_applier

    mta = importlib.import_module("fp16kit.legacy.multi_tensor_apply")
    assert amp_C is mta and multi_tensor_applier is mta.multi_tensor_applier
    assert callable(amp_C.multi_tensor_scale) and callable(amp_C.multi_tensor_l2norm)


def test_availability_checks_see_apex_installed(alias, tmp_path):
    # what apex-era scripts ask before, or instead of, importing apex (Transformer-XL's
    # `'apex' not in sys.modules` -> "APEX AMP unavailable"; transformers' old is_apex_available();
    # a test suite's find_spec("apex.amp"); env reports and requirement checks reading the metadata)
    alias()
    assert "apex" in sys.modules and sys.modules["apex"].__spec__.name == "apex"
    assert importlib.util.find_spec("apex") is not None and importlib.util.find_spec("apex.amp") is not None
    assert importlib.util.find_spec("amp_C") is not None and importlib.util.find_spec("apex_C") is not None
    if hasattr(pkgutil, "find_loader"):  # gone in python 3.14
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            assert pkgutil.find_loader("apex") is not None
    assert importlib.metadata.version("apex") == "0.1"  # what every apex build's metadata said
    dist = importlib.metadata.distribution("Apex")  # any spelling PEP 503 equates
    assert dist.metadata["Name"] == "apex" and "fp16kit.legacy" in dist.metadata["Summary"]
    assert dist.files is None and not dist.requires
    assert importlib.metadata.packages_distributions()["apex"][0] == "apex"
    # only on the interpreter's path: a search of another folder (an installer's target) finds nothing
    assert not [d for d in importlib.metadata.distributions(path=[str(tmp_path)])]
    import apex

    with pytest.raises(AttributeError, match="apex never had one"):  # as in every apex: no __version__
        apex.__version__  # noqa: B018
    assert hasattr(apex, "amp")  # the guards' hasattr(apex, "amp")

    uninstall_apex_alias()
    assert "apex" not in sys.modules and importlib.util.find_spec("apex") is None
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("apex")


def test_every_covered_submodule_is_an_attribute_of_apex(alias):
    alias()
    import apex

    children = sorted(k.split(".")[1] for k in apex_map.APEX_MODULES if k.count(".") == 1)
    assert apex.__all__ == children
    for name in children:
        module = getattr(apex, name)
        assert sys.modules[f"apex.{name}"] is module
        if f"apex.{name}" in apex_map.CLOSED:  # synthetic: only the covered submodules
            assert module.__all__ == ["optimizers"]
            assert module.optimizers is importlib.import_module("fp16kit.legacy.contrib.optimizers")
        else:
            target = apex_map.STAR_MODULES.get(f"apex.{name}", apex_map.APEX_MODULES[f"apex.{name}"])
            assert module is importlib.import_module(target)


def test_submodule_import_does_not_clobber_an_exported_name(alias):
    # fp16kit.legacy.amp exports the object `_amp_state`, like apex.amp did; importing the
    # submodule apex.amp._amp_state must not replace that attribute with the module
    state = fp16kit.legacy.amp._amp_state
    alias()
    import apex.amp._amp_state
    from apex.amp._amp_state import _amp_state

    assert fp16kit.legacy.amp._amp_state is state is _amp_state is apex.amp._amp_state
    assert sys.modules["apex.amp._amp_state"] is sys.modules["fp16kit.legacy.amp._amp_state"]


def test_uncovered_imports_raise_importerror_naming_fp16kit_and_a_replacement(alias):
    alias()
    with pytest.raises(ImportError, match=r"apex\.RNN.*fp16kit.*torch\.nn\.LSTM"):
        import apex.RNN  # noqa: F401
    with pytest.raises(ImportError, match=r"fp16kit.*torch\.nn\.utils\.parametrizations\.weight_norm"):
        from apex.reparameterization import apply_weight_norm  # noqa: F401
    import fp16kit.legacy.contrib  # noqa: F401  (imported first or not, apex.contrib stays apex's)

    with pytest.raises(ImportError, match=r"fp16kit.*cross_entropy"):
        from apex.contrib import xentropy  # noqa: F401  (a fromlist import keeps the hint)
    with pytest.raises(ImportError, match=r"fp16kit.*cross_entropy"):
        import apex.contrib.xentropy  # noqa: F401
    with pytest.raises(ImportError, match=r"not covered by fp16kit"):
        import apex.amp.nonexistent  # noqa: F401
    import apex

    with pytest.raises(AttributeError, match="torch.nn.LSTM"):
        apex.RNN  # noqa: B018
    assert not hasattr(apex, "transformer")


def test_pickles_by_apex_path_load_as_fp16kit_classes(alias):
    # an apex-era pickle names apex.fp16_utils.loss_scaler.DynamicLossScaler
    alias()
    from fp16kit.legacy.loss_scaler import DynamicLossScaler

    data = pickle.dumps(DynamicLossScaler(init_scale=2.0**10), protocol=0)  # text: paths can be edited
    assert b"fp16kit.legacy.loss_scaler" in data
    apex_data = data.replace(b"fp16kit.legacy.loss_scaler", b"apex.fp16_utils.loss_scaler")
    restored = pickle.loads(apex_data)
    assert type(restored) is DynamicLossScaler and restored.cur_scale == 2.0**10


def test_megatron_opt_in(alias):
    alias(megatron=True)
    import fp16
    from fp16 import loss_scaler
    from megatron.fp16 import FP16_Optimizer

    megatron = sys.modules["fp16kit.legacy.megatron"]
    assert fp16 is megatron and loss_scaler is sys.modules["fp16kit.legacy.megatron.loss_scaler"]
    assert FP16_Optimizer is megatron.FP16_Optimizer
    with pytest.raises(ImportError, match="only megatron.fp16"):
        import megatron.mpu  # noqa: F401


def test_megatron_names_are_not_claimed_without_the_flag(alias):
    alias()
    assert importlib.util.find_spec("fp16") is None


def _fake_package(tmp_path, name: str):
    pkg = tmp_path / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text("REAL = True\n")
    return pkg


def _old_apex(tmp_path):
    """An apex before 25.x: it has amp/ and fp16_utils/, so the alias is not needed."""
    pkg = _fake_package(tmp_path, "apex")
    for sub in ("amp", "fp16_utils"):
        (pkg / sub).mkdir()
        (pkg / sub / "__init__.py").write_text("REAL = True\n")
    return pkg


def test_refuses_to_hide_a_real_apex_that_has_amp(alias, tmp_path, monkeypatch):
    _old_apex(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    meta_path = list(sys.meta_path)
    with pytest.raises(
        RuntimeError, match=r"real module named 'apex' is importable.*do not need the alias.*shadow=True"
    ):
        alias()
    assert sys.meta_path == meta_path and not apex_alias_installed()  # nothing changed
    alias(shadow=True)
    import apex

    assert not hasattr(apex, "REAL") and apex.amp is fp16kit.legacy.amp


def test_shadow_gives_an_imported_apex_back(alias, tmp_path, monkeypatch):
    _old_apex(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    import apex as real

    try:
        with pytest.raises(RuntimeError, match="already imported"):
            alias()
        alias(shadow=True)
        assert importlib.import_module("apex") is not real
        uninstall_apex_alias()
        assert sys.modules["apex"] is real
    finally:
        sys.modules.pop("apex", None)


def test_a_namespace_directory_named_apex_is_not_a_real_apex(alias, tmp_path, monkeypatch):
    # a cloned apex repository's top folder (no __init__.py) next to the script
    (tmp_path / "apex").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    alias()
    import apex

    assert apex.amp is fp16kit.legacy.amp


def test_install_twice_and_uninstall_twice(alias):
    alias()
    alias()  # same arguments: nothing happens
    assert sum(type(f).__name__ == "_ApexAliasFinder" for f in sys.meta_path) == 1
    with pytest.raises(RuntimeError, match="uninstall_apex_alias"):
        alias(megatron=True)
    uninstall_apex_alias()
    uninstall_apex_alias()
    with pytest.raises(ImportError):
        import apex  # noqa: F401


def test_uninstall_forgets_what_was_imported(alias):
    alias()
    import apex.optimizers.fused_adam  # noqa: F401
    from apex.parallel import DistributedDataParallel  # noqa: F401

    assert "apex.optimizers.fused_adam" in sys.modules
    uninstall_apex_alias()
    assert not [k for k in sys.modules if k.partition(".")[0] == "apex"]
    assert "fp16kit.legacy.optimizers.fused_adam" in sys.modules  # fp16kit's own stay imported


def test_megatrons_own_fp16_copy_gets_advice_that_works(alias, tmp_path, monkeypatch):
    # a Megatron-LM v1 checkout: fp16/ beside pretrain_bert.py, importing apex itself. "run it as it
    # is" read as "without fp16kit"; what works is the alias without megatron=True
    pkg = _fake_package(tmp_path, "fp16")
    (pkg / "__init__.py").write_text("from apex.multi_tensor_apply import multi_tensor_applier\nREAL = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RuntimeError, match=r"real module named 'fp16'.*without --megatron.*through the alias"):
        alias(megatron=True)
    alias()
    import fp16

    assert fp16.REAL and fp16.multi_tensor_applier is fp16kit.legacy.multi_tensor_apply.multi_tensor_applier
    sys.modules.pop("fp16")
