"""The ``apex`` distribution the apex alias reports while it stands in for all of apex.

So that checks of apex's package metadata see it installed, as they saw NVIDIA apex::

    importlib.metadata.version("apex")            -> "0.1"   (NVIDIA apex's setup.py never changed
                                                              it: every build reported 0.1)
    importlib.metadata.distribution("apex")       -> Name apex, Summary naming fp16kit.legacy
    importlib.metadata.packages_distributions()   -> {"apex": ["apex"], ...}  (top_level.txt)
    files, requires, entry points                 -> none

It is found through the alias's finder on ``sys.meta_path`` (``find_distributions``), so it goes
away with the alias. ``pkg_resources`` scans ``sys.path`` folders instead and does not see it.
"""

from __future__ import annotations

import os
import pathlib
import re
import sys
from collections.abc import Iterator
from importlib.metadata import Distribution, DistributionFinder

__all__ = ["APEX_VERSION", "ApexDistribution", "find_apex_distribution"]

APEX_VERSION = "0.1"

_METADATA = f"""\
Metadata-Version: 2.1
Name: apex
Version: {APEX_VERSION}
Summary: fp16kit's apex alias: apex's API from fp16kit.legacy (not NVIDIA apex)
"""


class ApexDistribution(Distribution):
    """The alias's ``apex``: metadata and top_level.txt only."""

    def read_text(self, filename: str) -> str | None:
        if filename in ("METADATA", "PKG-INFO"):
            return _METADATA
        if filename == "top_level.txt":
            return "apex\n"
        return None

    def locate_file(self, path: str | os.PathLike[str]) -> pathlib.Path:
        # where fp16kit is installed: the folder its own distribution's files are relative to
        return pathlib.Path(__file__).resolve().parents[2] / path


def find_apex_distribution(context: DistributionFinder.Context) -> Iterator[Distribution]:
    """Return ``ApexDistribution`` when ``context`` asks for ``apex`` (or for all) on the interpreter's own path.

    ``ApexDistribution`` when ``context`` asks for ``apex`` (any spelling PEP 503 equates) or for
    all, on the interpreter's own path: a search of other folders (``distributions(path=[...])``,
    an installer looking at a target directory) must not find it there."""
    if list(context.path) != sys.path:
        return
    name = context.name
    if name is None or re.sub(r"[-_.]+", "-", name).lower() == "apex":
        yield ApexDistribution()
