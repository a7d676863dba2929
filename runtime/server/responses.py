"""`POST /v1/responses`: OpenAI's Responses API, the text subset the SDK's
`client.responses.create` uses, over the chat endpoint's prompt and generation.

`input` is a string (one user message) or a list of message items (`{"role", "content"}`,
content a string or `input_text` / `output_text` parts); `instructions` becomes a system
message first. The answer is a `Response` object with one `message` output item; streamed, the
SDK's event sequence (response.created, .in_progress, .output_item.added,
.content_part.added, .output_text.delta ..., .output_text.done, .content_part.done,
.output_item.done, then .completed or .incomplete). Stored responses (`previous_response_id`,
`store` is ignored), function tools and non-text output formats are a 400 naming the field.

Builds no app and registers no routes.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request

from taipan.messages.requests import FinishReason
from taipan.server.chat import ChatServer
from taipan.server.completions import failed
from taipan.server.schemas import (
    APIError,
    ChatMessage,
    ResponsesBody,
    content_text,
    sampling_params,
)


def _refuse(body: ResponsesBody) -> None:
    if body.previous_response_id:
        raise APIError(
            400, "previous_response_id: taipan stores no responses", "previous_response_id"
        )
    if body.tools:
        raise APIError(400, "tools in /v1/responses are not supported yet (use chat)", "tools")
    if body.text and body.text.get("format", {"type": "text"}) != {"type": "text"}:
        raise APIError(400, "text.format other than text needs structured outputs", "text")
    if body.reasoning:
        raise APIError(400, "reasoning options are not supported by this model", "reasoning")
    if body.n != 1:
        raise APIError(400, "/v1/responses gives one output", "n")


def _messages(body: ResponsesBody) -> list[ChatMessage]:
    out = []
    if body.instructions:
        out.append(ChatMessage(role="system", content=body.instructions))
    if isinstance(body.input, str):
        return [*out, ChatMessage(role="user", content=body.input)]
    for item in body.input:
        if item.get("type", "message") != "message" or "role" not in item:
            kind = item.get("type")
            raise APIError(400, f"input items of type {kind!r} are not supported", "input")
        text = content_text(item.get("content"), "input")
        out.append(ChatMessage(role=item["role"], content=text))
    if not out:
        raise APIError(400, "input must not be empty", "input")
    return out


class ResponsesServer(ChatServer):
    """ChatServer with /v1/responses."""

    async def responses(self, body: ResponsesBody, request: Request):
        self.check_model(body)
        _refuse(body)
        ids = self.chat_prompt(_messages(body))
        limit = self.client.info.max_sequence_length
        max_tokens = body.max_output_tokens or max(1, limit - len(ids))
        self.check_fits(len(ids), max_tokens, "input")
        params = sampling_params(body, max_tokens, -1)
        state = _Response(self.model, body, len(ids))
        if body.stream:
            return await self.held_stream(request, 1, self._stream(state, ids, params))
        [c] = await self.generate_all(request, [(ids, params)])
        failed(c)
        return state.finish(c.text, len(c.token_ids), c.finish_reason)

    async def _stream(self, state: _Response, ids, params) -> AsyncIterator[str]:
        yield state.event("response.created", response=state.snapshot("in_progress"))
        yield state.event("response.in_progress", response=state.snapshot("in_progress"))
        item = state.item("in_progress", "")
        yield state.event("response.output_item.added", output_index=0, item=item)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        yield state.event("response.content_part.added", **state.where(), part=part)
        text, count, reason = "", 0, None
        timer = self.metrics.timer()
        async for d in self.client.stream(ids, params):
            count += len(d.token_ids)
            timer.tokens(len(d.token_ids))
            if d.text:
                text += d.text
                yield state.event("response.output_text.delta", **state.where(), delta=d.text,
                                  logprobs=[])  # fmt: skip
            if d.finished:
                timer.finish(d, len(ids), count)
                failed(d)
                reason = d.finish_reason
        yield state.event("response.output_text.done", **state.where(), text=text, logprobs=[])
        part = {**part, "text": text}
        yield state.event("response.content_part.done", **state.where(), part=part)
        yield state.event(
            "response.output_item.done", output_index=0, item=state.item("completed", text)
        )
        final = state.finish(text, count, reason)
        kind = "completed" if final["status"] == "completed" else "incomplete"
        yield state.event(f"response.{kind}", response=final)


class _Response:
    """One response's ids, fields and event numbering."""

    def __init__(self, model: str, body: ResponsesBody, input_tokens: int) -> None:
        self.id = f"resp_{uuid.uuid4().hex}"
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.created_at = time.time()
        self.body, self.model, self.input_tokens = body, model, input_tokens
        self.sequence = 0

    def where(self) -> dict:
        return {"item_id": self.item_id, "output_index": 0, "content_index": 0}

    def event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"

    def item(self, status: str, text: str) -> dict:
        content = []
        if status == "completed":
            content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant",
                "content": content}  # fmt: skip

    def snapshot(self, status: str, output=(), usage=None, incomplete=None) -> dict:
        b = self.body
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "model": self.model,
            "output": list(output),
            "parallel_tool_calls": b.parallel_tool_calls,
            "previous_response_id": None,
            "reasoning": None,
            "store": False,
            "temperature": 1.0 if b.temperature is None else b.temperature,
            "text": {"format": {"type": "text"}},
            "tool_choice": b.tool_choice or "auto",
            "tools": [],
            "top_p": 1.0 if b.top_p is None else b.top_p,
            "truncation": "disabled",
            "usage": usage,
            "metadata": {},
        }

    def finish(self, text: str, output_tokens: int, reason: FinishReason) -> dict:
        usage = {
            "input_tokens": self.input_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.input_tokens + output_tokens,
        }
        if reason == FinishReason.LENGTH:
            return self.snapshot(
                "incomplete", [self.item("completed", text)], usage,
                {"reason": "max_output_tokens"},
            )  # fmt: skip
        return self.snapshot("completed", [self.item("completed", text)], usage)
