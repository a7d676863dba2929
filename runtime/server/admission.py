"""The HTTP server's bounded queue: how many choices may be in flight through it at once.

A request holds one slot per prompt and choice from admission until its response ends, however
it ends. One that finds no room waits up to `queue_timeout` seconds, first come first served,
then gets a 503 with `Retry-After`; one that could never fit is a 400 at once.

Owns only its counters and its waiters; it never talks to the runtime, and the caller (the
request handlers) owns releasing what it acquired. Metrics read it, never change it.
"""

from __future__ import annotations

import asyncio
import collections
import math

from taipan.server.schemas import APIError

DEFAULT_MAX_QUEUED = 1024  # choices in flight through the server (`--max-queued`)
DEFAULT_QUEUE_TIMEOUT_S = 10.0  # how long a request waits for room (`--queue-timeout`)
RETRY_AFTER_S = 1  # a refused request's Retry-After: room comes back as requests end


class Admission:
    """At most `max_queued` choices in flight through the server. `acquire(k)` takes k slots,
    waiting first come first served (a large request at the head is not overtaken) up to
    `timeout` seconds (0: not at all), else raises a 503 with Retry-After; k above the bound is
    a 400 at once. The caller owns `release(k)` once the response has ended, however it ended.
    One event loop's state: no locks."""

    def __init__(self, max_queued: int, timeout: float) -> None:
        if max_queued < 1:
            raise ValueError(f"max_queued must be >= 1, got {max_queued}")
        if not 0 <= timeout < math.inf:
            raise ValueError(f"queue_timeout must be finite seconds >= 0, got {timeout}")
        self.limit, self.timeout = max_queued, timeout
        self.in_flight = 0  # slots held by admitted requests
        self._waiters: collections.deque[tuple[int, asyncio.Future]] = collections.deque()

    @property
    def waiting(self) -> int:
        """Choices of the requests waiting for room."""
        return sum(k for k, _ in self._waiters)

    async def acquire(self, k: int) -> None:
        if k > self.limit:
            raise APIError(
                400,
                f"this request has {k} choices (prompts x n), more than the server holds in "
                f"flight ({self.limit}, --max-queued); send fewer prompts or a smaller n",
                "n",
            )
        if not self._waiters and self.in_flight + k <= self.limit:
            self.in_flight += k
            return
        if self.timeout == 0:
            raise self._busy()
        entry = (k, asyncio.get_running_loop().create_future())
        self._waiters.append(entry)
        try:
            await asyncio.wait_for(asyncio.shield(entry[1]), self.timeout)
        except BaseException as e:  # timed out, or the caller was cancelled (client gone)
            if entry[1].done():  # room came as the wait ended: the slots are held
                if isinstance(e, TimeoutError):
                    return
                self.release(k)
                raise
            entry[1].cancel()
            self._waiters.remove(entry)
            self._admit_waiters()  # a large request that leaves may make room for the next
            if isinstance(e, TimeoutError):
                raise self._busy() from None
            raise

    def release(self, k: int) -> None:
        self.in_flight -= k
        self._admit_waiters()

    def _admit_waiters(self) -> None:
        while self._waiters and self.in_flight + self._waiters[0][0] <= self.limit:
            k, future = self._waiters.popleft()
            self.in_flight += k
            future.set_result(None)

    def _busy(self) -> APIError:
        return APIError(
            503,
            f"the server is at capacity ({self.limit} choices in flight, --max-queued) and "
            f"no room came within {self.timeout:g} s (--queue-timeout); retry later",
            code="server_overloaded",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
