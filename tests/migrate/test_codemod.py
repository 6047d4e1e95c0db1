"""fp16kit migrate's rewriter: every import form before -> after, byte-for-byte preservation
outside the rewritten names, idempotence, and what it reports instead of rewriting."""

from __future__ import annotations

import ast

import pytest

pytest.importorskip("libcst")

from fp16kit.migrate.codemod import MigrationError, migrate_source  # noqa: E402

# (before, after): every import form the issue lists; the expected text is written by hand
FORMS = {
    "import apex": ("import apex\n", "import fp16kit.legacy\n"),
    "import submodule": ("import apex.amp\n", "import fp16kit.legacy.amp\n"),
    "import as": ("import apex.amp as amp\n", "import fp16kit.legacy.amp as amp\n"),
    "import fp16_utils as": ("import apex.fp16_utils as fp16_utils\n", "import fp16kit.legacy as fp16_utils\n"),
    "import several": (
        "import os, apex.optimizers, apex.parallel as par\n",
        "import os, fp16kit.legacy.optimizers, fp16kit.legacy.parallel as par\n",
    ),
    "from apex import amp": ("from apex import amp\n", "from fp16kit.legacy import amp\n"),
    "from apex import two": ("from apex import amp, optimizers\n", "from fp16kit.legacy import amp, optimizers\n"),
    "from apex import fp16_utils": ("from apex import fp16_utils\n", "from fp16kit import legacy as fp16_utils\n"),
    "from apex import fp16_utils as": ("from apex import fp16_utils as fu\n", "from fp16kit import legacy as fu\n"),
    "from fp16_utils import X as Y": (
        "from apex.fp16_utils import FP16_Optimizer as Opt\n",
        "from fp16kit.legacy import FP16_Optimizer as Opt\n",
    ),
    "2018 names": (
        "from apex.fp16_utils import FP16_Module, fp32_to_fp16, fp16_to_fp32, Fused_Weight_Norm\n",
        "from fp16kit.legacy import FP16_Module, fp32_to_fp16, fp16_to_fp32, Fused_Weight_Norm\n",
    ),
    "from submodule import class": (
        "from apex.optimizers import FusedAdam\n",
        "from fp16kit.legacy.optimizers import FusedAdam\n",
    ),
    "from deep submodule": (
        "from apex.fp16_utils.loss_scaler import DynamicLossScaler\n",
        "from fp16kit.legacy.loss_scaler import DynamicLossScaler\n",
    ),
    "from package import submodule": (
        "from apex.fp16_utils import fp16util, FP16_Optimizer\n",
        "from fp16kit.legacy import fp16util, FP16_Optimizer\n",
    ),
    "from amp import scaler": ("from apex.amp import scaler\n", "from fp16kit.legacy.amp import scaler\n"),
    "contrib": (
        "from apex.contrib.optimizers import FP16_Optimizer, FusedAdam\n",
        "from fp16kit.legacy.contrib.optimizers import FP16_Optimizer, FusedAdam\n",
    ),
    "parallel LARC": ("from apex.parallel.LARC import LARC\n", "from fp16kit.legacy.parallel.LARC import LARC\n"),
    "normalization": (
        "from apex.normalization.fused_layer_norm import FusedLayerNorm as LN\n",
        "from fp16kit.legacy.normalization.fused_layer_norm import FusedLayerNorm as LN\n",
    ),
    "star": ("from apex.fp16_utils import *\n", "from fp16kit.legacy.fp16_utils import *\n"),
    "star submodule": ("from apex.parallel import *\n", "from fp16kit.legacy.parallel import *\n"),
    "parenthesised with comments": (
        "from apex.optimizers import (  # the fused ones\n"
        "    FusedAdam,  # BERT\n"
        "    # LAMB for large batches\n"
        "    FusedLAMB as Lamb,\n"
        ")\n",
        "from fp16kit.legacy.optimizers import (  # the fused ones\n"
        "    FusedAdam,  # BERT\n"
        "    # LAMB for large batches\n"
        "    FusedLAMB as Lamb,\n"
        ")\n",
    ),
    "try/except ImportError": (
        "try:\n    from apex import amp\nexcept ImportError:  # no apex\n    amp = None\n",
        "try:\n    from fp16kit.legacy import amp\nexcept ImportError:  # no apex\n    amp = None\n",
    ),
    "inside a function": (
        "def build(model):\n    from apex.parallel import DistributedDataParallel as DDP\n    return DDP(model)\n",
        "def build(model):\n    from fp16kit.legacy.parallel import DistributedDataParallel as DDP\n    return DDP(model)\n",
    ),
    "dotted uses after import apex": (
        "import apex\n"
        "model, opt = apex.amp.initialize(model, opt, opt_level='O2')\n"
        "model = apex.parallel.DistributedDataParallel(model, delay_allreduce=True)\n"
        "opt = apex.fp16_utils.FP16_Optimizer(opt)\n",
        "import fp16kit.legacy\n"
        "model, opt = fp16kit.legacy.amp.initialize(model, opt, opt_level='O2')\n"
        "model = fp16kit.legacy.parallel.DistributedDataParallel(model, delay_allreduce=True)\n"
        "opt = fp16kit.legacy.FP16_Optimizer(opt)\n",
    ),
    "dotted uses after import submodule": (
        "import apex.optimizers\nopt = apex.optimizers.FusedAdam(params)\nx = f(apex.optimizers).y\n",
        "import fp16kit.legacy.optimizers\nopt = fp16kit.legacy.optimizers.FusedAdam(params)\n"
        "x = f(fp16kit.legacy.optimizers).y\n",
    ),
    "mixed covered and not: one statement per target": (
        "from apex import amp, fp16_utils  # both\n",
        "from fp16kit.legacy import amp\nfrom fp16kit import legacy as fp16_utils  # both\n",
    ),
    "amp_C, apex's multi-tensor extension": (
        "import amp_C\nfrom amp_C import multi_tensor_l2norm as l2\nx = amp_C.multi_tensor_scale\n",
        "import fp16kit.legacy.multi_tensor_apply\nfrom fp16kit.legacy.multi_tensor_apply import multi_tensor_l2norm as l2\n"
        "x = fp16kit.legacy.multi_tensor_apply.multi_tensor_scale\n",
    ),
    "multi_tensor_applier": (
        "from apex.multi_tensor_apply import multi_tensor_applier\n",
        "from fp16kit.legacy.multi_tensor_apply import multi_tensor_applier\n",
    ),
    "relative imports are someone else's": ("from .apex import amp\nfrom . import apex\n", None),
    "other packages": ("import apexx\nfrom apex_utils import amp\nimport torch.amp\nx = apex.amp\n", None),
    "already migrated": ("from fp16kit.legacy import amp\nimport fp16kit.legacy.optimizers\n", None),
}


