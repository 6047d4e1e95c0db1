"""An opt-in import hook: ``import apex`` (and every apex module fp16kit covers) resolves to fp16kit.legacy.

For running apex-era code unmodified -- or, beside a real apex that lacks apex.amp /
apex.fp16_utils (NVIDIA apex >= 25.x, as NGC containers ship it), only what that apex lacks does.

Contract::

    install_apex_alias(megatron=False, shadow=False):
        a real `apex` package imported or importable (not a namespace folder), shadow=False:
            it has apex.amp and apex.fp16_utils (apex before 25.x: the alias is not needed)
                                        -> refuse (RuntimeError, nothing changed), as below
            it lacks either             -> COMPLEMENT it (one INFO line on the "fp16kit" logger names
                                           the covered modules it lacks, outermost only):
                `apex`, and every module the real apex provides (found by the finders after the
                alias's, as plain python would): the real one, its own loader and spec
                a covered module it lacks (apex.amp, apex.fp16_utils, ... and all below them):
                    fp16kit's, as in the table below; also set as an attribute of its real parent
                    package as soon as that is imported (or at install, if it already is), so
                    `import apex; apex.amp.initialize(...)` works
                an uncovered module it lacks -> ModuleNotFoundError naming the replacement
                `amp_C`: not claimed (the real apex's compiled extension, which its code probes)
                the real apex failing to import: its error, with a note naming shadow=True
        otherwise refuse (RuntimeError, nothing changed) if a real `apex` (or `amp_C`) is imported
            or importable (or `fp16` with megatron=True), unless shadow=True
        put one finder first on sys.meta_path; it claims every name under `apex`, `amp_C` and `apex_C`
        (with megatron: `fp16`, `megatron.fp16`, and `megatron` itself when no real Megatron exists)
        no real apex (or shadow=True): availability checks see apex installed and imported --
            sys.modules["apex"] is the synthetic root at once ('apex' in sys.modules), find_spec /
            pkgutil.find_loader find every covered module, and importlib.metadata reports an `apex`
            distribution, version 0.1 (fp16kit.legacy.apex_alias.distribution); `apex.__version__` stays
            missing, as in every apex; pkgutil.iter_modules (a scan of sys.path folders) does not list it
        complementing a real apex: its own sys.modules state, find_spec and metadata stand
        torch's weights-only allow-list gets fp16kit's loss-scaler classes (those alone) under the apex
            and Megatron class paths the alias maps to them, and under their own: `torch.load(f)`, torch
            >= 2.6's default (weights_only=True), reads the scalers apex-era optimizer checkpoints
            pickled, as the full unpickler does under the alias (fp16kit.legacy.checkpoints.safe_globals; a path
            the user's own entry already claims is left to it)
    import apex.X.Y (no real apex, shadow=True, or below a module that is fp16kit's):
        apex_map says apex.X.Y is module T  -> sys.modules["apex.X.Y"] is sys.modules[T]
                                               (the same object: isinstance, pickling, state stay one)
        `apex`, `apex.contrib`              -> a synthetic package whose attributes are the covered
                                               submodules, imported on first access (so that
                                               `from apex.contrib import xentropy` still says what to use)
        anything else under apex            -> ImportError naming fp16kit and the closest replacement
    uninstall_apex_alias():
        remove the finder and every sys.modules entry it made, and every attribute it set on a real
        package (a real apex imported meanwhile stays imported, as it is); restore what shadow=True hid;
        take off torch's weights-only list exactly what install put on it (what others added stays)

fp16kit never ships or installs a package named ``apex`` (PyPI's ``apex`` is an unrelated project).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import logging
import os
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any

from ..checkpoints import safe_globals
from . import apex_map
from .distribution import find_apex_distribution

__all__ = ["install_apex_alias", "uninstall_apex_alias", "apex_alias_installed"]

logger = logging.getLogger("fp16kit")

_LOCK = threading.RLock()
_MISSING = object()


def _alias_error(fullname: str, megatron: bool) -> ImportError:
    # plain ImportError, not ModuleNotFoundError: `from apex import RNN` would swallow the latter
    # (importlib ignores a missing submodule named in a fromlist) and lose the hint
    hint = apex_map.hint_for(fullname, megatron=megatron)
    return ImportError(f"No module named {fullname!r} under fp16kit's apex alias: {hint}", name=fullname)


class _AliasLoader(importlib.abc.Loader):
    """Hands back an existing fp16kit module (or the synthetic root) for an apex name."""

    def __init__(self, finder: _ApexAliasFinder, fullname: str, target: str | None) -> None:
        self._finder = finder
        self._fullname = fullname
        self._target = target  # None: the synthetic root package
        self._saved_spec: Any = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        if self._target is None:
            return self._finder.synthetic_root(spec.name)
        module = sys.modules.get(self._target) or importlib.import_module(self._target)
        # the import system sets module.__spec__ to ours right after this; exec_module puts it back
        self._saved_spec = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        if self._target is not None:
            module.__spec__ = self._saved_spec
        self._finder.loaded(self._fullname, module)

    # runpy (`fp16kit run -m apex.parallel.multiproc`) asks the loader for the code
    def get_code(self, fullname: str) -> types.CodeType | None:
        if self._target is None:
            return None
        spec = importlib.util.find_spec(self._target)
        return spec.loader.get_code(self._target) if spec and spec.loader else None  # type: ignore[attr-defined]

    def is_package(self, fullname: str) -> bool:
        if self._target is None:
            return True
        spec = importlib.util.find_spec(self._target)
        return bool(spec and spec.submodule_search_locations is not None)


class _RealPackageLoader(importlib.abc.Loader):
    """The real apex's own loader for one of its packages, which then gets the covered submodules it
    lacks (see _ApexAliasFinder.fill_in). The module's spec and __loader__ name the real loader."""

    def __init__(self, finder: _ApexAliasFinder, real: Any) -> None:
        self._finder = finder
        self._real = real

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._real.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        if module.__spec__ is not None:
            module.__spec__.loader = self._real
        module.__loader__ = self._real
        try:
            self._real.exec_module(module)
        except Exception as e:
            if module.__name__ == "apex" and sys.version_info >= (3, 11):  # add_note is 3.11's
                e.add_note(
                    "(fp16kit's apex alias left `import apex` to the installed apex, which failed; to use fp16kit.legacy "
                    "for all of apex instead: install_apex_alias(shadow=True) or `fp16kit run --shadow`)"
                )
            raise
        self._finder.fill_in(module)

    def __getattr__(self, name: str) -> Any:  # get_code, is_package, get_resource_reader, ...: the real loader's
        return getattr(self._real, name)


