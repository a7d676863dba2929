"""The OpenAI server at parity with vLLM's (issue 28, items 1 and 4-7) through the official
`openai` SDK (sync and async) and plain HTTP, over the session's runtime served by uvicorn on
a socket: the lenient schema (nulls, ignored fields, the SDK's `model_dump()` fed back, custom
roles, negative seeds, no model), log-probs and offsets across stream / echo / logprobs 0..N /
token-id prompts with special tokens / multi-byte characters, continuous usage,
`/v1/models/{id}`, `/tokenize` and `/detokenize` as vLLM shapes them, `/v1/responses`, the
Prometheus metrics a vLLM dashboard reads, and tool calling (the tools in the prompt, the
model's calls parsed, streamed and not, through a client whose replies are canned calls)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading

import httpx
import openai
import pytest

from taipan.client import AsyncClient, Completion, Delta
from taipan.messages.requests import FinishReason
from taipan.server import serve
from tests.ports import free_port

MODEL = "M"
ONE = [{"role": "user", "content": "Name a colour."}]


@contextlib.contextmanager
def _served(runtime, wrap=None, **options):
    """The app over a client of the session's runtime (`wrap`ped, to fake replies), served
    by uvicorn on a free port in a thread of its own (`serve`'s `options`); yields the base
    URL."""
    port, started, held = free_port(), threading.Event(), {}

    def run() -> None:
        async def main() -> None:
            async with AsyncClient(runtime.address) as client:
                up = asyncio.Event()
                app_client = wrap(client) if wrap else client
                held["task"] = asyncio.ensure_future(
                    serve(
                        app_client,
                        "127.0.0.1",
                        port,
                        served_model_name=MODEL,
                        started=up,
                        **options,
                    )  # fmt: skip
                )
                held["loop"] = asyncio.get_running_loop()
                await up.wait()
                started.set()
                with contextlib.suppress(asyncio.CancelledError):
                    await held["task"]

        asyncio.run(main())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(120), "the HTTP server did not come up"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        held["loop"].call_soon_threadsafe(held["task"].cancel)
        thread.join(30)


@contextlib.contextmanager
def served_wrapped(runtime, wrapper):
    """`_served` over a client wrapped in `wrapper` (a WrappedClient class); yields (base URL,
    the wrapped client the server uses)."""
    made = []

    def wrap(client):
        made.append(wrapper(client))
        return made[0]

    with _served(runtime, wrap) as url:
        yield url, made[0]


class WrappedClient:
    """A connected AsyncClient that records each prompt it is given (`prompts`); a subclass
    fakes replies or passes them through."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client
        self.prompts: list[list[int]] = []

    def __getattr__(self, name):
        return getattr(self._client, name)


@pytest.fixture(scope="module")
def base(runtime):
    with _served(runtime) as url:
        yield url


@pytest.fixture(scope="module")
def oai(base):
    return openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tok(client):
    return client.tokenizer


def _post(base, path, body):
    return httpx.post(f"{base}{path}", json=body, timeout=120)


# --- item 4: the lenient schema --------------------------------------------------------------


def test_a_lenient_body_gives_what_the_plain_one_gives(base, oai):
    plain = oai.chat.completions.create(
        model=MODEL, messages=ONE, max_tokens=3, temperature=0, seed=-5
    )
    reply = plain.choices[0].message
    lenient = {
        "messages": [*ONE, reply.model_dump(), {"role": "user", "content": "Another."}],
        "max_tokens": 3, "temperature": 0, "n": None, "stream": None, "logprobs": None,
        "top_logprobs": None, "frequency_penalty": None, "presence_penalty": 0,
        "logit_bias": {}, "stop": None, "store": True, "metadata": {"a": "b"},
        "service_tier": "auto", "user": "u1", "parallel_tool_calls": False,
        "prediction": {"type": "content", "content": "x"}, "response_format": {"type": "text"},
        "seed": 2**63 - 5, "tools": None, "tool_choice": "none",
    }  # fmt: skip
    r = _post(base, "/v1/chat/completions", lenient)  # no model: the served one
    assert r.status_code == 200, r.text
    assert r.json()["model"] == MODEL
    # Custom roles reach the template; an extra field in a message is tolerated.
    odd = {"model": "", "max_tokens": 1, "messages": [
        {"role": "critic", "content": "Terse.", "weight": 2}, *ONE]}  # fmt: skip
    assert _post(base, "/v1/chat/completions", odd).status_code == 200
    bad = _post(base, "/v1/chat/completions", {**lenient, "presence_penalty": 3.0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "presence_penalty"


# --- item 5: log-probs and offsets -----------------------------------------------------------


def _check_offsets(text: str, lp: dict) -> None:
    """Each whole token's text sits at its offset in the text; offsets never go back."""
    assert lp["text_offset"] == sorted(lp["text_offset"])
    for s, o in zip(lp["tokens"], lp["text_offset"], strict=True):
        if not s.startswith("bytes:"):
            assert text[o : o + len(s)] == s, (text, s, o)


def _streamed(base, body) -> tuple[str, dict, list[dict]]:
    """(text, logprobs joined, chunks) of a streamed completion's choice 0."""
    chunks, text = [], ""
    lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    with httpx.stream("POST", f"{base}/v1/completions", json={**body, "stream": True},
                      timeout=120) as r:  # fmt: skip
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            chunks.append(chunk)
            for c in chunk["choices"]:
                text += c["text"]
                for key in lp:
                    lp[key] += (c["logprobs"] or {}).get(key) or []
    return text, lp, chunks


@pytest.mark.parametrize("top", [0, 2])
def test_echo_of_a_token_id_prompt_streamed_or_not(base, tok, top):
    """A token-id prompt with special tokens: text, tokens and offsets agree; logprobs 0 gives
    each token's own log-prob; streamed equals whole, prompt log-probs included."""
    ids = tok.apply_chat_template(ONE) + tok.encode("Blue", add_special_tokens=False)
    body = {"prompt": ids, "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": top}
    whole = _post(base, "/v1/completions", body).json()["choices"][0]
    lp = whole["logprobs"]
    assert whole["text"].startswith("<|im_start|>system")  # special tokens kept
    assert len(lp["tokens"]) == len(ids) + 2
    assert "".join(lp["tokens"]) == whole["text"]
    _check_offsets(whole["text"], lp)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    rows = zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True)
    for s, v, t in list(rows)[1:]:
        assert t[s] == v and 1 <= len(t) <= top + 1
    text, slp, _ = _streamed(base, body)
    assert text == whole["text"]
    assert slp["tokens"] == lp["tokens"] and slp["text_offset"] == lp["text_offset"]
    assert slp["token_logprobs"] == pytest.approx(lp["token_logprobs"], abs=1e-5)


def test_vllms_prompt_logprobs(base, oai, tok):
    """vLLM's extension: per prompt token {id: {logprob, rank, decoded_token}}, None first."""
    ids = tok.encode("The sky is", add_special_tokens=False)
    body = {"prompt": ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2,
            "logprobs": 0}  # fmt: skip
    choice = _post(base, "/v1/completions", body).json()["choices"][0]
    got = choice["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids)
    for t, entry in zip(ids[1:], got[1:], strict=True):
        assert str(t) in entry and 2 <= len(entry) <= 3
        assert {1, 2} <= {e["rank"] for e in entry.values()}
        assert entry[str(t)]["decoded_token"] == tok.decode([t])
    assert len(choice["logprobs"]["top_logprobs"][0]) == 1  # logprobs 0: cut from the 2
    chat = oai.chat.completions.create(
        model=MODEL, messages=ONE, max_tokens=1, extra_body={"prompt_logprobs": 0}
    )
    assert chat.prompt_logprobs[0] is None and len(chat.prompt_logprobs) == chat.usage.prompt_tokens
    # (streamed: tests/test_http_vllm_extensions.py)


def test_multi_byte_characters_as_byte_strings_with_offsets(base, tok):
    prompt = "日本語 😀 is"
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "logprobs": 1}
    whole = _post(base, "/v1/completions", {**body, "echo": True}).json()["choices"][0]
    lp = whole["logprobs"]
    assert any(s.startswith("bytes:\\x") for s in lp["tokens"]) and "\ufffd" not in lp["tokens"]
    _check_offsets(whole["text"], lp)
    text, slp, _ = _streamed(base, body)  # streamed, no echo: offsets from 0, filled
    assert slp["text_offset"] and slp["text_offset"][0] == 0
    _check_offsets(text, slp)


def test_chat_logprobs_carry_exact_bytes(oai):
    got = oai.chat.completions.create(
        model=MODEL, messages=ONE, max_tokens=3, temperature=0, logprobs=True, top_logprobs=0
    ).choices[0]
    content = got.logprobs.content
    assert (
        bytes(b for e in content for b in e.bytes)
        .decode(errors="replace")
        .startswith(got.message.content)
    )
    assert all(e.top_logprobs == [] for e in content)


# --- item 6: usage and endpoints -------------------------------------------------------------


def test_continuous_usage_stats_on_every_chunk(base):
    body = {"prompt": "One, two,", "max_tokens": 3, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    _, _, chunks = _streamed(base, body)
    assert all(c.get("usage") for c in chunks)
    done = [c["usage"]["completion_tokens"] for c in chunks]
    assert done == sorted(done) and done[-1] == 3
    plain = {**body, "stream_options": {"include_usage": False, "continuous_usage_stats": True}}
    assert not any(c.get("usage") for c in _streamed(base, plain)[2])


def test_invocations_answers_as_chat_or_completions(base, oai):
    chat = {"messages": ONE, "max_tokens": 2, "temperature": 0}
    want = oai.chat.completions.create(model=MODEL, **chat).model_dump()
    got = _post(base, "/invocations", chat).json()
    assert got["object"] == "chat.completion"
    assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
    r = _post(base, "/invocations", {"prompt": "Hi", "max_tokens": 1})
    assert r.json()["object"] == "text_completion"
    assert _post(base, "/invocations", {"input": "x"}).status_code == 400
    assert _post(base, "/invocations", {"prompt": "x", "n": 0}).json()["error"]["param"] == "n"


def test_models_by_id(base, oai):
    assert oai.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("nope")
    err = httpx.get(f"{base}/v1/models/org/nope").json()["error"]
    assert err["code"] == "model_not_found" and err["message"]


def test_tokenize_and_detokenize_as_vllm_shapes_them(base, tok):
    r = _post(base, "/tokenize", {"prompt": "Hello", "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode("Hello") and r["count"] == len(r["tokens"])
    assert r["token_strs"] == [tok.id_to_token(t) for t in r["tokens"]] and r["max_model_len"]
    chat = _post(base, "/tokenize", {"messages": ONE}).json()
    assert chat["tokens"] == tok.apply_chat_template(ONE) and chat["token_strs"] is None
    cont = {"messages": [*ONE, {"role": "assistant", "content": "Blue and"}],
            "add_generation_prompt": False, "continue_final_message": True}  # fmt: skip
    ids = _post(base, "/tokenize", cont).json()["tokens"]
    assert tok.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\nBlue and")
    both = _post(base, "/tokenize", {**cont, "add_generation_prompt": True})
    assert both.status_code == 400
    del cont["add_generation_prompt"]  # continue_final_message alone: no generation prompt
    assert _post(base, "/tokenize", cont).json()["tokens"] == ids
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    with_tools = _post(base, "/tokenize", {"messages": ONE, "tools": tools}).json()["tokens"]
    assert '"get_weather"' in tok.decode(with_tools)  # SmolLM2's template: our Hermes prompt
    assert _post(base, "/detokenize", {"tokens": ids}).json()["prompt"] == tok.decode(
        ids, skip_special_tokens=False
    )


def test_responses_create_plain_and_streamed(oai):
    want = oai.chat.completions.create(
        model=MODEL, max_tokens=4, temperature=0,
        messages=[{"role": "system", "content": "Be brief."}, *ONE],
    ).choices[0].message.content  # fmt: skip
    r = oai.responses.create(
        model=MODEL, input="Name a colour.", instructions="Be brief.", max_output_tokens=4,
        temperature=0, store=False,
    )  # fmt: skip
    assert r.output_text == want and r.status == "incomplete"  # 4 tokens: cut
    assert r.usage.output_tokens == 4 and r.incomplete_details.reason == "max_output_tokens"
    events = list(
        oai.responses.create(
            model=MODEL, instructions="Be brief.", max_output_tokens=4, temperature=0,
            input=[{"role": "user", "content": [{"type": "input_text", "text": "Name a colour."}]}],
            stream=True,
        )
    )  # fmt: skip
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]  # fmt: skip
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == want == events[-1].response.output_text
    assert r.store is False and events[-1].response.store is True
    with pytest.raises(openai.NotFoundError):  # (stored responses: test_http_responses_store)
        oai.responses.create(model=MODEL, input="x", previous_response_id="resp_1")


# --- item 7: metrics -------------------------------------------------------------------------


def _metrics(base) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_metrics_a_vllm_dashboard_reads(base):
    before = _metrics(base)
    body = {"prompt": [1, 2, 3, 4], "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    _post(base, "/v1/completions", body)
    _streamed(base, body)
    after = _metrics(base)

    def grew(name):
        return after.get(name, 0) - before.get(name, 0)

    assert grew("taipan_prompt_tokens_total") == 8
    assert grew("taipan_generation_tokens_total") == 6
    assert grew('taipan_request_success_total{finished_reason="length"}') == 2
    assert grew("taipan_time_per_output_token_seconds_count") == 4  # per token after the first
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds"):  # fmt: skip
        assert grew(f"taipan_{name}_count") == 2, name
    for name in ("taipan_requests_running", "taipan_requests_waiting",
                 "taipan_kv_cache_usage_perc", "taipan_prefix_cache_queries_total",
                 "taipan_prefix_cache_hits_total", "taipan_prefix_cache_hit_rate",
                 "taipan_spec_decode_num_draft_tokens_total"):  # fmt: skip
        assert name in after, name


def test_speculative_counters_render_per_position():
    """The runtime's speculative-decoding counters as vLLM's (per position by a label)."""
    import types

    import prometheus_client as prom

    from taipan.server.metrics import _RuntimeCounters

    counters = _RuntimeCounters()
    counters.update(types.SimpleNamespace(
        prefix_prompt_tokens=10, prefix_cached_tokens=4, spec_verify_rows=5,
        spec_draft_tokens=20, spec_accepted_tokens=7, spec_accepted_per_position=(4, 2, 1),
        spec_backoffs=3, spec_draft_disabled=1, evicted_total=2, paused_total=6,
        spec_chains=9, spec_batch_off_steps=11, grammar_void_rows=12,
    ))  # fmt: skip
    registry = prom.CollectorRegistry()
    registry.register(counters)
    text = prom.generate_latest(registry).decode()
    for line in ("taipan_spec_decode_num_drafts_total 5.0",
                 "taipan_spec_decode_num_draft_tokens_total 20.0",
                 "taipan_spec_decode_num_accepted_tokens_total 7.0",
                 'taipan_spec_decode_num_accepted_tokens_per_pos_total{position="1"} 2.0',
                 "taipan_spec_decode_backoffs_total 3.0",
                 "taipan_spec_decode_draft_disabled_total 1.0",
                 "taipan_spec_decode_chains_total 9.0",
                 "taipan_spec_decode_batch_off_steps_total 11.0",
                 "taipan_structured_void_rows_total 12.0",
                 "taipan_prefix_cache_hits_total 4.0",
                 "taipan_num_preemptions_total 2.0", "taipan_pauses_total 6.0"):  # fmt: skip
        assert line in text, line


# --- item 1: tool calling --------------------------------------------------------------------

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip
CALLS = ('I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
         '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n'
         "</tool_call>")  # fmt: skip


class _CannedCalls(WrappedClient):
    """A connected AsyncClient whose replies are CALLS (streamed a few characters a delta)."""

    async def generate(self, ids, params, raise_on_error=True):
        self.prompts.append(list(ids))
        c = Completion(prompt=None, prompt_token_ids=list(ids), text=CALLS,
                       token_ids=[1] * 9, finish_reason=FinishReason.STOP)  # fmt: skip
        return [c]

    async def stream(self, ids, params):
        self.prompts.append(list(ids))
        pieces = [CALLS[i : i + 9] for i in range(0, len(CALLS), 9)]
        for k, piece in enumerate(pieces):
            last = k == len(pieces) - 1
            yield Delta(piece, [1], last, FinishReason.STOP if last else None)


@pytest.fixture(scope="module")
def canned(runtime):
    with _served(runtime, _CannedCalls) as url:
        yield openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)


def test_tool_calls_parsed_plain_and_streamed(canned):
    async def main():
        history = [{"role": "user", "content": "Weather in Paris and Rome?"}]
        r = await canned.chat.completions.create(model=MODEL, messages=history, tools=TOOLS)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "I will check."
        calls = choice.message.tool_calls
        assert [json.loads(c.function.arguments) for c in calls] == [
            {"city": "Paris"}, {"city": "Rome"}]  # fmt: skip
        assert len({c.id for c in calls}) == 2
        one = await canned.chat.completions.create(
            model=MODEL, messages=history, tools=TOOLS, parallel_tool_calls=False
        )
        assert len(one.choices[0].message.tool_calls) == 1
        none = await canned.chat.completions.create(
            model=MODEL, messages=history, tools=TOOLS, tool_choice="none"
        )
        assert none.choices[0].message.content == CALLS and not none.choices[0].message.tool_calls
        # The SDK's stream accumulator joins the streamed calls into the same message.
        async with canned.chat.completions.stream(
            model=MODEL, messages=history, tools=TOOLS, tool_choice="auto"
        ) as stream:
            async for _ in stream:
                pass
            final = await stream.get_final_completion()
        streamed = final.choices[0]
        assert streamed.finish_reason == "tool_calls"
        assert [c.function.name for c in streamed.message.tool_calls] == ["get_weather"] * 2
        assert streamed.message.content.strip() == "I will check."
        # The reply fed back, with the tool's result: the conversation renders.
        back = [*history, choice.message.model_dump(),
                {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny"}]  # fmt: skip
        again = await canned.chat.completions.create(model=MODEL, messages=back, tools=TOOLS)
        assert again.choices[0].finish_reason == "tool_calls"
        with pytest.raises(openai.BadRequestError, match="tool_choice"):
            named = {"type": "function", "function": {"name": "not_a_tool"}}
            await canned.chat.completions.create(
                model=MODEL, messages=history, tools=TOOLS, tool_choice=named
            )

    asyncio.run(main())


def test_tools_with_the_real_model(oai, tok):
    """The tools reach SmolLM2's prompt (its template has none: our Hermes instructions) and a
    reply that calls nothing is plain content."""
    r = oai.chat.completions.create(model=MODEL, messages=ONE, tools=TOOLS, max_tokens=2,
                                    temperature=0)  # fmt: skip
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")
    assert r.usage.prompt_tokens > len(tok.apply_chat_template(ONE)) + 20
