"""What a message is: the tag -> class registry (`@message`, `@struct`), the field types the wire
admits, and the validation of decoded values.

Owns: registration (a tag inside its family's range, DESIGN.md §3, taken once), which trailing
fields a sender may leave off, and the checkers that turn a decoded value into its field's type
or raise `MessageError`. Must not touch: msgpack and frames (messages/codec.py encodes and
decodes with what is here, and re-exports its names) and torch (nothing in messages/ imports it).

A message is a frozen dataclass registered under an integer tag with `@message(tag)`. A message
or nested struct registered with `required=k` may come with only its first k fields (the rest
were added later, with defaults: an older sender, or a log recorded before them, still decodes);
every other message and struct carries all of its fields. Nested plain records (e.g.
`SamplingParams`) are `@struct` dataclasses, encoded as an array of their fields. Enum fields
(`enum.StrEnum` / `enum.IntEnum`) travel as their value and decode to their member; a value that
is not a member is a `MessageError` naming the choices. A `typing.Literal` (e.g. the `""` of
`Policy | Literal[""]`, a wire form older than its enum) admits exactly its values. Array fields
declare their dtype and rank with `Array[dtype, ndim]` (ndim None: any rank; dtype a tuple: any
of them): decode checks both, so consumers neither re-check nor trust; encode checks them too
(`array_fields`), so a sender's bug surfaces at the sender.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from taipan.messages.errors import ErrorCode

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


def registered(tag) -> type | None:
    """The message class registered under `tag` (None: no such tag)."""
    return _REGISTRY.get(tag)


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
            if item is int and all(type(x) is int for x in v):  # (a shape: no call per item)
                if v and not (-(2**63) <= min(v) and max(v) < 2**64):
                    raise MessageError("integer out of 64-bit range", ErrorCode.BAD_FIELD)
                return tuple(v)
            return tuple([check_item(x) for x in v])

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
    if tp is str or tp is bytes:

        def check_text(v):
            if type(v) is not tp:  # (msgpack gives exactly str or bytes)
                raise MessageError(
                    f"expected {tp.__name__}, got {type(v).__name__}", ErrorCode.BAD_FIELD
                )
            return v

        return check_text

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
    # The (dtype, ndim) pairs already accepted: a field sees few, and every message of a step's
    # outputs checks about ten arrays per request (most of them empty defaults).
    accepted: set[tuple[np.dtype, int]] = set()

    def check_array(v):
        if type(v) is np.ndarray and (v.dtype, v.ndim) in accepted:
            return v
        if not isinstance(v, np.ndarray):
            raise MessageError(f"expected an array, got {type(v).__name__}", ErrorCode.BAD_FIELD)
        problem = spec.problem(v)
        if problem is not None:
            raise MessageError(problem, ErrorCode.BAD_ARRAY)
        if type(v) is np.ndarray and len(accepted) < 16:
            accepted.add((v.dtype, v.ndim))
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


_FAST: dict[type, list[Callable[[Any], Any]]] = {}


def build(cls, values: Sequence[Any]):
    """A message or struct from its fields; it may leave off the trailing ones its `required=`
    allows (they take their defaults)."""
    fast = _FAST.get(cls)
    if fast is None:
        fast = _FAST[cls] = [check for _, check in _field_checkers(cls)]
    if len(values) == len(fast) or required_fields(cls) <= len(values) < len(fast):
        # The fields given (the rest: their defaults) and valid: positional, no keyword dict
        # (a struct cost 4 us this way less); a bad field falls through to the loop below,
        # which names it.
        try:
            return cls(*[check(v) for check, v in zip(fast, values, strict=False)])
        except MessageError:
            pass
    checkers = _field_checkers(cls)
    required = required_fields(cls)
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


def required_fields(cls) -> int:
    """How many leading fields a sender must give (`message` / `struct`'s `required=`)."""
    required = getattr(cls, "REQUIRED_FIELDS", None)
    return len(_field_checkers(cls)) if required is None else required


def _decode_struct(cls, v):
    if not isinstance(v, list | tuple):
        raise MessageError(f"{cls.__name__}: expected an array of fields", ErrorCode.BAD_FIELD)
    return build(cls, v)


_ARRAY_FIELDS: dict[type, list[tuple[str, Callable[[Any], Any]]]] = {}


def _holds_array(tp) -> bool:
    if typing.get_origin(tp) is typing.Annotated:
        return True
    return any(_holds_array(a) for a in typing.get_args(tp))


def array_fields(cls) -> list[tuple[str, Callable[[Any], Any]]]:
    """The fields of a message class that hold arrays, with their decode-time checkers: encode
    runs them too, so a wrong dtype or rank is the sender's TypeError, not the receiver's."""
    fields = _ARRAY_FIELDS.get(cls)
    if fields is None:
        hints = typing.get_type_hints(cls, include_extras=True)
        fields = [(name, _checker(tp)) for name, tp in hints.items() if _holds_array(tp)]
        _ARRAY_FIELDS[cls] = fields
    return fields
