"""What a step runs on the device, as WorkerForward, a base of ModelWorker: the CUDA graph
bucket it replays (agreed with the expert-parallel group), the model's forward over the step
buffers (eager, or recorded into a CUDA graph and replayed), the last tokens' logits, sampling,
the Mamba snapshots at chunk ends, a hybrid's verify rows (their states inside the row kept in
scratch slots, the last accepted one restored), and the routed experts' recording.

Routed experts (a MoE model, StepPlan.return_routed_experts): every MoE layer writes its router's
ids into one static buffer (ops/moe.py `record_routing`); the captured graphs always do (one
small copy per layer), an eager forward only when its plan asks; the step's rows go to the host
with its tokens.

Must not touch: the load and the pools' sizes (worker.py, sizing.py), the step's launch /
collect bookkeeping and its StepResult (worker.py), or the lifecycle state (controls.py). It
reads the tensors the load set and writes only the step's outputs: the sampled tokens' and the
logits' buffers, the routing buffer, and the Mamba slots a plan names.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np
import torch

from taipan.actors.gpu.buffers import StepBuffers
from taipan.actors.gpu.draft import DraftModel
from taipan.actors.gpu.graphs import Bucket, StepGraphs
from taipan.actors.gpu.host_staging import to_host
from taipan.actors.gpu.mtp import MTPDrafter
from taipan.actors.gpu.speculative import draft_rows
from taipan.messages.gpu import StepPlan, StepResult
from taipan.ops.expert_parallel import EPGroup, exchange_only
from taipan.ops.mamba import MambaMetadata
from taipan.ops.models.llama import AttentionMetadata
from taipan.ops.moe import record_routing
from taipan.ops.parallel import TPGroup
from taipan.ops.sampling import row_keys, sample


class WorkerForward:
    """The forward's half of ModelWorker, run in the worker's thread. It reads what the load
    set (annotated below) and provides `_capture` (WorkerControls calls it at resume)."""

    # Set by ModelWorker.load (and replaced by WorkerControls while suspended).
    model: torch.nn.Module | None
    device: torch.device
    dtype: torch.dtype
    block_size: int
    tp: TPGroup
    ep: EPGroup | None
    exchange: object  # the MoE layers' token exchange under expert parallelism, or None
    kv_cache: torch.Tensor | None
    # The last `_sample`'s noise keys [B] (None: every row greedy), for a grammar check.
    sample_keys: torch.Tensor | None = None
    model_kv: object  # ModelWorker's: the cache as the model reads it (a WindowedKV, or it)
    mamba_state: tuple[torch.Tensor, torch.Tensor] | None
    _mamba_slots: int  # live + snapshot slots; the scratch slots follow
    _snapshot_slots: int
    _scratch_per_slot: int
    buffers: StepBuffers | None
    graphs: StepGraphs | None
    graph_capture_seconds: float
    _logits: torch.Tensor | None
    _graph_hidden: torch.Tensor | None
    _sampled: torch.Tensor | None
    _moe_blocks: list
    _routing: torch.Tensor | None
    draft: DraftModel | None  # speculative_method "draft_model" (actors/gpu/draft.py)
    mtp_k: int  # speculative_method "mtp": its drafts per row (0: no MTP head)
    mtp: MTPDrafter | None  # and its drafter (actors/gpu/mtp.py)

    # ---- which graph runs ----------------------------------------------------------------------

    def _bucket(self, plan: StepPlan, inner_snaps: dict) -> Bucket | None:
        """The CUDA graph the step replays, or None: it runs eagerly (no graph holds it, it
        wants prompt log-probs, its kernels store prefix snapshots inside chunks, or it
        verifies speculative drafts without a mixed graph or under expert parallelism). A
        hybrid's verify rows' snapshots travel in the step buffers (snap_pos / snap_slots),
        which the mixed graphs read: only those `inner_snaps` holds keep a step eager."""
        eager = self.graphs is None or (plan.prompt_targets >= 0).any() or bool(inner_snaps)
        if (len(plan.num_drafts) and plan.num_drafts.any()) or self.mtp_k:
            # Verify rows (several query tokens each) fit a mixed graph, which keeps every
            # token's hidden state (_graph_hidden); under expert parallelism they run eagerly.
            # An MTP head reads every step's hidden states: mixed graphs only.
            eager = eager or self.ep is not None or self._graph_hidden is None
        all_decode = bool((np.diff(plan.query_start_loc) == 1).all()) and not self.mtp_k
        if self.ep is not None:
            return self._ep_shape(len(plan.input_ids), all_decode, eager)
        if not eager:
            return self.graphs.pick(len(plan.input_ids), len(plan.seq_lens), all_decode)
        return None

    def _ep_shape(self, num_tokens: int, all_decode: bool, eager: bool):
        """Agree with the group on this step's shape; returns the graph bucket every rank runs
        (None: all eager) and sets the exchange's rows per rank to its size (eager: the
        largest token count of the group). A dummy step takes part with 0 tokens."""
        tokens, mixed, any_eager = self.ep.agree([num_tokens, int(not all_decode), int(eager)])
        bucket = None
        if not any_eager and self.graphs is not None:
            # A function of the agreed values alone (a mixed bucket that holds `tokens` holds
            # any rank's sequences), so every rank picks the same one.
            bucket = self.graphs.pick(tokens, 1, all_decode=not mixed)
        self.exchange.tokens = bucket.tokens if bucket is not None else tokens
        return bucket

    def _dummy(self, plan: StepPlan, start: float) -> StepResult:
        """A dummy step (ModelWorker's docstring): this rank's experts serve the peers' rows."""
        self._ep_shape(0, True, False)
        with torch.inference_mode():
            exchange_only(self.model, self.dtype, self.device, head_passes=self.mtp_k)
        elapsed = time.perf_counter() - start
        no_tokens = np.zeros(0, dtype=np.int32)
        return StepResult(plan.step, no_tokens, None, elapsed, device_seconds=elapsed)

    # ---- the forward ---------------------------------------------------------------------------

    def _forward_logits(self, plan: StepPlan, staged, bucket: Bucket | None, inner_snaps):
        """(inputs, logits [B, V] fp32, hidden [T, H] or None after a graph, but a mixed one
        of a speculative config): the step's one host-to-device copy, then the graph of
        `bucket` replayed or the forward run eagerly."""
        num_seqs, num_tokens = len(plan.seq_lens), len(plan.input_ids)
        if bucket is not None:
            inputs = self.buffers.upload(staged, num_tokens=num_tokens, num_seqs=num_seqs)
            self.graphs.replay(bucket)
            kept = self._graph_hidden  # (speculative configs' mixed graphs only)
            hidden = None if bucket.decode or kept is None else kept[:num_tokens]
            return inputs, self._logits[:num_seqs], hidden
        inputs = self.buffers.upload(staged)
        with self._recording(plan.return_routed_experts):
            hidden = self._forward(plan, inputs, inner_snaps)  # [T, H]
        # Logits for every sequence's last token (rows that do not sample are ignored):
        # their positions come from the device's query starts, so nothing travels for them.
        last = inputs["query_start_loc"][1:].long() - 1
        return inputs, self.model.compute_logits(hidden[last]), hidden

    def _forward(
        self, plan: StepPlan, inputs: dict[str, torch.Tensor], inner_snaps=None
    ) -> torch.Tensor:
        attn = self._step_attn(inputs, plan=plan)
        ids = inputs["input_ids"]
        if len(plan.prev_rows):  # only then: the gather costs launches
            ids = self._ids_with_previous_tokens(inputs)
        # (a hybrid's verify rows' snapshots, in the step buffers unless inner_snaps has them)
        static = not inner_snaps and "snap_pos" in inputs and bool(len(draft_rows(plan)))
        return self._run_model(ids, inputs, attn, inner_snaps, static)

    def _step_attn(self, inputs, plan: StepPlan | None = None, bucket: Bucket | None = None):
        """The step's attention metadata over its buffers: an eager step's with its plan's
        layout (`plan`), or a graph's for `bucket` (its decode rows and query bound fixed);
        with the windowed layers' tables where the buffers hold them (per-layer-group KV)."""
        fields = {name: inputs[name] for name in _ATTN_FIELDS}
        if bucket is not None:
            decode = bucket.decode
            attn = AttentionMetadata(
                **fields,
                num_decodes=bucket.seqs if decode else 0,
                max_query_len=1 if decode else bucket.tokens,
            )
            layout = None
        else:
            layout = (plan.query_start_loc, plan.seq_lens, self.block_size)
            attn = AttentionMetadata(**fields).with_layout(*layout)
        if "local_block_tables" in inputs:
            attn.with_local(inputs["local_block_tables"], inputs["local_slot_mapping"], layout)
        return attn

    def _run_model(
        self,
        ids: torch.Tensor,
        inputs: dict[str, torch.Tensor],
        attn: AttentionMetadata,
        inner_snaps: dict[int, list[tuple[int, int]]] | None = None,
        static_snaps: bool = False,
    ) -> torch.Tensor:
        """The model's forward over the step's buffers (a hybrid also gets its Mamba slots, and
        the snapshots its kernels store inside chunks: row -> [(position, slot)], or with
        `static_snaps` those of the step buffers' snap_pos / snap_slots, its verify rows')."""
        if self.mamba_state is None:
            return self.model(ids, inputs["positions"], attn, self.model_kv())
        conv, ssm = self.mamba_state
        mamba = MambaMetadata(
            conv, ssm, inputs["mamba_init"], inputs["mamba_out"], attn.query_start_loc,
            attn.num_decodes,
        )  # fmt: skip
        if inner_snaps:
            rows = range(attn.num_decodes, len(attn.query_start_loc) - 1)
            width = max(len(v) for v in inner_snaps.values())
            table = [(inner_snaps.get(r, []) + [(1, -1)] * width)[:width] for r in rows]
            mamba.snap_pos = self._tensor(np.asarray([[p for p, _ in t] for t in table]))
            mamba.snap_slots = self._tensor(np.asarray([[s for _, s in t] for t in table]))
        elif static_snaps:  # (every non-decode row's entries; (1, -1) stores nothing)
            nd = attn.num_decodes
            mamba.snap_pos, mamba.snap_slots = inputs["snap_pos"][nd:], inputs["snap_slots"][nd:]
        return self.model(ids, inputs["positions"], attn, self.kv_cache, mamba)

    def _ids_with_previous_tokens(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """input_ids, where prev_rows says so replaced by the last step's sampled tokens (on
        the device: no host round trip). [T] int64."""
        prev = inputs["prev_rows"]
        previous = self._sampled[prev.clamp(min=0).long()]
        return torch.where(prev >= 0, previous, inputs["input_ids"].long())

    def _snapshot_chunk_ends(self, plan: StepPlan) -> None:
        """The snapshots at a chunk's end: copies of its out slot into snapshot slots (every
        layer; queued after the forward, so the next step's forward reads them)."""
        ends = plan.mamba_snap_pos == np.diff(plan.query_start_loc)[plan.mamba_snap_row]
        if not ends.any():
            return
        self._copy_slots(plan.mamba_out[plan.mamba_snap_row[ends]], plan.mamba_snap_dst[ends])

    def _copy_slots(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Every recurrent layer's state slots `src` copied into slots `dst` (queued)."""
        s, d = self._tensor(src, torch.long), self._tensor(dst, torch.long)
        for t in self.mamba_state:
            t.index_copy_(1, d, t.index_select(1, s))

    # ---- a hybrid's verify rows ------------------------------------------------------------

    def _verify_snapshots(self, plan: StepPlan) -> dict[int, list[tuple[int, int]]]:
        """A hybrid's verify rows (actors/gpu/speculative.py): the recurrent state is rolled
        back to the last accepted token, so the kernels keep each row's states after its first
        1..d tokens (its last known token, then each draft but the last) in its live slot's
        scratch slots, as they keep prefix snapshots inside a chunk: row -> [(position,
        slot)]. ValueError (before the step touches anything) for a verify row that does not
        continue a live slot of its own, has more drafts than the scratch slots, or also takes
        prefix snapshots."""
        rows = draft_rows(plan)
        nd, k = plan.num_drafts[rows], self._scratch_per_slot
        live = self._mamba_slots - self._snapshot_slots
        out, init = plan.mamba_out[rows], plan.mamba_init[rows]
        if (out < 0).any() or (out >= live).any() or (init != out).any():
            raise ValueError("a hybrid's verify row must continue its own live Mamba slot")
        if nd.max() > k:
            raise ValueError(
                f"a hybrid's verify row has {int(nd.max())} drafts, more than the "
                f"num_speculative_tokens={k} its Mamba scratch slots hold"
            )
        if np.isin(rows, plan.mamba_snap_row).any():
            raise ValueError("a hybrid's verify row cannot take prefix snapshots")
        base = self._mamba_slots
        return {
            int(r): [(j + 1, base + int(s) * k + j) for j in range(int(d))]
            for r, d, s in zip(rows, nd, out, strict=True)
        }

    def _roll_back_states(self, plan: StepPlan, spec: np.ndarray) -> None:
        """After verification (`spec`: StepResult.spec_tokens, m >= 1 new tokens a row): a
        verify row whose drafts were not all accepted gets, in its live slot, the state after
        its first m tokens (its last known token and the m - 1 accepted drafts), which
        `_verify_snapshots` had the kernels keep; queued before the next step's forward."""
        rows = draft_rows(plan)
        new = (spec[rows] >= 0).sum(axis=1)
        short = new < plan.num_drafts[rows] + 1
        if not short.any():
            return
        live_slot = plan.mamba_out[rows[short]].astype(np.int64)
        src = self._mamba_slots + live_slot * self._scratch_per_slot + new[short] - 1
        self._copy_slots(src, live_slot)

    def _sample(
        self, plan: StepPlan, inputs: dict[str, torch.Tensor], logits: torch.Tensor
    ) -> torch.Tensor:
        if not (plan.temperature[plan.sample != 0] > 0).any():
            self.sample_keys = None
            return logits.argmax(dim=-1)  # all greedy: skip the filters and the noise
        names = ("temperature", "top_k", "top_p", "seeds", "gen_index", "min_p")
        # (the rows' noise keys, kept: a grammar check draws a refused row again with its own)
        self.sample_keys = row_keys(inputs["seeds"], inputs["gen_index"])
        return sample(logits, **{name: inputs[name] for name in names}, keys=self.sample_keys)

    def _tensor(self, a: np.ndarray, dtype=None) -> torch.Tensor:
        # np.frombuffer views are read-only; torch wants writable memory.
        t = torch.from_numpy(np.array(a, copy=True))
        return t.to(self.device, dtype=dtype, non_blocking=True)

    # ---- routed experts ------------------------------------------------------------------------

    @contextlib.contextmanager
    def _recording(self, on: bool):
        """Inside: the MoE layers write their routers' ids into `_routing` (when `on`)."""
        if not on or self._routing is None:
            yield
            return
        record_routing(self._moe_blocks, self._routing)
        try:
            yield
        finally:
            record_routing(self._moe_blocks, None)

    def _routed_to_host(self, plan: StepPlan) -> torch.Tensor | None:
        """The step's routed experts [T, MoE layers, k], copied to host memory (queued without
        waiting on CUDA: `collect` reads them after the step's end event and copies them out),
        when the plan asks; the tensor-parallel leader's only (every peer routes alike). On
        CUDA into the launch's pinned arena (host_staging.to_host: an RL rollout's every step
        asks, and pinning memory for each cost 0.15-0.4 ms of host time between launches)."""
        if not plan.return_routed_experts or self._routing is None or self.tp.rank:
            return None
        rows = self._routing[: len(plan.input_ids)]
        if self.device.type != "cuda":
            return rows.clone()  # (the next step's forward rewrites the buffer)
        return to_host(rows)

    # ---- CUDA graphs ---------------------------------------------------------------------------

    def _graph_body(self, bucket: Bucket) -> None:
        """What a graph records: the forward over the buffers at the bucket's size, the logits
        of each sequence's last token into the static logits buffer, and (a mixed bucket)
        every token's hidden state into _graph_hidden where the config speculates (verify rows
        read it)."""
        inputs = self.buffers.views(num_tokens=bucket.tokens, num_seqs=bucket.seqs)
        if self.exchange is not None:  # every rank captures this bucket at this size
            self.exchange.tokens = bucket.tokens
        attn = self._step_attn(inputs, bucket=bucket)
        ids = self._ids_with_previous_tokens(inputs)  # 3 tiny kernels, so always recorded
        # A speculative hybrid's mixed graphs take its verify rows' snapshots (every step, as
        # padding entries where there are none: a graph cannot branch on the plan).
        static = "snap_pos" in inputs and not bucket.decode
        hidden = self._run_model(ids, inputs, attn, static_snaps=static)
        # Padding rows repeat the last query start: they read a real row (or row 0).
        last = (inputs["query_start_loc"][1:].long() - 1).clamp(min=0)
        self.model.compute_logits(hidden[last], out=self._logits[: bucket.seqs])
        if not bucket.decode and self._graph_hidden is not None:
            self._graph_hidden[: bucket.tokens].copy_(hidden)

    def _neutral_step(self, bucket: Bucket) -> None:
        """Fill the step buffers with an empty step padded to the bucket: no sequence attends
        anything or writes a slot (what the captures run on)."""
        empty = {
            name: np.zeros((0, f.width) if f.width else 0, dtype=f.dtype)
            for name, f in self.buffers.fields.items()
        }
        self.buffers.load(empty, num_tokens=bucket.tokens, num_seqs=bucket.seqs)
        if self.mtp is not None:  # (and no row of the head's passes)
            self.mtp.load(None, None, None, bucket.seqs)

    # ---- an MTP head's drafts ------------------------------------------------------------------

    def _mtp_drafts(self, plan, bucket, inputs, hidden, tokens, spec) -> torch.Tensor | None:
        """The head's passes over this step (actors/gpu/mtp.py), queued without waiting: the
        bucket's second graph after its first, or eagerly over the forward's hidden states.
        The drafts' host copy [B, k] when a row asked for them (StepPlan.mtp_draft), else None
        (the passes still write the head's KV at the step's positions)."""
        num_seqs = len(plan.seq_lens)
        self.mtp.load(plan, tokens, spec, bucket.seqs if bucket is not None else num_seqs)
        if bucket is not None:
            self.graphs.replay_then(bucket)
            self.mtp.replays += 1
        else:
            attn = self._step_attn(inputs, plan=plan)
            self.mtp.body(num_seqs, attn, inputs, hidden, self.model_kv())
        return self.mtp.result(num_seqs) if plan.mtp_draft.any() else None

    def _mtp_body(self, bucket: Bucket) -> None:
        """What a mixed bucket's second graph records: the head's passes over the step buffers
        and the hidden states the bucket's first graph kept."""
        inputs = self.buffers.views(num_tokens=bucket.tokens, num_seqs=bucket.seqs)
        attn = self._step_attn(inputs, bucket=bucket)
        hidden = self._graph_hidden[: bucket.tokens]
        self.mtp.body(bucket.seqs, attn, inputs, hidden, self.model_kv())

    @torch.inference_mode()
    def _capture(self) -> None:
        start = time.perf_counter()
        # (the head's passes; under expert parallelism MTP steps run eagerly: forward.py
        # `_bucket`)
        then = self._mtp_body if self.mtp is not None and self.ep is None else None
        with self._recording(True):
            self.graphs.capture(self._graph_body, self._neutral_step, then)
        if self.draft is not None and self.draft.graphs is not None:  # (draft_graphs.py)
            self.draft.graphs.capture(self._sampled)
        self.graph_capture_seconds = time.perf_counter() - start


def plan_arrays(
    plan: StepPlan, names=StepBuffers.FIELD_NAMES, verify_snaps: dict | None = None
) -> dict[str, np.ndarray]:
    """The StepPlan's arrays by StepBuffers field name (`names`: the buffers' fields; empty
    prev_rows, mamba_*: all -1), and where the buffers hold snapshot entries (a dict of
    Fields), the hybrid's verify rows' `verify_snaps` (row -> [(position, slot)]) in them."""
    arrays = {name: getattr(plan, name) for name in names if name not in _SNAPSHOT_FIELDS}
    if not len(plan.prev_rows):
        arrays["prev_rows"] = np.full(len(plan.input_ids), -1, dtype=np.int32)
    for name in ("mamba_init", "mamba_out"):  # empty: no Mamba layers
        if not len(arrays[name]):
            arrays[name] = np.full(len(plan.seq_lens), -1, dtype=np.int32)
    if "snap_pos" in names:
        shape = (len(plan.seq_lens), names["snap_pos"].width)
        pos, slots = np.ones(shape, np.int32), np.full(shape, -1, np.int32)
        for row, entries in (verify_snaps or {}).items():
            for j, (p, slot) in enumerate(entries):
                pos[row, j], slots[row, j] = p, slot
        arrays["snap_pos"], arrays["snap_slots"] = pos, slots
    return arrays


_SNAPSHOT_FIELDS = ("snap_pos", "snap_slots")
_ATTN_FIELDS = ("query_start_loc", "seq_lens", "block_tables", "slot_mapping")
