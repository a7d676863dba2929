"""The coordinator actor alone, over real zmq sockets: raw client DEALERs, a scripted engine.

Both ROUTERs watch their peers over ipc, as in production (runtime/procs.py): inproc connections
have no descriptor, so a closed peer would go unnoticed there. The engine peer says Hello and
ModelLoaded, sends a Heartbeat every `heartbeat_s`, answers submissions (one terminal output, or
two deltas when streaming, each in a StepOutputs of its own) unless told to hold them, and
answers lifecycle controls as each test scripts it (acknowledge, refuse, or hold the answer).
The last tests put the public AsyncClient/Client in front of it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import logging
import random
import time

import msgpack
import numpy as np
import pytest
import structlog
import zmq
import zmq.asyncio

from taipan.actors.channel import Channel, make_socket
from taipan.actors.coordinator.actor import CoordinatorActor
from taipan.auth import new_token, publish_token, remove_token
from taipan.client import AsyncClient, Client, ControlError, RuntimeUnreachable
from taipan.messages.codec import MessageError, decode, encode, encode_frame, registry
from taipan.messages.common import ErrorReply, Heartbeat, Hello, PeerGone
from taipan.messages.gpu import ModelLoaded
from taipan.messages.lifecycle import (
    CONTROL_MESSAGES,
    ControlAck,
    ControlCommand,
    LifecycleState,
    Pause,
    Resume,
    Stop,
    StopAck,
    Suspend,
    Unpause,
    UpdateWeights,
)
from taipan.messages.requests import (
    AbortRequest,
    EngineSubmit,
    FinishReason,
    GetModelInfo,
    ModelInfo,
    RequestEvent,
    RequestOutput,
    SamplingParams,
    StepOutputs,
    SubmitRequest,
)
from taipan.messages.stats import GetStats, RankStats, Stats
from taipan.ops.tokenizer import Tokenizer, bytes_to_unicode

TOKEN = "test-control-token-0123456789"
WAIT_S = 5.0  # the bound on any answer that should come at once
ENGINE_STATE = {
    "pause": "PAUSED",
    "unpause": "RUNNING",
    "suspend": "SUSPENDED",
    "resume": "PAUSED",
    "update_weights": "SUSPENDED",
}
PROMPT = np.array([1, 2, 3], np.int32)


class ScriptedEngine:
    """An engine peer. Controls (and "stats") in `refuse` get an ErrorReply with that text; those
    in `hold` wait, unanswered, until `release()`. `hold_submits` records submissions without
    answering them (`finish` answers one later); `silent` sends nothing at all, heartbeats
    included (a hung process). Every inbound message notifies `changed` (see `until`)."""

    def __init__(self, chan: Channel, heartbeat_s: float):
        self.chan = chan
        self.heartbeat_s = heartbeat_s
        self.weight_version = 0
        self.refuse: dict[str, str] = {}
        self.hold: set[str] = set()
        self.held: list[str] = []
        self.hold_submits = False
        self.silent = False
        self.controls: list = []  # every control message received, in order
        self.submits: list[EngineSubmit] = []
        self.aborts: list[int] = []  # global ids
        self.unexpected: list = []  # anything else the coordinator sent
        self.heartbeats_heard = 0  # the coordinator's answers to our heartbeats
        self.changed = asyncio.Condition()

    async def until(self, predicate, timeout: float = WAIT_S) -> None:
        """Wait until `predicate()` holds after some inbound message (or already does)."""
        async with asyncio.timeout(timeout), self.changed:
            await self.changed.wait_for(predicate)

    async def send(self, msg) -> None:
        if not self.silent:
            await self.chan.send(msg)

    async def hello(self) -> None:
        await self.send(Hello("engine", 0))
        # By field name: the gpu family may grow fields the coordinator does not read.
        known = dict(model="test-model", tokenizer=byte_tokenizer_wire(), eos_token_ids=(2,))
        fields = {f.name: known.get(f.name, _sixteen(f)) for f in dataclasses.fields(ModelLoaded)}
        await self.send(ModelLoaded(**fields))

    async def heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            await self.send(Heartbeat(time.time()))

    async def run(self) -> None:
        while True:
            msg = (await self.chan.recv()).msg
            await self.handle(msg)
            async with self.changed:
                self.changed.notify_all()

    async def handle(self, msg) -> None:
        if isinstance(msg, EngineSubmit):
            self.submits.append(msg)
            if not self.hold_submits:
                await self.finish(msg)
            return
        if isinstance(msg, AbortRequest):
            self.aborts.append(msg.request_id)
            return
        if isinstance(msg, Heartbeat):
            self.heartbeats_heard += 1
            return
        if isinstance(msg, GetStats):
            command = "stats"
        elif type(msg) in CONTROL_MESSAGES:
            command = CONTROL_MESSAGES[type(msg)]
            self.controls.append(msg)
        else:
            self.unexpected.append(msg)
            return
        if command in self.hold:
            self.held.append(command)
        else:
            await self.answer(command)

    async def finish(self, msg: EngineSubmit) -> None:
        for out in outputs_for(msg):  # one step each
            await self.send(StepOutputs.of([out]))

    async def answer(self, command: str) -> None:
        if command in self.refuse:
            await self.send(ErrorReply("control_failed", self.refuse[command], None))
        elif command == "stop":
            await self.send(StopAck("engine-0"))
        elif command == "stats":
            await self.send(Stats("RUNNING", (rank_stats(self.weight_version),)))
        else:
            self.weight_version += command == "update_weights"
            await self.send(ControlAck(command, ENGINE_STATE[command], self.weight_version))

    async def release(self) -> None:
        held, self.held = self.held, []
        for command in held:
            await self.answer(command)


def rank_stats(step: int) -> RankStats:
    return RankStats(0, "RUNNING", step, 1, 2, 0, 64, 60, 4, 0, 0, 8, 0)


def byte_tokenizer_wire() -> str:
    """A byte-level tokenizer (one token per byte) in ModelInfo's wire form: no model files."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {ch: i for i, ch in enumerate(bytes_to_unicode().values())}
    backend = Backend(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    tok = Tokenizer(backend, chat_template=None, bos_token_id=None, eos_token_ids=(), add_bos=False)
    return json.dumps(tok.to_wire())


def outputs_for(msg: EngineSubmit) -> list[RequestOutput]:
    """Streaming: token 5 in a first delta, token 6 in the terminal one; else one output."""
    whole = finished_output(msg)
    if not msg.stream:
        return [whole]
    first = RequestOutput(
        msg.request_id,
        whole.new_token_ids[:1],
        False,
        None,
        None,
        whole.num_prompt_tokens,
        1,
        log_probs=whole.log_probs[:1],
        top_n_ids=whole.top_n_ids[:1],
        top_n_log_probs=whole.top_n_log_probs[:1],
    )
    last = dataclasses.replace(
        whole,
        new_token_ids=whole.new_token_ids[1:],
        log_probs=whole.log_probs[1:],
        top_n_ids=whole.top_n_ids[1:],
        top_n_log_probs=whole.top_n_log_probs[1:],
    )
    return [first, last]


def finished_output(msg: EngineSubmit) -> RequestOutput:
    """A terminal output with every optional field set, to check that all of them relay."""
    return RequestOutput(
        msg.request_id,
        np.array([5, 6], np.int32),
        True,
        "length",
        None,
        len(msg.prompt_token_ids),
        2,
        log_probs=np.array([-0.5, -0.25], np.float32),
        top_n_ids=np.array([[5, 7], [6, 5]], np.int32),
        top_n_log_probs=np.array([[-0.5, -1.5], [-0.25, -3.0]], np.float32),
        prompt_log_probs=np.array([-1.0, -2.0], np.float32),
        prompt_top_n_ids=np.array([[2], [3]], np.int32),
        prompt_top_n_log_probs=np.array([[-1.0], [-2.0]], np.float32),
        events=(RequestEvent("ADD_ENGINE", 1.0, None), RequestEvent("FINISH", 2.0, None)),
        ttft=0.125,
        tpot=0.0625,
        policy_staleness=np.zeros(5, np.int32),
        kv_cache_staleness=np.zeros(5, np.int32),
    )


async def receive(chan: Channel, timeout: float = WAIT_S):
    return (await asyncio.wait_for(chan.recv(), timeout)).msg


async def assert_silent(chan: Channel, seconds: float) -> None:
    """Nothing arrives on `chan` for `seconds`."""
    with pytest.raises(TimeoutError):
        msg = await receive(chan, seconds)
        pytest.fail(f"expected nothing, got {msg}")


@dataclasses.dataclass
class Harness:
    actor: CoordinatorActor
    engine: ScriptedEngine
    client: Channel  # identity b"tester"
    ctx: zmq.asyncio.Context
    front: str  # the clients' address
    channels: list[Channel]  # closed at the end
    run: asyncio.Task | None = None
    engine_tasks: list[asyncio.Task] = dataclasses.field(default_factory=list)

    async def send(self, msg) -> None:
        await self.client.send(msg)

    async def recv(self, timeout: float = WAIT_S):
        return await receive(self.client, timeout)

    async def ask(self, msg):
        await self.send(msg)
        return await self.recv()

    async def generate(self, request_id: int) -> RequestOutput:
        out = await self.ask(SubmitRequest(request_id, PROMPT, SamplingParams(), False))
        assert isinstance(out, RequestOutput) and out.request_id == request_id
        return out

    def connect(self, identity: bytes | None = None) -> Channel:
        """Another client connection."""
        chan = make_socket(
            self.ctx, zmq.DEALER, self.front, bind=False, name="coordinator", identity=identity
        )
        self.channels.append(chan)
        return chan

    def close(self, chan: Channel) -> None:
        """Close one connection now (Channel.close is not idempotent for a watched channel)."""
        self.channels.remove(chan)
        chan.close()

    async def kill_engine(self) -> None:
        """The engine process exits: its tasks end and its connection closes."""
        for task in self.engine_tasks:
            task.cancel()
        await asyncio.wait(self.engine_tasks)
        self.close(self.engine.chan)


@pytest.fixture
def addresses(tmp_path) -> tuple[str, str]:
    """(clients, engines) ipc addresses; pytest keeps tmp_path short enough for a socket path."""
    return f"ipc://{tmp_path}/front.sock", f"ipc://{tmp_path}/back.sock"


@contextlib.asynccontextmanager
async def running(
    addresses: tuple[str, str], *, control_token: str = TOKEN, heartbeat_s: float = 1.0, **timeouts
):
    """A coordinator (both ROUTERs watching their peers), a scripted engine that has loaded its
    model, and a client connection; checks at the end that the engine got nothing unexpected."""
    front_address, back_address = addresses
    ctx = zmq.asyncio.Context()
    front = make_socket(ctx, zmq.ROUTER, front_address, bind=True, name="clients", watch_peers=True)
    back = make_socket(ctx, zmq.ROUTER, back_address, bind=True, name="engines", watch_peers=True)
    engine_chan = make_socket(
        ctx, zmq.DEALER, back_address, bind=False, name="coordinator", identity=b"engine-0"
    )
    client = make_socket(
        ctx, zmq.DEALER, front_address, bind=False, name="coordinator", identity=b"tester"
    )
    actor = CoordinatorActor(
        front, back, 1, "test-model", 512, control_token=control_token, **timeouts
    )
    engine = ScriptedEngine(engine_chan, heartbeat_s)
    channels = [front, back, engine_chan, client]
    h = Harness(actor, engine, client, ctx, front_address, channels)
    try:
        async with asyncio.TaskGroup() as tg:
            h.run = tg.create_task(actor.run())
            h.engine_tasks = [tg.create_task(engine.run()), tg.create_task(engine.heartbeats())]
            try:
                await engine.hello()
                # ModelInfo arrives only once the engine is registered and loaded.
                assert isinstance(await h.ask(GetModelInfo()), ModelInfo)
                yield h
                assert engine.unexpected == []
            finally:
                actor.stop()
                for task in h.engine_tasks:
                    task.cancel()
    finally:
        for chan in h.channels:
            chan.close()
        ctx.term()


def assert_error(reply, code: str, *fragments: str) -> None:
    assert isinstance(reply, ErrorReply), reply
    assert reply.code == code and reply.request_id is None, reply
    for fragment in fragments:
        assert fragment in reply.text, reply.text


def capture_log(actor: CoordinatorActor) -> list[dict]:
    """Route the actor's log (every level) into the returned list of event dicts."""
    capture = structlog.testing.LogCapture()
    actor.log = structlog.wrap_logger(
        None,
        processors=[capture],
        wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG),
    ).bind(actor=actor.name)
    return capture.entries


