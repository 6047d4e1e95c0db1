"""fp16kit migrate on the availability checks apex-era code wrote without an import statement:
each guard below is copied from a public training codebase (shortened), rewritten to the name the
import rewrite gives it, and -- the point -- still answers "apex is here" when the migrated code
runs under plain python, where the unmigrated guard says "no apex" (or stops the script)."""

from __future__ import annotations

import importlib
import pkgutil
import sys
import types

import pytest

pytest.importorskip("libcst")

from fp16kit.migrate.codemod import migrate_source  # noqa: E402

# NVIDIA DeepLearningExamples, Transformer-XL train.py (2019-2020): the guard that stops a migrated
# run at once ("APEX AMP unavailable"), and the einsum registration that silently stops happening
TRANSFORMER_XL = """\
import sys
import warnings
import torch
try:
    from apex import amp
except ModuleNotFoundError:
    warnings.warn('APEX AMP is unavailable')


def parse_args(args):
    if args.fp16 and args.amp == 'apex' and 'apex' not in sys.modules:
        raise RuntimeError(
            'APEX AMP unavailable, install APEX or switch to pytorch AMP'
        )
    return args


def register():
    if 'apex' in sys.modules:
        amp.register_half_function(torch, 'einsum')
        return True
    return False
"""

# the guards of other codebases, as their authors wrote them
GUARDS = {
    "config switch (use_amp = 'apex' in sys.modules and ...)": (
        "import sys\ntry:\n    from apex import amp\nexcept ImportError:\n    pass\n"
        "use_amp = ('apex' in sys.modules) and amp_options['use_amp']\n",
        "import sys\ntry:\n    from fp16kit.legacy import amp\nexcept ImportError:\n    pass\n"
        "use_amp = ('fp16kit.legacy' in sys.modules) and amp_options['use_amp']\n",
    ),
    "transformers' old is_apex_available()": (
        'import importlib.util\n\n\ndef is_apex_available():\n    return importlib.util.find_spec("apex") is not None\n',
        "import importlib.util\n\n\ndef is_apex_available():\n"
        '    return importlib.util.find_spec("fp16kit.legacy") is not None\n',
    ),
    "Lightning utilities' APEX_AVAILABLE": (
        'import importlib.util\nAPEX_AVAILABLE = importlib.util.find_spec("apex") is not None\n',
        'import importlib.util\nAPEX_AVAILABLE = importlib.util.find_spec("fp16kit.legacy") is not None\n',
    ),
    "a test suite's apex.amp probe": (
        'import importlib\napex_spec = importlib.util.find_spec("apex")\nif apex_spec is not None:\n'
        '    amp_spec = importlib.util.find_spec("apex.amp")\nelse:\n    amp_spec = None\namp_found = amp_spec is not None\n',
        'import importlib\napex_spec = importlib.util.find_spec("fp16kit.legacy")\nif apex_spec is not None:\n'
        '    amp_spec = importlib.util.find_spec("fp16kit.legacy.amp")\nelse:\n    amp_spec = None\n'
        "amp_found = amp_spec is not None\n",
    ),
    "DeepSpeed's required_amp_check()": (
        "def required_amp_check():\n    from importlib.util import find_spec\n    if find_spec('apex') is None:\n"
        "        return False\n    else:\n        return True\n",
        "def required_amp_check():\n    from importlib.util import find_spec\n    if find_spec('fp16kit.legacy') is None:\n"
        "        return False\n    else:\n        return True\n",
    ),
    "find_spec, then import_module": (
        "import importlib\napex = importlib.util.find_spec('apex')\nif apex is not None:\n"
        "    apex = importlib.import_module('apex')\n",
        "import importlib\napex = importlib.util.find_spec('fp16kit.legacy')\nif apex is not None:\n"
        "    apex = importlib.import_module('fp16kit.legacy')\n",
    ),
    "pkgutil.find_loader": (
        "import pkgutil\nHAS_APEX = pkgutil.find_loader('apex') is not None\n",
        "import pkgutil\nHAS_APEX = pkgutil.find_loader('fp16kit.legacy') is not None\n",
    ),
    "__import__ as a statement": (
        "try:\n    __import__('apex.amp')\n    HAS_AMP = True\nexcept ImportError:\n    HAS_AMP = False\n",
        "try:\n    __import__('fp16kit.legacy.amp')\n    HAS_AMP = True\nexcept ImportError:\n    HAS_AMP = False\n",
    ),
    "__import__ with a fromlist returns the module": (
        "amp = __import__('apex.amp', fromlist=['initialize'])\n",
        "amp = __import__('fp16kit.legacy.amp', fromlist=['initialize'])\n",
    ),
    "hasattr(apex, ...) after import apex": (
        "try:\n    import apex\n    from apex.multi_tensor_apply import multi_tensor_applier\n"
        '    APEX_AVAILABLE = hasattr(apex, "multi_tensor_apply")\n'
        '    APEX_FUSED_AVAILABLE = hasattr(apex, "normalization")\n'
        "    FP16_UTILS = getattr(apex, 'fp16_utils', None)\nexcept ImportError:\n    APEX_AVAILABLE = False\n",
        "try:\n    import fp16kit.legacy\n    from fp16kit.legacy.multi_tensor_apply import multi_tensor_applier\n"
        '    APEX_AVAILABLE = hasattr(fp16kit.legacy, "multi_tensor_apply")\n'
        '    APEX_FUSED_AVAILABLE = hasattr(fp16kit.legacy, "normalization")\n'
        "    FP16_UTILS = getattr(fp16kit, 'legacy', None)\nexcept ImportError:\n    APEX_AVAILABLE = False\n",
    ),
    "sys.modules.get and sys.modules[...]": (
        "import sys\namp = sys.modules.get(\"apex.amp\")\nroot = sys.modules['apex'] if 'apex' in sys.modules.keys() else None\n",
        'import sys\namp = sys.modules.get("fp16kit.legacy.amp")\n'
        "root = sys.modules['fp16kit.legacy'] if 'fp16kit.legacy' in sys.modules.keys() else None\n",
    ),
    "NeMo's EMA callback: amp_C": (
        "import importlib\ntry:\n    import amp_C\n    apex_available = True\nexcept Exception:\n    apex_available = False\n"
        "fused = importlib.util.find_spec('amp_C') is not None\n",
        "import importlib\ntry:\n    import fp16kit.legacy.multi_tensor_apply\n    apex_available = True\nexcept Exception:\n"
        "    apex_available = False\nfused = importlib.util.find_spec('fp16kit.legacy.multi_tensor_apply') is not None\n",
    ),
}

