"""What :func:`fp16kit.legacy.load_checkpoint` says when ``torch.load`` fails.

One :class:`CheckpointRefused` (a ``pickle.UnpicklingError``) per kind of file it will not load,
each naming the fix, and carrying its ``kind`` and ``subject`` for callers that word their own
message (``fp16kit convert-checkpoint``).

=========================  ==========================================================
the file (``kind``)        how it is told
=========================  ==========================================================
not written by torch.save  its first bytes are neither a zip archive holding
(not_torch)                ``data.pkl`` nor torch's legacy magic number
truncated or corrupt       it starts like torch.save's output, but its zip archive does
(damaged)                  not open or fails its CRC check, or torch ran out of data
                           (legacy format) or met bytes no pickle has, or a tensor's
                           pickle claims more bytes than its data holds (than the
                           whole file, in the legacy format) or a view past its end
a whole pickled object     a refused global in a pickle holding ``_modules`` and
(whole)                    ``_parameters`` (``nn.Module``'s state) or ``param_groups``
                           and ``defaults`` (``Optimizer``'s): the pickle is parsed,
                           never run, and nothing is imported
a newer pickle protocol    torch's reader meets an opcode of protocol 3 or more
(protocol)
a TorchScript archive      torch says so (``torch.jit.save`` wrote it)
(torchscript)
anything else refused      a refused global: named, nothing was run (global); a
(global, structure)        structure a checkpoint never has (structure)
=========================  ==========================================================

torch's own words are quoted without its terminal colour codes and without its advice
(``add_safe_globals``, ``weights_only=False``). The file is looked at again only after
``torch.load`` failed; a file object is left where the caller had it.
"""

from __future__ import annotations

import io
import os
import pickle
import pickletools
import re
import stat
import struct
import zipfile
import zlib
from collections.abc import Callable
from typing import Any

import torch

from .records import SCALER_CLASSES

LOADER = "fp16kit.legacy.load_checkpoint"
_HEAD_BYTES = 512  # enough for a tar header's "ustar" at offset 257


class CheckpointRefused(pickle.UnpicklingError):
    """A file :func:`fp16kit.legacy.load_checkpoint` will not load.

    Beside the message (which names the fix), for callers that word their own (the command
    line):

    ``kind``     ``subject``
    ===========  ==============================================================
    not_torch    why it is not a file torch.save wrote ("it is empty", ...)
    damaged      how it is truncated or damaged
    whole        the class of the whole pickled object; ``whole`` is "module"
                 or "optimizer"
    global       the refused global (``os.system``, a class, ...)
    protocol     the pickle protocol it was saved with
    torchscript  "" (a ``torch.jit.save`` archive)
    structure    what is wrong with its structure (a cycle, a record where a
                 checkpoint never holds one, too many containers, ...)
    """

    def __init__(self, message: str, kind: str, subject: str = "", whole: str = "") -> None:
        super().__init__(message)
        self.kind, self.subject, self.whole = kind, subject, whole


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_TORCH_ADVICE = re.compile(
    r"\s*(Please use `torch\.serialization\.(add_)?safe_globals|Check the documentation of torch\.load)"
)


def torch_words(e: BaseException) -> str:
    """torch's error ``e`` in one line, without its terminal colour codes and its advice.

    torch's error ``e`` without its terminal colour codes and without its advice (re-run with
    ``weights_only=False``, ``add_safe_globals``): what it found, in one line."""
    text = _ANSI.sub("", str(e))
    _, found, after = text.partition("WeightsUnpickler error:")
    if found:
        text = after
    text = _TORCH_ADVICE.split(text, maxsplit=1)[0]
    return " ".join(text.split()) or type(e).__name__


