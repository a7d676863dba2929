"""The route table: every path the server answers, and the small handlers inline.

`GET /health`, `GET /v1/models` and `/v1/models/{id}`, `GET /metrics` (Prometheus), vLLM's
`GET /tokenizer_info`, `POST /tokenize` (a prompt, or chat messages through the template) and
`POST /detokenize` (lm-eval's remote tokenizer), the generating `POST /v1/completions`,
`POST /v1/chat/completions` and `POST /v1/responses` (and SageMaker's `POST /invocations`, either
of the first two), which call `ResponsesServer`, `GET` and `DELETE /v1/responses/{id}` (its
stored responses), and the
lifecycle controls an HTTP-driven trainer needs (CONTROL_PATHS: pause with its mode, clear_cache
and timeout, unpause, suspend, resume, update_weights from a path, init / update / close weight
transfer, update_weights_from_ipc, flush_cache), only with `--api-key`.

Registers routes only: error handlers, the API key check and serving belong to the app module.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json

import prometheus_client as prom
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from taipan.client import ControlError
from taipan.messages.lifecycle import IpcTensor
from taipan.server.chat import generation_prompt
from taipan.server.responses import ResponsesServer
from taipan.server.schemas import (
    APIError,
    ChatBody,
    CompletionBody,
    DetokenizeBody,
    ResponsesBody,
    TokenizeBody,
)

CONTROL_PATHS = (
    "/pause", "/unpause", "/suspend", "/resume", "/update_weights", "/init_weight_transfer",
    "/update_weights_from_distributed", "/close_weight_transfer", "/flush_cache",
    "/update_weights_from_ipc",
)  # fmt: skip
# IpcTensor's bytes fields: base64 strings (or null) in JSON.
_IPC_BYTES = ("handle", "ref_counter_handle", "event_handle")
_CONTROL_STATUS = {
    "bad_request": 400,
    "not_authorized": 403,
    "illegal_transition": 409,
    "busy": 409,
}


def add_control_routes(app: FastAPI, client, enabled: bool) -> None:
    """The lifecycle over HTTP (runtime/client.py's methods, the same ControlAck as JSON). Each
    is refused (403) unless the server has an API key; a refused or failed control is the
    runtime's ErrorReply code and text with 400, 403 or 409, or 500 when an engine failed."""

    async def run(call, **kw):
        if not enabled:
            raise APIError(403, "lifecycle controls over HTTP need the server's --api-key")
        try:
            ack = await call(**kw)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        except ControlError as e:
            status = _CONTROL_STATUS.get(str(e.code), 500)
            raise APIError(status, e.text, code=str(e.code)) from None
        return {"state": str(ack.state), "weight_version": ack.weight_version}

    async def body_of(request: Request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw) if raw.strip() else {}
        except ValueError:
            raise APIError(400, "the body is not JSON") from None
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object")
        return body

    def keys(body: dict, allowed: tuple[str, ...]) -> dict:
        unknown = sorted(set(body) - set(allowed))
        if unknown:
            raise APIError(400, f"unknown field(s) {unknown}; allowed: {list(allowed)}", unknown[0])
        return body

    @app.post("/pause")
    async def pause(request: Request):
        body = keys(await body_of(request), ("mode", "clear_cache", "timeout"))
        if not isinstance(body.get("clear_cache", False), bool | None):
            raise APIError(400, "clear_cache must be true or false", "clear_cache")
        timeout = body.get("timeout")
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, int | float)
        ):
            raise APIError(400, "timeout must be a number of seconds", "timeout")
        return await run(client.pause, **{k: v for k, v in body.items() if v is not None})

    @app.post("/unpause")
    async def unpause():
        return await run(client.unpause)

    @app.post("/suspend")
    async def suspend(request: Request):
        return await run(client.suspend, **keys(await body_of(request), ("mode",)))

    @app.post("/resume")
    async def resume():
        return await run(client.resume)

    @app.post("/update_weights")
    async def update_weights(request: Request):
        body = _draft_checked(keys(await body_of(request), ("path", "weight_version", "draft")))
        if not body.get("path"):
            raise APIError(400, "update_weights over HTTP takes a checkpoint path", "path")
        return await run(client.update_weights, **body)

    @app.post("/init_weight_transfer")
    async def init_weight_transfer(request: Request):
        allowed = ("master_address", "master_port", "world_size", "rank_offset", "backend")
        return await run(client.init_weight_transfer, **keys(await body_of(request), allowed))

    @app.post("/update_weights_from_distributed")
    async def update_from_distributed(request: Request):
        allowed = ("buckets", "weight_version", "stage", "draft")
        body = _draft_checked(keys(await body_of(request), allowed))
        try:
            buckets = [[(t["name"], t["dtype"], t["shape"]) for t in b] for b in body["buckets"]]
        except (KeyError, TypeError):
            raise APIError(
                400, "buckets: a list of lists of {name, dtype, shape} objects", "buckets"
            ) from None
        body["buckets"] = buckets
        return await run(client.update_weights_from_distributed, **body)

    @app.post("/update_weights_from_ipc")
    async def update_from_ipc(request: Request):
        allowed = ("tensors", "weight_version", "stage", "draft")
        body = _draft_checked(keys(await body_of(request), allowed))
        try:
            body["tensors"] = [_ipc_record(t) for t in body["tensors"]]
        except (KeyError, TypeError, ValueError) as e:
            fields = ", ".join(IpcTensor.__dataclass_fields__)
            raise APIError(
                400, f"tensors: a list of {{{fields}}} objects, bytes as base64 ({e})", "tensors"
            ) from None
        return await run(client.update_weights_from_ipc, **body)

    @app.post("/close_weight_transfer")
    async def close_weight_transfer():
        return await run(client.close_weight_transfer)

    @app.post("/flush_cache")  # (SGLang's path; vLLM's is /reset_prefix_cache)
    async def flush_cache():
        return await run(client.flush_cache)


