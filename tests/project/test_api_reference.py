"""docs/api.md lists every public name: regenerated here and compared, so it cannot go stale."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _generator():
    spec = importlib.util.spec_from_file_location("make_api", DOCS / "make_api.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_public_package_declares_its_names():
    missing = [name for name in _generator().public_packages() if not hasattr(importlib.import_module(name), "__all__")]
    assert not missing, f"public packages without __all__: {missing}"


def test_every_public_name_exists():
    gen = _generator()
    for package in gen.public_packages():
        module = importlib.import_module(package)
        for name in getattr(module, "__all__", ()):
            assert hasattr(module, name), f"{package}.__all__ names {name!r}, which it lacks"


def test_api_page_is_current():
    gen = _generator()
    assert (DOCS / "api.md").read_text() == gen.render(), (
        "docs/api.md is stale: run `python docs/make_api.py` and commit the result"
    )


def test_no_entry_stops_mid_sentence():
    # Each entry is a docstring's first line, so every public docstring must open with a
    # one-line summary (PEP 257): a whole sentence, then a blank line.
    page = (DOCS / "api.md").read_text()
    cut = [
        line.strip()
        for line in page.splitlines()
        if " — " in line and not line.rstrip().endswith((".", "?", "!", ":", ")", "`"))
    ]
    assert not cut, f"{len(cut)} entries stop mid-sentence, e.g.:\n" + "\n".join(cut[:15])


def test_every_public_name_of_ours_has_a_docstring():
    page = (DOCS / "api.md").read_text()
    bare = [line.strip() for line in page.splitlines() if line.endswith("— (undocumented)")]
    assert not bare, f"{len(bare)} public names have no docstring, e.g.:\n" + "\n".join(bare[:15])
