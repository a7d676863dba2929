"""vLLM's request extensions the issue 28 server had left out, over uvicorn on a socket with the
real default model: `prompt_logprobs` with `stream=true` (vLLM refuses it; taipan sends the
unstreamed value, in vLLM's shape, on the choice's last chunk: beside `choices` in chat) and
`bad_words` as strings (tokenized as vLLM does, onto SamplingParams.bad_words_ids), each bad
value a 400 naming its key; `return_token_ids`, chat's `echo` and `truncate_prompt_tokens` in
the shapes vLLM's own tests ask for."""

from __future__ import annotations

import functools
import json

import httpx
import openai
import pytest

from taipan.actors.config import InferenceConfig
from taipan.launcher import Runtime
from taipan.server import ServerOptions
from taipan.server.params import bad_words_ids
from tests.conftest import TEST_CONFIG
from tests.test_http_openai_parity import MODEL, _post, _served

ONE = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def base(runtime):
    with _served(runtime) as url:
        yield url


def _chunks(base: str, path: str, body: dict) -> list[dict]:
    out = []
    with httpx.stream("POST", f"{base}{path}", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
    return out


def _same_prompt_logprobs(got: list, want: list) -> None:
    assert len(got) == len(want) and got[0] is None and want[0] is None
    for g, w in zip(got[1:], want[1:], strict=True):
        assert g.keys() == w.keys()
        for k in g:
            assert g[k]["rank"] == w[k]["rank"] and g[k]["decoded_token"] == w[k]["decoded_token"]
            assert g[k]["logprob"] == pytest.approx(w[k]["logprob"], abs=1e-4)


@pytest.mark.parametrize("echo", [False, True])
def test_streamed_completion_prompt_logprobs(base, echo):
    body = {"prompt": "The sky is", "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2,
            "n": 2, "echo": echo, "logprobs": 1 if echo else None}  # fmt: skip
    whole = _post(base, "/v1/completions", body).json()["choices"]
    chunks = _chunks(base, "/v1/completions", body)
    for k in range(2):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == k]
        assert all("prompt_logprobs" not in c for c in mine if c["finish_reason"] is None)
        [last] = [c for c in mine if c["finish_reason"] is not None]
        _same_prompt_logprobs(last["prompt_logprobs"], whole[k]["prompt_logprobs"])


def test_streamed_chat_prompt_logprobs(base):
    body = {"messages": ONE, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 1}
    whole = _post(base, "/v1/chat/completions", body).json()
    chunks = _chunks(base, "/v1/chat/completions", body)
    [got] = [c["prompt_logprobs"] for c in chunks if "prompt_logprobs" in c]
    assert chunks[-1]["choices"][0]["finish_reason"] and "prompt_logprobs" in chunks[-1]
    _same_prompt_logprobs(got, whole["prompt_logprobs"])
    assert len(got) == whole["usage"]["prompt_tokens"]


def test_bad_words_are_tokenized_as_vllm_does(client):
    encode = functools.partial(client.tokenizer.encode, add_special_tokens=False)
    for word in ["Paris", " New York", "the"]:
        bare, spaced = encode(word.lstrip()), encode(" " + word.lstrip())
        want = [tuple(bare)]
        if spaced[0] != bare[0] and len(spaced) == len(bare):
            want.append(tuple(spaced))
        assert bad_words_ids([word], encode) == tuple(want)
    assert len(bad_words_ids(["Paris"], encode)) == 2  # "Paris" and " Paris": both banned


def test_bad_words_keep_a_word_out_of_the_reply(base):
    oai = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120)
    prompt = "The capital of France is"
    plain = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    word = plain.choices[0].text.split()[0]
    banned = oai.completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, temperature=0, extra_body={"bad_words": [word]}
    )
    assert word not in banned.choices[0].text, (word, banned.choices[0].text)
    chat = oai.chat.completions.create(
        model=MODEL, messages=ONE, max_tokens=2, temperature=0,
    ).choices[0].message.content  # fmt: skip
    first = chat.split()[0]
    again = oai.chat.completions.create(
        model=MODEL, messages=ONE, max_tokens=2, temperature=0, extra_body={"bad_words": [first]}
    )
    assert not again.choices[0].message.content.startswith(first)


