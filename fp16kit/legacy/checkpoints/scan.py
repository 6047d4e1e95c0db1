"""Bounds on what a checkpoint file may make :func:`fp16kit.legacy.load_checkpoint` do, checked first.

What a checkpoint file may make :func:`fp16kit.legacy.load_checkpoint` do, checked before any
of it is inflated or handed to torch: work and memory bounded by a constant times the file's size.

torch's weights-only reader bounds *which* code a pickle reaches, not how much work or memory it
asks of that code: ``bytearray(2**28)`` from an 830-byte pickle, ``torch.FloatTensor(2**24)``
(uninitialized memory), a legacy storage the file never fills, a 200,000-deep tuple (hashing it
overflows the C stack), a zip whose directory points 300 entries at one deflated record. So the
file is read once, cheaply, first::

    the input        a regular file (a FIFO, a device, a socket, a directory waits or never ends:
                     refused before it is opened for reading); an open file object or BytesIO as
                     given
    zip format       the central directory only: names unique as torch's reader looks them up
                     (ignoring ASCII case; torch reads the first data.pkl, zipfile the last),
                     none with a NUL byte, all in the first record's folder (torch reads
                     FOLDER/data.pkl, FOLDER the first record's), records stored or deflated,
                     none encrypted, no two
                     overlapping or sharing data, all before the directory, a deflated one at
                     most MAX_INFLATION times its size (torch.save stores, never deflates);
                     byteorder / .format_version records small. Then data.pkl (at most its
                     bounded size) is scanned, and each storage it names must be a record of
                     exactly numel * itemsize bytes
    legacy format    magic number, protocol, system info, the object, the storage keys: each
                     pickle scanned; every storage the object names must be listed in the keys
                     and its bytes (an int64 count, then the data) present in the file
    legacy tar       (torch < 0.4) refused: torch's weights-only reader does not read it
    each pickle      simulated opcode by opcode, with torch's weights-only opcode set (the scan
                     stops at any other opcode: torch refuses it there):
                       nesting of tuples, lists, dicts, sets, objects, marks  <= MAX_DEPTH
                       memory the scan itself keeps   <= SCAN_MEMORY_RATIO * size (None,
                       small ints, ... shared: a reference each, as torch's reader keeps)
                       bytes built or copied by calls (bytearray(n), _codecs.encode, set(x),
                       OrderedDict(x), BUILD's state, ...), plus the steps hashing and
                       comparing dict keys and set members takes (a shared tuple is hashed
                       item by item each time; ints may be chosen to collide), summed
                                                                       <= ALLOCATION_RATIO * size
                                                                          + ALLOCATION_SLACK
                       _codecs.encode only with latin-1 / utf-8 / ascii on a str
                       tensor classes never called with arguments, storage classes never
                       called (they allocate); every view within its storage; _rebuild_qtensor's
                       size and a converted copy's items within the budget; wrapper subclasses and numpy
                       rebuilds (never in these checkpoints) refused
                       fp16kit's stand-ins (apex scalers, Namespace, numpy records) only called,
                       never held as a value (a bare class would come back as fp16kit's record)

torch is then handed the file as it was scanned (:func:`bounded`): nothing past its end then, and
every byte the scan read (the zip's directory, headers and data.pkl; the legacy format's pickles
and storage headers) as the scan read it, from the same open file -- appended to or rewritten in
place meanwhile, the file cannot show torch what the scan never saw.

Legit checkpoints copy each byte a few times at most (``bytearray(_codecs.encode(s))``), so the
ratio leaves a wide margin; a pickle that memoizes one big object and copies it many times runs
into it at once. Refusals are :class:`~fp16kit.legacy.checkpoints.errors.CheckpointRefused`.
"""

from __future__ import annotations

import bisect
import io
import os
import stat
import struct
import zipfile
import zlib
from typing import Any

import torch

from .errors import CheckpointRefused, file_name, raw_name, torch_folder, torch_record
from .unpickler import ALLOCATION_RATIO, ALLOCATION_SLACK, MAX_DEPTH, Budget, Scanner, refused

__all__ = [
    "ALLOCATION_RATIO",
    "ALLOCATION_SLACK",
    "MAX_DEPTH",
    "MAX_INFLATION",
    "Scanned",
    "bounded",
    "open_regular",
    "scan",
]