# --- lifecycle ---------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_legal_sequence_gets_acks_with_states_and_weight_versions(addresses):
    state = {"model.norm.weight": np.ones(4, np.float32)}
    async with running(addresses) as h:
        acks = [
            await h.ask(msg)
            for msg in [
                Pause(TOKEN),
                Suspend(TOKEN, "offload"),
                UpdateWeights(TOKEN, "/ckpt/step-1", None),
                UpdateWeights(TOKEN, None, state),
                Resume(TOKEN),
                Unpause(TOKEN),
            ]
        ]
        assert acks == [
            ControlAck("pause", "PAUSED", 0),
            ControlAck("suspend", "SUSPENDED", 0),
            ControlAck("update_weights", "SUSPENDED", 1),
            ControlAck("update_weights", "SUSPENDED", 2),
            ControlAck("resume", "PAUSED", 2),
            ControlAck("unpause", "RUNNING", 2),
        ]
        assert acks[0].command is ControlCommand.PAUSE and acks[0].state is LifecycleState.PAUSED
        # The engine got each command as sent, less the token: the mode and the weights travel.
        got = h.engine.controls
        assert [CONTROL_MESSAGES[type(m)] for m in got] == [a.command for a in acks]
        assert all(m.token == "" for m in got)
        assert got[1] == Suspend("", "offload")
        assert got[2] == UpdateWeights("", "/ckpt/step-1", None)
        assert got[3].state["model.norm.weight"].tolist() == [1.0] * 4
        assert h.actor.lifecycle.weight_version == 2


