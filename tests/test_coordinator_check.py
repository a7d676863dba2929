"""The coordinator's replay checker (actors/coordinator/check.py, `taipan replay --check`).

Fed logs written the way the live coordinator writes them (messages encoded and decoded by the
codec, a batch of arrivals recorded before their outcomes), it re-routes every submission:
by prefix (two ranks, one holding the prompt's blocks), round robin, after a rank is declared
dead (the record-only RankGone), and with a stale hash salt; it names the first EngineSubmit
that a tampered log sends elsewhere. Then a live coordinator with a recorder declares a silent
engine dead, and a real runtime with prefix caching records a session: both check "ok".
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import json

import numpy as np
import pytest
import zmq
import zmq.asyncio

from taipan.actors.channel import make_socket
from taipan.actors.config import InferenceConfig, plan_limits, routing_policy
from taipan.actors.coordinator.actor import CoordinatorActor
from taipan.actors.coordinator.check import CLIENTS, ENGINES, CoordinatorReplay
from taipan.actors.record import Recorder, read_log
from taipan.client import Client
from taipan.launcher import Runtime
from taipan.messages.block_hash import block_hashes
from taipan.messages.codec import decode, encode
from taipan.messages.common import Hello, RankGone
from taipan.messages.gpu import ModelLoaded
from taipan.messages.lifecycle import ControlAck
from taipan.messages.requests import (
    EngineSubmit,
    FinishReason,
    GetModelInfo,
    RequestOutput,
    SamplingParams,
    StepOutputs,
    SubmitRequest,
)
from taipan.messages.stats import PrefixEvents
from taipan.replay import main as replay_main
from tests.conftest import TEST_CONFIG
from tests.test_coordinator_actor import ScriptedEngine, receive

BS = 4  # block size of the simulated engines
E0, E1, CLIENT = b"engine-0", b"engine-1", b"client-a"
LOADED = ModelLoaded("m", 64, BS, 100, 512, "{}", (2,), 1024)
GREEDY = SamplingParams(max_tokens=4, temperature=0.0)
PREFIX = dict(policy="longest_prefix", alpha=0.5, capacity=4, prefix_caching=True)
ROUND_ROBIN = dict(policy="round_robin", alpha=0.5, capacity=4, prefix_caching=False)


class Log:
    """A coordinator log in the making: (direction, channel, peer, msg, time) records."""

    def __init__(self, ranks=(E0, E1)):
        self.records: list[tuple] = []
        self.time = 100.0
        for rank, engine in enumerate(ranks):
            self.arrive(ENGINES, engine, Hello("engine", rank))
            self.arrive(ENGINES, engine, LOADED)

    def arrive(self, channel: str, peer: bytes | None, msg) -> float:
        self.time += 0.25
        self.records.append(("in", channel, peer, msg, self.time))
        return self.time

    def send(self, channel: str, peer: bytes | None, msg) -> None:
        self.records.append(("out", channel, peer, msg, self.time))

    def submit(self, rid: int, prompt, *, salt: int = 0, hashed: bool = True) -> SubmitRequest:
        """A client's submission; with `hashed`, its block hashes as the client computes them."""
        prompt = np.asarray(prompt, np.int32)
        hashes = block_hashes(prompt, BS, salt) if hashed else np.zeros(0, np.int64)
        msg = SubmitRequest(rid, prompt, GREEDY, False, hashes, salt)
        return msg, self.arrive(CLIENTS, CLIENT, msg)

    def route(self, sub, arrived: float, gid: int, engine: bytes, salt: int | None = None):
        """The coordinator's EngineSubmit for `sub` (re-hashed with `salt` when given)."""
        hashes, salt_sent = sub.block_hashes, sub.hash_salt
        if salt is not None:
            hashes, salt_sent = block_hashes(sub.prompt_token_ids, BS, salt), salt
        out = EngineSubmit(
            gid, sub.prompt_token_ids, sub.sampling, False, arrived, hashes, salt_sent
        )
        self.send(ENGINES, engine, out)

    def finish(self, engine: bytes, gid: int) -> None:
        out = RequestOutput(gid, np.array([7], np.int32), True, FinishReason.LENGTH, None, 8, 1)
        self.arrive(ENGINES, engine, StepOutputs.of([out]))


def check(records, settings=PREFIX) -> tuple[str | None, CoordinatorReplay]:
    replay = CoordinatorReplay(**settings)
    for direction, channel, peer, msg, time in records:
        frames = tuple(bytes(f) for f in encode(msg))
        msg = decode(frames)  # as check_coordinator hands them over: decoded from the log
        if direction == "in":
            what = replay.inbound(channel, peer, msg, time)
        else:
            what = replay.outbound(channel, peer, msg, frames)
        if what is not None:
            return what, replay
    return None, replay


