"""`LLM` and `AsyncLLM` (issue 11) with real embedded runtimes and the real SmolLM2 model:
completions in input order equal to a plain Client's, one SamplingParams per prompt, chat, the
progress bar, lifecycle methods, shutdown stopping the processes; AsyncLLM's streamed deltas,
many requests at once, and `serve` answering the openai client; the refusals (address= with a
config or with direct mode, a wrong number of SamplingParams).

Direct mode (`use_coordinator=False`): no coordinator process; greedy outputs, log-probs, stop
strings and streamed deltas equal coordinator mode's; stats work and every lifecycle method
raises RuntimeError naming the mode; shutdown aborts what runs (each request gets its terminal
output) and the engine exits by itself with code 0; a killed engine fails its requests and
every later call within seconds."""

from __future__ import annotations

import asyncio

import openai
import pytest

from taipan import LLM, AsyncLLM, SamplingParams
from taipan.client import Client, RuntimeUnreachable
from taipan.launcher import LaunchError, Runtime
from taipan.messages.lifecycle import LifecycleState
from taipan.messages.requests import FinishReason
from tests.ports import free_port

PROMPTS = ["The capital of France is", [504, 3458, 314], "Water boils at"]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
CONFIG = dict(max_requests=8, max_sequence_length=256)


@pytest.fixture(scope="module")
def llm(model_path):
    with LLM(model_path, **CONFIG) as llm:
        yield llm


def test_generate_in_order_equals_a_client(llm, capsys, monkeypatch):
    # The progress bar, whatever the user's environment says; TQDM_DISABLE=1 (a user's choice)
    # hides it even when asked for.
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=True)
    assert "generate" in capsys.readouterr().err
    monkeypatch.setenv("TQDM_DISABLE", "1")
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=True)] == [
        o.token_ids for o in outs
    ]
    assert "generate" not in capsys.readouterr().err
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
    assert llm.flush_cache().state == LifecycleState.PAUSED
    assert llm.unpause().state == LifecycleState.RUNNING
    assert llm.pause(mode="wait", clear_cache=True, timeout=60).state == LifecycleState.PAUSED
    assert llm.unpause().state == LifecycleState.RUNNING
    assert llm.is_primary_rank


def test_chat_with_a_template_of_its_own(llm, tmp_path):
    """vLLM's LLM.chat arguments: `chat_template` (the source, or a file's path),
    `chat_template_kwargs` (the template's variables) and `add_generation_prompt`."""
    conv = [{"role": "user", "content": "Say hi."}]
    template = "{% for m in messages %}{{ greeting }}{{ m['content'] }}{% endfor %}"
    template += "{% if add_generation_prompt %} ->{% endif %}"
    (tmp_path / "t.jinja").write_text(template)
    want = llm.tokenizer.encode("Hello: Say hi. ->", add_special_tokens=False)
    kw = {"chat_template_kwargs": {"greeting": "Hello: "}, "use_tqdm": False}
    for source in (template, str(tmp_path / "t.jinja")):
        [a] = llm.chat(conv, GREEDY, chat_template=source, **kw)
        assert a.prompt_token_ids == want
    [b] = llm.chat(conv, GREEDY, chat_template=template, add_generation_prompt=False, **kw)
    assert b.prompt_token_ids == llm.tokenizer.encode("Hello: Say hi.", add_special_tokens=False)
    [plain] = llm.chat(conv, GREEDY, use_tqdm=False)
    [text] = llm.chat("Say hi.", GREEDY, use_tqdm=False)
    assert plain.prompt_token_ids == text.prompt_token_ids != want
    with pytest.raises(ValueError, match="does not parse"):
        llm.chat(conv, GREEDY, chat_template="{% for %}", use_tqdm=False)


def test_refusals(model_path, runtime):
    with pytest.raises(ValueError, match="direct mode .* starts its own engine rank"):
        LLM(address=runtime.address, use_coordinator=False)
    with pytest.raises(LaunchError, match="use AsyncLLM.serve in direct mode"):
        Runtime(model_path, direct=True, http_port=8000)
    with pytest.raises(LaunchError, match="chat_template, trust_request_chat_template: options"):
        Runtime(model_path, chat_template="{{ x }}", trust_request_chat_template=True)
    with pytest.raises(LaunchError, match="neither a file nor a template"):
        Runtime(model_path, http_port=8000, chat_template="no/such/file.jinja")
    with pytest.raises(LaunchError, match="does not parse"):
        Runtime(model_path, http_port=8000, chat_template="{% if %}")
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
        assert str((await llm.pause(mode="wait", clear_cache=True)).state) == "PAUSED"
        assert str((await llm.flush_cache()).state) == "PAUSED"
        assert str((await llm.unpause()).state) == "RUNNING"

        port = free_port()
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