def every_control(token: str) -> list:
    """One of each control message (UpdateWeights both ways, one with a frame of its own)."""
    big = {"w": np.zeros(20_000, np.float32)}  # over INLINE_ARRAY_BYTES: travels as a frame
    return [
        Pause(token),
        Unpause(token),
        Suspend(token, "offload"),
        Suspend(token, None),
        Resume(token),
        UpdateWeights(token, "/ckpt", None),
        UpdateWeights(token, None, big),
        Stop(token, "test"),
    ]


WRONG_TOKENS = ["", "wrong", TOKEN + "x", TOKEN[:-1], TOKEN.upper(), " " + TOKEN, TOKEN + "\x00"]


@pytest.mark.asyncio
async def test_controls_need_the_token_which_the_engines_never_see(addresses):
    async with running(addresses) as h:
        log = capture_log(h.actor)
        # The token is checked first: an unauthorized peer learns nothing of the state (resume
        # while RUNNING is not_authorized, not illegal_transition).
        for token in WRONG_TOKENS:
            for msg in every_control(token):
                command = CONTROL_MESSAGES[type(msg)]
                assert_error(await h.ask(msg), "not_authorized", command, "control_token=")
        assert h.actor.fsm.state == "RUNNING" and h.engine.controls == []
        # Each step of the whole lifecycle: refused without the token, taken with it.
        steps = [
            (Pause, "PAUSED"),
            (lambda t: Suspend(t, "recompute"), "SUSPENDED"),
            (lambda t: UpdateWeights(t, "/ckpt/step-2", None), "SUSPENDED"),
            (Resume, "PAUSED"),
            (Unpause, "RUNNING"),
            (Pause, "PAUSED"),
            (lambda t: Stop(t, "done"), "STOPPED"),
        ]
        for make, after in steps:
            before, forwarded = h.actor.fsm.state, len(h.engine.controls)
            for token in ("", "wrong"):
                assert_error(await h.ask(make(token)), "not_authorized")
            assert h.actor.fsm.state == before and len(h.engine.controls) == forwarded
            ack = await h.ask(make(TOKEN))
            assert isinstance(ack, ControlAck) and ack.state == after, ack
            assert h.engine.controls[forwarded:] == [make("")]  # the token stays here
        await asyncio.wait_for(h.run, WAIT_S)
    # Every control is logged with its sender and outcome; refusals of the token at warning.
    refused = [e for e in log if e["event"] == "control refused"]
    assert len(refused) == len(WRONG_TOKENS) * 8 + 2 * len(steps)
    assert {(e["log_level"], e["outcome"], e["sender"]) for e in refused} == {
        ("warning", "not_authorized", "tester")
    }
    done = [
        (e["log_level"], e["command"], e["sender"]) for e in log if e["event"] == "control done"
    ]
    assert done == [("info", str(CONTROL_MESSAGES[type(make(""))]), "tester") for make, _ in steps]


@pytest.mark.asyncio
async def test_the_client_finds_the_token_and_without_it_is_not_authorized(addresses, monkeypatch):
    front = addresses[0]
    monkeypatch.delenv("TAIPAN_CONTROL_TOKEN", raising=False)
    token = new_token()
    path = publish_token(front, token)  # as the launcher does: this user's file for the address
    try:
        async with running(addresses, control_token=token) as h:
            # Given explicitly, then from the environment: both win over the file.
            async with AsyncClient(front, connect_timeout=WAIT_S, control_token="not-it") as c:
                with pytest.raises(ControlError) as info:
                    await c.pause()
                assert info.value.code == "not_authorized" and info.value.command == "pause"
                assert "control_token=" in info.value.text
                assert "TAIPAN_CONTROL_TOKEN" in info.value.text
            monkeypatch.setenv("TAIPAN_CONTROL_TOKEN", "not-it")
            async with AsyncClient(front, connect_timeout=WAIT_S) as c:
                with pytest.raises(ControlError, match="not_authorized"):
                    await c.pause()
            assert h.engine.controls == [] and h.actor.fsm.state == "RUNNING"
            monkeypatch.delenv("TAIPAN_CONTROL_TOKEN")
            async with AsyncClient(front, connect_timeout=WAIT_S) as c:
                assert c.control_token == token
                assert (await c.pause()).state == "PAUSED"
            remove_token(path, token)
            async with AsyncClient(front, connect_timeout=WAIT_S) as c:
                assert c.control_token == ""  # none given, in the environment or in a file
                with pytest.raises(ControlError, match="not_authorized"):
                    await c.unpause()
            monkeypatch.setenv("TAIPAN_CONTROL_TOKEN", token)
            async with AsyncClient(front, connect_timeout=WAIT_S) as c:
                assert (await c.unpause()).state == "RUNNING"
            assert h.engine.controls == [Pause(""), Unpause("")]
    finally:
        remove_token(path, token)


def test_the_coordinator_needs_a_control_token():
    with pytest.raises(ValueError, match="non-empty control token"):
        CoordinatorActor(None, None, 1, "test-model", 512, control_token="")


@pytest.mark.asyncio
async def test_stats_carry_the_fsm_state_and_each_ranks_latest_report(addresses):
    async with running(addresses, stats_timeout=0.2) as h:
        assert await h.ask(GetStats()) == Stats("RUNNING", (rank_stats(0),))
        await h.engine.send(Stats("RUNNING", (rank_stats(7),)))  # a periodic report
        await h.ask(Pause(TOKEN))
        # An engine that does not answer in time: the client gets the latest report known.
        h.engine.hold.add("stats")
        assert await h.ask(GetStats()) == Stats("PAUSED", (rank_stats(7),))


@pytest.mark.asyncio
async def test_illegal_transitions_are_refused_and_nothing_is_forwarded(addresses):
    async with running(addresses) as h:
        reply = await h.ask(Resume(TOKEN))
        assert_error(reply, "illegal_transition", "resume is illegal while RUNNING; legal: pause")
        assert_error(await h.ask(Stop(TOKEN, "test")), "illegal_transition", "stop", "RUNNING")
        assert_error(await h.ask(Unpause(TOKEN)), "illegal_transition", "RUNNING")
        reply = await h.ask(UpdateWeights(TOKEN, "/x", None))
        assert_error(reply, "illegal_transition", "RUNNING")
        assert h.engine.controls == []
        assert (await h.generate(1)).finished  # still serving, still RUNNING
        assert (await h.ask(Pause(TOKEN))).state == "PAUSED"
        assert_error(await h.ask(Resume(TOKEN)), "illegal_transition", "while PAUSED")


