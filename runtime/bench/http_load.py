"""The `http-load` workload of `taipan bench`: one runtime with the OpenAI server in its own
process; `--num-prompts` streaming completions of `mixed_prompts` (greedy, EOS ignored,
`--output-len` tokens) sent at once over HTTP, a seeded `--drop-share` of them dropped by their
client (the connection closed) after `--drop-after` text chunks; then the same load through
`AsyncClient` on the same runtime (a drop leaves `stream` early). A dropped request asks for the
whole context, so only its abort lets the engine go idle soon after. Per side: completed
requests a second, p50/p99 TTFT, and the invariants (`_violations`: no 5xx, nothing failed,
every other request complete, the engine idle with its KV blocks back and at most
`--output-len` steps run after the last completion, the server's queue empty); a broken one is
named on stderr, the row says `invariants_hold` false and the run exits 1. tests/perf/NOTES.md
defines every figure.

HTTP/1.1 over asyncio streams here (httpx is a dev dependency only). Never imports torch itself
(the GPU's name comes from taipan.ops.hardware, imported inside `http_load_workload`).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import json
import socket
import sys
import time

import numpy as np

from taipan.bench.common import mixed_prompts, rounded

IDLE_TIMEOUT_S = 60.0  # after the load, how long the engine may take to be idle again


@dataclasses.dataclass
class Job:
    prompt: str
    max_tokens: int
    drop: bool


@dataclasses.dataclass
class Outcome:
    """One request's fate, on either side: dropped (its client hung up as planned), completed
    (all its tokens, finish reason "length"), or failed (`error` says why)."""

    dropped: bool = False
    completed: bool = False
    ttft: float | None = None  # seconds from sending to the first non-empty text
    status: int | None = None  # HTTP only
    error: str | None = None


# --- a minimal HTTP/1.1 client: one POST, its server-sent events ---------------------------------


class _Connection:
    """One request on its own connection (`Connection: close`), reading a chunked SSE body."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.chunked = False
        self._buffer = b""
        self._eof = False

    @classmethod
    async def request(cls, host: str, port: int, method: str, path: str, body: bytes = b""):
        """Send the request and read the status line and headers; (connection, status)."""
        reader, writer = await asyncio.open_connection(host, port)
        conn = cls(reader, writer)
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        writer.write(head.encode() + body)
        await writer.drain()
        status = int((await reader.readline()).split()[1])
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            if name.strip().lower() == "transfer-encoding" and "chunked" in value.lower():
                conn.chunked = True
        return conn, status

    async def _more(self) -> bool:
        """Read the next piece of the body into the buffer; False at its end."""
        if self._eof:
            return False
        if not self.chunked:
            data = await self.reader.read(65536)
        else:
            size = int((await self.reader.readline()).split(b";")[0].strip() or b"0", 16)
            data = await self.reader.readexactly(size + 2)  # the chunk and its CRLF
            data = data[:-2]
        self._eof = not data
        self._buffer += data
        return bool(data)

    async def body(self) -> bytes:
        while await self._more():
            pass
        return self._buffer

    async def next_event(self) -> str | None:
        """The next event's `data:` text, or None at the end of the stream."""
        while b"\n\n" not in self._buffer:
            if not await self._more():
                return None
        event, self._buffer = self._buffer.split(b"\n\n", 1)
        lines = event.decode().splitlines()
        return "\n".join(line[6:] for line in lines if line.startswith("data: "))

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(OSError):
            await self.writer.wait_closed()