# what must stay exactly as it is: option values, substring tests, a script stubbing apex out
UNTOUCHED = (
    "import sys, types\n"
    "parser.add_argument('--amp', choices=['apex', 'pytorch'], default='apex')\n"
    "if args.amp == 'apex':\n    pass\n"
    "for key in list(sys.modules.keys()):\n    if 'apex' in key:\n        del sys.modules[key]\n"
    "if 'apex' not in sys.modules:\n    sys.modules['apex'] = types.ModuleType('apex')\n"
    "del sys.modules['apex']\n"
)


def _run(src: str, **names) -> dict:
    namespace: dict = {"__name__": "guarded", **names}
    exec(compile(src, "<guarded>", "exec"), namespace)
    return namespace


@pytest.fixture
def no_apex():
    """Plain python without apex (no alias, nothing named apex imported)."""
    assert "apex" not in sys.modules and importlib.util.find_spec("apex") is None


def test_transformer_xl_guard_stops_unmigrated_and_passes_migrated(no_apex, monkeypatch):
    import fp16kit.legacy.amp as amp

    registered: list[str] = []  # not amp's own registry: an O1 einsum there would reach other tests
    monkeypatch.setattr(amp, "register_half_function", lambda module, name: registered.append(name))
    args = types.SimpleNamespace(fp16=True, amp="apex")
    with pytest.warns(UserWarning, match="APEX AMP is unavailable"):
        before = _run(TRANSFORMER_XL)
    with pytest.raises(RuntimeError, match="APEX AMP unavailable"):  # what the issue saw after migrate
        before["parse_args"](args)
    assert before["register"]() is False

    r = migrate_source(TRANSFORMER_XL)
    assert r.code == TRANSFORMER_XL.replace("from apex import amp", "from fp16kit.legacy import amp").replace(
        "'apex' not in sys.modules", "'fp16kit.legacy' not in sys.modules"
    ).replace("if 'apex' in sys.modules", "if 'fp16kit.legacy' in sys.modules")
    assert "args.amp == 'apex'" in r.code and r.unmigratable == []
    assert (r.imports_rewritten, r.checks_rewritten) == (1, 2)
    after = _run(r.code)
    assert after["parse_args"](args) is args
    assert after["register"]() is True and registered == ["einsum"]
    assert migrate_source(r.code).changed is False