@pytest.mark.parametrize("name", sorted(FORMS))
def test_import_forms(name):
    before, after = FORMS[name]
    result = migrate_source(before)
    assert result.code == (before if after is None else after)
    assert result.changed == (after is not None)
    ast.parse(result.code)


@pytest.mark.parametrize("name", sorted(FORMS))
def test_idempotent(name):
    once = migrate_source(FORMS[name][0]).code
    twice = migrate_source(once)
    assert twice.code == once and not twice.changed


def test_counts():
    r = migrate_source(FORMS["dotted uses after import apex"][0])
    assert (r.imports_rewritten, r.uses_rewritten) == (1, 3)
    r = migrate_source("from apex import amp\nimport apex.optimizers as o, os\n")
    assert (r.imports_rewritten, r.uses_rewritten) == (2, 0)


def test_megatron_only_with_the_flag():
    src = (
        "from fp16 import FP16_Module, FP16_Optimizer\n"
        "from fp16.loss_scaler import DynamicLossScaler\n"
        "import fp16.fp16util as fu\n"
        "from megatron.fp16 import FP16_Optimizer as Opt\n"
        "from megatron import mpu, fp16\n"
        "from apex.optimizers import FusedAdam as Adam\n"
    )
    off = migrate_source(src)
    assert off.code == src.replace("from apex.optimizers", "from fp16kit.legacy.optimizers")
    assert off.unmigratable == []  # `fp16` is a common name: not apex's business without --megatron
    on = migrate_source(src, megatron=True)
    assert on.code == (
        "from fp16kit.legacy.megatron import FP16_Module, FP16_Optimizer\n"
        "from fp16kit.legacy.megatron.loss_scaler import DynamicLossScaler\n"
        "import fp16kit.legacy.megatron.fp16util as fu\n"
        "from fp16kit.legacy.megatron import FP16_Optimizer as Opt\n"
        "from megatron import mpu\n"
        "from fp16kit.legacy import megatron as fp16\n"
        "from fp16kit.legacy.optimizers import FusedAdam as Adam\n"
    )
    assert migrate_source(on.code, megatron=True).code == on.code
    # Megatron's other modules are not ours: no rewrite, no report
    assert migrate_source("from megatron import mpu\nimport megatron.model\n", megatron=True).unmigratable == []


