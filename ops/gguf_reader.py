"""The GGUF metadata reader the model loader and the tokenizer share: gguf-py's `GGUFReader`
with its metadata arrays read in one pass. Reading only; no tensors are dequantized here."""

from __future__ import annotations

import functools
import struct

import numpy as np


@functools.cache
def gguf_reader() -> type:
    """`gguf.GGUFReader` reading each metadata array in one pass: the stock reader walks an
    array element by element (a 262,144-token vocabulary took 26 s of a 30 s load). Fields read
    the same through `contents()`; an array field's `data` indexes one part holding all its
    numbers, or one part per string."""
    import gguf

    array, string = gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING

    class Reader(gguf.GGUFReader):
        def _get_field_parts(self, orig_offs: int, raw_type: int):
            if raw_type != array:
                return super()._get_field_parts(orig_offs, raw_type)
            item_type, count = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
            kind, offs = gguf.GGUFValueType(int(item_type[0])), orig_offs + 12
            parts, types = [item_type, count], [array, kind]
            numbers = self.gguf_scalar_to_np.get(kind)
            if numbers is not None:
                values = self._get(offs, numbers, int(count[0]))
                return 12 + values.nbytes, [*parts, values], [2], types
            if kind != string:  # (nested arrays: the stock reader's way)
                return super()._get_field_parts(orig_offs, raw_type)
            data = self.data.view(np.ndarray)  # (slices of a plain array: no memmap overhead)
            raw, order = memoryview(data), "<Q" if self.byte_order == "I" else ">Q"
            for _ in range(int(count[0])):
                (length,) = struct.unpack_from(order, raw, offs)
                parts.append(data[offs + 8 : offs + 8 + length])
                offs += 8 + length
            return offs - orig_offs, parts, list(range(2, len(parts))), types

    return Reader
