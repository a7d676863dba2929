"""The processes of the `relay` bench (taipan.bench.relay starts them):
`python -m taipan.bench.relay_peers coordinator|engine|client SPEC_JSON [INDEX]`.

`coordinator`: the real one, through runtime/procs.py's own entry point (SPEC's `coordinator`
is its LaunchSpec); with SPEC's `profile` set, under cProfile, its stats written there when it
exits (SIGTERM).
`engine`: a synthetic engine rank (`SyntheticEngine`): registers and answers as a real rank
does, streams `expected_token`s, never computes. `client`: the real client actor
(`CountingClient`) submitting its share of the requests and checking every token (`client_main`).

Every result goes to stdout as one line `RELAY {json}`; logs go to stderr. Never imports torch
or the engine actor: the wire, the actor framework and the client actor, and (the coordinator
role only) runtime/procs.py.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import os
import signal
import sys
import time

import msgpack
import numpy as np
import zmq
import zmq.asyncio

from taipan.actors.base import Actor
from taipan.actors.channel import Channel, Envelope, make_socket
from taipan.actors.client.actor import ClientActor
from taipan.actors.log import configure
from taipan.messages.codec import encode_frame
from taipan.messages.common import ErrorReply, Heartbeat, Hello
from taipan.messages.gpu import ModelLoaded
from taipan.messages.lifecycle import LifecycleState, Stop, StopAck
from taipan.messages.requests import (
    AbortRequest,
    EngineSubmit,
    EventType,
    FinishReason,
    RequestEvent,
    RequestOutput,
    SamplingParams,
    StepOutputs,
)
from taipan.messages.stats import GetStats, RankStats, Stats

TOKEN_MASK = 0x7FFF  # synthetic token ids stay below 32768 (any vocabulary's size here)
HEARTBEAT_S = 1.0
# Steps back to back stay close behind the coordinator: a Heartbeat after every PROBE_STEPS steps
# (the coordinator answers each, in order with the engine's other messages), and no step while
# MAX_PROBES_AHEAD of them are unanswered.
PROBE_STEPS = 8
MAX_PROBES_AHEAD = 4
BLOCK_SIZE = 256
NUM_BLOCKS = 1 << 16


def expected_token(prompt_first: int, i: int) -> int:
    """Token i of a request whose prompt starts with `prompt_first`."""
    return (prompt_first + i) & TOKEN_MASK


def result(**fields) -> None:
    print("RELAY " + json.dumps(fields), flush=True)


# --- the synthetic engine ------------------------------------------------------------------------


class TokenFrames:
    """One-token, non-final RequestOutput frames, byte for byte what `encode_frame` gives: the
    frame of a sample output, unpacked once, is repacked with the fields that change."""

    def __init__(self):
        sample = RequestOutput(1, np.zeros(1, np.int32), False, None, None, 1, 1)
        self.wire = msgpack.unpackb(encode_frame(sample), raw=False, use_list=True)
        self.tokens: dict[int, msgpack.ExtType] = {}
        self.ext_type = self.wire[3]  # new_token_ids: ExtType(code, [dtype, shape, bytes])

    def frame(self, request_id: int, token: int, num_prompt: int, num_generated: int) -> bytes:
        ext = self.tokens.get(token)
        if ext is None:
            body = msgpack.packb(["int32", [1], np.int32(token).tobytes()], use_bin_type=True)
            ext = self.tokens[token] = msgpack.ExtType(self.ext_type.code, body)
        wire = self.wire
        wire[2], wire[3], wire[7], wire[8] = request_id, ext, num_prompt, num_generated
        return msgpack.packb(wire, use_bin_type=True)


@dataclasses.dataclass
class SyntheticRequest:
    request_id: int
    first: int  # the prompt's first token: the tokens follow from it
    num_prompt: int
    max_tokens: int
    stream: bool
    arrival: float
    generated: int = 0
    streamed: int = 0  # tokens already sent
    first_token_time: float = 0.0


class SyntheticEngine(Actor):
    """A synthetic engine rank. It registers as a real rank does (Hello, ModelLoaded, a Heartbeat
    every second, over a DEALER with an engine's identity) and answers EngineSubmit,
    AbortRequest, GetStats and Stop with the real messages; it never computes. Each step it gives
    every running request (up to `batch`, admitted in arrival order) its next token and reports
    the step in one StepOutputs, as the real engine does (actors/engine/actor.py `_emit`): a
    streaming request gets a one-token output every step, a non-streaming one a single output at
    its end. Steps come `steps_per_s` a second, or back to back as fast as the coordinator takes
    them: a Heartbeat after every few steps, which the coordinator answers in order with the
    rest, keeps an engine at most a few dozen steps ahead of it (else thousands of steps would
    queue in its sockets and the coordinator would read them late). Token i of a request is
    `expected_token(prompt, i)`, so the client can check every token and its order. A non-final
    one-token output is encoded from a template (`TokenFrames`: the same bytes `encode_frame`
    writes, at a tenth of its cost, so that eight synthetic engines leave the cores to the
    coordinator); terminal outputs go through `encode_frame`."""

    def __init__(self, rank: int, coord: Channel, batch: int, steps_per_s: float):
        super().__init__(f"engine-{rank}")
        self.rank, self.coord = rank, coord
        self.batch, self.steps_per_s = batch, steps_per_s
        self.waiting: collections.deque[SyntheticRequest] = collections.deque()
        self.running: dict[int, SyntheticRequest] = {}
        self.aborted: list[SyntheticRequest] = []
        self.work = asyncio.Event()
        self.answered = asyncio.Event()  # a probe was answered
        self.frames = TokenFrames()
        self.counts = collections.Counter()
        self.serve(coord)
        for msg_type, handler in [
            (EngineSubmit, self.on_submit),
            (AbortRequest, self.on_abort),
            (GetStats, self.on_get_stats),
            (Stop, self.on_stop),
            (Heartbeat, self.on_heartbeat),
            (ErrorReply, self.on_error),
        ]:
            self.on(msg_type, handler)

    async def started(self) -> None:
        await self.coord.send(Hello("engine", self.rank))
        fields = dict(
            model="synthetic",
            num_blocks=NUM_BLOCKS,
            block_size=BLOCK_SIZE,
            vocab_size=TOKEN_MASK + 1,
            max_position_embeddings=1 << 20,
            tokenizer="{}",  # the bench client never detokenizes
            eos_token_ids=(),
            block_bytes=1,
        )
        await self.coord.send(ModelLoaded(**fields))
        self.spawn(self._heartbeat())
        self.spawn(self._step_loop())

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            await self.coord.send(Heartbeat(time.time()))
            self.counts["heartbeats"] += 1

    async def on_submit(self, env: Envelope, msg: EngineSubmit) -> None:
        self.counts["submits"] += 1
        prompt = msg.prompt_token_ids
        req = SyntheticRequest(
            msg.request_id,
            int(prompt[0]),
            len(prompt),
            msg.sampling.max_tokens,
            msg.stream,
            env.time,
        )
        self.waiting.append(req)
        self.work.set()

    async def on_abort(self, env: Envelope, msg: AbortRequest) -> None:
        req = self.running.pop(msg.request_id, None)
        if req is None:
            req = next((r for r in self.waiting if r.request_id == msg.request_id), None)
            if req is None:
                return
            self.waiting.remove(req)
        self.counts["aborts"] += 1
        self.aborted.append(req)
        self.work.set()

    async def on_get_stats(self, env: Envelope, msg: GetStats) -> None:
        counts = dict(step=self.counts["steps"], running=len(self.running))
        counts.update(waiting=len(self.waiting), num_blocks=NUM_BLOCKS, blocks_free=NUM_BLOCKS)
        zeros = ("paused", "blocks_used", "paused_total", "evicted_total", "weight_version")
        rank = RankStats(
            self.rank,
            LifecycleState.RUNNING,
            **counts,
            **dict.fromkeys(zeros, 0),
            tokens_last_step=len(self.running),
        )
        await env.reply(Stats(LifecycleState.RUNNING, (rank,)))

    async def on_stop(self, env: Envelope, msg: Stop) -> None:
        ended = [*self.running.values(), *self.waiting, *self.aborted]
        self.running.clear()
        self.waiting.clear()
        self.aborted.clear()
        if ended:
            now = time.time()
            frames = [self._final(r, FinishReason.ABORT, now) for r in ended]
            await self._send([r.request_id for r in ended], [True] * len(ended), frames)
        await self.coord.send(StopAck(self.name))
        self.stop()

    async def on_heartbeat(self, env: Envelope, msg: Heartbeat) -> None:
        self.counts["heartbeats_answered"] += 1
        self.answered.set()

    async def on_error(self, env: Envelope, msg: ErrorReply) -> None:
        self.log.warning("error reply", code=msg.code, text=msg.text)

    async def _step_loop(self) -> None:
        period = 1.0 / self.steps_per_s if self.steps_per_s > 0 else 0.0
        due = time.monotonic()
        steps = 0
        while True:
            if not (self.running or self.waiting or self.aborted):
                self.work.clear()
                await self.work.wait()
                due = time.monotonic()
            while self.waiting and len(self.running) < self.batch:
                req = self.waiting.popleft()
                self.running[req.request_id] = req
            await self._step(time.time())
            steps += 1
            if steps % PROBE_STEPS == 0:
                await self._probe()
            if period:
                due += period
                await asyncio.sleep(max(0.0, due - time.monotonic()))
            else:
                await asyncio.sleep(0)  # let submissions and aborts in between steps

    async def _probe(self) -> None:
        """Send a probe; wait while too many are unanswered (the coordinator is behind)."""
        await self.coord.send(Heartbeat(time.time()))
        self.counts["heartbeats"] += 1
        while self.counts["heartbeats"] - self.counts["heartbeats_answered"] > MAX_PROBES_AHEAD:
            self.answered.clear()
            await self.answered.wait()

    async def _step(self, now: float) -> None:
        """One step: the next token of every running request, in one StepOutputs."""
        ids, finished, frames = [], [], []
        step = list(self.running.values())
        self.counts["tokens"] += len(step)
        for req in step:
            token = expected_token(req.first, req.generated)
            req.generated += 1
            if req.generated == 1:
                req.first_token_time = now
            if req.generated >= req.max_tokens:
                del self.running[req.request_id]
                frames.append(self._final(req, FinishReason.LENGTH, now))
            elif req.stream:
                req.streamed = req.generated
                frames.append(
                    self.frames.frame(req.request_id, token, req.num_prompt, req.generated)
                )
            else:
                continue
            ids.append(req.request_id)
            finished.append(req.request_id not in self.running)
        aborted, self.aborted = self.aborted, []
        for req in aborted:
            ids.append(req.request_id)
            finished.append(True)
            frames.append(self._final(req, FinishReason.ABORT, now))
        if frames:
            await self._send(ids, finished, frames)

    async def _send(self, ids: list[int], finished: list[bool], frames: list[bytes]) -> None:
        msg = StepOutputs(np.array(ids, np.int64), np.array(finished, np.bool_), tuple(frames))
        await self.coord.send(msg)
        self.counts["steps"] += 1
        self.counts["entries"] += len(frames)

    def _final(self, req: SyntheticRequest, reason: FinishReason, now: float) -> bytes:
        """The request's terminal output, encoded as the real engine's `output_of` builds it."""
        n = req.generated
        tokens = [expected_token(req.first, i) for i in range(req.streamed, n)]
        req.streamed = n
        events = (
            RequestEvent(EventType.ADD_ENGINE, req.arrival, None),
            RequestEvent(EventType.ADD_CONTEXT, req.first_token_time or now, None),
            RequestEvent(EventType.FINISH, now, None),
        )
        first = req.first_token_time or now
        stale = np.zeros(req.num_prompt + n, np.int32)  # no weight update here
        out = RequestOutput(
            req.request_id,
            np.array(tokens, np.int32),
            True,
            reason,
            None,
            req.num_prompt,
            n,
            events=events,
            ttft=first - req.arrival,
            tpot=(now - first) / max(1, n - 1),
            policy_staleness=stale,
            kv_cache_staleness=stale,
        )
        return encode_frame(out)


async def engine_main(spec: dict, rank: int) -> None:
    ctx = zmq.asyncio.Context()
    identity = f"engine-{rank}-{os.getpid()}".encode()  # as a real rank names itself
    coord = make_socket(
        ctx, zmq.DEALER, spec["backend"], bind=False, name="coordinator", identity=identity
    )
    engine = SyntheticEngine(rank, coord, spec["batch"], spec["steps_per_s"])
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, engine.stop)
    try:
        await engine.run()
    finally:
        coord.close()
        ctx.term()
    result(role="engine", rank=rank, **engine.counts)


# --- the client ----------------------------------------------------------------------------------


class CountingClient(ClientActor):
    """The real client actor, counting every message it receives by type."""

    def __init__(self, channel: Channel, *, address: str, timeout: float):
        super().__init__(channel, address=address, timeout=timeout)
        self.received: collections.Counter[str] = collections.Counter()

    async def dispatch(self, env: Envelope) -> None:
        self.received[type(env.msg).__name__] += 1
        await super().dispatch(env)


def prompt_of(client: int, j: int, length: int) -> np.ndarray:
    """Request j of client `client`: its first token picks its synthetic tokens."""
    prompt = np.full(length, 7, np.int32)
    prompt[0] = (client * 7919 + j * 13) & TOKEN_MASK
    return prompt


async def _one(actor: ClientActor, prompt: np.ndarray, sampling: SamplingParams, stream: bool):
    """Submit one request and take every output of it; (problem or None, tokens, outputs)."""
    _, queue = await actor.submit(prompt, sampling, stream)
    tokens: list[int] = []
    outputs = 0
    while True:
        out = await queue.get()
        outputs += 1
        tokens.extend(out.new_token_ids.tolist())
        if out.finished:
            break
    n = sampling.max_tokens
    want = [expected_token(int(prompt[0]), i) for i in range(n)]
    problem = None
    if out.finish_reason != FinishReason.LENGTH:
        problem = f"finish_reason {out.finish_reason} ({out.error})"
    elif tokens != want or out.num_generated_tokens != n:
        problem = f"{len(tokens)} tokens (wanted {n}) or not the engine's, in order"
    return problem, len(tokens), outputs


async def client_main(spec: dict, index: int) -> None:
    """The real client actor on one DEALER, counting what it receives. It prints "ready" once the
    runtime answers ModelInfo, waits for a line on stdin, submits its share of the requests at
    once, consumes every output of each in its own task (as `AsyncClient.generate` does), checks
    them, and prints its result."""
    ctx = zmq.asyncio.Context()
    ctx.setsockopt(zmq.RCVHWM, 0)  # as AsyncClient does (runtime/client.py)
    chan = make_socket(ctx, zmq.DEALER, spec["frontend"], bind=False, name="coordinator")
    actor = CountingClient(chan, address=spec["frontend"], timeout=spec["timeout"])
    task = asyncio.create_task(actor.run())  # owned here; awaited below
    try:
        await asyncio.wait_for(actor.model_info(), spec["timeout"])
        result(role="client", ready=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        sampling = SamplingParams(max_tokens=spec["output_len"], temperature=0.0, ignore_eos=True)
        prompts = [prompt_of(index, j, spec["prompt_len"]) for j in range(spec["requests"][index])]
        cpu, start = os.times(), time.time()
        done = await asyncio.gather(*(_one(actor, p, sampling, spec["stream"]) for p in prompts))
        end, cpu_end = time.time(), os.times()
        problems = [p for p, _, _ in done if p is not None]
        result(
            role="client",
            index=index,
            start=start,
            end=end,
            cpu_seconds=(cpu_end.user + cpu_end.system) - (cpu.user + cpu.system),
            requests=len(done),
            failed=len(problems),
            problems=problems[:3],
            tokens=sum(n for _, n, _ in done),
            outputs=sum(k for _, _, k in done),
            received=dict(actor.received),
        )
    finally:
        actor.stop()
        await task
        chan.close()
        ctx.term()


# --- entry points --------------------------------------------------------------------------------


def coordinator_main(spec_json: str) -> None:
    """The real coordinator process (runtime/procs.py), under cProfile when SPEC says where."""
    from taipan import procs

    spec = json.loads(spec_json)
    launch, path = json.dumps(spec["coordinator"]), spec["profile"]
    if not path:
        procs.main(["coordinator", launch])
        return
    import cProfile

    profile = cProfile.Profile()
    profile.enable()
    try:
        procs.main(["coordinator", launch])
    finally:
        profile.disable()
        profile.dump_stats(path)


def main(argv: list[str]) -> None:
    role = argv[0]
    if role == "coordinator":
        coordinator_main(argv[1])
        return
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    spec = json.loads(argv[1])
    configure(spec.get("log_level"))
    import uvloop

    if role == "engine":
        uvloop.run(engine_main(spec, int(argv[2])))
    elif role == "client":
        uvloop.run(client_main(spec, int(argv[2])))
    else:
        raise SystemExit(f"unknown role {role!r}")


def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: the bench's own cleanup still stops us
        pass


if __name__ == "__main__":
    main(sys.argv[1:])
