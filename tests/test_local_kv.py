"""Per-layer-group KV (issue 27 item 3): a model whose windowed layers sit among layers that see
their whole context (Gemma 3: local and global) keeps the windowed layers' keys in a pool of
their own, as rings of each request's last window (actors/engine/local_kv.py), so a long request
holds blocks of the global layers alone in the main pool.

Layers: the rings' arithmetic (sizes, ids, tables, slots) and the pool split
(actors/gpu/sizing.py); end to end on a tiny random Gemma 3 (three local layers with a window
of 24 keys, one global) with real processes: greedy tokens and log-probs equal transformers'
for prompts whose rings wrap (chunks cut to the window), with overlapped steps, speculative
verify rows, a suspend that drops the KV, and the engine's plans replayed; the same budget holds
more requests at once than one pool for every layer does.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from taipan import LLM
from taipan.actors.config import LOCAL_CHUNK_TOKENS, local_chunk, ring_blocks
from taipan.actors.engine.local_kv import LocalPool, local_arrays, ring_row
from taipan.actors.gpu.sizing import size_pools
from taipan.actors.gpu.window import kv_window, windowed_layers
from tests.random_dense import make_random_gemma3
from tests.test_e2e_dense import GREEDY, PROMPTS, assert_equals_hf, hf_model

transformers = pytest.importorskip("transformers")
BLOCK, WINDOW = 16, 24
LAYERS = ["sliding_attention"] * 3 + ["full_attention"]


# ---- the rings --------------------------------------------------------------------------------


def test_ring_sizes_hold_a_chunk_and_its_window():
    """A chunk of c tokens writes and reads keys over W - 1 + c positions: the ring holds them
    in distinct slots wherever the chunk starts; a short request's ring never wraps."""
    chunk = local_chunk(WINDOW, BLOCK, 4, 256, num_speculative_tokens=3)
    assert chunk == WINDOW and local_chunk(8, BLOCK, 4, 256, num_speculative_tokens=20) == 21
    # A budget of many tokens: chunks of LOCAL_CHUNK_TOKENS, not of the window, where half the
    # longest request (less the window) allows: a ring stays about half a request's keys.
    assert local_chunk(WINDOW, BLOCK, 64, 256) == 64
    assert local_chunk(512, 256, 16384, 32768) == LOCAL_CHUNK_TOKENS
    assert local_chunk(512, 256, 16384, 2560) == 768  # (the default max_sequence_length)
    assert ring_blocks(512, 256, 768) * 256 == 1536
    assert local_chunk(1024, 256, 16384, 2560) == 1024
    assert local_chunk(4096, 256, 16384, 32768) == 4096
    r = ring_blocks(WINDOW, BLOCK, chunk)
    assert r == 4
    pool = LocalPool(10, WINDOW, BLOCK, chunk)
    assert pool.ring_size(40) == 3 and not pool.wraps(40)
    assert pool.ring_size(1000) == r and pool.wraps(1000)
    ring = list(range(r))
    for start in range(0, 200, 7):  # every span a chunk reads maps to distinct slots
        pos = np.arange(max(0, start - WINDOW + 1), start + chunk)
        slots = np.asarray(ring)[(pos // BLOCK) % r] * BLOCK + pos % BLOCK
        assert len(set(slots.tolist())) == len(pos)


def test_rings_are_taken_and_given_back_deterministically():
    pool = LocalPool(6, WINDOW, BLOCK, WINDOW)
    a, b = pool.take(4), pool.take(2)
    assert (a, b, pool.num_free) == ([0, 1, 2, 3], [4, 5], 0)
    pool.give(b)
    with pytest.raises(RuntimeError, match="2 free blocks, not 3"):
        pool.take(3)
    pool.give(a)
    assert pool.take(4) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="needs blocks and a window"):
        LocalPool(0, WINDOW, BLOCK, WINDOW)


def test_local_tables_repeat_each_ring_and_slots_follow_positions():
    """A ring shorter than the pool's (a request that never wraps: 3 blocks, positions < 48)
    is repeated to the common width; its entries past its own are never read."""
    chunks = [
        SimpleNamespace(start=5, num_new_tokens=3),
        SimpleNamespace(start=70, num_new_tokens=1),
    ]
    rows = [ring_row([7, 8, 9], 4), ring_row([3, 4, 5, 6], 4)]
    assert rows[0].tolist() == [7, 8, 9, 7]
    out = local_arrays(rows, chunks, 6, BLOCK)
    np.testing.assert_array_equal(out["local_block_tables"][:, :3], [[7, 8, 9], [3, 4, 5]])
    assert out["local_block_tables"][1].tolist() == [3, 4, 5, 6, 3, 4]
    # position 70: block 4 of a ring of 4 -> its first block (3), offset 6
    assert out["local_slot_mapping"].tolist() == [7 * 16 + 5, 7 * 16 + 6, 7 * 16 + 7, 3 * 16 + 6]


def test_cached_windows_shorten_a_hit_to_what_they_cover():
    """Prompt blocks a chunk completes are saved (from the ring, into cached blocks) and usable
    once their step is done; a hit keeps only the matched blocks whose window before the
    first computed token is cached."""
    pool = LocalPool(12, WINDOW, BLOCK, WINDOW, caching=True)
    hashes = np.arange(100, 106)  # six prompt blocks
    req = SimpleNamespace(hashes=hashes, ring=pool.take(4))
    saves: list = []
    chunk = SimpleNamespace(request=req, start=0, num_new_tokens=40, drafts=None)
    pool.saves_of([chunk], 1, saves)  # blocks 0 and 1 complete (block 2 is not)
    assert saves == [(0, 4), (1, 5)] and pool.num_cached == 2
    assert pool.usable_hit(hashes, 2, 200) == 0  # (step 1 is still in flight)
    pool.writing.clear()
    assert pool.usable_hit(hashes, 2, 200) == 2  # the window before 32: blocks 0, 1
    chunk = SimpleNamespace(request=req, start=40, num_new_tokens=24, drafts=None)
    pool.saves_of([chunk], 2, saves)  # block 2 (positions 32..47) and 3
    pool.writing.clear()
    assert pool.num_cached == 4 and saves[2:] == [(2, 6), (3, 7)]
    pool._cache.pop(101)  # block 1's windowed keys evicted
    # a hit of 4 blocks starts at 64 and needs blocks 2, 3 (positions 41..63): cached
    assert pool.usable_hit(hashes, 4, 200) == 4
    # a hit of 3 starts at 48 and needs blocks 1, 2 (positions 25..47): block 1 is gone; so
    # would 2 (blocks 0, 1) and 1 (block 0 only: cached)
    assert pool.usable_hit(hashes, 3, 200) == 1
    copies: list = []
    sources = pool.window_sources(hashes, 64)
    ring = pool.take(pool.num_free)  # (every block: the sources are evicted, still read first)
    pool.copies_into(ring, sources, copies)
    assert sources == [(2, 6), (3, 7)] and pool.num_cached == 0
    assert copies == [(6, ring[2]), (7, ring[3])] and pool.num_copied == 2
    pool.drop_cache()
    assert pool.num_cached == 0 and pool.usable_hit(hashes, 4, 200) == 0


def test_the_split_gives_the_windowed_layers_at_most_their_share():
    """Blocks of 3 windowed layers (local) and 1 other (main) over a budget of 100 one-pool
    blocks: the windowed pool takes what the rings want, at most 3/4 of the budget."""
    layer = 1000
    few = size_pools(100 * 4 * layer, layer, local_block_bytes=3 * layer, local_blocks=40)
    assert (few.num_local_blocks, few.num_blocks) == (40, 400 - 120)
    many = size_pools(100 * 4 * layer, layer, local_block_bytes=3 * layer, local_blocks=10**6)
    assert (many.num_local_blocks, many.num_blocks) == (100, 100)  # one pool's split
    with pytest.raises(ValueError, match="no block of the windowed layers"):
        size_pools(layer, layer, local_block_bytes=3 * layer, local_blocks=4)


def test_which_models_split():
    def config(windows):
        return SimpleNamespace(num_layers=len(windows), layer_window=lambda i: windows[i])

    assert windowed_layers(config([24, 24, None, 24])) == (24, (True, True, False, True))
    assert windowed_layers(config([24, 24])) is None and kv_window(config([24, 24])) == 24
    assert windowed_layers(config([None, None])) is None
    assert windowed_layers(SimpleNamespace(num_layers=2)) is None


def test_a_plan_without_its_local_arrays_is_refused():
    from taipan.actors.gpu.plan_checks import check_local_kv
    from tests.test_ops_logprobs import Seq, make_plan

    plan = make_plan(1, [Seq([1, 2, 3], 0, [0])])
    check_local_kv(plan, 0, BLOCK)
    with pytest.raises(ValueError, match="must match block_tables"):
        check_local_kv(plan, 8, BLOCK)
    good = dataclasses.replace(
        plan,
        local_block_tables=np.zeros(plan.block_tables.shape, np.int32),
        local_slot_mapping=np.arange(3, dtype=np.int64),
    )
    check_local_kv(good, 8, BLOCK)
    with pytest.raises(ValueError, match="need a windowed layers' pool"):
        check_local_kv(good, 0, BLOCK)
    bad = dataclasses.replace(good, local_block_tables=good.local_block_tables + 8)
    with pytest.raises(ValueError, match="must name blocks 0..7"):
        check_local_kv(bad, 8, BLOCK)


# ---- served -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    path = make_random_gemma3(
        str(tmp_path_factory.mktemp("local") / "g"), sliding_window=WINDOW,
        layer_types=LAYERS, num_hidden_layers=len(LAYERS),
    )  # fmt: skip
    return path, hf_model(path)


