"""Beam search as vLLM runs it (runtime/beam_search.py): on the client, one engine step per
token, the 2 x beam_width most likely next tokens of every beam from the engine's log-probs.
Against a reference written out over transformers' logits on a tiny random Llama (fp32, CPU):
the same beams, scores and order; EOS completes a beam unless ignore_eos; the Python API
(LLM.beam_search) and the OpenAI server's `use_beam_search` (completions and chat, `n` beams,
`length_penalty`), with what cannot be combined with it refused (400 naming the field)."""

from __future__ import annotations

import dataclasses

import httpx
import numpy as np
import pytest
import torch

from taipan import LLM, BeamSearchParams
from taipan.beam_search import MAX_BEAM_WIDTH, beam_score

transformers = pytest.importorskip("transformers")
PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.random_llama import TINY_SHAPE, make_random_llama

    path = make_random_llama(str(tmp_path_factory.mktemp("beam") / "tiny"), TINY_SHAPE)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return path, model.eval()


@pytest.fixture(scope="module")
def served(tiny):
    """(the runtime, an LLM connected to it): prefix caching on, as beam search wants."""
    from taipan import InferenceConfig, Runtime

    config = InferenceConfig(
        block_size_tokens=16, max_tokens=64, max_requests=16, max_sequence_length=128,
        enable_prefix_caching=True,
    )  # fmt: skip
    with Runtime(tiny[0], config) as rt, LLM(address=rt.address) as llm:
        yield rt, llm


@pytest.fixture
def llm(served):
    return served[1]


def reference(model, prompt, width, steps, eos, penalty):
    """vLLM's algorithm over transformers' log-probs: (tokens, cum log-prob) best first."""
    beams, done = [(list(prompt), 0.0)], []

    def score(b):
        return beam_score(b[0], b[1], eos, penalty)

    for _ in range(steps):
        if not beams:
            break
        grown = []
        for tokens, cum in beams:
            with torch.no_grad():
                lp = torch.log_softmax(model(torch.tensor([tokens])).logits[0, -1].float(), -1)
            top = torch.topk(lp, 2 * width)
            for t, v in zip(top.indices.tolist(), top.values.tolist(), strict=True):
                (done if t in eos else grown).append((tokens + [t], cum + v))
        beams = sorted(grown, key=score, reverse=True)[:width]
    return sorted(done + beams, key=score, reverse=True)[:width]


@pytest.mark.parametrize("width, penalty", [(1, 1.0), (3, 1.0), (4, 0.5)])
def test_beams_equal_the_reference(tiny, llm, width, penalty):
    params = BeamSearchParams(beam_width=width, max_tokens=6, length_penalty=penalty)
    outs = llm.beam_search(PROMPTS, params)
    eos = set(llm.tokenizer.eos_token_ids)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        want = reference(tiny[1], prompt, width, 6, eos, penalty)
        assert [s.tokens for s in out.sequences] == [w[0] for w in want]
        np.testing.assert_allclose(
            [s.cum_logprob for s in out.sequences], [w[1] for w in want], atol=1e-4
        )
        assert all(s.text == llm.tokenizer.decode(s.tokens[len(prompt) :]) for s in out.sequences)
    if width == 1:  # one beam is greedy decoding
        from taipan import SamplingParams

        greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        [plain] = llm.generate([PROMPTS[0]], greedy, use_tqdm=False)
        assert outs[0].sequences[0].tokens[len(PROMPTS[0]) :] == plain.token_ids


def test_eos_completes_a_beam_unless_ignored(tiny, llm, monkeypatch):
    """With a common next token as EOS, beams that choose it complete ("stop", their text
    without it); with ignore_eos they run on."""
    first = reference(tiny[1], PROMPTS[1], 2, 1, set(), 1.0)[0][0][-1]
    monkeypatch.setattr(llm.tokenizer, "eos_token_ids", (first,))
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    [out] = llm.beam_search([PROMPTS[1]], params)
    stopped = [s for s in out.sequences if s.finish_reason == "stop"]
    assert stopped and all(s.tokens[-1] == first for s in stopped)
    want = reference(tiny[1], PROMPTS[1], 2, 4, {first}, 1.0)
    assert [s.tokens for s in out.sequences] == [w[0] for w in want]
    [free] = llm.beam_search([PROMPTS[1]], dataclasses.replace(params, ignore_eos=True))
    assert all(s.finish_reason == "length" for s in free.sequences)


def test_bad_params_are_refused(llm):
    with pytest.raises(ValueError, match=f"beam_width must be in \\[1, {MAX_BEAM_WIDTH}\\]"):
        llm.beam_search(PROMPTS, BeamSearchParams(beam_width=MAX_BEAM_WIDTH + 1, max_tokens=2))
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        llm.beam_search(PROMPTS, BeamSearchParams(beam_width=2, max_tokens=0))


def test_use_beam_search_over_http(served):
    """`use_beam_search` with `n` beams on /v1/completions (each prompt's beams, best first)
    and /v1/chat/completions; fields it cannot honour are a 400 naming them."""
    from tests.test_http_openai_parity import _served

    rt, llm = served
    with _served(rt) as url:
        body = {"prompt": PROMPTS, "max_tokens": 5, "n": 3, "use_beam_search": True,
                "length_penalty": 0.5}  # fmt: skip
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
        outs = llm.beam_search(PROMPTS, BeamSearchParams(3, 5, length_penalty=0.5))
        want = [s.text for o in outs for s in o.sequences]
        assert [c["text"] for c in r["choices"]] == want
        assert [c["index"] for c in r["choices"]] == list(range(6))
        pairs = zip(outs, PROMPTS, strict=True)
        generated = sum(len(s.tokens) - len(p) for o, p in pairs for s in o.sequences)
        assert r["usage"]["completion_tokens"] == generated
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "n": 2,
                "use_beam_search": True}  # fmt: skip
        r = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=120).json()
        assert len(r["choices"]) == 2 and all(c["message"]["content"] for c in r["choices"])
        for extra, field in (({"stream": True}, "stream"), ({"logprobs": 1}, "logprobs"),
                             ({"stop": "x"}, "stop"), ({"n": 11}, "n"),
                             ({"temperature": 0.7}, "temperature")):  # fmt: skip
            r = httpx.post(f"{url}/v1/completions", json={**body, **extra}, timeout=120)
            assert r.status_code == 400 and r.json()["error"]["param"] == field, (extra, r.text)
        for t in (0, 1):  # (what leaves the model's log-probs as they are)
            r = httpx.post(f"{url}/v1/completions", json={**body, "temperature": t}, timeout=120)
            assert [c["text"] for c in r.json()["choices"]] == want
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "length_penalty": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "length_penalty"