@pytest.mark.parametrize("value", ["no", [""], ["  "], [1], {"a": 1}, [["x"]]])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_bad_words_are_a_400_naming_the_key(base, path, value):
    body = {"max_tokens": 1, "bad_words": value}
    body.update({"prompt": "x"} if path == "/v1/completions" else {"messages": ONE})
    r = _post(base, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "bad_words", r.text


def test_return_token_ids_in_vllms_shape(base):
    """`return_token_ids`: completions give each choice its `prompt_token_ids` and `token_ids`
    (streamed: the prompt's on the choice's first chunk, the tokens on every chunk); chat
    gives `prompt_token_ids` beside the choices (streamed: on the first chunk only) and each
    choice its `token_ids`. Without it, none of them."""
    body = {"prompt": "The sky is", "max_tokens": 4, "temperature": 0}
    plain = _post(base, "/v1/completions", body).json()["choices"][0]
    [c] = _post(base, "/v1/completions", {**body, "return_token_ids": True}).json()["choices"]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain
    tok = _post(base, "/tokenize", {"prompt": "The sky is"}).json()["tokens"]
    assert c["prompt_token_ids"] == tok and len(c["token_ids"]) == 4
    body = {**body, "return_token_ids": True, "echo": True, "logprobs": 1}
    chunks = [x["choices"][0] for x in _chunks(base, "/v1/completions", body)]
    assert chunks[0]["prompt_token_ids"] == tok
    assert all("prompt_token_ids" not in x for x in chunks[1:])
    assert sum((x["token_ids"] for x in chunks), []) == c["token_ids"]
    chat = {"messages": ONE, "max_tokens": 4, "temperature": 0, "return_token_ids": True}
    whole = _post(base, "/v1/chat/completions", chat).json()
    ids = whole["prompt_token_ids"]
    assert ids == _post(base, "/tokenize", {"messages": ONE}).json()["tokens"]
    chunks = _chunks(base, "/v1/chat/completions", chat)
    assert chunks[0]["prompt_token_ids"] == ids
    assert all("prompt_token_ids" not in x for x in chunks[1:])
    streamed = [t for x in chunks if x["choices"] for t in x["choices"][0].get("token_ids", [])]
    assert streamed == whole["choices"][0]["token_ids"] and len(streamed) == 4


def test_chat_echo_and_truncated_prompts(base):
    """vLLM's chat `echo` starts the reply with the last (assistant) message, streamed or not;
    `truncate_prompt_tokens` keeps the prompt's last k tokens (-1: up to the context)."""
    saying = "An apple a day, keeps"
    msgs = [{"role": "user", "content": "Tell me a saying."},
            {"role": "assistant", "content": saying}]  # fmt: skip
    chat = {"messages": msgs, "max_tokens": 5, "temperature": 0,
            "continue_final_message": True}  # fmt: skip
    plain = _post(base, "/v1/chat/completions", chat).json()["choices"][0]["message"]["content"]
    echo = _post(base, "/v1/chat/completions", {**chat, "echo": True}).json()
    assert echo["choices"][0]["message"]["content"] == saying + plain and saying not in plain
    streamed = "".join(
        x["choices"][0]["delta"].get("content") or ""
        for x in _chunks(base, "/v1/chat/completions", {**chat, "echo": True})
        if x["choices"]
    )
    assert streamed == saying + plain
    body = {"prompt": "one two three four five six", "max_tokens": 2, "temperature": 0}
    full = _post(base, "/v1/completions", body).json()
    cut = _post(base, "/v1/completions", {**body, "truncate_prompt_tokens": 3, "echo": True})
    ids = _post(base, "/tokenize", {"prompt": body["prompt"]}).json()["tokens"]
    assert cut.json()["usage"]["prompt_tokens"] == 3
    assert "prompt_tokens_details" not in cut.json()["usage"]  # (vLLM's default: see below)
    assert cut.json()["choices"][0]["text"].startswith(" four five six")
    whole = _post(base, "/v1/completions", {**body, "truncate_prompt_tokens": -1}).json()
    assert whole["usage"]["prompt_tokens"] == len(ids) == full["usage"]["prompt_tokens"]
    right = {**body, "prompt": list(range(100, 108)), "truncate_prompt_tokens": 4}
    for side, want in (("right", [100, 101, 102, 103]), ("left", [104, 105, 106, 107])):
        r = _post(
            base, "/v1/completions", {**right, "truncation_side": side, "return_token_ids": True}
        )
        assert r.json()["choices"][0]["prompt_token_ids"] == want, side
    r = _post(base, "/v1/completions", {**body, "truncate_prompt_tokens": -2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"


def test_cached_prompt_tokens_in_usage(model_path):
    """With `prompt_tokens_details` (`taipan serve --enable-prompt-tokens-details`, vLLM's
    flag; off, usage is the three counts vLLM's own tests compare): usage's
    prompt_tokens_details.cached_tokens, the prompt tokens whose KV came from the prefix
    cache, once per prompt, streamed (the last chunk's usage) or not."""
    config = InferenceConfig(**TEST_CONFIG, enable_prefix_caching=True)
    with (
        Runtime(model_path, config) as rt,
        _served(rt, options=ServerOptions(prompt_tokens_details=True)) as url,
    ):
        body = {"prompt": "word " * 100, "max_tokens": 1, "n": 2}
        ids = _post(url, "/tokenize", {"prompt": body["prompt"]}).json()["tokens"]
        first = _post(url, "/v1/completions", body).json()["usage"]
        again = _post(url, "/v1/completions", body).json()["usage"]
        assert first["prompt_tokens_details"] == {"cached_tokens": 0}
        whole_blocks = (len(ids) - 1) // 16 * 16  # (block_size 16; one token left to compute)
        assert again["prompt_tokens_details"] == {"cached_tokens": whole_blocks} != first
        chat = {"messages": ONE, "max_tokens": 1, "stream_options": {"include_usage": True}}
        usages = [_chunks(url, "/v1/chat/completions", chat)[-1]["usage"] for _ in range(2)]
        assert usages[0]["prompt_tokens_details"]["cached_tokens"] == 0
        assert usages[1]["prompt_tokens_details"]["cached_tokens"] > 0


def test_tokens_as_token_ids(base):
    """vLLM's `return_tokens_as_token_ids`: every token of the log-probs shown as
    "token_id:N" (a chat entry's bytes those of that string); the completion's text offsets
    are those of the tokens' own text."""
    body = {"prompt": "The sky is", "max_tokens": 4, "temperature": 0, "logprobs": 2,
            "return_token_ids": True}  # fmt: skip
    plain = _post(base, "/v1/completions", body).json()["choices"][0]
    ids = _post(base, "/v1/completions", {**body, "return_tokens_as_token_ids": True})
    got = ids.json()["choices"][0]
    shown = [f"token_id:{t}" for t in got["token_ids"]]
    assert got["logprobs"]["tokens"] == shown and got["text"] == plain["text"]
    assert got["logprobs"]["text_offset"] == plain["logprobs"]["text_offset"]
    assert all(k.startswith("token_id:") for top in got["logprobs"]["top_logprobs"] for k in top)
    streamed = _chunks(base, "/v1/completions", {**body, "return_tokens_as_token_ids": True})
    assert [t for x in streamed for t in x["choices"][0]["logprobs"]["tokens"]] == shown
    chat = {
        "messages": ONE,
        "max_tokens": 3,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
        "return_tokens_as_token_ids": True,
        "return_token_ids": True,
    }
    c = _post(base, "/v1/chat/completions", chat).json()["choices"][0]
    for entry, t in zip(c["logprobs"]["content"], c["token_ids"], strict=True):
        assert (
            entry["token"] == f"token_id:{t}" and bytes(entry["bytes"]) == entry["token"].encode()
        )
        assert all(x["token"].startswith("token_id:") for x in entry["top_logprobs"])


# A template unlike SmolLM2's own: each message as "[role] content", the turn to answer as
# "[assistant]".
PLAIN = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


def test_a_requests_chat_template_needs_the_servers_trust(base):
    """vLLM's rule: a request's `chat_template` is code the server would run, refused (400
    naming the flag) unless the server trusts request templates."""
    for path, body in (
        ("/v1/chat/completions", {"messages": ONE, "max_tokens": 1}),
        ("/tokenize", {"messages": ONE}),
    ):
        r = _post(base, path, {**body, "chat_template": PLAIN})
        assert r.status_code == 400, (path, r.text)
        error = r.json()["error"]
        assert error["param"] == "chat_template"
        assert "--trust-request-chat-template" in error["message"]


def test_chat_templates_of_the_server_and_of_a_request(runtime, client):
    """--chat-template (ServerOptions.chat_template) replaces the model's for every chat
    prompt (and /tokenizer_info shows it); with --trust-request-chat-template a request's own
    template wins for that request; one that does not parse is the request's 400."""
    tok = client.tokenizer
    shouted = PLAIN.replace("[{{ m['role'] }}]", "{{ m['role'] | upper }}:")
    options = ServerOptions(chat_template=PLAIN, trust_request_chat_template=True)
    with _served(runtime, options=options) as url:
        assert httpx.get(f"{url}/tokenizer_info").json()["chat_template"] == PLAIN
        plain = tok.encode("[user] Name a colour.\n[assistant]", add_special_tokens=False)
        assert _post(url, "/tokenize", {"messages": ONE}).json()["tokens"] == plain
        body = {"messages": ONE, "max_tokens": 2, "temperature": 0, "return_token_ids": True}
        r = _post(url, "/v1/chat/completions", body).json()
        assert r["prompt_token_ids"] == plain and r["usage"]["prompt_tokens"] == len(plain)
        own = tok.encode("USER: Name a colour.\n[assistant]", add_special_tokens=False)
        r = _post(url, "/v1/chat/completions", {**body, "chat_template": shouted}).json()
        assert r["prompt_token_ids"] == own
        ids = _post(url, "/tokenize", {"messages": ONE, "chat_template": shouted}).json()
        assert ids["tokens"] == own
        bad = _post(url, "/v1/chat/completions", {**body, "chat_template": "{% for %}"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template"
        assert "does not parse" in bad.json()["error"]["message"]


def test_allowed_token_ids(base, client):
    """vLLM's `allowed_token_ids`: only those tokens are generated (completions and chat);
    an empty list or an id past the vocabulary is a 400 naming the field."""
    tok = client.tokenizer
    allowed = sorted(set(tok.encode(" red green blue yellow", add_special_tokens=False)))
    body = {"prompt": "My favourite colour is", "max_tokens": 6, "temperature": 0,
            "allowed_token_ids": allowed, "return_token_ids": True}  # fmt: skip
    got = _post(base, "/v1/completions", body).json()["choices"][0]
    assert len(got["token_ids"]) == 6 and set(got["token_ids"]) <= set(allowed)
    chat = {"messages": ONE, "max_tokens": 4, "temperature": 0.9, "seed": 3,
            "allowed_token_ids": allowed, "return_token_ids": True}  # fmt: skip
    got = _post(base, "/v1/chat/completions", chat).json()["choices"][0]
    assert got["token_ids"] and set(got["token_ids"]) <= set(allowed)
    for bad, says in (([], "non-empty"), ([1, tok.vocab_size], "outside the vocabulary")):
        r = _post(base, "/v1/completions", {**body, "allowed_token_ids": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids"
        assert says in r.json()["error"]["message"]


def test_add_special_tokens_for_completions(base):
    """vLLM's `add_special_tokens` on /v1/completions (default true: BOS before a text prompt
    where the tokenizer adds one; SmolLM2's adds none, so the ids agree here) reaches the
    tokenizer: `_encode_prompts` with a tokenizer that does add one."""
    from types import SimpleNamespace

    from taipan.server.completions import OpenAIServer

    body = {"prompt": "The sky is", "max_tokens": 1, "return_token_ids": True}
    plain = _post(base, "/v1/completions", body).json()["choices"][0]
    bare = _post(base, "/v1/completions", {**body, "add_special_tokens": False}).json()
    assert bare["choices"][0]["prompt_token_ids"] == plain["prompt_token_ids"]

    class WithBos:
        vocab_size = 10

        def encode(self, text, add_special_tokens=True):
            return ([1] if add_special_tokens else []) + [len(text)]

    server = SimpleNamespace(client=SimpleNamespace(tokenizer=WithBos()))
    assert OpenAIServer._encode_prompts(server, "abc") == [("abc", [1, 3])]
    assert OpenAIServer._encode_prompts(server, ["abc"], False) == [("abc", [3])]