@pytest.mark.asyncio
async def test_bad_control_fields_are_refused(addresses):
    # A mode that is not a KVCacheManagementMode cannot even be built...
    with pytest.raises(ValueError, match="swap"):
        Suspend(TOKEN, "swap")
    async with running(addresses) as h:
        assert (await h.ask(Pause(TOKEN))).state == "PAUSED"
        # ...and on the wire it is refused at decode, naming the choices.
        await h.client.sock.send(msgpack.packb([Suspend.TAG, Suspend.VERSION, TOKEN, "swap"]))
        assert_error(await h.recv(), "bad_field", "'swap'", "persist")
        assert (await h.ask(Suspend(TOKEN, None))).state == "SUSPENDED"
        reply = await h.ask(UpdateWeights(TOKEN, None, None))
        assert_error(reply, "bad_request", "exactly one")
        both = UpdateWeights(TOKEN, "/x", {"w": np.zeros(1, np.float32)})
        assert_error(await h.ask(both), "bad_request", "exactly one")
        assert len(h.engine.controls) == 2


@pytest.mark.asyncio
async def test_engine_error_fails_the_control_and_keeps_the_state(addresses):
    async with running(addresses) as h:
        await h.ask(Pause(TOKEN))
        h.engine.refuse["suspend"] = "no pinned memory for offload"
        reply = await h.ask(Suspend(TOKEN, "offload"))
        assert_error(reply, "control_failed", "stays PAUSED", "engine 0", "no pinned memory")
        assert h.actor.fsm.state == "PAUSED"
        assert_error(await h.ask(Resume(TOKEN)), "illegal_transition", "while PAUSED")
        del h.engine.refuse["suspend"]
        assert await h.ask(Suspend(TOKEN, "persist")) == ControlAck("suspend", "SUSPENDED", 0)
        assert (await h.generate(2)).finished


@pytest.mark.asyncio
async def test_a_control_while_one_is_pending_is_busy_and_requests_keep_flowing(addresses):
    async with running(addresses) as h:
        h.engine.hold.add("pause")
        await h.send(Pause(TOKEN))
        await h.engine.until(lambda: h.engine.held)
        assert_error(await h.ask(Pause(TOKEN)), "busy", "pause is still waiting")
        # The pending pause blocks no other handler: a request goes through meanwhile.
        out = await h.generate(3)
        assert out.finished and out.new_token_ids.tolist() == [5, 6]
        await h.engine.release()
        assert await h.recv() == ControlAck("pause", "PAUSED", 0)
        assert await h.ask(Unpause(TOKEN)) == ControlAck("unpause", "RUNNING", 0)
        assert len(h.engine.controls) == 2  # the busy one was not forwarded


@pytest.mark.asyncio
async def test_an_unanswered_control_times_out_and_a_late_ack_is_ignored(addresses):
    async with running(addresses, control_timeout=0.2) as h:
        h.engine.hold.add("pause")
        reply = await h.ask(Pause(TOKEN))
        assert_error(reply, "control_failed", "engine 0 did not answer pause within 0.2 s")
        assert "stays RUNNING" in reply.text and h.actor.lifecycle.round is None
        h.engine.hold.clear()
        await h.engine.release()  # the late ack
        # The engine answers in order: once this output is back, the late ack was handled.
        await h.generate(4)
        assert h.actor.fsm.state == "RUNNING"
        assert await h.ask(Pause(TOKEN)) == ControlAck("pause", "PAUSED", 0)


@pytest.mark.asyncio
async def test_stop_from_paused_refuses_new_requests_then_exits(addresses):
    async with running(addresses) as h:
        await h.ask(Pause(TOKEN))
        h.engine.hold.add("stop")
        await h.send(Stop(TOKEN, "test over"))
        await h.engine.until(lambda: h.engine.held)
        out = await h.ask(SubmitRequest(5, np.array([1, 2], np.int32), SamplingParams(), False))
        assert out.finished and out.finish_reason == "error" and "stopping" in out.error
        await h.engine.release()
        assert await h.recv() == ControlAck("stop", "STOPPED", 0)
        await asyncio.wait_for(h.run, WAIT_S)  # the coordinator exits by itself
        assert h.engine.controls == [Pause(""), Stop("", "test over")]


@pytest.mark.asyncio
async def test_stop_exits_even_when_an_engine_does_not_answer(addresses):
    async with running(addresses, stop_timeout=0.2) as h:
        await h.ask(Pause(TOKEN))
        h.engine.hold.add("stop")
        reply = await h.ask(Stop(TOKEN, "test over"))
        assert_error(reply, "control_failed", "did not answer stop", "exits anyway")
        await asyncio.wait_for(h.run, WAIT_S)


# --- requests ----------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_outputs_relay_every_field_under_the_client_id(addresses):
    async with running(addresses) as h:
        out = await h.generate(41)
        expected = finished_output(EngineSubmit(41, np.zeros(3, np.int32), None, False, 0.0))
        assert out.finish_reason is FinishReason.LENGTH
        for field in dataclasses.fields(RequestOutput):
            a, b = getattr(out, field.name), getattr(expected, field.name)
            if isinstance(a, np.ndarray):
                assert a.dtype == b.dtype and np.array_equal(a, b), field.name
            else:
                assert a == b, field.name


@pytest.mark.asyncio
async def test_a_client_cannot_forge_the_output_of_another_clients_request(addresses):
    async with running(addresses) as h:
        h.engine.hold_submits = True
        await h.send(SubmitRequest(1, PROMPT, SamplingParams(), False))
        await h.engine.until(lambda: h.engine.submits)
        gid = h.engine.submits[0].request_id  # global ids are small consecutive numbers
        forger = h.connect(identity=b"forger")
        await forger.send(RequestOutput(gid, np.array([66], np.int32), True, "stop", None, 3, 1))
        await forger.send(Heartbeat(0.0))
        # A client's messages are handled in order: the forgery before the heartbeat.
        replies = [await receive(forger)]
        while not isinstance(replies[-1], Heartbeat):
            replies.append(await receive(forger))
        [refusal, _] = replies
        assert_error(refusal, "unexpected_message", "RequestOutput")
        await h.engine.finish(h.engine.submits[0])
        out = await h.recv()
        assert out.new_token_ids.tolist() == [5, 6], "the client got the forged output"


async def held_requests(h: Harness, clients: list[Channel], stream: bool = False) -> list:
    """Each client submits request 1 (held by the engine); their EngineSubmits, in the order of
    `clients` (told apart by prompt: the coordinator may take the clients in any order)."""
    h.engine.hold_submits = True
    for k, chan in enumerate(clients):
        await chan.send(SubmitRequest(1, np.array([100 + k], np.int32), SamplingParams(), stream))
    await h.engine.until(lambda: len(h.engine.submits) == len(clients))
    return sorted(h.engine.submits, key=lambda m: int(m.prompt_token_ids[0]))


