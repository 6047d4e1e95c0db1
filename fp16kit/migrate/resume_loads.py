"""``fp16kit migrate``'s report of the ``torch.load`` calls that resume apex-era optimizer state.

apex's ``FP16_Optimizer`` (``apex.fp16_utils``, and Megatron-LM v1's ``fp16`` copy) put its loss-scaler
*object* in ``state_dict()``, so every checkpoint such a script saved pickles an apex class. After
migrate there is no apex alias: ``torch.load`` of such a file fails ("No module named 'apex'" with
the full unpickler; torch's default, weights_only=True, refuses the class). The file must be
converted once. Rule (one report per call, on its line)::

    the module imports something whose state pickles an apex scaler: an FP16_Optimizer of
    apex.fp16_utils (or fp16 / megatron.fp16 with --megatron), their LossScaler /
    DynamicLossScaler, apex.amp.scaler, or those modules themselves (or it assigns such an
    FP16_Optimizer: `apex.fp16_utils.FP16_Optimizer(...)` after `import apex`)
        (not amp: amp.state_dict() is plain data; not apex.optimizers' / apex.contrib's fused-era
        FP16_Optimizer: numbers and tensors only)
    and a call to torch.load (`torch.load`, `import torch as th` -> `th.load`, `from torch import
    load`) reaches R.load_state_dict(...): inside its argument, or through names assigned from it in
    the same function (`ckpt = torch.load(f)`, `sd = ckpt["optimizer"]`, ...)
    where R is an optimizer: a name or attribute the module assigns an FP16_Optimizer(...) to, or
    one whose last part says so (optimizer, optim, opt, ..._opt, opt_...)
        -> "torch.load(...) resumes apex-era optimizer state ...: convert old checkpoints once:
           fp16kit convert-checkpoint OLD NEW"
    or, in such a module, a torch.load whose value (the same way) is read at an optimizer's key:
    `ckpt["optimizer"]`, `ckpt.get("optimizer")` (the key named as R is above) -- the state
    handed to a helper in another file that calls load_state_dict (NVIDIA's RN50 main.py)
        -> the same report, naming the key

A model's own weights (``model.load_state_dict(torch.load(path))``) are not reported. A loader in
a module that does not import the optimizer (a checkpoint helper handed the optimizer as an
argument, in a file without apex imports) is not seen.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import libcst as cst

from ..legacy.apex_alias import apex_map
from .probes import dotted_name

__all__ = ["resume_loads"]

_L = "fp16kit.legacy"
# fp16kit's names (what apex_map resolves them to) of what pickles an apex scaler object
_OPTIMIZERS = frozenset(
    {
        f"{_L}.FP16_Optimizer",
        f"{_L}.fp16_optimizer.FP16_Optimizer",
        f"{_L}.megatron.FP16_Optimizer",
        f"{_L}.megatron.fp16.FP16_Optimizer",
    }
)
_SCALER_MODULES = frozenset({f"{_L}.loss_scaler", f"{_L}.amp.scaler", f"{_L}.megatron.loss_scaler"})
_PACKAGES = frozenset({_L, f"{_L}.megatron"})  # export FP16_Optimizer and the scalers
_MODULES = _SCALER_MODULES | _PACKAGES | {f"{_L}.fp16_optimizer", f"{_L}.megatron.fp16"}
_SCALERS = frozenset(f"{m}.{c}" for m in _SCALER_MODULES | _PACKAGES for c in ("LossScaler", "DynamicLossScaler"))
_OPTIMIZER_NAME = re.compile(r"(.*optim.*|opt|opts|.*_opt|opt_.*)", re.I)

MESSAGE = (
    "torch.load(...) resumes apex-era optimizer state ({receiver}.load_state_dict): checkpoints apex's FP16_Optimizer "
    "saved pickle its loss-scaler object, which torch.load cannot read without apex (or `fp16kit run`): convert old "
    "checkpoints once: fp16kit convert-checkpoint OLD NEW (checkpoints saved after migrate load as they are)"
)

ENTRY_MESSAGE = (
    "torch.load(...) resumes apex-era optimizer state (its {key!r} entry): checkpoints apex's FP16_Optimizer saved "
    "pickle its loss-scaler object, which torch.load cannot read without apex (or `fp16kit run`): convert old "
    "checkpoints once: fp16kit convert-checkpoint OLD NEW (checkpoints saved after migrate load as they are)"
)


class _Bindings(cst.CSTVisitor):
    """The module's imports: local name -> apex path; torch's names; whether one pickles a scaler."""

    def __init__(self, megatron: bool) -> None:
        super().__init__()
        self.megatron = megatron
        self.apex: dict[str, str] = {}
        self.star: list[str] = []  # apex modules imported with *
        self.torch: set[str] = set()
        self.load: set[str] = set()  # `from torch import load [as L]`
        self.pickles = False

    def target(self, path: str) -> str | None:
        res = apex_map.resolve(path, megatron=self.megatron)
        return res.new_path if res is not None and res.covered else None

    def note(self, path: str) -> None:
        target = self.target(path)
        if target in _OPTIMIZERS or target in _SCALERS or (target in _MODULES and path not in apex_map.CLOSED):
            self.pickles = True

    def visit_Import(self, node: cst.Import) -> bool:
        for alias in node.names:
            name = dotted_name(alias.name) or ""
            local = dotted_name(alias.asname.name) if alias.asname is not None else None
            if name == "torch" or (name.startswith("torch.") and local is None):
                self.torch.add(local or "torch")
            elif self.target(name) is not None:
                self.note(name)
                head = local or name.partition(".")[0]
                self.apex[head] = name if local else head
        return False

    def visit_ImportFrom(self, node: cst.ImportFrom) -> bool:
        module = dotted_name(node.module) if node.module is not None and not node.relative else None
        if module is None:
            return False
        if isinstance(node.names, cst.ImportStar):
            if self.target(module) is not None:
                self.note(module)
                self.star.append(module)
            return False
        for alias in node.names:
            name = dotted_name(alias.name) or ""
            local = (dotted_name(alias.asname.name) or "") if alias.asname is not None else name
            if module == "torch" and name == "load":
                self.load.add(local)
            elif self.target(f"{module}.{name}") is not None:
                self.note(f"{module}.{name}")
                self.apex[local] = f"{module}.{name}"
        return False

    def apex_path(self, dotted: str) -> str | None:
        head, _, rest = dotted.partition(".")
        if head in self.apex:
            return self.apex[head] + (f".{rest}" if rest else "")
        if not rest:
            for module in self.star:
                if self.target(f"{module}.{head}") in _OPTIMIZERS:
                    return f"{module}.{head}"
        return None


class _Flow(cst.CSTVisitor):
    """torch.load calls, assignments, ``X.load_state_dict(...)`` calls and FP16_Optimizer receivers,
    by function scope."""

    def __init__(self, names: _Bindings) -> None:
        super().__init__()
        self.names = names
        self.scopes: list[int] = [0]
        self.loads: set[int] = set()
        self.nodes: dict[int, cst.Call] = {}
        self.assigned: dict[tuple[int, str], list[cst.BaseExpression]] = {}
        self.calls: list[tuple[tuple[int, ...], str, cst.Call]] = []  # (scope chain, receiver, call)
        self.optimizers: set[str] = set()  # receivers an FP16_Optimizer(...) is assigned to
        self.scope_of: dict[int, tuple[int, ...]] = {}  # id(expression) -> scope chain where it is evaluated
        self.entries: list[tuple[tuple[int, ...], str, cst.BaseExpression]] = []  # (chain, key, X) of X["optimizer"]

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.scopes.append(id(node))

    def leave_FunctionDef(self, original_node: cst.FunctionDef) -> None:
        self.scopes.pop()

    def visit_Call(self, node: cst.Call) -> None:
        func = dotted_name(node.func)
        if func is None:
            return
        head, _, last = func.rpartition(".")
        if (last == "load" and head in self.names.torch) or (not head and func in self.names.load):
            self.loads.add(id(node))
            self.nodes[id(node)] = node
        elif last == "load_state_dict" and head:
            self.calls.append((tuple(self.scopes), head, node))
        elif last == "get" and node.args and isinstance(node.func, cst.Attribute):
            self._entry(node.func.value, node.args[0].value)

    def visit_Subscript(self, node: cst.Subscript) -> None:
        if len(node.slice) == 1 and isinstance(node.slice[0].slice, cst.Index):
            self._entry(node.value, node.slice[0].slice.value)

    def _entry(self, container: cst.BaseExpression, key: cst.BaseExpression) -> None:
        value = key.evaluated_value if isinstance(key, cst.SimpleString) else None
        if isinstance(value, str) and _OPTIMIZER_NAME.fullmatch(value):
            self.entries.append((tuple(self.scopes), value, container))

    def _assign(self, targets: list[cst.BaseExpression], value: cst.BaseExpression | None) -> None:
        if value is None:
            return
        func = dotted_name(value.func) if isinstance(value, cst.Call) else None
        is_optimizer = func is not None and self.names.target(self.names.apex_path(func) or "") in _OPTIMIZERS
        for target in targets:
            name = dotted_name(target)
            if name is None:
                continue
            if is_optimizer:
                self.optimizers.add(name)
            if "." not in name:
                self.assigned.setdefault((self.scopes[-1], name), []).append(value)
                self.scope_of[id(value)] = tuple(self.scopes)

    def visit_Assign(self, node: cst.Assign) -> None:
        self._assign([t.target for t in node.targets], node.value)

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        self._assign([node.target], node.value)


def _parts(exprs: Iterator[cst.CSTNode]) -> Iterator[cst.CSTNode]:
    """The nodes of ``exprs`` that may carry a value (an attribute's name does not)."""
    stack = list(exprs)
    while stack:
        n = stack.pop()
        yield n
        stack.extend([n.value] if isinstance(n, cst.Attribute) else n.children)


def _reached(
    flow: _Flow, exprs: Iterator[cst.CSTNode], chain: tuple[int, ...], carried: dict[tuple[int, str], set[int]]
) -> set[int]:
    """The torch.load calls whose value ``exprs`` (evaluated in scope ``chain``) may hold."""
    found = set()
    for part in _parts(exprs):
        if id(part) in flow.loads:
            found.add(id(part))
        elif isinstance(part, cst.Name):
            scope = next((s for s in reversed(chain) if (s, part.value) in flow.assigned), None)
            if scope is not None:
                found |= carried.get((scope, part.value), set())
    return found


def resume_loads(module: cst.Module, *, megatron: bool = False) -> list[tuple[cst.CSTNode, str]]:
    """(node, message) for each torch.load call of ``module`` that the rule in the module docstring reports.

    (node, message) for each torch.load call of ``module`` the rule in the module docstring
    reports; the node is the call's ``torch.load`` (on the call's first line)."""
    names = _Bindings(megatron)
    module.visit(names)
    if not names.apex and not names.star:
        return []
    flow = _Flow(names)
    module.visit(flow)
    if (
        not (names.pickles or flow.optimizers) or not flow.loads
    ):  # apex.fp16_utils.FP16_Optimizer(...) after `import apex`
        return []
    carried: dict[tuple[int, str], set[int]] = {}
    changed = True
    while changed:  # names assigned from names: ckpt = torch.load(f); sd = ckpt["optimizer"]
        changed = False
        for key, values in flow.assigned.items():
            now = set().union(*(_reached(flow, iter([v]), flow.scope_of[id(v)], carried) for v in values))
            if now - carried.get(key, set()):
                carried[key] = carried.get(key, set()) | now
                changed = True
    reports: dict[int, str] = {}
    for chain, receiver, call in flow.calls:
        if receiver not in flow.optimizers and not _OPTIMIZER_NAME.fullmatch(receiver.rpartition(".")[2]):
            continue
        for load in _reached(flow, (a.value for a in call.args), chain, carried):
            reports.setdefault(load, MESSAGE.format(receiver=receiver))
    for chain, entry_key, container in flow.entries:
        for load in _reached(flow, iter([container]), chain, carried):
            reports.setdefault(load, ENTRY_MESSAGE.format(key=entry_key))
    return [(flow.nodes[i].func, message) for i, message in reports.items()]
