"""vLLM's request extensions the issue 28 server had left out, over uvicorn on a socket with the
real default model: `prompt_logprobs` with `stream=true` (vLLM refuses it; taipan sends the
unstreamed value, in vLLM's shape, on the choice's last chunk: beside `choices` in chat) and
`bad_words` as strings (tokenized as vLLM does, onto SamplingParams.bad_words_ids), each bad
value a 400 naming its key."""

from __future__ import annotations

import functools
import json

import httpx
import openai
import pytest

from taipan.server.schemas import bad_words_ids
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
