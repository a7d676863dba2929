"""Continuous batching: which requests run in the next step, and with how many tokens.

Pure core: ints, lists and numpy; no torch, no zmq, no clock (times come from messages).
Owns every EngineRequest. The engine actor calls, once per step:

    batch = scheduler.schedule()          # what runs, which blocks to free / allocate
    scheduler.assign_blocks(batch, ids)   # the allocator's answer
    plan = scheduler.plan_arrays(batch)   # numpy arrays for the StepPlan
    done = scheduler.update(batch, toks)  # append sampled tokens, stop checks

Budgets: at most `max_tokens` tokens and `max_requests` running requests per step. Running
requests go first (one decode token each, or the next prompt chunk), then waiting requests are
admitted FIFO. A request is admitted only if the pool can hold every block it may ever need
(prompt + max_tokens) on top of what running requests may still need: so a running request
never finds the pool empty. (Pausing and eviction replace this reservation in a later step.)
"""

from __future__ import annotations

import dataclasses
from collections import deque

import numpy as np

from actors.engine.request import EngineRequest, Status
from messages.requests import SamplingParams
from runtime.config import RuntimePlan


@dataclasses.dataclass
class Chunk:
    request: EngineRequest
    num_new_tokens: int
    new_blocks: int

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the known tokens (so its last logit is used)."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens == r.num_tokens


@dataclasses.dataclass
class StepBatch:
    step: int
    chunks: list[Chunk]
    free_ids: list[int]
    ended: list[EngineRequest]  # aborted before this step: report them now

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)


def derive_seed(request_id: int, arrival_time: float) -> int:
    """A seed for an unseeded request, fixed by its inbound message (replays stay exact)."""
    x = (request_id * 0x9E3779B97F4A7C15 + int(arrival_time * 1e6)) & (2**64 - 1)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (x ^ (x >> 31)) >> 1