#: The most a deflated zip record may expand (deflate's own maximum is about 1032).
MAX_INFLATION = 32

_SMALL_RECORDS = (
    "byteorder",
    ".format_version",
    ".storage_alignment",
    "version",
    ".data/version",
    ".data/serialization_id",
)


# ------------------------------------------------------------------------------ the input


def open_regular(f: Any) -> tuple[Any, bool]:
    """Open ``f`` for reading, refusing anything that is not a regular file.

    ``(file object to read, whether we opened it)`` for a path or file object ``f``;
    CheckpointRefused (kind ``not_file``) when it is not a regular file. A path is opened with
    O_NONBLOCK and checked with fstat before anything is read (a FIFO would wait for a writer
    forever); a file object with a descriptor is checked the same way."""
    if isinstance(f, (str, os.PathLike)):
        check_regular(f)  # a socket cannot even be opened (ENXIO): say what it is first
        fd = os.open(os.fspath(f), os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        try:
            _check_regular(f, os.fstat(fd).st_mode)
            os.set_blocking(fd, True)
            return os.fdopen(fd, "rb"), True
        except BaseException:
            os.close(fd)
            raise
    try:
        fd = f.fileno()
    except (AttributeError, OSError, ValueError):  # BytesIO, a wrapper without a descriptor
        return f, False
    _check_regular(f, os.fstat(fd).st_mode)
    return f, False


def _check_regular(f: Any, mode: int) -> None:
    if stat.S_ISREG(mode):
        return
    what = (
        "a directory"
        if stat.S_ISDIR(mode)
        else "a FIFO (named pipe)"
        if stat.S_ISFIFO(mode)
        else "a socket"
        if stat.S_ISSOCK(mode)
        else "a device"
        if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
        else "not a regular file"
    )
    raise CheckpointRefused(
        f"fp16kit.legacy.load_checkpoint: {file_name(f)} is {what}, not a regular file: a checkpoint is read "
        "from a file (reading this could wait forever or never end). Give the checkpoint file itself, or "
        "read the data into an io.BytesIO and pass that.",
        "not_file",
        what,
    )


def scan(f: Any, opened: Any) -> Scanned | None:
    """Check the file ``opened`` as the module docstring says, leaving its position where it was.

    Check the file ``opened`` (``f`` as the caller named it) as the module docstring says,
    leaving its position where it was. Raises CheckpointRefused; returns what was scanned (hand
    torch :func:`bounded` of it), or None for a file object that reads text. torch may read it
    (or it is no checkpoint format at all: torch and the error messages say so)."""
    start = opened.tell()
    try:
        head = opened.read(512)
        end = opened.seek(0, os.SEEK_END)
        if not isinstance(head, bytes):
            return None
        budget = Budget(f, end - start)
        opened.seek(start)
        snapshot = _Snapshot()
        # every byte the scan reads is kept, and torch reads those as kept (bounded)
        reader = io.BufferedReader(_Recording(opened, snapshot), _RECORDED_CHUNK)
        if head.startswith(b"PK\x03\x04"):
            _scan_zip(f, reader, budget)
        elif head[257:262] == b"ustar":
            raise CheckpointRefused(
                f"fp16kit.legacy.load_checkpoint: {file_name(f)} is in torch's legacy tar format (torch < 0.4), "
                "which torch's weights-only reader does not read; nothing was loaded from it. If you trust "
                "it, load it once with torch.load(..., weights_only=False) and save its state dicts again.",
                "legacy_tar",
                "torch's legacy tar format",
            )
        elif head.startswith(b"\x80"):
            _scan_legacy(f, reader, end, budget)
        return Scanned(end, snapshot)
    finally:
        opened.seek(start)


_RECORDED_CHUNK = 1 << 12  # what the scan reads at a time past what it needs (kept): a zip's local headers


class Scanned:
    """What :func:`scan` checked: where the file ended then, and every byte it read.

    The zip's directory and headers, data.pkl; the legacy format's pickles and storage
    headers."""

    def __init__(self, end: int, snapshot: _Snapshot) -> None:
        self.end, self.snapshot = end, snapshot


class _Snapshot:
    """Bytes of a file at known offsets, as first read: sorted spans that do not overlap."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.chunks: list[bytes] = []

    def patch(self, pos: int, view: memoryview) -> None:
        """``view`` (read at ``pos``) with every byte this snapshot holds there as it holds it."""
        end = pos + len(view)
        i = max(bisect.bisect_right(self.starts, pos) - 1, 0)
        while i < len(self.starts) and self.starts[i] < end:
            a, chunk = self.starts[i], self.chunks[i]
            lo, hi = max(a, pos), min(a + len(chunk), end)
            if lo < hi:
                view[lo - pos : hi - pos] = chunk[lo - a : hi - a]
            i += 1

    def add(self, pos: int, data: bytes) -> None:
        """Keep ``data``, read at ``pos`` and patched (so it agrees with what is kept where both are)."""
        if not data:
            return
        end = pos + len(data)
        i = bisect.bisect_left(self.starts, pos)
        if i and self.starts[i - 1] + len(self.chunks[i - 1]) > pos:
            i -= 1
        j = i
        while j < len(self.starts) and self.starts[j] < end:
            j += 1
        if i < j:  # overlapping spans: one span of their union
            lo, hi = min(self.starts[i], pos), max(self.starts[j - 1] + len(self.chunks[j - 1]), end)
            merged = bytearray(hi - lo)
            for a, chunk in zip(self.starts[i:j], self.chunks[i:j]):
                merged[a - lo : a - lo + len(chunk)] = chunk
            merged[pos - lo : end - lo] = data
            pos, data = lo, bytes(merged)
        self.starts[i:j], self.chunks[i:j] = [pos], [data]


class _Recording(io.RawIOBase):
    """The file ``opened``, each byte read kept in ``snapshot`` -- and read from there when it
    is read again (the scan sees one version of the file, however often it looks)."""

    def __init__(self, opened: Any, snapshot: _Snapshot) -> None:
        super().__init__()
        self._f, self._snapshot = opened, snapshot

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._f.tell()

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        return self._f.seek(pos, whence)

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        pos = self._f.tell()
        data = self._f.read(len(view))
        n = len(data)
        view[:n] = data
        self._snapshot.patch(pos, view[:n])
        self._snapshot.add(pos, bytes(view[:n]))
        return n


class _Window(io.RawIOBase):
    """The file ``opened`` as :func:`scan` read it: reads stop where it ended then, and every byte
    the scan read is read as the scan read it (a rewrite in place since is not seen)."""

    def __init__(self, opened: Any, scanned: Scanned) -> None:
        super().__init__()
        self._f, self._end, self._snapshot = opened, scanned.end, scanned.snapshot

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._f.tell()

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        if whence == os.SEEK_END:
            pos += self._end
        elif whence == os.SEEK_CUR:
            pos += self._f.tell()
        if pos < 0:  # what io.BytesIO says (a file says OSError EINVAL: not the file's fault)
            raise ValueError(f"negative seek value {pos}")
        return self._f.seek(pos)

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        pos = self._f.tell()
        n = max(0, min(len(view), self._end - pos))
        if not n:
            return 0
        if hasattr(self._f, "readinto"):
            got = self._f.readinto(view[:n]) or 0
        else:
            data = self._f.read(n)
            got = len(data)
            view[:got] = data
        self._snapshot.patch(pos, view[:got])
        return got


def bounded(opened: Any, scanned: Scanned) -> io.BufferedReader:
    """``opened`` as :func:`scan` checked it, for torch to read.

    Nothing past where the file ended then, and the bytes the scan read as it read them. A
    zip's directory is read from the end of the file: appended to while it is loaded (another
    process saving into it), the file would point torch at records the scan never saw;
    rewritten in place (the same size), at a pickle the scan never saw. Tensor data the scan
    did not read is read as the file holds it."""
    return io.BufferedReader(_Window(opened, scanned), 1 << 16)


# -------------------------------------------------------------------------------- zip


def _scan_zip(f: Any, opened: Any, budget: Budget) -> None:
    try:
        archive = zipfile.ZipFile(opened)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError) as e:
        raise refused(f, f"its zip archive does not open ({type(e).__name__}: {e})", "damaged") from None
    with archive:
        infos = archive.infolist()
        records = _check_directory(f, opened, archive, infos)
        folder = torch_folder(infos)
        pickle = torch_record(infos, "data.pkl")  # the one torch reads: in the first record's folder
        if folder is None or pickle is None:
            return  # not a checkpoint: torch and the messages say so
        for info in infos:
            if not raw_name(info).startswith(folder):
                raise refused(
                    f,
                    f"its zip record {info.filename!r} is outside the folder {folder.decode('cp437')!r} "
                    "of its first record, where torch's reader reads every record",
                    "damaged",
                )
        for small in _SMALL_RECORDS:
            small_info = records.get((folder + small.encode()).lower())
            if small_info is not None and small_info.file_size > 64:
                raise refused(
                    f,
                    f"its record {small_info.filename!r} holds {small_info.file_size:,} bytes; torch.save writes a few",
                    "damaged",
                )
        try:
            data = archive.read(pickle)  # bounded: at most MAX_INFLATION times its stored size
        except zipfile.BadZipFile as e:
            raise refused(f, f"record data.pkl of its zip archive fails its check ({e})", "damaged") from None
        except (OSError, ValueError, EOFError, NotImplementedError, zlib.error) as e:
            raise refused(
                f, f"record data.pkl of its zip archive does not read ({type(e).__name__}: {e})", "damaged"
            ) from None
    stream = io.BytesIO(data)
    scanner = Scanner(f, stream, len(data), budget, legacy=False)
    if not scanner.run():
        return
    prefix = folder.decode("cp437")
    for key, nbytes in scanner.storages.items():
        name = f"{prefix}data/{key}"
        stored = records.get((folder + b"data/" + key.encode("utf-8", "surrogatepass")).lower())
        if stored is None:
            raise refused(f, f"its pickle names storage {key!r}, but the archive holds no record {name!r}", "damaged")
        if stored.file_size != nbytes:
            raise refused(
                f,
                f"its pickle claims {nbytes:,} bytes for storage {key!r}, but record {stored.filename!r} "
                f"holds {stored.file_size:,}",
                "damaged",
            )


def _check_directory(
    f: Any, opened: Any, archive: zipfile.ZipFile, infos: list[zipfile.ZipInfo]
) -> dict[bytes, zipfile.ZipInfo]:
    """The central directory's claims, before anything is inflated (see the module docstring); the
    records by their names as torch's reader looks them up (bytes, ASCII lower-cased)."""
    names: dict[bytes, zipfile.ZipInfo] = {}
    spans = []
    directory = getattr(archive, "start_dir", None)
    for info in infos:
        raw = raw_name(info)
        if b"\0" in raw:
            raise refused(
                f,
                f"its zip record {info.orig_filename!r} has a NUL byte in its name (zip readers "
                "disagree on where such a name ends)",
                "damaged",
            )
        if raw.lower() in names:
            twin = names[raw.lower()].filename
            raise refused(
                f,
                f"its zip archive holds the record {info.filename!r} twice (torch reads one copy, a zip tool the other)"
                if twin == info.filename
                else f"its zip archive holds the records {twin!r} and {info.filename!r}, one name to torch's "
                "reader (which ignores case): torch reads one, a zip tool the other",
                "damaged",
            )
        names[raw.lower()] = info
        if info.flag_bits & 0x41:  # traditional or strong encryption
            raise refused(f, f"its zip record {info.filename!r} is encrypted", "damaged")
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise refused(
                f,
                f"its zip record {info.filename!r} is compressed with method {info.compress_type} "
                "(torch.save stores its records)",
                "damaged",
            )
        stored = info.compress_type == zipfile.ZIP_STORED
        if (stored and info.file_size != info.compress_size) or (
            not stored and info.file_size > MAX_INFLATION * info.compress_size + 1024
        ):
            raise refused(
                f,
                f"its zip record {info.filename!r} claims {info.file_size:,} bytes from "
                f"{info.compress_size:,} stored (more than fp16kit.legacy.checkpoints.scan.MAX_INFLATION = "
                f"{MAX_INFLATION} times; torch.save stores its records uncompressed)",
                "damaged",
            )
        spans.append((info.header_offset, _local_end(f, opened, info), info.filename))
    spans.sort()
    for (_a, a_end, a_name), (b, _b_end, b_name) in zip(spans, spans[1:]):
        if b < a_end:
            raise refused(
                f,
                f"its zip records {a_name!r} and {b_name!r} overlap (share their data: a zip bomb's shape)",
                "damaged",
            )
    if spans and directory is not None and spans[-1][1] > directory:
        raise refused(f, f"its zip record {spans[-1][2]!r} reaches into the archive's directory", "damaged")
    return names


