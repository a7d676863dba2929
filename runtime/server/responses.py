"""`POST /v1/responses`: OpenAI's Responses API, the text and function-tool subset the SDK's
`client.responses.create` uses, over the chat endpoint's prompt and generation.

`input` is a string (one user message) or a list of items: messages (`{"role", "content"}`,
content a string or `input_text` / `output_text` parts), `function_call` items (an earlier
reply's calls: they join the assistant message before them, as its `tool_calls`) and
`function_call_output` items (a call's result: a `tool` message); `instructions` becomes a
system message first. Function `tools` reach the chat template as chat's do (.chat,
.tools), and `tool_choice` works as chat's: "none" renders them but parses nothing, "auto"
parses the reply for calls, "required" or `{"type": "function", "name"}` forces a call by
the same grammar (tools.tool_grammar); `parallel_tool_calls` false keeps the first call.

The answer is a `Response` whose `output` holds a `message` item for the reply's text and a
`function_call` item (`call_id`, `name`, `arguments`) per call. Streamed, the SDK's event
sequence: response.created, .in_progress, then per item .output_item.added, for a message
.content_part.added, .output_text.delta ..., .output_text.done, .content_part.done, for a call
.function_call_arguments.delta (the whole arguments at once: a call is sent when it is
complete) and .function_call_arguments.done, then .output_item.done; last .completed or
.incomplete. Without tools the message item opens at once (it may stay empty); with them it
opens at the first text.

Structured outputs: `text.format` {"type": "json_schema", "name", "schema", "strict"} or
{"type": "json_object"} keeps the reply to a grammar, as chat's `response_format` does (the
same mapping and leniency: `name` and `strict` are not needed, chat's nested `json_schema`
shape is taken too); {"type": "text"} (the default) keeps it to none. The Response echoes the
format. A bad format or a schema that does not compile is a 400 naming `text.format`, as is a
format beside another structured output (vLLM's guided_*); a tool_choice forcing a call beside
one is a 400 naming `tool_choice`, as chat's is. The SDK's `client.responses.parse(text_format=
...)` reads the message's `output_text`. Tools other than functions are a 400 naming `tools`.

Stored responses (.response_store), as vLLM stores them: with `store` true (the default) the
finished Response is kept, with the conversation the model saw, in a bounded LRU in this
process's memory (MAX_STORED_RESPONSES; the least recently used evicted first); a streamed one
once complete, a failed or disconnected one never. `previous_response_id` continues a stored
response: its input items, then its output items (messages, function_call items), then the
request's `input`, converted as above; only the request's own `instructions` apply. An unknown,
unstored, deleted or evicted id is a 404 naming `previous_response_id`. `GET` and `DELETE
/v1/responses/{id}` return and forget a stored response (404 if unknown). The Response's `store`
says whether it was stored.

Builds no app and registers no routes.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from pydantic import ValidationError

from taipan.messages.requests import FinishReason, SamplingParams, StructuredOutput
from taipan.server.chat import ChatServer
from taipan.server.completions import failed
from taipan.server.params import check_structured
from taipan.server.response_store import ResponseStore
from taipan.server.schemas import (
    APIError,
    ChatMessage,
    ResponsesBody,
    Tool,
    ToolFunction,
    content_text,
)
from taipan.server.tools import ToolStream, parse_tool_calls, tool_style


def _refuse(body: ResponsesBody) -> None:
    if body.reasoning:
        raise APIError(400, "reasoning options are not supported by this model", "reasoning")
    if body.n != 1:
        raise APIError(400, "/v1/responses gives one output", "n")


def _text_format(body: ResponsesBody) -> tuple[dict, StructuredOutput | None]:
    """`text.format` (null or absent: {"type": "text"}) and the structured output it asks
    for (None for text), as chat's response_format maps: a 400 naming `text.format`."""
    text = body.text or {}
    if not isinstance(text, dict):
        raise APIError(400, "text must be an object", "text")
    fmt = text.get("format")
    fmt = {"type": "text"} if fmt is None else fmt
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return fmt, None
    if kind == "json_object":
        structured = StructuredOutput("json_object", "")
    elif kind == "json_schema":
        schema = fmt.get("schema")
        inner = fmt.get("json_schema")  # chat's nested shape: taken too
        if schema is None and isinstance(inner, dict):
            schema = inner.get("schema")
        if not isinstance(schema, dict):
            raise APIError(400, "text.format.schema must be a JSON schema object",
                           "text.format")  # fmt: skip
        structured = StructuredOutput("json_schema", json.dumps(schema))
    elif not isinstance(fmt, dict):
        raise APIError(400, "text.format must be an object", "text.format")
    else:
        raise APIError(400, f"text.format type {repr(kind)[:60]} is not text, json_object or "
                       "json_schema", "text.format")  # fmt: skip
    check_structured(structured, "text.format")
    return fmt, structured