def refusal(e: Exception, f: Any, start: int | None) -> CheckpointRefused | None:
    """What ``load_checkpoint`` raises for ``torch.load``'s error ``e`` (None: ``e`` itself)."""
    torch_said = f"(torch said: {type(e).__name__}: {torch_words(e)})"
    found = re.search(r"GLOBAL (\S+)", str(e)) or re.search(r"got <class '([^']+)'>", str(e))
    what = found.group(1) if found else "an object it does not allow"
    not_checkpoint = _look(f, start, _not_torch_save)
    if not_checkpoint:
        asked = f" {LOADER} refused to load {what}, which its pickle asks for; nothing was run."
        return CheckpointRefused(
            f"{LOADER}: {file_name(f)} is not a checkpoint written by torch.save: {not_checkpoint}. "
            "Expected a zip archive holding a data.pkl record (torch >= 1.6) or torch's legacy "
            "format, which starts with torch's magic number (older torch, or "
            "_use_new_zipfile_serialization=False). Check that this is the file you meant; one "
            "written with pickle.dump is read with pickle.load, and only if you trust it."
            f"{asked if found else ''}\n{torch_said}",
            "not_torch",
            not_checkpoint,
        )
    if "TorchScript archives" in str(e):
        return CheckpointRefused(
            f"{LOADER}: {file_name(f)} is a TorchScript archive (torch.jit.save wrote it), not a checkpoint of "
            "state dicts: load it with torch.jit.load. It holds no apex objects to read.",
            "torchscript",
        )
    if found and isinstance(e, pickle.UnpicklingError):
        kind, whole = _whole_object(what, f, start)
        if whole:
            return CheckpointRefused(
                f"{LOADER} refused to load {what} in {file_name(f)}: {whole}\n{torch_said}", "whole", what, kind
            )
        return CheckpointRefused(
            f"{LOADER} refused to load {what} in {file_name(f)}: only tensors, plain containers, apex's and Megatron's "
            f"loss scalers ({', '.join(SCALER_CLASSES)}), argparse.Namespace and numpy arrays and "
            "numbers are read; nothing was run. If you trust this file and need that object, use "
            f"torch.load(..., weights_only=False) yourself.\n{torch_said}",
            "global",
            what,
        )
    if "Unsupported operand" in str(e):
        protocol = _look(f, start, _protocol)
        if protocol and int(protocol) > 2:
            return CheckpointRefused(
                f"{LOADER}: {file_name(f)} was saved with torch.save(..., pickle_protocol={protocol}), whose "
                "opcodes torch's weights-only reader does not read (it reads protocol 2, torch.save's "
                "default). Re-save it with the default protocol where it loads, if you trust it."
                f"\n{torch_said}",
                "protocol",
                protocol,
            )
    damage = _damage(e, f, start)
    if damage:
        return CheckpointRefused(
            f"{LOADER}: {file_name(f)} is truncated or corrupt: {damage}. It starts like a checkpoint "
            "written by torch.save, but is cut short or damaged (an interrupted save or copy, a "
            "full disk?). Save or copy it again, and compare its size with the original's."
            f"\n{torch_said}",
            "damaged",
            damage,
        )
    if isinstance(e, pickle.UnpicklingError):
        return CheckpointRefused(
            f"{LOADER} refused to load {what} in {file_name(f)}: only tensors, plain containers, apex's and "
            "Megatron's loss scalers, argparse.Namespace and numpy arrays and numbers are read; nothing was "
            f"run.\n{torch_said}",
            "structure",
            torch_words(e),
        )
    if isinstance(e, (TypeError, AttributeError, RecursionError, ValueError)):  # e.g. a REDUCE on a record
        return CheckpointRefused(
            f"{LOADER} could not read {file_name(f)}: {type(e).__name__}: {torch_words(e)}",
            "structure",
            f"{type(e).__name__}: {torch_words(e)}",
        )
    if isinstance(e, _MALFORMED) or isinstance(e, RuntimeError) and not _ENVIRONMENT.search(str(e)):
        # what torch's reader raises on bytes it does not expect (a storage reference of the wrong
        # shape, a key it never stored, ...): the file, not the machine
        said = f"torch's reader failed on it with {type(e).__name__}: {torch_words(e)}"
        return CheckpointRefused(
            f"{LOADER}: {file_name(f)} is truncated or corrupt: {said}. It starts like a checkpoint written by "
            "torch.save, but is cut short or damaged (an interrupted save or copy, a full disk?), or crafted. "
            "Save or copy it again, and compare its size with the original's.",
            "damaged",
            said,
        )
    return None


_MALFORMED = (
    KeyError,
    IndexError,
    struct.error,
    AssertionError,
    EOFError,
    UnicodeError,
    OverflowError,
    zipfile.BadZipFile,
    zlib.error,
    NotImplementedError,
    pickle.UnpicklingError,
)
# torch's errors about this machine, not the file: they pass through as they are
_ENVIRONMENT = re.compile(r"CUDA|cuda|device|out of memory|can't allocate memory|DefaultCPUAllocator")


def structure_refused(f: Any, why: str, fix: str) -> CheckpointRefused:
    """The file ``f``, whose structure :func:`fp16kit.legacy.load_checkpoint` refuses: ``why``, then ``fix``."""
    return CheckpointRefused(f"{LOADER} refused {file_name(f)}: {why}. {fix}", "structure", why)


def position(f: Any) -> int | None:
    """Where ``torch.load`` starts reading a file object (None for a path or an unseekable file)."""
    if isinstance(f, (str, os.PathLike)):
        return None
    try:
        return f.tell()
    except (AttributeError, OSError, ValueError):
        return None


