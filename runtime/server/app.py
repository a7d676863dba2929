"""Build the OpenAI-compatible app and serve it: what the CLI, `AsyncLLM.serve` and tests call.

`build_app(client, ...)` wires one connected `AsyncClient` to a FastAPI app: the bounded queue,
the metrics, OpenAI-shaped error handlers and the `--api-key` check, then the route table.
`serve(...)` runs it under uvicorn in the caller's event loop (`AsyncLLM.serve`); `http_main(spec)`
is the `http` process of `taipan serve --http-port`. Never imports torch: a tokenizer, msgpack
and sockets only.

No endpoint logic lives here (taipan.server.routes, .completions, .chat, .responses and
.generate hold it).
"""

from __future__ import annotations

import asyncio
import contextlib

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from taipan.auth import curve_keys
from taipan.client import AsyncClient
from taipan.server.admission import DEFAULT_MAX_QUEUED, DEFAULT_QUEUE_TIMEOUT_S, Admission
from taipan.server.generate import GENERATE_PATH, add_generate_route
from taipan.server.metrics import Metrics
from taipan.server.options import ServerOptions
from taipan.server.responses import ResponsesServer
from taipan.server.routes import CONTROL_PATHS, add_control_routes, add_routes
from taipan.server.schemas import APIError

# The paths behind --api-key.
GUARDED = (
    "/v1/", "/tokenize", "/detokenize", "/tokenizer_info", "/invocations", GENERATE_PATH,
    *CONTROL_PATHS,
)  # fmt: skip


class _KeyCheck:
    """`--api-key`: a 401 for a GUARDED path without `Authorization: Bearer KEY`, before the
    body is read. Plain ASGI (not BaseHTTPMiddleware, which hides a client's disconnect from
    `request.is_disconnected()`, and so from the aborts)."""

    def __init__(self, app, key: str, metrics: Metrics) -> None:
        self.app, self.expected, self.metrics = app, f"Bearer {key}".encode(), metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(GUARDED):
            if dict(scope["headers"]).get(b"authorization") != self.expected:
                self.metrics.http_errors.labels(status="401").inc()
                error = APIError(401, "a valid API key is required (Authorization: Bearer)")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(
    client: AsyncClient,
    *,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_queued: int = DEFAULT_MAX_QUEUED,
    queue_timeout: float = DEFAULT_QUEUE_TIMEOUT_S,
    options: ServerOptions | None = None,
) -> FastAPI:
    """The OpenAI-compatible app over a connected client; at most `max_queued` choices in
    flight, a request waiting up to `queue_timeout` seconds for room (see .admission);
    `options`: the server-wide rendering and usage choices (.options)."""
    admission = Admission(max_queued, queue_timeout)
    metrics = Metrics(admission)
    server = ResponsesServer(
        client, served_model_name or client.model, metrics, admission, options or ServerOptions()
    )
    app = FastAPI(title="taipan", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server

    @app.exception_handler(APIError)
    async def _api_error(_request, e: APIError):
        metrics.http_errors.labels(status=str(e.status)).inc()
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request, e: StarletteHTTPException):
        # FastAPI's own refusals (a body it cannot parse, an unknown path or method).
        metrics.http_errors.labels(status=str(e.status_code)).inc()
        return APIError(e.status_code, str(e.detail)).response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request, e: RequestValidationError):
        parts = []
        param = None
        for err in e.errors()[:5]:
            loc = [str(x) for x in err.get("loc", ()) if x != "body"]
            param = param or (loc[0] if loc else None)
            # (the error's type too: vLLM's clients look for e.g. "less_than_equal")
            parts.append(f"{'.'.join(loc) or 'body'}: {err.get('msg')} [{err.get('type')}]")
        metrics.http_errors.labels(status="400").inc()
        return APIError(400, "; ".join(parts) or "invalid request body", param).response()

    if api_key is not None:
        app.add_middleware(_KeyCheck, key=api_key, metrics=metrics)
    add_routes(app, server)
    add_control_routes(app, client, enabled=api_key is not None)
    add_generate_route(app, client, admission, metrics, enabled=api_key is not None)
    return app


async def serve(
    client: AsyncClient,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_queued: int = DEFAULT_MAX_QUEUED,
    queue_timeout: float = DEFAULT_QUEUE_TIMEOUT_S,
    options: ServerOptions | None = None,
    log_level: str = "warning",
    started: asyncio.Event | None = None,
) -> None:
    """Serve the app on host:port in the running event loop until cancelled."""
    import uvicorn

    app = build_app(
        client,
        served_model_name=served_model_name,
        api_key=api_key,
        max_queued=max_queued,
        queue_timeout=queue_timeout,
        options=options,
    )
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off")
    server = uvicorn.Server(config)
    server.install_signal_handlers = lambda: None  # the process owner decides about signals
    task = asyncio.ensure_future(server.serve())
    try:
        while not server.started and not task.done():
            await asyncio.sleep(0.02)
        if task.done():
            task.result()  # e.g. the port is taken
            raise OSError(f"the HTTP server on {host}:{port} stopped at start")
        if started is not None:
            started.set()
        await task
    finally:
        server.should_exit = True
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(task, 5)


async def http_main(spec: dict) -> None:
    """The `http` process: connect to the runtime's frontend and serve until the runtime (or
    SIGTERM) ends it."""
    http = spec["http"]
    queue = {k: http[k] for k in ("max_queued", "queue_timeout") if http.get(k) is not None}
    keys = curve_keys(spec["frontend"], spec.get("keys_dir"), server=False)
    client = AsyncClient(spec["frontend"], curve=keys)
    await client.connect()
    try:
        await serve(
            client,
            http["host"],
            http["port"],
            served_model_name=http.get("served_model_name"),
            api_key=http.get("api_key"),
            options=ServerOptions.of(http),
            log_level=http.get("log_level") or "warning",
            **queue,
        )
    finally:
        await client.close()
