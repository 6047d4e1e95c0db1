"""``fp16kit migrate``'s second concern: the checks apex-era code makes for apex without an ``import``.

Statement (availability probes, dynamic imports), which the import rewrite alone leaves
spelling ``apex`` -- after it, ``'apex' in sys.modules`` is False and amp silently turns off.

Rules (``NAME`` is a module-name string literal; ``T`` is what the import rewrite maps it to)::

    rewritten (NAME is a covered module: 'apex', 'apex.amp', 'amp_C', ... -> 'fp16kit.legacy', ...):
        NAME in sys.modules / not in sys.modules[.keys()] / sys.modules.get(NAME) / sys.modules[NAME]
        importlib.util.find_spec(NAME), pkgutil.find_loader / get_loader, importlib.find_loader,
        lightning's (_)module_available / (_)package_available, importlib.import_module(NAME)
        __import__(NAME) when its value is unused or it has a fromlist (else it returns `fp16kit`)
            (a bare name -- find_spec(NAME), fs(NAME) -- only where it is bound, in that scope, by
            `from importlib.util import find_spec [as fs]`, or an import of the function from its other
            homes (_BARE), or is the builtin __import__: a user's function of that name stays as it is)
        hasattr(apex, "x") / getattr(apex, "x"[, d]) where `apex` is, in that scope, the name a
            rewritten `import apex` binds                                  -> hasattr(parent(T), last(T))
            (`apex` a parameter, loop variable, local or class attribute: not apex, stays as it is)
    reported with the fix (FILE:LINE, as migrate reports what it cannot migrate):
        NAME not covered (apex.contrib.xentropy, fused_layer_norm_cuda, ...): the replacement
        a module name built at run time ("apex." + x, f"apex.{x}", "apex.%s" % x, "apex.{}".format(x))
        importlib.metadata.version / distribution, pkg_resources.get_distribution / require,
        RequirementCache("apex..."): no migrated install has an `apex` distribution
        is_apex_available / APEX_AVAILABLE imported from a library (transformers, Lightning): its own
        probe for a real apex, False after migrate
        a probe whose function or `apex` may be the import or something else the module binds to that
        name (`try: import apex` / `except ImportError: apex = None`; a second `def find_spec`): the
        lines of both, and the rewrite to make where it is the import
        hasattr(apex, "x") with apex.x not covered: once a line -- not again where the line also uses
        apex.x, which is reported as such
    a module that assigns or deletes sys.modules[NAME] (a script stubbing apex out, a test faking it):
        its checks of that NAME are about its own stub, and stay as they are

A reported import, or dynamic import, inside the ``try`` of an ``except ImportError`` also says so
(:func:`fallback_handler`): after migrate that fallback runs and turns off what the ``try`` enabled.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping

import libcst as cst
from libcst.metadata import (
    Assignment,
    BaseAssignment,
    BuiltinAssignment,
    CodeRange,
    MetadataWrapper,
    PositionProvider,
    Scope,
    ScopeProvider,
)

from ..legacy.apex_alias.apex_map import Resolution, is_handled

__all__ = ["Probes", "dotted_name", "fallback_handler"]

# dotted spellings of the functions that take a module name first
_IMPORTS = frozenset({"importlib.import_module", "importlib.__import__", "builtins.__import__"})
_CHECKS = frozenset(
    {
        "importlib.util.find_spec",
        "util.find_spec",
        "importlib.find_loader",
        "pkgutil.find_loader",
        "pkgutil.get_loader",
        "sys.modules.get",
    }
)
# the same functions called by a bare name, and the modules a `from M import name [as local]` that
# binds it may import it from (__import__ is also the builtin); any other binding of the name is the
# user's own function (a data loader's get_loader, a local def find_spec), which takes no module name
_LIGHTNING_IMPORTS = frozenset(
    {
        "lightning_utilities",
        "lightning_utilities.core.imports",
        "pytorch_lightning.utilities.imports",
        "lightning.pytorch.utilities.imports",
    }
)
_BARE = {
    "find_spec": frozenset({"importlib.util"}),
    "find_loader": frozenset({"importlib", "pkgutil"}),
    "get_loader": frozenset({"pkgutil"}),
    "import_module": frozenset({"importlib"}),
    "__import__": frozenset({"importlib", "builtins"}),
    # Lightning's helpers: find_spec inside
    **dict.fromkeys(
        ("_module_available", "module_available", "_package_available", "package_available"), _LIGHTNING_IMPORTS
    ),
}
# functions that read a distribution's metadata, by their last name
_METADATA = frozenset(
    {"version", "distribution", "metadata", "files", "requires", "get_distribution", "require", "RequirementCache"}
)
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
            return (
                left.evaluated_value
                if isinstance(left, cst.SimpleString) and isinstance(left.evaluated_value, str)
                else _static_prefix(left)
            )
        if isinstance(node.operator, cst.Modulo) and isinstance(left, cst.SimpleString):
            value = left.evaluated_value
            return value.partition("%")[0] if isinstance(value, str) else None
    if (
        isinstance(node, cst.Call)
        and isinstance(node.func, cst.Attribute)
        and node.func.attr.value == "format"
        and isinstance(node.func.value, cst.SimpleString)
    ):
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
        isinstance(fromlist, cst.Name) and fromlist.value == "None"
    )


def fallback_handler(
    node: cst.CSTNode, parents: Callable[[cst.CSTNode], cst.CSTNode | None]
) -> cst.ExceptHandler | None:
    """The ``except ImportError`` handler whose ``try`` body holds ``node``, or None.

    The ``except ImportError`` (or ModuleNotFoundError, Exception, bare) whose ``try`` body holds
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
    """The probes of one module (see the module docstring).

    ``strings`` / ``names`` hold the rewrites (by the id of the node in the parsed tree) that the
    rewriter applies as it leaves each node; ``seen`` the nodes dealt with here, which the rewriter
    must not report again as a plain string or a bare name; ``report(node, message)`` takes what is
    left for the user."""

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
        self._module: cst.Module | None = None
        self._aliases: set[str] = set()  # local names `from importlib.util import find_spec as fs` binds
        self._starred: set[str] = set()  # probe functions a `from pkgutil import *` binds
        self._scopes: Mapping[cst.CSTNode, Scope | None] | None = None  # libcst's metadata maps, on first need
        self._positions: Mapping[cst.CSTNode, CodeRange] | None = None
        self._uses: dict[int, set[str]] | None = None  # line -> the uncovered apex.x uses reported on it

    # -- what the rewriter's visitors hand over ------------------------------------------------
    def prepare(self, module: cst.Module) -> None:
        """Before the walk: collect the module's own sys.modules names and its probe functions' local names.

        Before the walk: the names the module itself puts in (or takes out of) sys.modules, and
        the local names its imports give the probe functions (``fs`` for ``from importlib.util import
        find_spec as fs``)."""
        stubbed: set[object] = set()
        aliases: set[str] = set()
        starred: set[str] = set()
        self._stubbed, self._aliases, self._starred = stubbed, aliases, starred
        self._module, self._scopes, self._positions, self._uses = module, None, None, None

        class _Stubs(cst.CSTVisitor):
            def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
                source = None if node.relative else dotted_name(node.module) if node.module else None
                if source is None:
                    return
                if isinstance(node.names, cst.ImportStar):
                    starred.update(name for name, sources in _BARE.items() if source in sources)
                    return
                for alias in node.names:
                    if isinstance(alias.name, cst.Name) and source in _BARE.get(alias.name.value, ()):
                        aliases.add(
                            alias.asname.name.value
                            if isinstance(alias.asname, cst.AsName) and isinstance(alias.asname.name, cst.Name)
                            else alias.name.value
                        )

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
        elif isinstance(node.func, cst.Name) and (func in _BARE or func in self._aliases):
            self._module_name(node, first.value, func, bare=node.func)
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
            self._report(
                node,
                f"{module}.{name} is the library's own test for a real apex (an "
                "importlib.util.find_spec('apex')), so it is False after migrate: use True where the "
                "script only needs apex's API (fp16kit.legacy has it), or run the unmigrated script "
                "with `fp16kit run`, under which it is True",
            )

    # -- the rules -----------------------------------------------------------------------------
    def _module_name(self, node: cst.CSTNode, arg: cst.BaseExpression, func: str, bare: cst.Name | None = None) -> None:
        """The rule for a module-name argument of ``func``; ``bare`` is the function's Name where it is
        called by a bare name, which is a probe only where its import says so (:meth:`_bare_function`;
        decided only for an argument naming apex: the scope analysis costs more than the parse)."""
        probes: list[BaseAssignment] = []  # the bindings of `bare` that are the probe's import
        others: list[BaseAssignment] = []  # ... and the rest
        if not isinstance(arg, cst.SimpleString):
            prefix = _static_prefix(arg)
            root = prefix.partition(".")[0] if prefix and "." in prefix else None
            if root and is_handled(root, megatron=self._megatron, extensions=True):
                if bare is not None:
                    found, probes, others = self._bare_function(bare)
                    if found is None:
                        return
                    func = found
                what = _what(func)
                self._report(
                    node,
                    f"{what} of a module name built at run time ({prefix!r} + ...) is not rewritten: "
                    "fp16kit's modules have other names (apex.X is fp16kit.legacy.X for the covered "
                    "ones, amp_C is fp16kit.legacy.multi_tensor_apply; MIGRATION.md lists them): "
                    "build the fp16kit name instead",
                )
            return
        value = arg.evaluated_value
        res = self._resolve(value) if isinstance(value, str) and value not in self._stubbed else None
        if res is None:
            return
        if bare is not None:
            found, probes, others = self._bare_function(bare)
            if found is None:
                return  # the user's own function of that name: its "apex" is no module name
            func = found
        what = _what(func)
        self.seen.add(id(arg))
        if not res.covered or res.rest:
            fix = res.hint if not res.covered else f"use {res.new_path!r}"
            self._report(node, f"{what} of {value!r} is not rewritten: {fix}")
            return
        if others:  # `from importlib.util import find_spec` and a `def find_spec` of its own, say
            assert bare is not None
            self._report(
                node,
                f"{what} of {value!r} is not rewritten: {bare.value!r} here may be the {func} "
                f"{'imported on ' + self._lines(probes) if probes else 'a `*` import brings'}, or what "
                f"{self._lines(others)} binds to that name: where it is {func}, use {res.new_path!r}",
            )
            return
        if (
            func.endswith("__import__")
            and isinstance(node, cst.Call)
            and id(node) not in self._discarded
            and not _has_fromlist(node)
        ):
            self._report(
                node,
                f"dynamic import of {value!r} is not rewritten: __import__ returns the top-level "
                f"package, which would be fp16kit, not {res.new_path}: use "
                f"importlib.import_module({res.new_path!r})",
            )
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
        # what `apex` is here: only the module a rewritten `import apex` binds has apex's attributes
        bindings = self._referents(obj)
        imports = [b for b in bindings if self._rewritten_import(b)]
        others = [b for b in bindings if not self._rewritten_import(b)]
        self.seen.update((id(obj), id(attr_node)))  # dealt with here, the module or not: no "used on its own"
        if bindings and not imports:
            return  # a parameter, loop variable, local or class attribute that shares the name: not apex
        if not res.covered:
            if dotted not in self._uses_on_line(node):  # that use's report names the line already
                self._report(
                    node,
                    f"{func}({obj.value}, {attr!r}) is not rewritten: {res.hint}; `import "
                    f"{obj.value}` now binds fp16kit, so write the check as False (fp16kit has no such "
                    "module)",
                )
            return
        parent, _, last = res.new_path.rpartition(".")
        if others or not imports:  # `except ImportError: apex = None`, a module-level `for apex in ...`
            rewrite = f"{func}({parent}, {last!r}{', ...' if len(node.args) > 2 else ''})"
            where = (
                (
                    f"{obj.value!r} here may be the module the `import {obj.value}` on {self._lines(imports)} binds, "
                    f"or what {self._lines(others)} binds to that name"
                )
                if imports
                else (
                    f"no binding of {obj.value!r} reaches this scope (is the `import {obj.value}` in another function?)"
                )
            )
            self._report(
                node,
                f"{func}({obj.value}, {attr!r}) is not rewritten: {where}: where it is the module, "
                f"write {rewrite} (`import {obj.value}` now binds fp16kit)",
            )
            return
        if func == "getattr" and len(node.args) == 2:  # no default: it raises where the module lacks the name
            self._check_provided(node, parent, last, dotted)
        self.names[id(obj)] = parent
        self.strings[id(attr_node)] = last
        self.rewritten += 1

    # -- what the names are: libcst's scope analysis, on first need ----------------------------
    def _scope_map(self) -> Mapping[cst.CSTNode, Scope | None]:
        """libcst's ScopeProvider map of the module being walked: resolved once, on the first probe
        that needs it (it costs about three parses), over the walked tree's own nodes."""
        if self._scopes is None:
            assert self._module is not None, "prepare() first"
            self._scopes = MetadataWrapper(self._module, unsafe_skip_copy=True).resolve(ScopeProvider)
        return self._scopes

    def _position_map(self) -> Mapping[cst.CSTNode, CodeRange]:
        """The PositionProvider map, resolved apart from the scopes: only reports need lines."""
        if self._positions is None:
            assert self._module is not None, "prepare() first"
            self._positions = MetadataWrapper(self._module, unsafe_skip_copy=True).resolve(PositionProvider)
        return self._positions

    def _referents(self, name: cst.Name) -> Collection[BaseAssignment]:
        """Every binding the read ``name`` may see, in its scope (libcst does not follow the control
        flow: `import apex` and an `apex = None` in the same scope both are); empty when none is known."""
        scope = self._scope_map().get(name)
        if scope is None:
            return ()
        return [binding for access in scope.accesses[name] for binding in access.referents]

    def _lines(self, bindings: Collection[BaseAssignment]) -> str:
        """ "line 3" / "lines 3, 7": where ``bindings`` are."""
        positions = self._position_map()
        lines = sorted(
            {positions[b.node].start.line for b in bindings if isinstance(b, Assignment) and b.node in positions}
        )
        return ("line " if len(lines) == 1 else "lines ") + ", ".join(map(str, lines)) if lines else "the builtins"

    def _rewritten_import(self, binding: BaseAssignment) -> bool:
        """Whether ``binding`` is an ``import apex[.x]`` (no ``as``) that the import rewrite rewrites:
        then the name is the module the probe asks about."""
        node = getattr(binding, "node", None)
        if not isinstance(node, cst.Import):
            return False
        for alias in node.names:
            dotted = dotted_name(alias.name)
            if alias.asname is None and dotted and dotted.partition(".")[0] == binding.name:
                res = self._resolve(dotted)
                if res is not None and res.covered and not res.rest:
                    return True
        return False

    def _bare_function(self, name: cst.Name) -> tuple[str | None, list[BaseAssignment], list[BaseAssignment]]:
        """The probe function (by its own name: ``find_spec`` for ``fs``) that the bare ``name`` called
        here is, the bindings it may see that import it, and the others; None for the function when
        none does -- a function of the user's that shares the name (`from mydata import get_loader`)."""
        found: set[str] = set()
        probes: list[BaseAssignment] = []
        others: list[BaseAssignment] = []
        bindings = self._referents(name)
        for binding in bindings:
            function = self._probe_binding(binding)
            if function is None:
                others.append(binding)
            else:
                found.add(function)
                probes.append(binding)
        if not bindings and name.value in self._starred:  # `from importlib.util import *`: no binding is known
            found.add(name.value)
        if not found:
            return None, probes, others
        # two probes under one name both take a module name; __import__ first, as it alone may not be rewritten
        return ("__import__" if "__import__" in found else min(found)), probes, others

    @staticmethod
    def _probe_binding(binding: BaseAssignment) -> str | None:
        """The probe function ``binding`` binds: the builtin ``__import__``, or a name imported from a
        module in its ``_BARE`` entry; else None."""
        if isinstance(binding, BuiltinAssignment):
            return binding.name if binding.name == "__import__" else None
        node = getattr(binding, "node", None)
        if (
            not isinstance(node, cst.ImportFrom)
            or node.relative
            or node.module is None
            or isinstance(node.names, cst.ImportStar)
        ):
            return None
        source = dotted_name(node.module)
        for alias in node.names:
            if not isinstance(alias.name, cst.Name):
                continue
            local = alias.asname.name if isinstance(alias.asname, cst.AsName) else alias.name
            if (
                isinstance(local, cst.Name)
                and local.value == binding.name
                and source in _BARE.get(alias.name.value, ())
            ):
                return alias.name.value
        return None

    def _uses_on_line(self, node: cst.CSTNode) -> set[str]:
        """The apex paths ``node``'s line uses as dotted names (``apex.__version__``) that the rewriter
        reports as not covered -- and each of their prefixes: the line's report for them names it."""
        positions = self._position_map()
        if self._uses is None:
            uses: dict[int, set[str]] = {}
            probes = self

            class _Uses(cst.CSTVisitor):  # the rewriter's own walk of dotted uses (codemod.visit_Attribute)
                def visit_Import(self, _: cst.Import) -> bool:
                    return False

                def visit_ImportFrom(self, _: cst.ImportFrom) -> bool:
                    return False

                def visit_Attribute(self, attribute: cst.Attribute) -> bool:
                    dotted = dotted_name(attribute)
                    if dotted is None:
                        return True
                    res = probes._resolve(dotted) if dotted.partition(".")[0] in probes._roots else None
                    if res is not None and not res.covered:
                        parts = dotted.split(".")
                        uses.setdefault(positions[attribute].start.line, set()).update(
                            ".".join(parts[:i]) for i in range(2, len(parts) + 1)
                        )
                    return False

            assert self._module is not None
            self._module.visit(_Uses())
            self._uses = uses
        return self._uses.get(positions[node].start.line, set())


def _what(func: str) -> str:
    """How a report names the call: a dynamic import, or an availability check by its function."""
    return (
        "dynamic import"
        if func.rpartition(".")[2] in ("import_module", "__import__")
        else f"availability check ({func})"
    )