def file_name(f: Any) -> str:
    """How a refusal names the file ``f`` (a path's repr, a file object's name)."""
    if isinstance(f, (str, os.PathLike)):
        return repr(os.fspath(f))
    name = getattr(f, "name", None)
    return repr(name) if isinstance(name, str) else f"the {type(f).__name__} it was given"


def _look(f: Any, start: int | None, inspect: Callable[[Any], str], *, back_to_start: bool = True) -> str:
    """``inspect(opened file)`` on ``f`` read again from its start; "" when it cannot be. A file
    object is left at ``start`` (where the caller had it), or where it was found."""
    try:
        if isinstance(f, (str, os.PathLike)):
            if os.fspath(f).endswith(".safetensors"):  # torch.load hands these to safetensors
                return ""
            # opened afresh, after torch failed: what is there now may be a FIFO (never blocks)
            fd = os.open(os.fspath(f), os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
            with os.fdopen(fd, "rb") as opened:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    return ""
                os.set_blocking(fd, True)
                return inspect(opened)
        if start is None:
            return ""
        found = f.tell()
        f.seek(start)
        try:
            return inspect(f)
        finally:
            f.seek(start if back_to_start else found)
    except (OSError, ValueError, AttributeError, TypeError):
        return ""


def _not_torch_save(opened: Any) -> str:
    """Why the file is not one ``torch.save`` wrote, or "" when it looks like one."""
    start = opened.tell()
    head = opened.read(_HEAD_BYTES)
    if not isinstance(head, bytes):
        return ""
    if not head:
        return "it is empty"
    if head.startswith(b"PK\x03\x04"):  # what torch.load takes for its zip format
        opened.seek(start)
        try:
            with zipfile.ZipFile(opened) as archive:
                records = archive.namelist()
                found = torch_record(archive.infolist(), "data.pkl")  # where torch's reader looks for it
        except (zipfile.BadZipFile, EOFError, OSError, ValueError):
            return ""  # a damaged checkpoint: see _damage
        if found is not None:
            return ""
        return f"it is a zip archive without a data.pkl record (it holds {records[:3]!r}...)"
    if head[257:262] == b"ustar" or _starts_with_magic_number(head):  # torch's legacy formats
        return ""
    if head.startswith(b"\x80"):
        return f"it is a plain pickle (protocol {head[1]}), not torch.save's format"
    return f"it starts with {head[:24]!r}"


def _magic_pickles() -> list[bytes]:
    return [pickle.dumps(torch.serialization.MAGIC_NUMBER, protocol=p) for p in range(2, pickle.HIGHEST_PROTOCOL + 1)]


def _starts_with_magic_number(head: bytes) -> bool:
    """Whether ``head`` begins with torch's legacy-format magic number, pickled (any protocol),
    or is the start of one (a file cut short inside it)."""
    if any(len(head) < len(m) and m.startswith(head) for m in _magic_pickles()):
        return True
    try:
        for op, arg, _ in pickletools.genops(io.BytesIO(head)):
            if op.name not in ("PROTO", "FRAME"):
                return type(arg) is int and arg == torch.serialization.MAGIC_NUMBER
    except (ValueError, struct.error):  # not pickle opcodes, or cut off at the end of the head
        return False
    return False


# --------------------------------------------------------------------- truncated or corrupt

_TORCH_DAMAGE = re.compile(r"unexpected EOF|might be corrupted|PytorchStreamReader failed|Unsupported operand")


def _damage(e: Exception, f: Any, start: int | None) -> str:
    """How a file that starts like torch.save's output is damaged, or "" when it is not (as
    far as can be told: then ``e`` is about something else)."""
    if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError)):
        return ""
    found = _look(f, start, _zip_damage)
    if found:
        return found
    if isinstance(e, EOFError):
        return "it ends in the middle of a pickle"
    message = str(e)
    if isinstance(e, RuntimeError):
        sizes = _size_claim(message, f, start)
        if sizes:
            return sizes
    if isinstance(e, (RuntimeError, OSError, pickle.UnpicklingError)) and _TORCH_DAMAGE.search(message):
        if "Unsupported operand" in message:
            return f"its pickle holds a byte that is no pickle opcode torch.save writes ({torch_words(e)})"
        return "torch ran out of data or found it damaged"
    return ""


_WRONG_SIZE = re.compile(
    r"storage has wrong byte size|record size \((\d+) bytes\) does not match expected size \((\d+) bytes"
)
_BAD_VIEW = re.compile(
    r"Trying to resize storage that is not resizable|Storage size calculation overflowed|"
    r"numel: integer multiplication overflow|out of bounds for storage of size"
)
_ALLOCATING = re.compile(r"can't allocate memory: you tried to allocate (\d+) bytes")


