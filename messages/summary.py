"""One-line, human-readable summaries of messages: what `taipan replay` prints and what the
replay checkers quote when they report a divergence. Pure formatting; imports nothing but numpy.
"""

from __future__ import annotations

import dataclasses
import enum

import numpy as np

MAX_ITEMS = 6  # values shown per array / list in a summary
MAX_STR = 60  # characters shown per string field


def summarize(msg) -> str:
    """`TypeName field=value ...`, arrays as dtype[shape] and their first few values."""
    if not dataclasses.is_dataclass(msg):
        return _value(msg)
    fields = " ".join(f"{f.name}={_value(getattr(msg, f.name))}" for f in dataclasses.fields(msg))
    return f"{type(msg).__name__} {fields}".rstrip()


def _value(v) -> str:
    if isinstance(v, enum.Enum):
        return str(v.value)
    if isinstance(v, np.ndarray):
        head = v.reshape(-1)[:MAX_ITEMS].tolist()
        more = " …" if v.size > MAX_ITEMS else ""
        shape = ",".join(str(d) for d in v.shape)
        values = f" [{' '.join(_value(x) for x in head)}{more}]" if v.size else ""
        return f"{v.dtype.name}[{shape}]{values}"
    if isinstance(v, str):
        return repr(cut(v, MAX_STR))
    if isinstance(v, bytes):
        return f"bytes[{len(v)}]"
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, list | tuple):
        more = ", …" if len(v) > MAX_ITEMS else ""
        return f"({', '.join(_value(x) for x in v[:MAX_ITEMS])}{more})"
    if isinstance(v, dict):
        items = list(v.items())
        more = ", …" if len(items) > MAX_ITEMS else ""
        return "{" + ", ".join(f"{k}: {_value(x)}" for k, x in items[:MAX_ITEMS]) + more + "}"
    if dataclasses.is_dataclass(v):
        return f"({summarize(v)})"
    return repr(v)


def cut(s: str, limit: int) -> str:
    return s if len(s) <= limit else s[: limit - 1] + "…"
