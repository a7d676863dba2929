"""The OpenAI-compatible HTTP server (issue 11) through a real `taipan serve --http-port` process
and the official `openai` package (and lm-eval's local-completions model on tasks from local JSONL
files): completions and chat, streaming and not, n=2, log-probs
(generated and, with echo and max_tokens 0, the prompt's), stop strings, usage; greedy text
equal to `Client.generate` on the same runtime; /v1/models, /health, /metrics; errors in
OpenAI's shape with 4xx for bad input (unknown model and field, bad values, a prompt too long,
malformed JSON, a missing API key); a client that disconnects mid-stream gets its request
aborted and every KV block back. The http process never imports torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import httpx
import openai
import pytest

from taipan.client import Client
from taipan.messages.requests import SamplingParams
from taipan.ops.tokenizer import Tokenizer
from tests.ports import free_port

PROMPTS = ["The capital of France is", "Water boils at a temperature of"]
TEMPLATE_MARK = "{# taipan serve --chat-template #}"
KEY = "sk-test-key"
MODEL = "smol"  # --served-model-name


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    """`taipan serve --http-port P --api-key KEY ...` with a known frontend address; yields
    (base_url, frontend address, process)."""
    port = free_port()
    where = tmp_path_factory.mktemp("http")
    address = f"ipc://{where}/frontend.sock"
    # --chat-template: the model's own template (so chat answers stay the model's), marked by
    # a Jinja comment that renders nothing but shows in /tokenizer_info
    template = where / "chat.jinja"
    template.write_text(Tokenizer.from_gguf(model_path).chat_template + TEMPLATE_MARK)
    cmd = [
        sys.executable, "-m", "taipan.cli", "serve", "--model", model_path,
        "--address", address, "--http-port", str(port), "--api-key", KEY,
        "--served-model-name", MODEL, "--max-queued", "64", "--queue-timeout", "5",
        "--enable-prompt-tokens-details", "--chat-template", str(template),
        "--trust-request-chat-template", "--set", "max_requests=8",
        "--set", "max_sequence_length=256",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        assert proc.poll() is None, "taipan serve exited during start-up"
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                if r.status == 200:
                    break
        except (urllib.error.URLError, OSError):
            pass
        assert time.monotonic() < deadline, "the HTTP server did not come up"
        time.sleep(0.2)
    yield base, address, proc
    proc.terminate()
    assert proc.wait(60) == 0


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def direct(server):
    with Client(server[1]) as c:
        yield c


def _post(server, path, body, key=KEY, raw=None):
    headers = {"content-type": "application/json"}
    if key:
        headers["authorization"] = f"Bearer {key}"
    content = raw if raw is not None else json.dumps(body)
    return httpx.post(f"{server[0]}{path}", content=content, headers=headers, timeout=120)


def test_models_health_and_metrics(server, oai):
    assert [m.id for m in oai.models.list().data] == [MODEL]
    assert httpx.get(f"{server[0]}/health").json() == {"status": "ok"}
    text = httpx.get(f"{server[0]}/metrics").text
    for name in (
        "taipan_request_success_total",
        "taipan_time_to_first_token_seconds_bucket",
        "taipan_requests_running",
        "taipan_kv_blocks_used",
        "taipan_local_kv_blocks_total 0.0",  # (SmolLM2 has no windowed layers)
        "taipan_prefix_cache_hit_rate",
        "taipan_engine_ranks_alive 1.0",
        "taipan_http_in_flight",
        "taipan_http_refused_total",
    ):
        assert name in text, name
    assert "taipan_http_max_queued 64.0" in text  # --max-queued reached the http process


def test_chat_template_flags_reach_the_http_process(server, direct):
    """--chat-template: the server renders with the file's template (the model's plus a
    comment here); --trust-request-chat-template: a request may bring its own."""
    auth = {"authorization": f"Bearer {KEY}"}
    info = httpx.get(f"{server[0]}/tokenizer_info", headers=auth).json()
    assert info["chat_template"] == direct.tokenizer.chat_template + TEMPLATE_MARK
    messages = [{"role": "user", "content": "Hi"}]
    ids = _post(server, "/tokenize", {"messages": messages}).json()["tokens"]
    assert ids == direct.tokenizer.apply_chat_template(messages)
    own = "{% for m in messages %}{{ m['content'] }}!{% endfor %}"
    r = _post(server, "/tokenize", {"messages": messages, "chat_template": own})
    assert r.json()["tokens"] == direct.tokenizer.encode("Hi!", add_special_tokens=False)


def test_completions_greedy_equal_the_client(oai, direct):
    want = direct.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0))
    got = oai.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.index for c in got.choices] == [0, 1]
    assert [c.text for c in got.choices] == [w.text for w in want]
    assert [c.finish_reason for c in got.choices] == ["length", "length"]
    prompt_tokens = sum(len(w.prompt_token_ids) for w in want)
    assert got.usage.prompt_tokens == prompt_tokens and got.usage.completion_tokens == 24
    # Token ids as the prompt give the same text.
    ids = want[0].prompt_token_ids
    again = oai.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)
    assert again.choices[0].text == want[0].text


def test_completions_stream_n2_and_usage(oai):
    whole = oai.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=10, temperature=0, n=2
    )
    assert [c.text for c in whole.choices] == [whole.choices[0].text] * 2  # greedy: equal
    assert whole.usage.completion_tokens == 20
    stream = oai.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=10, temperature=0, n=2, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    texts, reasons, usage = {0: "", 1: ""}, {}, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
            assert not chunk.choices
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert texts == {0: whole.choices[0].text, 1: whole.choices[0].text}
    assert reasons == {0: "length", 1: "length"}
    assert usage.completion_tokens == 20 and usage.prompt_tokens == whole.usage.prompt_tokens
    # (--enable-prompt-tokens-details; no prefix caching here)
    assert whole.usage.prompt_tokens_details.cached_tokens == 0
    assert usage.prompt_tokens_details.cached_tokens == 0


def test_sampled_choices_are_seeded(oai):
    kw = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=6, temperature=1.0, seed=7, n=2)
    a = oai.completions.create(**kw)
    b = oai.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.choices[0].text != a.choices[1].text  # choice j draws with seed + j


def test_completion_logprobs_and_prompt_logprobs(oai, direct):
    want = direct.generate(
        PROMPTS[0],
        SamplingParams(max_tokens=6, temperature=0.0, return_log_probs=True, top_n_logprobs=2),
    )[0]
    got = oai.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=2
    ).choices[0]
    assert got.logprobs.token_logprobs == pytest.approx(want.log_probs, abs=1e-5)
    assert all(len(t) == 2 for t in got.logprobs.top_logprobs)
    assert "".join(got.logprobs.tokens) == got.text
    # lm-eval's log-likelihood request: echo, max_tokens 0, logprobs: the prompt's log-probs.
    prompt = direct.generate(
        PROMPTS[0], SamplingParams(max_tokens=1, temperature=0.0, return_log_probs=True)
    )[0]
    echo = oai.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=0, echo=True, logprobs=0, temperature=0
    ).choices[0]
    assert echo.text == PROMPTS[0]
    assert echo.logprobs.token_logprobs[0] is None
    assert echo.logprobs.token_logprobs[1:] == pytest.approx(prompt.prompt_log_probs, abs=1e-5)
    assert len(echo.logprobs.tokens) == len(prompt.prompt_token_ids)


def test_stop_strings_cut_the_text(oai):
    full = oai.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0)
    text = full.choices[0].text
    stop = text[3:6]  # inside the text, not at a token boundary in general
    got = oai.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0, stop=[stop]
    ).choices[0]
    assert got.text == text[: text.index(stop)]
    assert got.finish_reason == "stop"


def test_chat_equals_the_client_streamed_or_not(oai, direct):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    want = direct.generate(messages, SamplingParams(max_tokens=12, temperature=0.0), chat=True)[0]
    got = oai.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=12, temperature=0,
        logprobs=True, top_logprobs=3,
    )  # fmt: skip
    choice = got.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == want.text
    assert len(choice.logprobs.content) == len(want.token_ids)
    assert all(len(e.top_logprobs) == 3 for e in choice.logprobs.content)
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    stream = oai.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True, n=2
    )
    texts = {0: "", 1: ""}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == {0: want.text, 1: want.text}


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"model": "nope", "prompt": "x"}, 404, "model"),
        ({"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"model": MODEL, "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "x", "bogus": 1}, 400, "bogus"),
        ({"model": MODEL, "prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, None),
        ({"model": MODEL, "prompt": "x " * 300}, 400, "prompt"),
        ({"model": MODEL, "prompt": [10**9]}, 400, "prompt"),
        ({"model": MODEL, "prompt": "x", "stop": [""]}, 400, "stop"),
        ({"model": MODEL, "prompt": []}, 400, "prompt"),
        ({"model": MODEL, "prompt": "x", "logit_bias": {"1": 500}}, 400, "logit_bias"),
        ({"model": MODEL, "prompt": "x", "bad_words": [""]}, 400, "bad_words"),
    ],
)
def test_bad_completion_requests_are_4xx_in_openai_shape(server, body, status, param):
    r = _post(server, "/v1/completions", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if param is not None:
        assert err["param"] == param, err


@pytest.mark.parametrize(
    "extra, param, named",
    [
        ({"logit_bias": {"49153": 1.0}}, "logit_bias", ["49153", "49152"]),
        ({"stop_token_ids": [49153]}, "stop_token_ids", ["49153", "49152"]),
        ({"logit_bias": {"bad1": 50.0, "bad2": 20.0}}, "logit_bias", ["bad1", "bad2"]),
    ],
)
def test_token_ids_outside_the_vocabulary_are_the_clients_400(server, extra, param, named):
    """As vLLM's own tests ask: a logit_bias or stop_token_ids id past the vocabulary (SmolLM2:
    49,152) is a 400 naming the id and the size (it was the engine's refusal, a 500), and every
    bad logit_bias key is named at once."""
    for path, body in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
        ("/v1/completions", {"prompt": "Hi"}),
    ):
        r = _post(server, path, {"model": MODEL, "max_tokens": 2, **body, **extra})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and all(n in err["message"] for n in named), err


def test_stop_and_special_tokens_text_as_vllm(server):
    """vLLM's rules for the text: the stop token that ended a request (a stop_token_id, EOS)
    stays in the token count but not in the text unless include_stop_str_in_output; special
    tokens' text shows with skip_special_tokens=false (SmolLM2's EOS is <|im_end|>)."""
    [comma] = _post(server, "/tokenize", {"prompt": ",", "add_special_tokens": False}).json()[
        "tokens"
    ]
    body = {"model": MODEL, "prompt": "1, 2, 3,", "max_tokens": 10, "temperature": 0}
    texts = {}
    for include in (False, True):
        extra = {"stop_token_ids": [comma], "include_stop_str_in_output": include}
        r = _post(server, "/v1/completions", {**body, **extra}).json()
        c = r["choices"][0]
        assert (c["finish_reason"], c["stop_reason"]) == ("stop", comma), c
        texts[include] = (c["text"], r["usage"]["completion_tokens"])
    assert texts[True] == (texts[False][0] + ",", texts[False][1]), texts
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 64}
    for skip, include in ((True, True), (False, False), (False, True)):
        extra = {"temperature": 0, "skip_special_tokens": skip}
        extra["include_stop_str_in_output"] = include
        c = _post(server, "/v1/chat/completions", {**chat, **extra}).json()["choices"][0]
        assert c["finish_reason"] == "stop", c
        shown = c["message"]["content"].endswith("<|im_end|>")
        assert shown == (not skip and include), (skip, include, c)


def test_bad_chat_requests_malformed_json_and_auth(server, oai):
    r = _post(server, "/v1/chat/completions", {"model": MODEL, "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = _post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": 5}]})
    assert r.status_code == 400
    r = _post(server, "/v1/completions", None, raw="{not json")
    assert r.status_code == 400 and "error" in r.json()
    r = _post(server, "/v1/completions", {"model": MODEL, "prompt": "x"}, key="wrong")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = _post(server, "/v1/completions", {"model": MODEL, "prompt": "x"}, key=None)
    assert r.status_code == 401
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="other", prompt="x", max_tokens=1)
    assert httpx.get(f"{server[0]}/health").status_code == 200  # still serving


def test_tokenizer_endpoints(server, direct):
    tok = direct.tokenizer
    r = _post(server, "/tokenize", {"prompt": PROMPTS[0], "add_special_tokens": False})
    assert r.json()["tokens"] == tok.encode(PROMPTS[0], add_special_tokens=False)
    ids = r.json()["tokens"]
    assert _post(server, "/detokenize", {"tokens": ids}).json() == {"prompt": PROMPTS[0]}
    messages = [{"role": "user", "content": "Hi"}]
    r = _post(server, "/tokenize", {"messages": messages})
    assert r.json()["tokens"] == tok.apply_chat_template(messages)
    info = httpx.get(f"{server[0]}/tokenizer_info", headers={"authorization": f"Bearer {KEY}"})
    assert info.json()["eos_token"]
    assert info.json()["chat_template"] == tok.chat_template + TEMPLATE_MARK  # (--chat-template)
    assert _post(server, "/tokenize", {"prompt": "x"}, key=None).status_code == 401
    assert _post(server, "/tokenize", {}).status_code == 400
    assert _post(server, "/detokenize", {"tokens": [-1]}).status_code == 400


def test_a_client_that_disconnects_mid_stream_gives_its_blocks_back(server, direct):
    before = direct.stats().ranks[0]
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 200, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    headers = {"authorization": f"Bearer {KEY}"}
    with httpx.stream(
        "POST", f"{server[0]}/v1/completions", json=body, headers=headers, timeout=60
    ) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
        assert direct.stats().ranks[0].running == 1
    deadline = time.monotonic() + 10
    while (now := direct.stats().ranks[0]).running or now.blocks_free != before.blocks_free:
        assert time.monotonic() < deadline, now
        time.sleep(0.05)


def test_a_client_that_disconnects_before_a_plain_answer_gives_its_blocks_back(server, direct):
    before = direct.stats().ranks[0]
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 200, "temperature": 0,
            "ignore_eos": True, "n": 2}  # fmt: skip
    with pytest.raises(httpx.ReadTimeout):  # the client gives up after 1 s and hangs up
        _post_timeout = httpx.Timeout(60, read=1.0)
        httpx.post(
            f"{server[0]}/v1/completions", json=body, timeout=_post_timeout,
            headers={"authorization": f"Bearer {KEY}"},
        )  # fmt: skip
    deadline = time.monotonic() + 10
    while (now := direct.stats().ranks[0]).running or now.blocks_free != before.blocks_free:
        assert time.monotonic() < deadline, now  # both choices aborted within seconds
        time.sleep(0.05)


def test_the_http_process_never_imports_torch():
    code = (
        "import sys, taipan.server, taipan.procs, taipan.launcher; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --- lm-eval's local-completions model, unmodified, on tasks from local JSONL files ----------

LM_EVAL_DATA = os.path.join(os.path.dirname(__file__), "data", "lm_eval")
GEN_TASK = """task: taipan_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: @DATA@/gen.jsonl
output_type: generate_until
test_split: test
doc_to_text: "{{question}}"
doc_to_target: "{{answer}}"
target_delimiter: ""
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
"""
MC_TASK = """task: taipan_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: @DATA@/mc.jsonl
output_type: multiple_choice
test_split: test
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: label
target_delimiter: ""
metric_list:
  - metric: acc
