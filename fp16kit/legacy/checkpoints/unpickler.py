"""The opcode simulation behind :mod:`fp16kit.legacy.checkpoints.scan`.

One pickle, opcode by opcode, the way torch's weights-only reader runs it, knowing of each
value only its kind, size and nesting depth -- never building it.

The scan stops (returns False) where torch's reader refuses the file on its own, cleanly: at an
opcode outside its set (protocol 3+), at a global it does not allow; everything before was
checked. Per call it knows what the callee builds::

    bytearray(n) / bytearray(s, codec)      n bytes / len(s) * (1 or 4)      charged to the budget
    _codecs.encode(s, codec)                latin-1, utf-8, ascii only, on a str; len(s) * (1 or 4)
    set / OrderedDict / Counter / torch.Size(x)   a copy of x                 charged: x's size
    BUILD(obj, state)                       a copy of state (records, OrderedDict.__dict__)
    SETITEM(S), set / OrderedDict / Counter(x), BUILD   each key hashed: the items of a tuple key
                                            (a shared one counted each time), times one more
                                            for each earlier key of its hash (ints, floats and
                                            tuples of them: hashes a pickle can choose): charged
    torch.Tensor(...), torch.FloatTensor(n)  refused: memory of the pickle's choosing (torch.save
                                            never calls them; without arguments: an empty tensor)
    UntypedStorage(), FloatStorage(), ...   refused: an empty storage grows to fit any view set
                                            on it (torch.save stores every storage in the file)
    _rebuild_tensor*(storage, offset, size, stride), BUILD(tensor, (storage, offset, size,
    stride))                                a view, which must fit its storage (a legacy-format
                                            storage would grow to fit it)
    _rebuild_qtensor(..., size, ...)        prod(size) bytes before it checks: charged
    _rebuild_device_tensor_from_cpu_tensor(t, dtype, ...)   a converted copy of all t's items (a
                                            zero-stride view has more than its storage): charged
    _rebuild_from_type_v2(f, cls, args, state)   f(*args) as above, f a tensor rebuild
    fp16kit's stand-ins (checkpoint_records)   as torch runs them; their class or function
                                            itself never stored as a value
    another global the user allowed (add_safe_globals)   trusted, as torch trusts it
"""

from __future__ import annotations

import struct
from typing import Any, cast

import torch

from .errors import CheckpointRefused, file_name

__all__ = ["ALLOCATION_RATIO", "ALLOCATION_SLACK", "MAX_DEPTH", "SCAN_MEMORY_RATIO", "Budget", "Scanner", "refused"]

#: How deep containers (tuples, lists, dicts, sets, objects) may nest in a checkpoint's pickle.
#: State dicts nest a few levels; ``copy.deepcopy`` and ``repr`` of deeper data fail anyway, and
#: hashing a deep tuple overflows the C stack.
MAX_DEPTH = 200
#: The most bytes (or items) the calls in a file's pickles may build, per byte of the file.
ALLOCATION_RATIO = 4
#: ... plus this, for small files.
ALLOCATION_SLACK = 1 << 20
#: The most memory (bytes) the scan keeps per byte of a pickle, whatever its opcodes: a record of
#: 64-88 bytes per value it cannot share (an opcode makes at most one, and takes a byte at least;
#: a 1-tuple takes two and holds its item) and a reference per item of a list or tuple. None,
#: True, False, small ints and the empty tuple are shared, so a list of 10 million Nones costs a
#: reference each (about 9.5 bytes per byte), as it costs torch's own reader; a list of empty
#: dicts costs torch 72 bytes per byte, the scan 89.
SCAN_MEMORY_RATIO = 96
_TEXT_CODECS = {
    "latin1": 1,
    "latin-1": 1,
    "latin_1": 1,
    "iso-8859-1": 1,
    "iso8859-1": 1,
    "l1": 1,
    "utf-8": 4,
    "utf8": 4,
    "utf_8": 4,
    "ascii": 1,
    "us-ascii": 1,
}
_COPIERS = {"builtins.set", "collections.OrderedDict", "collections.Counter", "torch.Size"}
_TENSOR_REBUILDS = {
    f"torch._utils._rebuild_{n}"
    for n in (
        "tensor",
        "tensor_v2",
        "tensor_v3",
        "parameter",
        "parameter_with_state",
        "sparse_tensor",
        "meta_tensor_no_storage",
        "nested_tensor",
        "qtensor",
        "device_tensor_from_cpu_tensor",
    )
}
_NEVER = {
    "torch._utils._rebuild_wrapper_subclass": "a tensor subclass's wrapper (DTensor and the like)",
    "torch._utils._rebuild_device_tensor_from_numpy": "a tensor rebuilt from a numpy array",
}