def _size_claim(message: str, f: Any, start: int | None) -> str:
    """torch's error for a pickle claiming tensor sizes its data does not hold, as damage
    ("" when ``message`` is another error). A failed allocation is damage only when it is
    larger than the whole file: the legacy format stores each tensor's bytes as they are, so a
    file holding its data is larger than any of them (a real out-of-memory passes through)."""
    found = _WRONG_SIZE.search(message)
    if found:
        held = f" ({found.group(1)} bytes held, {found.group(2)} claimed)" if found.group(1) else ""
        return f"a tensor's data is not the size its pickle claims{held}"
    if _BAD_VIEW.search(message):  # torch.save writes views that fit their storage
        return "a tensor's size, strides or offset do not fit its data (they reach past it or overflow)"
    found = _ALLOCATING.search(message)
    if found:
        size = _look(f, start, _size_after_start)
        if size and not size.startswith("zip") and int(found.group(1)) > int(size):
            return f"its pickle claims a tensor of {int(found.group(1)):,} bytes, more than the whole file ({int(size):,} bytes)"
    return ""


def _size_after_start(opened: Any) -> str:
    """The number of bytes from the current position to the end ("zip ..." for a zip archive,
    whose records may be compressed)."""
    start = opened.tell()
    head = opened.read(4)
    end = opened.seek(0, os.SEEK_END)
    return f"zip {end - start}" if head == b"PK\x03\x04" else str(end - start)


def damaged(f: Any, start: int | None, *, records: str = "pickle", name: Any = None) -> CheckpointRefused | None:
    """The error for a zip checkpoint whose records fail their CRC check, or None.

    The error for a zip checkpoint whose records fail their CRC check (torch reads them
    unchecked), or None: ``records="pickle"`` checks ``data.pkl`` only (cheap: what a flipped
    bit would silently change is the structure), ``"all"`` every record (reads the whole file).
    ``name``: how the message names the file (default: as ``f``)."""
    found = _look(f, start, _pickle_crc if records == "pickle" else _zip_damage, back_to_start=False)
    if not found:
        return None
    return CheckpointRefused(
        f"{LOADER}: {file_name(f if name is None else name)} is truncated or corrupt: {found}. It starts like a "
        "checkpoint written by torch.save, but is damaged (a bad disk or copy?). Copy it again from a good source.",
        "damaged",
        found,
    )


def _pickle_crc(opened: Any) -> str:
    start = opened.tell()
    if opened.read(4) != b"PK\x03\x04":
        return ""
    opened.seek(start)
    try:
        with zipfile.ZipFile(opened) as archive:
            info = torch_record(archive.infolist(), "data.pkl")
            if info is not None:
                archive.read(info)  # checks the CRC
    except zipfile.BadZipFile as e:
        return f"record data.pkl of its zip archive fails its check ({e})"
    except (EOFError, OSError, ValueError, zlib.error, NotImplementedError, RuntimeError) as e:
        return f"its zip archive ends early or is damaged ({type(e).__name__}: {e})"
    return ""


def _zip_damage(opened: Any) -> str:
    start = opened.tell()
    if opened.read(4) != b"PK\x03\x04":
        return ""
    opened.seek(start)
    try:
        with zipfile.ZipFile(opened) as archive:
            bad = archive.testzip()  # reads every record and checks its CRC
    except zipfile.BadZipFile as e:
        return f"its zip archive does not open ({e}; the index at the end of the file is missing or damaged)"
    except (EOFError, OSError, ValueError, zlib.error, NotImplementedError, RuntimeError) as e:
        return f"its zip archive ends early or is damaged ({type(e).__name__}: {e})"
    if bad is not None:
        return f"record {bad!r} of its zip archive fails its CRC check"
    return ""


# ------------------------------------------------------------------ zip names, as torch reads them


def raw_name(info: zipfile.ZipInfo) -> bytes:
    """The bytes of record ``info``'s name in the archive (zipfile decodes them, and cuts them at a NUL)."""
    return info.orig_filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437")


def torch_folder(infos: list[zipfile.ZipInfo]) -> bytes | None:
    """The folder torch's zip reader reads every record from.

    The first record's name up to and including its first ``/`` (None: no records, or the first is
    in no folder -- torch refuses it)."""
    if not infos:
        return None
    first = raw_name(infos[0])
    return first[: first.index(b"/") + 1] if b"/" in first else None


