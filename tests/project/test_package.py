"""The package as it ships: what ``import fp16kit`` shows and reaches, and what the source
distribution and the wheel hold (built here from a copy of the tree, with setuptools' own
build backend -- no network)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout


def test_import_shows_the_api_and_reaches_every_subpackage_without_a_framework():
    out = json.loads(
        _python(
            "import json, sys, fp16kit\n"
            "names = [n for n in dir(fp16kit) if not n.startswith('__')]\n"
            "reached = [fp16kit.optim.LAMB.__name__, fp16kit.nn.MixedLayerNorm.__name__,\n"
            "           fp16kit.legacy.FP16_Optimizer.__name__, fp16kit.integrations.__name__]\n"
            "frameworks = [m for m in ('lightning', 'accelerate', 'transformers') if m in sys.modules]\n"
            "print(json.dumps([names, reached, frameworks]))\n"
        )
    )
    names, reached, frameworks = out
    assert "torch" not in names and "warnings" not in names
    assert {"GradScaler", "MixedPrecisionOptimizer", "optim", "nn", "legacy", "integrations"} <= set(names)
    assert reached == ["LAMB", "MixedLayerNorm", "FP16_Optimizer", "fp16kit.integrations"]
    assert frameworks == []


def test_an_unknown_attribute_is_an_attribute_error():
    import fp16kit

    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        fp16kit.nonexistent  # noqa: B018


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """An sdist and a wheel built from a copy of the tree (the tree itself stays clean)."""
    tree = tmp_path_factory.mktemp("tree") / "fp16kit"
    shutil.copytree(
        ROOT,
        tree,
        ignore=shutil.ignore_patterns(
            ".git", "build", "dist", "*.egg-info", "__pycache__", ".ci-venv", ".pytest_cache"
        ),
    )
    out = tree.parent / "dist"
    for build in ("build_sdist", "build_wheel"):  # one process each: setuptools keeps state
        code = f"import sys; from setuptools import build_meta; build_meta.{build}(sys.argv[1])"
        subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, check=True, cwd=tree)
    (sdist,), (wheel,) = out.glob("*.tar.gz"), out.glob("*.whl")
    return sdist, wheel


def test_the_sdist_holds_the_tests_and_the_documents(built):
    sdist, _ = built
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    for needed in (
        "LICENSE",
        "README.md",
        "MIGRATION.md",
        "CHANGELOG.md",
        "pyproject.toml",
        "setup.cfg",
        "docs/architecture.md",
        "docs/async.md",
        "tests/_helpers/__init__.py",
        "tests/legacy/checkpoints/test_load.py",
        "tests/project/test_package.py",
        "fp16kit/py.typed",
    ):
        assert needed in names, f"the sdist lacks {needed}"
    assert any(n.startswith("examples/") for n in names)
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]


def test_the_wheel_holds_exactly_the_package_and_its_license(built):
    _, wheel = built
    with zipfile.ZipFile(wheel) as whl:
        names = whl.namelist()
        metadata = next(whl.read(n).decode() for n in names if n.endswith(".dist-info/METADATA"))
    tops = {n.split("/", 1)[0] for n in names}
    assert tops == {"fp16kit", next(t for t in tops if t.endswith(".dist-info"))}
    assert any(n.endswith("/LICENSE") for n in names)
    assert "License: BSD-3-Clause" in metadata or "License-Expression: BSD-3-Clause" in metadata


def test_the_sdists_own_tests_pass_from_its_unpacked_tree(built, tmp_path):
    # A sample that needs the helpers, the docs and the package together: the layering and
    # citation rules, the api page, a core module, a legacy checkpoint test.
    sdist, _ = built
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp_path, filter="data")
    (tree,) = tmp_path.iterdir()
    sample = [
        "tests/project/test_layering.py",
        "tests/project/test_citations.py",
        "tests/project/test_api_reference.py",
        "tests/core/test_scale_rules.py",
        "tests/legacy/checkpoints/test_load.py",
    ]
    env = {**__import__("os").environ, "PYTHONPATH": str(tree)}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *sample],
        capture_output=True,
        text=True,
        cwd=tree,
        env=env,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "passed" in run.stdout and str(tree) in _python_in(tree, env)


def _python_in(tree: Path, env: dict) -> str:
    code = "import fp16kit; print(fp16kit.__file__)"
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tree, env=env
    ).stdout