def refused(f: Any, why: str, kind: str = "structure") -> CheckpointRefused:
    if kind == "damaged":
        return CheckpointRefused(
            f"fp16kit.legacy.load_checkpoint: {file_name(f)} is truncated or corrupt: {why}. It starts like a "
            "checkpoint written by torch.save, but is cut short or damaged (an interrupted save or copy, a full "
            "disk?), or crafted; nothing was loaded from it. Save or copy it again, and compare its size with the "
            "original's.",
            "damaged",
            why,
        )
    return CheckpointRefused(
        f"fp16kit.legacy.load_checkpoint refused {file_name(f)}: {why}; nothing was loaded from it. torch.save "
        "never writes this: if you trust the file, load it with torch.load(..., weights_only=False) and "
        "save its state dicts again.",
        kind,
        why,
    )


class Budget:
    """What the pickles of one file may build (:data:`ALLOCATION_RATIO`)."""

    def __init__(self, f: Any, size: int) -> None:
        self.f, self.size, self.left = f, size, ALLOCATION_RATIO * max(size, 0) + ALLOCATION_SLACK

    def charge(self, n: int, what: str) -> None:
        self.left -= n
        if self.left < 0:
            raise refused(
                self.f,
                (
                    f"its pickle builds {what}, and with it more than fp16kit.legacy.checkpoints.scan."
                    f"ALLOCATION_RATIO = {ALLOCATION_RATIO} times the file's {self.size:,} bytes (a few KB "
                    "of pickle asking for much more memory or work than the file holds)"
                ),
            )


# ----------------------------------------------------------------------------- values


class _V:
    """What the scan knows of one pickled value: its kind, size (bytes or items), nesting depth,
    and for some kinds the value (ints, short strings, global paths, list and tuple items).

    The scan keeps one of these per value a pickle builds, so it is kept small (four slots: a
    pickle of one-byte opcodes makes one value per byte); tuples and globals, which need more,
    are :class:`_Rich`, dicts and sets :class:`_Keyed`, and the values every pickle repeats
    (None, True, False, small ints, the empty tuple) are shared (:data:`_SHARED`)."""

    __slots__ = ("kind", "size", "depth", "value")
    stand_in = False  # whether it is (or holds) one of fp16kit's stand-in classes itself: see _Rich
    tree = 1  # the items hashing it visits (a shared one each time): see _Rich

    def __init__(self, kind: str, size: int = 0, depth: int = 0, value: Any = None) -> None:
        self.kind, self.size, self.depth, self.value = kind, size, depth, value


class _Rich(_V):
    """A tuple or a global: whether it holds a stand-in, its hash tree's size and its hash."""

    __slots__ = ("stand_in", "tree", "hashed")

    def __init__(self, kind: str, size: int, depth: int, value: Any, stand_in: bool, tree: int = 1) -> None:
        super().__init__(kind, size, depth, value)
        self.stand_in, self.tree, self.hashed = stand_in, tree, _UNHASHED


class _Keyed(_V):
    """A dict or a set: how many of its keys have each hash a pickle can choose (None: none yet),
    and the steps hashing them took."""

    __slots__ = ("counts", "steps")

    def __init__(self, kind: str, size: int = 0, depth: int = 1) -> None:
        super().__init__(kind, size, depth)
        self.counts: dict[int, int] | None = None
        self.steps = 0


_UNHASHED = object()
_NONE, _TRUE, _FALSE = _V("none"), _V("bool", value=True), _V("bool", value=False)
_SMALL_INTS = [_V("int", value=i) for i in range(256)]  # BININT1's
_EMPTY_TUPLE = _Rich("tuple", 0, 1, (), False)
#: Values shared by every reference to them (never changed: a BUILD on one works on a copy).
_SHARED = frozenset(map(id, [_NONE, _TRUE, _FALSE, _EMPTY_TUPLE, *_SMALL_INTS]))
_MAX_TREE = 1 << 62


