"""install_apex_alias() beside a real apex that lacks amp / fp16_utils (NVIDIA apex >= 25.x, as NGC
containers ship it): `import apex` is the real package, what it lacks of fp16kit's coverage is
fp16kit.legacy's (also as attributes of the real package), everything it has stays its own, and
uninstalling takes every trace of fp16kit off it."""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.metadata
import logging
import sys

import pytest

import fp16kit.legacy
import fp16kit.legacy.amp
from fp16kit.legacy.apex_alias import apex_alias_installed, install_apex_alias, uninstall_apex_alias


def _apex_names() -> set[str]:
    return {k for k in sys.modules if k == "apex" or k.startswith("apex.") or k == "amp_C"}


@pytest.fixture
def new_apex(tmp_path, monkeypatch):
    """apex 25.x's shape: contrib.xentropy and optimizers (with a marker class) but no amp / fp16_utils."""
    assert not _apex_names() and not apex_alias_installed()
    pkg = tmp_path / "apex"
    (pkg / "contrib" / "xentropy").mkdir(parents=True)
    (pkg / "optimizers").mkdir()
    (pkg / "__init__.py").write_text("REAL = True\n__all__ = ['optimizers', 'normalization', 'transformer']\n")
    (pkg / "contrib" / "__init__.py").write_text("")
    (pkg / "contrib" / "xentropy" / "__init__.py").write_text("class SoftmaxCrossEntropyLoss:\n    REAL = True\n")
    (pkg / "optimizers" / "__init__.py").write_text("class FusedAdam:\n    REAL = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    meta_path = list(sys.meta_path)
    yield pkg
    uninstall_apex_alias()
    assert sys.meta_path == meta_path
    for name in _apex_names():  # the real apex stays imported after uninstall, as any import does
        del sys.modules[name]


def _assert_no_fp16kit_left_on(apex, optimizers):
    assert not hasattr(apex, "amp") and not hasattr(apex, "fp16_utils") and not hasattr(apex, "parallel")
    assert not hasattr(optimizers, "fused_adam")  # a submodule the fake's optimizers lacks
    assert not [k for k in sys.modules if k.startswith("apex.") and sys.modules[k].__name__.startswith("fp16kit")]
    with pytest.raises(ModuleNotFoundError):
        import apex.amp  # noqa: F401


def test_a_new_apex_is_complemented_not_hidden(new_apex, caplog):
    with caplog.at_level(logging.INFO, logger="fp16kit"):
        install_apex_alias()
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(infos) == 1 and str(new_apex / "__init__.py") in infos[0]
    assert "apex.amp, apex.fp16_utils" in infos[0] and "apex.contrib.xentropy" not in infos[0]
    import apex

    # the real package, with its own loader, spec and __all__ ...
    assert apex.REAL and apex.__file__ == str(new_apex / "__init__.py")
    assert type(apex.__loader__) is importlib.machinery.SourceFileLoader and apex.__spec__.loader is apex.__loader__
    assert apex.__all__ == ["optimizers", "normalization", "transformer"]
    # ... whose missing modules are fp16kit's, as attributes too: `import apex; apex.amp.initialize`
    assert apex.amp is fp16kit.legacy.amp and apex.fp16_utils is fp16kit.legacy.fp16_utils
    assert apex.amp.initialize is fp16kit.legacy.amp.initialize
    from apex import amp
    from apex.amp import _amp_state
    from apex.fp16_utils import FP16_Optimizer
    from apex.fp16_utils.loss_scaler import DynamicLossScaler

    assert amp is fp16kit.legacy.amp and _amp_state is fp16kit.legacy.amp._amp_state
    assert (
        FP16_Optimizer is fp16kit.legacy.FP16_Optimizer and DynamicLossScaler.__module__ == "fp16kit.legacy.loss_scaler"
    )
    # what it has stays its own
    from apex.contrib import xentropy
    from apex.contrib.xentropy import SoftmaxCrossEntropyLoss
    from apex.optimizers import FusedAdam

    assert FusedAdam.REAL and SoftmaxCrossEntropyLoss.REAL and xentropy.__file__.startswith(str(new_apex))
    assert apex.optimizers.__file__ == str(new_apex / "optimizers" / "__init__.py")
    # below a real package, a covered module it lacks is fp16kit's (apex.contrib.optimizers here)
    from apex.contrib.optimizers import FP16_Optimizer as ContribFP16

    assert ContribFP16 is importlib.import_module("fp16kit.legacy.contrib.optimizers").FP16_Optimizer
    # neither has it: plain python's ModuleNotFoundError, naming the replacement
    with pytest.raises(ModuleNotFoundError, match=r"installed apex does not have it.*torch\.nn\.LSTM"):
        import apex.RNN  # noqa: F401
    # amp_C is the real apex's compiled extension, which its code probes: the alias leaves it alone
    assert importlib.util.find_spec("amp_C") is None

    optimizers = apex.optimizers
    uninstall_apex_alias()
    assert sys.modules["apex"] is apex and apex.REAL and apex.optimizers.FusedAdam is FusedAdam
    _assert_no_fp16kit_left_on(apex, optimizers)


def test_a_new_apex_keeps_its_own_availability_answers(new_apex):
    # complementing a real apex: nothing imported at install, its (absent) metadata is not replaced
    install_apex_alias()
    assert "apex" not in sys.modules
    assert importlib.util.find_spec("apex").origin == str(new_apex / "__init__.py")
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("apex")
    assert importlib.util.find_spec("apex.amp") is not None  # the part the alias fills in


def test_an_imported_new_apex_is_complemented_in_place(new_apex):
    import apex
    import apex.optimizers

    install_apex_alias()
    assert sys.modules["apex"] is apex
    assert apex.amp is fp16kit.legacy.amp and apex.fp16_utils is fp16kit.legacy.fp16_utils  # set on the package now
    assert apex.optimizers.fused_adam is importlib.import_module("fp16kit.legacy.optimizers.fused_adam")
    import apex.amp.frontend  # noqa: F401

    uninstall_apex_alias()
    assert sys.modules["apex"] is apex and apex.optimizers.FusedAdam.REAL
    _assert_no_fp16kit_left_on(apex, apex.optimizers)
    install_apex_alias()  # and again: the same result
    assert apex.amp is fp16kit.legacy.amp


def test_shadow_still_hides_all_of_a_new_apex(new_apex):
    install_apex_alias(shadow=True)
    import apex
    from apex.optimizers import FusedAdam

    assert not hasattr(apex, "REAL") and apex.amp is fp16kit.legacy.amp
    assert FusedAdam is importlib.import_module("fp16kit.legacy.optimizers").FusedAdam
    with pytest.raises(ImportError, match="cross_entropy"):
        from apex.contrib import xentropy  # noqa: F401


def test_an_apex_with_amp_but_no_fp16_utils_is_complemented_too(new_apex):
    (new_apex / "amp").mkdir()
    (new_apex / "amp" / "__init__.py").write_text("REAL = True\n")
    importlib.invalidate_caches()
    install_apex_alias()
    import apex
    import apex.amp

    assert apex.amp.REAL and apex.fp16_utils is fp16kit.legacy.fp16_utils


@pytest.mark.parametrize("has_amp", [False, True])
def test_torch_s_weights_only_list_gets_the_scaler_paths_the_alias_serves_not_the_real_apex_s(new_apex, has_amp):
    """torch.load's default reads a scaler path as fp16kit's class only where the alias gives that
    module: a real apex's own apex.amp.scaler stays off the list."""
    import torch

    if has_amp:
        (new_apex / "amp").mkdir()
        (new_apex / "amp" / "__init__.py").write_text("REAL = True\n")
        (new_apex / "amp" / "scaler.py").write_text("class LossScaler:\n    REAL = True\n")
        importlib.invalidate_caches()
    before = set(torch.serialization.get_safe_globals())
    install_apex_alias()
    paths = {e[1] for e in set(torch.serialization.get_safe_globals()) - before}
    era1 = {
        "apex.fp16_utils.loss_scaler.LossScaler",
        "apex.fp16_utils.loss_scaler.DynamicLossScaler",
        "fp16kit.legacy.loss_scaler.LossScaler",
        "fp16kit.legacy.loss_scaler.DynamicLossScaler",
    }
    era2 = {"apex.amp.scaler.LossScaler", "fp16kit.legacy.amp.scaler.LossScaler"}
    assert paths == (era1 if has_amp else era1 | era2)
    uninstall_apex_alias()
    assert set(torch.serialization.get_safe_globals()) == before


def test_a_new_apex_that_fails_to_import_says_how_to_hide_it(new_apex):
    (new_apex / "__init__.py").write_text("raise ImportError('undefined symbol: _ZN3c10')\n")
    install_apex_alias()
    with pytest.raises(ImportError, match="undefined symbol") as e:
        import apex  # noqa: F401
    assert any("shadow=True" in note and "--shadow" in note for note in getattr(e.value, "__notes__", []))


def test_a_real_amp_C_stays_with_a_new_apex(new_apex):
    (new_apex.parent / "amp_C.py").write_text("REAL = True\n")
    importlib.invalidate_caches()
    install_apex_alias()
    import amp_C

    assert amp_C.REAL


def test_a_plain_module_named_apex_is_refused_not_complemented(tmp_path, monkeypatch):
    # `import apex.amp` cannot work below a module that is not a package: hiding it is the way
    (tmp_path / "apex.py").write_text("REAL = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RuntimeError, match=r"not a package with apex\.amp.*shadow=True"):
        install_apex_alias()
    assert not apex_alias_installed()


def test_a_namespace_subfolder_of_a_new_apex(new_apex):
    # apex/contrib without __init__.py: finding it at install (apex not imported yet) raised KeyError
    (new_apex / "contrib" / "__init__.py").unlink()
    importlib.invalidate_caches()
    install_apex_alias()
    from apex.contrib.optimizers import FP16_Optimizer
    from apex.contrib.xentropy import SoftmaxCrossEntropyLoss

    assert SoftmaxCrossEntropyLoss.REAL
    assert FP16_Optimizer is importlib.import_module("fp16kit.legacy.contrib.optimizers").FP16_Optimizer