def _tools(body: ResponsesBody) -> list[Tool]:
    """The Responses API's flat function tools ({"type": "function", "name", ...}) as chat's
    (chat's nested shape is taken too)."""
    out = []
    for tool in body.tools or []:
        if tool.get("type") != "function":
            kind = tool.get("type")
            raise APIError(400, f"tools of type {kind!r} are not supported (functions only)",
                           "tools")  # fmt: skip
        if isinstance(tool.get("function"), dict):  # chat's nested shape: taken too
            tool = {**tool["function"], "type": "function"}
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise APIError(400, "a function tool needs a non-empty name", "tools")
        parameters = tool.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise APIError(400, f"tool {name!r}: parameters must be a JSON schema", "tools")
        fields = {k: tool.get(k) for k in ("description", "strict") if tool.get(k) is not None}
        try:
            function = ToolFunction(name=name, parameters=parameters, **fields)
        except ValidationError as e:
            why = e.errors()[0]
            raise APIError(400, f"tool {name!r}: {why['loc'][0]}: {why['msg']}", "tools") from None
        out.append(Tool(function=function))
    return out


def _forced(body: ResponsesBody, tools: list[Tool]) -> tuple[bool, str | None]:
    """(whether tool_choice forces a call, the function it names or None)."""
    choice = body.tool_choice
    if choice is None or choice in ("none", "auto"):
        return False, None
    if not tools:
        raise APIError(400, f"tool_choice {choice!r} needs tools", "tool_choice")
    if choice == "required":
        return True, None
    function = choice.get("function")
    name = choice.get("name") or (function.get("name") if isinstance(function, dict) else None)
    if choice.get("type") != "function" or not isinstance(name, str):
        raise APIError(
            400, 'tool_choice must be "none", "auto", "required" or {"type": "function", '
            '"name": ...}', "tool_choice",
        )  # fmt: skip
    if name not in [t.function.name for t in tools]:
        raise APIError(400, f"tool_choice names {name!r}, which is not in tools", "tool_choice")
    return True, name


def _input_items(body: ResponsesBody) -> list[dict]:
    """The request's `input` as items (a string: one user message)."""
    if isinstance(body.input, str):
        return [{"type": "message", "role": "user", "content": body.input}]
    return list(body.input)


def _messages(instructions: str | None, items: list[dict]) -> list[ChatMessage]:
    out: list[dict] = []
    if instructions:
        out.append({"role": "system", "content": instructions})
    for item in items:
        out += _item_message(item, out[-1] if out else None)
    if not out:
        raise APIError(400, "input must not be empty", "input")
    try:
        return [ChatMessage.model_validate(m) for m in out]
    except ValidationError as e:
        why = e.errors()[0]
        where = ".".join(str(x) for x in why["loc"])
        raise APIError(400, f"input: a message's {where}: {why['msg']}", "input") from None


def _item_message(item: dict, last: dict | None) -> list[dict]:
    """The chat messages one input item adds (a function_call joins the assistant message
    `last` when there is one: it updates `last` and adds none)."""
    kind = item.get("type", "message")
    if kind == "message" and "role" in item:
        return [{"role": item["role"], "content": content_text(item.get("content"), "input")}]
    if kind == "function_call":
        name, args, call_id = item.get("name"), item.get("arguments", "{}"), item.get("call_id")
        args = json.dumps(args) if isinstance(args, dict) else args
        if not isinstance(name, str) or not isinstance(args, str) or not call_id:
            raise APIError(400, "a function_call item needs call_id, name and arguments", "input")
        call = {"id": call_id, "type": "function",
                "function": {"name": name, "arguments": args}}  # fmt: skip
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)
            return []
        return [{"role": "assistant", "content": None, "tool_calls": [call]}]
    if kind == "function_call_output":
        output = item.get("output")
        if not item.get("call_id") or not isinstance(output, str | list):
            raise APIError(400, "a function_call_output item needs call_id and output", "input")
        text = content_text(output, "input")
        return [{"role": "tool", "tool_call_id": item["call_id"], "content": text}]
    raise APIError(400, f"input items of type {kind!r} are not supported", "input")