"""


def _encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of a (context, continuation) request into tokens (its _encode_pair)."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole = tok.encode(context + continuation, add_special_tokens=False)
    ctx = tok.encode(context, add_special_tokens=False)
    return ctx, whole[len(ctx) :]


@pytest.mark.slow  # (the default run stays under ~15 min on the 2-core CI box)
def test_lm_eval_generate_until_and_loglikelihood(server, direct, tmp_path, monkeypatch):
    """A generate-until task and a log-likelihood (multiple-choice) task: the generations equal
    greedy Client outputs with the same stops, and every log-likelihood equals the sum of our
    own prompt log-probs over the continuation's tokens."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    for name, text in (("taipan_gen.yaml", GEN_TASK), ("taipan_mc.yaml", MC_TASK)):
        (tmp_path / name).write_text(text.replace("@DATA@", LM_EVAL_DATA))
    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={
            "base_url": f"{server[0]}/v1/completions",
            "model": MODEL,
            "tokenizer_backend": "remote",
            "auth_token": KEY,
            "num_concurrent": 2,
            "max_retries": 1,
        },
        tasks=["taipan_gen", "taipan_mc"],
        task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True,
    )
    assert "exact_match,none" in out["results"]["taipan_gen"]
    assert "acc,none" in out["results"]["taipan_mc"]
    gen = out["samples"]["taipan_gen"]
    assert len(gen) == 4
    for s in gen:
        want = direct.generate(
            s["doc"]["question"], SamplingParams(max_tokens=12, temperature=0.0, stop=("\n", "."))
        )[0]
        assert s["resps"][0][0] == want.text, s["doc"]
    tok = direct.tokenizer
    mc = out["samples"]["taipan_mc"]
    assert sum(len(s["arguments"]) for s in mc) == 10  # one request per choice
    for s in mc:
        for (context, continuation), [(ll, _greedy)] in zip(
            s["arguments"], s["resps"], strict=True
        ):
            ctx, cont = _encode_pair(tok, context, continuation)
            [c] = direct.generate(
                ctx + cont,
                SamplingParams(max_tokens=1, temperature=0.0, return_log_probs=True),
            )
            assert ll == pytest.approx(sum(c.prompt_log_probs[len(ctx) - 1 :]), abs=1e-4)