@pytest.mark.parametrize("name", sorted(GUARDS))
def test_guards_are_rewritten(name):
    before, after = GUARDS[name]
    r = migrate_source(before)
    assert r.code == after, r.code
    assert r.unmigratable == [] and r.checks_rewritten >= 1
    assert migrate_source(r.code).code == r.code  # idempotent


def test_rewritten_guards_find_fp16kit_under_plain_python(no_apex):
    # each guard said "no apex" unmigrated; migrated, each says "here" (the one a real apex gave)
    cases = {
        "transformers' old is_apex_available()": lambda ns: ns["is_apex_available"](),
        "Lightning utilities' APEX_AVAILABLE": lambda ns: ns["APEX_AVAILABLE"],
        "a test suite's apex.amp probe": lambda ns: ns["amp_found"],
        "DeepSpeed's required_amp_check()": lambda ns: ns["required_amp_check"](),
        "find_spec, then import_module": lambda ns: ns["apex"] is importlib.import_module("fp16kit.legacy"),
        "__import__ as a statement": lambda ns: ns["HAS_AMP"],
        "__import__ with a fromlist returns the module": lambda ns: (
            ns["amp"] is importlib.import_module("fp16kit.legacy.amp")
        ),
        "hasattr(apex, ...) after import apex": lambda ns: (
            ns["APEX_AVAILABLE"]
            and ns["APEX_FUSED_AVAILABLE"]
            and ns["FP16_UTILS"] is importlib.import_module("fp16kit.legacy")
        ),
        "NeMo's EMA callback: amp_C": lambda ns: ns["apex_available"] and ns["fused"],
        "config switch (use_amp = 'apex' in sys.modules and ...)": lambda ns: ns["use_amp"],
        "sys.modules.get and sys.modules[...]": lambda ns: ns["amp"] is not None and ns["root"] is not None,
    }
    if hasattr(pkgutil, "find_loader"):  # gone in python 3.14
        cases["pkgutil.find_loader"] = lambda ns: ns["HAS_APEX"]
    for name, answer in cases.items():
        before = GUARDS[name][0]
        after = migrate_source(before).code
        try:
            unmigrated = answer(_run(before, amp_options={"use_amp": True}))
        except ModuleNotFoundError:  # find_spec('apex.amp') or `import apex` without apex
            unmigrated = False
        assert not unmigrated, name
        assert answer(_run(after, amp_options={"use_amp": True})), name


def test_what_is_not_a_check_stays():
    r = migrate_source(UNTOUCHED)
    assert r.code == UNTOUCHED and r.unmigratable == [] and r.checks_rewritten == 0


def _report(src: str, **kw) -> list[tuple[int, str]]:
    return [(p.line, p.message) for p in migrate_source(src, **kw).unmigratable]