async def _http_one(host: str, port: int, body: dict, job: Job, drop_after: int) -> Outcome:
    out, start = Outcome(), time.perf_counter()
    conn, out.status = await _Connection.request(
        host, port, "POST", "/v1/completions", json.dumps(body).encode()
    )
    try:
        if out.status != 200:
            out.error = f"HTTP {out.status}: {(await conn.body())[:300]!r}"
            return out
        chunks, tokens, finish = 0, None, None
        while (data := await conn.next_event()) not in (None, "[DONE]"):
            event = json.loads(data)
            if "error" in event:
                out.error = f"error event: {event['error']}"
                return out
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            for choice in event["choices"]:
                finish = choice.get("finish_reason") or finish
                if choice["text"]:
                    chunks += 1
                    out.ttft = out.ttft or time.perf_counter() - start
            if job.drop and chunks >= drop_after:
                out.dropped = True  # hang up: the connection closes below
                return out
        _judge(out, job, data == "[DONE]", finish == "length", tokens)
        return out
    finally:
        await conn.close()


async def _server_in_flight(host: str, port: int) -> float:
    """The server's `taipan_http_in_flight` (its bounded queue, runtime/server/admission.py)."""
    conn, status = await _Connection.request(host, port, "GET", "/metrics")
    try:
        text = (await conn.body()).decode()
    finally:
        await conn.close()
    for line in text.splitlines():
        if line.startswith("taipan_http_in_flight "):
            return float(line.split()[1])
    raise RuntimeError(f"/metrics (HTTP {status}) has no taipan_http_in_flight")


def _judge(out: Outcome, job: Job, ended: bool, length: bool, tokens: int | None) -> None:
    """A request that ran to its end: complete, or failed saying why."""
    if job.drop:
        out.error = "a request to drop ended before its client could hang up"
    elif not (ended and length and tokens == job.max_tokens):
        out.error = f"incomplete: ended {ended}, finish length {length}, {tokens} tokens"
    else:
        out.completed = True


# --- the Client side ---------------------------------------------------------------------------


async def _client_one(client, job: Job, drop_after: int) -> Outcome:
    from taipan.messages.requests import FinishReason, SamplingParams

    out, start = Outcome(), time.perf_counter()
    sampling = SamplingParams(max_tokens=job.max_tokens, temperature=0.0, ignore_eos=True)
    chunks, tokens, finish = 0, 0, None
    async with contextlib.aclosing(client.stream(job.prompt, sampling)) as deltas:
        async for d in deltas:
            tokens += len(d.token_ids)
            if d.text:
                chunks += 1
                out.ttft = out.ttft or time.perf_counter() - start
            if d.finished:
                finish = d.finish_reason
                if finish in (FinishReason.ERROR, FinishReason.ABORT):
                    out.error = f"finished {finish}: {d.error}"
                    return out
            if job.drop and chunks >= drop_after:
                out.dropped = True  # leaving the stream aborts the request
                return out
    _judge(out, job, finish is not None, finish == FinishReason.LENGTH, tokens)
    return out


# --- the load, on either side ------------------------------------------------------------------


async def _engine(client) -> dict:
    rank = (await client.stats()).merged()  # every rank's counters summed
    return {
        "busy": rank.running + rank.waiting,
        "blocks_free": rank.blocks_free + rank.blocks_evictable,
        "steps": rank.steps_total,
    }


async def _idle(client, blocks: int | None) -> tuple[dict, float]:
    """(engine figures, seconds waited) once nothing runs or waits and, when given, `blocks`
    are free again; TimeoutError after IDLE_TIMEOUT_S."""
    start = time.perf_counter()
    while True:
        now = await _engine(client)
        if not now["busy"] and blocks in (None, now["blocks_free"]):
            return now, time.perf_counter() - start
        if time.perf_counter() - start > IDLE_TIMEOUT_S:
            raise TimeoutError(
                f"the engine was not idle {IDLE_TIMEOUT_S:g} s after the load: {now}"
            )
        await asyncio.sleep(0.05)