def _config(path: str, blocks: float, max_tokens: int = 32, **extra) -> dict:
    """A budget of `blocks` one-pool blocks (every layer's keys), prefix caching off (the
    default), chunked prefill off (a local pool turns it on); a step budget of 32 tokens by
    default, so a wrapping ring's chunks are of 32 (local_chunk) and its 5 blocks wrap past 80
    tokens."""
    c = transformers.AutoConfig.from_pretrained(path)
    per_block = c.num_hidden_layers * 2 * BLOCK * c.num_key_value_heads * c.head_dim * 4
    return dict(
        block_size_tokens=BLOCK, max_tokens=max_tokens, max_requests=4, max_sequence_length=256,
        buffer_size_gb=blocks * per_block / 1024**3, **extra,
    )  # fmt: skip


def test_served_equal_hf_with_wrapping_rings(gemma, tmp_path):
    """Requests of up to 100 prompt tokens outgrow their rings of 5 blocks (80 keys): they
    prefill in chunks of 32 and wrap, overlapped steps, and equal transformers; the engine's plans
    replay; a suspend that drops the KV recomputes into the rings."""
    from taipan import replay
    from taipan.actors.record import read_log

    path, hf = gemma
    rec = tmp_path / "rec"
    with LLM(path, record_dir=str(rec), **_config(path, 12, overlap_steps=True)) as llm:
        done = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        [rank] = llm.stats().ranks
        assert rank.num_local_blocks > 0 and rank.local_blocks_used == 0
        assert llm.pause().state == "PAUSED"
        assert llm.suspend("recompute").state == "SUSPENDED"
        llm.resume()
        llm.unpause()
        again = llm.generate(PROMPTS[2:4], GREEDY, use_tqdm=False)
    assert_equals_hf(done + again, hf)
    logs = {name: list(read_log(rec / f"{name}.tplog")) for name in ("engine-0",)}
    assert replay.check(logs, {name: rec / f"{name}.tplog" for name in logs}) == 0