@pytest.mark.parametrize(
    "src, words",
    [
        # apex's distribution metadata: nothing migrated provides it
        (
            'import importlib.metadata\nv = importlib.metadata.version("apex")\n',
            ["importlib.metadata.version('apex')", "find_spec('fp16kit.legacy')", "0.1"],
        ),
        ("from importlib.metadata import version\nif version('apex') >= '0.1':\n    pass\n", ["version('apex')"]),
        (
            'import pkg_resources\nv = str(pkg_resources.get_distribution("apex").version)\n',
            ["pkg_resources.get_distribution('apex')", "no migrated install has an 'apex' distribution"],
        ),
        (
            "from lightning_utilities.core.imports import RequirementCache\nHAVE_APEX = RequirementCache('apex>=0.1')\n",
            ["RequirementCache('apex>=0.1')"],
        ),
        # a library's own probe for a real apex
        (
            "import torch\nfrom transformers.file_utils import is_apex_available\n",
            ["transformers.file_utils.is_apex_available", "False after migrate", "fp16kit run"],
        ),
        (
            "import transformers\nok = transformers.utils.is_apex_available()\n",
            ["transformers.utils.is_apex_available"],
        ),
        (
            "import torch\nfrom pytorch_lightning.utilities import APEX_AVAILABLE\n",
            ["pytorch_lightning.utilities.APEX_AVAILABLE"],
        ),
        # names built at run time, and names fp16kit does not have
        ("import importlib\nm = importlib.import_module('apex.' + name)\n", ["built at run time", "'apex.'"]),
        ('import importlib\nm = importlib.import_module(f"apex.contrib.{name}")\n', ["'apex.contrib.'"]),
        ("import importlib\nm = importlib.import_module('apex.%s' % name)\n", ["built at run time"]),
        (
            "from importlib.util import find_spec\nok = find_spec('apex.contrib.xentropy') is not None\n",
            ["availability check (find_spec) of 'apex.contrib.xentropy'", "cross_entropy"],
        ),
        ("import sys\nok = 'fused_layer_norm_cuda' in sys.modules\n", ["torch.nn.functional.layer_norm"]),
        ("import torch\nm = __import__('apex')\n", ["top-level package", "importlib.import_module('fp16kit.legacy')"]),
        ("import apex\nok = hasattr(apex, 'RNN')\n", ["hasattr(apex, 'RNN')", "torch.nn.LSTM", "as False"]),
    ],
)
def test_what_cannot_be_rewritten_is_reported_with_the_fix(src, words):
    r = migrate_source(src)
    assert [p.line for p in r.unmigratable] == [2]  # FILE:LINE in the command's report
    for word in words:
        assert word in r.unmigratable[0].message, r.unmigratable[0].message


def test_getattr_without_default_checks_the_name_exists():
    r = migrate_source(
        "import amp_C\nl2 = getattr(amp_C, 'multi_tensor_l2norm')\nmp = getattr(amp_C, 'multi_tensor_l2norm_mp')\n"
        "ok = hasattr(amp_C, 'multi_tensor_l2norm_mp')\n"
    )
    assert r.code == (
        "import fp16kit.legacy.multi_tensor_apply\n"
        "l2 = getattr(fp16kit.legacy.multi_tensor_apply, 'multi_tensor_l2norm')\n"
        "mp = getattr(fp16kit.legacy.multi_tensor_apply, 'multi_tensor_l2norm_mp')\n"
        "ok = hasattr(fp16kit.legacy.multi_tensor_apply, 'multi_tensor_l2norm_mp')\n"
    )
    # getattr without a default raises where fp16kit lacks the op: reported; hasattr just answers False
    assert [p.line for p in r.unmigratable] == [3] and "has no 'multi_tensor_l2norm_mp'" in r.unmigratable[0].message
    ns = _run(r.code.replace("mp = getattr", "# mp = getattr"))  # that line raises AttributeError, as reported
    assert callable(ns["l2"]) and ns["ok"] is False


def test_a_failing_import_inside_an_import_error_fallback_says_the_fallback_runs():
    # fairseq's get_fused_adam_class() and a codebase's optional fused RMSNorm: after migrate the
    # uncovered line still raises ImportError, so the whole try falls back
    src = (
        "try:\n"
        "    from apex import amp\n"
        "    from apex.contrib.xentropy import SoftmaxCrossEntropyLoss\n"
        "    import importlib\n"
        "    fused_adam_cuda = importlib.import_module('fused_adam_cuda')\n"
        "    APEX_AVAILABLE = True\n"
        "except (ImportError, AttributeError):\n"
        "    APEX_AVAILABLE = False\n"
        "try:\n"
        "    import fused_layer_norm_cuda\n"
        "except ValueError:\n"  # not an import fallback: no note
        "    pass\n"
    )
    found = dict(_report(src))
    assert sorted(found) == [3, 5, 10]
    for line in (3, 5):
        assert "inside the `try` of the `except` on line 7: after migrate that fallback runs" in found[line]
    assert "cross_entropy" in found[3] and "fp16kit.legacy.optimizers.FusedAdam" in found[5]
    assert "inside the `try`" not in found[10]


