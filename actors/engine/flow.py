"""The step protocol's rules, written once and without I/O: `StepFlow`. The live engine
(actors/engine/step.py's StepRunner) feeds it from its sockets, the replay checker
(actors/engine/check.py) from the log, so the two cannot take a step two ways.

A step's way through it:
- `begin(batch)`: the batch is being dispatched; returns its BlockOps (with its sliding-window
  releases: `wire.block_ops`) and MambaOps (None for one it does not need), whose replies are
  now due.
- `reply_in(name, reply)`: each reply ("allocator", "mamba_cache"), or the error that came
  instead of it.
- `settle()`, once none is due: applies them, the Mamba reply first and then the allocator's
  (the live engine's order; the mirrors end in the same state either way), and says why the
  step fails, if it does. The allocator's problem is named before the Mamba one.
- `sent(batch)`: its StepPlan went to the gpu (a step that only frees blocks sends none and is
  done at `settle`); `sent_dummy(step)`: an expert-parallel dummy step went instead.
- `on_result(result)`: the gpu answered the oldest step at it (answers come in order).
- `fail(step, error)`: a failed step ends its requests, wherever it is.

Owns: the step being dispatched (`dispatching`, until its StepPlan is sent), its replies until
they are applied, the allocator reply whose hash events the coordinator must see
(`block_reply`), and the steps at the gpu (`at_gpu`, oldest first: one, or two with
overlapping steps). Applies replies through the mirrors (`apply_block_reply` here, for the
scheduler's block budget and the prefix index; MambaMirror.served / unserved) and results
through Scheduler.update.
Must not touch: sockets, the clock (times come in as arguments), logs, counters.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from taipan.actors.engine.batch import StepBatch
from taipan.actors.engine.request import EngineRequest
from taipan.actors.engine.scheduler import Scheduler
from taipan.actors.engine.wire import block_ops, mamba_ops
from taipan.messages.allocator import BlockOps, BlockOpsReply
from taipan.messages.gpu import StepResult
from taipan.messages.mamba_cache import MambaOps, MambaOpsReply


class EngineError(RuntimeError):
    """An expected failure of a step or a call (a refusal, an error answer): logged in a line."""


class DummyStep(NamedTuple):
    """A dummy step at the gpu (expert parallelism): answered like a step, changes no request.
    `step` is the last step the scheduler planned."""

    step: int


class StepFlow:
    """The reply-ordering rules of one engine's steps (module docstring), over `sched`."""

    def __init__(self, sched: Scheduler):
        self.sched = sched
        self.dispatching: StepBatch | None = None  # planned, its StepPlan not yet sent
        self.due: set[str] = set()  # of `dispatching`: "allocator", "mamba_cache" not yet in
        self.block_reply: BlockOpsReply | None = None  # of `dispatching`, once it came
        self._replies: dict[str, BlockOpsReply | MambaOpsReply | Exception] = {}  # not applied
        self.at_gpu: deque[StepBatch | DummyStep] = deque()  # StepPlan sent, no result yet

    @property
    def idle(self) -> bool:
        """No step being dispatched and none at the gpu."""
        return self.dispatching is None and not self.at_gpu

    # --- dispatching one step -----------------------------------------------------------------

    def begin(self, batch: StepBatch) -> tuple[BlockOps | None, MambaOps | None]:
        """`batch` is being dispatched: its messages (None: not needed), whose replies are due."""
        self.dispatching, self.block_reply, self._replies = batch, None, {}
        ops, mops = block_ops(batch), mamba_ops(batch)
        self.due = {name for name, m in (("allocator", ops), ("mamba_cache", mops)) if m}
        return ops, mops

    def waits_for(self, name: str) -> bool:
        """Whether the step being dispatched waits for the reply of `name`."""
        return self.dispatching is not None and name in self.due

    def reply_in(self, name: str, reply: BlockOpsReply | MambaOpsReply | Exception) -> None:
        """The reply of `name` ("allocator" or "mamba_cache") to the step being dispatched, or
        the error that came instead of it; applied at `settle`."""
        self.due.discard(name)
        self._replies[name] = reply
        if isinstance(reply, BlockOpsReply):
            self.block_reply = reply

    def settle(self) -> Exception | None:
        """Every reply is in: apply them. Returns why the step fails (`fail` it then), else
        None: its StepPlan goes out next (`sent`), or, with no chunk, the step is done."""
        batch = self.dispatching
        mamba_problem = self._apply_mamba(batch)
        failure = self._apply_blocks(batch) or mamba_problem
        if failure is None and not batch.chunks:
            self.dispatching = None
        return failure

    def _apply_mamba(self, batch: StepBatch) -> Exception | None:
        reply = self._replies.pop("mamba_cache", None)
        if reply is None:
            return None
        if isinstance(reply, Exception):  # the pool acted on nothing: the mirror takes it back
            self.sched.mamba.unserved(batch)
            return reply
        try:
            self.sched.mamba.served(batch, reply)
        except Exception as err:
            return err
        if not reply.ok:
            return EngineError(f"mamba_cache refused a planned step: {reply.error or 'refused'}")
        return None

    def _apply_blocks(self, batch: StepBatch) -> Exception | None:
        reply = self._replies.pop("allocator", None)
        if reply is None or isinstance(reply, Exception):
            return reply
        try:
            apply_block_reply(self.sched, batch, reply)
        except Exception as err:
            return err
        if not reply.ok:
            return EngineError(f"allocator refused a planned step: {reply.error}")
        return None

    # --- at the gpu ---------------------------------------------------------------------------

    def sent(self, batch: StepBatch) -> None:
        """The step's StepPlan went to the gpu."""
        self.dispatching, self.due = None, set()
        self.at_gpu.append(batch)

    def sent_dummy(self, step: int) -> None:
        self.at_gpu.append(DummyStep(step))

    def on_result(self, result: StepResult, now: float) -> list[EngineRequest]:
        """The gpu's answer to the oldest step at it, applied: the requests with something to
        report. Raises EngineError when the step failed (a real step stays at the gpu until
        `fail` ends it; a dummy is gone either way)."""
        head = self.at_gpu[0]
        if isinstance(head, DummyStep):
            self.at_gpu.popleft()
            if result.error is not None or result.step != head.step:
                raise EngineError(result.error or f"the gpu answered step {result.step}")
            return []
        if result.step != head.step:
            raise EngineError(f"gpu answered step {result.step}, expected {head.step}")
        if result.error is not None:
            raise EngineError(f"forward failed: {result.error}")
        self.at_gpu.popleft()
        return self.sched.update(head, result, now)

    def fail(self, step: StepBatch | DummyStep, error: str, now: float) -> list[EngineRequest]:
        """End a failed step (the one being dispatched, or one at the gpu): its requests end
        with `error`, each with its terminal output (returned)."""
        if step is self.dispatching:
            self.dispatching, self.due = None, set()
        for i, s in enumerate(self.at_gpu):
            if s is step:
                del self.at_gpu[i]
                break
        if isinstance(step, DummyStep):
            return []
        return self.sched.update(step, None, now, error=error)


def apply_block_reply(sched: Scheduler, batch: StepBatch, reply: BlockOpsReply) -> None:
    """The allocator's reply to `batch`'s BlockOps. Served, its new blocks go to their requests;
    served or refused, its free count and hash events are the truth (the prefix index, and the
    Mamba snapshots its evictions void)."""
    if reply.ok:
        block_ids = reply.block_ids
        offset = 0
        for c in batch.chunks:
            new = block_ids[offset : offset + c.new_blocks].tolist()
            c.request.blocks.extend(new)
            if sched.prefix is not None and new:
                sched.prefix.hold(new)
            offset += c.new_blocks
        if offset != len(block_ids):
            raise ValueError(f"allocator returned {len(block_ids)} blocks, expected {offset}")
    sched.num_free_blocks = reply.num_free
    if sched.prefix is not None:
        sched.prefix.apply(reply, batch.drop_cache)
        # (A step that dropped the cache evicts only hashes from before the drop, whose
        # snapshots the mirror dropped with them: a snapshot it takes itself stays.)
        if sched.mamba_snapshots and not batch.drop_cache:
            sched.mamba.kv_evicted(reply.evicted_hashes.tolist())