def _draft_checked(body: dict) -> dict:
    """A weight update's body whose `draft` (the draft model's weights), when given, is a
    boolean."""
    if not isinstance(body.get("draft", False), bool):
        raise APIError(400, "draft must be true or false", "draft")
    return body


def _ipc_record(fields: dict) -> dict:
    """An IPC record as JSON (an object of IpcTensor's fields, its bytes base64) -> the fields
    the client takes (it checks their types)."""
    if not isinstance(fields, dict):
        raise TypeError(f"a record is an object, not {type(fields).__name__}")
    out = dict(fields)
    for name in _IPC_BYTES:
        if out.get(name) is not None:
            try:
                out[name] = base64.b64decode(out[name], validate=True)
            except (binascii.Error, TypeError, ValueError):
                raise ValueError(f"{name} is not base64") from None
    return out


def add_routes(app: FastAPI, server: ResponsesServer) -> None:
    """Register every endpoint on `app`, each answering from `server` and its client."""
    client, metrics = server.client, server.metrics

    @app.get("/health")
    async def health():
        """200 while the runtime answers (a stats round trip within 5 s), else 503."""
        try:
            await asyncio.wait_for(client.stats(), 5.0)
        except Exception as e:  # unreachable, closed, timed out: all mean "not healthy"
            return JSONResponse({"status": "unavailable", "reason": str(e)}, status_code=503)
        return {"status": "ok"}

    def model_card() -> dict:
        return {
            "id": server.model,
            "object": "model",
            "created": server.created,
            "owned_by": "taipan",
            "root": client.model,
            "parent": None,
            "max_model_len": client.info.max_sequence_length,
        }

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != server.model:
            raise APIError(
                404, f"the model {model_id!r} does not exist", "model", "model_not_found"
            )
        return model_card()

    # vLLM's tokenizer endpoints (lm-eval's "remote" tokenizer backend uses them, so that it
    # needs no tokenizer files of its own).
    @app.get("/tokenizer_info")
    async def tokenizer_info():
        tok = client.tokenizer
        eos = tok.eos_token_ids[0] if tok.eos_token_ids else None
        return {
            "tokenizer_class": "taipan",
            "eos_token": None if eos is None else tok.id_to_token(eos),
            "bos_token": None if tok.bos_token_id is None else tok.id_to_token(tok.bos_token_id),
            "pad_token": None,
            "chat_template": server.template_of(),
            "model_max_length": client.info.max_sequence_length,
        }

    @app.post("/tokenize")
    async def tokenize(body: TokenizeBody):
        """vLLM's: a prompt (special tokens added by default), or chat messages through the
        template (none added by default); `return_token_strs` adds the vocabulary pieces."""
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", "prompt")
        tok = client.tokenizer
        if body.prompt is not None:
            add = True if body.add_special_tokens is None else body.add_special_tokens
            ids = tok.encode(body.prompt, add_special_tokens=add)
        else:
            ids = server.chat_prompt(
                body.messages,
                body.tools,
                add_generation_prompt=generation_prompt(body),
                continue_final_message=body.continue_final_message,
                add_special_tokens=bool(body.add_special_tokens),
                chat_template_kwargs=body.chat_template_kwargs,
                chat_template=body.chat_template,
            )
        strs = [tok.id_to_token(t) for t in ids] if body.return_token_strs else None
        limit = client.info.max_sequence_length
        return {"count": len(ids), "max_model_len": limit, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeBody):
        vocab = client.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"token ids must lie in [0, {vocab})", "tokens")
        return {"prompt": client.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.get("/metrics")
    async def metrics_():
        """The metrics, with the runtime's gauges read fresh (a stats round trip within 5 s);
        503 while the runtime does not answer, so that a scrape marks it down."""
        try:
            body = await asyncio.wait_for(metrics.render(client), 5.0)
        except Exception as e:  # unreachable, closed, timed out: no fresh gauges to give
            text = f"the runtime does not answer: {e}\n"
            return Response(text, status_code=503, media_type="text/plain")
        return Response(body, media_type=prom.CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        return await server.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: Request):
        return await server.chat(body, request)

    @app.post("/v1/responses")
    async def responses(body: ResponsesBody, request: Request):
        return await server.responses(body, request)

    @app.get("/v1/responses/{response_id}")
    async def stored_response(response_id: str):
        return server.stored_response(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        return server.delete_response(response_id)

    @app.post("/invocations")
    async def invocations(request: Request):
        """SageMaker's entry point (as vLLM serves it): a chat body (it has `messages`) or a
        completion body (`prompt`), answered as its endpoint answers it."""
        try:
            raw = json.loads(await request.body())
        except ValueError:
            raise APIError(400, "the body is not JSON") from None
        if not isinstance(raw, dict) or not ({"messages", "prompt"} & set(raw)):
            raise APIError(400, "/invocations takes a chat (messages) or completion (prompt) body")
        kind = ChatBody if "messages" in raw else CompletionBody
        try:
            body = kind.model_validate(raw)
        except ValidationError as e:
            raise RequestValidationError(e.errors()) from None
        if isinstance(body, ChatBody):
            return await server.chat(body, request)
        return await server.completions(body, request)