async def _load(client, jobs: list[Job], one) -> dict:
    """Run every job at once through `one(job)`; the side's figures (NOTES.md)."""

    async def safe(job: Job) -> Outcome:
        try:
            return await one(job)
        except Exception as e:  # a refused connection, a cut stream: a failure, with its reason
            return Outcome(error=f"{type(e).__name__}: {e}")

    before, _ = await _idle(client, None)
    start = time.perf_counter()
    async with asyncio.TaskGroup() as tg:
        tasks = [tg.create_task(safe(job)) for job in jobs]
    seconds = time.perf_counter() - start
    end = await _engine(client)
    outcomes = [t.result() for t in tasks]
    try:
        after, idle_s = await _idle(client, before["blocks_free"])
    except TimeoutError as e:
        print(f"taipan bench: http-load: {e}", file=sys.stderr)
        after, idle_s = await _engine(client), None
    ttft = np.array([o.ttft for o in outcomes if o.ttft is not None], dtype=np.float64)
    completed = sum(o.completed for o in outcomes)
    errors = [o.error for o in outcomes if o.error]
    return {
        "seconds": seconds,
        "requests_s": completed / seconds,
        "ttft_p50_s": float(np.percentile(ttft, 50)) if ttft.size else None,
        "ttft_p99_s": float(np.percentile(ttft, 99)) if ttft.size else None,
        "completed": completed,
        "dropped": sum(o.dropped for o in outcomes),
        "failed": len(errors),
        "5xx": sum(o.status is not None and o.status >= 500 for o in outcomes),
        "first_error": errors[0][:300] if errors else None,
        "blocks_free_before": before["blocks_free"],
        "blocks_free_after": after["blocks_free"],
        "steps_after_load": after["steps"] - end["steps"],
        "idle_after_s": idle_s,
    }


def _violations(side: str, f: dict, jobs: list[Job], output_len: int) -> list[str]:
    drops = sum(j.drop for j in jobs)
    checks = {
        f"{f['5xx']} responses were 5xx": f["5xx"] == 0,
        f"{f['failed']} requests failed (first: {f['first_error']})": f["failed"] == 0,
        f"{f['completed']} of {len(jobs) - drops} requests completed": f["completed"]
        == len(jobs) - drops,
        f"{f['dropped']} of {drops} requests were dropped": f["dropped"] == drops,
        f"KV blocks free {f['blocks_free_before']} before, {f['blocks_free_after']} after "
        f"(the engine idle after {f['idle_after_s']} s)": f["idle_after_s"] is not None
        and f["blocks_free_after"] == f["blocks_free_before"],
        f"the engine ran {f['steps_after_load']} steps after the last completion (an unaborted "
        f"drop would run to the end of its context)": f["steps_after_load"] <= output_len,
    }
    if "in_flight_after" in f:
        checks[f"the server still holds {f['in_flight_after']} choices"] = not f["in_flight_after"]
    return [f"{side}: {what}" for what, ok in checks.items() if not ok]


# --- the workload ------------------------------------------------------------------------------


def _jobs(client, n: int, output_len: int, drop_share: float, seed: int) -> list[Job]:
    """n jobs of `mixed_prompts`; a seeded `drop_share` of them are to be dropped, and ask for
    the rest of the context."""
    prompts = mixed_prompts(n)
    drops = set(np.random.default_rng([seed, 4]).permutation(n)[: round(drop_share * n)].tolist())
    limit = client.info.max_sequence_length
    jobs = []
    for i, prompt in enumerate(prompts):
        length = len(client.tokenizer.encode(prompt))
        if length + output_len > limit:
            raise ValueError(
                f"prompt {i} ({length} tokens) + --output-len {output_len} exceed "
                f"max_sequence_length ({limit}); lower --output-len or --set max_sequence_length"
            )
        jobs.append(Job(prompt, limit - length if i in drops else output_len, i in drops))
    return jobs


