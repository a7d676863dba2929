"""The wire format: msgpack encoding and decoding of the messages registered in
messages/schema.py (whose names are re-exported here: `message`, `struct`, `Array`,
`MessageError`, `registry`, ...).

Owns: how a message becomes frames and back. Must not touch: sockets (actors/channel.py does
that), what a field may hold (messages/schema.py) and torch (nothing in messages/ imports it).

On the wire a message is one msgpack array `[tag, version, *fields]` in frame 0; numpy arrays
travel as a msgpack ExtType holding (dtype, shape, bytes), and arrays larger than
`INLINE_ARRAY_BYTES` travel as extra frames (ExtType holds the frame index) so the receiver wraps
them without a copy.

Decoding trusts nothing: an unknown tag, a wrong version or arity, a field of the wrong type
(schema.py's checks), a bad array header or an oversized frame raises `MessageError`. Encoding
checks the array fields' dtype and rank, so a sender's bug surfaces at the sender.

Relaying without decoding: `encode_frame` encodes a message as one frame (arrays inline), so it
can travel as a `bytes` field of another message; `replace_first_field` gives such a frame a new
first field (an id) after checking its tag, version and field count, copying the rest unread.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import operator
import struct as _struct
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import numpy as np

from taipan.messages.errors import ErrorCode
from taipan.messages.schema import (
    ALLOWED_DTYPES,
    TAG_RANGES,
    Array,
    ArraySpec,
    MessageError,
    array_fields,
    build,
    dtype_name,
    message,
    registered,
    registry,
    required_fields,
    struct,
)

__all__ = [
    "ALLOWED_DTYPES",
    "EXT_ARRAY_FRAME",
    "EXT_ARRAY_INLINE",
    "INLINE_ARRAY_BYTES",
    "MAX_FRAME_BYTES",
    "MAX_FRAMES",
    "TAG_RANGES",
    "Array",
    "ArraySpec",
    "MessageError",
    "decode",
    "dtype_name",
    "encode",
    "encode_frame",
    "hand_over",
    "message",
    "registry",
    "replace_first_field",
    "same_encoding",
    "struct",
]

EXT_ARRAY_INLINE = 1
EXT_ARRAY_FRAME = 2
INLINE_ARRAY_BYTES = 64 * 1024
MAX_FRAME_BYTES = 1 << 30
MAX_FRAMES = 4096  # a state dict in UpdateWeights is one frame per large tensor


@functools.cache
def _little_endian(dt: np.dtype) -> np.dtype:
    return dt.newbyteorder("<")


@functools.cache
def _wire_dtype(name: str) -> np.dtype:
    return np.dtype(name).newbyteorder("<")


# --- encoding --------------------------------------------------------------------------------


# Empty arrays by (dtype, shape): their wire form (encode) and the array read back (decode; a
# read-only view of no bytes, safe to share). A RequestOutput carries nine of them: building
# each anew was most of its 36 us to encode and 31 us to decode (tests/perf/NOTES.md).
_EMPTY_EXT: dict[tuple[str, tuple[int, ...]], msgpack.ExtType] = {}
_EMPTY_ARRAYS: dict[bytes, np.ndarray] = {}
_EMPTY_CACHE_MAX = 256


_PLAIN = frozenset({int, float, str, bytes, bool, type(None)})  # msgpack's own (not subclasses)

# The shared, read-only empty arrays that message classes default their optional array fields
# to (messages/requests.py `empty_array_field`), by id, with their wire form: such a field is
# encoded by one lookup and needs no check (a default is of its field's dtype and rank). They
# are never freed, so an id here is always theirs.
_SHARED_EMPTY: dict[int, msgpack.ExtType] = {}


def share_empty(arr: np.ndarray) -> None:
    """Register `arr`, an empty read-only array kept for good, as a shared field default."""
    if arr.size or arr.flags.writeable:
        raise ValueError("a shared default must be an empty, read-only array")
    _SHARED_EMPTY[id(arr)] = _array_to_wire(arr, None)


def _to_wire(v, extra: list | None):
    """`v` as msgpack values; large arrays go to `extra` frames (None: every array inline)."""
    if type(v) in _PLAIN:
        return v
    if type(v) is np.ndarray and v.size:  # (the common case first)
        return _array_to_wire(v, extra)
    if isinstance(v, enum.Enum):
        return v.value
    if isinstance(v, np.ndarray):
        if v.size == 0:
            key = (v.dtype.str, v.shape)
            ext = _EMPTY_EXT.get(key)
            if ext is None:
                ext = _array_to_wire(v, None)
                if len(_EMPTY_EXT) < _EMPTY_CACHE_MAX:
                    _EMPTY_EXT[key] = ext
            return ext
        return _array_to_wire(v, extra)
    # (Plain values inline, not through a call each: a list of 291 weight specs was 0.7 ms.)
    if getattr(type(v), "IS_STRUCT", False):
        values = _fields_of(v)
        return [
            x if type(x) in _PLAIN else _to_wire(x, extra) for x in values[: _sent(type(v), values)]
        ]
    if isinstance(v, list | tuple):
        return [x if type(x) in _PLAIN else _to_wire(x, extra) for x in v]
    if isinstance(v, dict):
        return {k: _to_wire(x, extra) for k, x in v.items()}
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, np.floating):
        return float(v)
    return v


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}
_FIELD_GETTERS: dict[type, Callable[[Any], tuple]] = {}


def _fields_of(v) -> tuple:
    """A struct's field values in order (one C call: `operator.attrgetter`)."""
    get = _FIELD_GETTERS.get(type(v))
    if get is None:
        names = _field_names(type(v))
        if not names:
            get = _FIELD_GETTERS[type(v)] = lambda x: ()
            return ()
        many = operator.attrgetter(*names)
        get = many if len(names) > 1 else (lambda x, one=many: (one(x),))
        _FIELD_GETTERS[type(v)] = get
    return get(v)


