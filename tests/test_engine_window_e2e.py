"""A sliding-window model served by real processes and replayed (issue 27 item 3): a tiny random
Mistral whose every layer attends to 24 keys (tests/random_dense.py), a KV pool of 6 blocks of
16 tokens, and requests of up to 7 blocks, with overlapping steps, chunked prefill and prefix
caching. The engine gives back the blocks behind each request's window (BlockOps releases), the
requests complete, and `taipan replay --check` re-plans the engine's and the allocator's logs
without a divergence. (tests/test_e2e_dense.py holds the same model's tokens to transformers'.)
"""

from __future__ import annotations

import numpy as np
import pytest

from taipan import replay
from taipan.actors.config import InferenceConfig
from taipan.actors.record import read_log
from taipan.client import Client
from taipan.launcher import Runtime
from taipan.messages import decode
from taipan.messages.allocator import BlockOps
from taipan.messages.requests import FinishReason, SamplingParams
from tests.random_dense import make_random_mistral

pytest.importorskip("transformers")
BLOCK, WINDOW = 16, 24


def test_a_windowed_model_frees_behind_the_window_and_replays(tmp_path):
    path = make_random_mistral(str(tmp_path / "windowed"), sliding_window=WINDOW)
    import transformers

    c = transformers.AutoConfig.from_pretrained(path)
    head_dim = c.hidden_size // c.num_attention_heads
    per_block = c.num_hidden_layers * 2 * BLOCK * c.num_key_value_heads * head_dim * 4
    config = InferenceConfig(
        block_size_tokens=BLOCK,
        enable_chunked_prefill=True,
        max_tokens=32,
        max_requests=4,
        max_sequence_length=256,
        enable_prefix_caching=True,
        buffer_size_gb=6.5 * per_block / 1024**3,  # 6 blocks: 96 tokens
        overlap_steps=True,
    )
    gen = np.random.default_rng(3)
    prompts = [gen.integers(0, 256, n).tolist() for n in (100, 40, 70)]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    rec = tmp_path / "rec"
    with Runtime(path, config, record_dir=str(rec)) as rt, Client(rt.address) as client:
        done = client.generate(prompts, greedy)
        again = client.generate(prompts[:1], greedy)  # (its window's blocks may be cached)
    assert [d.finish_reason for d in done + again] == [FinishReason.LENGTH] * 4
    assert again[0].token_ids == done[0].token_ids
    engine = list(read_log(rec / "engine-0.tplog"))
    sent = [decode(r.frames) for r in engine if (r.direction, r.channel) == ("out", "allocator")]
    assert sum(len(m.release_ids) for m in sent if isinstance(m, BlockOps)) > 0
    logs = {name: list(read_log(rec / f"{name}.tplog")) for name in ("engine-0", "allocator-0")}
    assert replay.check(logs, {name: rec / f"{name}.tplog" for name in logs}) == 0
