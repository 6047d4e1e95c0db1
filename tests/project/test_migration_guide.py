"""MIGRATION.md covers every name fp16kit.legacy exports, and every apex module the tools map."""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import fp16kit.legacy
from fp16kit.legacy.apex_alias import apex_map

GUIDE = (Path(__file__).resolve().parents[2] / "MIGRATION.md").read_text(encoding="utf-8")
# what the guide mentions as code: `...` spans and fenced blocks
CODE = " ".join(re.findall(r"`([^`\n]+)`", GUIDE)) + " ".join(re.findall(r"```\w*\n(.*?)```", GUIDE, re.S))


def _legacy_modules() -> list[str]:
    """fp16kit.legacy's packages, and every module an apex (or Megatron) path maps to, except
    apex.amp's internals (kept importable for old code, not part of the documented API)."""
    names = {"fp16kit.legacy"}
    for info in pkgutil.walk_packages(fp16kit.legacy.__path__, "fp16kit.legacy."):
        if info.ispkg and not any(part.startswith("_") for part in info.name.split(".")):
            names.add(info.name)
    names.update(
        target for target in apex_map.module_map(megatron=True).values() if not target.startswith("fp16kit.legacy.amp.")
    )
    return sorted(names)


def _mentioned(name: str) -> bool:
    return re.search(rf"(?<![\w]){re.escape(name)}(?![\w])", CODE) is not None


def test_every_exported_legacy_name_is_in_the_guide():
    missing = []
    for package in _legacy_modules():
        module = importlib.import_module(package)
        for name in getattr(module, "__all__", ()):
            if not _mentioned(name):
                missing.append(f"{package}.{name}")
    assert not missing, f"MIGRATION.md does not mention: {missing}"


def test_every_covered_apex_module_is_in_the_guide():
    # the top-level packages of every apex path the import alias and the codemod map
    roots = {
        path.split(".")[1]
        for path in apex_map.module_map(megatron=False)
        if path.count(".") >= 1 and path.startswith("apex.")
    }
    missing = [r for r in sorted(roots) if not _mentioned(f"apex.{r}")]
    assert not missing, f"MIGRATION.md does not mention apex modules: {missing}"
