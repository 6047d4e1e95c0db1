"""apex's argument rule for O1 casts (apex/amp/utils.py ``casted_args``).

Shared by the decorators of :mod:`.casts` and the op lists of :mod:`.o1_lists`.

Top-level positional and keyword arguments only; a list or tuple counts as one unit when all its
items (recursively) are floating tensors, and is then rebuilt with every item converted (RNN
weights, ``torch.cat``'s list, an LSTM's ``(h, c)``); anything else passes untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["cast_args", "float_tensors", "is_float_tensor"]

Convert = Callable[[torch.Tensor], torch.Tensor]


def is_float_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def _is_unit(x: Any) -> bool:
    if isinstance(x, (list, tuple)):
        return all(_is_unit(y) for y in x)
    return is_float_tensor(x)


def _leaves(x: Any) -> Iterator[torch.Tensor]:
    if isinstance(x, (list, tuple)):
        for y in x:
            yield from _leaves(y)
    else:
        yield x


def _rebuild(x: Any, items: list) -> Any:
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # namedtuple
        return type(x)(*items)
    return type(x)(items)


def _convert(x: Any, convert: Convert) -> Any:
    if isinstance(x, torch.Tensor):
        return convert(x) if x.is_floating_point() else x
    if isinstance(x, (list, tuple)) and x and _is_unit(x):
        return _rebuild(x, [_convert(y, convert) for y in x])
    return x


def float_tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """Every floating tensor the rule would hand to ``convert``."""
    return [t for a in (*args, *kwargs.values()) if _is_unit(a) for t in _leaves(a)]


def cast_args(args: tuple, kwargs: dict, convert: Convert, keep: tuple[str, ...] = ()) -> tuple[list, dict]:
    """Return ``(args, kwargs)`` with ``convert`` applied to every floating tensor of the rule.

    ``(args, kwargs)`` with ``convert`` applied to every floating tensor of the rule (keyword
    arguments named in ``keep`` pass as they are)."""
    new_args = [_convert(a, convert) for a in args]
    new_kwargs = {k: (v if k in keep else _convert(v, convert)) for k, v in kwargs.items()} if kwargs else {}
    return new_args, new_kwargs