def _field_names(cls) -> tuple[str, ...]:
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names


@functools.cache
def _wire_form(dt: np.dtype) -> tuple[str, bool]:
    """(the dtype's wire name, whether its arrays go as they are: little-endian or one byte);
    TypeError for a dtype that cannot travel."""
    name = dtype_name(dt)
    if name not in ALLOWED_DTYPES:
        raise TypeError(f"dtype {dt} cannot travel")
    return name, dt == _little_endian(dt)


# msgpack.ExtType validates its fields in Python (~1 us); ours are an int code and bytes.
_ext = functools.partial(tuple.__new__, msgpack.ExtType)


def _array_to_wire(v: np.ndarray, extra: list | None) -> msgpack.ExtType:
    name, as_is = _wire_form(v.dtype)
    # The wire is little-endian and keeps 0-d shapes (ascontiguousarray makes them 1-d).
    arr = v
    if not (as_is and v.flags.c_contiguous):
        arr = np.ascontiguousarray(v, dtype=_little_endian(v.dtype)).reshape(v.shape)
    if extra is not None and arr.nbytes > INLINE_ARRAY_BYTES:
        extra.append(memoryview(arr).cast("B"))
        body = msgpack.packb([name, list(arr.shape), len(extra)])
        return _ext((EXT_ARRAY_FRAME, body))
    body = msgpack.packb([name, list(arr.shape), arr.tobytes()])
    return _ext((EXT_ARRAY_INLINE, body))


def encode(msg) -> list:
    """Message -> frames (bytes or memoryviews). Raises TypeError for an unregistered object."""
    extra: list = []
    head = _encode_head(msg, extra)
    return [head, *extra]


def encode_frame(msg) -> bytes:
    """Message -> exactly one frame, every array inline however large: a message that travels
    inside another one's `bytes` field (e.g. StepOutputs) and is relayed as is. `decode([frame])`
    reads it back."""
    return _encode_head(msg, None)


def _encode_head(msg, extra: list | None) -> bytes:
    return pack_values(wire_values(msg, extra))


def pack_values(values: list) -> bytes:
    """One frame of `wire_values`-shaped values (what `encode_frame` sends)."""
    return msgpack.packb(values, use_bin_type=True)


# A frame composed from its parts' bytes (messages/requests.py `stream_frame`): msgpack packs a
# list as its header, then each element's bytes, so `list_head(2) + pack_value(a) +
# pack_value(b)` is `pack_values([a, b])`, byte for byte, and constant parts pack once.


def pack_value(value) -> bytes:
    """One wire value's bytes, as `pack_values` packs it inside a list."""
    return msgpack.packb(value, use_bin_type=True)


@functools.cache
def list_head(n: int) -> bytes:
    """The header of a packed list of `n` elements."""
    return msgpack.packb([None] * n)[:-n] if n else msgpack.packb([])


