"""Replay check of the engine's scheduler core (`taipan replay --check`, DESIGN.md §10).

Re-drives a fresh Scheduler from an engine's recorded log and compares the two messages that
carry its decisions — `BlockOps` to the allocator and `StepPlan` to the gpu actor — byte for
byte with the recorded ones. Its `StepOutputs` are checked against the contract the coordinator
relies on: every entry is the RequestOutput it is filed as, and no request gets a second
terminal output; and each request's tokens as sent, with its finish reason, must be those the
replay generates (with overlapping steps a sampled token reaches the next plan on the device,
not through the StepPlan, so this is where a changed token shows). Acks and stats follow from
the decisions and are not compared.

Why the log is enough: the engine sets its clock from every inbound message (`self.now`), plans
a step synchronously and sends its first message (BlockOps, or StepPlan when no block changes)
before yielding, records a `NoStep` when a plan comes out empty, and applies a step's result
right when it reads it. So, walking the log in order, every inbound message recorded before a
step's first outbound message was applied before that step was planned, and a result is applied
where it is recorded. What a step's replies and results do is decided by the live engine's own
rules (actors/engine/flow.py's StepFlow), fed here from the log: with overlapping steps the
engine plans and sends step N+1 before it reads step N's result, so at most one step is being
given its blocks (`flow.dispatching`) and at most two have their StepPlan at the gpu
(`flow.at_gpu`, answered in order). The config is not in the log: the launcher writes it to
`config.json` in the record directory.

Expert parallelism (actors/engine/ep.py): the log holds every consensus round (this rank's
messages out, the peers' in), which the replay feeds to the same pure core (`EpMirror`): it
checks that the engine stepped only as the agreements allow (a round first whenever the
schedule says so; no step after an agreement to idle or to pause) and knows a dummy step (an
empty StepPlan, `wire.dummy_plan`) from the scheduler's own.

Pauses (actors/engine/controls.py): a pause in mode wait stops admission when it arrives; what
a pause does once the rank has stopped (abort every request; with clear_cache, a step of its own
that drops the cached prefix) happens where the live engine does it: alone, at the first moment
no step is in flight (mode wait: once no request that started is left, after which the engine
plans nothing); in a group, where the group meets at the "paused" barrier. A FlushCache's step
comes at the first moment no step is in flight. An Unpause before then withdraws the pause.

Pure: decoded messages in, a divergence text out. No sockets, no torch.
"""

from __future__ import annotations

from taipan.actors.config import InferenceConfig
from taipan.actors.engine import wire
from taipan.actors.engine.consensus import (
    Action,
    ConsensusSchedule,
    ProtocolError,
    RoundBook,
    agree,
)
from taipan.actors.engine.flow import EngineError, StepFlow
from taipan.actors.engine.request import EngineRequest
from taipan.actors.engine.scheduler import Scheduler
from taipan.messages.allocator import AllocatorReady, BlockOps, BlockOpsReply
from taipan.messages.codec import MessageError, same_encoding
from taipan.messages.common import ErrorReply
from taipan.messages.consensus import ROUND_MESSAGES, BarrierPoint, EpBarrier, EpHello, EpVote
from taipan.messages.gpu import GpuControlReply, ModelLoaded, NoStep, StepPlan, StepResult
from taipan.messages.lifecycle import FlushCache, Pause, PauseMode, Stop, Unpause
from taipan.messages.mamba_cache import MambaOps, MambaOpsReply
from taipan.messages.requests import AbortRequest, EngineSubmit, FinishReason, StepOutputs
from taipan.messages.summary import summarize


