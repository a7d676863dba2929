"""The OpenAI-compatible HTTP front end (DESIGN.md §11): the `http` actor's process.

A FastAPI app over one connected `AsyncClient`; never imports torch. Its parts, each importing
only those listed before it:
  options      ServerOptions: server-wide rendering and usage choices (taipan serve's flags)
  schemas      OpenAI's error shape, the lenient request bodies, results -> OpenAI's fields
  params       body -> SamplingParams (controls, structured outputs, seeds)
  logprobs     tokens as the API shows them (exact bytes), log-prob fields and text offsets
  tools        tool calls: the tools in the prompt, the model's calls parsed (Hermes, Llama 3)
  response_store  the Responses API's stored responses: a bounded LRU in this process's memory
  admission    the bounded queue (--max-queued, --queue-timeout; 503 with Retry-After)
  metrics      the Prometheus registry behind GET /metrics (vLLM's names mapped)
  streaming    server-sent events; a request's choices run together, aborted on disconnect
  completions  OpenAIServer: what the endpoints share, and POST /v1/completions
  generate     POST /generate: token ids in and out, for HTTP-driven trainers (with --api-key)
  chat         ChatServer: the chat prompt, POST /v1/chat/completions (tools included)
  responses    ResponsesServer: POST /v1/responses (the text and function-tool subset), its
               stored responses (previous_response_id, GET / DELETE /v1/responses/{id})
  routes       the route table and the small endpoints (health, models, tokenizer)
  app          build_app, serve (in the caller's loop), http_main (the `http` process)

This module only re-exports what callers use; it holds no logic.
"""

from taipan.server.admission import DEFAULT_MAX_QUEUED, DEFAULT_QUEUE_TIMEOUT_S, Admission
from taipan.server.app import build_app, http_main, serve
from taipan.server.options import ServerOptions
from taipan.server.schemas import APIError

__all__ = [
    "DEFAULT_MAX_QUEUED",
    "DEFAULT_QUEUE_TIMEOUT_S",
    "APIError",
    "Admission",
    "ServerOptions",
    "build_app",
    "http_main",
    "serve",
]