def test_megatron_dotted_uses():
    src = "import fp16\nm = fp16.FP16_Module(net)\ns = fp16.loss_scaler.DynamicLossScaler()\nfp16 = 3\n"
    r = migrate_source(src, megatron=True)
    assert r.code == (
        "import fp16kit.legacy.megatron\nm = fp16kit.legacy.megatron.FP16_Module(net)\n"
        "s = fp16kit.legacy.megatron.loss_scaler.DynamicLossScaler()\nfp16 = 3\n"
    )
    assert [p.line for p in r.unmigratable] == [4]  # the bare name, now unbound


# ------------------------------------------------------------------ bytes outside the names stay
def test_crlf_bom_and_comments_preserved_byte_for_byte():
    before = (
        b"\xef\xbb\xbf# -*- coding: utf-8 -*-\r\n"
        b"import torch  # keep   this\r\n"
        b"from apex import amp   # two spaces\r\n"
        b"\r\n"
        b"\r\n"
        b"x = amp.initialize( model ,opt )\t# tab\r\n"
        b"from apex.optimizers import (FusedAdam,\r\n"
        b"                             FusedSGD)\r\n"
        b"s = '\xc3\xa9'\r\n"
    )
    expected = before.replace(b"from apex import amp", b"from fp16kit.legacy import amp").replace(
        b"from apex.optimizers import", b"from fp16kit.legacy.optimizers import"
    )
    result = migrate_source(before)
    assert isinstance(result.code, bytes)
    assert result.code == expected


def test_latin1_coding_declaration_and_mixed_newlines_kept():
    before = "# -*- coding: latin-1 -*-\nimport apex.amp as amp  # caf\xe9\r\nprint('\xe9')\n".encode("latin-1")
    result = migrate_source(before)
    assert result.encoding == "iso-8859-1"
    assert result.code == before.replace(b"import apex.amp", b"import fp16kit.legacy.amp")


def test_no_trailing_newline_and_backslash_continuation():
    before = "from apex.optimizers import FusedAdam, \\\n    FusedSGD as S"
    assert migrate_source(before).code == before.replace("apex.optimizers", "fp16kit.legacy.optimizers")


def test_split_statement_keeps_layout_and_comments():
    before = (
        "if True:\n"
        "    from apex.optimizers import (\n"
        "        FusedAdam,  # adam\n"
        "        FusedMixedPrecisionLamb,  # not covered\n"
        "        FusedLAMB  # lamb\n"
        "    )\n"
    )
    r = migrate_source(before)
    assert r.code == (
        "if True:\n"
        "    from fp16kit.legacy.optimizers import (\n"
        "        FusedAdam,  # adam\n"
        "        FusedLAMB  # lamb\n"
        "    )\n"
        "    from apex.optimizers import (\n"
        "        FusedMixedPrecisionLamb,  # not covered\n"
        "    )\n"
    )
    assert [(p.line, "FusedLAMB" in p.message) for p in r.unmigratable] == [(2, True)]
    assert migrate_source(r.code).code == r.code


def test_split_on_one_line_and_after_semicolons():
    assert migrate_source("from apex import RNN, amp  # c\n").code == (
        "from apex import RNN\nfrom fp16kit.legacy import amp  # c\n"
    )
    # a line that already held several statements keeps them on one line
    assert migrate_source("x = 1; from apex import amp, fp16_utils\n").code == (
        "x = 1; from fp16kit.legacy import amp; from fp16kit import legacy as fp16_utils\n"
    )


# ------------------------------------------------------------------ what is reported, not rewritten
def _report(src: str, **kw) -> list[tuple[int, str]]:
    return [(p.line, p.message) for p in migrate_source(src, **kw).unmigratable]