@pytest.mark.asyncio
async def test_one_step_of_outputs_is_relayed_to_each_requests_own_client(addresses):
    async with running(addresses) as h:
        other = h.connect(identity=b"other")
        mine, theirs = await held_requests(h, [h.client, other], stream=True)
        first, last = outputs_for(mine)
        # One step: a delta for my request, the terminal output of theirs; then mine ends.
        await h.engine.send(StepOutputs.of([first, finished_output(theirs)]))
        await h.engine.send(StepOutputs.of([last]))
        got_mine = [await h.recv(), await h.recv()]
        [got_theirs] = [await receive(other)]
        assert [o.request_id for o in got_mine] == [1, 1]  # each under its client's own id
        assert [o.new_token_ids.tolist() for o in got_mine] == [[5], [6]]
        assert [o.finished for o in got_mine] == [False, True]
        assert got_theirs.request_id == 1 and got_theirs.finished
        assert got_theirs.new_token_ids.tolist() == [5, 6] and got_theirs.ttft == 0.125
        assert h.actor.core.routes == {}  # both finished: nothing left to route
        await assert_silent(other, 0.2)


@pytest.mark.asyncio
async def test_a_malformed_step_outputs_fails_its_requests_and_the_coordinator_goes_on(addresses):
    async with running(addresses) as h:
        log = capture_log(h.actor)
        other = h.connect(identity=b"other")
        mine, theirs = await held_requests(h, [h.client, other])
        good = StepOutputs.of([finished_output(mine), finished_output(theirs)])
        # The arrays disagree: no entry can be trusted, every request named ends with an error.
        await h.engine.send(dataclasses.replace(good, finished=good.finished[:1]))
        for chan in (h.client, other):
            out = await receive(chan)
            assert out.request_id == 1 and out.finished and out.finish_reason == "error"
            assert "engine 0 sent a malformed output" in out.error and "differ" in out.error
        await h.engine.until(lambda: len(h.engine.aborts) == 2)
        assert sorted(h.engine.aborts) == sorted([mine.request_id, theirs.request_id])
        [refusal] = h.engine.unexpected
        assert refusal.code == "bad_message" and "differ" in refusal.text
        h.engine.unexpected.clear()
        # Late outputs for those requests are dropped: each client had its one terminal output.
        await h.engine.send(good)
        await assert_silent(h.client, 0.2)
        assert h.actor.core.routes == {} and not h.run.done()
        errors = [e for e in log if e["event"] == "malformed outputs"]
        assert [(e["log_level"], e["requests_failed"]) for e in errors] == [("error", 2)]
        h.engine.hold_submits = False
        assert (await h.generate(2)).finished


@pytest.mark.asyncio
async def test_a_bad_entry_fails_only_its_request(addresses):
    async with running(addresses) as h:
        other = h.connect(identity=b"other")
        mine, theirs = await held_requests(h, [h.client, other])
        good = StepOutputs.of([finished_output(mine), finished_output(theirs)])
        cases = [
            encode_frame(Heartbeat(1.0)),  # not a RequestOutput
            encode_frame(dataclasses.replace(finished_output(mine), request_id=999)),
            encode_frame(dataclasses.replace(finished_output(mine), finished=False)),
            b"\xc1",  # not msgpack
        ]
        for i, frame in enumerate(cases):
            bad = dataclasses.replace(good, outputs=(frame, good.outputs[1]))
            await h.engine.send(bad)
            out = await h.recv()
            assert out.request_id == 1 and out.finish_reason == "error", (i, out)
            assert "malformed output" in out.error, (i, out.error)
            relayed = await receive(other)
            assert relayed.request_id == 1 and relayed.finish_reason == "length", i
            assert relayed.new_token_ids.tolist() == [5, 6]
            await h.engine.until(lambda: h.engine.unexpected)
            assert h.engine.unexpected.pop().code == "bad_message"
            if i + 1 < len(cases):
                h.engine.submits.clear()
                mine, theirs = await held_requests(h, [h.client, other])
                good = StepOutputs.of([finished_output(mine), finished_output(theirs)])
        assert h.actor.core.routes == {} and not h.run.done()


@pytest.mark.asyncio
async def test_heartbeats_a_client_and_an_engine_get_one_back(addresses):
    async with running(addresses) as h:
        before = time.time()
        reply = await h.ask(Heartbeat(0.0))
        assert isinstance(reply, Heartbeat) and reply.time >= before
        # A registered engine's heartbeat is answered (an engine on another host watches the
        # coordinator by these answers).
        heard = h.engine.heartbeats_heard
        await h.engine.send(Heartbeat(time.time()))
        await h.engine.until(lambda: h.engine.heartbeats_heard > heard)


# --- fuzzing -----------------------------------------------------------------------------------


def random_value(rng: random.Random, depth: int = 0):
    """Any msgpack value, including ones every decoder must refuse (int map keys, odd ExtTypes)."""
    kind = rng.randrange(14 if depth < 3 else 10)
    if kind == 0:
        return rng.randrange(-5, 200)
    if kind == 1:
        return rng.choice([-(2**63), 2**63 - 1, 2**64 - 1, -1, 2**32])
    if kind == 2:
        return rng.choice([0.0, -1.5, 1e300, float("nan"), float("inf")])
    if kind == 3:
        return rng.choice(["", "engine", "pause", "persist", "RUNNING", "é\u2603", TOKEN + "?"])
    if kind == 4:
        return rng.randbytes(rng.randrange(12))
    if kind == 5:
        return rng.choice([None, True, False])
    if kind == 6:
        return "".join(rng.choice("abc/\x00 ") for _ in range(rng.randrange(8)))
    if kind == 7:  # an array header, now and then a consistent one
        dtype = rng.choice(["int32", "float32", "int64", "object", "bool"])
        shape = rng.choice([[3], [1, 2], [], [2**41], [-1]])
        data = rng.choice([bytes(12), bytes(8), rng.randbytes(5), 1, 7])
        return msgpack.ExtType(rng.choice([1, 2]), msgpack.packb([dtype, shape, data]))
    if kind == 8:
        return msgpack.ExtType(rng.randrange(128), rng.randbytes(rng.randrange(10)))
    if kind == 9:
        return rng.choice([0, 1, 20, 24, 42, 140])
    if kind in (10, 11):
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(5))]
    if kind == 12:
        return {
            str(rng.randrange(9)): random_value(rng, depth + 1) for _ in range(rng.randrange(3))
        }
    return {rng.randrange(9): random_value(rng, depth + 1)}  # int keys: refused by strict_map_key


