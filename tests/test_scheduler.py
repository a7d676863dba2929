"""The engine's Scheduler, driven the way EngineActor drives it, against a fake allocator (a free
list) and a fake gpu that writes every step into a shadow KV cache and checks that each sequence
reads back exactly its own tokens.

The fake gpu samples token (position * 7) % 50 + 10 for the token at `position`, so each request's
output is known in advance (`expected_output`) whatever the batching, chunking or block layout.
With `overlap` the harness plans step N+1 before it applies step N's result, as the engine does
with `overlap_steps`: the fake gpu runs each step when it is sent (in order, as a device stream)
and takes the input ids `prev_rows` points at from the tokens it sampled in the step before.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from taipan.actors.config import RuntimePlan
from taipan.actors.engine import wire
from taipan.actors.engine.batch_arrays import _block_tables, plan_arrays
from taipan.actors.engine.flow import apply_block_reply
from taipan.actors.engine.outputs import output_of, step_outputs
from taipan.actors.engine.request import EngineRequest, Status
from taipan.actors.engine.scheduler import Scheduler, StepBatch
from taipan.actors.engine.wire import derive_seed
from taipan.messages.allocator import BlockOpsReply
from taipan.messages.codec import encode
from taipan.messages.gpu import NoStep, StepResult
from taipan.messages.requests import SamplingParams, StepOutputs
from tests.fuzz import fuzz_settings

REASONS = {"stop", "length", "abort"}


def fake_token(position: int) -> int:
    return (position * 7) % 50 + 10


def fake_log_prob(position: int) -> float:
    """The fake gpu's log-prob of the token at `position` (prompt or generated), as the float32
    it travels as."""
    return float(np.float32(-position / 1000))


def make_plan(
    num_blocks=64,
    block_size=4,
    max_requests=8,
    max_tokens=32,
    max_sequence_length=256,
    eos=(),
    max_paused_blocks=None,
) -> RuntimePlan:
    return RuntimePlan(
        num_blocks=num_blocks,
        block_size=block_size,
        max_requests=max_requests,
        max_tokens=max_tokens,
        max_sequence_length=max_sequence_length,
        eos_token_ids=tuple(eos),
        max_paused_blocks=max_paused_blocks,
    )


def make_request(rid: int, prompt_len: int, max_tokens: int = 4, stream=False, **sampling):
    prompt = ((np.arange(prompt_len) * 31 + rid * 7) % 1000 + 100).astype(np.int32)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.5, top_k=rid, **sampling)
    return EngineRequest(rid, prompt, params, stream, arrival_time=float(rid), seed=1000 + rid)


def true_tokens(req: EngineRequest, n: int) -> np.ndarray:
    """The first `n` tokens of the request as the fake gpu makes them: prompt, then the tokens
    it samples (known before the host sees them)."""
    p = len(req.prompt)
    tail = [fake_token(q) for q in range(p, n)]
    return np.concatenate([req.prompt[:n], np.asarray(tail, dtype=np.int64)]).astype(np.int64)


def expected_output(req: EngineRequest, plan: RuntimePlan) -> tuple[list[int], str]:
    """What the request generates with the fake gpu, and why it stops."""
    s, p, out = req.sampling, len(req.prompt), []
    while True:
        tok = fake_token(p + len(out))
        out.append(tok)
        if (not s.ignore_eos and tok in plan.eos_token_ids) or tok in s.stop_token_ids:
            return out, "stop"
        if len(out) >= s.max_tokens or p + len(out) >= plan.max_sequence_length:
            return out, "length"


class FakePool:
    """The allocator's contract (messages/allocator.py): frees by request id, then allocations,
    all or nothing; lowest free block first."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.free = list(range(num_blocks))
        self.held: dict[int, list[int]] = {}

    def apply(self, free_ids, allocs: list[tuple[int, int]]) -> tuple[np.ndarray, int]:
        for rid in free_ids:
            self.free.extend(self.held.pop(rid, []))
        self.free.sort()
        total = sum(n for _, n in allocs)
        assert total <= len(self.free), f"planned {total} blocks, {len(self.free)} free"
        out = []
        for rid, n in allocs:
            taken, self.free = self.free[:n], self.free[n:]
            self.held.setdefault(rid, []).extend(taken)
            out.extend(taken)
        return np.asarray(out, dtype=np.int32), len(self.free)