class _ApexAliasFinder(importlib.abc.MetaPathFinder):
    """The finder install_apex_alias() puts first on sys.meta_path."""

    def __init__(self, *, megatron: bool, shadow: bool, synthetic_megatron: bool, complement: bool = False) -> None:
        self.megatron = megatron
        self.shadow = shadow
        self.complement = complement  # a real apex is installed: fill in only what it lacks
        self.synthetic_megatron = synthetic_megatron
        self.table = {**apex_map.module_map(megatron=megatron), **apex_map.STAR_MODULES}
        self.created: dict[str, types.ModuleType] = {}  # sys.modules entries this finder made
        self.parent_attrs: list[tuple[types.ModuleType, str, Any]] = []  # attributes set on foreign parents
        self.hidden: dict[str, types.ModuleType] = {}  # real modules hidden by shadow=True
        self.lacking: tuple[str, ...] = ()  # complementing: the covered modules the real apex lacks
        self.safe_globals: list[Any] = []  # what it put on torch's weights-only list

    def claims(self, fullname: str) -> bool:
        root = fullname.partition(".")[0]
        if root in apex_map.ROOTS:
            # amp_C / apex_C are the real apex's own compiled extensions, which its code probes: left to it
            return not (self.complement and root in ("amp_C", "apex_C"))
        if not self.megatron:
            return False
        if root == "fp16" or fullname == "megatron.fp16" or fullname.startswith("megatron.fp16."):
            return True
        return root == "megatron" and self.synthetic_megatron

    def fp16kit_module(self, fullname: str) -> str | None:
        """The fp16kit module ``import <fullname>`` gives under this alias, or None (not claimed, or
        the real apex's)."""
        if not self.claims(fullname) or fullname not in self.table or fullname in apex_map.CLOSED:
            return None
        if (
            self.complement
            and fullname.partition(".")[0] == "apex"
            and not any(fullname == m or fullname.startswith(m + ".") for m in self.lacking)
        ):
            return None
        return self.table[fullname]

    def find_distributions(self, context: Any = None) -> Iterator[importlib.metadata.Distribution]:
        """importlib.metadata's hook: the alias's ``apex`` distribution, unless a real apex is complemented
        (its own metadata stands)."""
        if self.complement:
            return iter(())
        return find_apex_distribution(
            context if context is not None else importlib.metadata.DistributionFinder.Context()
        )

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if not self.claims(fullname):
            return None
        if self.complement and fullname.partition(".")[0] == "apex":
            return self._complement_spec(fullname, path, target)
        return self._alias_spec(fullname)

    def _complement_spec(self, fullname: str, path: Any, target: Any) -> importlib.machinery.ModuleSpec | None:
        """A real apex is installed: what it provides is its own, the covered rest is fp16kit's."""
        parent = fullname.rpartition(".")[0]
        if fullname == "apex" or (parent in sys.modules and parent not in self.created):  # a real package
            spec = _find_real(fullname, path, target)
            if spec is not None:
                return self._watch(spec)
            if fullname == "apex":
                return None
            if fullname not in self.table:
                hint = apex_map.hint_for(fullname, megatron=self.megatron)
                raise ModuleNotFoundError(
                    f"No module named {fullname!r}: the installed apex does not have it, nor does fp16kit ({hint})",
                    name=fullname,
                )
        return self._alias_spec(fullname)  # missing from the real apex, or below a module that is fp16kit's

    def _watch(self, spec: importlib.machinery.ModuleSpec) -> importlib.machinery.ModuleSpec:
        """A real apex package some covered submodule may be missing from: complement it once it has run."""
        if (
            spec.loader is not None
            and spec.submodule_search_locations is not None
            and any(k.rpartition(".")[0] == spec.name for k in self.table)
        ):
            spec.loader = _RealPackageLoader(self, spec.loader)
        return spec

    def fill_in(self, package: types.ModuleType) -> None:
        """Import the covered submodules the real package ``package`` lacks (fp16kit's), which also sets
        them as its attributes (undone at uninstall): `import apex; apex.amp.initialize(...)` works."""
        name = package.__spec__.name if package.__spec__ is not None else package.__name__
        folders = list(getattr(package, "__path__", None) or [])
        for child in sorted(k for k in self.table if k.rpartition(".")[0] == name):
            if child in sys.modules or _find_real(child, folders, None) is not None:
                continue
            try:
                importlib.import_module(child)
            except Exception as e:  # noqa: BLE001 -- one fp16kit module failing must not break `import apex`
                # (importing that module by name raises the same error, with its traceback)
                logger.debug("apex alias: %s not added to the installed apex: %r", child, e)

    def _alias_spec(self, fullname: str) -> importlib.machinery.ModuleSpec:
        if fullname in apex_map.CLOSED or (fullname == "megatron" and self.synthetic_megatron):
            loader = _AliasLoader(self, fullname, None)
            return importlib.machinery.ModuleSpec(fullname, loader, is_package=True)
        if fullname.startswith("megatron.") and not fullname.startswith("megatron.fp16") and self.synthetic_megatron:
            raise ImportError(
                f"No module named {fullname!r}: fp16kit's alias provides only megatron.fp16 (Megatron-LM v1's fp16 "
                "package, as fp16kit.legacy.megatron); the rest of Megatron-LM is not part of fp16kit",
                name=fullname,
            )
        if fullname not in self.table:
            raise _alias_error(fullname, self.megatron)
        target_name = self.table[fullname]
        try:
            module = importlib.import_module(target_name)
        except ImportError as e:
            raise ImportError(
                f"{fullname!r} is {target_name!r} under fp16kit's apex alias, which failed to import: {e}",
                name=fullname,
            ) from e
        loader = _AliasLoader(self, fullname, target_name)
        # a spec for a package would give a plain fp16kit module a __path__ (the import system sets it)
        return importlib.machinery.ModuleSpec(fullname, loader, is_package=hasattr(module, "__path__"))

    def synthetic_root(self, name: str) -> types.ModuleType:
        module = types.ModuleType(
            name, f"fp16kit's stand-in for {name!r}: its covered submodules are fp16kit.legacy's."
        )
        module.__path__ = []  # a package, so `import apex.amp` looks for apex.amp
        children = sorted(k.rpartition(".")[2] for k in self.table if k.rpartition(".")[0] == name)
        module.__dict__["__all__"] = children  # `from apex import *` imports the covered submodules, as apex's did
        megatron = self.megatron

        def __getattr__(attr: str) -> Any:
            full = f"{name}.{attr}"
            if attr == "__version__":  # apex never set one: its version was in its metadata only
                raise AttributeError(
                    f"module {name!r} has no attribute '__version__' (apex never had one; its "
                    f"distribution's version: importlib.metadata.version({name!r}))"
                )
            if attr.startswith("__") or full not in self.table:
                raise AttributeError(
                    f"module {name!r} has no attribute {attr!r} ({apex_map.hint_for(full, megatron=megatron)})"
                )
            return importlib.import_module(full)

        module.__dict__["__getattr__"] = __getattr__  # PEP 562: the module's own __getattr__
        return module

    def loaded(self, fullname: str, module: types.ModuleType) -> None:
        self.created[fullname] = module
        parent, _, child = fullname.rpartition(".")
        parent_module = sys.modules.get(parent) if parent else None
        if parent_module is not None and parent not in self.created:
            # the import system will set megatron.fp16 on a real megatron package: undo it at uninstall
            self.parent_attrs.append((parent_module, child, getattr(parent_module, child, _MISSING)))
        # Register the already-imported children under their apex names now: otherwise a later
        # `import apex.amp._amp_state` would make the import system set the parent attribute
        # `_amp_state` to the module, clobbering the object of that name fp16kit.legacy.amp exports
        # (apex itself had them in sys.modules from its __init__, so it never did that either).
        for name in sorted(self.table, key=lambda n: n.count(".")):
            if name.startswith(fullname + ".") and name not in sys.modules and name not in apex_map.CLOSED:
                target = sys.modules.get(self.table[name])
                if target is not None and name.rpartition(".")[0] in sys.modules:
                    sys.modules[name] = target
                    self.created[name] = target