class EpMirror:
    """The consensus as the engine saw it: the rounds of its log, and the steps they allow."""

    def __init__(self, config: InferenceConfig):
        self.schedule = ConsensusSchedule(config.ep_consensus_interval, config.disable_ep_consensus)
        self.book: RoundBook | None = None
        self.early: list = []  # peers' messages before this rank's hello named its group
        self.voted = False  # a round came since the last step
        self.paused = False  # the group just met at the "paused" barrier (EngineReplay takes it)

    def own(self, msg) -> str | None:
        if self.book is None:
            if not isinstance(msg, EpHello):
                return f"{type(msg).__name__} sent before the group's hello"
            self.book = RoundBook(msg.rank, msg.group)
            for early in self.early:
                self.book.add(early)
        if msg.round < self.book.next_round:
            return None  # the same message, to the next peer
        self.book.own(msg)
        return self._settle()

    def peer(self, msg) -> str | None:
        if self.book is None:
            self.early.append(msg)
            return None
        self.book.add(msg)
        return self._settle()

    def _settle(self) -> str | None:
        done = self.book.next_round - 1
        msgs = self.book.complete(done)
        if msgs:
            # a rank joins round r+1 only once round r is complete on its side, so a round
            # still open below one that completed lost a message (from the log, or the wire)
            stale = sorted(r for r in self.book.rounds if r < done)
            if stale:
                missing = ", ".join(f"rank {r}" for r in self.book.missing(stale[0]))
                return (
                    f"consensus round {stale[0]} never completed ({missing} missing) although "
                    f"round {done} did"
                )
        if msgs and isinstance(msgs[0], EpVote):
            self.schedule.agreed(agree(msgs))
            self.voted = True
        elif msgs and isinstance(msgs[0], EpBarrier) and msgs[0].point is BarrierPoint.PAUSED:
            self.schedule.reset()
            self.voted = False
            self.paused = True
        return None

    def step(self) -> str | None:
        """The engine sent a StepPlan (its own or a dummy): the group steps."""
        if self.book is None:
            return "a step before the expert-parallel group's hello"
        if not self.voted and self.schedule.due():
            return "a step without the consensus round the schedule requires first"
        action = self.schedule.action(1)
        if action in (Action.IDLE, Action.PAUSE):
            return f"a step after the group agreed to {action} (round {self.book.next_round - 1})"
        self.schedule.stepped()
        self.voted = False
        return None


_UNEXPECTED = {
    "allocator": "BlockOpsReply arrived with no step waiting for blocks",
    "mamba_cache": "MambaOpsReply arrived with no step waiting for Mamba slots",
}