def test_uncovered_modules_reported_with_line_and_replacement():
    src = (
        "import torch\n"
        "from apex import RNN\n"
        "from apex.reparameterization import apply_weight_norm\n"
        "import apex.transformer\n"
        "from apex.contrib.xentropy import SoftmaxCrossEntropyLoss\n"
        "from apex.mlp import MLP\n"
        "from apex.fused_dense import FusedDense\n"
        "from apex.optimizers import FusedMixedPrecisionLamb\n"
        "import fused_layer_norm_cuda\n"
        "from apex.contrib import sparsity\n"
        "from apex import not_a_module\n"
    )
    r = migrate_source(src)
    assert r.code == src and not r.changed
    found = dict(_report(src))
    assert "torch.nn.LSTM" in found[2]
    assert "torch.nn.utils.parametrizations.weight_norm" in found[3]
    assert "megatron.core" in found[4].lower() or "Megatron-Core" in found[4]
    assert "cross_entropy" in found[5]
    assert "nn.Linear" in found[6] and "nn.Linear" in found[7]
    assert "FusedLAMB" in found[8] and "MixedPrecisionOptimizer" in found[8]
    assert "torch.nn.functional.layer_norm" in found[9]
    assert "torch.ao.pruning" in found[10]
    assert "not covered by fp16kit" in found[11] and "apex.optimizers" in found[11]
    assert sorted(found) == list(range(2, 12))


def test_star_from_apex_reported_with_imports_that_work():
    # the suggestion was `from fp16kit.legacy import ..., fp16_utils, ...`: an ImportError, since
    # apex.fp16_utils is fp16kit.legacy itself (the codemod writes `from fp16kit import legacy as fp16_utils`)
    import importlib

    from fp16kit.legacy.apex_alias import apex_map

    for module in ("apex", "apex.contrib"):
        [(line, message)] = _report(f"from {module} import *\n")
        prefix = f"from {module} import *: import what you use by name, e.g. "
        assert line == 1 and message.startswith(prefix)
        namespace: dict = {}
        exec(message[len(prefix) :], namespace)  # the suggested imports run, and bind what the star did
        children = {k.rpartition(".")[2]: v for k, v in apex_map.APEX_MODULES.items() if k.rpartition(".")[0] == module}
        assert {k: v for k, v in namespace.items() if k != "__builtins__"} == {
            name: importlib.import_module(target) for name, target in children.items()
        }
    assert _report("from apex import *\n")[0][1].endswith(
        "from fp16kit.legacy import amp, contrib, multi_tensor_apply, normalization, optimizers, parallel; "
        "from fp16kit import legacy as fp16_utils"
    )


def test_dynamic_imports_strings_and_bare_names_reported():
    src = (
        "import importlib\n"
        "import apex\n"
        "amp = importlib.import_module('apex.amp')\n"
        'm = __import__("apex")\n'
        "path = 'apex.fp16_utils.loss_scaler.DynamicLossScaler'\n"
        "rnn = apex.RNN.LSTM(3, 4)\n"
        "if apex is not None:\n"
        "    pass\n"
        "choice = 'apex'  # a plain word: not reported\n"
        "doc = 'we used apex for fp16'\n"
        "f(apex=True)\n"
        "obj.apex.amp = g(x).apex\n"
        "def apex_setup(apex=None):\n"
        "    pass\n"
    )
    lines = _report(src)
    # import_module('apex.amp') is rewritten (tests/migrate/test_probes.py); `m = __import__("apex")` is
    # not: it would bind `fp16kit`
    assert [line for line, _ in lines] == [4, 5, 6, 7]
    assert "dynamic import of 'apex'" in lines[0][1] and "importlib.import_module('fp16kit.legacy')" in lines[0][1]
    assert "fp16kit.legacy.loss_scaler.DynamicLossScaler" in lines[1][1]
    assert "torch.nn.LSTM" in lines[2][1]
    assert "used on its own" in lines[3][1]
    code = migrate_source(src).code
    assert "importlib.import_module('fp16kit.legacy.amp')" in code
    assert "'apex.fp16_utils.loss_scaler.DynamicLossScaler'" in code  # a plain string stays a string


def test_unknown_names_under_closed_packages_are_not_guessed():
    r = migrate_source("import apex\nx = apex.transformer.tensor_parallel\ny = apex.contrib.focal_loss.focal_loss\n")
    assert "apex.transformer.tensor_parallel" in r.code and "apex.contrib.focal_loss" in r.code
    assert [p.line for p in r.unmigratable] == [2, 3]


def test_python2_source_is_refused_with_its_line():
    with pytest.raises(MigrationError) as e:
        migrate_source("import apex\nprint 'hello'\n")
    assert e.value.line == 2 and "Python 2" in e.value.message


