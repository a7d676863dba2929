"""Stored responses in `/v1/responses` (issue 28, OpenAI parity, as vLLM stores them) through
the official `openai` SDK and plain HTTP, over uvicorn on a socket with the session's runtime
(the real default model, its prompts recorded): `previous_response_id` continuing a stored
conversation (the earlier turns and replies in the prompt, the earlier instructions not; plain
and streamed), function calls and their outputs fed back through a stored response, `store`
false keeping nothing, GET and DELETE /v1/responses/{id}, each unknown id a 404 naming its
field; and the store's LRU bound without a server."""

from __future__ import annotations

import httpx
import openai
import pytest

from taipan.server.response_store import MAX_STORED_RESPONSES, ResponseStore
from tests.test_http_openai_parity import MODEL, WrappedClient, _CannedCalls, served_wrapped
from tests.test_http_responses_tools import ASK, WEATHER

FIRST = "My name is Ada. Say hello to me."
SECOND = "What is my name?"


class _Recorded(WrappedClient):
    """A connected AsyncClient that records each prompt it is given and generates as usual."""

    async def generate(self, ids, params, raise_on_error=True):
        self.prompts.append(list(ids))
        return await self._client.generate(ids, params, raise_on_error=raise_on_error)

    def stream(self, ids, params):
        self.prompts.append(list(ids))
        return self._client.stream(ids, params)


@pytest.fixture(scope="module")
def served(runtime):
    """(SDK client, base URL, the recording client) over a server of the real model."""
    with served_wrapped(runtime, _Recorded) as (url, client):
        oai = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
        yield oai, url, client


def _prompt(client) -> str:
    return client.tokenizer.decode(client.prompts[-1], skip_special_tokens=False)


def _create(oai, **kwargs):
    return oai.responses.create(model=MODEL, max_output_tokens=6, temperature=0.0, **kwargs)


def test_the_store_keeps_the_most_recently_used():
    assert MAX_STORED_RESPONSES >= 100
    store = ResponseStore(capacity=3)
    for i in range(4):
        store.put({"id": f"r{i}", "output": [{"type": "message"}]}, [{"role": "user"}])
    assert len(store) == 3 and "r0" not in store and store.get("r0") is None
    assert store.get("r1").conversation() == [{"role": "user"}, {"type": "message"}]
    store.put({"id": "r4"}, [])  # r1 was used last: r2 goes
    assert "r1" in store and "r2" not in store
    assert store.delete("r1") and not store.delete("r1") and len(store) == 2


def test_previous_response_id_continues_the_conversation(served):
    oai, _, client = served
    first = _create(oai, input=FIRST, instructions="Answer in French.")
    assert first.store is True and first.previous_response_id is None and first.output_text
    second = _create(oai, input=SECOND, previous_response_id=first.id)
    prompt = _prompt(client)
    assert second.previous_response_id == first.id and second.output_text
    assert prompt.index(FIRST) < prompt.index(first.output_text.strip()) < prompt.index(SECOND)
    assert "Answer in French." not in prompt  # earlier instructions are not carried over
    # The same conversation given whole renders the same prompt.
    whole = [{"role": "user", "content": FIRST}, *[o.model_dump() for o in first.output],
             {"role": "user", "content": SECOND}]  # fmt: skip
    again = _create(oai, input=whole, store=False)
    assert client.prompts[-1] == client.prompts[-2]
    assert second.usage.input_tokens == again.usage.input_tokens
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    # Streamed, from the second: all three turns, and retrievable once complete.
    events = list(_create(oai, input="Spell it.", previous_response_id=second.id, stream=True))
    assert events[-1].type in ("response.completed", "response.incomplete")
    third = events[-1].response
    prompt = _prompt(client)
    assert prompt.index(FIRST) < prompt.index(SECOND) < prompt.index("Spell it.")
    got = oai.responses.retrieve(third.id)
    assert got.previous_response_id == second.id and got.store is True
    assert got.output_text == third.output_text and got.usage == third.usage


def test_get_and_delete_a_stored_response(served):
    _, base, _ = served
    body = {"model": MODEL, "input": FIRST, "max_output_tokens": 4, "temperature": 0.0}
    made = httpx.post(f"{base}/v1/responses", json=body, timeout=120).json()
    url = f"{base}/v1/responses/{made['id']}"
    assert httpx.get(url).json() == made
    deleted = httpx.delete(url)
    assert deleted.status_code == 200
    assert deleted.json() == {"id": made["id"], "object": "response.deleted", "deleted": True}
    for gone in (httpx.get(url), httpx.delete(url)):
        assert gone.status_code == 404 and gone.json()["error"]["type"] == "not_found_error"
    after = {**body, "previous_response_id": made["id"]}
    r = httpx.post(f"{base}/v1/responses", json=after, timeout=120)
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"


def test_unstored_and_unknown_ids_are_a_404_naming_the_field(served):
    oai, _, _ = served
    kept = _create(oai, input=FIRST, store=False)
    assert kept.store is False
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(kept.id)
    for rid in (kept.id, "resp_unknown"):
        with pytest.raises(openai.NotFoundError) as e:
            _create(oai, input=SECOND, previous_response_id=rid, stream=rid == kept.id)
        err = e.value.body
        assert err["param"] == "previous_response_id", err
        assert "previous_response_id" in err["message"] and rid in err["message"], err


def test_function_calls_continue_through_a_stored_response(runtime):
    with served_wrapped(runtime, _CannedCalls) as (url, client):
        oai = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        r = oai.responses.create(model=MODEL, input=ASK, tools=[WEATHER])
        calls = [o for o in r.output if o.type == "function_call"]
        back = [{"type": "function_call_output", "call_id": c.call_id, "output": f"sunny {i}"}
                for i, c in enumerate(calls)]  # fmt: skip
        oai.responses.create(model=MODEL, input=back, tools=[WEATHER], previous_response_id=r.id)
        prompt = _prompt(client)
        whole = [{"role": "user", "content": ASK}, *r.output, *back]
        oai.responses.create(model=MODEL, input=whole, tools=[WEATHER], store=False)
    assert len(calls) == 2 and client.prompts[-1] == client.prompts[-2]
    assert prompt.index(ASK) < prompt.index('"Paris"') < prompt.index("sunny 0")
    assert prompt.index("sunny 0") < prompt.index("sunny 1")