class EngineReplay:
    """Feed it an engine log's records in order (`inbound` / `outbound`); a non-None return
    is the first divergence."""

    def __init__(self, config: InferenceConfig):
        self.config = config
        self.sched: Scheduler | None = None
        self.flow: StepFlow | None = None  # the step rules, over `sched` (actors/engine/flow.py)
        self.loaded: ModelLoaded | None = None
        self.now = 0.0
        self.stopped = False
        self.steps_checked = 0
        self.finished: set[int] = set()  # requests whose terminal output the engine sent
        self.requests: dict[int, EngineRequest] = {}  # the replay's, until their terminal output
        self.sent: dict[int, list[int]] = {}  # tokens the engine sent each of them so far
        self.ep = EpMirror(config)  # used once the log shows consensus rounds
        self.pause_due: Pause | None = None  # a pause whose effects are still to come
        self.paused = False  # the engine is paused (it refuses another pause)
        self.flush_due = False  # a FlushCache came; its step comes once no step is in flight
        self.flush_next = False  # the next plan is the step that drops the cached prefix

    # --- inbound ------------------------------------------------------------------------------

    def inbound(self, channel: str, msg, time: float) -> str | None:
        """`msg` None: the frames did not decode (the engine's clock still moved)."""
        problem = self._inbound(channel, msg, time)
        if problem is None:
            self._pause_effects()
        return problem

    def _pause_effects(self) -> None:
        """What a pending pause or flush does once the rank stopped (module docstring)."""
        if self.flow is None:
            return
        pause = self.pause_due
        if self.ep.paused:  # the group met at the "paused" barrier
            self.ep.paused = False
            if pause is not None:
                self._paused(pause)
        elif pause is not None and self.ep.book is None and self.flow.idle:
            if pause.mode != PauseMode.WAIT or self.sched.drained():
                self._paused(pause)
        if self.flush_due and self.flow.idle:
            self.flush_due = False
            self.flush_next = self.sched.prefix is not None

    def _paused(self, pause: Pause) -> None:
        """As the live engine's paused_now: abort every request (mode abort), then drop the
        cached prefix in a step of its own (clear_cache: the next plan)."""
        self.pause_due, self.paused = None, True
        if pause.mode == PauseMode.ABORT:
            self.sched.fail_all(FinishReason.ABORT, self.now)
        if pause.clear_cache:
            self.flush_next = self.sched.prefix is not None

    def _inbound(self, channel: str, msg, time: float) -> str | None:
        if self.stopped:
            return None
        self.now = time
        sched = self.sched
        if isinstance(msg, ROUND_MESSAGES):
            try:
                return self.ep.peer(msg)
            except ProtocolError as e:
                return f"consensus: {e}"
        if isinstance(msg, ModelLoaded):
            self.loaded = msg
        elif isinstance(msg, AllocatorReady) and self.loaded is not None:
            self._boot(msg)
        elif isinstance(msg, EngineSubmit):
            vocab = self.loaded.vocab_size if self.loaded else 0
            req, _ = wire.submission(sched, vocab, msg)
            if req is not None:
                sched.add(req, time)
                self.requests[req.request_id] = req
        elif isinstance(msg, AbortRequest) and sched is not None:
            sched.abort(msg.request_id, time)
        elif isinstance(msg, Pause) and channel == "coordinator" and sched is not None:
            if self.pause_due is None and not self.paused:  # (else the engine refuses it)
                self.pause_due = msg
                sched.admitting = sched.admitting and msg.mode != PauseMode.WAIT
        elif isinstance(msg, Unpause) and channel == "coordinator" and sched is not None:
            # (a pause still pending is withdrawn; a refused unpause changes nothing that
            # matters here: a paused engine plans nothing)
            self.pause_due, self.paused = None, False
            sched.admitting = True
        elif isinstance(msg, FlushCache) and channel == "coordinator":
            self.flush_due = True
        elif isinstance(msg, Stop):
            self.stopped = True  # the engine fails everything and exits: nothing left to plan
        elif isinstance(msg, MambaOpsReply) or (
            isinstance(msg, ErrorReply) and channel == "mamba_cache"
        ):
            return self._reply("mamba_cache", channel, msg)
        elif isinstance(msg, BlockOpsReply | StepResult | ErrorReply) and channel != "coordinator":
            if isinstance(msg, StepResult) or channel == "gpu":
                return self._result(channel, msg)
            return self._reply("allocator", channel, msg)
        elif isinstance(msg, GpuControlReply) and msg.error is None and sched is not None:
            if msg.command == "resume" and not msg.kv_valid:
                sched.invalidate_kv()
            elif msg.command in ("update_weights", "commit_weights") and msg.draft:
                sched.draft_updated()
            elif msg.command in ("update_weights", "commit_weights"):
                sched.new_weights(msg.weight_version)
        return None

    def _boot(self, ready: AllocatorReady) -> None:
        try:
            plan = wire.runtime_plan(self.config, self.loaded, ready)
        except wire.BootError:
            self.sched = self.flow = None
            return
        self.sched = wire.new_scheduler(self.config, plan)
        self.flow = StepFlow(self.sched)

    def _reply(self, name: str, channel: str, msg) -> str | None:
        """The step being dispatched gets the reply of `name` ("allocator", "mamba_cache")."""
        if self.flow is None or not self.flow.waits_for(name):
            if isinstance(msg, ErrorReply):
                return None  # an error answering something else
            return _UNEXPECTED[name]
        self.flow.reply_in(name, _as_reply(channel, msg))
        return self._settle()

    def _settle(self) -> None:
        """Once every reply of the step being dispatched is in: fail it (as the live engine's
        failure path), or let its StepPlan come (a step that only freed blocks has none)."""
        flow = self.flow
        if flow.due:
            return None
        batch = flow.dispatching
        failure = flow.settle()
        if failure is not None:
            flow.fail(batch, str(failure), self.now)
        return None

    def _result(self, channel: str, msg) -> str | None:
        """The gpu answered the oldest step at it (a failed dummy ends the engine: nothing
        follows it)."""
        flow = self.flow
        if flow is None or not flow.at_gpu:
            if isinstance(msg, ErrorReply):
                return None  # an error answering a control call, not a step
            return f"{type(msg).__name__} arrived with no step at the gpu"
        step = flow.at_gpu[0]
        try:
            if isinstance(msg, ErrorReply):
                raise _as_reply(channel, msg)
            flow.on_result(msg, self.now)
        except EngineError as e:
            flow.fail(step, str(e), self.now)
        return None

    # --- outbound -----------------------------------------------------------------------------

    def outbound(self, msg, frames: tuple[bytes, ...]) -> str | None:
        if isinstance(msg, StepOutputs):
            return self._check_outputs(msg)
        if isinstance(msg, ROUND_MESSAGES) and not self.stopped:
            try:
                problem = self.ep.own(msg)
            except (ProtocolError, ValueError) as e:
                return f"consensus: {e}"
            self._pause_effects()
            return problem
        if self.stopped or not isinstance(msg, BlockOps | MambaOps | StepPlan | NoStep):
            return None
        if self.sched is None:
            return f"the engine sent {type(msg).__name__} before it could have a scheduler"
        if isinstance(msg, StepPlan) and self.ep.book is not None:
            problem = self.ep.step()
            if problem is not None:
                return problem
            if not len(msg.seq_lens):
                return self._send_dummy(frames)
        flow = self.flow
        if isinstance(msg, StepPlan) and flow.dispatching is not None:
            return self._send_plan(frames)
        if isinstance(msg, MambaOps) and flow.dispatching is not None:
            return self._compare("MambaOps", wire.mamba_ops(flow.dispatching), frames)
        # A new plan: BlockOps, a StepPlan with no block change, or an empty plan (NoStep).
        if flow.dispatching is not None or len(flow.at_gpu) > 1:
            busy = flow.dispatching or flow.at_gpu[0]
            return f"{type(msg).__name__} planned while step {busy.step} is still in flight"
        if self.flush_next:  # the step of a flush: frees and the drop, no forward
            self.flush_next = False
            batch = self.sched.flush_cache()
        else:
            batch = self.sched.schedule(self.now)
        if isinstance(msg, NoStep):
            if batch.is_step:
                return f"the engine planned no step, replay plans step {batch.step}"
            return self._compare("NoStep", NoStep(batch.step), frames)
        if not batch.is_step:
            return f"the engine sent {type(msg).__name__}, replay plans no step"
        ops, mops = flow.begin(batch)
        if isinstance(msg, BlockOps):
            return self._compare("BlockOps", ops, frames)
        if ops is not None:
            return f"the engine skipped the allocator, replay plans {summarize(ops)}"
        if isinstance(msg, MambaOps):
            return self._compare("MambaOps", mops, frames)
        if mops is not None:
            return f"the engine skipped the mamba_cache actor, replay plans {summarize(mops)}"
        return self._send_plan(frames)

    def _send_dummy(self, frames: tuple[bytes, ...]) -> str | None:
        flow = self.flow
        if flow.dispatching is not None:
            return f"a dummy step while step {flow.dispatching.step} waits for its blocks"
        flow.sent_dummy(self.sched.step)
        return self._compare("StepPlan", wire.dummy_plan(self.sched.step), frames)

    def _send_plan(self, frames: tuple[bytes, ...]) -> str | None:
        batch = self.flow.dispatching
        self.flow.sent(batch)
        self.steps_checked += 1
        return self._compare("StepPlan", wire.step_plan(self.sched, batch), frames)

    def _check_outputs(self, msg: StepOutputs) -> str | None:
        problem = msg.problem()
        if problem is not None:
            return problem
        try:
            outputs = msg.decoded()
        except MessageError as e:
            return str(e)
        for i, out in enumerate(outputs):
            rid, finished = int(msg.request_ids[i]), bool(msg.finished[i])
            if (out.request_id, out.finished) != (rid, finished):
                return (
                    f"StepOutputs entry {i} is filed as request {rid} (finished {finished}) "
                    f"but holds request {out.request_id} (finished {out.finished})"
                )
            if finished and rid in self.finished:
                return f"request {rid} got a second terminal output"
            self.sent.setdefault(rid, []).extend(out.new_token_ids.tolist())
            if finished:
                self.finished.add(rid)
                problem = self._compare_ending(rid, out.finish_reason)
                if problem is not None:
                    return problem
        return None

    def _compare_ending(self, rid: int, reason) -> str | None:
        """The engine ended request `rid`: what it sent must be what the replay generated. Not
        compared where the replay cannot follow (a request it never admitted, or one ended by
        a stop or by the rank's death, which the log does not drive)."""
        mine, sent = self.requests.pop(rid, None), self.sent.pop(rid, [])
        if mine is None or mine.finish_reason is None:
            return None
        if sent == mine.generated and str(reason) == str(mine.finish_reason):
            return None
        return (
            f"request {rid}: the engine sent {len(sent)} tokens ({reason}) {sent[:8]}..., "
            f"replay generates {len(mine.generated)} ({mine.finish_reason}) "
            f"{mine.generated[:8]}..."
        )

    @staticmethod
    def _compare(kind: str, replayed, frames) -> str | None:
        if replayed is None:
            return f"the engine sent {kind}, replay plans no {kind}"
        if same_encoding(replayed, frames):
            return None
        return f"{kind} differs: replay plans {summarize(replayed)}"


def _as_reply(channel: str, msg):
    """A reply as the live engine reads it: an error answer is the error its read raises."""
    return EngineError(f"{channel}: {msg.text}") if isinstance(msg, ErrorReply) else msg