def test_names_the_fp16kit_module_lacks_are_rewritten_and_reported():
    src = "import apex\nfrom apex.parallel import DistributedDataParallel, NotAThing\nx = apex.amp.no_such_function\n"
    r = migrate_source(src)
    assert r.code == (
        "import fp16kit.legacy\nfrom fp16kit.legacy.parallel import DistributedDataParallel, NotAThing\n"
        "x = fp16kit.legacy.amp.no_such_function\n"
    )
    assert [(p.line, p.message.split(":")[0]) for p in r.unmigratable] == [
        (2, "apex.parallel.NotAThing"),
        (3, "apex.amp.no_such_function"),
    ]
    assert "fp16kit.legacy.parallel has no 'NotAThing'" in r.unmigratable[0].message


@pytest.mark.parametrize(
    "source, line, words",
    [
        (b"from apex import amp\nx = '\xff'\n", 2, "byte 0xff is not utf-8"),  # latin-1 bytes, no declaration
        (b"# coding: foobar\nfrom apex import amp\n", 1, "unknown encoding: foobar"),
        (b"\xef\xbb\xbf# coding: latin-1\nfrom apex import amp\n", 1, "encoding problem"),  # BOM says UTF-8
    ],
)
def test_undecodable_source_is_refused_with_its_line_not_a_crash(source, line, words):
    with pytest.raises(MigrationError) as e:
        migrate_source(source)
    assert e.value.line == line and words in e.value.message and "cannot decode" in e.value.message


@pytest.mark.parametrize(
    "source, line",
    [
        (b"import apex_C\rx = 1\r", 1),  # classic Mac line ends: libcst dropped the last CR
        (b"x = 1\n\x0cfrom apex import amp\n", 2),  # a form feed before a statement: dropped
        (b"from apex import amp\n# C:\\data\\\n", 2),  # a last-line comment ending in '\': its newline dropped
    ],
)
def test_source_libcst_would_not_reproduce_is_refused(source, line):
    with pytest.raises(MigrationError) as e:
        migrate_source(source)
    assert e.value.line == line and "byte for byte" in e.value.message


def test_form_feeds_and_backslash_comments_libcst_keeps_are_migrated():
    src = b"x = 1\n\x0c\nfrom apex import amp  # C:\\data\\\ny = 2\n"
    assert migrate_source(src).code == b"x = 1\n\x0c\nfrom fp16kit.legacy import amp  # C:\\data\\\ny = 2\n"


def test_only_the_differing_head_of_a_name_is_rewritten():
    # a backslash continuation or parentheses inside a rewritten name used to be dropped (the lines
    # after it moved up by one)
    src = (
        "import apex.\\\n    amp as amp, apex . optimizers\n"
        "from apex.\\\n    optimizers import FusedAdam\n"
        "import apex\n"
        "opt = apex.parallel.\\\n    DistributedDataParallel\n"
        "init = (apex).amp.initialize\n"
        "F = (apex.fp16_utils).FP16_Optimizer\n"
    )
    expected = (
        "import fp16kit.legacy.\\\n    amp as amp, fp16kit.legacy . optimizers\n"
        "from fp16kit.legacy.\\\n    optimizers import FusedAdam\n"
        "import fp16kit.legacy\n"
        "opt = fp16kit.legacy.parallel.\\\n    DistributedDataParallel\n"
        "init = (fp16kit.legacy).amp.initialize\n"
        "F = (fp16kit.legacy).FP16_Optimizer\n"
    )
    r = migrate_source(src)
    assert r.code == expected and not r.unmigratable
    assert migrate_source(r.code).changed is False


def test_megatron_uses_left_unbound_by_a_rewritten_import_are_reported():
    # `import megatron.fp16` bound `megatron`; `import fp16kit.legacy.megatron` does not, so the
    # untouched `megatron.mpu...` below became a NameError at run time, silently
    src = "import megatron.fp16\nx = megatron.fp16.FP16_Module\nrank = megatron.mpu.get_rank()\n"
    r = migrate_source(src, megatron=True)
    assert (
        r.code
        == "import fp16kit.legacy.megatron\nx = fp16kit.legacy.megatron.FP16_Module\nrank = megatron.mpu.get_rank()\n"
    )
    assert [p.line for p in r.unmigratable] == [3] and "add `import megatron.mpu`" in r.unmigratable[0].message
    # another import still binds `megatron`: nothing to report
    r = migrate_source("import megatron.fp16\nimport megatron.mpu\nrank = megatron.mpu.get_rank()\n", megatron=True)
    assert r.unmigratable == []
