"""Server-sent events and the asyncio plumbing of one HTTP request's choices.

`merge` runs a request's choices concurrently and yields their chunks as they come;
`held_stream` wraps an SSE generator into a response that ends with an OpenAI error event if the
runtime fails mid-stream and calls `release` however the stream ends; `until_disconnected`
cancels a request's choices (the AsyncClient then aborts them) when the HTTP client hangs up.

Knows nothing of completion or chat fields (beyond OpenAI's error event), the bounded queue's
counts or the metrics: callers pass in what to run and what to release.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from taipan.server.schemas import APIError


def sse(obj: dict) -> str:
    """One server-sent event carrying `obj` as compact JSON."""
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class Done:
    """The end of a merge: every producer's return value, in producer order."""

    def __init__(self, results: list) -> None:
        self.results = results


async def merge(args: list[tuple], producer) -> AsyncGenerator[Any, None]:
    """Run `producer(*a, put)` for each a concurrently and yield what they put, as it comes;
    then a Done with their results. A producer's exception is raised here; leaving early
    (the HTTP client went away) cancels them all, which aborts their requests."""
    queue: asyncio.Queue = asyncio.Queue()

    async def put(_key, item) -> None:
        await queue.put(item)

    tasks = [asyncio.ensure_future(producer(*a, put)) for a in args]
    finished = asyncio.ensure_future(asyncio.gather(*tasks))
    getter = None
    try:
        while True:
            getter = asyncio.ensure_future(queue.get())
            done, _ = await asyncio.wait({getter, finished}, return_when=asyncio.FIRST_COMPLETED)
            if getter in done:
                yield getter.result()
                continue
            getter.cancel()
            while not queue.empty():
                yield queue.get_nowait()
            yield Done(finished.result())  # raises a producer's exception
            return
    finally:
        # Cancel and await everything (a gather or queue read left behind would be logged as
        # an exception never retrieved or a task destroyed while pending).
        pending = [*tasks, finished, *([getter] if getter is not None else [])]
        for t in pending:
            t.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*pending, return_exceptions=True)


async def _guard(events: AsyncGenerator[str, None]) -> AsyncIterator[str]:
    """A stream that fails after its 200 went out ends with an OpenAI error event. Closing
    this closes `events` at once (so its requests are aborted then, not when collected)."""
    try:
        async with contextlib.aclosing(events):
            async for e in events:
                yield e
    except APIError as e:
        yield sse({"error": {"message": e.message, "type": "server_error", "code": e.code}})
        yield "data: [DONE]\n\n"
    except Exception as e:  # the runtime went away mid-stream: say so, then end the stream
        yield sse({"error": {"message": f"{type(e).__name__}: {e}", "type": "server_error"}})
        yield "data: [DONE]\n\n"


class _HeldStream(StreamingResponse):
    """A streamed answer that gives its slots of the bounded queue back when it ends, however
    it ends: finished, failed, cancelled, or the client gone (then starlette leaves the body
    iterator open, so it is closed here first: its requests are aborted before the release)."""

    def __init__(self, content: AsyncGenerator[str, None], release) -> None:
        super().__init__(content, media_type="text/event-stream")
        self._release = release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()
            finally:
                self._release()


async def until_disconnected(request: Request, coros: list) -> list:
    """Await the coroutines together; if the HTTP client disconnects first, cancel them (the
    AsyncClient aborts each request it stops listening to) and raise CancelledError."""
    work = asyncio.ensure_future(asyncio.gather(*coros))
    try:
        while True:
            done, _ = await asyncio.wait({work}, timeout=0.25)
            if done:
                return work.result()
            if await request.is_disconnected():
                work.cancel()
                with contextlib.suppress(BaseException):
                    await work
                raise asyncio.CancelledError("the HTTP client disconnected")
    finally:
        if not work.done():
            work.cancel()


def held_stream(
    events: AsyncGenerator[str, None], release: Callable[[], None]
) -> StreamingResponse:
    """The SSE response of `events` that calls `release` once it has ended, however it ends."""
    return _HeldStream(_guard(events), release=release)