class _Hash:
    """Stands for an item of known hash in a tuple whose hash the scan works out."""

    __slots__ = ("h",)

    def __init__(self, h: int) -> None:
        self.h = h

    def __hash__(self) -> int:
        return self.h


def _hash(v: _V) -> int | None:
    """The hash Python gives the value ``v`` stands for, where a pickle can choose it (ints, floats,
    tuples of them): keys chosen to collide make each insertion compare with all before. None
    where it cannot (str and bytes hashes are salted per process) or the value is unhashable."""
    if v.kind in ("int", "float", "bool", "none"):
        return None if v.value is None and v.kind != "none" else hash(v.value)
    if not isinstance(v, _Rich) or v.kind != "tuple" or v.value is None:
        return None
    if v.hashed is _UNHASHED:  # worked out once: a shared tuple is a key many times over
        items = [_hash(i) for i in v.value]
        known = [h for h in items if h is not None]
        v.hashed = None if len(known) < len(items) else hash(tuple(_Hash(h) for h in known))
    return cast("int | None", v.hashed)  # no longer _UNHASHED: worked out just above


def _stand_in_paths() -> frozenset[str]:
    from .records import SAFE_GLOBALS
    from .safe_globals import entry_path

    return frozenset(entry_path(e) for e in SAFE_GLOBALS)


def _global_path(module: str, name: str) -> str:
    from pickle import _compat_pickle  # type: ignore[attr-defined]

    if (module, name) in _compat_pickle.NAME_MAPPING:
        module, name = _compat_pickle.NAME_MAPPING[(module, name)]
    elif module in _compat_pickle.IMPORT_MAPPING:
        module = _compat_pickle.IMPORT_MAPPING[module]
    return f"{module}.{name}"


def _itemsize(path: str) -> int | None:
    """The element size of the storage class at ``path`` (None: not a storage class)."""
    module, _, name = path.rpartition(".")
    if not module.startswith("torch") or not name.endswith("Storage"):
        return None
    if name in ("UntypedStorage", "TypedStorage"):
        return 1
    try:
        return torch._utils._element_size(torch.serialization.StorageType(name).dtype)
    except (KeyError, AttributeError, RuntimeError):
        return None


def _allowed() -> tuple[dict[str, Any], dict[str, Any]]:
    """torch's weights-only allow-list now: (its own, the user's -- fp16kit's stand-ins included)."""
    from torch import _weights_only_unpickler as wo

    return wo._get_allowed_globals(), wo._get_user_allowed_globals()


class _Stop(Exception):
    """torch's reader refuses the file at this point by itself."""