# Hand-made frames msgpack's packer will not make.
TRICKY = [
    b"\x91" * 3000 + b"\xc0",  # nested past msgpack's depth limit
    b"\xd4\xff\x00",  # a timestamp (ExtType -1) of a length no timestamp has
    b"\x93\x2a\x01\xd6\xff\x00\x00\x00\x01",  # Pause whose token is a valid timestamp
    b"\x92\x2a",  # an array shorter than it says
    b"\xdd\xff\xff\xff\xff",  # an array claiming 2**32 - 1 items
    b"\x93\x2a\x01\xa5tok",  # a string shorter than it says
    b"",
]
TAGS = sorted(registry()) + [19, 59, 99, 255, -1, 2**40]
WRONG_TOKEN_VALUES = [TOKEN.encode(), [TOKEN], {"token": TOKEN}, None, 0, *WRONG_TOKENS]


def fuzz_frames(rng: random.Random) -> list[bytes]:
    """One inbound message: garbage, a near-miss envelope, or a control with a wrong token. Never
    a well-formed control with the right token."""
    kind = rng.randrange(7)
    if kind == 0:
        frames = [rng.randbytes(rng.randrange(40))]
    elif kind == 1:
        frames = [msgpack.packb(random_value(rng))]
    elif kind in (2, 3):  # a known (or unknown) tag with random fields, arity nearly right
        tag = rng.choice(TAGS)
        arity = len(dataclasses.fields(registry()[tag])) if tag in registry() else 2
        version = 1 if rng.random() < 0.9 else random_value(rng)
        fields = [random_value(rng) for _ in range(max(0, arity + rng.choice([-1, 0, 0, 1])))]
        frames = [msgpack.packb([tag, version, *fields])]
    elif kind == 4:  # a control whose token is wrong in value or type
        cls = rng.choice(list(CONTROL_MESSAGES))
        rest = [random_value(rng) for _ in dataclasses.fields(cls)[1:]]
        frames = [msgpack.packb([cls.TAG, cls.VERSION, rng.choice(WRONG_TOKEN_VALUES), *rest])]
    elif kind == 5:  # the right token in a malformed control: wrong version or arity
        cls = rng.choice(list(CONTROL_MESSAGES))
        rest = [random_value(rng) for _ in dataclasses.fields(cls)[1:]]
        if rng.random() < 0.5:
            frames = [msgpack.packb([cls.TAG, 2, TOKEN, *rest])]
        else:
            frames = [msgpack.packb([cls.TAG, cls.VERSION, TOKEN, *rest, random_value(rng)])]
    else:  # a valid control, well encoded, with a wrong token
        frames = encode(rng.choice(every_control(rng.choice(WRONG_TOKENS))))
    if rng.random() < 0.05:
        frames.append(rng.randbytes(rng.randrange(20)))
    return frames


# What the coordinator takes from a client (and may answer); it drops an ErrorReply unanswered
# and answers anything else (engine-side messages included) with "unexpected_message".
FROM_A_CLIENT = (SubmitRequest, AbortRequest, GetModelInfo, GetStats, Heartbeat, PeerGone)


def expected_error(frames: list[bytes]) -> str | None:
    """The ErrorReply code the coordinator owes a client for these frames, or None."""
    try:
        msg = decode(frames)
    except MessageError as e:
        return e.code
    if type(msg) in CONTROL_MESSAGES:
        assert msg.token != TOKEN, "the fuzzer made an authorized control"
        return "not_authorized"
    return None if isinstance(msg, (*FROM_A_CLIENT, ErrorReply)) else "unexpected_message"


@pytest.mark.asyncio
async def test_fuzzed_frames_and_wrong_token_controls_change_nothing(addresses):
    rng = random.Random(20240611)
    async with running(addresses) as h:
        log = capture_log(h.actor)  # quiet, and countable
        fuzzer = h.ctx.socket(zmq.DEALER)
        h.channels.append(Channel(fuzzer, "fuzzer"))  # closed with the others
        fuzzer.setsockopt(zmq.LINGER, 0)
        fuzzer.setsockopt(zmq.RCVHWM, 0)
        fuzzer.connect(h.front)
        expected, got = collections.Counter(), collections.Counter()
        for batch in range(8):
            for i in range(500):
                frames = [TRICKY[i]] if batch == 0 and i < len(TRICKY) else fuzz_frames(rng)
                code = expected_error(frames)
                if code is not None:
                    expected[code] += 1
                await fuzzer.send_multipart(frames)
            # A client's messages are handled in order: once this one is answered, every error
            # reply of the batch has been sent (a batch keeps the replies under the high-water
            # mark, where the coordinator's ROUTER would drop them).
            marker = 1_000_000 + batch
            await fuzzer.send_multipart(
                encode(SubmitRequest(marker, PROMPT, SamplingParams(), False))
            )
            while True:
                reply = decode(await asyncio.wait_for(fuzzer.recv_multipart(), WAIT_S))
                if isinstance(reply, ErrorReply):
                    got[reply.code] += 1
                if isinstance(reply, RequestOutput) and reply.request_id == marker:
                    break
        assert got == expected and expected["not_authorized"] > 500, (got, expected)
        refused = [e for e in log if e["event"] == "control refused"]
        assert len(refused) == expected["not_authorized"]
        assert {e["outcome"] for e in refused} == {"not_authorized"}
        # Nothing changed: still RUNNING, the engine saw no control, a request is served.
        assert not h.run.done() and h.actor.lifecycle.round is None
        assert await h.ask(GetStats()) == Stats("RUNNING", (rank_stats(0),))
        assert h.actor.fsm.state == "RUNNING" and h.engine.controls == []
        out = await h.generate(7)
        assert out.finished and out.finish_reason == "length"


# --- liveness ----------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_dead_engine_fails_its_requests_and_new_ones_are_refused(addresses):
    async with running(addresses, stats_timeout=60.0) as h:
        h.engine.hold_submits = True
        await h.send(SubmitRequest(7, PROMPT, SamplingParams(), True))
        await h.engine.until(lambda: h.engine.submits)
        start = time.monotonic()
        await h.kill_engine()
        out = await h.recv(timeout=2.0)
        assert time.monotonic() - start < 2.0
        assert isinstance(out, RequestOutput) and out.request_id == 7 and out.finished, out
        assert out.finish_reason is FinishReason.ERROR
        assert "engine rank 0 died (its connection closed)" in out.error
        # Nothing is left to route to: refused at once, naming the dead rank.
        out = await h.ask(SubmitRequest(8, PROMPT, SamplingParams(), False))
        assert out.finish_reason == "error" and out.request_id == 8
        assert "no engine rank is alive (rank 0 died: its connection closed)" in out.error
        assert isinstance(await h.ask(GetModelInfo()), ModelInfo)
        # Stats wait for no dead engine (stats_timeout is a minute) and show it dead.
        stats = await h.ask(GetStats())
        [dead] = stats.ranks
        assert (dead.rank, dead.alive, dead.running) == (0, False, 0)
        assert dead.dead_reason == "its connection closed"
        assert stats.merged().alive is False
        assert h.actor.links.engines == {}


