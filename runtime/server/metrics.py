"""The HTTP server's Prometheus metrics (`GET /metrics`), one registry per app.

Counts what the handlers report (a `RequestTimer` per choice: its tokens, finish reason and
timings), reads the bounded queue's counters at scrape time, and fetches the runtime's gauges
through `client.stats()` when rendered. It only observes: it never admits, refuses or aborts
anything.

What a vLLM dashboard reads, under taipan's names (vLLM's in brackets):

  taipan_prompt_tokens_total                  [vllm:prompt_tokens_total]
  taipan_generation_tokens_total              [vllm:generation_tokens_total]
  taipan_request_success_total{finished_reason}  [vllm:request_success_total]
  taipan_request_prompt_tokens                [vllm:request_prompt_tokens] (histogram)
  taipan_request_generation_tokens            [vllm:request_generation_tokens] (histogram)
  taipan_time_to_first_token_seconds          [vllm:time_to_first_token_seconds]
  taipan_time_per_output_token_seconds        [vllm:time_per_output_token_seconds, the newer
                                               vllm:inter_token_latency_seconds]: one
                                               observation per output token after the first
  taipan_e2e_request_latency_seconds          [vllm:e2e_request_latency_seconds]
  taipan_request_queue_time_seconds           [vllm:request_queue_time_seconds]
  taipan_request_prefill_time_seconds         [vllm:request_prefill_time_seconds]
  taipan_request_decode_time_seconds          [vllm:request_decode_time_seconds]
  taipan_requests_running                     [vllm:num_requests_running]
  taipan_requests_waiting                     [vllm:num_requests_waiting]
  taipan_kv_cache_usage_perc                  [vllm:kv_cache_usage_perc] (0..1)
  taipan_prefix_cache_queries_total           [vllm:prefix_cache_queries] (prompt tokens)
  taipan_prefix_cache_hits_total              [vllm:prefix_cache_hits] (of those, cached)
  taipan_prefix_cache_hit_rate                [vllm:gpu_prefix_cache_hit_rate, older vLLMs]
  taipan_spec_decode_num_drafts_total         [vllm:spec_decode_num_drafts] (verify rows)
  taipan_spec_decode_num_draft_tokens_total   [vllm:spec_decode_num_draft_tokens]
  taipan_spec_decode_num_accepted_tokens_total [vllm:spec_decode_num_accepted_tokens]
  taipan_spec_decode_num_accepted_tokens_per_pos_total{position}
                                              [vllm:spec_decode_num_accepted_tokens_per_pos]
  taipan_spec_decode_backoffs_total           (ours: requests that stopped speculating a while)
  taipan_spec_decode_draft_disabled_total     (ours: ranks whose draft an update disabled)
  taipan_spec_decode_chains_total             (ours: steps whose verify steps the gpu chained)
  taipan_spec_decode_batch_off_steps_total    (ours: steps too large a batch kept plain)
  taipan_structured_void_rows_total           (ours: rows a grammar check's fix voided)

TTFT, queue and prefill time come from the engine's clock (the request's events); end-to-end
latency is the server's (from submission to the last token). Time per output token: a streamed
choice observes the gap between its deltas, shared by the delta's tokens; a non-streamed one has
only its mean gap (the engine's tpot), observed once per token after the first.
"""

from __future__ import annotations

import time

import prometheus_client as prom
from prometheus_client.core import CounterMetricFamily

from taipan.client import AsyncClient, Completion, Delta
from taipan.messages.requests import EventType, FinishReason
from taipan.server.admission import Admission
from taipan.server.schemas import openai_finish

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_PER_TOKEN = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5)
_TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)