def test_one_budget_holds_more_requests_with_a_windowed_pool(gemma):
    """Four requests of 165 tokens (11 blocks each) on a budget of 32 one-pool blocks, steps of
    64 tokens: one pool for every layer (disable_hybrid_kv_cache_manager, vLLM's name) pauses
    requests; the split (the global layer's blocks in the main pool, 44 of them, the three
    local layers' rings of 7 blocks apart: 28 blocks of three layers) runs them all at once."""
    path, hf = gemma
    prompts = [PROMPTS[3] + PROMPTS[2], PROMPTS[2] + PROMPTS[3]] * 2
    one_pool = dict(enable_chunked_prefill=True, disable_hybrid_kv_cache_manager=True)
    with LLM(path, **_config(path, 32, max_tokens=64, **one_pool)) as llm:
        one = llm.generate(prompts, GREEDY, use_tqdm=False)
        [rank] = llm.stats().ranks
        assert rank.num_local_blocks == 0 and rank.paused_total > 0
    with LLM(path, **_config(path, 32, max_tokens=64)) as llm:
        split = llm.generate(prompts, GREEDY, use_tqdm=False)
        [rank] = llm.stats().ranks
        assert rank.num_local_blocks == 28 and rank.paused_total == 0
        assert rank.num_blocks == 44  # (blocks of the one global layer)
    assert [d.token_ids for d in split] == [d.token_ids for d in one]
    assert_equals_hf(split, hf)


def test_pauses_and_evictions_under_a_split_give_rings_back(gemma):
    """Four requests of 165 tokens on 20 one-pool blocks with room for half a paused block:
    requests pause and are evicted (their rings given back, their windows recomputed into new
    ones) and the tokens still equal transformers'; no ring is left taken."""
    path, hf = gemma
    c = transformers.AutoConfig.from_pretrained(path)
    per_block = c.num_hidden_layers * 2 * BLOCK * c.num_key_value_heads * c.head_dim * 4
    prompts = [PROMPTS[3] + PROMPTS[2], PROMPTS[2] + PROMPTS[3]] * 2
    paused = 0.5 * per_block / 1024**3
    with LLM(path, **_config(path, 20, paused_buffer_size_gb=paused)) as llm:
        done = llm.generate(prompts, GREEDY, use_tqdm=False)
        [rank] = llm.stats().ranks
    assert rank.num_local_blocks > 0 and rank.local_blocks_used == 0
    assert rank.paused_total > 0 and rank.evicted_total > 0, rank
    assert_equals_hf(done, hf)


