"""apex's O1 lists (:mod:`.lists`) read into one rule per function object, at each O1 initialize.

``read()`` returns a :class:`Rules`: ``{function: (kind, name)}`` for the objects torch hands a
``TorchFunctionMode`` (``torch.Tensor.sum`` for ``x.sum()``, ``F.softmax``, ``Tensor.add`` for
``a + b``), kind one of ``fp16``, ``fp32``, ``promote``, ``banned``, ``fp32_inplace_fn``,
``fp32_inplace_method``; and for each banned name its message and the rule it has besides
(apex checked the ban outside every other wrapper). How entries reach functions: the
:mod:`.lists` docstring. Besides the lists, the RNN functions (``torch.lstm``, the cells) run in
fp16: apex re-routed them itself, no list names them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from . import lists

__all__ = ["Rules", "read"]

RNN_FUNCS = ("lstm", "gru", "rnn_tanh", "rnn_relu", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell")

_MODULES = (lists.functional_overrides, lists.torch_overrides, lists.tensor_overrides)

# apex's order of wrapping, innermost (the one that decides) first: (lists module, list, kind)
_ORDER = tuple(
    (module, list_name, kind)
    for module in _MODULES
    for list_name, kind in (("FP16_FUNCS", "fp16"), ("FP32_FUNCS", "fp32"))
) + tuple(
    (module, list_name, "promote")
    for module in (lists.torch_overrides, lists.tensor_overrides)
    for list_name in ("CASTS", "SEQUENCE_CASTS")
)

# Operators torch hands to a mode as the method they call (``a + b`` as Tensor.add); the others
# (``__eq__``, ``__rsub__``, ``__rdiv__``, ``__rpow__``, ``__ipow__``) are handed as themselves,
# and the in-place ones (``h += f`` as Tensor.add_) are left to torch.
_HANDED_AS = {
    "__add__": ("add",),
    "__radd__": ("add",),
    "__sub__": ("sub",),
    "__mul__": ("mul",),
    "__rmul__": ("mul",),
    "__div__": ("div",),
    "__truediv__": ("div",),
    "__ne__": ("ne",),
    "__lt__": ("lt",),
    "__le__": ("le",),
    "__gt__": ("gt",),
    "__ge__": ("ge",),
    "__pow__": ("pow",),
    "__matmul__": ("matmul", "__rmatmul__"),
}


@dataclass
class Rules:
    """What :class:`.o1_lists.ApexLists` applies: a rule per function, apex's ban messages."""

    by_function: dict[Callable[..., Any], tuple[str, str]] = field(default_factory=dict)
    banned: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (message, rule besides)


def _key(module: Any) -> str:
    return module.__name__.rpartition(".")[2]


def _names(module: Any, name: str) -> tuple[str, ...]:
    return (name, *_HANDED_AS.get(name, ())) if _key(module) == "tensor_overrides" else (name,)


def _functions(namespace: Any, names: tuple[str, ...]) -> Iterator[tuple[str, Callable[..., Any]]]:
    """``(attribute name, function)`` for each of ``names`` the namespace has as a function."""
    for name in names:
        fn = getattr(namespace, name, None)
        if callable(fn) and not isinstance(fn, type):
            yield name, fn


def _check(module: Any, list_name: str, value: Any) -> list[Any]:
    if not isinstance(value, (list, tuple)):
        raise TypeError(
            f"amp.lists.{_key(module)}.{list_name} is {type(value).__name__}, not a list: keep apex's "
            f"list and edit it in place before amp.initialize ({list_name}.append('name'), .remove('name'))."
        )
    for entry in value:
        ok = (
            isinstance(entry, tuple) and len(entry) == 2 and all(isinstance(e, str) for e in entry)
            if list_name == "BANNED_FUNCS"
            else isinstance(entry, str)
        )
        if not ok:
            form = "(name, message) pairs of strings" if list_name == "BANNED_FUNCS" else "function names (strings)"
            raise TypeError(
                f"amp.lists.{_key(module)}.{list_name} holds {entry!r}: apex's lists hold {form}, "
                f"e.g. {list_name}.append({'(name, message)' if list_name == 'BANNED_FUNCS' else repr('softmax')}). "
                "Fix the entry before amp.initialize."
            )
    return list(value)


def _entries() -> list[tuple[Any, str, str]]:
    """``(lists module, kind, name)`` for every entry, in apex's order of wrapping, checked."""
    entries = []
    for module, list_name, kind in _ORDER:
        entries += [(module, kind, name) for name in _check(module, list_name, getattr(module, list_name))]
    return entries


def read() -> Rules:
    """Return the lists as they stand now, as rules (see the module docstring).

    The lists as they stand now, as rules (see the module docstring); TypeError, naming the
    list and the fix, for an entry that is not a name."""
    entries = _entries()
    banned = _check(lists.functional_overrides, "BANNED_FUNCS", lists.functional_overrides.BANNED_FUNCS)
    rules = Rules()
    by_function = rules.by_function
    # in place first: apex put its errors outside the casts of the same names
    for module, kind in ((lists.torch_overrides, "fp32_inplace_fn"), (lists.tensor_overrides, "fp32_inplace_method")):
        inplace = tuple(name + "_" for name in module.FP32_FUNCS if not name.startswith("__"))
        for attr, fn in _functions(module.MODULE, inplace):
            by_function.setdefault(fn, (kind, attr))
    own: dict[Callable[..., Any], tuple[str, str]] = {}
    for module, kind, name in entries:
        for attr, fn in _functions(module.MODULE, _names(module, name)):
            own.setdefault(fn, (kind, attr))
    for fn, rule in own.items():
        by_function.setdefault(fn, rule)
    reached = _shipped() | set(own)
    for module, kind, name in entries:  # the same name in the other namespaces, where apex's lists do not reach
        aliases = tuple(n for n in _names(module, name) if not n.startswith("__"))
        for other in _MODULES:
            if other is not module:
                for attr, fn in _functions(other.MODULE, aliases):
                    if fn not in reached:
                        by_function.setdefault(fn, (kind, attr))
    for attr, fn in _functions(lists.torch_overrides.MODULE, RNN_FUNCS):
        by_function.setdefault(fn, ("fp16", attr))
    for name, message in banned:  # F.<name> only, as apex; banned twice: the last message (outermost)
        for _, fn in _functions(lists.functional_overrides.MODULE, (name,)):
            besides = rules.banned[name][1] if name in rules.banned else by_function.get(fn, ("fp32", name))[0]
            rules.banned[name] = (message, besides)
            by_function[fn] = ("banned", name)
    return rules


def _shipped() -> set[Callable[..., Any]]:
    """The functions apex's lists as shipped name in their own namespace."""
    return {fn for m in _MODULES for name in lists._SHIPPED[_key(m)] for _, fn in _functions(m.MODULE, _names(m, name))}
