"""The Hugging Face oracle's GGUF loading, made cheaper for the tests (no effect on what it
loads). transformers reads a GGUF file three times for one tokenizer and model (tokenizer,
config, weights), each time parsing every metadata field through gguf-py's memmap accessors
(~7 s for SmolLM2's 49k-token vocabulary on the 2-core box), and it rebuilds gguf-py's tensor
name map once per tensor (~20 ms each, 397 times). Inside `cached_gguf_reads()` a file is parsed
once (its reader reused: read-only) and each name map is built once."""

from __future__ import annotations

import contextlib
import functools
import os


@contextlib.contextmanager
def cached_gguf_reads():
    import gguf

    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple, object] = {}

    def reader(path, mode="r"):
        key = (os.path.realpath(path), mode, os.stat(path).st_mtime_ns)
        if key not in readers:
            readers[key] = reader_class(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map