def pack_ints(values: Sequence[int], dtype: str, shape: tuple[int, ...]) -> bytes:
    """The bytes of an inline integer array of `shape` holding `values` (row-major) as
    `wire_values` packs it (`array_wire`), without building the array: the raw data through
    a cached struct, the ExtType's and the array header's bytes cached per dtype and shape.
    `dtype`: "int32" or "int64"; the array must be small enough to travel inline."""
    head, raw = _ints_layout(dtype, shape)
    return head + raw.pack(*values)


@functools.lru_cache(maxsize=512)  # (shapes: the tokens a step streams, mostly a few)
def _ints_layout(dtype: str, shape: tuple[int, ...]):
    if dtype not in ("int32", "int64"):
        raise TypeError(f"pack_ints takes int32 or int64, got {dtype}")
    empty = np.zeros(shape, dtype=dtype)
    if not 0 < empty.nbytes <= INLINE_ARRAY_BYTES:
        raise ValueError(f"pack_ints packs arrays of 1 to {INLINE_ARRAY_BYTES} bytes, not {shape}")
    whole = pack_value(array_wire(empty))
    code = {"int32": "i", "int64": "q"}[dtype]
    return whole[: -empty.nbytes], _struct.Struct(f"<{empty.size}{code}")


def wire_values(msg, extra: list | None = None) -> list:
    """What `encode_frame` packs for `msg` (checked as encoding checks it): [TAG, VERSION, the
    fields sent, in wire form]. For a sender that packs many messages of one shape itself
    (messages/requests.py `stream_frame`), from a template's values."""
    cls = type(msg)
    _check_outbound(msg, cls)
    values = _fields_of(msg)
    shared = _SHARED_EMPTY
    fields = [
        x if type(x) in _PLAIN else (shared.get(id(x)) or _to_wire(x, extra))
        for x in values[: _sent(cls, values)]
    ]
    return [cls.TAG, cls.VERSION, *fields]


def array_wire(v: np.ndarray) -> msgpack.ExtType:
    """A non-empty array's inline wire form (as `wire_values` gives it)."""
    return _array_to_wire(v, None)


def _check_outbound(msg, cls: type) -> tuple:
    """What encoding checks of a sender's message: a registered class, array fields of their
    dtype and rank (a wrong one is the sender's TypeError, not the receiver's). Returns the
    array fields' values."""
    got = _ARRAY_GETTERS.get(cls)
    if got is None:
        if registered(getattr(cls, "TAG", None)) is not cls:
            raise TypeError(f"{cls.__name__} is not a registered message")
        fields = array_fields(cls)
        names = tuple(name for name, _ in fields)
        many = operator.attrgetter(*names) if names else (lambda m: ())
        get = many if len(names) != 1 else (lambda m, one=many: (one(m),))
        got = _ARRAY_GETTERS[cls] = (
            get, tuple(check for _, check in fields), names, _shared_defaults(cls, names)
        )  # fmt: skip
    get, checks, names, defaults = got
    values = get(msg)
    # (a field at its shared empty default needs no check: found in C, the rest checked)
    for i, differs in enumerate(map(operator.is_not, values, defaults)):
        if differs:
            try:
                checks[i](values[i])
            except MessageError as e:
                raise TypeError(f"{cls.__name__}.{names[i]}: {e}") from None
    return values


_CHECKED = object()


def _shared_defaults(cls, names: tuple[str, ...]) -> tuple:
    """Per array field of `cls`, its default when that is a shared empty (share_empty), else
    a marker no value is (such a field is always checked)."""
    by_name = {f.name: f for f in dataclasses.fields(cls)}
    out = []
    for name in names:
        f = by_name[name]
        d = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        out.append(d if isinstance(d, np.ndarray) and id(d) in _SHARED_EMPTY else _CHECKED)
    return tuple(out)


# Per registered class: (one getter of its array fields' values, their checks, their names,
# their shared empty defaults).
_ARRAY_GETTERS: dict[type, tuple[Callable[[Any], tuple], tuple, tuple[str, ...], tuple]] = {}


def hand_over(msg) -> None:
    """Ready `msg` to be handed to an actor of the same process as an object, unencoded
    (actors/local.py): encoding's checks, then its array fields made read-only, as decoded
    ones are, so neither side can change what the other holds. Raises TypeError as `encode`."""
    for v in _check_outbound(msg, type(msg)):
        if type(v) is np.ndarray and v.size:  # (an empty one holds nothing to change)
            v.flags.writeable = False


