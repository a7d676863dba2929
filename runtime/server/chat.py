"""`POST /v1/chat/completions` (`ChatServer.chat`), and the chat prompt every chat-shaped
endpoint renders (`ChatServer.chat_prompt`: chat, /tokenize and /v1/responses).

The model's chat template (or the server's --chat-template, or with
--trust-request-chat-template the request's own `chat_template`: `template_of`) renders the
messages as Hugging Face's `apply_chat_template` does, with `tools`, vLLM's
`add_generation_prompt`, `continue_final_message` and `chat_template_kwargs`. With tools and
tool_choice "auto" (or absent) the reply is parsed for tool calls (.tools): they come back as
`tool_calls` with finish_reason "tool_calls", streamed as OpenAI streams them (each call in one
delta, by index). tool_choice "none" passes the tools to the template but parses nothing, as
vLLM does. `parallel_tool_calls` false keeps the first call. "required" or a named function
forces a call by a grammar (tools.tool_grammar). vLLM's `prompt_logprobs` comes back once per
response, as vLLM's does (streamed, which vLLM refuses: on the first choice's last chunk,
beside `choices`).

Builds no app and registers no routes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request

from taipan.messages.requests import SamplingParams, StructuredOutput
from taipan.ops.chat_template import ChatTemplateError, cached_chat_template
from taipan.outputs import join_versions
from taipan.server.completions import OpenAIServer, failed
from taipan.server.logprobs import chat_logprobs, prompt_logprobs
from taipan.server.params import check_structured, choice_params
from taipan.server.schemas import (
    APIError,
    ChatBody,
    ChatMessage,
    Tool,
    forced_tool_name,
    message_dict,
    openai_finish,
    openai_usage,
    refuse_unsupported,
)
from taipan.server.streaming import Done, merge, sse
from taipan.server.tools import (
    ToolStream,
    fallback_messages,
    parse_tool_calls,
    template_renders_tools,
    tool_grammar,
    tool_style,
)


class ChatServer(OpenAIServer):
    """OpenAIServer with the chat endpoint and the chat prompt."""

    # --- the prompt --------------------------------------------------------------------------

    def template_of(self, requested: str | None = None) -> str | None:
        """The chat template source a request renders with: its own `requested` one (only
        with --trust-request-chat-template; a 400 otherwise, or if it does not parse), else
        the server's --chat-template, else the model's (None: it has none)."""
        if requested is None:
            return self.options.chat_template or self.client.tokenizer.chat_template
        if not self.options.trust_request_chat_template:
            raise APIError(
                400, "a chat_template in the request needs the server started with "
                "--trust-request-chat-template", "chat_template",
            )  # fmt: skip
        try:
            cached_chat_template(requested)
        except ChatTemplateError as e:
            raise APIError(400, str(e), "chat_template") from e
        return requested

    def chat_prompt(
        self,
        messages: list[ChatMessage],
        tools: list[Tool] | None = None,
        *,
        tool_choice=None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
        chat_template_kwargs: dict | None = None,
        chat_template: str | None = None,
    ) -> list[int]:
        """The token ids of the conversation through the chat template (`template_of`
        `chat_template`); a 400 for messages the template refuses."""
        if add_generation_prompt and continue_final_message:
            raise APIError(
                400,
                "add_generation_prompt and continue_final_message cannot both be true",
                "continue_final_message",
            )
        tok = self.client.tokenizer
        template = self.template_of(chat_template)
        dicts = [message_dict(m) for m in messages]
        tool_dicts = [t.model_dump(exclude_none=True) for t in tools or []] or None
        if not template_renders_tools(template):  # (SmolLM2's GGUF template)
            dicts = fallback_messages(dicts, None if tool_choice == "none" else tool_dicts)
        kwargs = dict(chat_template_kwargs or {})
        if tool_dicts:
            kwargs["tools"] = tool_dicts
        try:
            text = tok.render_chat_template(
                dicts, add_generation_prompt, template=template, **kwargs
            )
        except Exception as e:  # a template that refuses these messages: the caller's input
            raise APIError(400, f"the chat template refused the messages: {e}", "messages") from e
        if continue_final_message:
            last = dicts[-1].get("content") or ""
            end = text.rfind(last) if last else -1
            if dicts[-1]["role"] != "assistant" or end < 0:
                raise APIError(
                    400,
                    "continue_final_message needs a final assistant message with content",
                    "continue_final_message",
                )
            text = text[: end + len(last)]
        return tok.encode(text, add_special_tokens=add_special_tokens)

    def _forced_tools(self, body: ChatBody, params: SamplingParams) -> SamplingParams:
        """`params` keeping to a tool call when tool_choice is "required" or names a function
        (tools.tool_grammar, in the template's style), else as they are."""
        choice = body.tool_choice
        if choice is None or choice in ("none", "auto"):
            return params
        if params.structured is not None:
            raise APIError(
                400, "tool_choice forcing a call cannot be combined with response_format or "
                "another structured output", "tool_choice",
            )  # fmt: skip
        only = forced_tool_name(choice) if isinstance(choice, dict) else None
        return self.force_tool_call(
            params, body.tools, only, body.parallel_tool_calls, body.chat_template
        )

    def force_tool_call(
        self,
        params: SamplingParams,
        tools: list[Tool],
        only: str | None,
        parallel: bool,
        chat_template: str | None = None,
    ) -> SamplingParams:
        """`params` keeping to a call of one of `tools` (of the one named `only`), in the
        template's style (`template_of` `chat_template`); several calls with `parallel`
        (unless one is named)."""
        dicts = [t.model_dump(exclude_none=True) for t in tools]
        style = tool_style(self.template_of(chat_template))
        grammar = tool_grammar(dicts, only, style, parallel and only is None)
        structured = StructuredOutput("grammar", grammar)
        check_structured(structured, "tools")
        return dataclasses.replace(params, structured=structured)

    # --- /v1/chat/completions ----------------------------------------------------------------

    async def chat(self, body: ChatBody, request: Request):
        self.check_model(body)
        refuse_unsupported(body)
        if body.max_tokens is not None and body.max_completion_tokens is not None:
            if body.max_tokens != body.max_completion_tokens:
                raise APIError(400, "max_tokens and max_completion_tokens differ", "max_tokens")
        if body.top_logprobs and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        ids = self.chat_prompt(
            body.messages,
            body.tools,
            tool_choice=body.tool_choice,
            add_generation_prompt=generation_prompt(body),
            continue_final_message=body.continue_final_message,
            add_special_tokens=body.add_special_tokens,
            chat_template_kwargs=body.chat_template_kwargs,
            chat_template=body.chat_template,
        )
        ids = self.truncated(body, ids)
        limit = self.client.info.max_sequence_length
        max_tokens = body.max_completion_tokens or body.max_tokens or max(1, limit - len(ids))
        self.check_fits(len(ids), max_tokens, "messages")
        top_n = (body.top_logprobs or 0) if body.logprobs else -1
        prompt_top = -1 if body.prompt_logprobs is None else body.prompt_logprobs
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if body.use_beam_search:
            return await self._beam_chat(body, request, rid, ids, max_tokens)
        params = self._forced_tools(body, self.sampling_params(body, max_tokens, top_n, prompt_top))
        if body.stream:
            return await self.held_stream(
                request, body.n, self._stream_chat(body, rid, ids, params)
            )
        jobs = [(ids, choice_params(params, j)) for j in range(body.n)]
        choices, completion_tokens, echo = [], 0, echoed(body)
        results = await self.generate_all(request, jobs)
        for j, c in enumerate(results):
            failed(c)
            completion_tokens += len(c.token_ids)
            message, finish = self._message(body, c.text), openai_finish(c.finish_reason)
            if echo:
                message["content"] = echo + (message["content"] or "")
            if message.get("tool_calls"):
                finish = "tool_calls"
            logprobs = None
            if body.logprobs:
                content = chat_logprobs(
                    self.texts_for(body),
                    c.token_ids,
                    c.log_probs,
                    c.top_n_logprobs,
                    body.top_logprobs or 0,
                )
                logprobs = {"content": content}
            choices.append(
                {
                    "index": j,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": finish,
                    "stop_reason": c.stop_reason,
                    "weight_versions": c.weight_versions,  # taipan's extension
                    **({"token_ids": c.token_ids} if body.return_token_ids else {}),  # vLLM's
                }
            )
        out = {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": choices,
            "usage": self.usage(len(ids), completion_tokens, results[0].num_cached_tokens),
            "prompt_logprobs": None,  # vLLM's, when asked
        }
        if body.return_token_ids:
            out["prompt_token_ids"] = ids
        if body.prompt_logprobs is not None:  # vLLM's: the prompt's, once for all choices
            out["prompt_logprobs"] = prompt_logprobs(
                self.texts_for(body), ids, c.prompt_log_probs, c.prompt_top_n_logprobs,
                body.prompt_logprobs,
            )  # fmt: skip
        return out

    async def _beam_chat(self, body: ChatBody, request: Request, rid: str, ids, max_tokens: int):
        """vLLM's `use_beam_search` in chat: `n` beams, best first, as assistant messages."""
        if body.stream:
            raise APIError(400, "stream cannot be combined with use_beam_search", "stream")
        outs = await self.beam_search(request, [ids], body, max_tokens)
        message = lambda s: {"message": {"role": "assistant", "content": s.text}}  # noqa: E731
        choices, generated = self.beam_choices(outs, [ids], message)
        return {
            "id": rid, "object": "chat.completion", "created": int(time.time()),
            "model": self.model, "choices": choices, "usage": self.usage(len(ids), generated, 0),
        }  # fmt: skip

    def _parses_tools(self, body: ChatBody) -> bool:
        return bool(body.tools) and body.tool_choice != "none"

    def _message(self, body: ChatBody, text: str) -> dict:
        if not self._parses_tools(body):
            return {"role": "assistant", "content": text}
        content, calls = parse_tool_calls(text, tool_style(self.template_of(body.chat_template)))
        if not body.parallel_tool_calls:
            calls = calls[:1]
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        return message

    def _stream_chat(self, body: ChatBody, rid: str, ids: list[int], params):
        created = int(time.time())
        options = body.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = include_usage and options.continuous_usage_stats
        style = tool_style(self.template_of(body.chat_template))
        cached: list[int] = []  # the prompt's cached tokens (from the first choice)

        async def one(j: int, put) -> int:
            count = 0

            async def send(chunk: dict) -> None:
                if continuous:
                    chunk["usage"] = openai_usage(len(ids), count)
                await put(j, chunk)

            await send({"index": j, "delta": {"role": "assistant", "content": echoed(body)},
                        "logprobs": None, "finish_reason": None})  # fmt: skip
            tools = ToolStream(style) if self._parses_tools(body) else None
            sent = 0  # tool calls sent
            versions: list[tuple[int, int]] = []  # of the tokens since the last chunk sent
            timer = self.metrics.timer()
            async for d in self.client.stream(ids, choice_params(params, j)):
                count += len(d.token_ids)
                timer.tokens(len(d.token_ids))
                versions = join_versions(versions, d.weight_versions)
                text, calls = d.text, []
                if tools is not None:
                    text, calls = tools.delta(d.text, d.finished, body.parallel_tool_calls, sent)
                chunk = {"index": j, "delta": _delta(text, calls, sent), "logprobs": None,
                         "finish_reason": None}  # fmt: skip
                sent += len(calls)
                if body.logprobs and d.token_ids:
                    content = chat_logprobs(
                        self.texts_for(body), d.token_ids, d.log_probs, d.top_n_logprobs,
                        body.top_logprobs or 0,
                    )  # fmt: skip
                    chunk["logprobs"] = {"content": content}
                if body.return_token_ids:
                    chunk["token_ids"] = d.token_ids
                if d.finished:
                    timer.finish(d, len(ids), count)
                    failed(d)
                    if j == 0:
                        cached.append(d.num_cached_tokens)
                    finish = openai_finish(d.finish_reason)
                    chunk["finish_reason"] = "tool_calls" if sent else finish
                    chunk["stop_reason"] = d.stop_reason
                    if body.prompt_logprobs is not None and j == 0:  # once, as unstreamed
                        chunk["prompt_logprobs"] = prompt_logprobs(
                            self.texts_for(body), ids, d.prompt_log_probs, d.prompt_top_n_logprobs,
                            body.prompt_logprobs,
                        )  # fmt: skip
                if chunk["delta"] or d.finished or chunk["logprobs"] or chunk.get("token_ids"):
                    chunk["weight_versions"], versions = versions, []
                    await send(chunk)
            return count

        def envelope(choices, usage=None, prompt=None):
            out = {"id": rid, "object": "chat.completion.chunk", "created": created,
                   "model": self.model, "choices": choices}  # fmt: skip
            if usage is not None:
                out["usage"] = usage
            if prompt is not None:
                out["prompt_logprobs"] = prompt
            return out

        async def events() -> AsyncIterator[str]:
            counts = None
            args = [(j,) for j in range(body.n)]
            first = body.return_token_ids  # (the stream's first chunk: the prompt's ids, vLLM's)
            async with contextlib.aclosing(merge(args, one)) as items:
                async for item in items:
                    if isinstance(item, Done):
                        counts = item.results
                        break
                    usage, prompt = item.pop("usage", None), item.pop("prompt_logprobs", None)
                    chunk = envelope([item], usage, prompt)
                    if first:
                        chunk["prompt_token_ids"], first = ids, False
                    yield sse(chunk)
            if include_usage and counts is not None:
                usage = self.usage(len(ids), sum(counts), sum(cached))
                yield sse(envelope([], usage))
            yield "data: [DONE]\n\n"

        return events()


def echoed(body: ChatBody) -> str:
    """What vLLM's chat `echo` puts before the reply: the last message's text when that
    message is the assistant's, else ""."""
    last = body.messages[-1]
    if not body.echo or last.role != "assistant" or not last.content:
        return ""
    if isinstance(last.content, str):
        return last.content
    return "".join(p.get("text", "") for p in last.content if p.get("type") == "text")


def generation_prompt(body) -> bool:
    """`add_generation_prompt`, which `continue_final_message` turns off unless it was sent
    (then both true is a 400), as vLLM reads them."""
    if body.continue_final_message and "add_generation_prompt" not in body.model_fields_set:
        return False
    return body.add_generation_prompt


def _delta(text: str, calls: list[dict], first: int) -> dict:
    """A streamed chunk's delta: its content, and its complete tool calls, numbered from
    `first` (the calls the choice sent before)."""
    delta: dict = {}
    if text:
        delta["content"] = text
    if calls:
        delta["tool_calls"] = [{"index": first + i, **c} for i, c in enumerate(calls)]
    return delta