class Scheduler:
    def __init__(self, plan: RuntimePlan, enable_chunked_prefill: bool):
        self.plan = plan
        self.chunked_prefill = enable_chunked_prefill
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self.requests: dict[int, EngineRequest] = {}
        self.num_free_blocks = plan.num_blocks  # the allocator's count after the last reply
        self.pending_free: dict[int, int] = {}  # request id -> blocks to free next step
        self.step = 0

    # --- admission ----------------------------------------------------------------------------

    def check(self, prompt_len: int, sampling: SamplingParams) -> str | None:
        """Why a request can never run here, or None."""
        p = self.plan
        if prompt_len == 0:
            return "the prompt is empty"
        total = prompt_len + sampling.max_tokens
        if total > p.max_sequence_length:
            return (
                f"prompt ({prompt_len} tokens) + max_tokens ({sampling.max_tokens}) = {total} "
                f"exceeds max_sequence_length ({p.max_sequence_length})"
            )
        if not self.chunked_prefill and prompt_len > p.max_tokens:
            return (
                f"prompt ({prompt_len} tokens) exceeds the per-step token budget max_tokens "
                f"({p.max_tokens}); set enable_chunked_prefill=true or raise max_tokens"
            )
        if -(-total // p.block_size) > p.num_blocks:
            return f"needs {-(-total // p.block_size)} KV blocks; the pool has {p.num_blocks}"
        return None

    def add(self, req: EngineRequest) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request {req.request_id} is already known")
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def abort(self, request_id: int) -> EngineRequest | None:
        """Mark a request aborted. A waiting one ends now (returned); a running one ends at the
        end of the step in flight (update()) or at the next schedule(), whichever comes first."""
        req = self.requests.get(request_id)
        if req is None or req.status is Status.FINISHED:
            return None
        req.aborted = True
        if req.status is Status.WAITING:
            self.waiting.remove(req)
            self._finish(req, "abort")
            return req
        return None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.pending_free)

    # --- one step -----------------------------------------------------------------------------

    def _free_view(self) -> int:
        return self.num_free_blocks + sum(self.pending_free.values())

    def _reserved(self, req: EngineRequest) -> int:
        return req.blocks_needed(req.max_total_tokens, self.plan.block_size)

    def schedule(self) -> StepBatch:
        bs = self.plan.block_size
        budget = self.plan.max_tokens
        chunks: list[Chunk] = []
        # No step is in flight while we plan: aborted running requests end here, and their
        # blocks go back in this very step.
        ended = [r for r in self.running if r.aborted]
        for r in ended:
            self._finish(r, "abort")
        for req in list(self.running):
            remaining = req.num_tokens - req.num_computed_tokens
            n = min(remaining, budget)
            if n <= 0:
                continue
            budget -= n
            new_blocks = req.blocks_needed(req.num_computed_tokens + n, bs)
            chunks.append(Chunk(req, n, new_blocks))
        spare = self._free_view() - sum(self._reserved(r) for r in self.running)
        while self.waiting and len(self.running) < self.plan.max_requests and budget > 0:
            req = self.waiting[0]
            n = req.num_tokens
            if n > budget and not self.chunked_prefill:
                break
            if self._reserved(req) > spare:
                break
            self.waiting.popleft()
            n = min(n, budget)
            budget -= n
            spare -= self._reserved(req)
            req.status = Status.RUNNING
            self.running.append(req)
            chunks.append(Chunk(req, n, req.blocks_needed(n, bs)))
        free_ids = list(self.pending_free)
        self.pending_free.clear()
        self.step += 1
        return StepBatch(self.step, chunks, free_ids, ended)

    def assign_blocks(self, batch: StepBatch, block_ids: np.ndarray, num_free: int) -> None:
        offset = 0
        for c in batch.chunks:
            c.request.blocks.extend(int(b) for b in block_ids[offset : offset + c.new_blocks])
            offset += c.new_blocks
        if offset != len(block_ids):
            raise ValueError(f"allocator returned {len(block_ids)} blocks, expected {offset}")
        self.num_free_blocks = num_free

    def plan_arrays(self, batch: StepBatch) -> dict[str, np.ndarray]:
        """The StepPlan arrays (see messages/gpu.py) for this batch."""
        bs = self.plan.block_size
        ids, positions, slots, seq_lens, sample = [], [], [], [], []
        query_start = [0]
        width = max(len(c.request.blocks) for c in batch.chunks)
        tables = np.zeros((len(batch.chunks), width), dtype=np.int32)
        for i, c in enumerate(batch.chunks):
            r = c.request
            start, stop = r.num_computed_tokens, r.num_computed_tokens + c.num_new_tokens
            pos = np.arange(start, stop, dtype=np.int64)
            blocks = np.asarray(r.blocks, dtype=np.int64)
            ids.append(r.token_slice(start, stop))
            positions.append(pos)
            slots.append(blocks[pos // bs] * bs + pos % bs)
            query_start.append(query_start[-1] + c.num_new_tokens)
            seq_lens.append(stop)
            sample.append(c.samples)
            tables[i, : len(r.blocks)] = r.blocks
        reqs = [c.request for c in batch.chunks]
        ids_all = np.concatenate(ids).astype(np.int32)
        return {
            "input_ids": ids_all,
            "positions": np.concatenate(positions).astype(np.int32),
            "slot_mapping": np.concatenate(slots),
            "query_start_loc": np.asarray(query_start, dtype=np.int32),
            "seq_lens": np.asarray(seq_lens, dtype=np.int32),
            "block_tables": tables,
            "sample": np.asarray(sample, dtype=np.int8),
            "temperature": np.asarray([r.sampling.temperature for r in reqs], dtype=np.float32),
            "top_k": np.asarray([r.sampling.top_k for r in reqs], dtype=np.int32),
            "top_p": np.asarray([r.sampling.top_p for r in reqs], dtype=np.float32),
            "seeds": np.asarray([r.seed for r in reqs], dtype=np.int64),
            "gen_index": np.asarray([len(r.generated) for r in reqs], dtype=np.int32),
            "logprobs": np.zeros(len(reqs), dtype=np.int8),
            "top_n": np.zeros(len(reqs), dtype=np.int32),
            "prompt_targets": np.full(len(ids_all), -1, dtype=np.int32),
        }

    def update(
        self, batch: StepBatch, token_ids: np.ndarray | None, error: str = ""
    ) -> list[EngineRequest]:
        """Apply a step's sampled tokens (None: the step failed with `error`). Returns the
        requests that have something to report: new tokens of streaming requests, and every
        request that ended."""
        out = []
        for i, c in enumerate(batch.chunks):
            r = c.request
            if r.status is Status.FINISHED:
                continue
            if token_ids is None:
                self._finish(r, "error", error or "the step failed")
                out.append(r)
                continue
            samples = c.samples  # before num_computed_tokens moves
            r.num_computed_tokens += c.num_new_tokens
            if r.aborted:
                self._finish(r, "abort")
                out.append(r)
                continue
            if not samples:
                continue
            tok = int(token_ids[i])
            r.generated.append(tok)
            reason = self._stop_reason(r, tok)
            if reason is not None:
                self._finish(r, reason)
            if reason is not None or r.stream:
                out.append(r)
        return out

    def fail_all(self, reason: str) -> list[EngineRequest]:
        """End every request (used at shutdown with reason "abort")."""
        ended = []
        for r in list(self.waiting) + list(self.running):
            self._finish(r, reason)
            ended.append(r)
        return ended

    # --- ending -------------------------------------------------------------------------------

    def _stop_reason(self, r: EngineRequest, tok: int) -> str | None:
        s = r.sampling
        if not s.ignore_eos and tok in self.plan.eos_token_ids:
            return "stop"
        if tok in s.stop_token_ids:
            return "stop"
        if len(r.generated) >= s.max_tokens or r.num_tokens >= self.plan.max_sequence_length:
            return "length"
        return None

    def _finish(self, r: EngineRequest, reason: str, error: str | None = None) -> None:
        if r.status is Status.RUNNING:
            self.running.remove(r)
        elif r.status is Status.WAITING and r in self.waiting:
            self.waiting.remove(r)
        r.status = Status.FINISHED
        r.finish_reason = reason
        r.error = error
        if r.blocks:
            self.pending_free[r.request_id] = len(r.blocks)
            r.blocks = []
        del self.requests[r.request_id]