# Per class, the defaults of the fields a sender may leave off (those after `required=`), as
# (kind, default) where kind is "value" (an immutable default), "empty" (an empty array of that
# dtype and rank) or None (never left off: a default the codec cannot compare); and per such
# field the default object itself (a value that *is* it is at its default: one identity test
# for the shared empty arrays, None and the booleans, which most trailing fields hold).
_OPTIONAL: dict[type, tuple[int, tuple, tuple]] = {}
_NEVER = object()  # (no value is this: a field never left off)


def _optional_defaults(cls) -> tuple[int, tuple, tuple]:
    got = _OPTIONAL.get(cls)
    if got is not None:
        return got
    fields = dataclasses.fields(cls)
    required = getattr(cls, "REQUIRED_FIELDS", None)
    required = len(fields) if required is None else required
    defaults, same = [], []
    for f in fields[required:]:
        d = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        if isinstance(d, np.ndarray) and d.size == 0:
            defaults.append(("empty", (d.dtype, d.shape)))
            same.append(d if id(d) in _SHARED_EMPTY else _NEVER)  # (a fresh one: compared)
        elif type(d) in _PLAIN or d == ():
            defaults.append(("value", d))
            same.append(d)
        else:
            defaults.append((None, None))
            same.append(_NEVER)
    got = _OPTIONAL[cls] = (required, tuple(defaults), tuple(same))
    return got


def _sent(cls, values: tuple) -> int:
    """How many leading fields of `values` go on the wire: the trailing ones still at their
    defaults are left off, down to `required=` (the receiver fills them in, as for an older
    sender): a step's RequestOutputs carry 7 of their 21 fields, most of the time."""
    required, defaults, same = _optional_defaults(cls)
    # (the last field that is not its default object, found in C; from there on, the values
    # equal to a default without being it, such as a fresh 0.0, are compared one by one)
    differs = list(map(operator.is_not, values[required:], same))
    if True not in differs:
        return required
    n = len(differs) - differs[::-1].index(True) + required
    while n > required:
        v = values[n - 1]
        if v is same[n - 1 - required]:
            n -= 1
            continue
        kind, d = defaults[n - 1 - required]
        if kind == "value":
            if type(v) is not type(d) or v != d:
                break
        elif kind == "empty":
            if type(v) is not np.ndarray or v.size or (v.dtype, v.shape) != d:
                break
        else:
            break
        n -= 1
    return n


def replace_first_field(frame: bytes, cls: type, value: int, peek: int = 1) -> tuple[bytes, list]:
    """Relay a one-frame `cls` message with its first field replaced by the int `value`, without
    decoding it: returns (the new frame, its first `peek` fields as they were). The peeked
    values are plain msgpack (an array stays an unread ExtType: the caller checks their types);
    every byte after them is copied unread, so only the final receiver validates those fields.
    MessageError if `frame` is not msgpack or not a `cls` message (tag, version, field count)."""
    name = cls.__name__
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=True, max_buffer_size=MAX_FRAME_BYTES)
    try:
        unpacker.feed(frame)
        count = unpacker.read_array_header()
        tag, version = unpacker.unpack(), unpacker.unpack()
        start = unpacker.tell()
        peeked = [unpacker.unpack()]
        end = unpacker.tell()
        peeked += [unpacker.unpack() for _ in range(peek - 1)]
    except Exception as e:  # as in decode: whatever msgpack raises means "not this message"
        raise MessageError(
            f"not a one-frame {name}: {type(e).__name__}: {e}", ErrorCode.BAD_MSGPACK
        ) from None
    arity = 2 + len(dataclasses.fields(cls))
    least = 2 + required_fields(cls)  # an older sender may omit trailing fields (`required=`)
    if (
        tag != cls.TAG
        or type(version) is not int
        or version != cls.VERSION
        or not least <= count <= arity
    ):
        items = f"{arity}" if least == arity else f"{least} to {arity}"
        raise MessageError(
            f"not a one-frame {name}: tag {tag!r}, version {version!r}, {count} items "
            f"(expected {cls.TAG}, {cls.VERSION}, {items})",
            ErrorCode.BAD_ENVELOPE,
        )
    relabelled = b"".join((frame[:start], msgpack.packb(value), frame[end:]))
    return relabelled, peeked


# --- decoding --------------------------------------------------------------------------------