@pytest.mark.asyncio
async def test_a_dead_engine_ends_the_control_and_stats_query_waiting_for_it(addresses):
    async with running(addresses, stats_timeout=60.0, control_timeout=60.0) as h:
        other = h.connect()
        h.engine.hold |= {"pause", "stats"}
        await h.send(Pause(TOKEN))
        await other.send(GetStats())
        await h.engine.until(lambda: len(h.engine.held) == 2)
        await h.kill_engine()
        reply = await h.recv(timeout=2.0)
        assert_error(reply, "control_failed", "pause failed; the state stays RUNNING")
        assert "engine 0: its connection closed" in reply.text
        assert h.actor.fsm.state == "RUNNING" and h.actor.lifecycle.round is None
        stats = await receive(other, 2.0)
        assert [(r.rank, r.alive) for r in stats.ranks] == [(0, False)]


@pytest.mark.asyncio
async def test_a_silent_engine_is_declared_dead_after_engine_timeout(addresses):
    async with running(addresses, engine_timeout=0.5, heartbeat_s=0.05) as h:
        h.engine.hold_submits = True
        await h.send(SubmitRequest(9, PROMPT, SamplingParams(), False))
        await h.engine.until(lambda: h.engine.submits)
        # Heartbeats alone keep a busy engine alive well past the timeout.
        await assert_silent(h.client, 1.0)
        assert 0 in h.actor.links.engines
        h.engine.silent = True  # hung: its connection stays open
        start = time.monotonic()
        out = await h.recv(timeout=3.0)
        assert time.monotonic() - start < 1.5
        assert out.request_id == 9 and out.finish_reason == "error"
        assert "engine rank 0 died (sent nothing for 0.5 s)" in out.error
        assert h.actor.links.engines == {}


@pytest.mark.asyncio
async def test_a_vanished_clients_requests_are_aborted(addresses):
    async with running(addresses) as h:
        h.engine.hold_submits = True
        leaver = h.connect(identity=b"leaver")
        for request_id in (1, 2):
            await leaver.send(SubmitRequest(request_id, PROMPT, SamplingParams(), False))
        await h.send(SubmitRequest(1, np.array([9], np.int32), SamplingParams(), False))
        await h.engine.until(lambda: len(h.engine.submits) == 3)
        mine = [s for s in h.engine.submits if s.prompt_token_ids.tolist() == [9]]
        theirs = {s.request_id for s in h.engine.submits} - {mine[0].request_id}
        h.close(leaver)
        await h.engine.until(lambda: len(h.engine.aborts) == 2, timeout=2.0)
        assert sorted(h.engine.aborts) == sorted(theirs)  # by their engine-side global ids
        # The client still here keeps its request.
        await h.engine.finish(mine[0])
        out = await h.recv()
        assert out.request_id == 1 and out.finish_reason == "length"
        assert len(h.engine.aborts) == 2


# --- the public client in front of it ------------------------------------------------------------


@pytest.mark.asyncio
async def test_client_lifecycle_methods_return_acks_and_raise_control_errors(addresses):
    front = addresses[0]
    async with running(addresses) as h:
        async with AsyncClient(front, connect_timeout=WAIT_S, control_token=TOKEN) as c:
            assert c.info.kv_cache_tokens == 16 * 16 and c.info.kv_cache_bytes == 16 * 16
            with pytest.raises(ControlError) as info:
                await c.resume()
            assert info.value.code == "illegal_transition" and info.value.command == "resume"
            assert "resume is illegal while RUNNING; legal: pause" in str(info.value)
            with pytest.raises(ControlError, match="stop is illegal while RUNNING"):
                await c.stop()
            assert await c.pause() == ControlAck("pause", "PAUSED", 0)
            assert (await c.suspend("recompute")).state == "SUSPENDED"
            with pytest.raises(ValueError, match="exactly one of path and state"):
                await c.update_weights()
            ack = await c.update_weights(state={"model.norm.weight": np.ones(2, np.float32)})
            assert ack == ControlAck("update_weights", "SUSPENDED", 1)
            h.engine.refuse["resume"] = "out of device memory"
            with pytest.raises(ControlError, match="out of device memory") as info:
                await c.resume()
            assert info.value.code == "control_failed"
            del h.engine.refuse["resume"]
            assert (await c.resume()).state == "PAUSED"
            assert h.engine.controls[1] == Suspend("", "recompute")
            stats = await c.stats()
            assert stats.state == "PAUSED" and stats.ranks == (rank_stats(1),)
        # The blocking twin, in a thread: this loop must keep serving the coordinator.
        client = await asyncio.to_thread(Client, front, connect_timeout=WAIT_S, control_token=TOKEN)
        try:
            assert await asyncio.to_thread(client.unpause) == ControlAck("unpause", "RUNNING", 1)
        finally:
            await asyncio.to_thread(client.close)


@pytest.mark.asyncio
async def test_client_matches_stop_strings_itself_and_collects_log_probs(addresses):
    sampling = SamplingParams(
        stop=("ab", "\n"),
        stop_word_ids=((9, 9),),
        return_log_probs=True,
        top_n_logprobs=2,
        return_prompt_top_n_logprobs=True,
    )
    async with running(addresses) as h:
        async with AsyncClient(addresses[0], connect_timeout=WAIT_S) as c:
            [done] = await c.generate("xyz", sampling)
            deltas = [d async for d in c.stream("xyz", sampling)]
            [plain] = await c.generate("xyz", SamplingParams(stop="ab"))
            [unstopped] = await c.generate("xyz", SamplingParams())
            with pytest.raises(ValueError, match="stop strings must be non-empty"):
                await c.generate("xyz", SamplingParams(stop=("",)))
            tok = c.tokenizer
    # Stop strings travel as given (a bare string as one), for the record: the engine matches
    # only the ids it was given, and streams every request with stop strings to the client,
    # which matches them on the text. The refused one was never sent.
    first, _, bare, last = h.engine.submits
    assert first.sampling.stop == ("ab", "\n") and first.sampling.stop_word_ids == ((9, 9),)
    assert bare.sampling.stop == ("ab",) and bare.sampling.stop_word_ids == ()
    assert [s.stream for s in h.engine.submits] == [True, True, True, False]
    assert last.sampling.stop == ()

    assert done.token_ids == [5, 6] and done.text == tok.decode([5, 6])
    assert done.finish_reason == "length" and done.stop_reason is None
    assert done.log_probs == [-0.5, -0.25]
    assert done.top_n_logprobs == [{5: -0.5, 7: -1.5}, {6: -0.25, 5: -3.0}]
    assert done.prompt_log_probs == [-1.0, -2.0]
    assert done.prompt_top_n_logprobs == [{2: -1.0}, {3: -2.0}]
    assert [e.type for e in done.events] == ["ADD_ENGINE", "FINISH"]
    assert (done.ttft, done.tpot) == (0.125, 0.0625)
    assert done.policy_staleness == [0] * 5 and unstopped.text == done.text

    first, last = deltas
    assert first.token_ids == [5] and first.log_probs == [-0.5] and not first.finished
    assert first.top_n_logprobs == [{5: -0.5, 7: -1.5}] and first.prompt_log_probs is None
    assert last.token_ids == [6] and last.log_probs == [-0.25] and last.finished
    assert last.prompt_log_probs == [-1.0, -2.0] and last.ttft == 0.125
    assert first.text + last.text == done.text

    # Nothing asked, nothing shown (whatever the engine sent).
    assert plain.log_probs is None and plain.top_n_logprobs is None
    assert plain.prompt_log_probs is None and plain.prompt_top_n_logprobs is None
    assert plain.ttft == 0.125 and len(plain.events) == 2