def test_a_budget_too_small_for_a_ring_keeps_one_pool(gemma):
    """3 one-pool blocks of budget: the windowed layers' share (2.25 of them) holds no ring of
    5 blocks, so the model keeps one pool (a split would refuse requests one pool serves)."""
    path, hf = gemma
    with LLM(path, **_config(path, 3.5)) as llm:
        done = llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False)
        [rank] = llm.stats().ranks
    assert rank.num_local_blocks == 0 and rank.num_blocks == 3
    assert_equals_hf(done, hf)


def test_speculative_verify_rows_on_wrapping_rings(gemma):
    """n-gram drafts (k = 3) on a prompt that repeats itself: verify rows of four tokens write
    into wrapping rings, rejected ones roll back, and the tokens equal transformers'."""
    path, hf = gemma
    repeat = (PROMPTS[2][:20] * 5)[:90]
    with LLM(path, **_config(path, 12, num_speculative_tokens=3)) as llm:
        [done] = llm.generate([repeat], GREEDY, use_tqdm=False)
        stats = llm.stats().merged()
    assert stats.spec_verify_rows > 0
    assert_equals_hf([done], hf)


def test_a_draft_model_beside_the_split(gemma):
    """A self-draft (the target's first two layers, a local one among them) keeps its own KV
    over the main pool's block ids while the target's windowed layers use their rings: verify
    rows, with prefix caching too, and the tokens equal transformers'."""
    path, hf = gemma
    repeat = (PROMPTS[2][:20] * 5)[:90]
    draft = dict(num_speculative_tokens=3, speculative_method="draft_model")
    for caching in (False, True):
        config = _config(path, 12, speculative_model="self:2", enable_prefix_caching=caching)
        with LLM(path, **config, **draft) as llm:
            done = llm.generate([PROMPTS[3], repeat], GREEDY, use_tqdm=False)
            stats = llm.stats().merged()
        assert stats.spec_verify_rows > 0 and stats.num_local_blocks > 0
        assert_equals_hf(done, hf)


@pytest.mark.slow
def test_served_at_tp2_equal_hf(gemma):
    """Two processes (gloo), each with its kv heads' share of both pools."""
    path, hf = gemma
    with LLM(path, tensor_parallel_size=2, **_config(path, 12)) as llm:
        done = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert llm.stats().ranks[0].num_local_blocks > 0
    assert_equals_hf(done, hf)


@pytest.mark.gpu
def test_gpu_cuda_graphs_with_a_windowed_pool_equal_hf(tmp_path):
    """On CUDA (graphs on; head_dim 64 for the kernels), fp32 with TF32 off: the windowed
    layers read their rings through the captured graphs' persistent local tables and slots."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    path = make_random_gemma3(
        str(tmp_path / "g"), seed=2, head_dim=64, sliding_window=WINDOW, layer_types=LAYERS,
        num_hidden_layers=len(LAYERS),
    )  # fmt: skip
    hf = hf_model(path, "cuda")
    with LLM(path, device="cuda", **_config(path, 12, overlap_steps=True)) as llm:
        done = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        stats = llm.stats().merged()
    assert stats.steps_graphed > 0 and stats.num_local_blocks > 0
    assert_equals_hf(done, hf, atol=1e-3)


def test_prefix_hits_copy_the_cached_window_into_the_ring(gemma):
    """Prefix caching with the split: the second run of a 70-token prompt skips its cached
    blocks, the windowed keys of the window before the hit copied from the cache into its
    ring; the tokens equal the first run's and transformers'. A flush drops both caches."""
    from tests.test_e2e_dense import CACHED, SHARED

    path, hf = gemma
    with LLM(path, **_config(path, 12, enable_prefix_caching=True)) as llm:
        [first] = llm.generate([SHARED], CACHED, use_tqdm=False)
        [again] = llm.generate([SHARED], CACHED, use_tqdm=False)
        [rank] = llm.stats().ranks
        assert again.num_cached_tokens == 4 * BLOCK and first.num_cached_tokens == 0
        assert rank.local_blocks_cached >= 4 and rank.local_blocks_copied == 2
        assert llm.pause().state == "PAUSED"
        llm.flush_cache()
        llm.unpause()
        [third] = llm.generate([SHARED], CACHED, use_tqdm=False)
        assert third.num_cached_tokens == 0
    assert again.token_ids == first.token_ids == third.token_ids
    assert_equals_hf([first, again], hf)
