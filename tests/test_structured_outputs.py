"""Structured outputs through the real runtime (engine, gpu actor and their sockets; the tiny
random Llama on the CPU, whose greedy choices are arbitrary, the grammar alone keeps them in
line): every output parses against its grammar with overlapped steps on and off, a bad grammar
is refused at submission naming why, and requests with and without grammars share steps."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from taipan import LLM, RequestError
from taipan.messages.requests import SamplingParams, StructuredOutput
from tests.random_llama import TINY_SHAPE, make_random_llama

pytest.importorskip("llguidance")

SCHEMA = {
    "type": "object",
    # (bounded: a random model never stops a number or a string of its own accord)
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["ok", "n"],
    "additionalProperties": False,
    # (no whitespace between tokens: a random model pads every gap to its bound, which can
    # outrun max_tokens)
    "x-guidance": {"whitespace_flexible": False},
}


def _sampling(kind: str, spec: str, **kw) -> SamplingParams:
    kw = {"max_tokens": 120, "temperature": 0.0} | kw
    return SamplingParams(structured=StructuredOutput(kind, spec), **kw)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_random_llama(str(tmp_path_factory.mktemp("tiny") / "m"), TINY_SHAPE)


@pytest.mark.parametrize("overlap", [True, False])
def test_outputs_keep_to_their_grammars(tiny, overlap):
    cases = [
        ("choice", json.dumps(["red", "green", "blue"]), lambda t: t in ("red", "green", "blue")),
        ("regex", "[0-9]{3}-[a-z]{2}", lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
        ("json_schema", json.dumps(SCHEMA), lambda t: set(json.loads(t)) == {"ok", "n"}),
    ]
    prompts = [[5, 17, 42, 9], [3, 3, 3], [100, 7]]
    with LLM(tiny, max_requests=8, overlap_steps=overlap, buffer_size_gb=0.05) as llm:
        samplings = [_sampling(kind, spec) for kind, spec, _ in cases]
        plain = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        # Grammar rows beside a plain one in the same steps, twice each (sampled, seeded too).
        outs = llm.generate(prompts + [[1, 2]], samplings + [plain], use_tqdm=False)
        sampled = [_sampling(k, s, temperature=1.0, seed=i) for i, (k, s, _) in enumerate(cases)]
        outs += llm.generate(prompts, sampled, use_tqdm=False)
        for (kind, _, check), out in zip(cases * 2, outs[:3] + outs[4:], strict=True):
            text = llm.tokenizer.decode(out.token_ids)
            assert check(text), (kind, text)
            assert out.finish_reason == "stop", (kind, text, out.finish_reason)
        assert len(outs[3].token_ids) == 8


@pytest.mark.parametrize(
    ("overlap", "mode"), [(True, "check"), (False, "check"), (True, "wait"), (True, "mask")]
)
def test_checked_greedy_rows_equal_masked_ones(tiny, overlap, mode, monkeypatch):
    """A greedy grammar row is checked after sampling (its mask computed only when the grammar
    rejects its choice), or under TAIPAN_GRAMMAR_MASKS=mask masked before; one with processed
    log-probs is masked before in every mode. All greedy under the same grammar: the same
    tokens (this random model's choices are mostly rejected, so the masked fallback runs at
    most steps), alone and sharing steps. In "check" mode with overlapped steps the next step
    does not wait for the check: the rows that read a replaced token are void and computed
    again (grammar_void_rows counts them); "wait" and "mask" never void a row."""
    monkeypatch.setenv("TAIPAN_GRAMMAR_MASKS", mode)
    prompts = [[5, 17, 42, 9], [3, 3, 3], [100, 7], [8, 8]]
    specs = [("json_schema", json.dumps(SCHEMA)), ("regex", "[0-9]{3}-[a-z]{2}")] * 2
    checked = [_sampling(kind, spec) for kind, spec in specs]
    masked = [
        _sampling(kind, spec, return_log_probs=True, logprobs_mode="processed")
        for kind, spec in specs
    ]
    with LLM(tiny, max_requests=8, overlap_steps=overlap, buffer_size_gb=0.05) as llm:
        got = llm.generate(prompts, checked, use_tqdm=False)
        want = llm.generate(prompts, masked, use_tqdm=False)
        both = llm.generate(prompts[:2] + prompts[2:], checked[:2] + masked[2:], use_tqdm=False)
        void = llm.stats().merged().grammar_void_rows
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert (void > 0) == (overlap and mode == "check"), void
    assert [o.token_ids for o in both] == [o.token_ids for o in want]


@pytest.mark.parametrize("overlap", [True, False])
def test_checked_sampled_rows_equal_masked_ones(tiny, overlap, monkeypatch):
    """ "check" mode checks a seeded temperature draw with no top-k / top-p / min-p too: kept
    where the grammar allows it, else drawn again over the allowed tokens with its own noise,
    so the tokens equal "mask" mode's, which masks before drawing (this random model's draws
    are mostly refused: the second draw runs at most steps). With raw log-probs (checked in
    the launch) as well; a top-p row keeps its mask in both modes."""
    prompts = [[5, 17, 42, 9], [3, 3, 3], [100, 7], [8, 8], [6, 1]]
    specs = [("json_schema", json.dumps(SCHEMA)), ("regex", "[0-9]{3}-[a-z]{2}")] * 2
    specs.append(("regex", "[0-9]{3}-[a-z]{2}"))
    drawn = [_sampling(k, sp, temperature=1.0, seed=10 + i) for i, (k, sp) in enumerate(specs)]
    drawn[-1] = _sampling(*specs[-1], temperature=0.8, top_p=0.9, seed=3)
    logged = [dataclasses.replace(p, return_log_probs=True) for p in drawn]
    got = {}
    for mode in ("mask", "check"):
        monkeypatch.setenv("TAIPAN_GRAMMAR_MASKS", mode)
        with LLM(tiny, max_requests=8, overlap_steps=overlap, buffer_size_gb=0.05) as llm:
            outs = llm.generate(prompts, drawn, use_tqdm=False)
            outs += llm.generate(prompts, logged, use_tqdm=False)
            void = llm.stats().merged().grammar_void_rows
            texts = [llm.tokenizer.decode(o.token_ids) for o in outs]
        got[mode] = [o.token_ids for o in outs]
        assert (void > 0) == (overlap and mode == "check"), (mode, void)
        for (kind, _), text in zip(specs * 2, texts, strict=True):
            ok = re.fullmatch("[0-9]{3}-[a-z]{2}", text) if kind == "regex" else json.loads(text)
            assert ok, (mode, kind, text)
    assert got["check"] == got["mask"]


def test_void_rows_keep_outputs_under_kv_pressure_and_prefix_caching(tiny, monkeypatch):
    """ "check" mode with overlapped steps in a pool too small for its requests (8 blocks of 16
    tokens, 6 grammar requests growing to 2-3 blocks each: they pause, are evicted and
    recompute) and with prefix caching (two prompts share their first block): the tokens of
    "wait" mode, where no row is ever void; every block comes back."""
    shape = TINY_SHAPE
    kv_per_token = shape["num_key_value_heads"] * shape["head_dim"]
    per_block = shape["num_hidden_layers"] * 2 * 16 * kv_per_token * 4  # (fp32 K, V of a layer)
    config = dict(
        block_size_tokens=16, buffer_size_gb=8.5 * per_block / 1024**3, max_tokens=24,
        max_requests=8, max_sequence_length=512, overlap_steps=True, enable_prefix_caching=True,
    )  # fmt: skip
    shared = list(range(200, 216))
    prompts = [shared + [5, 17], shared + [9], [3, 3, 3], [100, 7], [8, 8, 1], [4] * 10]
    specs = [("json_schema", json.dumps(SCHEMA)), ("regex", "[0-9]{3}-[a-z]{30}")] * 3
    sampling = [_sampling(kind, spec, max_tokens=36) for kind, spec in specs]
    got = {}
    for mode in ("wait", "check"):
        monkeypatch.setenv("TAIPAN_GRAMMAR_MASKS", mode)
        with LLM(tiny, **config) as llm:
            got[mode] = [o.token_ids for o in llm.generate(prompts, sampling, use_tqdm=False)]
            stats = llm.stats().merged()
        assert stats.evicted_total > 0 and stats.prefix_cached_tokens > 0, (mode, stats)
        assert (stats.grammar_void_rows > 0) == (mode == "check"), (mode, stats)
    assert got["check"] == got["wait"]


def test_a_bad_grammar_is_refused_naming_why(tiny):
    with LLM(tiny, buffer_size_gb=0.05) as llm:
        with pytest.raises(RequestError, match="regex"):
            llm.generate([[1, 2, 3]], _sampling("regex", "(unclosed"), use_tqdm=False)
        with pytest.raises(RequestError, match="structured.kind"):
            llm.generate([[1, 2, 3]], _sampling("yaml", ""), use_tqdm=False)
        [ok] = llm.generate([[1, 2, 3]], _sampling("choice", '["x"]'), use_tqdm=False)
        assert llm.tokenizer.decode(ok.token_ids) == "x"


def test_the_engine_sends_each_grammar_once_and_drops_it_when_its_request_ends():
    """actors/engine/grammar.py's GrammarBook, alone: rows only where a grammar request
    samples, its grammar in the first plan that samples for it, its drop after it has ended."""
    import types

    import numpy as np

    from taipan.actors.engine.grammar import GrammarBook

    g = StructuredOutput("regex", "a+")

    def chunk(rid, structured, samples=True):
        sampling = SamplingParams(structured=structured)
        return types.SimpleNamespace(
            request=types.SimpleNamespace(request_id=rid, sampling=sampling), samples=samples
        )

    book = GrammarBook()
    batch = types.SimpleNamespace(chunks=[chunk(1, None), chunk(2, g, samples=False)])
    assert book.arrays(batch, {1: 0, 2: 0}) == {}  # (a prefill chunk that samples nothing)
    batch = types.SimpleNamespace(chunks=[chunk(1, None), chunk(2, g)])
    first = book.arrays(batch, {1: 0, 2: 0})
    assert first["grammar_rows"].tolist() == [-1, 2] and [
        s.request_id for s in first["grammar_new"]
    ] == [2]
    again = book.arrays(batch, {1: 0, 2: 0})
    assert again["grammar_new"] == [] and "grammar_drop" not in again
    ended = book.arrays(types.SimpleNamespace(chunks=[chunk(1, None)]), {1: 0})
    assert ended == {"grammar_drop": ended["grammar_drop"]} and ended["grammar_drop"].tolist() == [
        2
    ]
    assert book.live == set() and isinstance(ended["grammar_drop"], np.ndarray)


@pytest.mark.gpu
def test_gpu_checked_rows_equal_masked_ones_with_graphs_and_overlap(tmp_path, monkeypatch):
    """On CUDA (graphs, overlapped steps): a checked greedy row (checked when its step is
    collected; the next step, launched inline without waiting for it, reads the unchecked
    token, and its row is void where the check replaced it) gives the tokens of a masked one,
    in fp32, and each output keeps to its grammar; so it does with TAIPAN_GRAMMAR_MASKS=wait
    (the next forward waits for the check: no void row); with n-gram drafts (verify rows in
    mixed graphs, each grammar walked over its positions) the same tokens again."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from tests.random_llama import GPU_TINY_SHAPE

    gpu_tiny = make_random_llama(str(tmp_path / "m"), GPU_TINY_SHAPE)
    prompts = [[5, 17, 42, 9], [3, 3, 3], [100, 7], [8, 8]] * 2
    specs = [("json_schema", json.dumps(SCHEMA)), ("regex", "[0-9]{3}-[a-z]{2}")] * 4
    checked = [_sampling(kind, spec) for kind, spec in specs]
    masked = [
        _sampling(kind, spec, return_log_probs=True, logprobs_mode="processed")
        for kind, spec in specs
    ]
    with LLM(gpu_tiny, device="cuda", dtype="float32", max_requests=8) as llm:
        got = llm.generate(prompts, checked, use_tqdm=False)
        want = llm.generate(prompts, masked, use_tqdm=False)
        stats = llm.stats().merged()
        texts = [llm.tokenizer.decode(o.token_ids) for o in got]
    monkeypatch.setenv("TAIPAN_GRAMMAR_MASKS", "wait")  # (read by the engine process)
    with LLM(gpu_tiny, device="cuda", dtype="float32", max_requests=8) as llm:
        waited = llm.generate(prompts, checked, use_tqdm=False)
        assert llm.stats().merged().grammar_void_rows == 0
    monkeypatch.delenv("TAIPAN_GRAMMAR_MASKS")
    # The checked rows again with n-gram drafts: their grammars walked over verify rows.
    with LLM(
        gpu_tiny, device="cuda", dtype="float32", max_requests=8, num_speculative_tokens=4
    ) as llm:
        spec = llm.generate(prompts, checked, use_tqdm=False)
        assert llm.stats().merged().spec_draft_tokens > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.token_ids for o in waited] == [o.token_ids for o in got]
    assert [o.token_ids for o in spec] == [o.token_ids for o in got]
    assert stats.steps_graphed > 0 and stats.grammar_void_rows > 0, stats
    for (kind, _), text in zip(specs, texts, strict=True):
        if kind == "regex":
            assert re.fullmatch("[0-9]{3}-[a-z]{2}", text), text
        else:
            assert set(json.loads(text)) == {"ok", "n"}, text


