"""The route table: every path the server answers, and the small handlers inline.

`GET /health`, `GET /v1/models`, `GET /metrics` (Prometheus), vLLM's `GET /tokenizer_info`,
`POST /tokenize` and `POST /detokenize` (lm-eval's remote tokenizer), and the generating
`POST /v1/completions` and `POST /v1/chat/completions`, which call `OpenAIServer`.

Registers routes only: error handlers, the API key check and serving belong to the app module.
"""

from __future__ import annotations

import asyncio

import prometheus_client as prom
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from taipan.server.completions import OpenAIServer
from taipan.server.schemas import (
    APIError,
    ChatBody,
    CompletionBody,
    DetokenizeBody,
    TokenizeBody,
    message_dict,
)


def add_routes(app: FastAPI, server: OpenAIServer) -> None:
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

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": server.model,
                    "object": "model",
                    "created": server.created,
                    "owned_by": "taipan",
                    "max_model_len": client.info.max_sequence_length,
                }
            ],
        }

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
            "chat_template": tok.chat_template,
            "model_max_length": client.info.max_sequence_length,
        }

    @app.post("/tokenize")
    async def tokenize(body: TokenizeBody):
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", "prompt")
        tok = client.tokenizer
        if body.prompt is not None:
            ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            messages = [message_dict(m) for m in body.messages]
            try:
                ids = tok.apply_chat_template(messages, body.add_generation_prompt)
            except Exception as e:  # a template that refuses these messages
                raise APIError(400, f"the chat template refused the messages: {e}") from e
        limit = client.info.max_sequence_length
        return {"tokens": ids, "count": len(ids), "max_model_len": limit}

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