# --- direct mode ------------------------------------------------------------------------------

LOGPROBS = SamplingParams(max_tokens=6, temperature=0.0, return_log_probs=True, top_n_logprobs=2)
STOPPED = SamplingParams(max_tokens=24, temperature=0.0, stop=["\n"])


@pytest.fixture(scope="module")
def direct(model_path):
    with LLM(model_path, use_coordinator=False, **CONFIG) as llm:
        yield llm


def test_direct_mode_equals_coordinator_mode(llm, direct):
    assert [name for name, _ in direct._runtime.procs] == ["engine-0"]  # no coordinator
    assert direct.is_primary_rank and not direct.use_coordinator
    for sampling in (GREEDY, LOGPROBS, STOPPED):
        want = llm.generate(PROMPTS, sampling, use_tqdm=False)
        got = direct.generate(PROMPTS, sampling, use_tqdm=False)
        for w, g in zip(want, got, strict=True):
            assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason)
            assert g.stop_reason == w.stop_reason
            if sampling is LOGPROBS:
                # fp32 sums differ in their last bits with the step's batch (which requests
                # share it depends on arrival): 1e-5 absolute, or relative for large ones.
                assert g.log_probs == pytest.approx(w.log_probs, rel=1e-5, abs=1e-5)
                assert g.prompt_log_probs == pytest.approx(w.prompt_log_probs, rel=1e-5, abs=1e-5)
                assert [list(t) for t in g.top_n_logprobs] == [list(t) for t in w.top_n_logprobs]
    assert any(o.stop_reason == "\n" for o in got)  # the stop string was matched on text
    [a] = llm.chat([{"role": "user", "content": "Say hi."}], GREEDY, use_tqdm=False)
    [b] = direct.chat([{"role": "user", "content": "Say hi."}], GREEDY, use_tqdm=False)
    assert a.token_ids == b.token_ids


def test_direct_mode_stats_and_lifecycle_refused(direct, tmp_path):
    stats = direct.stats()
    assert stats.state == LifecycleState.RUNNING
    assert [r.rank for r in stats.ranks] == [0] and stats.ranks[0].running == 0
    calls = {
        "pause": direct.pause,
        "unpause": direct.unpause,
        "suspend": lambda: direct.suspend("offload"),
        "resume": direct.resume,
        "update_weights": lambda: direct.update_weights(path=str(tmp_path)),
        "flush_cache": direct.flush_cache,
    }
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match=f"{name} needs coordinator mode: in direct mode"):
            call()
    # The client under it refuses too (no coordinator to send a control to).
    with pytest.raises(RuntimeError, match="direct mode"):
        direct.client.pause()
    [out] = direct.generate(PROMPTS[0], GREEDY, use_tqdm=False)  # still serving
    assert out.token_ids


@pytest.mark.asyncio
async def test_async_direct_streams_and_shutdown_aborts(model_path, llm):
    want = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm_direct = AsyncLLM(model_path, use_coordinator=False, **CONFIG)
    async with llm_direct:
        runtime = llm_direct._runtime

        async def streamed(p):
            tokens, last = [], None
            async for d in llm_direct.generate(p, GREEDY):
                tokens, last = tokens + d.token_ids, d
            assert last.finished
            return tokens

        got = await asyncio.gather(*(streamed(p) for p in PROMPTS))
        assert got == [w.token_ids for w in want]
        # Requests still running at shutdown each get their one terminal output.
        long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        running = asyncio.ensure_future(llm_direct.generate_all(PROMPTS, long))
        while (await llm_direct.stats()).ranks[0].running < len(PROMPTS):
            await asyncio.sleep(0.05)
    assert {o.finish_reason for o in await running} == {FinishReason.ABORT}
    assert [p.returncode for _, p in runtime.procs] == [0]  # it exited as told, no signal


def test_direct_mode_engine_death_is_seen_within_seconds(model_path):
    import signal
    import time

    with LLM(model_path, use_coordinator=False, **CONFIG) as direct:
        long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        [proc] = [p for _, p in direct._runtime.procs]
        stream = direct.client.stream(PROMPTS[0], long)
        first = next(stream)  # it runs
        assert not first.finished
        start = time.monotonic()
        proc.send_signal(signal.SIGKILL)
        *_, last = list(stream)
        assert last.finished and last.finish_reason == FinishReason.ERROR
        assert "engine rank 0 died" in last.error
        assert time.monotonic() - start < 5
        [late] = direct.client.generate(PROMPTS[0], GREEDY, raise_on_error=False)
        assert "engine rank 0 died" in late.error
        with pytest.raises(RuntimeUnreachable, match="engine rank 0 died"):
            direct.stats()
