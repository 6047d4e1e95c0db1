"""Build a C kernel of this package at first use, and load it with ctypes.

A kernel ships as C source beside this module. :func:`load` compiles it once per machine and
keeps the shared library in the cache directory (``$FP16KIT_CACHE``, else
``$XDG_CACHE_HOME/fp16kit`` or ``~/.cache/fp16kit``; a temporary directory when that cannot be
written), named by a hash of the source, the compiler and its flags, so that a new fp16kit or
compiler builds anew and later processes only load the file. The build writes a temporary file
and renames it into place, so processes building at once never load a half-written library.

It returns None -- and says why in one log line, once per process -- when the kernels are
turned off (``FP16KIT_FUSED=0``), on a platform the kernels are not written for (they use x86-64
AVX2/FMA/F16C intrinsics), when no C compiler is found (``$CC``, ``cc``, ``gcc``), or when the
build fails. Callers then use torch's ops: the kernels are an acceleration, never a requirement.
The build time is logged (at INFO) when a build ran.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

__all__ = ["disabled_by_env", "load"]

logger = logging.getLogger("fp16kit")

FLAGS = ("-O2", "-shared", "-fPIC", "-ffp-contract=off", "-fno-math-errno")
"""``-ffp-contract=off``: the kernels spell every fused multiply-add they mean (torch's rounding)."""
OPENMP = "-fopenmp"  # tried first; without it the kernels run on one thread

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}


def disabled_by_env() -> bool:
    """``FP16KIT_FUSED=0`` (or ``false``/``off``/``no``): use torch's ops only."""
    return os.environ.get("FP16KIT_FUSED", "1").strip().lower() in ("0", "false", "off", "no")


def load(name: str) -> ctypes.CDLL | None:
    """The library built from ``<name>.c`` beside this module, or None (the reason is logged once)."""
    with _lock:
        if name not in _loaded:
            lib, why = _load(name)
            if lib is None:
                logger.log(
                    logging.INFO if why.startswith("FP16KIT_FUSED") else logging.WARNING,
                    f"fp16kit: the fused {name} kernel is off ({why}); using torch's ops.",
                )
            _loaded[name] = lib
        return _loaded[name]


def _load(name: str) -> tuple[ctypes.CDLL | None, str]:
    if disabled_by_env():
        return None, "FP16KIT_FUSED=0"
    if platform.machine().lower() not in ("x86_64", "amd64") or sys.platform == "win32":
        return None, f"it is written for x86-64 Linux/macOS, this is {platform.machine()} {sys.platform}"
    source = Path(__file__).with_name(f"{name}.c")
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None, "no C compiler: set CC or install gcc"
    code = source.read_bytes()
    for flags in ((*FLAGS, OPENMP), FLAGS):
        key = hashlib.sha256(b"\0".join([code, compiler.encode(), " ".join(flags).encode()])).hexdigest()[:16]
        for directory in _cache_dirs():
            target = directory / f"{name}-{key}.so"
            built = "ok" if target.exists() else _build(compiler, flags, source, target)
            if built is not None:
                break  # (None: this directory cannot be written)
        else:
            return None, f"no writable cache directory (set FP16KIT_CACHE): tried {', '.join(map(str, _cache_dirs()))}"
        if built == "ok":
            try:
                return ctypes.CDLL(str(target)), ""
            except OSError as e:
                return None, f"the built library does not load: {e}"
        # this compiler refused these flags (e.g. no OpenMP): try the next set
    return None, f"the build with {compiler} failed (run with FP16KIT_FUSED=0 to silence this)"


def _build(compiler: str, flags: tuple[str, ...], source: Path, target: Path) -> str | None:
    """Compile ``source`` to ``target``: "ok", an error text, or None when ``target``'s directory is not writable."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=target.name, suffix=".tmp", dir=target.parent)
    except OSError:
        return None
    os.close(fd)
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            [compiler, *flags, "-o", tmp, str(source), "-lm"], capture_output=True, text=True, timeout=300
        )
        if proc.returncode != 0:
            logger.debug(f"fp16kit: {compiler} {' '.join(flags)} failed:\n{proc.stderr}")
            return proc.stderr or f"exit status {proc.returncode}"
        os.replace(tmp, target)
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    logger.info(
        f"fp16kit: built the fused {source.stem} kernel in {time.perf_counter() - start:.1f} s "
        f"({Path(compiler).name} {' '.join(flags)}; kept in {target.parent})."
    )
    return "ok"


def _cache_dirs() -> list[Path]:
    explicit = os.environ.get("FP16KIT_CACHE")
    if explicit:
        return [Path(explicit)]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return [
        Path(base) / "fp16kit",
        Path(tempfile.gettempdir()) / f"fp16kit-{os.getuid() if hasattr(os, 'getuid') else 0}",
    ]
