"""The looping model of the speculative-decoding tests (issue 29), apart from the test modules so
that a GPU run imports it without the HTTP server's packages: a tiny Llama (fp32, random weights)
whose untied head maps each byte token's embedding to a successor's, so its greedy outputs settle
into short loops that n-gram and draft-model drafts follow; the prompts and sampling they use."""

from __future__ import annotations

import json
import os

import numpy as np

from taipan.messages.requests import SamplingParams
from tests.random_llama import TINY_SHAPE, make_random_llama

BASE = dict(
    block_size_tokens=16,
    max_tokens=48,  # a step's tokens; prompts of up to 97 tokens: chunked
    max_requests=4,
    buffer_size_gb=0.05,
    max_sequence_length=256,
    enable_prefix_caching=True,
    enable_chunked_prefill=True,
)
_gen = np.random.default_rng(29)
# Byte tokens: repeated passages (the drafts find their continuation in the prompt), counting,
# and random ids; more prompts than max_requests, two sharing their first blocks.
PASSAGE = list(b"the quick brown fox jumps over the lazy dog. ")
PROMPTS = [
    PASSAGE * 2,
    list(b"def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"),
    PASSAGE * 2 + list(b"again: "),
    list(b"1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,"),
    _gen.integers(0, 256, 37).tolist(),
    _gen.integers(0, 256, 5).tolist() * 6,
]
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def make_looping_llama(path: str, seed: int = 0, scale: float = 0.7) -> str:
    """make_random_llama's TINY_SHAPE made to loop (`make_looping`; scale 0.7: at T = 2,
    PROMPTS' first round drafted 174 tokens in 64 verify rows and 138 were accepted, at every
    position)."""
    make_random_llama(path, TINY_SHAPE, seed=seed)
    names = ("model.embed_tokens.weight", ("o_proj.weight", "down_proj.weight"))
    return make_looping(path, *names, seed=seed, scale=scale)


def make_looping(path: str, embedding: str, outputs: tuple[str, ...], seed: int, scale: float):
    """The model saved in `path`, rewritten: an untied head whose row succ[t] is token t's
    embedding (tensor `embedding`; greedy: t -> succ[t] unless the layers bend it), succ a
    permutation of the 256 byte tokens in cycles of 3 to 7, and the tensors whose names end
    with `outputs` (the layers' output projections) scaled by `scale`."""
    from safetensors.numpy import load_file, save_file

    weights = os.path.join(path, "model.safetensors")
    state = load_file(weights)
    emb = state[embedding]
    gen = np.random.default_rng(seed)
    order, succ, i = gen.permutation(256), np.arange(emb.shape[0]), 0
    while i < 256:
        cycle = order[i : i + min(int(gen.integers(3, 8)), 256 - i)]
        succ[cycle] = np.roll(cycle, -1)
        i += len(cycle)
    head = np.zeros_like(emb)
    head[succ] = emb
    state["lm_head.weight"] = head
    for name in state:
        if name.endswith(outputs):
            state[name] = state[name] * np.float32(scale)
    save_file(state, weights, metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg | {"tie_word_embeddings": False}, f)
    return path