async def _both_sides(rt, args) -> tuple[dict, dict, list[Job]]:
    from taipan.client import AsyncClient

    host, port, model = rt.http["host"], rt.http["port"], rt.http["served_model_name"]

    def body(job: Job) -> dict:
        return {"model": model, "prompt": job.prompt, "max_tokens": job.max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip

    async with AsyncClient(rt.address) as stats, AsyncClient(rt.address) as client:
        jobs = _jobs(stats, args.num_prompts, args.output_len, args.drop_share, args.seed)
        warm = [Job(j.prompt, 2, False) for j in jobs[:4]]  # both paths, a few tokens, untimed
        await _load(stats, warm, lambda j: _http_one(host, port, body(j), j, args.drop_after))
        await _load(stats, warm, lambda j: _client_one(client, j, args.drop_after))
        http = await _load(
            stats, jobs, lambda j: _http_one(host, port, body(j), j, args.drop_after)
        )
        http["in_flight_after"] = await _server_in_flight(host, port)
        ours = await _load(stats, jobs, lambda j: _client_one(client, j, args.drop_after))
    return http, ours, jobs


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _check_args(args) -> None:
    args.output_len = args.output_len or 64
    args.num_prompts = 200 if args.num_prompts is None else args.num_prompts
    if args.num_prompts < 1 or args.output_len < 1 or args.drop_after < 1:
        raise ValueError("--num-prompts, --output-len and --drop-after must be >= 1")
    if not 0 <= args.drop_share < 1:
        raise ValueError(f"--drop-share must be in [0, 1), got {args.drop_share}")


def http_load_workload(args) -> list[dict]:
    from taipan.launcher import runtime_from_args
    from taipan.models import resolve
    from taipan.ops.hardware import gpu_name
    from taipan.server import DEFAULT_MAX_QUEUED

    _check_args(args)
    name, _ = resolve(args.model)
    served = copy.copy(args)
    served.http_host = "127.0.0.1"
    served.http_port = _free_port(served.http_host)
    served.max_queued = max(DEFAULT_MAX_QUEUED, args.num_prompts)  # the queue is not measured
    with runtime_from_args(served) as rt:
        http, ours, jobs = asyncio.run(_both_sides(rt, args))
    violations = _violations("http", http, jobs, args.output_len)
    violations += _violations("client", ours, jobs, args.output_len)
    for v in violations:
        print(f"taipan bench: FAILED: http-load {v}", file=sys.stderr)
    row = {
        "workload": "http-load",
        "model": name,
        "gpu": gpu_name(args.device),
        "dtype": args.dtype,
        "device": args.device,
        "num_requests": args.num_prompts,
        "drop_share": args.drop_share,
        "drop_after": args.drop_after,
        "dropped_requests": sum(j.drop for j in jobs),
        "output_len": args.output_len,
        "prompts": f"mixed_prompts, {args.num_prompts} (10-150 tokens)",
        "max_queued": served.max_queued,
        **{f"http_{k}": v for k, v in http.items()},
        **{f"client_{k}": v for k, v in ours.items() if k != "5xx"},
        "http_vs_client_requests_s": _ratio(http["requests_s"], ours["requests_s"]),
        "http_vs_client_ttft_p50": _ratio(http["ttft_p50_s"], ours["ttft_p50_s"]),
        "invariants_hold": not violations,
        "violations": violations,
    }
    return [rounded(row)]


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def http_load_summary(row: dict) -> str:
    def side(s: str) -> str:
        return (
            f"{row[f'{s}_requests_s']} req/s, TTFT p50 {row[f'{s}_ttft_p50_s']} s p99 "
            f"{row[f'{s}_ttft_p99_s']} s, {row[f'{s}_completed']} completed, "
            f"{row[f'{s}_dropped']} dropped, {row[f'{s}_failed']} failed, blocks "
            f"{row[f'{s}_blocks_free_before']} -> {row[f'{s}_blocks_free_after']}"
        )

    return (
        f"http-load {row['num_requests']} streams x {row['output_len']} tokens, "
        f"{row['dropped_requests']} dropped after {row['drop_after']} chunks: HTTP {side('http')}, "
        f"{row['http_5xx']} 5xx; Client {side('client')}; invariants hold: "
        f"{row['invariants_hold']}"
    )