@pytest.mark.gpu
def test_gpu_checked_draws_equal_masked_ones_with_graphs_and_overlap(tmp_path, monkeypatch):
    """On CUDA (graphs, overlapped steps, the Triton sampler), fp32: seeded temperature draws
    checked in "check" mode (a refused draw drawn again over the allowed tokens with its own
    noise) give the tokens "mask" mode draws after masking, with and without raw log-probs."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from tests.random_llama import GPU_TINY_SHAPE

    gpu_tiny = make_random_llama(str(tmp_path / "m"), GPU_TINY_SHAPE)
    prompts = [[5, 17, 42, 9], [3, 3, 3], [100, 7], [8, 8]] * 2
    specs = [("json_schema", json.dumps(SCHEMA)), ("regex", "[0-9]{3}-[a-z]{2}")] * 4
    drawn = [_sampling(k, sp, temperature=1.0, seed=20 + i) for i, (k, sp) in enumerate(specs)]
    logged = [dataclasses.replace(p, return_log_probs=True) for p in drawn]
    got = {}
    for mode in ("mask", "check"):
        monkeypatch.setenv("TAIPAN_GRAMMAR_MASKS", mode)  # (read by the engine process)
        with LLM(gpu_tiny, device="cuda", dtype="float32", max_requests=8) as llm:
            outs = llm.generate(prompts, drawn, use_tqdm=False)
            outs += llm.generate(prompts, logged, use_tqdm=False)
            stats = llm.stats().merged()
        got[mode] = [o.token_ids for o in outs]
        assert stats.steps_graphed > 0 and (stats.grammar_void_rows > 0) == (mode == "check")
    assert got["check"] == got["mask"]


def test_grammar_requests_speculate_and_keep_their_outputs(tiny):
    """With n-gram drafts, grammar requests speculate and give the tokens they give without:
    greedy ones (their grammar walked over the scored positions), a seeded sampled one and a
    greedy one with processed log-probs (each scored position masked as plain decoding masks
    it), beside a seeded sampled request without a grammar (verified on the device)."""
    specs = [("regex", "(ab ){16}"), ("json_schema", json.dumps(SCHEMA))]
    prompts = [[5, 17, 42, 9], [3, 3, 3], [1, 2, 3, 1, 2, 3], [9, 9], [4, 5]]
    samplings = [_sampling(kind, spec) for kind, spec in specs] + [
        SamplingParams(max_tokens=24, temperature=0.8, seed=3, ignore_eos=True),
        _sampling("regex", "(ab ){16}", temperature=0.9, seed=5),
        _sampling("regex", "(cd ){12}", return_log_probs=True, logprobs_mode="processed"),
    ]
    outs, stats = {}, {}
    for k in (0, 4):
        with LLM(tiny, num_speculative_tokens=k, buffer_size_gb=0.05) as llm:
            got = llm.generate(prompts, samplings, use_tqdm=False)
            outs[k] = [o.token_ids for o in got]
            stats[k] = llm.stats().merged()
            texts = [llm.tokenizer.decode(o.token_ids) for o in got]
    assert outs[4] == outs[0]
    assert re.fullmatch("(ab ){16}", texts[0]) and re.fullmatch("(ab ){16}", texts[3]), texts
    assert re.fullmatch("(cd ){12}", texts[4]), texts[4]
    assert set(json.loads(texts[1])) == {"ok", "n"}, texts[1]
    assert stats[4].spec_accepted_tokens > 0 and stats[0].spec_draft_tokens == 0, stats[4]
