"""apex's argument rule for O1 casts (apex/amp/utils.py ``casted_args``), shared by the
decorators of :mod:`.casts` and the op lists of :mod:`.o1_lists`.

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


def _convert_unit(x: Any, convert: Convert) -> Any:
    if isinstance(x, (list, tuple)):
        return _rebuild(x, [_convert_unit(y, convert) for y in x])
    return convert(x)


def float_tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """Every floating tensor the rule would hand to ``convert``."""
    return [t for a in (*args, *kwargs.values()) if _is_unit(a) for t in _leaves(a)]


def cast_args(args: tuple, kwargs: dict, convert: Convert, keep: tuple[str, ...] = ()) -> tuple[list, dict]:
    """``(args, kwargs)`` with ``convert`` applied to every floating tensor of the rule (keyword
    arguments named in ``keep`` pass as they are)."""
    new_args = [_convert_unit(a, convert) if _is_unit(a) else a for a in args]
    new_kwargs = {k: (_convert_unit(v, convert) if k not in keep and _is_unit(v) else v) for k, v in kwargs.items()}
    return new_args, new_kwargs