PROMPT = list(range(10, 19))  # 9 tokens: two complete blocks of 4


def prefix_log(engine_of_second: bytes = E1) -> Log:
    """Rank 1 holds the prompt's two blocks (its PrefixEvents); rank 0 holds nothing. The first
    request scores 0.5 * 2/2 + 0.5 * free on rank 1 against 0.5 * free on rank 0: rank 1; so
    does the second, sent in the same batch (arrivals recorded before their outcomes)."""
    log = Log()
    hashes = block_hashes(np.asarray(PROMPT, np.int32), BS, 0)
    log.arrive(ENGINES, E1, PrefixEvents(hashes, np.zeros(0, np.int64)))
    sub1, t1 = log.submit(1, PROMPT)
    sub2, t2 = log.submit(2, PROMPT[:8] + [99])
    log.route(sub1, t1, 1, E1)
    log.route(sub2, t2, 2, engine_of_second)
    # A prompt sharing nothing goes to rank 0, the freer one.
    sub3, t3 = log.submit(3, [1, 2, 3, 4, 5])
    log.route(sub3, t3, 3, E0)
    return log


def test_longest_prefix_choices_replay():
    what, replay = check(prefix_log().records)
    assert what is None
    assert replay.summary().startswith(
        "3 submissions routed as recorded, 0 refused, 1 PrefixEvents"
    )


def test_an_engine_submit_to_the_wrong_rank_diverges():
    what, replay = check(prefix_log(engine_of_second=E0).records)
    assert what == (
        "request 2 of client client-a: the coordinator sent it to rank 0 as request 2, "
        "replay routes it to rank 1 as request 2"
    )
    assert replay.replayed.startswith("→ engines[rank 1]  EngineSubmit request_id=2 ")


def test_replay_check_names_the_divergence(tmp_path):
    """The same tampered log through `taipan replay --check`, with the config beside it."""
    write_config(tmp_path, InferenceConfig(**TEST_CONFIG, enable_prefix_caching=True))
    with Recorder(tmp_path, "coordinator") as out:
        for direction, channel, peer, msg, time in prefix_log(engine_of_second=E0).records:
            out.write(direction, channel, peer, encode(msg), time)
    code, text = check_dir(tmp_path, "coordinator")
    assert code == 1, text
    lines = text.splitlines()
    assert lines[0].startswith("coordinator: DIVERGES at record #8 (byte ")
    assert lines[0].endswith("replay routes it to rank 1 as request 2")
    assert lines[1].startswith("  recorded: → engines[engine-0]  EngineSubmit request_id=2 ")
    assert lines[2].startswith("  replayed: → engines[rank 1]  EngineSubmit request_id=2 ")


def test_altered_hashes_gid_or_arrival_time_diverge():
    log = prefix_log()
    i = next(i for i, r in enumerate(log.records) if isinstance(r[3], EngineSubmit))
    direction, channel, peer, msg, time = log.records[i]
    for changed, want in [
        (dataclasses.replace(msg, block_hashes=msg.block_hashes[:1]), "block hashes differ"),
        (dataclasses.replace(msg, hash_salt=3), "hash salt 3, replay 0"),
        (
            dataclasses.replace(msg, request_id=5),
            "as request 5, replay routes it to rank 1 as request 1",
        ),
        (dataclasses.replace(msg, arrival_time=time + 1), "sent it to rank 1 as request 1"),
    ]:
        records = list(log.records)
        records[i] = (direction, channel, peer, changed, time)
        what, _ = check(records)
        assert what is not None and want in what, what


def test_prefix_events_that_contradict_the_table_diverge():
    log = Log()
    hashes = np.array([11, 12], np.int64)
    log.arrive(ENGINES, E1, PrefixEvents(hashes, np.zeros(0, np.int64)))
    log.arrive(ENGINES, E1, PrefixEvents(hashes[:1], np.zeros(0, np.int64)))  # added twice
    what, _ = check(log.records)
    assert what.startswith("PrefixEvents from rank 1 contradict the routing table: rank 1: hash 11")


