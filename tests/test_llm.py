"""`LLM` and `AsyncLLM` (issue 11) with real embedded runtimes and the real SmolLM2 model:
completions in input order equal to a plain Client's, one SamplingParams per prompt, chat, the
progress bar, lifecycle methods, shutdown stopping the processes; AsyncLLM's streamed deltas,
many requests at once, and `serve` answering the openai client; the refusals (direct mode not
built, address= with a config, a wrong number of SamplingParams)."""

from __future__ import annotations

import asyncio
import socket

import openai
import pytest

from taipan import LLM, AsyncLLM, SamplingParams
from taipan.client import Client
from taipan.messages.lifecycle import LifecycleState

PROMPTS = ["The capital of France is", [504, 3458, 314], "Water boils at"]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
CONFIG = dict(max_requests=8, max_sequence_length=256)


@pytest.fixture(scope="module")
def llm(model_path):
    with LLM(model_path, **CONFIG) as llm:
        yield llm


def test_generate_in_order_equals_a_client(llm, capsys):
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=True)
    assert "generate" in capsys.readouterr().err  # the progress bar
    with Client(llm._runtime.address) as c:
        want = c.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [w.token_ids for w in want]
    assert outs[1].prompt_token_ids == PROMPTS[1]
    # One SamplingParams per prompt; a single prompt.
    lengths = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (1, 3, 5)]
    assert [len(o.token_ids) for o in llm.generate(PROMPTS, lengths, use_tqdm=False)] == [1, 3, 5]
    [one] = llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
    assert one.token_ids == want[0].token_ids
    with pytest.raises(ValueError, match="one SamplingParams per prompt"):
        llm.generate(PROMPTS, lengths[:2])


def test_chat_and_lifecycle(llm):
    conv = [{"role": "user", "content": "Say hi."}]
    [a] = llm.chat(conv, GREEDY, use_tqdm=False)
    [b, c] = llm.chat([conv, conv], GREEDY, use_tqdm=False)
    assert a.token_ids == b.token_ids == c.token_ids and a.text
    assert llm.pause().state == LifecycleState.PAUSED
    assert llm.stats().state == LifecycleState.PAUSED
    assert llm.unpause().state == LifecycleState.RUNNING
    assert llm.is_primary_rank


def test_refusals(model_path, runtime):
    with pytest.raises(NotImplementedError, match="direct mode"):
        LLM(model_path, use_coordinator=False)
    with pytest.raises(ValueError, match="address= connects to a running runtime"):
        LLM(address=runtime.address, max_requests=4)
    with pytest.raises(ValueError, match="either config= or InferenceConfig fields"):
        from taipan import InferenceConfig

        LLM(model_path, config=InferenceConfig(), max_requests=4)


def test_connect_to_a_running_runtime(runtime):
    with LLM(address=runtime.address) as llm:
        [out] = llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
        assert out.token_ids
    assert runtime.alive()  # shutdown of a connected LLM leaves the runtime running


def test_shutdown_stops_the_embedded_runtime(model_path):
    llm = LLM(model_path, **CONFIG)
    runtime = llm._runtime
    assert runtime.alive()
    llm.shutdown()
    llm.shutdown()  # idempotent
    assert not runtime.alive()
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate("x")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.asyncio
async def test_async_llm_streams_runs_many_and_serves(model_path):
    async with AsyncLLM(model_path, **CONFIG) as llm:
        want = await llm.generate_all(PROMPTS, GREEDY)

        async def streamed(p):
            text, tokens, last = "", [], None
            async for d in llm.generate(p, GREEDY):
                text, tokens, last = text + d.text, tokens + d.token_ids, d
            assert last.finished
            return text, tokens

        got = await asyncio.gather(*(streamed(p) for p in PROMPTS))
        assert [t for _, t in got] == [w.token_ids for w in want]
        assert [t for t, _ in got] == [w.text for w in want]
        assert (await llm.stats()).ranks[0].running == 0

        port = _free_port()
        started = asyncio.Event()
        server = asyncio.ensure_future(llm.serve("127.0.0.1", port, started=started))
        await asyncio.wait_for(started.wait(), 30)
        oai = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")
        r = await oai.completions.create(
            model=llm.client.model, prompt=PROMPTS[0], max_tokens=8, temperature=0
        )
        assert r.choices[0].text == want[0].text
        server.cancel()
        await asyncio.gather(server, return_exceptions=True)
        await oai.close()
