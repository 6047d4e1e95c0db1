"""DESIGN.md's house rules that a test can see: imports point down; no host reads in kernels;
no print() in the library; classes a reader can take in one sitting; objects talk through the
documented protocol, not through each other's private attribute names."""

from __future__ import annotations

import ast
import pathlib

import fp16kit

PKG = pathlib.Path(fp16kit.__file__).parent
FACES = (
    "fp16kit.grad_scaler", "fp16kit.scaler_thread", "fp16kit.legacy", "fp16kit.optimizer",
    "fp16kit.async_step", "fp16kit.master_groups", "fp16kit.master_grads", "fp16kit.step_state",
    "fp16kit.step_snapshot", "fp16kit.master_checkpoint", "fp16kit.wrapping", "fp16kit.cli",
    "fp16kit.demo", "fp16kit.optim", "fp16kit.nn", "fp16kit.distributed", "fp16kit.migrate",
    "fp16kit.integrations",
)


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    package = ".".join(path.relative_to(PKG.parent).with_suffix("").parts[:-1])
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            names.add(mod)
            names.update(f"{mod}.{a.name}" for a in node.names)
    return names


def test_core_imports_no_face():
    for path in (PKG / "core").glob("*.py"):
        bad = {n for n in _imports(path) if n.startswith(FACES)}
        assert not bad, f"{path.name} imports a face: {sorted(bad)}"


def test_kernels_never_read_tensors_on_the_host():
    src = (PKG / "core" / "kernels.py").read_text()
    code = ast.parse(src)
    calls = {
        node.func.attr
        for node in ast.walk(code)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
    }
    assert not calls & {"item", "tolist", "numpy", "cpu"}
    conversions = [
        node.lineno
        for node in ast.walk(code)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("bool", "float", "int")
    ]
    assert not conversions, f"bool()/float()/int() in kernels.py at lines {conversions}"


def test_library_never_prints():
    for path in PKG.rglob("*.py"):
        if path.name == "__main__.py" or path.parent.name == "cli":  # the CLI writes to stdout
            continue
        tree = ast.parse(path.read_text())
        prints = [
            n.lineno for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "print"
        ]
        assert not prints, f"print() in {path.relative_to(PKG)} at lines {prints}"


def test_legacy_holds_no_tensor_math():
    # DESIGN.md rule 1: every tensor operation on grads, masters or scales runs in the core.
    import re

    pattern = re.compile(
        r"torch\._amp_|torch\._foreach_|torch\.linalg\.|torch\.norm\(|\.mul_\(|\.copy_\(|\.add_\(|\.div_\("
    )
    for path in (PKG / "legacy").rglob("*.py"):  # subpackages (legacy.amp) too
        hits = [i + 1 for i, line in enumerate(path.read_text().splitlines()) if pattern.search(line)]
        assert not hits, f"tensor math in {path.relative_to(PKG)} at lines {hits}"


def test_faces_import_downwards_only():
    modern = [*PKG.glob("*.py"), *(p for d in ("optim", "nn", "distributed", "integrations") for p in (PKG / d).rglob("*.py"))]
    for path in modern:  # the modern face never imports the legacy one
        bad = {n for n in _imports(path) if n.startswith("fp16kit.legacy")}
        assert not bad, f"{path.name} imports the legacy face: {sorted(bad)}"


def test_classes_stay_readable():
    # GradScaler no longer than torch's own class (662 lines); every other class ~400.
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                limit = 662 if node.name == "GradScaler" else 425
                size = node.end_lineno - node.lineno + 1
                assert size <= limit, f"{path.relative_to(PKG)}: {node.name} has {size} lines"


def test_no_private_attribute_protocol_between_objects():
    # The scaler <-> optimizer contract is fp16kit.core.protocol, not ``_fp16kit_*`` hooks.
    for path in PKG.rglob("*.py"):
        assert "_fp16kit_" not in path.read_text(), f"{path.relative_to(PKG)} uses a _fp16kit_ hook"