class ResponsesServer(ChatServer):
    """ChatServer with /v1/responses and its stored responses (`stored`)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.stored = ResponseStore()

    def stored_response(self, response_id: str) -> dict:
        """GET /v1/responses/{id}: the stored Response, else a 404."""
        found = self.stored.get(response_id)
        if found is None:
            raise APIError(404, f"no stored response {response_id!r}", "response_id")
        return found.response

    def delete_response(self, response_id: str) -> dict:
        """DELETE /v1/responses/{id}: forget a stored response, else a 404."""
        if not self.stored.delete(response_id):
            raise APIError(404, f"no stored response {response_id!r}", "response_id")
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    def _conversation(self, body: ResponsesBody) -> list[dict]:
        """The input items the model sees: a previous response's conversation, then `input`."""
        items = _input_items(body)
        if not body.previous_response_id:  # (null or "": none)
            return items
        previous = self.stored.get(body.previous_response_id)
        if previous is None:
            raise APIError(404, f"previous_response_id: no stored response "
                           f"{body.previous_response_id!r} (unknown, not stored, deleted or "
                           "evicted)", "previous_response_id")  # fmt: skip
        return [*previous.conversation(), *items]

    async def responses(self, body: ResponsesBody, request: Request):
        self.check_model(body)
        _refuse(body)
        tools = _tools(body)
        forced, only = _forced(body, tools)
        choice = "none" if body.tool_choice == "none" else None
        items = self._conversation(body)
        ids = self.chat_prompt(_messages(body.instructions, items), tools or None,
                               tool_choice=choice)  # fmt: skip
        limit = self.client.info.max_sequence_length
        max_tokens = body.max_output_tokens or max(1, limit - len(ids))
        self.check_fits(len(ids), max_tokens, "input")
        params = self.sampling_params(body, max_tokens, -1)
        fmt, structured = _text_format(body)
        if structured is not None:
            if params.structured is not None:
                raise APIError(400, "give one structured output, not text.format and "
                               "another", "text.format")  # fmt: skip
            params = dataclasses.replace(params, structured=structured)
        if forced:
            if params.structured is not None:
                raise APIError(400, "tool_choice forcing a call cannot be combined with "
                               "text.format or another structured output",
                               "tool_choice")  # fmt: skip
            params = self.force_tool_call(params, tools, only, body.parallel_tool_calls)
        state = _Response(self.model, body, len(ids), tools, fmt)
        parses = bool(tools) and body.tool_choice != "none"
        if body.stream:
            events = self._stream(state, ids, params, parses, items)
            return await self.held_stream(request, 1, events)
        [c] = await self.generate_all(request, [(ids, params)])
        failed(c)
        content, calls = c.text, []
        if parses:
            content, calls = parse_tool_calls(c.text, self._style())
            calls = calls if body.parallel_tool_calls else calls[:1]
        if content or not calls:
            state.output.append(state.message_item(state.new_id("msg"), "completed", content or ""))
        state.output += [state.call_item(call) for call in calls]
        return self._keep(state.finish(len(c.token_ids), c.finish_reason), items)

    def _keep(self, response: dict, items: list[dict]) -> dict:
        """Store a finished Response (when its `store` says so); returns it."""
        if response["store"]:
            self.stored.put(response, items)
        return response

    def _style(self):
        return tool_style(self.template_of())

    async def _stream(
        self,
        state: _Response,
        ids: list[int],
        params: SamplingParams,
        parses: bool,
        items: list[dict],
    ) -> AsyncIterator[str]:
        yield state.event("response.created", response=state.snapshot("in_progress"))
        yield state.event("response.in_progress", response=state.snapshot("in_progress"))
        if not parses:
            for e in state.open_message():
                yield e
        tools = ToolStream(self._style()) if parses else None
        count, reason, sent = 0, None, 0
        timer = self.metrics.timer()
        async for d in self.client.stream(ids, params):
            count += len(d.token_ids)
            timer.tokens(len(d.token_ids))
            text, calls = d.text, []
            if tools is not None:
                parallel = state.body.parallel_tool_calls
                text, calls = tools.delta(d.text, d.finished, parallel, sent)
            if text:
                for e in state.message_text(text):
                    yield e
            for call in calls:
                sent += 1
                for e in state.call_events(call):
                    yield e
            if d.finished:
                timer.finish(d, len(ids), count)
                failed(d)
                reason = d.finish_reason
        if not state.output and state.message is None:  # nothing said: an empty message
            for e in state.open_message():
                yield e
        for e in state.close_message():
            yield e
        final = self._keep(state.finish(count, reason), items)
        kind = "completed" if final["status"] == "completed" else "incomplete"
        yield state.event(f"response.{kind}", response=final)