class Scanner:
    """One file's pickles, simulated (see the module docstring).

    ``storages``: storage key -> bytes its pickle claims; ``itemsizes``: key -> element
    size."""

    def __init__(self, f: Any, stream: Any, size: int, budget: Budget, *, legacy: bool) -> None:
        self.f, self.stream, self.size, self.budget, self.legacy = f, stream, size, budget, legacy
        self.base = stream.tell()
        self.storages: dict[str, int] = {}
        self.itemsizes: dict[str, int] = {}
        self.torch_globals, self.user_globals = _allowed()
        self.stand_ins = _stand_in_paths()

    # ------------------------------------------------------------------ reading
    def _damaged(self, why: str) -> CheckpointRefused:
        return refused(self.f, f"its pickle {why}", "damaged")

    def _read(self, n: int) -> bytes:
        if n > self.size - (self.stream.tell() - self.base):
            raise self._damaged(f"claims {n:,} bytes past the end of the file (it is cut short)")
        data = self.stream.read(n)
        if len(data) != n:
            raise _Stop  # cut short: torch says so
        return data

    def _line(self) -> str:
        line = self.stream.readline(1024)
        if not line.endswith(b"\n"):
            raise self._damaged("holds a global whose name does not end (or is over 1 KB)")
        try:
            return line[:-1].decode("utf-8")
        except UnicodeDecodeError:
            raise self._damaged("holds a global whose name is not UTF-8") from None

    # ----------------------------------------------------------------- the loop
    def run(self, expect: int | None = None) -> bool:
        """Scan one pickle up to its STOP; False where torch would refuse it.

        Scan one pickle up to its STOP; False where torch refuses it by itself (stop), or
        where it is not the int ``expect`` (torch refuses such a file after reading it)."""
        out = self._pickle()
        return out is not None and (expect is None or out.kind == "int" and out.value == expect)

    def run_keys(self) -> list[str] | None:
        """Scan the legacy format's list of stored storage keys; its keys (None: stop)."""
        out = self._pickle()
        if out is None:
            return None
        if out.kind != "list" or not all(v.kind == "str" and isinstance(v.value, str) for v in out.value):
            raise self._damaged("of stored storage keys is not a list of keys")
        return [v.value for v in out.value]

    def _pickle(self) -> _V | None:
        self.stack: list[_V] = []
        self.metastack: list[list[_V]] = []
        self.memo: dict[int, _V] = {}
        try:
            while True:
                op = self.stream.read(1)
                if not op:
                    raise _Stop  # torch: "Ran out of input", refused as cut short
                handler = _OPCODES.get(op[0])
                if handler is None:
                    return None  # not an opcode torch's reader reads: it refuses there
                if handler(self) is _END:
                    return self._value(self.stack.pop(), "the checkpoint itself")
        except _Stop:
            return None
        except IndexError:
            raise self._damaged("is malformed (it takes more values than it has put)") from None

    def _push(self, v: _V) -> None:
        self.stack.append(v)

    def _pop_mark(self) -> list[_V]:
        items = self.stack
        self.stack = self.metastack.pop()
        return items

    def _value(self, v: _V, where: str) -> _V:
        """``v``, stored ``where``: never one of fp16kit's stand-in classes or functions itself."""
        if v.stand_in:
            raise refused(
                self.f,
                f"it holds {v.value or 'fp16kit stand-in'} itself (the class or function, not an "
                f"object made by it) as {where}, which no checkpoint holds",
            )
        return v

    def _container(self, kind: str, items: list[_V], where: str, value: Any = None) -> _V:
        depth = 1 + max((self._value(v, where).depth for v in items), default=0)
        if depth > MAX_DEPTH:
            self._too_deep()
        return _V(kind, len(items), depth, value)

    def _too_deep(self) -> None:
        raise refused(
            self.f,
            f"its containers nest deeper than fp16kit.legacy.checkpoints.unpickler.MAX_DEPTH = "
            f"{MAX_DEPTH} levels (a checkpoint's state dicts nest a few)",
        )

    def _grow(self, target: _V, items: list[_V], where: str) -> None:
        """``items`` (a list of the scan's own, taken over) added to the list or dict ``target``."""
        target.size += len(items)
        if isinstance(target.value, list):
            target.value.extend(items)
        elif target.value is not None:  # an empty list holds no list of its own until now
            target.value = items
        depth = 1 + max((self._value(v, where).depth for v in items), default=0)
        if depth > target.depth:
            target.depth = depth
            if depth > MAX_DEPTH:
                self._too_deep()

    # -------------------------------------------------------------- opcodes
    def op_global(self) -> None:
        path = _global_path(self._line(), self._line())
        if path not in self.torch_globals and path not in self.user_globals:
            raise _Stop  # torch refuses it, naming it
        self._push(_Rich("global", 0, 0, path, path in self.stand_ins))

    def op_newobj(self) -> None:
        args, cls = self.stack.pop(), self.stack.pop()
        self._push(self._call(cls, args, new=True))

    def op_reduce(self) -> None:
        args = self.stack.pop()
        self.stack[-1] = self._call(self.stack[-1], args, new=False)

    def op_build(self) -> None:
        state = self._value(self.stack.pop(), "an object's state")
        inst = self.stack[-1]
        if id(inst) in _SHARED:  # its depth changes below: this reference's own copy
            inst = self.stack[-1] = _V(inst.kind, inst.size, inst.depth, inst.value)
        if inst.kind == "tensor" and state.kind == "tuple" and state.value and state.value[0].kind == "storage":
            # torch's reader runs tensor.set_(*state): a view of that storage, which a legacy-format
            # storage grows to fit (memory of the pickle's choosing) -- so it must fit already
            if len(state.value) not in (1, 4):  # set_(storage) or set_(storage, offset, size, stride)
                raise refused(
                    self.f,
                    f"it sets a tensor's state (tensor.set_) from {len(state.value)} values; "
                    "torch.save writes a storage, or a storage, offset, size and stride",
                )
            if len(state.value) == 4:
                _view(self, "a tensor's state (tensor.set_)", state.value)
        if state.kind in ("str", "bytes", "list", "tuple", "dict", "set"):
            self.budget.charge(state.size, "an object from its state")
        if state.kind in ("dict", "set"):
            self._keys(_Keyed("dict"), [], copied=state)  # its keys hashed again into the object's
        if state.depth + 1 > inst.depth:
            inst.depth = state.depth + 1
            if inst.depth > MAX_DEPTH:
                self._too_deep()

    def op_append(self) -> None:
        item = self.stack.pop()
        self._into(self.stack[-1], "list", [item])

    def op_appends(self) -> None:
        items = self._pop_mark()
        self._into(self.stack[-1], "list", items)

    def op_setitem(self) -> None:
        v, k = self.stack.pop(), self.stack.pop()
        self._into(self.stack[-1], "dict", [k, v])

    def op_setitems(self) -> None:
        items = self._pop_mark()
        if len(items) % 2:
            raise self._damaged("sets a dict item without a value")
        self._into(self.stack[-1], "dict", items)

    def _into(self, target: _V, kind: str, items: list[_V]) -> None:
        if target.kind != kind:
            raise _Stop  # torch: "Can only append to lists" / "Can only SETITEM for dict"
        self._grow(target, items, f"an item of a {kind}")
        if kind == "dict":
            self._keys(cast(_Keyed, target), items[::2])  # a "dict" value is made as a _Keyed

    def _keys(self, target: _Keyed, keys: list[_V], copied: _V | None = None) -> None:
        """``keys`` hashed into the dict or set ``target`` (or all the keys of ``copied``): Python
        hashes a tuple anew each time, visiting every item of a shared one again (a few hundred
        bytes of tuples of tuples take 2**60 steps), and compares a key with each earlier one of
        its hash (ints chosen to collide: quadratic). Those steps are charged to the budget."""
        counts, steps = target.counts, 0
        if isinstance(copied, _Keyed):
            if copied.counts:
                if counts is None:
                    counts = target.counts = {}
                for known, n in copied.counts.items():
                    counts[known] = counts.get(known, 0) + n
            steps = copied.steps
        for key in keys:
            h = _hash(key)
            if h is None:
                steps += key.tree
            else:
                if counts is None:
                    counts = target.counts = {}
                seen = counts.get(h, 0)
                counts[h] = seen + 1
                steps += key.tree * (1 + seen)
        target.steps += steps
        self.budget.charge(
            steps,
            "dict keys or set members whose hashing and comparing take more steps than the "
            "file has bytes (a tuple shared many times over, or keys chosen to collide)",
        )

    def op_mark(self) -> None:
        if len(self.metastack) >= MAX_DEPTH:  # each mark closes into a container holding what follows
            self._too_deep()
        self.metastack.append(self.stack)
        self.stack = []

    def op_tuple(self) -> None:
        items = self._pop_mark()
        self._push(self._tuple(items))

    def _tuple(self, items: list[_V] | tuple[_V, ...]) -> _V:
        depth = 1 + max((v.depth for v in items), default=0)
        if depth > MAX_DEPTH:
            self._too_deep()
        return _Rich(
            "tuple",
            len(items),
            depth,
            items,
            any(v.stand_in for v in items),
            min(1 + sum(v.tree for v in items), _MAX_TREE),
        )

    def _tuple_n(self, n: int) -> None:
        if len(self.stack) < n:
            raise IndexError
        items = tuple(self.stack[-n:])  # a tuple of 1-3 items: smaller than a list of them
        del self.stack[-n:]
        self._push(self._tuple(items))

    def op_tuple1(self) -> None:
        self._tuple_n(1)

    def op_tuple2(self) -> None:
        self._tuple_n(2)

    def op_tuple3(self) -> None:
        self._tuple_n(3)

    def op_none(self) -> None:
        self._push(_NONE)

    def op_true(self) -> None:
        self._push(_TRUE)

    def op_false(self) -> None:
        self._push(_FALSE)

    def op_empty_tuple(self) -> None:
        self._push(_EMPTY_TUPLE)

    def op_empty_list(self) -> None:
        self._push(_V("list", 0, 1, ()))  # its items: a list of its own once it has some

    def op_empty_dict(self) -> None:
        self._push(_Keyed("dict"))

    def op_empty_set(self) -> None:
        self._push(_Keyed("set"))

    def op_binint(self) -> None:
        self._push(_V("int", value=struct.unpack("<i", self._read(4))[0]))

    def op_binint1(self) -> None:
        self._push(_SMALL_INTS[self._read(1)[0]])

    def op_binint2(self) -> None:
        self._push(_V("int", value=struct.unpack("<H", self._read(2))[0]))

    def op_long1(self) -> None:
        self._push(_V("int", value=int.from_bytes(self._read(self._read(1)[0]), "little", signed=True)))

    def op_binfloat(self) -> None:
        self._push(_V("float", value=struct.unpack(">d", self._read(8))[0]))

    def op_binunicode(self) -> None:
        self._string(struct.unpack("<I", self._read(4))[0])

    def op_short_binstring(self) -> None:
        self._string(self._read(1)[0])

    def _string(self, n: int) -> None:
        data = self._read(n)
        try:
            text = str(data, "utf-8", "surrogatepass") if n <= 4096 else None
        except UnicodeDecodeError:
            text = None
        self._push(_V("str", n, 0, text))

    def op_binpersid(self) -> None:
        pid = self._value(self.stack.pop(), "a storage reference")
        parts = pid.value if pid.kind == "tuple" else None
        want = 6 if self.legacy else 5
        if (
            not parts
            or parts[0].value not in ("storage", "module")
            or (parts[0].value == "storage" and len(parts) != want)
        ):
            raise self._damaged("refers to a storage in a form torch.save never writes")
        if parts[0].value == "module":
            raise _Stop  # a whole pickled module (legacy format): refused as such
        kind, key, numel = parts[1], parts[2], parts[4]
        itemsize = _itemsize(kind.value) if kind.kind == "global" else None
        if itemsize is None or key.kind != "str" or key.value is None or numel.kind != "int" or numel.value < 0:
            raise self._damaged("refers to a storage without a storage type, key or size")
        nbytes = numel.value * itemsize
        self.storages.setdefault(key.value, nbytes)
        self.itemsizes.setdefault(key.value, itemsize)
        self._push(_V("storage", nbytes, value=itemsize))

    def op_get(self, index: int) -> None:
        if index not in self.memo:
            raise self._damaged("refers to a value it never stored")
        self._push(self.memo[index])

    def op_binget(self) -> None:
        self.op_get(self._read(1)[0])

    def op_long_binget(self) -> None:
        self.op_get(struct.unpack("<I", self._read(4))[0])

    def op_binput(self) -> None:
        self.memo[self._read(1)[0]] = self.stack[-1]

    def op_long_binput(self) -> None:
        self.memo[struct.unpack("<I", self._read(4))[0]] = self.stack[-1]

    def op_proto(self) -> None:
        self._read(1)

    def op_stop(self) -> object:
        return _END

    # ---------------------------------------------------------------- calls
    def _call(self, func: _V, args: _V, *, new: bool) -> _V:
        if func.kind != "global":
            raise _Stop  # torch: "Trying to call reduce for unrecognized function"
        path = func.value
        if args.kind != "tuple" or args.value is None:
            raise refused(self.f, f"it calls {path} with arguments that are not a tuple")
        a = args.value
        if args.stand_in and not (path.endswith("multiarray._reconstruct") and a and a[0].stand_in):
            raise refused(self.f, f"it passes fp16kit's stand-in class itself to {path}")
        target = self.torch_globals.get(path)
        if path in self.stand_ins or target is None:  # fp16kit's stand-ins, or what the user allowed
            return self._container("object", [v for v in a if not v.stand_in], f"an argument of {path}")
        return _call_torch(self, path, target, a, new)


