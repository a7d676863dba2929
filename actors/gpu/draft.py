"""A draft model for speculative decoding (speculative_method "draft_model", LoadModel.draft_model):
a second, smaller model of the same tokenizer that the gpu worker runs before each step to keep
its own KV cache up to date and to draft the verify rows' tokens (`DraftModel.fill`).

The draft's KV cache has the target's block ids and block size (the engine's block tables serve
both; the worker sizes the pool with both models' bytes per block), so it needs no bookkeeping
of its own: whatever positions a step computes for the target, the draft computes for itself
in the same slots. Every step the draft model forwards every row of the plan, in one batch:

- a prefill chunk or a plain decode row: the plan's tokens (a decode row's token from the
  previous step's sampled tokens where `prev_rows` says so), so the draft's KV follows the
  target's, prompts and plain tokens alike;
- a verify row (StepPlan.draft_prev >= 0; its plan tokens are the last known token t at
  position s, then num_drafts placeholders): the token before t (draft_prev, position s - 1)
  and t, as two one-token rows (the second attends the first's KV, which each layer writes
  before it attends). Position s - 1 may already be in the draft's cache (rewritten with the
  same values) or not (the previous step accepted every draft: the last one was never fed to
  the draft); earlier positions always are. t's logits give the first draft; then one-token
  forwards of the verify rows feed each draft at s + j (the verify row's own slots: the
  engine allocated them) and give the next, greedily (argmax), until each row has its
  num_drafts.

`fill` returns the plan with those drafts in its input_ids: from there the step verifies them
as it verifies n-gram drafts (actors/gpu/speculative.py), grammars and penalties included.
Greedy drafts are point masses, which the rejection sampler takes exactly (ops/speculative.py).
A forward of one token a row (every one of a step without prefill chunks) replays a CUDA
graph of the draft when the worker captured them (actors/gpu/draft_graphs.py: CUDA graphs on,
not a self-draft sharded over tensor-parallel peers); the others run eagerly. One host copy of
the drafts at the end.

The draft's KV cache stays where it is through a suspend (it is small next to the target's; in
recompute mode every request recomputes from position 0, the draft too). Expert parallelism
(dummy steps) and drafts with recurrent layers are refused at load.

Must not touch: the target's KV cache, its buffers, the plan's other fields.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import torch

from taipan.actors.gpu.draft_graphs import (
    FIELDS,
    LENGTH,
    PICK,
    POSITION,
    PREV,
    SLOT,
    TOKEN,
    DraftGraphs,
    draft_graph_sizes,
)
from taipan.actors.gpu.host_staging import to_device
from taipan.actors.gpu.mamba_config import has_recurrent_layers
from taipan.actors.gpu.window import kv_window
from taipan.messages.gpu import LoadModel, StepPlan
from taipan.ops.attention import AttentionMetadata
from taipan.ops.loader import load_model
from taipan.ops.parallel import SINGLE, TPGroup

__all__ = ["DraftModel", "check_draft", "check_draft_prev", "load_draft", "self_draft"]


def check_draft_prev(plan: StepPlan, draft: bool, vocab_size: int) -> None:
    """ValueError for a plan's draft_prev the worker cannot take (`draft`: a draft model is
    loaded); called after actors/gpu/speculative.py `check_drafts`."""
    prev = plan.draft_prev
    if not len(prev):
        return
    if not draft:
        raise ValueError("the plan's draft_prev asks for a draft model's drafts; none is loaded")
    if len(prev) != len(plan.seq_lens) or not len(plan.num_drafts):
        raise ValueError("draft_prev needs one entry per sequence, and num_drafts")
    rows = np.flatnonzero(prev >= 0)
    if (prev < -1).any() or (prev >= vocab_size).any():
        raise ValueError(f"draft_prev holds tokens outside -1..{vocab_size - 1}")
    if (plan.num_drafts[rows] < 1).any():
        raise ValueError("draft_prev names a sequence without drafts")
    if (plan.positions[plan.query_start_loc[rows]] < 1).any():
        raise ValueError("a sequence with draft_prev must start after position 0")


def check_draft(target_config, draft_config, target_window: int, draft_window: int) -> None:
    """ValueError for a draft model the worker cannot run beside this target (`*_window`:
    the window behind which a model's KV blocks may be freed, 0: none)."""
    if draft_config.vocab_size != target_config.vocab_size:
        raise ValueError(
            f"the draft model's vocabulary ({draft_config.vocab_size} tokens) is not the "
            f"target's ({target_config.vocab_size}): a draft model needs the same tokenizer"
        )
    if target_window and not 0 < draft_window <= target_window:
        raise ValueError(
            f"the draft model reads further back ({draft_window or 'its whole context'}) than "
            f"the target's sliding window ({target_window}), behind which the KV blocks are "
            "freed: not built"
        )


SELF_PREFIX = "self:"


def load_draft(msg: LoadModel, target, target_config, dtype, device, tp: TPGroup):
    """(model, config, its tensor-parallel group) of LoadModel.draft_model, or None: a model
    of its own, whole on every tensor-parallel process (it drafts the same tokens on each),
    or "self:N", the target's first N layers (sharded as the target is, `tp`). ValueError
    for one that cannot draft for this target."""
    if not msg.draft_model:
        return None
    if msg.expert_parallel_size > 1:
        raise ValueError("a draft model under expert parallelism is not built yet")
    if msg.draft_model.startswith(SELF_PREFIX):
        model, config = self_draft(target, target_config, msg.draft_model)
    else:
        model, config, _ = load_model(msg.draft_model, dtype=dtype, device=device)
        tp = SINGLE
    if has_recurrent_layers(config):
        raise ValueError(
            "a draft model with recurrent (Mamba / GDN) layers is not built yet: its state "
            "would have to be rolled back to the last accepted draft too"
        )
    check_draft(target_config, config, kv_window(target_config), kv_window(config))
    return model, config, tp


def self_draft(model: torch.nn.Module, config, spec: str):
    """(model, config) of a self-speculative draft, speculative_model "self:N": the target's
    first N decoder layers, then its final norm and head (LayerSkip-style early exit). It
    holds no weights of its own (the same modules), so it follows every weight update; its
    KV cache is its own (N layers). ValueError for a model without that skeleton or an N
    that is not below its layer count."""
    n = int(spec.removeprefix(SELF_PREFIX))
    layers = getattr(model, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not hasattr(config, "num_layers"):
        raise ValueError(
            f"speculative_model={spec!r}: a self-draft needs a Llama-skeleton model (Llama, "
            f"Qwen2/3, Qwen3-MoE, Mistral, Gemma 3), not {type(model).__name__}"
        )
    if not 1 <= n < len(layers):
        raise ValueError(
            f"speculative_model={spec!r}: N must be in 1..{len(layers) - 1} (the target has "
            f"{len(layers)} layers)"
        )
    draft = copy.copy(model)
    draft._modules = dict(model._modules)  # (the target keeps its own layer list)
    draft._modules["layers"] = torch.nn.ModuleList(list(layers)[:n])
    draft_config = dataclasses.replace(config, num_layers=n)
    draft.config = draft_config
    return draft, draft_config


@dataclasses.dataclass
class DraftModel:
    model: torch.nn.Module
    kv_cache: torch.Tensor
    block_size: int
    device: torch.device
    # Its decode-only forwards replayed from CUDA graphs (actors/gpu/draft_graphs.py), or
    # None: every forward eager.
    graphs: DraftGraphs | None = None
    # Its config, and whether it has weights of its own (a model of its own, not "self:N"):
    # then UpdateWeights.draft updates them (actors/gpu/controls.py).
    config: object = None
    own_weights: bool = False

    @torch.inference_mode()
    def fill(self, plan: StepPlan, sampled: torch.Tensor | None) -> StepPlan:
        """Forward the draft over the plan's rows and draft its verify rows' tokens (the
        module docstring); returns the plan with them in its input_ids (the same plan when
        none verifies). `sampled`: the previous step's sampled tokens on the device (what
        `prev_rows` reads)."""
        qsl = plan.query_start_loc.astype(np.int64)
        batch = len(plan.seq_lens)
        verify = np.zeros(batch, bool)
        if len(plan.draft_prev):
            verify = plan.draft_prev >= 0
        # The forward's sequences: a verify row's two known tokens are two one-token rows (the
        # second attends the first's KV, written earlier in the same layer), so a step without
        # prefill chunks is one token per row: what the draft's graphs hold.
        ids, pos, slots, prev, lens, table_rows, starts = [], [], [], [], [], [], [0]
        prev_rows = plan.prev_rows if len(plan.prev_rows) else np.full(len(plan.input_ids), -1)
        last = []  # per verify row, its last known token's index in the forward
        for i in range(batch):
            a, b = qsl[i], qsl[i + 1]
            if verify[i]:
                s = int(plan.positions[a])
                ids += [int(plan.draft_prev[i]), int(plan.input_ids[a])]
                pos += [s - 1, s]
                slots += [self._slot(plan, i, s - 1), int(plan.slot_mapping[a])]
                prev += [-1, -1]
                lens += [s, s + 1]
                table_rows += [i, i]
                starts += [len(ids) - 1, len(ids)]
                last.append(len(ids) - 1)
            else:
                ids += plan.input_ids[a:b].tolist()
                pos += plan.positions[a:b].tolist()
                slots += plan.slot_mapping[a:b].tolist()
                prev += prev_rows[a:b].tolist()
                lens.append(int(plan.seq_lens[i]))
                table_rows.append(i)
                starts.append(len(ids))
        tables = plan.block_tables[np.asarray(table_rows, np.int64)]
        n = self._bucket(len(ids), len(lens))
        if n is not None:  # (no host wait: the pinned copies and the graph queue behind)
            pick = last + [0] * (len(ids) - len(last))  # (the verify rows' last known tokens)
            fields = np.asarray([ids, prev, pos, slots, lens, pick], dtype=np.int64)
            self.graphs.load(n, fields, tables)
            out = self.graphs.run(n)
            first = out.index_select(0, self.graphs.fields(n)[PICK, : len(last)])
        else:
            tokens = self._tensor(ids, torch.int64)
            if max(prev, default=-1) >= 0:
                p = self._tensor(prev, torch.int64)
                tokens = torch.where(p >= 0, sampled[p.clamp(min=0)], tokens)
            first = self._forward(tokens, pos, slots, starts, lens, tables, last)
        rows = np.flatnonzero(verify)
        if not len(rows):
            return plan
        drafts = self._draft(plan, rows, first)
        input_ids = plan.input_ids.copy()
        for i, row in zip(rows.tolist(), drafts, strict=True):
            input_ids[qsl[i] + 1 : qsl[i] + 1 + len(row)] = row
        return dataclasses.replace(plan, input_ids=input_ids)

    def use_graphs(self, msg: LoadModel) -> None:
        """Replay its one-token forwards from CUDA graphs (the worker captures them with the
        target's), at the target's decode sizes and their doubles, where there are any."""
        sizes = draft_graph_sizes(msg.cuda_graph_decode_sizes, msg.max_requests)
        if sizes:
            max_blocks = -(-msg.max_sequence_length // msg.block_size)
            self.graphs = DraftGraphs(
                self.model, self.kv_cache, msg.block_size, sizes, max_blocks, self.device
            )

    def _bucket(self, num_tokens: int, num_rows: int) -> int | None:
        """The draft graph bucket of a forward (one token a row), or None: eager."""
        if self.graphs is None or num_tokens != num_rows or not num_rows:
            return None
        return self.graphs.pick(num_rows)

    def _draft(self, plan: StepPlan, rows: np.ndarray, first: torch.Tensor) -> list[list[int]]:
        """Each verify row's num_drafts greedy drafts: `first` [R] came from its last known
        token; one-token forwards of the rows that need more feed each draft in turn."""
        qsl = plan.query_start_loc.astype(np.int64)
        need = plan.num_drafts[rows].astype(np.int64)
        got, cur = [first], first
        live = np.arange(len(rows))  # indices into rows still drafting, ascending
        for j in range(1, int(need.max())):
            keep = np.flatnonzero(need[live] > j)
            live = live[keep]
            at = qsl[rows[live]] + j  # the verify row's input token at offset j: draft j
            pos = plan.positions[at]
            tables = plan.block_tables[rows[live]]
            n = self._bucket(len(live), len(live))
            if n is not None:
                fields = np.zeros((FIELDS, len(live)), dtype=np.int64)
                fields[PREV], fields[POSITION], fields[SLOT] = -1, pos, plan.slot_mapping[at]
                fields[LENGTH], fields[PICK] = pos + 1, keep
                self.graphs.load(n, fields, tables)
                block = self.graphs.fields(n)
                block[TOKEN, : len(live)].copy_(cur.index_select(0, block[PICK, : len(live)]))
                cur = self.graphs.run(n)[: len(live)].clone()  # (the next replay rewrites it)
            else:
                tokens = cur if len(keep) == len(cur) else cur[self._tensor(keep, torch.int64)]
                starts = list(range(len(live) + 1))
                cur = self._forward(
                    tokens, pos.tolist(), plan.slot_mapping[at], starts, (pos + 1).tolist(),
                    tables, np.arange(len(live)),
                )  # fmt: skip
            got.append(cur)
        return _by_row([g.cpu().numpy() for g in got], need)

    def _forward(self, tokens, pos, slots, starts, lens, tables, last) -> torch.Tensor:
        """One eager forward of the draft over a batch; the argmax after positions `last`."""
        attn = AttentionMetadata(
            query_start_loc=self._tensor(starts, torch.int32),
            seq_lens=self._tensor(lens, torch.int32),
            block_tables=self._tensor(np.asarray(tables), torch.int32),
            slot_mapping=self._tensor(slots, torch.int64),
        ).with_layout(np.asarray(starts), np.asarray(lens), self.block_size)
        hidden = self.model(tokens, self._tensor(pos, torch.int64), attn, self.kv_cache)
        if not len(last):
            return torch.zeros(0, dtype=torch.int64, device=self.device)
        logits = self.model.compute_logits(hidden[self._tensor(last, torch.int64)])
        return logits.argmax(dim=-1)

    def _slot(self, plan: StepPlan, row: int, position: int) -> int:
        bs = self.block_size
        return int(plan.block_tables[row, position // bs]) * bs + position % bs

    def _tensor(self, values, dtype) -> torch.Tensor:
        # (pinned and queued: a blocking copy waits for everything queued before it,
        # tests/perf/host_sync_probe.py)
        return to_device(np.asarray(values), self.device, dtype)


def _by_row(steps: list[np.ndarray], need: np.ndarray) -> list[list[int]]:
    """Per verify row, its drafts in order: steps[j] holds draft j + 1 of the rows with
    need > j, in row order."""
    out: list[list[int]] = [[] for _ in need]
    for j, values in enumerate(steps):
        for i, v in zip(np.flatnonzero(need > j).tolist(), values.tolist(), strict=True):
            out[i].append(int(v))
    return out
