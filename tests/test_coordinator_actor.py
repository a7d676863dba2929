"""The coordinator actor alone, over real zmq sockets: a raw client DEALER, a scripted engine.

The engine peer says Hello and ModelLoaded, answers submissions (one terminal output, or two
deltas when streaming), and answers lifecycle controls as each test scripts it (acknowledge,
refuse, or hold the answer). The last tests put the public AsyncClient/Client in front of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json

import numpy as np
import pytest
import zmq
import zmq.asyncio

from taipan.actors.channel import Channel, make_socket
from taipan.actors.coordinator.actor import CONTROL_COMMANDS, CoordinatorActor
from taipan.client import AsyncClient, Client, ControlError
from taipan.messages.common import ErrorReply, Hello
from taipan.messages.gpu import ModelLoaded
from taipan.messages.lifecycle import (
    ControlAck,
    Pause,
    Resume,
    Stop,
    StopAck,
    Suspend,
    Unpause,
    UpdateWeights,
)
from taipan.messages.requests import (
    EngineSubmit,
    GetModelInfo,
    ModelInfo,
    RequestEvent,
    RequestOutput,
    SamplingParams,
    SubmitRequest,
)
from taipan.messages.stats import GetStats, RankStats, Stats
from taipan.ops.tokenizer import Tokenizer, bytes_to_unicode

FRONT, BACK = "inproc://coord-test-front", "inproc://coord-test-back"
WAIT_S = 5.0
ENGINE_STATE = {
    "pause": "PAUSED",
    "unpause": "RUNNING",
    "suspend": "SUSPENDED",
    "resume": "PAUSED",
    "update_weights": "SUSPENDED",
}


class ScriptedEngine:
    """An engine peer. Controls in `refuse` get an ErrorReply with that text; controls in `hold`
    wait, unanswered, until `release()`."""

    def __init__(self, chan: Channel):
        self.chan = chan
        self.weight_version = 0
        self.refuse: dict[str, str] = {}
        self.hold: set[str] = set()
        self.held: list[str] = []
        self.holding = asyncio.Event()
        self.controls: list = []  # every control message received, in order
        self.submits: list[EngineSubmit] = []

    async def hello(self) -> None:
        await self.chan.send(Hello("engine", 0))
        # By field name: the gpu family may grow fields the coordinator does not read.
        known = dict(model="test-model", tokenizer=byte_tokenizer_wire(), eos_token_ids=(2,))
        fields = {f.name: known.get(f.name, 16) for f in dataclasses.fields(ModelLoaded)}
        await self.chan.send(ModelLoaded(**fields))

    async def run(self) -> None:
        while True:
            msg = (await self.chan.recv()).msg
            if isinstance(msg, EngineSubmit):
                self.submits.append(msg)
                for out in outputs_for(msg):
                    await self.chan.send(out)
                continue
            if isinstance(msg, GetStats):
                command = "stats"
            else:
                command = CONTROL_COMMANDS[type(msg)]
                self.controls.append(msg)
            if command in self.hold:
                self.held.append(command)
                self.holding.set()
            else:
                await self.answer(command)

    async def answer(self, command: str) -> None:
        if command in self.refuse:
            await self.chan.send(ErrorReply("control_failed", self.refuse[command], None))
        elif command == "stop":
            await self.chan.send(StopAck("engine-0"))
        elif command == "stats":
            await self.chan.send(Stats("RUNNING", (rank_stats(self.weight_version),)))
        else:
            self.weight_version += command == "update_weights"
            ack = ControlAck(command, ENGINE_STATE[command], self.weight_version)
            await self.chan.send(ack)

    async def release(self) -> None:
        held, self.held = self.held, []
        self.holding.clear()
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
    )


@dataclasses.dataclass
class Harness:
    actor: CoordinatorActor
    engine: ScriptedEngine
    client: Channel
    run: asyncio.Task

    async def send(self, msg) -> None:
        await self.client.send(msg)

    async def recv(self):
        return (await asyncio.wait_for(self.client.recv(), WAIT_S)).msg

    async def ask(self, msg):
        await self.send(msg)
        return await self.recv()

    async def generate(self, request_id: int) -> RequestOutput:
        prompt = np.array([1, 2, 3], np.int32)
        out = await self.ask(SubmitRequest(request_id, prompt, SamplingParams(), False))
        assert isinstance(out, RequestOutput) and out.request_id == request_id
        return out


@contextlib.asynccontextmanager
async def running(front_address: str = FRONT, **timeouts):
    ctx = zmq.asyncio.Context()
    front = make_socket(ctx, zmq.ROUTER, front_address, bind=True, name="clients")
    back = make_socket(ctx, zmq.ROUTER, BACK, bind=True, name="engines")
    engine_chan = make_socket(
        ctx, zmq.DEALER, BACK, bind=False, name="coordinator", identity=b"engine-0"
    )
    client = make_socket(ctx, zmq.DEALER, front_address, bind=False, name="coordinator")
    actor = CoordinatorActor(front, back, 1, "test-model", 512, **timeouts)
    engine = ScriptedEngine(engine_chan)
    try:
        async with asyncio.TaskGroup() as tg:
            run = tg.create_task(actor.run())
            engine_task = tg.create_task(engine.run())
            try:
                await engine.hello()
                h = Harness(actor, engine, client, run)
                # ModelInfo arrives only once the engine is registered and loaded.
                assert isinstance(await h.ask(GetModelInfo()), ModelInfo)
                yield h
            finally:
                actor.stop()
                engine_task.cancel()
    finally:
        for chan in (front, back, engine_chan, client):
            chan.close()
        ctx.term()


def drive(body, front_address: str = FRONT, **timeouts) -> None:
    async def main():
        async with running(front_address, **timeouts) as h:
            await body(h)

    asyncio.run(main())


def assert_error(reply, code: str, *fragments: str) -> None:
    assert isinstance(reply, ErrorReply), reply
    assert reply.code == code and reply.request_id is None, reply
    for fragment in fragments:
        assert fragment in reply.text, reply.text


# --- tests ---------------------------------------------------------------------------------------


def test_legal_sequence_gets_acks_with_states_and_weight_versions():
    state = {"model.norm.weight": np.ones(4, np.float32)}

    async def body(h: Harness):
        acks = [
            await h.ask(msg)
            for msg in [
                Pause(),
                Suspend("offload"),
                UpdateWeights("/ckpt/step-1", None),
                UpdateWeights(None, state),
                Resume(),
                Unpause(),
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
        # The engine got each command as sent: the mode and the weights travel unchanged.
        got = h.engine.controls
        assert [CONTROL_COMMANDS[type(m)] for m in got] == [a.command for a in acks]
        assert got[1] == Suspend("offload") and got[2] == UpdateWeights("/ckpt/step-1", None)
        assert got[3].state["model.norm.weight"].tolist() == [1.0] * 4
        assert h.actor.weight_version == 2

    drive(body)


def test_outputs_relay_every_field_under_the_client_id():
    async def body(h: Harness):
        out = await h.generate(41)
        expected = finished_output(EngineSubmit(41, np.zeros(3, np.int32), None, False, 0.0))
        for field in dataclasses.fields(RequestOutput):
            a, b = getattr(out, field.name), getattr(expected, field.name)
            if isinstance(a, np.ndarray):
                assert a.dtype == b.dtype and np.array_equal(a, b), field.name
            else:
                assert a == b, field.name

    drive(body)


def test_stats_carry_the_fsm_state_and_each_ranks_latest_report():
    async def body(h: Harness):
        assert await h.ask(GetStats()) == Stats("RUNNING", (rank_stats(0),))
        await h.engine.chan.send(Stats("RUNNING", (rank_stats(7),)))  # a periodic report
        await h.ask(Pause())
        # An engine that does not answer in time: the client gets the latest report known.
        h.engine.hold.add("stats")
        assert await h.ask(GetStats()) == Stats("PAUSED", (rank_stats(7),))

    drive(body, stats_timeout=0.2)


def test_illegal_transitions_are_refused_and_nothing_is_forwarded():
    async def body(h: Harness):
        reply = await h.ask(Resume())
        assert_error(reply, "illegal_transition", "resume is illegal while RUNNING; legal: pause")
        assert_error(await h.ask(Stop("test")), "illegal_transition", "stop", "RUNNING")
        assert_error(await h.ask(Unpause()), "illegal_transition", "RUNNING")
        assert_error(await h.ask(UpdateWeights("/x", None)), "illegal_transition", "RUNNING")
        assert h.engine.controls == []
        assert (await h.generate(1)).finished  # still serving, still RUNNING
        assert (await h.ask(Pause())).state == "PAUSED"
        assert_error(await h.ask(Resume()), "illegal_transition", "while PAUSED")

    drive(body)


def test_bad_control_fields_are_bad_requests():
    async def body(h: Harness):
        assert (await h.ask(Pause())).state == "PAUSED"
        assert_error(await h.ask(Suspend("swap")), "bad_request", "'swap'", "persist")
        assert (await h.ask(Suspend(None))).state == "SUSPENDED"
        assert_error(await h.ask(UpdateWeights(None, None)), "bad_request", "exactly one")
        both = UpdateWeights("/x", {"w": np.zeros(1, np.float32)})
        assert_error(await h.ask(both), "bad_request", "exactly one")
        assert len(h.engine.controls) == 2

    drive(body)


def test_engine_error_fails_the_control_and_keeps_the_state():
    async def body(h: Harness):
        await h.ask(Pause())
        h.engine.refuse["suspend"] = "no pinned memory for offload"
        reply = await h.ask(Suspend("offload"))
        assert_error(reply, "control_failed", "stays PAUSED", "engine 0", "no pinned memory")
        assert h.actor.fsm.state == "PAUSED"
        assert_error(await h.ask(Resume()), "illegal_transition", "while PAUSED")
        del h.engine.refuse["suspend"]
        assert await h.ask(Suspend("persist")) == ControlAck("suspend", "SUSPENDED", 0)
        assert (await h.generate(2)).finished

    drive(body)


def test_a_control_while_one_is_pending_is_busy_and_requests_keep_flowing():
    async def body(h: Harness):
        h.engine.hold.add("pause")
        await h.send(Pause())
        await asyncio.wait_for(h.engine.holding.wait(), WAIT_S)
        assert_error(await h.ask(Pause()), "busy", "pause is still waiting")
        # The pending pause blocks no other handler: a request goes through meanwhile.
        out = await h.generate(3)
        assert out.finished and out.new_token_ids.tolist() == [5, 6]
        await h.engine.release()
        assert await h.recv() == ControlAck("pause", "PAUSED", 0)
        assert await h.ask(Unpause()) == ControlAck("unpause", "RUNNING", 0)
        assert len(h.engine.controls) == 2  # the busy one was not forwarded

    drive(body)


def test_an_unanswered_control_times_out_and_a_late_ack_is_ignored():
    async def body(h: Harness):
        h.engine.hold.add("pause")
        reply = await h.ask(Pause())
        assert_error(reply, "control_failed", "engine 0 did not answer pause within 0.2 s")
        assert "stays RUNNING" in reply.text and h.actor.control is None
        h.engine.hold.clear()
        await h.engine.release()  # the late ack
        # The engine answers in order: once this output is back, the late ack was handled.
        await h.generate(4)
        assert h.actor.fsm.state == "RUNNING"
        assert await h.ask(Pause()) == ControlAck("pause", "PAUSED", 0)

    drive(body, control_timeout=0.2)


def test_stop_from_paused_refuses_new_requests_then_exits():
    async def body(h: Harness):
        await h.ask(Pause())
        h.engine.hold.add("stop")
        await h.send(Stop("test over"))
        await asyncio.wait_for(h.engine.holding.wait(), WAIT_S)
        prompt = np.array([1, 2], np.int32)
        out = await h.ask(SubmitRequest(5, prompt, SamplingParams(), False))
        assert out.finished and out.finish_reason == "error" and "stopping" in out.error
        await h.engine.release()
        assert await h.recv() == ControlAck("stop", "STOPPED", 0)
        await asyncio.wait_for(h.run, WAIT_S)  # the coordinator exits by itself
        assert h.engine.controls == [Pause(), Stop("test over")]

    drive(body)


def test_stop_exits_even_when_an_engine_does_not_answer():
    async def body(h: Harness):
        await h.ask(Pause())
        h.engine.hold.add("stop")
        reply = await h.ask(Stop("test over"))
        assert_error(reply, "control_failed", "did not answer stop", "exits anyway")
        await asyncio.wait_for(h.run, WAIT_S)

    drive(body, stop_timeout=0.2)


# --- the public client in front of it -----------------------------------------------------------


@pytest.fixture
def ipc_front(tmp_path) -> str:
    # AsyncClient opens its own zmq context, so it reaches the coordinator over ipc, not inproc.
    return f"ipc://{tmp_path}/front.sock"


def test_client_lifecycle_methods_return_acks_and_raise_control_errors(ipc_front):
    async def body(h: Harness):
        async with AsyncClient(ipc_front, connect_timeout=WAIT_S) as c:
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
            assert h.engine.controls[1] == Suspend("recompute")
            stats = await c.stats()
            assert stats.state == "PAUSED" and stats.ranks == (rank_stats(1),)
        # The blocking twin, in a thread: this loop must keep serving the coordinator.
        client = await asyncio.to_thread(Client, ipc_front, connect_timeout=WAIT_S)
        try:
            assert await asyncio.to_thread(client.unpause) == ControlAck("unpause", "RUNNING", 1)
        finally:
            await asyncio.to_thread(client.close)

    drive(body, ipc_front)


def test_client_sends_stop_words_as_ids_and_collects_log_probs(ipc_front):
    sampling = SamplingParams(
        stop=("ab", "\n"),
        stop_word_ids=((9, 9),),
        return_log_probs=True,
        top_n_logprobs=2,
        return_prompt_top_n_logprobs=True,
    )

    async def body(h: Harness):
        async with AsyncClient(ipc_front, connect_timeout=WAIT_S) as c:
            [done] = await c.generate("xyz", sampling)
            deltas = [d async for d in c.stream("xyz", sampling)]
            [plain] = await c.generate("xyz", SamplingParams(stop="ab"))
            with pytest.raises(ValueError, match="encodes to no tokens"):
                await c.generate("xyz", SamplingParams(stop=("",)))
            tok = c.tokenizer
        ab, nl = (tuple(tok.encode(w, add_special_tokens=False)) for w in ("ab", "\n"))
        assert len(ab) == 2 and len(nl) == 1
        assert h.engine.submits[0].sampling.stop_word_ids == ((9, 9), ab, nl)
        assert h.engine.submits[2].sampling.stop_word_ids == (ab,)  # a bare string: one word

        assert done.token_ids == [5, 6] and done.text == tok.decode([5, 6])
        assert done.log_probs == [-0.5, -0.25]
        assert done.top_n_logprobs == [{5: -0.5, 7: -1.5}, {6: -0.25, 5: -3.0}]
        assert done.prompt_log_probs == [-1.0, -2.0]
        assert done.prompt_top_n_logprobs == [{2: -1.0}, {3: -2.0}]
        assert [e.type for e in done.events] == ["ADD_ENGINE", "FINISH"]
        assert (done.ttft, done.tpot) == (0.125, 0.0625)

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

    drive(body, ipc_front)