def _small(scanner: Scanner, path: str, a: list[_V], kinds: tuple[str, ...]) -> None:
    for v in a:
        if v.kind not in kinds:
            raise refused(scanner.f, f"it calls {path} with a {v.kind}, which torch.save never passes it")


def _call_torch(s: Scanner, path: str, target: Any, a: list[_V], new: bool) -> _V:
    """What calling torch's allowed global ``target`` (at ``path``) on ``a`` builds."""
    if path == "builtins.bytearray" and not new:
        return _bytes(s, path, a, allow_int=True)
    if path == "_codecs.encode":
        if not a or a[0].kind != "str":
            raise refused(s.f, "it calls _codecs.encode on something other than text (torch.save encodes a str)")
        return _bytes(s, path, a, allow_int=False)
    if path in _COPIERS:
        if a and a[0].kind not in ("list", "tuple", "dict", "set", "str", "bytes"):
            raise refused(s.f, f"it calls {path} on a {a[0].kind}, which torch.save never does")
        if len(a) > 1:
            raise refused(s.f, f"it calls {path} with {len(a)} arguments")
        s.budget.charge(a[0].size if a else 0, f"a copy by {path}")
        kind = "tuple" if path == "torch.Size" else "set" if path == "builtins.set" else "dict"
        size, depth = a[0].size if a else 0, 1 + (a[0].depth if a else 0)
        out = _V(kind, size, depth) if kind == "tuple" else _Keyed(kind, size, depth)
        if out.depth > MAX_DEPTH:
            s._too_deep()
        if a and kind != "tuple":  # the copy hashes its keys (of a list of pairs: the first items)
            items = a[0].value if a[0].kind in ("list", "tuple") and isinstance(a[0].value, (list, tuple)) else []
            if path == "collections.OrderedDict":
                items = [i.value[0] for i in items if i.kind == "tuple" and i.value]
            s._keys(out, items, copied=a[0] if a[0].kind in ("dict", "set") else None)  # type: ignore[arg-type]
        return out
    if (
        path in ("builtins.complex", "torch.device", "torch.serialization._get_layout")
        or new
        and path in ("builtins.bytearray", "builtins.set", "builtins.complex")
    ):
        _small(s, path, a, ("int", "float", "str", "bool", "none"))
        return _V("object")
    if path == "torch.nn.parameter.Parameter":
        if not a or a[0].kind != "tensor" or len(a) > 2:
            raise refused(s.f, "it makes a torch.nn.Parameter of something other than a tensor")
        return _V("tensor", a[0].size)
    if isinstance(target, type) and issubclass(target, (torch.UntypedStorage, torch.storage.TypedStorage)):
        raise refused(
            s.f,
            f"it makes a storage by calling {path}(...): an empty one grows to fit any tensor "
            "set on it (memory of a size the pickle chooses, uninitialized); torch.save stores every "
            "storage in the file",
        )
    if target in torch._tensor_classes or target is torch.Tensor:
        if a:
            raise refused(
                s.f,
                f"it calls {path}(...) with arguments, which allocates memory of a size the pickle "
                "chooses (uninitialized); torch.save never does",
            )
        return _V("tensor")
    if path in _NEVER:
        raise refused(s.f, f"it holds {_NEVER[path]} ({path}), which fp16kit.legacy.load_checkpoint does not read")
    if path in _TENSOR_REBUILDS:
        return _rebuild(s, path, a)
    if path == "torch._tensor._rebuild_from_type_v2":
        if len(a) != 4 or a[0].kind != "global" or a[0].value not in _TENSOR_REBUILDS or a[2].kind != "tuple":
            raise refused(s.f, "it calls torch._tensor._rebuild_from_type_v2 on something other than a tensor rebuild")
        out = _rebuild(s, a[0].value, a[2].value or [])
        if a[3].kind in ("dict", "tuple"):
            s.budget.charge(a[3].size, "a tensor's attributes")
        return out
    raise refused(s.f, f"it calls {path}, which is not a function torch.save calls")