def _local_end(f: Any, opened: Any, info: zipfile.ZipInfo) -> int:
    """Where record ``info``'s data ends in the file (after its local header)."""
    opened.seek(info.header_offset)
    header = opened.read(30)
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        raise refused(f, f"its zip record {info.filename!r} points at no local header", "damaged")
    name_length, extra_length = struct.unpack("<HH", header[26:30])
    return info.header_offset + 30 + name_length + extra_length + info.compress_size


# ----------------------------------------------------------------------------- legacy


def _scan_legacy(f: Any, opened: Any, end: int, budget: Budget) -> None:
    """torch's legacy format: five pickles, then each storage's int64 element count and data."""
    start = opened.tell()
    scanner = Scanner(f, opened, end - start, budget, legacy=True)
    # magic number, protocol version, system info, the object
    for expect in (torch.serialization.MAGIC_NUMBER, torch.serialization.PROTOCOL_VERSION, None, None):
        if not scanner.run(expect):
            return
    storages = scanner.storages
    needed = sum(storages.values())
    if needed > end - opened.tell():
        raise refused(
            f,
            f"its pickle claims storages of {needed:,} bytes, more than the rest of the file "
            f"({end - opened.tell():,} bytes)",
            "damaged",
        )
    keys = scanner.run_keys()
    if keys is None:
        return
    missing = [k for k in storages if k not in keys]
    if missing:
        raise refused(
            f,
            f"its pickle names storage {missing[0]!r}, whose data the file does not hold (its list of "
            "stored keys lacks it: torch would hand back uninitialized memory)",
            "damaged",
        )
    for key in keys:
        header = opened.read(8)
        if len(header) != 8 or key not in storages:
            raise refused(
                f,
                f"its storage {key!r} is not in the file"
                if key in storages
                else f"its list of stored keys names {key!r}, which its pickle never uses",
                "damaged",
            )
        (count,) = struct.unpack("<q", header)
        itemsize = scanner.itemsizes[key]
        if count * itemsize != storages[key] or opened.tell() + count * itemsize > end:
            raise refused(
                f,
                f"its storage {key!r} holds {count:,} items where the pickle claims "
                f"{storages[key] // itemsize:,}, or runs past the end of the file",
                "damaged",
            )
        opened.seek(count * itemsize, os.SEEK_CUR)