@pytest.mark.asyncio
@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("stream", [False, True])
async def test_a_stop_string_ends_the_text_and_aborts_the_request_at_once(
    addresses, include, stream
):
    """Token 5 is the text "\x05": the client aborts on seeing it, before the engine's next
    output, and drops what the engine generated meanwhile."""
    sampling = SamplingParams(stop="\x05", include_stop_word=include, return_log_probs=True)
    async with running(addresses) as h:
        h.engine.hold_submits = True
        async with AsyncClient(addresses[0], connect_timeout=WAIT_S) as c:

            async def ask():
                if stream:
                    return [d async for d in c.stream("xyz", sampling)]
                return await c.generate("xyz", sampling)

            task = asyncio.create_task(ask())
            await h.engine.until(lambda: h.engine.submits)
            [submit] = h.engine.submits
            first, last = outputs_for(submit)
            await h.engine.send(StepOutputs.of([first]))
            await h.engine.until(lambda: h.engine.aborts == [submit.request_id])
            aborted = dataclasses.replace(last, finish_reason=FinishReason.ABORT, error=None)
            await h.engine.send(StepOutputs.of([aborted]))
            [done] = await asyncio.wait_for(task, WAIT_S)
    assert done.finish_reason == "stop" and done.stop_reason == "\x05" and done.error is None
    assert done.token_ids == [5] and done.log_probs == [-0.5]
    assert done.text == ("\x05" if include else "")
    assert done.ttft == 0.125 and done.policy_staleness == [0] * 4  # prompt + the kept token
    if stream:
        assert done.finished


@pytest.mark.asyncio
async def test_a_stop_string_in_the_terminal_output_changes_its_reason_only(addresses):
    async with running(addresses) as h:
        async with AsyncClient(addresses[0], connect_timeout=WAIT_S) as c:
            [done] = await c.generate("xyz", SamplingParams(stop=("\x06", "\x07")))
    assert (done.text, done.token_ids) == ("\x05", [5, 6])
    assert (done.finish_reason, done.stop_reason) == ("stop", "\x06")
    assert h.engine.aborts == []  # it had ended already


@pytest.mark.asyncio
async def test_async_client_connect_fails_fast_when_nothing_listens(tmp_path):
    client = AsyncClient(f"ipc://{tmp_path}/nothing.sock", timeout=0.5, connect_timeout=30)
    start = time.monotonic()
    with pytest.raises(RuntimeUnreachable, match="nothing.sock"):
        await asyncio.wait_for(client.connect(), WAIT_S)
    assert time.monotonic() - start < 1.5


@pytest.mark.asyncio
async def test_async_client_fails_waiting_calls_when_the_coordinator_stops(addresses):
    async with running(addresses) as h:
        async with AsyncClient(addresses[0], timeout=0.5, connect_timeout=WAIT_S) as c:
            h.engine.hold_submits = True
            generating = asyncio.create_task(c.generate([[1, 2, 3]], raise_on_error=False))
            try:
                await h.engine.until(lambda: h.engine.submits)
                # A live coordinator answers the client's heartbeats: 3 timeouts, still waiting.
                done, _ = await asyncio.wait([generating], timeout=1.5)
                assert not done
                h.actor.stop()  # the coordinator process exits: its sockets close
                await asyncio.wait_for(h.run, WAIT_S)
                h.close(h.actor.frontend)
                start = time.monotonic()
                [completion] = await asyncio.wait_for(generating, WAIT_S)
            finally:
                generating.cancel()
            assert time.monotonic() - start < 1.5
            assert completion.finish_reason == "error"
            assert "no answer from the runtime" in completion.error
            start = time.monotonic()
            with pytest.raises(RuntimeUnreachable, match="it is not running there, or it died"):
                await asyncio.wait_for(c.stats(), WAIT_S)
            assert time.monotonic() - start < 1.5


# --- several ranks (issue 12): readiness, refusals ----------------------------------------------


def _sixteen(field) -> object:
    """A made-up ModelLoaded value: 16 for a number, False for a flag."""
    return False if field.type == "bool" else 16


def _loaded(block_size: int = 16) -> ModelLoaded:
    known = dict(model="test-model", tokenizer=byte_tokenizer_wire(), eos_token_ids=(2,))
    fields = {f.name: known.get(f.name, _sixteen(f)) for f in dataclasses.fields(ModelLoaded)}
    return ModelLoaded(**(fields | {"block_size": block_size}))


@pytest.mark.asyncio
async def test_ranks_join_ready_only_when_all_loaded_and_bad_ones_are_refused(addresses):
    """Two ranks: model info waits for both; an engine claiming a rank out of range, a rank
    already served or one of another block size is refused with `rank_refused` (and the last
    one, before the runtime is ready, fails the start)."""
    front_address, back_address = addresses
    ctx = zmq.asyncio.Context()
    front = make_socket(ctx, zmq.ROUTER, front_address, bind=True, name="clients", watch_peers=True)
    back = make_socket(ctx, zmq.ROUTER, back_address, bind=True, name="engines", watch_peers=True)

    def dealer(address: str, identity: bytes) -> Channel:
        return make_socket(ctx, zmq.DEALER, address, bind=False, name="c", identity=identity)

    engines = [dealer(back_address, f"engine-{i}".encode()) for i in range(4)]
    client = dealer(front_address, b"tester")
    actor = CoordinatorActor(front, back, 2, "test-model", 512, control_token=TOKEN)
    try:
        async with asyncio.TaskGroup() as tg:
            run = tg.create_task(actor.run())
            await engines[0].send(Hello("engine", 0))
            await engines[0].send(_loaded())
            await client.send(GetModelInfo())
            await assert_silent(client, 0.3)  # one rank of two: not ready
            for chan, rank, why in [
                (engines[2], 2, "rank 2 is outside this runtime's 2 rank(s)"),
                (engines[3], 0, "rank 0 is already served by a live engine"),
            ]:
                await chan.send(Hello("engine", rank))
                assert_error(await receive(chan), "rank_refused", why)
            await engines[1].send(Hello("engine", 1))
            await engines[1].send(_loaded(block_size=32))  # not the runtime's block size
            assert_error(await receive(engines[1]), "rank_refused", "block size 32 differs")
            reply = await receive(client)
            assert_error(reply, "load_failed", "engine rank 1 died before the runtime was ready")
            actor.stop()
            await run
    finally:
        for chan in (front, back, client, *engines):
            chan.close()
        ctx.term()