class Harness:
    """One rank's step loop (EngineActor._run_steps) around a real Scheduler."""

    def __init__(self, plan: RuntimePlan, chunked: bool, overlap: bool = False):
        self.plan = plan
        self.overlap = overlap
        self.running: tuple[StepBatch, StepResult] | None = None  # sent, result not applied
        self.device_sampled = np.zeros(0, dtype=np.int64)  # the fake gpu's last sampled tokens
        self.device_rows = np.zeros(0, dtype=bool)  # which rows of its last step sampled
        self.sched = Scheduler(plan, chunked, track_paused_events=True)
        self.now = 0.0
        self.pool = FakePool(plan.num_blocks)
        size = plan.num_blocks * plan.block_size
        self.kv_token = np.full(size, -1, dtype=np.int64)
        self.kv_owner = np.full(size, -1, dtype=np.int64)
        self.added: dict[int, EngineRequest] = {}
        self.add_order: list[int] = []
        self.first_scheduled: list[int] = []
        self.reports: dict[int, list[tuple[list[int], bool]]] = {}
        self.ended: dict[int, EngineRequest] = {}
        self.abort_called: set[int] = set()
        self.history: list[list[tuple[int, int, bool]]] = []  # per step: (id, tokens, samples)

    # --- what the actor's handlers do ---------------------------------------------------------

    def add(self, req: EngineRequest) -> str | None:
        problem = self.sched.check(len(req.prompt), req.sampling)
        if problem is None:
            self.sched.add(req, self.now)
            self.added[req.request_id] = req
            self.add_order.append(req.request_id)
        return problem

    def abort(self, rid: int) -> None:
        if rid in self.sched.requests:
            self.abort_called.add(rid)
        ended = self.sched.abort(rid, self.now)
        if ended is not None:
            assert ended.request_id == rid and ended.finish_reason == "abort"
            assert ended.status is Status.FINISHED and ended not in self.sched.waiting
            self.emit([ended])

    def emit(self, requests: list[EngineRequest]) -> None:
        """EngineActor._emit: the next RequestOutput of each reported request (one StepOutputs,
        see `sent`), as the engine builds it (`step_outputs`, streamed outputs packed straight
        into their frames): the same bytes and the same progress as each one's `output_of`."""
        before = [r.num_streamed for r in requests]
        msg = step_outputs(requests)
        progress = [r.num_streamed for r in requests]
        for r, n in zip(requests, before, strict=True):
            r.num_streamed = n
        outputs = [output_of(r) for r in requests]
        assert [r.num_streamed for r in requests] == progress
        if outputs:
            assert encode(msg) == encode(StepOutputs.of(outputs))
            self.sent(outputs)
        for r, out in zip(requests, outputs, strict=True):
            new, finished = out.new_token_ids.tolist(), out.finished
            assert finished == (r.finish_reason is not None)
            assert len(new) or finished, "an output with nothing in it"
            self.reports.setdefault(r.request_id, []).append((new, finished))
            if finished:
                assert r.request_id not in self.ended, f"request {r.request_id} ended twice"
                assert r.status is Status.FINISHED and r.blocks == []
                self.ended[r.request_id] = r

    def sent(self, outputs: list) -> None:
        """Hook: the outputs `emit` sends in one message."""

    # --- one step -----------------------------------------------------------------------------

    def record(self, direction: str, channel: str, msg) -> None:
        """Hook: a message the engine sends or reads, as it would be logged (see
        tests/test_engine_check.py)."""

    def step(self, in_flight: Callable[[], None] = lambda: None) -> bool:
        """One step loop iteration: plan a step and send it, then apply the result of the one
        sent before it (with `overlap`; else of this one). False when the engine would go idle.
        The messages are the live engine's, in its order."""
        sched = self.sched
        self.now += 1.0
        planned = None
        if sched.has_work():
            planned = sched.schedule(self.now)
            self.check_batch(planned)
            if not planned.is_step:
                self.record("out", "gpu", NoStep(planned.step))
                self.emit(planned.ended)
                planned = None
        sent = None
        if planned is not None:
            ops, mops = wire.block_ops(planned), wire.mamba_ops(planned)
            if ops is not None:
                self.record("out", "allocator", ops)
            if mops is not None:  # sent before either reply is read, as the engine does
                self.record("out", "mamba_cache", mops)
            if ops is not None:
                reply = self.allocate(planned, ops)
                self.now += 0.1
                self.record("in", "allocator", reply)
                self.apply_blocks(planned, reply)
            if mops is not None:
                mreply = self.mamba_slots(planned, mops)
                self.now += 0.1
                self.record("in", "mamba_cache", mreply)
                sched.mamba.served(planned, mreply)
            self.check_blocks(planned)
            if planned.chunks:
                plan = wire.step_plan(sched, planned)
                self.record("out", "gpu", plan)
                arrays = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)}
                self.check_plan(planned, arrays)
                sent = (planned, self.gpu(planned, arrays))
            self.emit(planned.ended)
        in_flight()  # messages the actor handles while the forward runs
        self.now += 0.5
        collected = self.running is not None
        if collected:
            self.collect(*self.running)
        if sent is not None:
            self.running = sent
            if not self.overlap:
                self.collect(*sent)
        return planned is not None or collected

    def apply_blocks(self, batch: StepBatch, reply: BlockOpsReply) -> None:
        """Hook: the allocator's reply applied (actors/engine/flow.py)."""
        apply_block_reply(self.sched, batch, reply)

    def allocate(self, batch: StepBatch, ops) -> BlockOpsReply:
        """The allocator's answer to the step's BlockOps."""
        allocs = [(c.request.request_id, c.new_blocks) for c in batch.chunks if c.new_blocks]
        block_ids, num_free = self.pool.apply(batch.free_ids, allocs)
        return BlockOpsReply(batch.step, True, block_ids, num_free, None)

    def mamba_slots(self, batch: StepBatch, ops):
        """The mamba_cache actor's answer to the step's MambaOps (hybrid harnesses only)."""
        raise AssertionError(f"a MambaOps without a Mamba model: {ops}")

    def collect(self, batch: StepBatch, result: StepResult) -> None:
        self.record("in", "gpu", result)
        self.emit(self.sched.update(batch, result, self.now))
        self.running = None
        self.check_after_update()

    def run(self, max_steps: int = 10_000) -> int:
        for n in range(max_steps):
            if not self.step():
                assert not self.sched.has_work(), "the scheduler has work but plans nothing"
                return n
        raise AssertionError("did not finish")

    def gpu(self, batch: StepBatch, a: dict[str, np.ndarray]) -> StepResult:
        """Write the step's K/V, check each sequence reads its own tokens, sample; log-probs
        are `fake_log_prob` of the position of the token they are for."""
        bs = self.plan.block_size
        owners = np.repeat(
            [c.request.request_id for c in batch.chunks], np.diff(a["query_start_loc"])
        )
        ids = a["input_ids"].astype(np.int64)
        prev = a["prev_rows"]
        if len(prev):  # as the worker: only rows the previous step sampled
            assert len(prev) == len(ids) and prev.min() >= -1
            wanted = prev[prev >= 0]
            assert len(wanted) and wanted.max() < len(self.device_rows)
            assert self.device_rows[wanted].all(), "prev_rows names a row that did not sample"
            ids = np.where(prev >= 0, self.device_sampled[np.maximum(prev, 0)], ids)
        write = a["slot_mapping"] >= 0  # -1: a token whose K/V is already cached
        self.kv_token[a["slot_mapping"][write]] = ids[write]
        self.kv_owner[a["slot_mapping"][write]] = owners[write]
        void = self.void_rows(a)
        for i, c in enumerate(batch.chunks):
            if i in void:  # (its input was a replaced token: it reads that, and is dropped)
                continue
            seq_len = int(a["seq_lens"][i])
            pos = self.keys_read(int(a["positions"][a["query_start_loc"][i]]), seq_len)
            slots = a["block_tables"][i][pos // bs].astype(np.int64) * bs + pos % bs
            if self.sched.prefix is None:  # (with prefix caching, blocks are shared)
                assert (self.kv_owner[slots] == c.request.request_id).all(), "reads another's KV"
            assert np.array_equal(self.kv_token[slots], true_tokens(c.request, seq_len)[pos])
        toks = [fake_token(int(a["seq_lens"][i])) for i in range(len(batch.chunks))]
        self.device_sampled = np.asarray(toks, dtype=np.int64)
        self.device_rows = a["sample"] == 1
        wanted = a["prompt_targets"] >= 0
        for i, c in enumerate(batch.chunks):  # targets are the prompt's next tokens
            lo, hi = a["query_start_loc"][i], a["query_start_loc"][i + 1]
            for t in np.flatnonzero(wanted[lo:hi]) + lo:
                assert a["prompt_targets"][t] == c.request.prompt[a["positions"][t] + 1]
        lps = [fake_log_prob(int(n)) for n in a["seq_lens"]]
        n_top = int(a["top_n"].max(initial=0))
        top_ids = np.tile(np.arange(n_top, dtype=np.int32), (len(toks), 1))
        return StepResult(
            batch.step,
            np.where(a["sample"] == 1, toks, -1).astype(np.int32),
            None,
            0.0,
            log_probs=np.where(a["logprobs"] == 1, lps, np.nan).astype(np.float32),
            top_n_ids=top_ids,
            top_n_log_probs=-top_ids.astype(np.float32),
            prompt_log_probs=np.asarray(
                [fake_log_prob(int(p) + 1) for p in a["positions"][wanted]], np.float32
            ),
            prompt_top_n_ids=np.zeros((int(wanted.sum()), n_top), np.int32),
            prompt_top_n_log_probs=np.zeros((int(wanted.sum()), n_top), np.float32),
        )

    def void_rows(self, a: dict[str, np.ndarray]) -> set[int]:
        """Rows of the step whose input is a token the step before replaced (none here)."""
        return set()

    # --- invariants ---------------------------------------------------------------------------

    def keys_read(self, start: int, seq_len: int) -> np.ndarray:
        """The positions whose K/V the queries [start, seq_len) of a sequence read: all of its
        context (a sliding window reads fewer: tests/test_engine_window.py)."""
        return np.arange(seq_len)

    def check_batch(self, batch: StepBatch) -> None:
        plan, sched = self.plan, self.sched
        assert batch.num_tokens <= plan.max_tokens
        assert len(batch.chunks) <= plan.max_requests
        assert len(sched.running) <= plan.max_requests
        ids = [c.request.request_id for c in batch.chunks]
        assert len(ids) == len(set(ids))
        assert all(c.num_new_tokens >= 1 for c in batch.chunks)
        assert all(c.request.status is Status.RUNNING for c in batch.chunks)
        assert len(batch.free_ids) == len(set(batch.free_ids))
        evicted = {r.request_id for r in sched.waiting if r.history.checkpoints}
        if sched.prefix is None and not sched.window:  # (a "recompute" resume frees and
            # re-admits at once: with prefix caching, or with released blocks)
            assert not set(batch.free_ids) & (set(sched.requests) - evicted)
        assert not set(ids) & {r.request_id for r in sched.paused}
        assert all(r.status is Status.PAUSED and r.blocks for r in sched.paused)
        longer = [c.num_new_tokens != 1 for c in batch.chunks]
        assert longer == sorted(longer), "one-token rows must come first"
        # Admission order is the order requests joined `running` (rows are sorted by length).
        for rid in [r.request_id for r in sched.running]:
            if rid in ids and rid not in self.first_scheduled:
                self.first_scheduled.append(rid)
        self.history.append(
            [(c.request.request_id, c.num_new_tokens, c.samples) for c in batch.chunks]
        )

    def check_blocks(self, batch: StepBatch) -> None:
        bs, sched = self.plan.block_size, self.sched
        assert sched.num_free_blocks == len(self.pool.free)
        for c in batch.chunks:
            r = c.request
            assert len(r.blocks) * bs >= c.start + c.num_new_tokens
        live = [r for r in sched.requests.values() if r.blocks]
        owned = [b for r in live for b in r.blocks]
        assert len(owned) == len(set(owned)), "a block has two owners"
        for r in live:
            assert self.pool.held[r.request_id] == r.blocks
            assert len(r.blocks) <= -(-r.max_total_tokens // bs)
        assert not set(owned) & set(self.pool.free)

    def check_plan(self, batch: StepBatch, a: dict[str, np.ndarray]) -> None:
        bs = self.plan.block_size
        n = len(batch.chunks)
        qsl = a["query_start_loc"]
        assert qsl[0] == 0 and np.all(np.diff(qsl) >= 1) and qsl[-1] == batch.num_tokens
        for key, dtype in [("input_ids", np.int32), ("positions", np.int32)]:
            assert a[key].dtype == dtype and a[key].shape == (batch.num_tokens,)
        assert a["slot_mapping"].dtype == np.int64
        assert a["block_tables"].shape[0] == n and a["block_tables"].dtype == np.int32
        written = a["slot_mapping"][a["slot_mapping"] >= 0].tolist()
        assert len(set(written)) == len(written)
        for i, c in enumerate(batch.chunks):
            r = c.request
            lo, hi = qsl[i], qsl[i + 1]
            start, stop = c.start, c.start + c.num_new_tokens
            assert hi - lo == c.num_new_tokens
            pos = a["positions"][lo:hi]
            assert np.array_equal(pos, np.arange(start, stop))
            table = a["block_tables"][i]
            assert np.array_equal(table[: len(r.blocks)], r.blocks)
            slots = np.where(pos < r.shared_until, -1, table[pos // bs] * bs + pos % bs)
            assert np.array_equal(a["slot_mapping"][lo:hi], slots)
            known = min(stop, r.num_tokens)  # tokens past it are sampled by the step in flight
            assert np.array_equal(
                a["input_ids"][lo : lo + known - start], r.token_slice(start, known)
            )
            if known < stop:
                assert self.overlap and c.num_new_tokens == 1 and a["input_ids"][lo] == 0
                assert a["prev_rows"][lo] >= 0
            elif len(a["prev_rows"]):
                assert (a["prev_rows"][lo:hi] == -1).all()
            assert a["seq_lens"][i] == stop
            if a["sample"][i]:  # (planning added the token it samples to num_planned_tokens)
                assert stop == r.num_planned_tokens - 1
            else:
                assert stop < r.num_planned_tokens
            assert a["gen_index"][i] == len(r.generated) + r.num_pending - int(a["sample"][i])
            assert a["seeds"][i] == r.seed and a["top_k"][i] == r.sampling.top_k
            assert a["temperature"][i] == np.float32(r.sampling.temperature)
            assert a["top_p"][i] == np.float32(r.sampling.top_p)

    def check_after_update(self) -> None:
        bs = self.plan.block_size
        for r in self.sched.running:
            if self.overlap:
                assert r.num_computed_tokens <= r.num_planned_tokens
            else:
                assert r.num_computed_tokens < r.num_tokens and not r.num_pending
            # (a void row's position is computed again: its block stays)
            held = r.num_computed_tokens + r.void_rows
            assert len(r.blocks) == -(-held // bs), "blocks beyond need"
            assert len(r.generated) < r.sampling.max_tokens

    def check_end(self) -> None:
        assert not self.sched.has_work() and not self.sched.requests
        assert set(self.ended) == set(self.added)
        assert self.pool.held == {} and self.pool.free == list(range(self.plan.num_blocks))
        assert self.sched.num_free_blocks == self.plan.num_blocks
        admitted = set(self.first_scheduled)
        assert self.first_scheduled == [i for i in self.add_order if i in admitted], "not FIFO"
        for rid, r in self.ended.items():
            assert r.finish_reason in REASONS, r.finish_reason
            assert len(r.generated) <= r.sampling.max_tokens
            want, reason = expected_output(r, self.plan)
            if r.finish_reason == "abort":
                assert rid in self.abort_called
                assert r.generated == want[: len(r.generated)] and len(r.generated) < len(want)
            else:
                assert (r.generated, r.finish_reason) == (want, reason)
            if r.sampling.return_log_probs:
                p = len(r.prompt)
                assert r.log_probs == [fake_log_prob(p + j) for j in range(len(r.generated))]
                if r.finish_reason != "abort":
                    assert r.prompt_log_probs == [fake_log_prob(j) for j in range(1, p)]
            kinds = [e.type for e in r.events]
            assert kinds[0] == "ADD_ENGINE" and kinds[-1] in ("FINISH", "FAIL")
            assert kinds.count("EVICT") <= len(r.history.checkpoints)  # + "recompute" resumes
            reports = self.reports[rid]
            assert [f for _, f in reports] == [False] * (len(reports) - 1) + [True]
            assert [t for new, _ in reports for t in new] == r.generated
            if not r.stream:
                assert len(reports) == 1


# --- property: random workloads --------------------------------------------------------------


@st.composite
def workloads(draw):
    bs = draw(st.sampled_from([1, 2, 4, 8]))
    max_tokens = draw(st.integers(1, 40))
    max_requests = draw(st.integers(1, min(max_tokens, 6)))
    max_seq = draw(st.integers(2, 48))
    need = -(-max_seq // bs)
    plan = make_plan(
        num_blocks=draw(st.integers(max(1, need // 2), 3 * need)),
        block_size=bs,
        max_requests=max_requests,
        max_tokens=max_tokens,
        max_sequence_length=max_seq,
        eos=draw(st.lists(st.integers(10, 59), max_size=2, unique=True)),
        max_paused_blocks=draw(st.none() | st.integers(0, need)),
    )
    requests = draw_requests(draw, max_seq, 10, stop_token_ids=True)
    return plan, draw(st.booleans()), requests, draw(st.booleans())


def draw_requests(draw, max_seq: int, most: int, stop_token_ids: bool) -> list[tuple]:
    """1..`most` random requests, each (arrival step, abort step or None, EngineRequest), that
    fit `max_seq` tokens (`stop_token_ids`: some carry stop ids)."""
    requests = []
    for rid in range(draw(st.integers(1, most))):
        prompt_len = draw(st.integers(1, max_seq - 1))
        arrival = draw(st.integers(0, 15))
        abort_at = draw(st.none() | st.none() | st.integers(arrival, arrival + 25))
        stops = draw(st.lists(st.integers(10, 59), max_size=2)) if stop_token_ids else []
        req = make_request(
            rid,
            prompt_len,
            max_tokens=draw(st.integers(1, max_seq - prompt_len)),
            stream=draw(st.booleans()),
            ignore_eos=draw(st.booleans()),
            stop_token_ids=tuple(stops),
            return_log_probs=draw(st.booleans()),
        )
        requests.append((arrival, abort_at, req))
    return requests


def expected_problem(plan: RuntimePlan, chunked: bool, req: EngineRequest) -> str | None:
    total = len(req.prompt) + req.sampling.max_tokens
    if not chunked and len(req.prompt) > plan.max_tokens:
        return "enable_chunked_prefill"
    if -(-total // plan.block_size) > plan.num_blocks:
        return "KV blocks"
    return None


@fuzz_settings(200)
@given(workloads())
def test_random_workloads_keep_every_invariant(workload):
    check_workload(workload)


@pytest.mark.slow
@settings(max_examples=5000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_keep_every_invariant_deep(workload):
    check_workload(workload)


def check_workload(workload, harness=None) -> Harness:
    """Drive the harness through one random workload; every invariant holds at every step."""
    plan, chunked, requests, overlap = workload
    h = (harness or Harness)(plan, chunked, overlap)

    def added(req, problem):
        want = expected_problem(plan, chunked, req)
        assert (problem is None) == (want is None), (problem, want)
        assert problem is None or want in problem

    drive(h, requests, added)
    h.check_end()
    reasons = {r.finish_reason for r in h.ended.values()}
    event(f"reasons: {sorted(reasons)}")
    event(f"rejected: {len(requests) > len(h.added)}")
    event(f"split prompt: {any(not s for step in h.history for _, _, s in step)}")
    event(f"steps > 20: {len(h.history) > 20}")
    event(f"paused: {h.sched.num_paused_total > 0}, evicted: {h.sched.num_evicted_total > 0}")
    event(f"overlap: {overlap}")
    return h


def drive(h: Harness, requests, added=lambda req, problem: None) -> None:
    """Run `requests` ((arrival tick, abort tick or None, request)) through the harness, one
    step loop iteration per tick, until nothing is left; `added(req, problem)` after each
    submission. Aborts arrive while the tick's step is in flight (or at once when idle)."""
    last = max([max(a, b or 0) for a, b, _ in requests], default=0)
    tick = 0
    while tick <= last or h.sched.has_work():
        assert tick < 5000, "no progress"
        for arrival, _, req in requests:
            if arrival == tick:
                added(req, h.add(req))
        aborts = [req.request_id for _, at, req in requests if at == tick]

        def in_flight(aborts=aborts):
            for rid in aborts:
                h.abort(rid)

        if not h.step(in_flight):
            assert not h.sched.has_work(), "the scheduler has work but plans nothing"
            for rid in aborts:  # idle: the aborts still arrive
                h.abort(rid)
        tick += 1


# --- examples --------------------------------------------------------------------------------


def test_chunked_prefill_splits_a_long_prompt_while_decodes_ride_along():
    h = Harness(make_plan(block_size=4, max_tokens=8, max_requests=4), chunked=True)
    h.add(make_request(1, 3, max_tokens=20))
    h.step()
    h.add(make_request(2, 20, max_tokens=2))
    for _ in range(5):
        h.step()
    assert h.history == [
        [(1, 3, True)],
        [(1, 1, True), (2, 7, False)],
        [(1, 1, True), (2, 7, False)],
        [(1, 1, True), (2, 6, True)],  # the last chunk samples the first token
        [(1, 1, True), (2, 1, True)],
        [(1, 1, True)],  # request 2 ended at length 2
    ]
    assert h.ended[2].generated == expected_output(h.ended[2], h.plan)[0]
    h.run()
    h.check_end()


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_step_budget():
    h = Harness(make_plan(block_size=4, max_tokens=8, max_requests=4), chunked=False)
    h.add(make_request(1, 3, max_tokens=3))
    h.step()
    h.add(make_request(2, 8, max_tokens=2))  # 8 tokens do not fit beside 1 decode token
    h.run()
    assert h.history[:4] == [[(1, 3, True)], [(1, 1, True)], [(1, 1, True)], [(2, 8, True)]]
    h.check_end()


def test_check_explains_why_a_request_can_never_run():
    sched = Scheduler(make_plan(num_blocks=4, block_size=4, max_tokens=8), False)
    assert sched.check(8, SamplingParams(max_tokens=4)) is None
    too_long = sched.check(9, SamplingParams(max_tokens=4))
    assert "prompt (9 tokens)" in too_long and "max_tokens (8)" in too_long
    assert "enable_chunked_prefill" in too_long
    assert "empty" in sched.check(0, SamplingParams())
    assert "needs 5 KV blocks; the pool has 4" in sched.check(8, SamplingParams(max_tokens=9))
    chunked = Scheduler(make_plan(num_blocks=64, block_size=4, max_tokens=8), True)
    assert chunked.check(9, SamplingParams(max_tokens=4)) is None
    seq = Scheduler(make_plan(max_sequence_length=10), True)
    assert "exceeds max_sequence_length (10)" in seq.check(6, SamplingParams(max_tokens=5))
    assert seq.check(6, SamplingParams(max_tokens=4)) is None


def test_request_filling_max_sequence_length_ends_by_length():
    h = Harness(make_plan(max_sequence_length=10), chunked=False)
    h.add(make_request(1, 6, max_tokens=4))
    h.run()
    assert h.ended[1].finish_reason == "length" and h.ended[1].num_tokens == 10
    h.check_end()


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_eos_stops_unless_ignore_eos(ignore_eos):
    eos = fake_token(5 + 2)  # the third generated token of a 5-token prompt
    h = Harness(make_plan(eos=(999, eos)), chunked=False)
    h.add(make_request(1, 5, max_tokens=10, ignore_eos=ignore_eos))
    h.run()
    r = h.ended[1]
    if ignore_eos:
        assert r.finish_reason == "length" and len(r.generated) == 10
    else:
        assert r.finish_reason == "stop" and r.generated == [fake_token(p) for p in (5, 6, 7)]
    h.check_end()


def test_stop_token_ids_stop_even_with_ignore_eos():
    stop = fake_token(4 + 1)
    h = Harness(make_plan(), chunked=False)
    h.add(make_request(1, 4, max_tokens=10, ignore_eos=True, stop_token_ids=(stop,)))
    h.run()
    assert h.ended[1].finish_reason == "stop" and h.ended[1].generated[-1] == stop
    assert len(h.ended[1].generated) == 2
    h.check_end()


def test_abort_of_a_waiting_request_ends_it_at_once():
    h = Harness(make_plan(max_requests=1, max_tokens=8), chunked=False)
    h.add(make_request(1, 4, max_tokens=5))
    h.add(make_request(2, 4, max_tokens=5))
    h.step()  # 1 runs, 2 waits (max_requests)
    assert [r.request_id for r in h.sched.waiting] == [2]
    h.abort(2)
    r = h.ended[2]
    assert r.finish_reason == "abort" and r.generated == [] and 2 not in h.sched.requests
    assert h.sched.abort(2, 0.0) is None and h.sched.abort(12345, 0.0) is None
    h.run()
    h.check_end()


def test_abort_of_a_running_request_ends_it_at_the_next_update():
    h = Harness(make_plan(), chunked=False)
    h.add(make_request(1, 4, max_tokens=50))
    h.add(make_request(2, 4, max_tokens=50))
    h.step()
    h.step(in_flight=lambda: h.abort(1))
    assert 1 in h.abort_called and h.ended[1].finish_reason == "abort"
    assert len(h.ended[1].generated) == 1  # the in-flight step's token is dropped
    batch = h.sched.schedule(h.now)
    assert batch.free_ids == [1] and [c.request.request_id for c in batch.chunks] == [2]


def test_abort_between_steps_ends_a_running_request_at_once():
    h = Harness(make_plan(), chunked=False)
    h.add(make_request(1, 4, max_tokens=50))
    h.add(make_request(2, 4, max_tokens=50))
    h.step()
    h.abort(1)  # between steps (or while the engine is paused)
    assert h.ended[1].finish_reason == "abort" and len(h.ended[1].generated) == 1
    assert h.sched.pending_free == {1: 1}
    h.step(in_flight=lambda: h.abort(2))
    h.run()
    h.check_end()


def test_abort_between_steps_of_the_only_running_request_ends_it():
    h = Harness(make_plan(), chunked=False)
    h.add(make_request(1, 4, max_tokens=50))
    h.step()
    h.abort(1)  # e.g. handled while the engine awaits coord.send in _emit
    for _ in range(3):
        h.step()
    assert 1 in h.ended and h.ended[1].finish_reason == "abort"


def test_failed_step_ends_its_requests_with_error():
    h = Harness(make_plan(max_requests=2), chunked=False)
    for rid in (1, 2, 3):
        h.add(make_request(rid, 4, max_tokens=5))
    batch = h.sched.schedule(0.0)
    ids, free = h.pool.apply([], [(c.request.request_id, c.new_blocks) for c in batch.chunks])
    apply_block_reply(
        h.sched, batch, BlockOpsReply(batch.step, True, np.asarray(ids, np.int32), free, None)
    )
    ended = h.sched.update(batch, None, 1.0, error="boom")
    assert [(r.request_id, r.finish_reason, r.error) for r in ended] == [
        (1, "error", "boom"),
        (2, "error", "boom"),
    ]
    assert [r.request_id for r in h.sched.waiting] == [3]
    assert sorted(h.sched.pending_free) == [1, 2]
    h.run()  # request 3 still runs, and the failed requests' blocks come back
    assert h.ended[3].finish_reason == "length"
    assert h.pool.free == list(range(h.plan.num_blocks))


def test_fail_all_ends_everything_once_and_frees_the_pool():
    h = Harness(make_plan(max_requests=2), chunked=False)
    for rid in (1, 2, 3):
        h.add(make_request(rid, 4, max_tokens=50, stream=True))
    h.step()
    ended = h.sched.fail_all("abort", 1.0)
    assert sorted(r.request_id for r in ended) == [1, 2, 3]
    assert all(r.finish_reason == "abort" and r.status is Status.FINISHED for r in ended)
    assert h.sched.fail_all("abort", 2.0) == []
    h.emit(ended)
    h.run()
    assert h.pool.free == list(range(h.plan.num_blocks)) and not h.sched.has_work()


def test_a_request_without_a_free_block_pauses_and_resumes_lifo():
    # 6 blocks of 2 tokens, three requests of 2-token prompts: each holds one block after its
    # prefill and needs one more block every 2 tokens. With 6 blocks, the third request to need
    # its third block finds none free and pauses; the last paused resumes first.
    h = Harness(make_plan(num_blocks=6, block_size=2, max_tokens=32), chunked=False)
    for rid in (1, 2, 3):
        h.add(make_request(rid, 2, max_tokens=6))
    h.run()
    h.check_end()
    assert h.sched.num_paused_total > 0
    paused = [e for r in h.ended.values() for e in r.events if e.type == "PAUSE"]
    assert paused, "PAUSE events are tracked in this harness"


def test_nothing_runnable_evicts_the_oldest_paused_and_recomputes_it():
    # 4 blocks of 2: two requests grow until both need a block and none is free; the engine
    # evicts the oldest paused one, the other finishes, and the evicted one recomputes its
    # prompt + generated tokens and still produces the expected tokens.
    h = Harness(make_plan(num_blocks=4, block_size=2, max_tokens=32), chunked=False)
    h.add(make_request(1, 2, max_tokens=6, return_log_probs=True))
    h.add(make_request(2, 2, max_tokens=6, return_log_probs=True))
    h.run()
    h.check_end()
    assert h.sched.num_evicted_total >= 1
    evicted = [r for r in h.ended.values() if r.history.checkpoints]
    assert evicted and all("EVICT" in [e.type for e in r.events] for r in evicted)
    # the recompute step covered prompt + generated tokens at once
    assert any(n > 2 for step in h.history for _, n, _ in step)


def test_paused_requests_over_their_block_budget_are_evicted():
    plan = make_plan(num_blocks=6, block_size=2, max_tokens=32, max_paused_blocks=0)
    h = Harness(plan, chunked=True)
    for rid in (1, 2, 3):
        h.add(make_request(rid, 2, max_tokens=6))
    h.run()
    h.check_end()
    # with a zero budget every pause is followed by an eviction in the same step
    assert h.sched.num_paused_total == h.sched.num_evicted_total > 0


def test_invalidated_kv_is_recomputed_with_the_same_outputs():
    h = Harness(make_plan(block_size=4), chunked=False)
    for rid in (1, 2):
        h.add(make_request(rid, 5, max_tokens=8, return_log_probs=True))
    for _ in range(3):
        h.step()
    h.sched.invalidate_kv()  # a "recompute" resume
    assert all(r.num_computed_tokens == 0 and r.blocks for r in h.sched.running)
    h.run()
    h.check_end()


def _stream_texts(h, rid):
    return [new for new, _ in h.reports[rid]]


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("stream", [False, True])
def test_stop_word_across_steps_stops_and_is_dropped_unless_included(include, stream):
    # generated tokens of a 4-token prompt are fake_token(4), fake_token(5), ...
    word = (fake_token(6), fake_token(7), fake_token(8))
    h = Harness(make_plan(), chunked=False)
    req = make_request(
        1, 4, max_tokens=20, stream=stream, stop_word_ids=(word,), include_stop_word=include
    )
    h.add(req)
    h.run()
    r = h.ended[1]
    head = [fake_token(4), fake_token(5)]
    assert r.finish_reason == "stop"
    assert r.generated == head + (list(word) if include else [])
    streamed = [t for new in _stream_texts(h, 1) for t in new]
    assert streamed == r.generated  # the dropped word was never streamed
    if stream:  # tokens that might start the stop word were held back until decided
        assert _stream_texts(h, 1)[0] == [fake_token(4)]


def test_streaming_interval_batches_deltas():
    h = Harness(make_plan(), chunked=False)
    h.add(make_request(1, 4, max_tokens=7, stream=True, streaming_interval=3))
    h.run()
    assert [len(new) for new in _stream_texts(h, 1)] == [3, 3, 1]


def test_events_and_timings():
    h = Harness(make_plan(), chunked=False)
    h.add(make_request(1, 4, max_tokens=3))
    h.run()
    r = h.ended[1]
    assert [e.type for e in r.events] == ["ADD_ENGINE", "ADD_CONTEXT", "FINISH"]
    # The harness's clock: 1.5 per step, and 0.1 more for each allocator round trip (steps 1
    # and 2 need a block; step 3 does not).
    assert r.ttft == r.first_token_time - r.arrival_time and r.tpot == pytest.approx(1.55)
    out = output_of(r)  # the terminal output carries them (again: outputs are idempotent)
    assert out.ttft == r.ttft and [e.type for e in out.events][-1] == "FINISH"


def test_plan_arrays_for_a_mixed_step():
    h = Harness(make_plan(block_size=2, max_tokens=8), chunked=False)
    a = make_request(1, 3, max_tokens=5)
    h.add(a)
    h.step()
    h.add(make_request(2, 2, max_tokens=5))
    batch = h.sched.schedule(h.now)
    ids, free = h.pool.apply([], [(c.request.request_id, c.new_blocks) for c in batch.chunks])
    apply_block_reply(
        h.sched, batch, BlockOpsReply(batch.step, True, np.asarray(ids, np.int32), free, None)
    )
    got = plan_arrays(batch, h.sched.plan.block_size, h.sched.mamba is not None)
    want = {
        "input_ids": [fake_token(3), 114, 145],  # prompt of 2: (31 i + 14) % 1000 + 100
        "positions": [3, 0, 1],
        "slot_mapping": [3, 4, 5],  # request 1: blocks [0, 1]; request 2: block [2]
        "query_start_loc": [0, 1, 3],
        "seq_lens": [4, 2],
        "block_tables": [[0, 1], [2, 0]],
        "sample": [1, 1],
        "gen_index": [1, 0],
        "top_k": [1, 2],
        "seeds": [1001, 1002],
    }
    assert {k: got[k].tolist() for k in want} == want


def test_block_tables_pad_unequal_rows_and_join_equal_ones():
    a, b = np.array([4, 5, 6], np.int32), np.array([7], np.int32)
    unequal = _block_tables([a, b, a])
    assert unequal.dtype == np.int32 and unequal.tolist() == [[4, 5, 6], [7, 0, 0], [4, 5, 6]]
    equal = _block_tables([a, a[::-1].copy()])
    assert equal.dtype == np.int32 and equal.tolist() == [[4, 5, 6], [6, 5, 4]]
    assert _block_tables([b]).tolist() == [[7]]


def test_add_twice_and_bad_allocator_reply_are_refused():
    sched = Scheduler(make_plan(), False)
    assert not sched.has_work()
    sched.add(make_request(1, 4), 0.0)
    assert sched.has_work()
    with pytest.raises(ValueError, match="already known"):
        sched.add(make_request(1, 4), 0.0)
    batch = sched.schedule(0.0)
    with pytest.raises(ValueError, match="expected 1"):
        reply = BlockOpsReply(1, True, np.array([0, 1], np.int32), 62, None)
        apply_block_reply(sched, batch, reply)


def test_derive_seed_is_fixed_by_the_message_and_in_range():
    seeds = {derive_seed(rid, t) for rid in range(50) for t in (0.0, 1.5)}
    assert len(seeds) == 100 and all(0 <= s < 2**63 for s in seeds)
    assert derive_seed(7, 1.25) == derive_seed(7, 1.25)


# --- overlap: step N+1 planned before step N's result ----------------------------------------


def test_overlap_plans_the_next_decode_row_from_the_token_in_flight():
    h = Harness(make_plan(block_size=4), chunked=False, overlap=True)
    h.add(make_request(1, 3, max_tokens=3))
    sent = []
    original = h.gpu
    h.gpu = lambda batch, a: (sent.append(a), original(batch, a))[1]
    h.step()  # plans and sends the prefill; nothing to collect yet
    assert h.ended == {} and h.sched.requests[1].generated == []
    h.step()  # plans the first decode before the prefill's token is known, then collects it
    first, second = sent
    assert first["prev_rows"].tolist() == []  # nothing read from the device
    assert second["input_ids"].tolist() == [0] and second["prev_rows"].tolist() == [0]
    assert second["positions"].tolist() == [3] and second["gen_index"].tolist() == [1]
    h.run()
    h.check_end()
    # max_tokens is known when planning: no row past the third token (no surplus here)
    assert [s for s in h.history if s] == [[(1, 3, True)], [(1, 1, True)], [(1, 1, True)]]


@pytest.mark.parametrize("stream", [False, True])
def test_overlap_drops_the_token_planned_after_an_eos(stream):
    eos = fake_token(5 + 2)  # the third generated token of a 5-token prompt
    h = Harness(make_plan(eos=(eos,), block_size=2), chunked=False, overlap=True)
    h.add(make_request(1, 5, max_tokens=10, stream=stream))
    h.run()
    h.check_end()  # outputs as without overlap, every block back in the pool
    r = h.ended[1]
    assert r.finish_reason == "stop" and r.generated == [fake_token(p) for p in (5, 6, 7)]
    # The step after the EOS was planned before the EOS was seen: one surplus row (position
    # 8, which needed a fourth block), its token dropped, its block freed by the step after.
    assert [s for s in h.history if s] == [[(1, 5, True)]] + [[(1, 1, True)]] * 3
    assert [t for new, _ in h.reports[1] for t in new] == r.generated


def test_overlap_abort_while_two_steps_hold_the_request():
    h = Harness(make_plan(), chunked=False, overlap=True)
    h.add(make_request(1, 4, max_tokens=50))
    h.add(make_request(2, 4, max_tokens=50))
    h.step()
    h.step()  # step 2 is at the gpu, step 1 collected
    h.step(in_flight=lambda: h.abort(1))  # step 3 sent, step 2 still holds request 1
    assert h.ended[1].finish_reason == "abort" and 1 not in h.sched.requests
    held = h.sched.steps_in_flight
    assert held == 1 and h.sched.pending_free == {1: 2}
    h.run()
    h.check_end()
    # Its end came with step 2's result: the tokens of steps 2 and 3 are dropped.
    assert len(h.ended[1].generated) == 1


def test_overlap_outputs_equal_the_serial_loop_under_pressure():
    # A pool so small that requests pause and get evicted: overlap plans with one step's
    # frees not yet known, yet every request produces the same tokens and every block returns.
    plan = make_plan(num_blocks=6, block_size=2, max_tokens=16, max_requests=4)
    for overlap in (False, True):
        h = Harness(plan, chunked=True, overlap=overlap)
        for rid in range(1, 5):
            h.add(make_request(rid, 3, max_tokens=6, return_log_probs=True))
        h.run()
        h.check_end()
        assert h.sched.num_paused_total > 0
