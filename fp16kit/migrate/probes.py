"""``fp16kit migrate``'s second concern: the checks apex-era code makes for apex without an
``import`` statement (availability probes, dynamic imports), which the import rewrite alone leaves
spelling ``apex`` -- after it, ``'apex' in sys.modules`` is False and amp silently turns off.

Rules (``NAME`` is a module-name string literal; ``T`` is what the import rewrite maps it to)::

    rewritten (NAME is a covered module: 'apex', 'apex.amp', 'amp_C', ... -> 'fp16kit.legacy', ...):
        NAME in sys.modules / not in sys.modules[.keys()] / sys.modules.get(NAME) / sys.modules[NAME]
        importlib.util.find_spec(NAME), pkgutil.find_loader / get_loader, importlib.find_loader,
        lightning's (_)module_available / (_)package_available, importlib.import_module(NAME)
        __import__(NAME) when its value is unused or it has a fromlist (else it returns `fp16kit`)
        hasattr(apex, "x") / getattr(apex, "x"[, d]) after `import apex`  -> hasattr(parent(T), last(T))
    reported with the fix (FILE:LINE, as migrate reports what it cannot migrate):
        NAME not covered (apex.contrib.xentropy, fused_layer_norm_cuda, ...): the replacement
        a module name built at run time ("apex." + x, f"apex.{x}", "apex.%s" % x, "apex.{}".format(x))
        importlib.metadata.version / distribution, pkg_resources.get_distribution / require,
        RequirementCache("apex..."): no migrated install has an `apex` distribution
        is_apex_available / APEX_AVAILABLE imported from a library (transformers, Lightning): its own
        probe for a real apex, False after migrate
    a module that assigns or deletes sys.modules[NAME] (a script stubbing apex out, a test faking it):
        its checks of that NAME are about its own stub, and stay as they are

A reported import, or dynamic import, inside the ``try`` of an ``except ImportError`` also says so
(:func:`fallback_handler`): after migrate that fallback runs and turns off what the ``try`` enabled.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import libcst as cst

from .apex_map import Resolution, is_handled

__all__ = ["Probes", "dotted_name", "fallback_handler"]

# spellings of the functions that take a module name first (`from importlib.util import find_spec`: the bare name)
_IMPORTS = frozenset({"importlib.import_module", "import_module", "__import__", "importlib.__import__",
                      "builtins.__import__"})
_CHECKS = frozenset({
    "importlib.util.find_spec", "util.find_spec", "find_spec", "importlib.find_loader", "pkgutil.find_loader",
    "find_loader", "pkgutil.get_loader", "get_loader", "sys.modules.get",
    # Lightning's helpers (pytorch_lightning.utilities.imports, lightning_utilities.core.imports): find_spec inside
    "_module_available", "module_available", "_package_available", "package_available",
})
# functions that read a distribution's metadata, by their last name
_METADATA = frozenset({"version", "distribution", "metadata", "files", "requires", "get_distribution", "require",
                       "RequirementCache"})
_APEX_DISTRIBUTION = re.compile(r"\s*apex\s*(\[[^]]*\])?\s*([<>=!~;].*)?", re.I)
# libraries whose own apex probe user code imported (transformers' is_apex_available, Lightning's APEX_AVAILABLE)
_PROBING_LIBRARIES = frozenset({"transformers", "pytorch_lightning", "lightning", "lightning_fabric"})
_LIBRARY_FLAG = re.compile(r"_?(is_)?apex_available", re.I)
_IMPORT_ERRORS = frozenset({"ImportError", "ModuleNotFoundError", "Exception", "BaseException"})

_NO_DISTRIBUTION = (
    "no migrated install has an 'apex' distribution: test `importlib.util.find_spec('fp16kit.legacy') is not None` "
    "instead (fp16kit.legacy has apex's API, whatever apex version the check wanted), or drop the check; under "
    "`fp16kit run` the alias reports apex 0.1, the version of every NVIDIA apex build"
)


def dotted_name(node: cst.CSTNode) -> str | None:
    """``a.b.c`` for a pure Name/Attribute chain, else None."""
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        head = dotted_name(node.value)
        return None if head is None else f"{head}.{node.attr.value}"
    return None


def _is_sys_modules(node: cst.BaseExpression) -> bool:
    """``sys.modules`` or ``sys.modules.keys()``."""
    if isinstance(node, cst.Call) and not node.args and dotted_name(node.func) == "sys.modules.keys":
        return True
    return dotted_name(node) == "sys.modules"


def _static_prefix(node: cst.BaseExpression) -> str | None:
    """The literal text a run-time string starts with ("apex." + x, f"apex.{x}", "apex.%s" % x,
    "apex.{}".format(x)); None for a literal (handled as one) or anything else."""
    if isinstance(node, cst.FormattedString) and node.parts and isinstance(node.parts[0], cst.FormattedStringText):
        return node.parts[0].value
    if isinstance(node, cst.BinaryOperation):
        left = node.left
        if isinstance(node.operator, cst.Add):
            return left.evaluated_value if isinstance(left, cst.SimpleString) and isinstance(
                left.evaluated_value, str) else _static_prefix(left)
        if isinstance(node.operator, cst.Modulo) and isinstance(left, cst.SimpleString):
            value = left.evaluated_value
            return value.partition("%")[0] if isinstance(value, str) else None
    if isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) and node.func.attr.value == "format" \
            and isinstance(node.func.value, cst.SimpleString):
        value = node.func.value.evaluated_value
        return value.partition("{")[0] if isinstance(value, str) else None
    return None


def _has_fromlist(call: cst.Call) -> bool:
    """``__import__(name, g, l, fromlist)`` / ``fromlist=`` given and not an empty literal: it returns
    the named module, not its top-level package."""
    fromlist = next((a.value for a in call.args if a.keyword is not None and a.keyword.value == "fromlist"), None)
    positional = [a for a in call.args if a.keyword is None and not a.star]
    if fromlist is None and len(positional) >= 4:
        fromlist = positional[3].value
    if fromlist is None:
        return False
    return not (isinstance(fromlist, (cst.List, cst.Tuple)) and not fromlist.elements) and not (
        isinstance(fromlist, cst.Name) and fromlist.value == "None")


def fallback_handler(node: cst.CSTNode, parents: Callable[[cst.CSTNode], cst.CSTNode | None]) -> cst.ExceptHandler | None:
    """The ``except ImportError`` (or ModuleNotFoundError, Exception, bare) whose ``try`` body holds
    ``node``, innermost first; None when there is none."""
    child, parent = node, parents(node)
    while parent is not None:
        if isinstance(parent, cst.Try) and child is parent.body:
            for handler in parent.handlers:
                if handler.type is None or _catches_import_error(handler.type):
                    return handler
        child, parent = parent, parents(parent)
    return None


def _catches_import_error(node: cst.BaseExpression) -> bool:
    if isinstance(node, cst.Tuple):
        return any(_catches_import_error(e.value) for e in node.elements)
    name = dotted_name(node)
    return name is not None and name.rpartition(".")[2] in _IMPORT_ERRORS


class Probes:
    """The probes of one module (see the module docstring): ``strings`` / ``names`` hold the
    rewrites (by the id of the node in the parsed tree) that the rewriter applies as it leaves each
    node; ``seen`` the nodes dealt with here, which the rewriter must not report again as a plain
    string or a bare name; ``report(node, message)`` takes what is left for the user."""

    def __init__(
        self,
        resolve: Callable[[str], Resolution | None],
        report: Callable[[cst.CSTNode, str], None],
        check_provided: Callable[[cst.CSTNode, str, str, str], None],
        roots: set[str],
        megatron: bool,
    ) -> None:
        self._resolve = resolve
        self._report = report
        self._check_provided = check_provided
        self._roots = roots  # names a rewritten `import apex` binds (filled before the walk)
        self._megatron = megatron
        self.strings: dict[int, str] = {}
        self.names: dict[int, str] = {}
        self.seen: set[int] = set()
        self.rewritten = 0
        self._discarded: set[int] = set()  # calls whose value is thrown away (`__import__("apex")` as a statement)
        self._stubbed: set[object] = set()  # names the module assigns or deletes in sys.modules

    # -- what the rewriter's visitors hand over ------------------------------------------------
    def prepare(self, module: cst.Module) -> None:
        """Before the walk: the names the module itself puts in (or takes out of) sys.modules."""
        stubbed = self._stubbed = set()

        class _Stubs(cst.CSTVisitor):
            def visit_Assign(self, node: cst.Assign) -> None:
                for target in node.targets:
                    self._add(target.target)

            def visit_Del(self, node: cst.Del) -> None:
                self._add(node.target)

            def _add(self, target: cst.BaseExpression) -> None:
                if isinstance(target, (cst.Tuple, cst.List)):
                    for element in target.elements:
                        self._add(element.value)
                elif isinstance(target, cst.Subscript) and _is_sys_modules(target.value) and len(target.slice) == 1:
                    index = target.slice[0].slice
                    if isinstance(index, cst.Index) and isinstance(index.value, cst.SimpleString):
                        stubbed.add(index.value.evaluated_value)

        module.visit(_Stubs())

    def statement(self, node: cst.Expr) -> None:
        if isinstance(node.value, cst.Call):
            self._discarded.add(id(node.value))

    def call(self, node: cst.Call) -> None:
        func = dotted_name(node.func)
        if func is None or not node.args:
            return
        first = node.args[0]
        if (first.keyword is not None and first.keyword.value != "name") or first.star:
            return
        if func in _IMPORTS or func in _CHECKS:
            self._module_name(node, first.value, func)
        elif func in ("hasattr", "getattr") and len(node.args) >= 2:
            self._attribute_probe(node, func)
        elif func.rpartition(".")[2] in _METADATA and isinstance(first.value, cst.SimpleString):
            value = first.value.evaluated_value
            if isinstance(value, str) and _APEX_DISTRIBUTION.fullmatch(value):
                self.seen.add(id(first.value))
                self._report(node, f"{func}({value!r}) is not rewritten: {_NO_DISTRIBUTION}")

    def comparison(self, node: cst.Comparison) -> None:
        if isinstance(node.left, cst.SimpleString) and any(
            isinstance(c.operator, (cst.In, cst.NotIn)) and _is_sys_modules(c.comparator) for c in node.comparisons[:1]
        ):
            self._module_name(node, node.left, "sys.modules")

    def subscript(self, node: cst.Subscript) -> None:
        if not _is_sys_modules(node.value) or len(node.slice) != 1:
            return
        index = node.slice[0].slice
        if isinstance(index, cst.Index):
            self._module_name(node, index.value, "sys.modules")

    def library_flag(self, node: cst.CSTNode, module: str, name: str) -> None:
        """``from transformers... import is_apex_available`` or ``transformers.is_apex_available``."""
        if module.partition(".")[0] in _PROBING_LIBRARIES and _LIBRARY_FLAG.fullmatch(name):
            self._report(node, f"{module}.{name} is the library's own test for a real apex (an "
                               "importlib.util.find_spec('apex')), so it is False after migrate: use True where the "
                               "script only needs apex's API (fp16kit.legacy has it), or run the unmigrated script "
                               "with `fp16kit run`, under which it is True")

    # -- the rules -----------------------------------------------------------------------------
    def _module_name(self, node: cst.CSTNode, arg: cst.BaseExpression, func: str) -> None:
        what = "dynamic import" if func in _IMPORTS else f"availability check ({func})"
        if not isinstance(arg, cst.SimpleString):
            prefix = _static_prefix(arg)
            root = prefix.partition(".")[0] if prefix and "." in prefix else None
            if root and is_handled(root, megatron=self._megatron, extensions=True):
                self._report(node, f"{what} of a module name built at run time ({prefix!r} + ...) is not rewritten: "
                                   "fp16kit's modules have other names (apex.X is fp16kit.legacy.X for the covered "
                                   "ones, amp_C is fp16kit.legacy.multi_tensor_apply; MIGRATION.md lists them): "
                                   "build the fp16kit name instead")
            return
        value = arg.evaluated_value
        res = self._resolve(value) if isinstance(value, str) and value not in self._stubbed else None
        if res is None:
            return
        self.seen.add(id(arg))
        if not res.covered or res.rest:
            fix = res.hint if not res.covered else f"use {res.new_path!r}"
            self._report(node, f"{what} of {value!r} is not rewritten: {fix}")
            return
        if func.endswith("__import__") and isinstance(node, cst.Call) and id(node) not in self._discarded \
                and not _has_fromlist(node):
            self._report(node, f"dynamic import of {value!r} is not rewritten: __import__ returns the top-level "
                               f"package, which would be fp16kit, not {res.new_path}: use "
                               f"importlib.import_module({res.new_path!r})")
            return
        self.strings[id(arg)] = res.new_path
        self.rewritten += 1

    def _attribute_probe(self, node: cst.Call, func: str) -> None:
        obj, attr_node = node.args[0].value, node.args[1].value
        if not (isinstance(obj, cst.Name) and obj.value in self._roots and isinstance(attr_node, cst.SimpleString)):
            return
        attr = attr_node.evaluated_value
        if not isinstance(attr, str) or not attr.isidentifier():
            return
        dotted = f"{obj.value}.{attr}"
        res = self._resolve(dotted)
        if res is None:
            return
        self.seen.update((id(obj), id(attr_node)))
        if not res.covered:
            self._report(node, f"{func}({obj.value}, {attr!r}) is not rewritten: {res.hint}; `import "
                               f"{obj.value}` now binds fp16kit, so write the check as False (fp16kit has no such "
                               "module)")
            return
        parent, _, last = res.new_path.rpartition(".")
        if func == "getattr" and len(node.args) == 2:  # no default: it raises where the module lacks the name
            self._check_provided(node, parent, last, dotted)
        self.names[id(obj)] = parent
        self.strings[id(attr_node)] = last
        self.rewritten += 1