def _bytes(s: Scanner, path: str, a: list[_V], *, allow_int: bool) -> _V:
    if not a:
        return _V("bytes", 0)
    first = a[0]
    if first.kind == "int" and allow_int and len(a) == 1:
        if first.value < 0:
            raise refused(s.f, f"it calls {path} with a negative size")
        n = first.value
    elif first.kind in ("str", "bytes", "list", "tuple") and len(a) <= 3:
        factor = 1
        if first.kind == "str":
            codec = a[1].value if len(a) > 1 else "utf-8"
            factor = _TEXT_CODECS.get(codec.lower() if isinstance(codec, str) else "", 0)
            if not factor:
                raise refused(s.f, f"it calls {path} with the codec {codec!r:.40} (torch.save uses latin1)")
        elif len(a) > 1:
            raise refused(s.f, f"it calls {path} with a codec on bytes")
        n = first.size * factor
    else:
        raise refused(s.f, f"it calls {path} on a {first.kind}, which torch.save never does")
    s.budget.charge(n, f"{n:,} bytes by {path}")
    return _V("bytes", n)


def _rebuild(s: Scanner, path: str, a: list[_V]) -> _V:
    """A tensor rebuild: a view of a storage (torch checks it fits), or a charged copy."""
    name = path.rpartition(".")[2]
    if not a:
        raise refused(s.f, f"it calls {path} without arguments")
    if name in ("_rebuild_parameter", "_rebuild_parameter_with_state", "_rebuild_device_tensor_from_cpu_tensor"):
        if a[0].kind != "tensor":
            raise refused(s.f, f"it calls {path} on a {a[0].kind}, not a tensor")
        if name == "_rebuild_device_tensor_from_cpu_tensor":
            # tensor.to(dtype): a copy of all its items (a view with zero strides has many more
            # than its storage holds), each of the new dtype's size
            itemsize = _dtype_size(a[1]) if len(a) > 1 else 16
            s.budget.charge(a[0].size * itemsize, f"a copy of {a[0].size:,} items by {path}")
        return _V("tensor", a[0].size)
    if name in ("_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_qtensor"):
        if a[0].kind != "storage" or len(a) < 4:
            raise refused(s.f, f"it calls {path} without a storage and a size")
        numel = _view(s, f"a tensor ({path})", a[:4])
        if name == "_rebuild_qtensor":
            s.budget.charge(numel, f"a quantized tensor of {numel:,} items by {path}")
        return _V("tensor", numel)
    return _V("tensor")  # sparse, nested, meta: their parts are tensors already read