def test_round_robin_without_prefix_caching():
    """No hashes anywhere; ranks alternate, whatever finishes; an empty prompt is refused
    without taking a global id."""
    log = Log()
    for gid, engine in [(1, E0), (2, E1), (3, E0)]:
        sub, t = log.submit(gid, PROMPT, hashed=False)
        log.route(sub, t, gid, engine)
    log.finish(E0, 1)
    log.submit(9, [], hashed=False)
    log.send(CLIENTS, CLIENT, RequestOutput(9, np.zeros(0, np.int32), True, "error", "x", 0, 0))
    sub, t = log.submit(4, PROMPT, hashed=False)
    log.route(sub, t, 4, E1)
    what, replay = check(log.records, ROUND_ROBIN)
    assert what is None and (replay.routed, replay.refused) == (4, 1)
    # Read with prefix caching on, the coordinator would have hashed the prompts itself.
    what, _ = check(log.records, PREFIX)
    assert what.startswith("request 1 of client client-a: the coordinator sent it to rank 0")
    assert what.endswith("the block hashes differ")


def test_a_rank_gone_marker_removes_the_rank():
    log = Log()
    sub, t = log.submit(1, PROMPT, hashed=False)
    log.route(sub, t, 1, E0)
    log.send(ENGINES, None, RankGone(0, "sent nothing for 10 s"))  # record-only
    for gid in (2, 3):  # everything goes to rank 1 now
        sub, t = log.submit(gid, PROMPT, hashed=False)
        log.route(sub, t, gid, E1)
    what, replay = check(log.records, ROUND_ROBIN)
    assert what is None and replay.ranks_gone == 1 and replay.core.ranks == [1]
    # Without the marker (the silence is the coordinator's clock), request 3 would go to rank 0.
    what, _ = check([r for r in log.records if not isinstance(r[3], RankGone)], ROUND_ROBIN)
    assert what.startswith("request 3 of client client-a: the coordinator sent it to rank 1")
    # A dead rank routed to: the replay names the engine, which has no live rank left.
    log.records[-1] = (*log.records[-1][:2], E0, *log.records[-1][3:])
    what, _ = check(log.records, ROUND_ROBIN)
    assert "sent it to engine b'engine-0' (no live rank)" in what


def test_a_stale_salt_is_rehashed_with_the_acknowledged_weight_version():
    log = Log(ranks=(E0,))
    log.send(CLIENTS, CLIENT, ControlAck("update_weights", "SUSPENDED", 1))
    sub, t = log.submit(1, PROMPT, salt=0)  # the client's salt is from before the update
    log.route(sub, t, 1, E0, salt=1)
    sub, t = log.submit(2, PROMPT, salt=1)  # up to date: sent as the client hashed it
    log.route(sub, t, 2, E0)
    what, _ = check(log.records)
    assert what is None
    # A coordinator that missed the new version would have sent the client's stale hashes.
    d, c, p, msg, t = log.records[-3]
    stale = block_hashes(msg.prompt_token_ids, BS, 0)
    log.records[-3] = (d, c, p, dataclasses.replace(msg, block_hashes=stale, hash_salt=0), t)
    what, _ = check(log.records)
    assert "the block hashes differ; hash salt 0, replay 1" in what


def test_refusals_must_match():
    refusal = RequestOutput(1, np.zeros(0, np.int32), True, "error", "x", 9, 0)
    log = Log(ranks=())
    log.submit(1, PROMPT)  # no engine has loaded its model: refused, as the replay refuses it
    log.send(CLIENTS, CLIENT, refusal)
    what, replay = check(log.records)
    assert what is None and replay.refused == 1 and replay.core.next_id == 1
    log = Log(ranks=(E0,))
    log.submit(1, PROMPT)
    log.send(CLIENTS, CLIENT, refusal)
    what, _ = check(log.records)
    assert what == (
        "request 1 of client client-a: the coordinator refused it (x), replay routes it to rank 0"
    )


# --- a live coordinator, then the real runtime --------------------------------------------------


def write_config(directory, config: InferenceConfig) -> None:
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config.to_dict()))


def check_dir(directory, *actors: str) -> tuple[int, str]:
    """`taipan replay DIR --check --actor ...` in-process: (exit code, stdout). Not capsys: the
    actors' logger binds the stderr it first sees, which capsys would close after the test."""
    args = [str(directory), "--check"] + [a for name in actors for a in ("--actor", name)]
    with contextlib.redirect_stdout(io.StringIO()) as out:
        code = replay_main(args)
    return code, out.getvalue()


