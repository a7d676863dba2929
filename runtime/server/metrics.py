"""The HTTP server's Prometheus metrics (`GET /metrics`), one registry per app.

Counts what the handlers report (finished requests, TTFT and TPOT, refusals and errors), reads
the bounded queue's counters at scrape time, and fetches the runtime's gauges through
`client.stats()` when rendered. It only observes: it never admits, refuses or aborts anything.
"""

from __future__ import annotations

import prometheus_client as prom

from taipan.client import AsyncClient
from taipan.messages.requests import FinishReason
from taipan.server.admission import Admission
from taipan.server.schemas import openai_finish


class Metrics:
    """The server's Prometheus metrics (one registry per app): requests by finish reason,
    TTFT and TPOT histograms, the bounded queue (choices in flight and waiting, requests
    refused), and at scrape time the runtime's gauges from `client.stats()`."""

    def __init__(self, admission: Admission) -> None:
        self.registry = prom.CollectorRegistry()
        r = self.registry
        queue = (
            ("http_in_flight", "Choices admitted by the HTTP server, not yet ended", "in_flight"),
            ("http_waiting", "Choices of HTTP requests waiting for room", "waiting"),
            ("http_max_queued", "The bound on choices in flight (--max-queued)", "limit"),
        )
        for name, help_, attr in queue:
            gauge = prom.Gauge(f"taipan_{name}", help_, registry=r)
            gauge.set_function(lambda attr=attr: getattr(admission, attr))
        self.refused = prom.Counter(
            "taipan_http_refused",
            "HTTP requests refused for want of room within --queue-timeout (503)",
            registry=r,
        )
        self.requests = prom.Counter(
            "taipan_requests", "Finished requests by finish reason", ["finish_reason"], registry=r
        )
        buckets = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        self.ttft = prom.Histogram(
            "taipan_time_to_first_token_seconds", "Time to first token", buckets=buckets, registry=r
        )
        self.tpot = prom.Histogram(
            "taipan_time_per_output_token_seconds",
            "Time per output token after the first",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
            registry=r,
        )
        self.http_errors = prom.Counter(
            "taipan_http_errors", "Refused or failed HTTP requests", ["status"], registry=r
        )
        self.gauges = {
            name: prom.Gauge(f"taipan_{name}", help_, registry=r)
            for name, help_ in (
                ("requests_running", "Requests running on the engines"),
                ("requests_waiting", "Requests waiting to be admitted"),
                ("requests_paused", "Requests paused (their KV kept)"),
                ("kv_blocks_used", "KV cache blocks in use"),
                ("kv_blocks_total", "KV cache blocks"),
                ("prefix_cache_hit_rate", "Prompt tokens taken from the prefix cache, share"),
                ("engine_ranks_alive", "Engine ranks serving (a dead one is routed around)"),
            )
        }

    def observe(self, reason: FinishReason | None, ttft: float | None, tpot: float | None):
        self.requests.labels(finish_reason=openai_finish(reason) or "unknown").inc()
        if ttft is not None:
            self.ttft.observe(ttft)
        if tpot is not None:
            self.tpot.observe(tpot)

    async def render(self, client: AsyncClient) -> bytes:
        stats = await client.stats()
        merged = stats.merged()  # every rank's counters summed
        values = {
            "requests_running": merged.running,
            "requests_waiting": merged.waiting,
            "requests_paused": merged.paused,
            "kv_blocks_used": merged.blocks_used,
            "kv_blocks_total": merged.num_blocks,
            "prefix_cache_hit_rate": merged.prefix_hit_rate,
            "engine_ranks_alive": sum(r.alive for r in stats.ranks),
        }
        for name, value in values.items():
            self.gauges[name].set(value)
        return prom.generate_latest(self.registry)