def torch_record(infos: list[zipfile.ZipInfo], name: str) -> zipfile.ZipInfo | None:
    """The record torch's reader finds for ``name`` (e.g. "data.pkl") in its folder, or None.

    torch's reader (miniz) looks names up ignoring ASCII case, so a name is compared
    lower-cased (the scan refuses archives with two records of one such name)."""
    folder = torch_folder(infos)
    if folder is None:
        return None
    wanted = (folder + name.encode("utf-8")).lower()
    return next((i for i in infos if raw_name(i).lower() == wanted), None)


# ------------------------------------------------------------------------ whole objects


def apex_object_refused(path: str, kind: str, why: str) -> pickle.UnpicklingError:
    """The error an fp16kit class of an apex name raises for a whole apex object it cannot rebuild.

    What one of fp16kit's classes of an apex name raises when ``pickle`` (``torch.load(...,
    weights_only=False)`` under fp16kit's apex alias) hands it a whole object apex pickled that
    it cannot be rebuilt from as it was: ``why``, and how to resume instead."""
    return pickle.UnpicklingError(
        f"The file holds a whole {path} object apex pickled (torch.save({kind}), not "
        f"{kind}.state_dict()); {why}. Re-save it once where it loads, with "
        f"torch.save({kind}.state_dict(), NEW_PATH), then build the {kind} in the script and pass that "
        f"to {kind}.load_state_dict."
    )


def _whole_object(path: str, f: Any, start: int | None) -> tuple[str, str]:
    """``(kind, advice)`` when the refused global ``path`` is a pickled module or optimizer
    object (kind "module" or "optimizer"); ``("", "")`` otherwise."""
    found = set(_look(f, start, _pickle_strings).split("\0"))  # nn.Module's / Optimizer's state keys
    kind = "module" if {"_modules", "_parameters"} <= found else ""
    if not kind and {"param_groups", "defaults"} <= found:
        kind = "optimizer"
    if not kind:
        return "", ""
    wrapped = "apex/torch DistributedDataParallel and FP16_Module wrap the model: obj.module.state_dict() drops their 'module.' prefix"
    return kind, (
        f"the file holds a whole pickled {kind} object (torch.save({'model' if kind == 'module' else 'optimizer'}) "
        f"wrote it), not its state_dict, and rebuilding it would import and run {path}'s code. "
        f"{LOADER} and torch.load(weights_only=True) read state dicts only. Re-save it once, in an "
        "environment where it loads (the old one, with apex or Megatron-LM installed), and only if "
        "you trust the file:\n"
        "    obj = torch.load(OLD_PATH, weights_only=False)\n"
        f"    torch.save(obj.state_dict(), NEW_PATH)  # {wrapped if kind == 'module' else 'one file per optimizer'}\n"
        f"then read NEW_PATH with {LOADER} (or torch.load(NEW_PATH, weights_only=True)) and pass it "
        f"to {kind}.load_state_dict."
    )


def _zip_main_pickle(opened: Any, size: int = -1) -> bytes | None:
    """The first ``size`` bytes (all: -1) of a zip checkpoint's ``data.pkl``, or None when the
    file is not a zip checkpoint (the legacy format: the pickles follow one another in the file).
    The file position is left where it was."""
    start = opened.tell()
    head = opened.read(4)
    opened.seek(start)
    if head != b"PK\x03\x04":
        return None
    with zipfile.ZipFile(opened) as archive:
        info = torch_record(archive.infolist(), "data.pkl")
        if info is None:
            raise StopIteration
        with archive.open(info) as record:
            return record.read(size)


def _protocol(opened: Any) -> str:
    """The pickle protocol torch.save wrote the file with ("" when it cannot tell)."""
    try:
        head = _zip_main_pickle(opened, 2)
        if head is None:
            start = opened.tell()
            head = opened.read(2)
            opened.seek(start)
        return str(head[1]) if head[:1] == b"\x80" else ""
    except (zipfile.BadZipFile, StopIteration, OSError, ValueError, IndexError):
        return ""


def _pickle_strings(opened: Any) -> str:
    """The strings of the checkpoint's main pickle, joined by NUL (parsed, never run)."""
    try:
        data = _zip_main_pickle(opened)
        if data is not None:
            stream: Any = io.BytesIO(data)
            skip = 0
        else:
            stream, skip = opened, 3  # legacy: magic number, protocol version, sys info, then the object
        strings: list[str] = []
        for index in range(skip + 1):
            for _op, arg, _ in pickletools.genops(stream):
                if index == skip and isinstance(arg, str):
                    strings.append(arg)
        return "\0".join(strings)
    except (zipfile.BadZipFile, StopIteration, ValueError, struct.error, EOFError, OSError):
        return ""