def _dtype_size(v: _V) -> int:
    """The item size of the torch dtype global ``v`` (16, the largest, when it is something else)."""
    dtype = (
        getattr(torch, v.value.rpartition(".")[2], None) if v.kind == "global" and isinstance(v.value, str) else None
    )
    return dtype.itemsize if isinstance(dtype, torch.dtype) else 16


def _view(s: Scanner, what: str, a: list[_V]) -> int:
    """The number of items of the view ``(storage, offset, size, stride)`` in ``a``, refused when
    it is no view torch.save writes: one reaching past its storage, negative sizes or strides.
    (Only a view's extent is computed: a product of a pickle's many sizes could take minutes.)"""
    storage, offset, size, stride = a
    if offset.kind != "int" or any(
        v.kind != "tuple" or not all(i.kind == "int" for i in v.value or []) for v in (size, stride)
    ):
        raise refused(s.f, f"it makes {what} without an int offset and tuples of int sizes and strides")
    sizes, strides = [v.value for v in size.value], [v.value for v in stride.value]
    if len(sizes) != len(strides) or offset.value < 0 or min(sizes + strides, default=0) < 0:
        raise refused(
            s.f,
            f"a tensor's size, strides or offset are negative or do not match: {what} of size "
            f"{tuple(sizes)!r:.60}, stride {tuple(strides)!r:.60}, offset {offset.value}",
            "damaged",
        )
    if 0 in sizes:
        return 0
    extent = offset.value + 1 + sum((n - 1) * k for n, k in zip(sizes, strides))
    held = storage.size // (storage.value or 1)
    if extent > held:
        raise refused(
            s.f,
            f"a tensor's size, strides or offset reach past its storage: {what} needs {extent:,} "
            f"items of a storage of {held:,}",
            "damaged",
        )
    numel = 1
    for n in sizes:  # each at least 1: the product stops growing past any bound at once
        numel = min(numel * n, 1 << 64)
    return numel


_END = object()
_OPCODES: dict[int, Any] = {
    ord(c): getattr(Scanner, f"op_{name}")
    for c, name in (
        ("c", "global"),
        ("\x81", "newobj"),
        ("R", "reduce"),
        ("b", "build"),
        ("a", "append"),
        ("e", "appends"),
        ("s", "setitem"),
        ("u", "setitems"),
        ("(", "mark"),
        ("t", "tuple"),
        ("\x85", "tuple1"),
        ("\x86", "tuple2"),
        ("\x87", "tuple3"),
        ("N", "none"),
        ("\x88", "true"),
        ("\x89", "false"),
        (")", "empty_tuple"),
        ("]", "empty_list"),
        ("}", "empty_dict"),
        ("\x8f", "empty_set"),
        ("J", "binint"),
        ("K", "binint1"),
        ("M", "binint2"),
        ("G", "binfloat"),
        ("X", "binunicode"),
        ("U", "short_binstring"),
        ("Q", "binpersid"),
        ("h", "binget"),
        ("j", "long_binget"),
        ("q", "binput"),
        ("r", "long_binput"),
        ("\x8a", "long1"),
        ("\x80", "proto"),
        (".", "stop"),
    )
}