@pytest.mark.asyncio
async def test_a_live_coordinator_logs_a_silent_engine_as_rank_gone(tmp_path):
    """Two scripted engines; rank 1 holds a prompt's blocks and gets it; then it goes silent and
    the coordinator's clock declares it dead: the log says so, and the check passes."""
    config = InferenceConfig(**TEST_CONFIG, enable_prefix_caching=True)
    rec_dir = tmp_path / "rec"
    write_config(rec_dir, config)
    ctx = zmq.asyncio.Context()
    rec = Recorder(rec_dir, "coordinator")
    front, back = f"ipc://{tmp_path}/front.sock", f"ipc://{tmp_path}/back.sock"
    sockets = [
        make_socket(ctx, zmq.ROUTER, addr, bind=True, name=name, recorder=rec, watch_peers=True)
        for addr, name in ((front, CLIENTS), (back, ENGINES))
    ]
    actor = CoordinatorActor(
        *sockets,
        2,
        "m",
        512,
        control_token="token",
        engine_timeout=0.5,
        prefix_caching=True,
        routing_policy=routing_policy(config),
        routing_alpha=config.prefix_caching_routing_alpha,
        rank_capacity=plan_limits(config)[0],
    )
    engines = []
    for rank in (0, 1):
        chan = make_socket(ctx, zmq.DEALER, back, bind=False, name="e", identity=b"e%d" % rank)
        engines.append(ScriptedEngine(chan, heartbeat_s=0.05))
    client = make_socket(ctx, zmq.DEALER, front, bind=False, name="coordinator", identity=b"c")
    sockets += [e.chan for e in engines] + [client]
    bs = config.block_size_tokens
    cached = np.arange(2 * bs + 3, dtype=np.int32)  # rank 1 holds its two blocks

    async def generate(rid: int, prompt: np.ndarray) -> None:
        hashes = block_hashes(prompt, bs, 0)
        await client.send(SubmitRequest(rid, prompt, GREEDY, False, hashes))
        out = await receive(client)
        assert out.request_id == rid and out.finish_reason == "length", out

    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(actor.run())
            tasks = [tg.create_task(t) for e in engines for t in (e.run(), e.heartbeats())]
            try:
                for rank, engine in enumerate(engines):
                    await engine.send(Hello("engine", rank))
                    await engine.send(dataclasses.replace(LOADED, block_size=bs))
                await client.send(GetModelInfo())
                await receive(client)  # a model is loaded
                added = block_hashes(cached, bs, 0)
                await engines[1].send(PrefixEvents(added, np.zeros(0, np.int64)))
                await generate(1, np.arange(5, dtype=np.int32) + 500)  # nothing cached: rank 0
                await generate(2, cached)
                assert engines[1].submits[0].prompt_token_ids.tolist() == cached.tolist()
                engines[1].silent = True  # hung, its connection open: only the clock can tell
                async with asyncio.timeout(5):
                    while 1 in actor.links.engines:
                        await asyncio.sleep(0.05)
                await generate(3, cached)
                assert [len(e.submits) for e in engines] == [2, 1]
            finally:
                actor.stop()
                for task in tasks:
                    task.cancel()
    finally:
        for chan in sockets:
            chan.close()
        ctx.term()
        rec.close()
    gone = [decode(r.frames) for r in read_log(rec_dir / "coordinator.tplog")]
    assert RankGone(1, "sent nothing for 0.5 s") in gone
    code, out = check_dir(rec_dir, "coordinator")
    assert code == 0, out
    assert "coordinator: ok, 3 submissions routed as recorded, 0 refused, 1 PrefixEvents " in out
    assert "1 rank(s) gone" in out


def test_a_recorded_prefix_caching_session_checks(model_path, tmp_path):
    """SmolLM2 on CPU with prefix caching (longest_prefix routing): shared prefixes, then a
    weight update, after which one client still hashes with the old salt (the coordinator
    re-hashes its prompts) while the other hashes with the new one."""
    rec = tmp_path / "rec"
    config = InferenceConfig(**TEST_CONFIG, enable_prefix_caching=True)
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    with Runtime(model_path, config, record_dir=str(rec)) as rt:
        with Client(rt.address) as c, Client(rt.address) as stale:
            system = c.tokenizer.encode("You are a careful assistant. Answer briefly. " * 4)
            prompts = [system[:40] + c.tokenizer.encode(f" Question {i}?") for i in range(3)]
            c.generate(prompts[:1], greedy)
            assert all(x.num_cached_tokens == 32 for x in c.generate(prompts[1:], greedy))
            c.pause()
            c.suspend("persist")
            c.update_weights(state={"model.norm.weight": np.ones(576, dtype=np.float32)})
            c.resume()
            c.unpause()
            c.generate(prompts[:2], greedy)
            stale.generate(prompts, greedy)
    code, out = check_dir(rec, "coordinator", "engine-0", "allocator-0")
    assert code == 0, out
    assert "coordinator: ok, 8 submissions routed as recorded, 0 refused" in out, out
    assert "engine-0: ok" in out and "allocator-0: ok" in out