class _Response:
    """One response's ids, fields, output items and event numbering. `message` is the
    streamed message item still open ({"id", "index", "text"}), else None."""

    def __init__(
        self, model: str, body: ResponsesBody, input_tokens: int, tools, fmt: dict
    ) -> None:
        self.id = self.new_id("resp")
        self.format = fmt
        self.created_at = time.time()
        self.body, self.model, self.input_tokens = body, model, input_tokens
        self.tools = [
            {"type": "function", **t.function.model_dump(exclude_none=True)} for t in tools
        ]
        self.sequence = 0
        self.output: list[dict] = []
        self.message: dict | None = None

    @staticmethod
    def new_id(prefix: str) -> str:
        return f"{prefix}_{uuid.uuid4().hex}"

    def event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"

    # --- items -----------------------------------------------------------------------------

    @staticmethod
    def message_item(item_id: str, status: str, text: str) -> dict:
        content = []
        if status == "completed":
            content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        return {"type": "message", "id": item_id, "status": status, "role": "assistant",
                "content": content}  # fmt: skip

    def call_item(self, call: dict, status: str = "completed") -> dict:
        """The function_call item of a chat tool call (tools.parse_tool_calls')."""
        f = call["function"]
        return {"type": "function_call", "id": self.new_id("fc"), "call_id": call["id"],
                "name": f["name"], "arguments": f["arguments"], "status": status}  # fmt: skip

    # --- streamed items --------------------------------------------------------------------

    def _where(self) -> dict:
        m = self.message
        return {"item_id": m["id"], "output_index": m["index"], "content_index": 0}

    def open_message(self) -> list[str]:
        self.message = {"id": self.new_id("msg"), "index": len(self.output), "text": ""}
        item = self.message_item(self.message["id"], "in_progress", "")
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            self.event("response.output_item.added", output_index=self.message["index"],
                       item=item),
            self.event("response.content_part.added", **self._where(), part=part),
        ]  # fmt: skip

    def message_text(self, text: str) -> list[str]:
        out = [] if self.message is not None else self.open_message()
        self.message["text"] += text
        out.append(self.event("response.output_text.delta", **self._where(), delta=text,
                              logprobs=[]))  # fmt: skip
        return out

    def close_message(self) -> list[str]:
        """The events that end the open message item (none when none is open)."""
        m = self.message
        if m is None:
            return []
        text, where = m["text"], self._where()
        item = self.message_item(m["id"], "completed", text)
        part = item["content"][0]
        out = [
            self.event("response.output_text.done", **where, text=text, logprobs=[]),
            self.event("response.content_part.done", **where, part=part),
            self.event("response.output_item.done", output_index=m["index"], item=item),
        ]
        self.output.append(item)
        self.message = None
        return out

    def call_events(self, call: dict) -> list[str]:
        """A complete call as its item's events (the open message ends first)."""
        out = self.close_message()
        item, index = self.call_item(call), len(self.output)
        where = {"item_id": item["id"], "output_index": index}
        args = item["arguments"]
        out += [
            self.event("response.output_item.added", output_index=index,
                       item={**item, "arguments": "", "status": "in_progress"}),
            self.event("response.function_call_arguments.delta", **where, delta=args),
            self.event("response.function_call_arguments.done", **where, name=item["name"],
                       arguments=args),
            self.event("response.output_item.done", output_index=index, item=item),
        ]  # fmt: skip
        self.output.append(item)
        return out

    # --- the response ----------------------------------------------------------------------

    def snapshot(self, status: str, usage=None, incomplete=None) -> dict:
        b = self.body
        choice = b.tool_choice or "auto"
        if isinstance(choice, dict):
            choice = {"type": "function", "name": choice.get("name")
                      or (choice.get("function") or {}).get("name")}  # fmt: skip
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
            "output": list(self.output) if status != "in_progress" else [],
            "parallel_tool_calls": b.parallel_tool_calls,
            "previous_response_id": b.previous_response_id or None,
            "reasoning": None,
            "store": b.store,
            "temperature": 1.0 if b.temperature is None else b.temperature,
            "text": {**(b.text or {}), "format": self.format},
            "tool_choice": choice,
            "tools": self.tools,
            "top_p": 1.0 if b.top_p is None else b.top_p,
            "truncation": "disabled",
            "usage": usage,
            "metadata": {},
        }

    def finish(self, output_tokens: int, reason: FinishReason) -> dict:
        """The final Response of the items in `output`."""
        usage = {
            "input_tokens": self.input_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.input_tokens + output_tokens,
        }
        if reason == FinishReason.LENGTH:
            return self.snapshot("incomplete", usage, {"reason": "max_output_tokens"})
        return self.snapshot("completed", usage)