class _RuntimeCounters:
    """The runtime's cumulative counters (since start), as Prometheus counters: the values of
    the last `client.stats()` a scrape fetched. Prefix caching (vLLM's prefix_cache_queries /
    hits), speculative decoding (vLLM's spec_decode_num_drafts, _num_draft_tokens,
    _num_accepted_tokens and _num_accepted_tokens_per_pos, by `position`) and preemptions
    (vLLM's num_preemptions: evictions, whose KV is recomputed; pauses keep theirs)."""

    HELP = {
        "prefix_cache_queries": "Prompt tokens looked up in the prefix cache",
        "prefix_cache_hits": "Prompt tokens served from the prefix cache",
        "spec_decode_num_drafts": "Rows that verified speculative drafts",
        "spec_decode_num_draft_tokens": "Draft tokens proposed",
        "spec_decode_num_accepted_tokens": "Draft tokens accepted",
        "spec_decode_backoffs": "Times a request stopped speculating, its drafts gaining nothing",
        "spec_decode_draft_disabled": "Ranks whose draft model a weight update disabled",
        "spec_decode_chains": "Steps whose verify steps the gpu chained (speculative_chain_steps)",
        "spec_decode_batch_off_steps": "Steps planned without speculation for their batch size "
        "(speculative_disable_by_batch_size)",
        "structured_void_rows": "Decode rows voided by a grammar check that replaced their "
        "input token (each a step lost by its request)",
        "num_preemptions": "Requests evicted for KV room (their KV dropped, recomputed later)",
        "pauses": "Times a running request paused for KV room (its KV kept)",
    }

    def __init__(self) -> None:
        self.values = dict.fromkeys(self.HELP, 0)
        self.per_position: tuple[int, ...] = ()

    def update(self, merged) -> None:
        self.values.update(
            prefix_cache_queries=merged.prefix_prompt_tokens,
            prefix_cache_hits=merged.prefix_cached_tokens,
            spec_decode_num_drafts=merged.spec_verify_rows,
            spec_decode_num_draft_tokens=merged.spec_draft_tokens,
            spec_decode_num_accepted_tokens=merged.spec_accepted_tokens,
            spec_decode_backoffs=merged.spec_backoffs,
            spec_decode_draft_disabled=merged.spec_draft_disabled,
            spec_decode_chains=merged.spec_chains,
            spec_decode_batch_off_steps=merged.spec_batch_off_steps,
            structured_void_rows=merged.grammar_void_rows,
            num_preemptions=merged.evicted_total,
            pauses=merged.paused_total,
        )
        self.per_position = tuple(merged.spec_accepted_per_position)

    def collect(self):
        for name, help_ in self.HELP.items():
            family = CounterMetricFamily(f"taipan_{name}", help_)
            family.add_metric([], self.values[name])
            yield family
        family = CounterMetricFamily(
            "taipan_spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position",
            labels=["position"],
        )
        for j, n in enumerate(self.per_position):
            family.add_metric([str(j)], n)
        yield family


class Metrics:
    """The server's Prometheus metrics (one registry per app): see the module docstring."""

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
        self.http_errors = prom.Counter(
            "taipan_http_errors", "Refused or failed HTTP requests", ["status"], registry=r
        )
        self.success = prom.Counter(
            "taipan_request_success",
            "Finished requests (choices) by finish reason",
            ["finished_reason"],
            registry=r,
        )
        self.prompt_tokens = prom.Counter(
            "taipan_prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.generation_tokens = prom.Counter(
            "taipan_generation_tokens", "Tokens generated by finished requests", registry=r
        )
        hist = {
            "request_prompt_tokens": ("Prompt tokens per request", _TOKENS),
            "request_generation_tokens": ("Generated tokens per request", _TOKENS),
            "time_to_first_token_seconds": ("Time to first token", _LATENCY),
            "time_per_output_token_seconds": ("Gap before each output token after the first",
                                              _PER_TOKEN),
            "e2e_request_latency_seconds": ("Submission to last token, seen by the server",
                                            _LATENCY),
            "request_queue_time_seconds": ("Time waiting in the engine before running", _LATENCY),
            "request_prefill_time_seconds": ("Time from running to the first token", _LATENCY),
            "request_decode_time_seconds": ("Time from the first token to the last", _LATENCY),
        }  # fmt: skip
        self.hist = {
            name: prom.Histogram(f"taipan_{name}", help_, buckets=buckets, registry=r)
            for name, (help_, buckets) in hist.items()
        }
        self.gauges = {
            name: prom.Gauge(f"taipan_{name}", help_, registry=r)
            for name, help_ in (
                ("requests_running", "Requests running on the engines"),
                ("requests_waiting", "Requests waiting to be admitted"),
                ("requests_paused", "Requests paused (their KV kept)"),
                ("kv_blocks_used", "KV cache blocks in use"),
                ("kv_blocks_total", "KV cache blocks"),
                ("kv_cache_usage_perc", "KV cache blocks in use, share (0..1)"),
                ("local_kv_blocks_used", "Windowed layers' own KV blocks in use (rings)"),
                ("local_kv_blocks_total", "Windowed layers' own KV blocks (0: one pool)"),
                ("prefix_cache_hit_rate", "Prompt tokens taken from the prefix cache, share"),
                ("engine_ranks_alive", "Engine ranks serving (a dead one is routed around)"),
            )
        }
        self._counters = _RuntimeCounters()
        r.register(self._counters)

    def timer(self) -> RequestTimer:
        """A timer for one choice, started now (at its submission)."""
        return RequestTimer(self)

    async def render(self, client: AsyncClient) -> bytes:
        stats = await client.stats()
        merged = stats.merged()  # every rank's counters summed
        values = {
            "requests_running": merged.running,
            "requests_waiting": merged.waiting,
            "requests_paused": merged.paused,
            "kv_blocks_used": merged.blocks_used,
            "kv_blocks_total": merged.num_blocks,
            "kv_cache_usage_perc": merged.blocks_used / merged.num_blocks
            if merged.num_blocks
            else 0.0,
            "local_kv_blocks_used": merged.local_blocks_used,
            "local_kv_blocks_total": merged.num_local_blocks,
            "prefix_cache_hit_rate": merged.prefix_hit_rate,
            "engine_ranks_alive": sum(r.alive for r in stats.ranks),
        }
        for name, value in values.items():
            self.gauges[name].set(value)
        self._counters.update(merged)
        return prom.generate_latest(self.registry)


