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
where it is recorded. With overlapping steps the engine plans and sends step N+1 before it reads
step N's result: at most one step is being given its blocks (`dispatching`) and at most two
have their StepPlan at the gpu (`at_gpu`, answered in order). The config is not in the log: the
launcher writes it to `config.json` in the record directory.

Expert parallelism (actors/engine/ep.py): the log holds every consensus round (this rank's
messages out, the peers' in), which the replay feeds to the same pure core (`EpMirror`): it
checks that the engine stepped only as the agreements allow (a round first whenever the
schedule says so; no step after an agreement to idle or to pause) and knows a dummy step (an
empty StepPlan, `wire.dummy_plan`) from the scheduler's own.

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
from taipan.actors.engine.request import EngineRequest
from taipan.actors.engine.scheduler import Scheduler, StepBatch
from taipan.messages.allocator import AllocatorReady, BlockOps, BlockOpsReply
from taipan.messages.codec import MessageError, encode
from taipan.messages.common import ErrorReply
from taipan.messages.consensus import ROUND_MESSAGES, BarrierPoint, EpBarrier, EpHello, EpVote
from taipan.messages.gpu import GpuControlReply, ModelLoaded, NoStep, StepPlan, StepResult
from taipan.messages.lifecycle import Stop
from taipan.messages.mamba_cache import MambaOps, MambaOpsReply
from taipan.messages.requests import AbortRequest, EngineSubmit, StepOutputs
from taipan.messages.summary import summarize


class EpMirror:
    """The consensus as the engine saw it: the rounds of its log, and the steps they allow."""

    def __init__(self, config: InferenceConfig):
        self.schedule = ConsensusSchedule(config.ep_consensus_interval, config.disable_ep_consensus)
        self.book: RoundBook | None = None
        self.early: list = []  # peers' messages before this rank's hello named its group
        self.voted = False  # a round came since the last step

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
        msgs = self.book.complete(self.book.next_round - 1)
        if msgs and isinstance(msgs[0], EpVote):
            self.schedule.agreed(agree(msgs))
            self.voted = True
        elif msgs and isinstance(msgs[0], EpBarrier) and msgs[0].point is BarrierPoint.PAUSED:
            self.schedule.reset()
            self.voted = False
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


class _Dummy:
    """A dummy step at the gpu (answered like a step, changes no request)."""

    def __init__(self, step: int):
        self.step = step


class EngineReplay:
    """Feed it an engine log's records in order (`inbound` / `outbound`); a non-None return
    is the first divergence."""

    def __init__(self, config: InferenceConfig):
        self.config = config
        self.sched: Scheduler | None = None
        self.loaded: ModelLoaded | None = None
        self.dispatching: StepBatch | None = None  # planned, its StepPlan not yet sent
        # Of the dispatching step: the replies not read yet ("allocator", "mamba_cache"), and
        # why it fails once they are (the engine reads both before it acts on either).
        self.replies_due: set[str] = set()
        self.failure: str | None = None
        self.at_gpu: list[StepBatch] = []  # StepPlan sent, result not yet applied (oldest first)
        self.now = 0.0
        self.stopped = False
        self.steps_checked = 0
        self.finished: set[int] = set()  # requests whose terminal output the engine sent
        self.requests: dict[int, EngineRequest] = {}  # the replay's, until their terminal output
        self.sent: dict[int, list[int]] = {}  # tokens the engine sent each of them so far
        self.ep = EpMirror(config)  # used once the log shows consensus rounds

    # --- inbound ------------------------------------------------------------------------------

    def inbound(self, channel: str, msg, time: float) -> str | None:
        """`msg` None: the frames did not decode (the engine's clock still moved)."""
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
            try:
                self.sched = wire.new_scheduler(
                    self.config, wire.runtime_plan(self.config, self.loaded, msg)
                )
            except wire.BootError:
                self.sched = None
        elif isinstance(msg, EngineSubmit):
            vocab = self.loaded.vocab_size if self.loaded else 0
            req, _ = wire.submission(sched, vocab, msg)
            if req is not None:
                sched.add(req, time)
                self.requests[req.request_id] = req
        elif isinstance(msg, AbortRequest) and sched is not None:
            sched.abort(msg.request_id, time)
        elif isinstance(msg, Stop):
            self.stopped = True  # the engine fails everything and exits: nothing left to plan
        elif isinstance(msg, MambaOpsReply) or (
            isinstance(msg, ErrorReply) and channel == "mamba_cache"
        ):
            return self._mamba_reply(msg)
        elif isinstance(msg, BlockOpsReply | StepResult | ErrorReply) and channel != "coordinator":
            return self._step_reply(channel, msg)
        elif isinstance(msg, GpuControlReply) and msg.error is None and sched is not None:
            if msg.command == "resume" and not msg.kv_valid:
                sched.invalidate_kv()
            elif msg.command in ("update_weights", "commit_weights"):
                sched.new_weights(msg.weight_version)
        return None

    def _step_reply(self, channel: str, msg) -> str | None:
        sched = self.sched
        if isinstance(msg, BlockOpsReply) or (isinstance(msg, ErrorReply) and channel != "gpu"):
            batch = self.dispatching
            if batch is None:
                if isinstance(msg, ErrorReply):
                    return None  # an error answering something else
                return "BlockOpsReply arrived with no step waiting for blocks"
            self.replies_due.discard("allocator")
            if isinstance(msg, ErrorReply):
                self.failure = f"{channel}: {msg.text}"
            elif not msg.ok:
                sched.refused(batch, msg)
                self.failure = f"allocator refused a planned step: {msg.error}"
            else:
                sched.assign_blocks(batch, msg)
            return self._settle(batch)
        if not self.at_gpu:
            if isinstance(msg, ErrorReply):
                return None  # an error answering a control call, not a step
            return f"{type(msg).__name__} arrived with no step at the gpu"
        batch = self.at_gpu[0]
        if isinstance(batch, _Dummy):  # (a failed one ends the engine: nothing to follow)
            self.at_gpu.pop(0)
            return None
        if isinstance(msg, ErrorReply):
            return self._fail(batch, f"gpu: {msg.text}")
        if msg.step != batch.step:
            return self._fail(batch, f"gpu answered step {msg.step}, expected {batch.step}")
        if msg.error is not None:
            return self._fail(batch, f"forward failed: {msg.error}")
        self.at_gpu.pop(0)
        sched.update(batch, msg, self.now)
        return None

    def _mamba_reply(self, msg) -> str | None:
        batch = self.dispatching
        if batch is None or "mamba_cache" not in self.replies_due:
            if isinstance(msg, ErrorReply):
                return None  # an error answering something else
            return "MambaOpsReply arrived with no step waiting for Mamba slots"
        self.replies_due.discard("mamba_cache")
        if isinstance(msg, ErrorReply):
            self.sched.mamba_unserved(batch)
            self.failure = self.failure or f"mamba_cache: {msg.text}"
        else:
            self.sched.assign_mamba(batch, msg)
            if not msg.ok:
                self.failure = self.failure or f"mamba_cache refused: {msg.error}"
        return self._settle(batch)

    def _settle(self, batch: StepBatch) -> None:
        """Once every reply of the dispatching step is in: fail it, or let its StepPlan come
        (a step that only freed blocks has none)."""
        if self.replies_due:
            return None
        if self.failure is not None:
            failure, self.failure = self.failure, None
            return self._fail(batch, failure)
        if not batch.chunks:
            self.dispatching = None
        return None

    def _fail(self, batch: StepBatch, error: str) -> None:
        """The step failed (as the live engine's failure path): its requests end."""
        self.sched.update(batch, None, self.now, error=error)
        if batch is self.dispatching:
            self.dispatching = None
        else:
            self.at_gpu.remove(batch)
        return None

    # --- outbound -----------------------------------------------------------------------------

    def outbound(self, msg, frames: tuple[bytes, ...]) -> str | None:
        if isinstance(msg, StepOutputs):
            return self._check_outputs(msg)
        if isinstance(msg, ROUND_MESSAGES) and not self.stopped:
            try:
                return self.ep.own(msg)
            except (ProtocolError, ValueError) as e:
                return f"consensus: {e}"
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
        if isinstance(msg, StepPlan) and self.dispatching is not None:
            return self._send_plan(frames)
        if isinstance(msg, MambaOps) and self.dispatching is not None:
            return self._compare("MambaOps", wire.mamba_ops(self.dispatching), frames)
        # A new plan: BlockOps, a StepPlan with no block change, or an empty plan (NoStep).
        if self.dispatching is not None or len(self.at_gpu) > 1:
            busy = self.dispatching or self.at_gpu[0]
            return f"{type(msg).__name__} planned while step {busy.step} is still in flight"
        batch = self.sched.schedule(self.now)
        ops, mops = wire.block_ops(batch), wire.mamba_ops(batch)
        if isinstance(msg, NoStep):
            if batch.is_step:
                return f"the engine planned no step, replay plans step {batch.step}"
            return self._compare("NoStep", NoStep(batch.step), frames)
        if not batch.is_step:
            return f"the engine sent {type(msg).__name__}, replay plans no step"
        self.dispatching = batch
        self.replies_due = {n for n, m in (("allocator", ops), ("mamba_cache", mops)) if m}
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
        if self.dispatching is not None:
            return f"a dummy step while step {self.dispatching.step} waits for its blocks"
        self.at_gpu.append(_Dummy(self.sched.step))
        return self._compare("StepPlan", wire.dummy_plan(self.sched.step), frames)

    def _send_plan(self, frames: tuple[bytes, ...]) -> str | None:
        batch, self.dispatching = self.dispatching, None
        self.at_gpu.append(batch)
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
        if tuple(bytes(f) for f in encode(replayed)) == tuple(bytes(f) for f in frames):
            return None
        return f"{kind} differs: replay plans {summarize(replayed)}"