_installed: _ApexAliasFinder | None = None


def apex_alias_installed() -> bool:
    """Whether install_apex_alias() is in effect."""
    return _installed is not None


def _find_real(fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
    """The spec the finders after the alias's give ``fullname`` (what plain python would import)."""
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        if isinstance(finder, _ApexAliasFinder) or find is None:
            continue
        spec = find(fullname, path, target)
        if spec is not None:
            return spec
    return None


def _missing_from(folders: list[str], table: Any) -> list[str]:
    """The covered apex modules a real apex package with these folders lacks, outermost only (what
    is below one of them is fp16kit's too)."""
    locations = {"apex": folders}
    missing = []
    for name in sorted((k for k in table if k.startswith("apex.")), key=lambda k: (k.count("."), k)):
        parent = name.rpartition(".")[0]
        if parent not in locations:
            continue  # below a missing module, or below a plain (non-package) module
        try:
            spec = _find_real(name, locations[parent])
        except KeyError:  # a namespace portion (a folder without __init__.py): PathFinder wants its parent imported
            last = name.rpartition(".")[2]
            portions = [os.path.join(f, last) for f in locations[parent] if os.path.isdir(os.path.join(f, last))]
            spec = importlib.machinery.ModuleSpec(name, None, is_package=True) if portions else None
            if spec is not None:
                spec.submodule_search_locations = portions
        if spec is None:
            missing.append(name)
        elif spec.submodule_search_locations is not None:
            locations[name] = list(spec.submodule_search_locations)
    return missing


def _complement_plan(megatron: bool) -> tuple[str, list[str]] | None:
    """(where the real apex is, the covered modules it lacks) when the alias should complement it: a
    real apex package without apex.amp or apex.fp16_utils (NVIDIA apex >= 25.x). None otherwise: no
    real apex (the alias is all of apex), or one that has both (_check_no_real refuses)."""
    imported = sys.modules.get("apex")
    if imported is not None:
        where = getattr(imported, "__file__", None)
        folders = getattr(imported, "__path__", None)
    else:
        where = _real_module("apex")
        try:
            spec = importlib.util.find_spec("apex") if where is not None else None
        except (ImportError, ValueError):
            spec = None
        folders = spec.submodule_search_locations if spec is not None else None
    if where is None or folders is None:
        return None
    missing = _missing_from(list(folders), apex_map.module_map(megatron=megatron))
    if "apex.amp" not in missing and "apex.fp16_utils" not in missing:
        return None
    return where, missing


def _real_module(name: str) -> str | None:
    """Where a real (non-namespace) package ``name`` would be imported from, or None."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin in (None, "namespace") or spec.loader is None:
        return None  # e.g. a cloned apex repository's top directory: a namespace package, not apex
    return spec.origin


def _has_amp(imported: types.ModuleType | None, name: str) -> bool:
    """Whether a real apex package holds amp/ or fp16_utils/ (looked up in its folders, not imported)."""
    if imported is not None:
        folders = list(getattr(imported, "__path__", None) or [])
    else:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            return True
        folders = list(spec.submodule_search_locations or []) if spec is not None else []
    return any(
        os.path.exists(os.path.join(folder, sub, "__init__.py")) or os.path.exists(os.path.join(folder, f"{sub}.py"))
        for folder in folders
        for sub in ("amp", "fp16_utils")
    )


def _check_no_real(names: tuple[str, ...], shadow: bool) -> None:
    for name in names:
        imported = sys.modules.get(name)
        where = getattr(imported, "__file__", None) or repr(imported) if imported is not None else _real_module(name)
        if where is None or shadow:
            continue
        state = "is already imported" if imported is not None else "is importable"
        if name not in apex_map.ROOTS:
            fix = (
                "If it is Megatron-LM v1's own fp16 package (beside its scripts), leave megatron=False / `fp16kit run` "
                "without --megatron: that copy then runs, its apex imports through the alias; or migrate its users "
                "to fp16kit.legacy.megatron (`fp16kit migrate --megatron`) and delete the copy."
            )
        elif name == "apex" and not _has_amp(imported, name):
            # a real apex package lacking them is complemented (_complement_plan); this one is not a
            # package the alias can add submodules to (a plain module apex.py, an imported namespace)
            fix = (
                "It is not a package with apex.amp or apex.fp16_utils, and the alias cannot add them to it (PyPI's "
                "'apex' is an unrelated project: pip uninstall apex if it was installed by mistake). To run apex-era "
                "code with it installed, let fp16kit's alias hide it."
            )
        else:
            fix = (
                "If it is NVIDIA apex with apex.amp (before 25.x), you do not need the alias. If it is PyPI's unrelated "
                "'apex' package (installed by mistake), remove it: pip uninstall apex."
            )
        raise RuntimeError(
            f"install_apex_alias(): a real module named {name!r} {state} ({where}), so fp16kit's alias would "
            f"hide it. {fix} To hide it anyway: install_apex_alias(shadow=True) or `fp16kit run --shadow`."
        )


def install_apex_alias(*, megatron: bool = False, shadow: bool = False) -> None:
    """Make ``import apex`` and its covered submodules resolve to fp16kit.legacy.

    ``megatron=True`` also maps Megatron-LM v1's ``fp16`` / ``megatron.fp16`` package to
    fp16kit.legacy.megatron. Beside a real ``apex`` that lacks ``apex.amp`` or ``apex.fp16_utils``
    (NVIDIA apex >= 25.x), ``import apex`` stays the real one and only the covered modules it lacks
    come from fp16kit.legacy. Raises RuntimeError (and changes nothing) if a real ``apex`` that has
    both (apex before 25.x), an ``amp_C`` without a real apex, or ``fp16`` (megatron=True) is
    imported or importable, unless ``shadow=True``, which hides the real one entirely. Calling it
    again with the same arguments does nothing; with others, call uninstall_apex_alias() first.
    """
    global _installed
    with _LOCK:
        if _installed is not None:
            if (_installed.megatron, _installed.shadow) == (megatron, shadow):
                return
            raise RuntimeError(
                f"the apex alias is already installed (megatron={_installed.megatron}, shadow={_installed.shadow}); "
                "call uninstall_apex_alias() before installing it with other arguments"
            )
        roots = (*sorted(apex_map.ROOTS), "fp16") if megatron else tuple(sorted(apex_map.ROOTS))
        plan = None if shadow else _complement_plan(megatron)
        if plan is not None:  # the real apex (and its amp_C) stay; only what it lacks is fp16kit's
            roots = tuple(r for r in roots if r not in apex_map.ROOTS)
        _check_no_real(roots, shadow)
        synthetic_megatron = megatron and "megatron" not in sys.modules and _real_module("megatron") is None
        finder = _ApexAliasFinder(
            megatron=megatron, shadow=shadow, synthetic_megatron=synthetic_megatron, complement=plan is not None
        )
        for name in list(sys.modules):  # shadow=True: hide what is imported, give it back at uninstall
            if finder.claims(name) and not (finder.complement and name.partition(".")[0] == "apex"):
                finder.hidden[name] = sys.modules.pop(name)
        if plan is not None:
            finder.lacking = tuple(plan[1])
        sys.meta_path.insert(0, finder)
        importlib.invalidate_caches()
        _installed = finder
        try:
            if plan is None:
                # `'apex' in sys.modules` is how apex-era scripts ask "is apex there?": the synthetic
                # root is in place at once, as if something had imported apex
                importlib.import_module("apex")
            else:
                where, missing = plan
                logger.info(
                    "apex alias: complementing the installed apex (%s): %s (missing there) come from fp16kit.legacy, "
                    "with their submodules; everything else is the installed apex's",
                    where,
                    ", ".join(missing),
                )
                # a real apex imported already gets its missing submodules now
                for name in sorted((n for n in sys.modules if n == "apex" or n.startswith("apex.")), key=len):
                    if name not in finder.created and hasattr(sys.modules[name], "__path__"):
                        finder.fill_in(sys.modules[name])
            # torch.load(f)'s default (weights_only=True) reads the scalers apex's optimizer
            # checkpoints pickled, as fp16kit's classes (this imports fp16kit.legacy)
            finder.safe_globals = safe_globals.allow(finder.fp16kit_module)
        except BaseException:
            uninstall_apex_alias()
            raise
        logger.debug("apex alias installed (megatron=%s, shadow=%s, complement=%s)", megatron, shadow, plan is not None)


def uninstall_apex_alias() -> None:
    """Undo install_apex_alias(): the finder and every ``apex`` entry it put in sys.modules go.

    fp16kit's own modules stay imported; modules hidden by ``shadow=True`` come back."""
    global _installed
    with _LOCK:
        finder = _installed
        if finder is None:
            return
        while finder in sys.meta_path:
            sys.meta_path.remove(finder)
        for name, module in finder.created.items():
            if sys.modules.get(name) is module:
                del sys.modules[name]
        for parent, attr, old in reversed(finder.parent_attrs):
            if old is _MISSING:
                parent.__dict__.pop(attr, None)
            else:
                setattr(parent, attr, old)
        sys.modules.update(finder.hidden)
        safe_globals.disallow(finder.safe_globals)
        _installed = None
        logger.debug("apex alias uninstalled")
