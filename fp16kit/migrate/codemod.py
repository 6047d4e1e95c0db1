"""``fp16kit migrate``'s rewriter: apex imports -> fp16kit.legacy on a concrete syntax tree (libcst).

So every byte outside the rewritten names stays as it was (comments, layout, CRLF, encoding, BOM).

Algorithm (one pass over the tree; the table is :mod:`fp16kit.legacy.apex_alias.apex_map`)::

    roots = names bound by a covered `import apex[.x]` / `import fp16[.x]` (no `as`)
    import A.B [as N]            A.B a mapped module        -> import T [as N]
    from M import n [as N], ...  M.n a mapped module        -> from parent(T) import last(T) [as N or n]
                                 M mapped, n an attribute   -> from T(M) import n [as N]
                                 names going to different modules: one statement per module, in order
    from M import *              M mapped (not `apex`)      -> from T(M) import *
    root.x.y (a dotted use)      longest mapped prefix P    -> T(P).rest
    availability checks and dynamic imports naming a covered module ('apex' in sys.modules,
    find_spec("apex.amp"), import_module("amp_C"), hasattr(apex, "amp"), ...; the rules are
    :mod:`fp16kit.migrate.probes`)                        -> the name the import rewrite gives it
    anything else under apex (uncovered modules and names, `from apex import *`, the bare name `apex`
    after its import was rewritten, strings naming apex paths, apex's distribution metadata):
        left as it is, and reported with its line and the closest replacement (an import inside the
        `try` of an `except ImportError` also says that the fallback now runs)
    a name the fp16kit module lacks (`from apex.parallel import Typo`): rewritten, and reported
    a torch.load that resumes apex's FP16_Optimizer state (its checkpoints pickle apex's scaler, which
    no migrated install can unpickle; the rule is :mod:`fp16kit.migrate.resume_loads`): reported, with
    `fp16kit convert-checkpoint OLD NEW`
    a source that never mentions a handled root name: returned as it is, without parsing

A second run changes nothing: every rewritten name is under fp16kit, which the table never maps.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Union, cast

import libcst as cst
from libcst.metadata import CodeRange, MetadataWrapper, ParentNodeProvider, PositionProvider

from ..legacy.apex_alias import apex_map
from .probes import Probes, fallback_handler
from .probes import dotted_name as _dotted
from .resume_loads import resume_loads

__all__ = ["MigrationError", "MigrationResult", "Unmigratable", "migrate_source"]

_DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
NameNode = Union[cst.Name, cst.Attribute]


@dataclass(frozen=True)
class Unmigratable:
    """A use of apex the rewriter left alone: where, and what to do instead."""

    line: int
    message: str


@dataclass
class MigrationResult:
    """The rewritten source (same type as the input) and what was done."""

    code: bytes | str
    changed: bool
    imports_rewritten: int = 0
    uses_rewritten: int = 0
    checks_rewritten: int = 0  # availability checks and dynamic imports (module-name strings, hasattr)
    unmigratable: list[Unmigratable] = field(default_factory=list)
    encoding: str = "utf-8"  # the source's (bytes in)


class MigrationError(ValueError):
    """The source could not be parsed (``line`` is 1-based)."""

    def __init__(self, line: int, message: str) -> None:
        super().__init__(f"line {line}: {message}")
        self.line = line
        self.message = message


def migrate_source(source: bytes | str, *, megatron: bool = False) -> MigrationResult:
    """Rewrite the apex imports in one module's source.

    Bytes in, bytes out (the encoding, from a BOM or a coding declaration, is kept); str in, str out.
    Raises MigrationError if it does not decode or parse, or if libcst would not give back its every
    byte."""
    if not _mentions_ours(source, megatron):  # parsing costs ~0.1 s a file: skip what cannot match
        return MigrationResult(source, False)
    module = _parse(source)
    rewriter = _ApexRewriter(megatron=megatron)
    new_module = module.visit(rewriter)
    code: bytes | str = new_module.bytes if isinstance(source, bytes) else new_module.code
    found = rewriter.problems + resume_loads(module, megatron=megatron)
    problems = _located(module, found) if found else []
    return MigrationResult(
        code, code != source, rewriter.imports, rewriter.uses, rewriter.probes.rewritten, problems, module.encoding
    )


def _located(module: cst.Module, found: list[tuple[cst.CSTNode, str]]) -> list[Unmigratable]:
    """The problems with their lines (resolved only when there are some: it costs as much as the
    rewrite); an import left failing inside the `try` of an `except ImportError` says that the
    fallback now runs."""
    metadata = MetadataWrapper(module, unsafe_skip_copy=True).resolve_many([PositionProvider, ParentNodeProvider])
    # resolve_many types its maps' values as object: these two providers' values are these
    positions = cast(Mapping[cst.CSTNode, CodeRange], metadata[PositionProvider])
    parents = cast(Mapping[cst.CSTNode, cst.CSTNode], metadata[ParentNodeProvider])
    problems = set()
    for node, message in found:
        handler = (
            fallback_handler(node, parents.get) if isinstance(node, (cst.Import, cst.ImportFrom, cst.Call)) else None
        )
        if handler is not None:
            message += (
                f" (inside the `try` of the `except` on line {positions[handler].start.line}: after migrate "
                "that fallback runs, and what the `try` enables stays off, until this is fixed)"
            )
        problems.add(Unmigratable(positions[node].start.line, message))
    return sorted(problems, key=lambda p: (p.line, p.message))


def _parse(source: bytes | str) -> cst.Module:
    """libcst's tree of ``source``, refused (MigrationError) unless it reproduces every byte: libcst
    drops a few (a lone CR line end, a form feed before a statement, the newline after a last-line
    comment ending in a backslash), and writing such a file would change bytes nobody asked to."""
    try:
        module = cst.parse_module(source)
    except cst.ParserSyntaxError as e:
        hint = (
            " (Python 2 code? port it to Python 3 first)"
            if re.search(r"^\s*print\s+[^\s(=]", _text(source), re.M)
            else ""
        )
        raise MigrationError(e.editor_line, f"cannot parse: invalid syntax at column {e.editor_column}{hint}") from None
    except UnicodeDecodeError as e:  # bytes not in the declared (or default UTF-8) encoding
        line = e.object[: e.start].count(b"\n") + 1
        raise MigrationError(
            line,
            f"cannot decode: byte {e.object[e.start]:#04x} is not {e.encoding} (python would "
            "refuse the file too): declare the file's encoding on its first or second line, "
            "e.g. `# -*- coding: latin-1 -*-`, or re-save it as UTF-8",
        ) from None
    except SyntaxError as e:  # tokenize's coding-declaration check: unknown, or against a BOM
        raise MigrationError(
            e.lineno or 1,
            f"cannot decode: {e.msg} (python would refuse the file too): fix its `# -*- coding: ... -*-` line",
        ) from None
    again = module.bytes if isinstance(source, bytes) else module.code
    if again != source:
        at = next((i for i, (a, b) in enumerate(zip(source, again)) if a != b), min(len(source), len(again)))
        head = source[:at]
        line = (head.count(b"\n") if isinstance(head, bytes) else head.count("\n")) + 1
        raise MigrationError(
            line,
            "libcst cannot reproduce this file byte for byte (a line ending in a lone CR, a form "
            "feed before a statement, or a backslash ending a comment on the last line): change "
            "that, or rewrite its apex imports by hand",
        )
    return module


def _mentions_ours(source: bytes | str, megatron: bool) -> bool:
    """Whether the source contains a root name the table handles, or APEX in any case (a library's
    APEX_AVAILABLE): every rewrite and report needs one."""
    roots = apex_map.ROOTS | apex_map.EXTENSION_ROOTS | ({"fp16"} if megatron else set())
    text = _text(source)
    return "apex" in text.lower() or any(root in text for root in roots)


def _text(source: bytes | str) -> str:
    return source.decode("latin-1") if isinstance(source, bytes) else source


def _name_node(dotted: str) -> NameNode:
    first, *rest = dotted.split(".")
    node: NameNode = cst.Name(first)
    for part in rest:
        node = cst.Attribute(value=node, attr=cst.Name(part))
    return node


def _renamed(node: cst.BaseExpression, old: str, new: str) -> cst.BaseExpression:
    """``node`` (the dotted name ``old``) renamed to ``new``, replacing only the head that differs
    (apex.amp -> fp16kit.legacy.amp: just ``apex``), so the layout of what stays (``apex.\\<newline>
    amp``, ``(apex).amp``) stays too."""
    old_parts, new_parts = old.split("."), new.split(".")
    same = 0
    while same < min(len(old_parts), len(new_parts)) - 1 and old_parts[-1 - same] == new_parts[-1 - same]:
        same += 1
    head = node
    for _ in range(same):
        head = head.value  # type: ignore[attr-defined]
    new_head = _name_node(".".join(new_parts[: len(new_parts) - same]))
    new_head = new_head.with_changes(lpar=head.lpar, rpar=head.rpar)
    return new_head if head is node else node.deep_replace(head, new_head)


class _ApexRewriter(cst.CSTTransformer):
    def __init__(self, *, megatron: bool) -> None:
        super().__init__()
        self.megatron = megatron
        self.table = apex_map.module_map(megatron=megatron)
        self.roots: set[str] = set()
        self.kept_roots: set[str] = set()  # root names some import that stays binds (`import megatron.mpu`)
        self.imports = 0
        self.uses = 0
        self.problems: list[tuple[cst.CSTNode, str]] = []  # (node of the parsed tree, message)
        self._not_uses: set[int] = set()  # Names that are not a use of a variable (attr, keyword, def)
        self._replacements: dict[int, cst.BaseExpression] = {}
        self._modules: dict[str, ModuleType | None] = {}  # fp16kit modules imported to check names
        self.probes = Probes(self._resolve, self._report, self._check_provided, self.roots, megatron)

    # -- helpers -------------------------------------------------------------------------------
    def _report(self, node: cst.CSTNode, message: str) -> None:
        self.problems.append((node, message))

    def _resolve(self, path: str) -> apex_map.Resolution | None:
        return apex_map.resolve(path, megatron=self.megatron)

    def _check_provided(self, node: cst.CSTNode, module: str, name: str, apex_path: str) -> None:
        """Report (still rewriting) a name the fp16kit module does not have: the rewritten import
        would fail, and so would the original one without apex."""
        if module not in self._modules:
            try:
                self._modules[module] = importlib.import_module(module)
            except Exception:  # noqa: BLE001 -- cannot check: rewrite without the check
                self._modules[module] = None
        target = self._modules[module]
        if target is not None and not hasattr(target, name):
            self._report(
                node,
                f"{apex_path}: {module} has no {name!r}, so fp16kit does not provide it "
                "(MIGRATION.md lists what it provides and the replacements)",
            )

    def _explain(self, res: apex_map.Resolution) -> str:
        return apex_map.hint_for(res.path, megatron=self.megatron)

    # -- the module: which names a rewritten `import apex...` binds ----------------------------
    def visit_Module(self, node: cst.Module) -> bool:
        rewriter = self

        class _Roots(cst.CSTVisitor):
            def visit_Import(self, imp: cst.Import) -> bool:
                for alias in imp.names:
                    dotted = _dotted(alias.name)
                    if not dotted:
                        continue
                    res = rewriter._resolve(dotted)
                    if alias.asname is None and res is not None and res.covered and not res.rest:
                        rewriter.roots.add(dotted.partition(".")[0])
                    elif alias.asname is None and dotted:  # stays: still binds its root name
                        rewriter.kept_roots.add(dotted.partition(".")[0])
                return False

        node.visit(_Roots())
        self.probes.prepare(node)
        return True

    # -- import A.B [as N] ---------------------------------------------------------------------
    def visit_Import(self, node: cst.Import) -> bool:
        return False  # its names are handled here, not as dotted uses

    def leave_Import(self, original_node: cst.Import, updated_node: cst.Import) -> cst.Import:
        names, changed = [], False
        for alias in updated_node.names:
            dotted = _dotted(alias.name)
            res = self._resolve(dotted) if dotted else None
            if dotted and res is not None and res.target is not None and not res.rest:  # covered
                names.append(alias.with_changes(name=_renamed(alias.name, dotted, res.target)))
                changed = True
            else:
                if res is not None:
                    self._report(original_node, f"import {dotted}: {self._explain(res)}")
                names.append(alias)
        if not changed:
            return updated_node
        self.imports += 1
        return updated_node.with_changes(names=names)

    # -- from M import ... ---------------------------------------------------------------------
    def visit_ImportFrom(self, node: cst.ImportFrom) -> bool:
        return False

    def leave_ImportFrom(
        self, original_node: cst.ImportFrom, updated_node: cst.ImportFrom
    ) -> cst.ImportFrom | cst.FlattenSentinel[cst.ImportFrom]:
        if updated_node.relative or updated_node.module is None:
            return updated_node
        module = _dotted(updated_node.module)
        if module is None:
            return updated_node
        if self._resolve(module) is None and not isinstance(updated_node.names, cst.ImportStar):
            for alias in updated_node.names:  # from transformers.utils import is_apex_available
                self.probes.library_flag(original_node, module, _dotted(alias.name) or "")
        if isinstance(updated_node.names, cst.ImportStar):
            return self._star(original_node, updated_node, module)
        groups: dict[str | None, list[cst.ImportAlias]] = {}  # target module (None: stays) -> names, in order
        for alias in updated_node.names:
            key, new_alias = self._from_alias(original_node, module, alias)
            groups.setdefault(key, []).append(new_alias)
        if list(groups) == [None]:
            return updated_node
        self.imports += 1
        last_alias = updated_node.names[-1]
        statements = []
        own = self._resolve(module)
        own_target = own.new_path if own is not None and own.covered else None
        for key, aliases in groups.items():
            new_module: cst.BaseExpression | None
            if key is None:
                new_module = updated_node.module
            elif key == own_target:  # the usual case: only the differing head of the name changes
                new_module = _renamed(updated_node.module, module, key)
            else:
                new_module = _name_node(key)
            statement = updated_node.with_changes(module=new_module)
            if aliases[-1] is not last_alias:
                aliases[-1], statement = self._close_group(updated_node, aliases[-1], statement)
            statements.append(statement.with_changes(names=aliases))
        return statements[0] if len(statements) == 1 else cst.FlattenSentinel(statements)

    @staticmethod
    def _close_group(
        node: cst.ImportFrom, alias: cst.ImportAlias, statement: cst.ImportFrom
    ) -> tuple[cst.ImportAlias, cst.ImportFrom]:
        """End a split-off group at ``alias`` as the original statement ended (its comment kept)."""
        comma = alias.comma
        if (
            not isinstance(comma, cst.Comma)
            or not isinstance(comma.whitespace_after, cst.ParenthesizedWhitespace)
            or node.rpar is None
        ):
            return alias.with_changes(comma=cst.MaybeSentinel.DEFAULT), statement
        # one name per line in (): keep the comma and its comment, indent `)` as the original did
        assert not isinstance(node.names, cst.ImportStar)  # a star import is never split
        last = node.names[-1].comma
        if isinstance(last, cst.Comma) and isinstance(last.whitespace_after, cst.ParenthesizedWhitespace):
            closing = last.whitespace_after.last_line
        elif isinstance(node.rpar.whitespace_before, cst.ParenthesizedWhitespace):
            closing = node.rpar.whitespace_before.last_line
        else:
            closing = cst.SimpleWhitespace("")
        alias = alias.with_changes(
            comma=comma.with_changes(whitespace_after=comma.whitespace_after.with_changes(last_line=closing))
        )
        return alias, statement.with_changes(rpar=node.rpar.with_changes(whitespace_before=cst.SimpleWhitespace("")))

    def _from_alias(
        self, node: cst.ImportFrom, module: str, alias: cst.ImportAlias
    ) -> tuple[str | None, cst.ImportAlias]:
        """Where one imported name goes: (fp16kit module to import it from, the new alias), or
        (None, the alias unchanged) when it stays."""
        name = _dotted(alias.name) or ""
        full = f"{module}.{name}"
        res = self._resolve(full)
        if res is None:
            return None, alias  # not ours (e.g. `from megatron import mpu`)
        if res.target is not None and not res.rest:  # a submodule: from parent(T) import last(T) as <the old name>
            parent, _, last = res.target.rpartition(".")
            asname = alias.asname
            if asname is None and last != name:
                asname = cst.AsName(name=cst.Name(name))
            return parent, alias.with_changes(name=cst.Name(last), asname=asname)
        if res.target is not None and res.rest == f".{name}":  # covered, an attribute of a mapped module
            self._check_provided(node, res.target, name, full)
            return res.target, alias
        self._report(node, f"from {module} import {name}: {self._explain(res)}")
        return None, alias

    def _star_imports(self, module: str) -> str:
        """The imports that bind what `from <CLOSED module> import *` bound: its covered submodules,
        under their apex names (apex.fp16_utils is fp16kit.legacy itself: `from fp16kit import legacy as fp16_utils`)."""
        by_parent: dict[str, list[str]] = {}
        for child in sorted(k for k in self.table if k.rpartition(".")[0] == module):
            name = child.rpartition(".")[2]
            parent, _, last = self.table[child].rpartition(".")
            by_parent.setdefault(parent, []).append(name if last == name else f"{last} as {name}")
        return "; ".join(f"from {parent} import {', '.join(names)}" for parent, names in by_parent.items())

    def _star(self, original: cst.ImportFrom, updated: cst.ImportFrom, module: str) -> cst.ImportFrom:
        res = self._resolve(module)
        if res is None:
            return updated
        if res.target is not None and not res.rest and module not in apex_map.CLOSED:  # covered
            assert updated.module is not None  # leave_ImportFrom keeps `from . import *` as it is
            self.imports += 1
            target = apex_map.STAR_MODULES.get(module, res.target)
            return updated.with_changes(module=_renamed(updated.module, module, target))
        if module in apex_map.CLOSED:
            message = f"from {module} import *: import what you use by name, e.g. {self._star_imports(module)}"
        else:
            message = f"from {module} import *: {self._explain(res)}"
        self._report(original, message)
        return updated

    def leave_SimpleStatementLine(
        self, original_node: cst.SimpleStatementLine, updated_node: cst.SimpleStatementLine
    ) -> cst.SimpleStatementLine | cst.FlattenSentinel[cst.SimpleStatementLine]:
        # a `from` import split in several: one line each (the comment stays on the last one)
        if len(original_node.body) != 1 or len(updated_node.body) == 1:
            return updated_node
        last = len(updated_node.body) - 1
        return cst.FlattenSentinel(
            [
                updated_node.with_changes(
                    body=[stmt.with_changes(semicolon=cst.MaybeSentinel.DEFAULT)],
                    leading_lines=updated_node.leading_lines if i == 0 else [],
                    trailing_whitespace=updated_node.trailing_whitespace if i == last else cst.TrailingWhitespace(),
                )
                for i, stmt in enumerate(updated_node.body)
            ]
        )

    # -- dotted uses: apex.amp.initialize(...) after `import apex` -----------------------------
    def visit_Attribute(self, node: cst.Attribute) -> bool:
        dotted = _dotted(node)
        if dotted is None:
            self._not_uses.add(id(node.attr))
            return True  # e.g. f(x).y: the chain inside is visited on its own
        if dotted.partition(".")[0] not in self.roots:
            self.probes.library_flag(node, *dotted.rsplit(".", 1))  # transformers.utils.is_apex_available
            return False
        res = self._resolve(dotted)
        if res is None:
            root = dotted.partition(".")[0]
            if root not in self.kept_roots:  # `import megatron.fp16` bound `megatron`; its rewrite does not
                self._report(
                    node,
                    f"{dotted}: the name {root!r} was bound by an import that now imports fp16kit "
                    f"(e.g. `import {root}.fp16`): add `import {dotted.rpartition('.')[0]}` for this use",
                )
            return False
        if res.target is None:  # not covered
            self._report(node, f"{dotted}: {self._explain(res)}")
            return False
        chain: list[cst.BaseExpression] = [node]
        while isinstance(chain[-1], cst.Attribute):
            chain.append(chain[-1].value)
        prefix_node = chain[len(chain) - (res.prefix.count(".") + 1)]
        if res.rest:
            self._check_provided(node, res.target, res.rest.split(".")[1], dotted)
        self._replacements[id(node)] = node.deep_replace(prefix_node, _renamed(prefix_node, res.prefix, res.target))
        return False

    def leave_Attribute(self, original_node: cst.Attribute, updated_node: cst.Attribute) -> cst.BaseExpression:
        new = self._replacements.pop(id(original_node), None)
        if new is None:
            return updated_node
        self.uses += 1
        return new

    def visit_Arg(self, node: cst.Arg) -> None:
        if node.keyword is not None:
            self._not_uses.add(id(node.keyword))

    def visit_Param(self, node: cst.Param) -> None:
        self._not_uses.add(id(node.name))

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self._not_uses.add(id(node.name))

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self._not_uses.add(id(node.name))

    def visit_Name(self, node: cst.Name) -> None:
        if node.value not in self.roots or id(node) in self._not_uses or id(node) in self.probes.seen:
            return
        self._report(
            node,
            f"the name {node.value!r} is used on its own, but `import {node.value}` now binds fp16kit: "
            "rewrite this use by hand (e.g. `except ImportError: apex = None` / `if apex:` checks)",
        )

    # -- availability checks and dynamic imports (fp16kit.migrate.probes) ----------------------
    def visit_Expr(self, node: cst.Expr) -> None:
        self.probes.statement(node)

    def visit_Call(self, node: cst.Call) -> None:
        self.probes.call(node)

    def visit_Comparison(self, node: cst.Comparison) -> None:
        self.probes.comparison(node)

    def visit_Subscript(self, node: cst.Subscript) -> None:
        self.probes.subscript(node)

    def leave_Name(self, original_node: cst.Name, updated_node: cst.Name) -> cst.BaseExpression:
        new = self.probes.names.get(id(original_node))
        return (
            updated_node
            if new is None
            else _name_node(new).with_changes(lpar=updated_node.lpar, rpar=updated_node.rpar)
        )

    def leave_SimpleString(self, original_node: cst.SimpleString, updated_node: cst.SimpleString) -> cst.SimpleString:
        new = self.probes.strings.get(id(original_node))
        if new is None:
            return updated_node
        quote = updated_node.quote
        return updated_node.with_changes(value=f"{updated_node.prefix}{quote}{new}{quote}")

    # -- what stays: strings naming apex paths -------------------------------------------------
    def visit_SimpleString(self, node: cst.SimpleString) -> None:
        if id(node) in self.probes.seen:
            return
        value = node.evaluated_value
        if not isinstance(value, str) or not _DOTTED.fullmatch(value):
            return
        res = self._resolve(value)
        if res is None:
            return
        new = f"fp16kit's is {res.new_path!r}" if res.covered else self._explain(res)
        self._report(
            node,
            f"the string {value!r} names an apex path and is not rewritten (a dynamic import or a "
            f"pickled class path?): {new}",
        )