# ---------------------------------------------------------------------------- pickles


def check_regular(f: Any) -> None:
    """Refuse the path ``f`` when it exists and is not a regular file.

    CheckpointRefused (kind ``not_file``) when the path ``f`` exists and is not a regular file
    (nothing is opened)."""
    try:
        mode = os.stat(f).st_mode
    except OSError:
        return  # the caller's open says what is wrong
    _check_regular(f, mode)


def check_file(f: Any, *, crc: bool = False) -> None:
    """:func:`open_regular` and :func:`scan` for the path or file object ``f``.

    Under the allow-list :func:`fp16kit.legacy.load_checkpoint` reads with (a caller that looks at
    a file before loading it); with ``crc``, then every record of a zip checkpoint CRC-checked
    (``convert_file``), read from the same open file as scanned (the path could name another by
    then, or the file have grown a directory the scan never saw)."""
    from .errors import damaged
    from .records import SAFE_GLOBALS
    from .safe_globals import replacing

    if isinstance(f, (str, os.PathLike)) and os.fspath(f).endswith(".safetensors"):
        check_regular(f)
        return
    opened, ours = open_regular(f)
    try:
        start = opened.tell()
        with replacing(SAFE_GLOBALS):
            scanned = scan(f, opened)
        if crc and scanned is not None:
            corrupt = damaged(bounded(opened, scanned), start, records="all", name=f)
            if corrupt is not None:
                raise corrupt
    finally:
        if ours:
            opened.close()