@pytest.mark.parametrize(
    "ext, fix",
    [
        ("fused_lamb_cuda", "fp16kit.legacy.optimizers.FusedLAMB"),
        ("xentropy_cuda", "cross_entropy"),
        ("fused_weight_gradient_mlp_cuda", "--no-gradient-accumulation-fusion"),
        ("fast_multihead_attn", "torch.nn.MultiheadAttention"),
        ("fused_dense_cuda", "torch.nn.functional.linear"),
        ("mlp_cuda", "torch.nn.Linear"),
    ],
)
def test_apex_extension_modules_are_reported(ext, fix):
    # imports of apex's compiled extensions: Megatron-LM, fairseq, NeMo and apex's own modules did these
    src = f"import torch\nimport {ext}\nfrom {ext} import forward\nm = importlib.import_module({ext!r})\n"
    found = _report(src)
    assert [line for line, _ in found] == [2, 3, 4]
    assert all(f"{ext} (apex's CUDA extension) is not in fp16kit" in m and fix in m for _, m in found)


def test_amp_C_and_apex_C_migrate_and_run_under_plain_python(no_apex):
    # Megatron-LM's clip_grads / NVIDIA BERT's run_pretraining: the multi-tensor ops through amp_C,
    # the flat all-reduce buffer through apex_C
    src = (
        "import torch\n"
        "from apex.multi_tensor_apply import multi_tensor_applier\n"
        "import amp_C\n"
        "import apex_C\n"
        "from amp_C import multi_tensor_scale\n"
        "grads = [torch.full((3,), 3.0), torch.full((4,), 4.0)]\n"
        "overflow_buf = torch.zeros(1, dtype=torch.int)\n"
        "norm, _ = multi_tensor_applier(amp_C.multi_tensor_l2norm, overflow_buf, [grads], False)\n"
        "flat = apex_C.flatten(grads)\n"
        "back = apex_C.unflatten(flat, grads)\n"
    )
    with pytest.raises(ModuleNotFoundError):
        _run(src)
    r = migrate_source(src)
    assert "import amp_C" not in r.code and "import apex_C" not in r.code and r.unmigratable == []
    ns = _run(r.code)
    assert float(ns["norm"]) == pytest.approx((9 * 3 + 16 * 4) ** 0.5)
    assert ns["flat"].numel() == 7 and [t.shape for t in ns["back"]] == [(3,), (4,)]


def test_megatron_fp16_checks_only_with_the_flag():
    src = "import sys\nHAVE = 'fp16' in sys.modules\n"
    assert migrate_source(src).changed is False
    assert migrate_source(src, megatron=True).code == "import sys\nHAVE = 'fp16kit.legacy.megatron' in sys.modules\n"


# `apex` in a hasattr/getattr that is not the module `import apex` binds: the shapes a plugin
# registry, a vendor-object wrapper and a config class give it
NOT_APEX_HERE = {
    "a parameter": 'import apex\n\n\ndef check(apex):\n    return hasattr(apex, "amp")\n\n\nok = check(plugin)\n',
    "a function's loop variable": (
        'import apex\n\n\ndef scan(plugins):\n    for apex in plugins:\n        if hasattr(apex, "parallel"):\n'
        "            return True\n    return False\n\n\nok = scan([plugin])\n"
    ),
    "a method's local": (
        "import apex\n\n\nclass C:\n    def __init__(self, vendor):\n        self.vendor = vendor\n\n"
        '    def f(self):\n        apex = self.vendor\n        return getattr(apex, "amp", None) is not None\n\n\n'
        "ok = C(plugin).f()\n"
    ),
    "a class attribute": (
        'import apex\n\n\nclass C:\n    apex = plugin\n    ok = hasattr(apex, "amp")\n\n\nok = C.ok\n'
    ),
}


@pytest.mark.parametrize("name", sorted(NOT_APEX_HERE))
def test_hasattr_of_another_value_named_apex_stays(name):
    src = NOT_APEX_HERE[name]
    r = migrate_source(src)
    assert r.code == src.replace("import apex\n", "import fp16kit.legacy\n", 1), r.code
    assert r.checks_rewritten == 0
    assert not any("hasattr" in p.message or "getattr" in p.message for p in r.unmigratable), r.unmigratable
    # it still asks the plugin, not fp16kit (which has all three names): False, as before migrate
    assert _run(r.code, plugin=types.SimpleNamespace())["ok"] is False


def test_hasattr_of_apex_in_a_scope_of_its_own_import_is_rewritten():
    # the import in the function (apex's own fused-kernel probes did this): the name is the module
    src = (
        'def fused_available():\n    import apex.normalization\n    return hasattr(apex, "normalization")\n\n\n'
        'def has_parallel():\n    import apex\n    return getattr(apex, "parallel", None) is not None\n'
    )
    r = migrate_source(src)
    assert r.code == src.replace("import apex", "import fp16kit.legacy").replace("(apex,", "(fp16kit.legacy,")
    assert r.unmigratable == [] and r.checks_rewritten == 2
    ns = _run(r.code)
    assert ns["fused_available"]() and ns["has_parallel"]()