def _array_from(body: bytes, frames: Sequence[memoryview], inline: bool) -> np.ndarray:
    if inline:
        empty = _EMPTY_ARRAYS.get(body)
        if empty is not None:
            return empty
    array = _read_array(body, frames)
    if inline and array.size == 0 and len(_EMPTY_ARRAYS) < _EMPTY_CACHE_MAX:
        _EMPTY_ARRAYS[bytes(body)] = array
    return array


def _read_array(body: bytes, frames: Sequence[memoryview]) -> np.ndarray:
    try:
        dtype, shape, data = msgpack.unpackb(body, raw=False)
    except Exception as e:
        raise MessageError(f"bad array header: {e}", ErrorCode.BAD_ARRAY) from None
    if not isinstance(dtype, str) or dtype not in ALLOWED_DTYPES:
        raise MessageError(f"array dtype {dtype!r} not allowed", ErrorCode.BAD_ARRAY)
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**40 for d in shape
    ):
        raise MessageError(f"bad array shape {shape!r}", ErrorCode.BAD_ARRAY)
    if isinstance(data, int) and not isinstance(data, bool):
        if not 1 <= data < len(frames):
            raise MessageError(f"array refers to missing frame {data}", ErrorCode.BAD_ARRAY)
        data = frames[data]
    elif not isinstance(data, bytes):
        raise MessageError("array data must be bytes or a frame index", ErrorCode.BAD_ARRAY)
    dt = _wire_dtype(dtype)
    count = math.prod(shape)  # Python ints: no overflow, and 30x faster than np.prod here
    if count * dt.itemsize != len(data):
        raise MessageError(
            f"array of {dtype}{shape} needs {count * dt.itemsize} bytes, got {len(data)}",
            ErrorCode.BAD_ARRAY,
        )
    return np.frombuffer(data, dtype=dt).reshape(shape)


def decode(frames: Sequence[bytes | memoryview]):
    """Frames -> message. Every malformed input raises MessageError, nothing else."""
    if not frames:
        raise MessageError("empty message", ErrorCode.EMPTY)
    if len(frames) > MAX_FRAMES:
        raise MessageError(f"{len(frames)} frames (max {MAX_FRAMES})", ErrorCode.TOO_LARGE)
    views = [memoryview(f) for f in frames]
    if any(v.nbytes > MAX_FRAME_BYTES for v in views):
        raise MessageError(f"frame over {MAX_FRAME_BYTES} bytes", ErrorCode.TOO_LARGE)

    def ext_hook(code, body):
        if code == EXT_ARRAY_INLINE or code == EXT_ARRAY_FRAME:
            return _array_from(body, views, code == EXT_ARRAY_INLINE)
        raise MessageError(f"unknown ExtType {code}", ErrorCode.BAD_EXT)

    try:
        obj = msgpack.unpackb(
            views[0], raw=False, ext_hook=ext_hook, strict_map_key=True, use_list=True
        )
    except MessageError:
        raise
    except Exception as e:  # msgpack raises many types for garbage; they all mean "not msgpack"
        raise MessageError(
            f"not a msgpack message: {type(e).__name__}: {e}", ErrorCode.BAD_MSGPACK
        ) from None
    if not isinstance(obj, list) or len(obj) < 2:
        raise MessageError("a message is an array [tag, version, *fields]", ErrorCode.BAD_ENVELOPE)
    tag, version, *values = obj
    if not isinstance(tag, int) or isinstance(tag, bool):
        raise MessageError(f"tag must be an int, got {type(tag).__name__}", ErrorCode.BAD_ENVELOPE)
    cls = registered(tag)
    if cls is None:
        raise MessageError(f"unknown message tag {tag}", ErrorCode.UNKNOWN_TAG)
    if type(version) is not int or version != cls.VERSION:
        raise MessageError(
            f"{cls.__name__} version {version!r}, expected {cls.VERSION}", ErrorCode.BAD_VERSION
        )
    return build(cls, values)


def same_encoding(msg, frames: Sequence[bytes | memoryview]) -> bool:
    """Whether `frames` are `msg` as sent: byte for byte, or as a sender older than some of its
    trailing fields (`required=`, in the message or a nested struct) sent it, those fields at
    their defaults in `msg` (replay --check of a log recorded before they were added)."""
    want = tuple(bytes(f) for f in encode(msg))
    if want == tuple(bytes(f) for f in frames):
        return True
    try:
        recorded = decode(frames)
    except MessageError:
        return False
    return tuple(bytes(f) for f in encode(recorded)) == want
