"""ops/gguf_file.py's own dequantizers (Q4_1, Q8_0: what SmolLM2's GGUF holds) equal the gguf
package's, bit for bit, on random blocks (finite float16 scales and minima, every byte value)
and on every such tensor of the real model."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from taipan.ops import gguf_file  # noqa: E402

BYTES = {"Q4_1": 20, "Q8_0": 34}  # one block of 32 weights


def _random_blocks(kind: str, n: int, seed: int) -> np.ndarray:
    g = np.random.default_rng(seed)
    blocks = g.integers(0, 256, (n, BYTES[kind]), dtype=np.uint8)
    scales = 2 if kind == "Q8_0" else 4  # d (and m): finite float16
    values = g.normal(0, 0.05, (n, scales // 2)).astype(np.float16)
    blocks[:, :scales] = values.view(np.uint8).reshape(n, scales)
    return blocks


@pytest.mark.parametrize("kind", sorted(BYTES))
def test_random_blocks_dequantize_as_the_gguf_package_does(kind):
    data = _random_blocks(kind, 257, seed=len(kind))
    want = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[kind]).reshape(-1)
    got = gguf_file._DEQUANTIZE[kind](data)
    assert got.dtype == np.float32 and np.array_equal(got, want)


def test_the_real_models_tensors_dequantize_as_the_gguf_package_does(model_path):
    reader = gguf.GGUFReader(model_path)
    seen = set()
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind not in gguf_file._DEQUANTIZE or (kind in seen and "blk.0." not in t.name):
            continue
        data = np.ascontiguousarray(t.data)
        want = gguf.quants.dequantize(data, t.tensor_type).reshape(-1)
        assert np.array_equal(gguf_file._DEQUANTIZE[kind](data), want), t.name
        seen.add(kind)
    assert seen == {"Q4_1", "Q8_0"}