@pytest.mark.parametrize(
    "src, line, binds",
    [
        # the import-or-None fallback: `apex` is the module or None, which hasattr answers differently
        ('try:\n    import apex\nexcept ImportError:\n    apex = None\nHAS_AMP = hasattr(apex, "amp")\n', 5, "line 4"),
        # a module-level loop rebinds the global apex (libcst, like python, sees both in one scope)
        ('import apex\nfor apex in plugins:\n    if hasattr(apex, "parallel"):\n        pass\n', 3, "line 2"),
    ],
)
def test_hasattr_of_a_name_that_may_be_apex_is_reported_not_rewritten(src, line, binds):
    r = migrate_source(src)
    assert "hasattr(apex," in r.code and r.checks_rewritten == 0
    found = [p for p in r.unmigratable if "hasattr" in p.message]
    assert [p.line for p in found] == [line], r.unmigratable
    assert binds in found[0].message and "`import apex` on line" in found[0].message
    assert "hasattr(fp16kit.legacy, " in found[0].message  # the rewrite to make where it is apex


@pytest.mark.parametrize(
    "src",
    [
        # a data library's get_loader, a local find_spec, a parameter named import_module
        'from mydata import get_loader\ntrain = get_loader("apex", batch_size=4)\n',
        'def find_spec(name):\n    return name\n\n\nprint(find_spec("apex"))\n',
        "from importlib.util import find_spec\n\n\ndef load(import_module, find_spec):\n"
        "    return import_module(\"apex\"), find_spec('apex')\n",
        'from mydata import get_loader\nx = get_loader("apex." + split)\n',
    ],
)
def test_a_users_function_named_like_a_probe_stays(src):
    r = migrate_source(src)
    assert r.code == src and r.unmigratable == [] and r.checks_rewritten == 0


@pytest.mark.parametrize(
    "src, after",
    [
        (
            'from importlib.util import find_spec as fs\nok = fs("apex.amp") is not None\n',
            'from importlib.util import find_spec as fs\nok = fs("fp16kit.legacy.amp") is not None\n',
        ),
        (
            "from importlib import import_module as load\nm = load('apex')\n",
            "from importlib import import_module as load\nm = load('fp16kit.legacy')\n",
        ),
        (
            "from lightning_utilities.core.imports import module_available\nHAVE = module_available('apex')\n",
            "from lightning_utilities.core.imports import module_available\nHAVE = module_available('fp16kit.legacy')\n",
        ),
        (
            "from importlib.util import *\nHAVE = find_spec('apex') is not None\n",
            "from importlib.util import *\nHAVE = find_spec('fp16kit.legacy') is not None\n",
        ),
    ],
)
def test_probes_imported_under_an_alias_are_rewritten(src, after):
    r = migrate_source(src)
    assert r.code == after and r.unmigratable == [] and r.checks_rewritten == 1


def test_a_probe_name_that_may_be_the_users_function_is_reported():
    src = (
        "from importlib.util import find_spec\n\nif cond:\n    def find_spec(name):\n        return None\n"
        "HAVE = find_spec('apex') is not None\n"
    )
    r = migrate_source(src)
    assert r.code == src
    assert [p.line for p in r.unmigratable] == [6]
    message = r.unmigratable[0].message
    assert "find_spec imported on line 1" in message and "line 4" in message and "'fp16kit.legacy'" in message


def test_an_uncovered_hasattr_and_its_use_on_one_line_are_one_report():
    r = migrate_source('import apex\nif hasattr(apex, "__version__"): print(apex.__version__)\n')
    assert [p.line for p in r.unmigratable] == [2], r.unmigratable
    assert "apex.__version__ is not covered" in r.unmigratable[0].message
    # on lines of their own each line is reported; another uncovered name on the line still is
    assert [
        p.line
        for p in migrate_source(
            'import apex\nif hasattr(apex, "__version__"):\n    print(apex.__version__)\n'
        ).unmigratable
    ] == [2, 3]
    assert len(migrate_source("import apex\nif hasattr(apex, 'RNN'): v = apex.__version__\n").unmigratable) == 2
