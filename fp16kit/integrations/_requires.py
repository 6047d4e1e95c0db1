"""Import an optional framework for an adapter module, or fail naming the extra to install."""

from __future__ import annotations

import importlib
import logging
from types import ModuleType

from packaging.version import Version

from ..core.log import log_once


def require(module: str, *, extra: str, tested: tuple[str, str]) -> ModuleType:
    """Import ``module`` or raise ``ImportError`` naming the extra to install.

    Import ``module`` (e.g. ``"lightning.pytorch"``) or raise ``ImportError`` naming
    ``pip install "fp16kit[<extra>]"``. ``tested = (lowest, below)`` is the version range the
    adapter is tested against (the extra's bounds); outside it the adapter still loads and
    logs one warning, since most releases keep the hooks it uses."""
    top = module.split(".")[0]
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"fp16kit.integrations.{extra} needs the {top!r} package: "
            f'pip install "fp16kit[{extra}]" (or pip install {top}).'
        ) from exc
    version = Version(importlib.import_module(top).__version__)
    low, high = (Version(v) for v in tested)
    if not low <= version < high:
        log_once(
            ("untested-version", top),
            "fp16kit.integrations.%s is tested with %s >= %s, < %s; found %s. It may work: report what breaks.",
            extra,
            top,
            low,
            high,
            version,
            level=logging.WARNING,
        )
    return mod