def test_lifecycle_controls_over_http_behind_the_api_key(server, direct):
    """An HTTP-driven trainer's controls: refused without the key, the runtime's refusals as
    400/409 with its code, and a pause / unpause round that serving survives."""
    assert _post(server, "/pause", {}, key=None).status_code == 401
    r = _post(server, "/pause", {"mode": "wait", "timeout": 0})
    assert r.status_code == 400 and "positive" in r.json()["error"]["message"]
    assert _post(server, "/pause", {"mode": "bogus"}).status_code == 400
    r = _post(server, "/resume", {})
    assert r.status_code == 409 and r.json()["error"]["code"] == "illegal_transition"
    assert _post(server, "/pause", {}).json()["state"] == "PAUSED"
    r = _post(server, "/update_weights", {"weight_version": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "path"
    r = _post(server, "/update_weights", {"path": "/nowhere", "draft": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "draft"
    # (a runtime without a draft model of its own: the engine names why)
    r = _post(server, "/update_weights", {"path": "/nowhere", "draft": True})
    assert r.status_code == 400 and "weights of its own" in r.json()["error"]["message"], r.text
    bad = {"master_address": "127.0.0.1", "master_port": 0, "world_size": 2}
    r = _post(server, "/init_weight_transfer", bad)
    assert r.status_code == 400 and "is not a port" in r.json()["error"]["message"]
    r = _post(server, "/update_weights_from_distributed", {"buckets": [["x"]]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "buckets"
    one = {"buckets": [[{"name": "lm_head.weight", "dtype": "float32", "shape": [2, 2]}]]}
    for path in ("/update_weights_from_distributed", "/update_weights_from_ipc"):
        r = _post(server, path, {"draft": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "draft", path
    r = _post(server, "/update_weights_from_distributed", one | {"draft": True})
    assert r.status_code == 400 and "weights of its own" in r.json()["error"]["message"], r.text
    r = _post(server, "/suspend", {"mode": "persist", "extra": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "extra"
    assert _post(server, "/unpause", {}).json() == {
        "state": "RUNNING", "weight_version": direct.stats().merged().weight_version
    }  # fmt: skip
    assert httpx.get(f"{server[0]}/health").status_code == 200


@pytest.mark.asyncio
async def test_lifecycle_controls_need_an_api_key(server):
    """A server started without --api-key refuses every control (403) and changes nothing."""
    from taipan.client import AsyncClient
    from taipan.server.app import build_app

    async with AsyncClient(server[1]) as client:
        app = build_app(client)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as h:
            for path in ("/pause", "/close_weight_transfer"):
                r = await h.post(path, json={})
                assert r.status_code == 403 and "--api-key" in r.json()["error"]["message"]
        assert str((await client.stats()).state) == "RUNNING"
