"""The OpenAI-compatible HTTP front end (DESIGN.md §11): the `http` actor's process.

A FastAPI app over one connected `AsyncClient`; never imports torch. Its parts, each importing
only those listed before it:
  schemas      OpenAI's error shape, the request bodies, body -> SamplingParams
  admission    the bounded queue (--max-queued, --queue-timeout; 503 with Retry-After)
  metrics      the Prometheus registry behind GET /metrics
  streaming    server-sent events; a request's choices run together, aborted on disconnect
  completions  OpenAIServer: POST /v1/completions and /v1/chat/completions
  generate     POST /generate: token ids in and out, for HTTP-driven trainers (with --api-key)
  routes       the route table and the small endpoints (health, models, tokenizer)
  app          build_app, serve (in the caller's loop), http_main (the `http` process)

This module only re-exports what callers use; it holds no logic.
"""

from taipan.server.admission import DEFAULT_MAX_QUEUED, DEFAULT_QUEUE_TIMEOUT_S, Admission
from taipan.server.app import build_app, http_main, serve
from taipan.server.schemas import APIError

__all__ = [
    "DEFAULT_MAX_QUEUED",
    "DEFAULT_QUEUE_TIMEOUT_S",
    "APIError",
    "Admission",
    "build_app",
    "http_main",
    "serve",
]
