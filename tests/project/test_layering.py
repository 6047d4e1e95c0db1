"""The house rules a test can see (docs/architecture.md §2): the folders are the layers and
imports point down; no import cycle; no host reads in kernels; no print() in the library;
classes a reader can take in one sitting; objects talk through the documented protocols, not
through each other's private attribute names."""

from __future__ import annotations

import ast
import pathlib
import re

import fp16kit

PKG = pathlib.Path(fp16kit.__file__).parent

# Each folder of fp16kit/ is one concern; a folder may import the folders of lower layers (and
# the core, which every layer stands on). The top-level package is the public front.
MODERN = ("scaler", "master_weights", "optim", "nn", "distributed")
LAYER = {
    "core": 0,
    **dict.fromkeys(MODERN, 1),
    "legacy": 2,
    "integrations": 2,
    "migrate": 3,
    "demo": 3,
    "bench": 3,
    "cli": 4,
}


def _module(path: pathlib.Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module(p): p for p in PKG.rglob("*.py")}


def _imports(path: pathlib.Path) -> set[str]:
    """Every fp16kit module or name ``path`` imports, anywhere in it (lazy and TYPE_CHECKING
    imports too: they are dependencies all the same), as absolute dotted names."""
    module = _module(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            names.update(f"{mod}.{a.name}" for a in node.names)
    return {n for n in names if n == "fp16kit" or n.startswith("fp16kit.")}


def _owner(name: str) -> str:
    """The module a dotted import name lives in (``fp16kit.core.kernels.unscale_`` -> kernels)."""
    while name not in MODULES and "." in name:
        name = name.rpartition(".")[0]
    return name


def _folder(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and (PKG / parts[1]).is_dir() else ""


IMPORTS = {m: _imports(p) for m, p in MODULES.items()}


def _edges():
    for module, names in IMPORTS.items():
        for name in names:
            yield module, name, _owner(name)


def test_every_folder_has_a_layer():
    folders = {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(LAYER), f"give each folder a layer: {sorted(folders ^ set(LAYER))}"


def test_imports_point_down():
    bad = []
    for module, name, target in _edges():
        a, b = _folder(module), _folder(target)
        if not a or not b or a == b:
            continue  # the top-level package re-exports the faces; a folder imports itself
        if LAYER[b] >= LAYER[a] and not (a in MODERN and b in MODERN):
            bad.append(f"{module} imports {name}")
    assert not bad, "an import that points up or sideways:\n" + "\n".join(sorted(bad))


def test_the_core_imports_only_the_core():
    bad = [f"{m} imports {n}" for m, n, t in _edges() if _folder(m) == "core" and _folder(t) != "core"]
    assert not bad, "\n".join(bad)


def test_scaler_and_master_weights_talk_only_through_the_core_protocol():
    pairs = {("scaler", "master_weights"), ("master_weights", "scaler")}
    bad = [f"{m} imports {n}" for m, n, t in _edges() if (_folder(m), _folder(t)) in pairs]
    assert not bad, "use fp16kit.core.protocol:\n" + "\n".join(bad)


def test_other_folders_use_only_public_names():
    # Outside its folder, a folder is reached through names without a leading underscore,
    # in modules without one (the core included: its modules are its interface).
    bad = []
    for module, name, target in _edges():
        if _folder(target) in ("", _folder(module)):
            continue
        inner = name[len("fp16kit.") :].split(".")[1:]
        if any(part.startswith("_") for part in inner):
            bad.append(f"{module} imports {name}")
    assert not bad, "a private name of another folder:\n" + "\n".join(sorted(bad))


def test_no_import_cycle():
    graph = {m: {t for _, _, t in ((m, n, _owner(n)) for n in IMPORTS[m]) if t in MODULES and t != m} for m in MODULES}
    # A package's __init__ importing its own modules is how it exports them, not a cycle back.
    for m in graph:
        graph[m] = {t for t in graph[m] if not m.startswith(t + ".") or MODULES[t].name != "__init__.py"}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_kernels_never_read_tensors_on_the_host():
    src = (PKG / "core" / "kernels.py").read_text()
    code = ast.parse(src)
    calls = {
        node.func.attr for node in ast.walk(code) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
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
            n.lineno
            for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "print"
        ]
        assert not prints, f"print() in {path.relative_to(PKG)} at lines {prints}"


def test_legacy_holds_no_tensor_math():
    # DESIGN.md rule 1: every tensor operation on grads, masters or scales runs in the core.
    pattern = re.compile(
        r"torch\._amp_|torch\._foreach_|torch\.linalg\.|torch\.norm\(|\.mul_\(|\.copy_\(|\.add_\(|\.div_\("
    )
    for path in (PKG / "legacy").rglob("*.py"):  # subpackages (legacy.amp) too
        hits = [i + 1 for i, line in enumerate(path.read_text().splitlines()) if pattern.search(line)]
        assert not hits, f"tensor math in {path.relative_to(PKG)} at lines {hits}"


def test_classes_stay_readable():
    # Every class ~400 lines, GradScaler included: its thread routing, checkpoints and optimizer
    # kinds live in modules of their own (fp16kit/scaler/).
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                limit = 425
                size = node.end_lineno - node.lineno + 1
                assert size <= limit, f"{path.relative_to(PKG)}: {node.name} has {size} lines"


def test_no_private_attribute_protocol_between_objects():
    # The scaler <-> optimizer contract is fp16kit.core.protocol, not ``_fp16kit_*`` hooks.
    for path in PKG.rglob("*.py"):
        assert "_fp16kit_" not in path.read_text(), f"{path.relative_to(PKG)} uses a _fp16kit_ hook"