class RequestTimer:
    """What one choice reports: `tokens(n)` as a streamed delta of n tokens arrives, then
    `finish(...)` once, with its last Completion or Delta."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.start = time.monotonic()
        self._last: float | None = None  # when the previous streamed tokens arrived
        self._streamed = 0  # tokens observed through `tokens`

    def tokens(self, n: int) -> None:
        now = time.monotonic()
        if n <= 0:
            return
        if self._last is not None:  # the first token's gap is TTFT, not a per-token time
            gap = (now - self._last) / n
            for _ in range(n):
                self.metrics.hist["time_per_output_token_seconds"].observe(gap)
        self._last = now
        self._streamed += n

    def finish(self, c: Completion | Delta, prompt_tokens: int, generated: int) -> None:
        m = self.metrics
        m.success.labels(finished_reason=openai_finish(c.finish_reason) or "unknown").inc()
        m.prompt_tokens.inc(prompt_tokens)
        m.generation_tokens.inc(generated)
        m.hist["request_prompt_tokens"].observe(prompt_tokens)
        m.hist["request_generation_tokens"].observe(generated)
        m.hist["e2e_request_latency_seconds"].observe(time.monotonic() - self.start)
        if c.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
            return
        if c.ttft is not None:
            m.hist["time_to_first_token_seconds"].observe(c.ttft)
        queue = _queue_time(c)
        if queue is not None:
            m.hist["request_queue_time_seconds"].observe(queue)
            if c.ttft is not None:
                m.hist["request_prefill_time_seconds"].observe(max(0.0, c.ttft - queue))
        if c.tpot is not None and generated > 1:
            m.hist["request_decode_time_seconds"].observe(c.tpot * (generated - 1))
            if not self._streamed:  # not streamed: the mean gap, once per token
                for _ in range(generated - 1):
                    m.hist["time_per_output_token_seconds"].observe(c.tpot)
        elif generated == 1:
            m.hist["request_decode_time_seconds"].observe(0.0)


def _queue_time(c: Completion | Delta) -> float | None:
    """From the request's arrival at an engine to its first admission (its events)."""
    arrived = admitted = None
    for e in c.events:
        if e.type == EventType.ADD_ENGINE and arrived is None:
            arrived = e.timestamp
        elif e.type == EventType.ADD_CONTEXT and admitted is None:
            admitted = e.timestamp
    if arrived is None or admitted is None:
        return None
    return max(0.0, admitted - arrived)
