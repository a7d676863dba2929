"""The wire format: a tag -> class registry, msgpack encoding, and validation.

Owns: how a message becomes frames and back. Must not touch: sockets (actors/channel.py does
that) and torch (nothing in messages/ imports it).

A message is a frozen dataclass registered under an integer tag with `@message(tag)`. On the wire
it is one msgpack array `[tag, version, *fields]` in frame 0; numpy arrays travel as a msgpack
ExtType holding (dtype, shape, bytes), and arrays larger than `INLINE_ARRAY_BYTES` travel as extra
frames (ExtType holds the frame index) so the receiver wraps them without a copy.

Decoding trusts nothing: an unknown tag, a wrong version or arity, a field of the wrong type, a
bad array header or an oversized frame raises `MessageError`. A message or nested struct
registered with `required=k` may come with only its first k fields (the rest were added later,
with defaults: an older sender, or a log recorded before them, still decodes); every other
message and struct carries all of its fields. Nested plain records (e.g.
`SamplingParams`) are `@struct` dataclasses, encoded as an array of their fields. Enum fields
(`enum.StrEnum` / `enum.IntEnum`) travel as their value and decode to their member; a value that
is not a member is a `MessageError` naming the choices. A `typing.Literal` (e.g. the `""` of
`Policy | Literal[""]`, a wire form older than its enum) admits exactly its values. Array fields
declare their dtype and rank with `Array[dtype, ndim]` (ndim None: any rank; dtype a tuple: any
of them): decode checks both, so consumers neither re-check nor trust; encode checks them too,
so a sender's bug surfaces at the sender.

Relaying without decoding: `encode_frame` encodes a message as one frame (arrays inline), so it
can travel as a `bytes` field of another message; `replace_first_field` gives such a frame a new
first field (an id) after checking its tag, version and field count, copying the rest unread.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import numpy as np

from taipan.messages.errors import ErrorCode

EXT_ARRAY_INLINE = 1
EXT_ARRAY_FRAME = 2
INLINE_ARRAY_BYTES = 64 * 1024
MAX_FRAME_BYTES = 1 << 30
MAX_FRAMES = 4096  # a state dict in UpdateWeights is one frame per large tensor
ALLOWED_DTYPES = frozenset(
    "bool int8 uint8 int16 uint16 int32 uint32 int64 uint64 float16 float32 float64".split()
)

# Tag ranges per family (DESIGN.md §3); a registration outside every range is a bug.
TAG_RANGES = {
    "connection": range(0, 20),
    "requests": range(20, 40),
    "lifecycle": range(40, 60),
    "consensus": range(60, 80),
    "allocator": range(80, 100),
    "mamba_cache": range(100, 120),
    "gpu": range(120, 140),
    "stats": range(140, 160),
}


class MessageError(ValueError):
    """A frame sequence that is not a valid message. `code` says what kind of invalid (one of
    ErrorCode's decoding codes); an actor answers with an ErrorReply of the same code."""

    def __init__(self, text: str, code: ErrorCode = ErrorCode.BAD_MESSAGE):
        super().__init__(text)
        self.code = code


@dataclasses.dataclass(frozen=True, slots=True)
class ArraySpec:
    """What an array field may hold: one of `dtypes` (numpy names), with `ndim` dimensions (None:
    any)."""

    dtypes: tuple[str, ...]
    ndim: int | None

    def problem(self, arr: np.ndarray) -> str | None:
        name = dtype_name(arr.dtype)
        if name not in self.dtypes:
            return f"dtype {name}, expected {' or '.join(self.dtypes)}"
        if self.ndim is not None and arr.ndim != self.ndim:
            return f"{arr.ndim}-D array of shape {list(arr.shape)}, expected {self.ndim}-D"
        return None


@functools.cache
def dtype_name(dt: np.dtype) -> str:
    """`dt.name`, cached: numpy computes the name in Python on every access (5 us), and every
    array of every message asks for it."""
    return dt.name


@functools.cache
def _little_endian(dt: np.dtype) -> np.dtype:
    return dt.newbyteorder("<")


@functools.cache
def _wire_dtype(name: str) -> np.dtype:
    return np.dtype(name).newbyteorder("<")


class Array:
    """The annotation of an array field: `Array[np.int32, 1]` is a 1-D int32 array;
    `Array[(np.float16, np.float32), None]` is a float16 or float32 array of any rank."""

    def __class_getitem__(cls, params):
        dtype, ndim = params
        dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
        names = tuple(np.dtype(d).name for d in dtypes)
        if not set(names) <= ALLOWED_DTYPES:
            raise TypeError(f"Array dtypes {names} include one that cannot travel")
        return typing.Annotated[np.ndarray, ArraySpec(names, ndim)]


_REGISTRY: dict[int, type] = {}
_CHECKERS: dict[type, list[tuple[str, Callable[[Any], Any]]]] = {}


_ENUM_FIELDS: dict[type, list[tuple[str, type[enum.Enum], tuple]]] = {}


def _enum_fields(cls) -> list[tuple[str, type[enum.Enum], tuple]]:
    """The (optional) enum fields of a message or struct class: (name, enum, the plain values
    a `Literal` beside the enum admits as they are)."""
    found = _ENUM_FIELDS.get(cls)
    if found is None:
        found = []
        for name, tp in typing.get_type_hints(cls).items():
            args = (
                typing.get_args(tp)
                if typing.get_origin(tp) in (typing.Union, types.UnionType)
                else (tp,)
            )
            kinds = [a for a in args if isinstance(a, type) and issubclass(a, enum.Enum)]
            if kinds:
                literals = [a for a in args if typing.get_origin(a) is typing.Literal]
                values = tuple(v for a in literals for v in typing.get_args(a))
                found.append((name, kinds[0], values))
        _ENUM_FIELDS[cls] = found
    return found


def _enum_members(self) -> None:
    """__post_init__ of every message and struct: a plain value given for an enum field becomes
    its member (ValueError if it is none), so a message holds the same types however it was
    made, decoded or constructed."""
    for name, kind, literals in _enum_fields(type(self)):
        value = getattr(self, name)
        if value is not None and not isinstance(value, kind) and value not in literals:
            object.__setattr__(self, name, kind(value))


def _frozen(cls):
    cls.__post_init__ = _enum_members
    return dataclasses.dataclass(frozen=True, slots=True)(cls)


def message(tag: int, version: int = 1, required: int | None = None):
    """Register a frozen dataclass as a wire message under `tag`. `required`: the message may
    come with only its first `required` fields (those after them were added later, with
    defaults: an older sender's message, or a log recorded before them, still decodes); None:
    every field, always."""

    def wrap(cls):
        cls = _frozen(cls)
        _set_required(cls, required)
        if not any(tag in r for r in TAG_RANGES.values()):
            raise TypeError(f"{cls.__name__}: tag {tag} is outside every family range")
        if tag in _REGISTRY:
            raise TypeError(f"tag {tag} is taken by {_REGISTRY[tag].__name__}")
        cls.TAG = tag
        cls.VERSION = version
        _REGISTRY[tag] = cls
        return cls

    return wrap


def struct(cls=None, *, required: int | None = None):
    """A nested record inside messages: a frozen dataclass encoded as the array of its fields.
    `@struct(required=k)`: as `message`'s, it may come with only its first k fields (the rest
    were added later, with defaults); plain `@struct`: every field, always."""

    def wrap(cls):
        cls = _frozen(cls)
        _set_required(cls, required)
        cls.IS_STRUCT = True
        return cls

    return wrap if cls is None else wrap(cls)


def _set_required(cls, required: int | None) -> None:
    """Record `required=` on a message or struct class; every later field needs a default."""
    later = dataclasses.fields(cls)[required:] if required is not None else ()
    if any(f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
           for f in later):  # fmt: skip
        raise TypeError(f"{cls.__name__}: every field after the first {required} needs a default")
    cls.REQUIRED_FIELDS = required


def registry() -> dict[int, type]:
    return dict(_REGISTRY)


# --- validation ------------------------------------------------------------------------------


def _checker(tp) -> Callable[[Any], Any]:
    """Build a function that validates (and lightly normalises) one decoded value of type tp."""
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return _array_checker(typing.get_args(tp)[1])
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return _enum_checker(tp)
    if origin is typing.Literal:
        return _literal_checker(typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        subs = [_checker(a) for a in typing.get_args(tp)]
        allows_none = type(None) in typing.get_args(tp)

        def check_union(v):
            if v is None:
                if allows_none:
                    return None
                raise MessageError("None where a value is required", ErrorCode.BAD_FIELD)
            errors = []
            for sub in subs:
                try:
                    return sub(v)
                except MessageError as e:
                    errors.append(str(e))
            raise MessageError("; ".join(errors), ErrorCode.BAD_FIELD)

        return check_union
    if tp is type(None):

        def check_none(v):
            if v is not None:
                raise MessageError(f"expected None, got {type(v).__name__}", ErrorCode.BAD_FIELD)
            return None

        return check_none
    if origin is list or origin is tuple:
        (item,) = typing.get_args(tp)[:1]
        check_item = _checker(item)

        def check_list(v):
            if not isinstance(v, list | tuple):
                raise MessageError(f"expected list, got {type(v).__name__}", ErrorCode.BAD_FIELD)
            return tuple(check_item(x) for x in v)

        return check_list
    if origin is dict:
        _, val = typing.get_args(tp)
        check_val = _checker(val)

        def check_dict(v):
            if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
                raise MessageError("expected a map with string keys", ErrorCode.BAD_FIELD)
            return {k: check_val(x) for k, x in v.items()}

        return check_dict
    if isinstance(tp, type) and getattr(tp, "IS_STRUCT", False):
        return lambda v: _decode_struct(tp, v)
    simple = {
        bool: (bool,),
        int: (int,),
        float: (float, int),
        str: (str,),
        bytes: (bytes,),
    }
    if tp not in simple:
        raise TypeError(f"unsupported message field type {tp!r}")
    allowed = simple[tp]

    def check_simple(v):
        if tp is not bool and isinstance(v, bool) or not isinstance(v, allowed):
            raise MessageError(
                f"expected {tp.__name__}, got {type(v).__name__}", ErrorCode.BAD_FIELD
            )
        if tp is int and not -(2**63) <= v < 2**64:
            raise MessageError("integer out of 64-bit range", ErrorCode.BAD_FIELD)
        return float(v) if tp is float else v

    return check_simple


def _array_checker(spec: ArraySpec) -> Callable[[Any], Any]:
    def check_array(v):
        if not isinstance(v, np.ndarray):
            raise MessageError(f"expected an array, got {type(v).__name__}", ErrorCode.BAD_FIELD)
        problem = spec.problem(v)
        if problem is not None:
            raise MessageError(problem, ErrorCode.BAD_ARRAY)
        return v

    return check_array


def _enum_checker(tp: type[enum.Enum]) -> Callable[[Any], Any]:
    choices = ", ".join(str(m.value) for m in tp)
    base = int if issubclass(tp, int) else str

    def check_enum(v):
        if isinstance(v, bool) or not isinstance(v, base):
            raise MessageError(f"expected a {tp.__name__} ({choices})", ErrorCode.BAD_FIELD)
        try:
            return tp(v)
        except ValueError:
            raise MessageError(
                f"{v!r} is not a {tp.__name__} ({choices})", ErrorCode.BAD_FIELD
            ) from None

    return check_enum


def _literal_checker(choices: tuple) -> Callable[[Any], Any]:
    expected = " or ".join(repr(c) for c in choices)

    def check_literal(v):
        if not any(type(v) is type(c) and v == c for c in choices):
            raise MessageError(f"expected {expected}, got {v!r}", ErrorCode.BAD_FIELD)
        return v

    return check_literal


def _field_checkers(cls) -> list[tuple[str, Callable[[Any], Any]]]:
    checkers = _CHECKERS.get(cls)
    if checkers is None:
        hints = typing.get_type_hints(cls, include_extras=True)
        checkers = [(f.name, _checker(hints[f.name])) for f in dataclasses.fields(cls)]
        _CHECKERS[cls] = checkers
    return checkers


def _build(cls, values: Sequence[Any]):
    """A message or struct from its fields; it may leave off the trailing ones its `required=`
    allows (they take their defaults)."""
    checkers = _field_checkers(cls)
    required = _required_fields(cls)
    if not required <= len(values) <= len(checkers):
        takes = (
            f"{len(checkers)}" if required == len(checkers) else f"{required} to {len(checkers)}"
        )
        raise MessageError(
            f"{cls.__name__} takes {takes} fields, got {len(values)}", ErrorCode.BAD_ARITY
        )
    checkers = checkers[: len(values)]  # the rest: their defaults (a sender older than them)
    kwargs = {}
    for (name, check), v in zip(checkers, values, strict=True):
        try:
            kwargs[name] = check(v)
        except MessageError as e:
            raise MessageError(f"{cls.__name__}.{name}: {e}", e.code) from None
    return cls(**kwargs)


def _required_fields(cls) -> int:
    """How many leading fields a sender must give (`message` / `struct`'s `required=`)."""
    required = getattr(cls, "REQUIRED_FIELDS", None)
    return len(_field_checkers(cls)) if required is None else required


def _decode_struct(cls, v):
    if not isinstance(v, list | tuple):
        raise MessageError(f"{cls.__name__}: expected an array of fields", ErrorCode.BAD_FIELD)
    return _build(cls, v)


# --- encoding --------------------------------------------------------------------------------

_ARRAY_FIELDS: dict[type, list[tuple[str, Callable[[Any], Any]]]] = {}


def _holds_array(tp) -> bool:
    if typing.get_origin(tp) is typing.Annotated:
        return True
    return any(_holds_array(a) for a in typing.get_args(tp))


def _array_fields(cls) -> list[tuple[str, Callable[[Any], Any]]]:
    """The fields of a message class that hold arrays, with their decode-time checkers: encode
    runs them too, so a wrong dtype or rank is the sender's TypeError, not the receiver's."""
    fields = _ARRAY_FIELDS.get(cls)
    if fields is None:
        hints = typing.get_type_hints(cls, include_extras=True)
        fields = [(name, _checker(tp)) for name, tp in hints.items() if _holds_array(tp)]
        _ARRAY_FIELDS[cls] = fields
    return fields


# Empty arrays by (dtype, shape): their wire form (encode) and the array read back (decode; a
# read-only view of no bytes, safe to share). A RequestOutput carries nine of them: building
# each anew was most of its 36 us to encode and 31 us to decode (tests/perf/NOTES.md).
_EMPTY_EXT: dict[tuple[str, tuple[int, ...]], msgpack.ExtType] = {}
_EMPTY_ARRAYS: dict[bytes, np.ndarray] = {}
_EMPTY_CACHE_MAX = 256


_PLAIN = frozenset({int, float, str, bytes, bool, type(None)})  # msgpack's own (not subclasses)


def _to_wire(v, extra: list | None):
    """`v` as msgpack values; large arrays go to `extra` frames (None: every array inline)."""
    if type(v) in _PLAIN:
        return v
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
    if getattr(type(v), "IS_STRUCT", False):
        return [_to_wire(getattr(v, name), extra) for name in _field_names(type(v))]
    if isinstance(v, list | tuple):
        return [_to_wire(x, extra) for x in v]
    if isinstance(v, dict):
        return {k: _to_wire(x, extra) for k, x in v.items()}
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, np.floating):
        return float(v)
    return v


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _field_names(cls) -> tuple[str, ...]:
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names


def _array_to_wire(v: np.ndarray, extra: list | None) -> msgpack.ExtType:
    name = dtype_name(v.dtype)
    if name not in ALLOWED_DTYPES:
        raise TypeError(f"dtype {v.dtype} cannot travel")
    # The wire is little-endian and keeps 0-d shapes (ascontiguousarray makes them 1-d).
    little = _little_endian(v.dtype)
    arr = v
    if v.dtype != little or not v.flags.c_contiguous:
        arr = np.ascontiguousarray(v, dtype=little).reshape(v.shape)
    if extra is not None and arr.nbytes > INLINE_ARRAY_BYTES:
        extra.append(memoryview(arr).cast("B"))
        body = msgpack.packb([name, list(arr.shape), len(extra)])
        return msgpack.ExtType(EXT_ARRAY_FRAME, body)
    body = msgpack.packb([name, list(arr.shape), arr.tobytes()])
    return msgpack.ExtType(EXT_ARRAY_INLINE, body)


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
    cls = type(msg)
    if _REGISTRY.get(getattr(cls, "TAG", None)) is not cls:
        raise TypeError(f"{cls.__name__} is not a registered message")
    for name, check in _array_fields(cls):
        try:
            check(getattr(msg, name))
        except MessageError as e:
            raise TypeError(f"{cls.__name__}.{name}: {e}") from None
    fields = [_to_wire(getattr(msg, name), extra) for name in _field_names(cls)]
    return msgpack.packb([cls.TAG, cls.VERSION, *fields], use_bin_type=True)


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
    least = 2 + _required_fields(cls)  # an older sender may omit trailing fields (`required=`)
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
    cls = _REGISTRY.get(tag)
    if cls is None:
        raise MessageError(f"unknown message tag {tag}", ErrorCode.UNKNOWN_TAG)
    if type(version) is not int or version != cls.VERSION:
        raise MessageError(
            f"{cls.__name__} version {version!r}, expected {cls.VERSION}", ErrorCode.BAD_VERSION
        )
    return _build(cls, values)


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
