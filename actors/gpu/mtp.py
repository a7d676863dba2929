"""An MTP head's drafts in the gpu worker (speculative_method "mtp", LoadModel.mtp):
`MTPDrafter`, StepResult.next_drafts of one step, after its sampling and verification.

Owns the translation of a StepPlan and the step's outcome into ops/mtp.py
`mtp_drafts_static`'s row inputs: each row's last valid position (its last token, or a verify
row's last accepted one) and the token after it (the token sampled there, read on the device
from the step's sampled tokens; the verify row's token drawn after its accepted drafts; or a
prompt chunk's next prompt token, StepPlan.mtp_next), and whether it drafts. They live in
static device buffers (one int64 block [FIELDS, max_requests] filled from pinned memory without
waiting, and the step's sampled tokens copied on the device), so the head's passes over a
graphed step are recorded once per mixed bucket and replayed after the step's own graph
(actors/gpu/graphs.py, `then`), and the host never waits for them: the drafts' copy to the
host is queued before the step's end event, and `collect` reads them.

Must not touch the worker's step buffers or its sampled-token buffer; writes only the head's KV
layer (through the model) and its own buffers.
"""

from __future__ import annotations

import numpy as np
import torch

from taipan.actors.gpu.speculative import draft_rows
from taipan.messages.gpu import StepPlan
from taipan.ops.attention import AttentionMetadata
from taipan.ops.mtp import mtp_drafts_static

__all__ = ["MTPDrafter"]

# Rows of the static per-row block (int64): the row's last valid position (-1: padding), the
# token after it where the host knows it, 1 where it is the step's sampled token instead, and
# 1 where the row drafts.
LAST, AFTER, SAMPLED, DRAFTING = range(4)
FIELDS = DRAFTING + 1
STAGING = 4  # pinned staging buffers in the ring (one load a step)


class MTPDrafter:
    """The head's row buffers, its passes over a step (`body`: what a graph records) and the
    drafts' copies to the host; the worker loads a step's rows (`load`), replays its bucket's
    second graph or runs `body`, and collects `result`. Made once per load of the model."""

    def __init__(
        self, model, k: int, block_size: int, max_seqs: int, device, host_buffers: int
    ) -> None:
        """`host_buffers`: the drafts' pinned host copies, one per launched, uncollected step
        (the worker's HOST_TOKEN_BUFFERS)."""
        self.model, self.k, self.block_size = model, k, block_size
        self.device = torch.device(device)
        self._rows = torch.zeros(FIELDS * max_seqs, dtype=torch.int64, device=self.device)
        self.tokens = torch.zeros(max_seqs, dtype=torch.int64, device=self.device)
        self.out = torch.full((max_seqs, k), -1, dtype=torch.int64, device=self.device)
        pinned = self.device.type == "cuda"
        ring = STAGING if pinned else 1
        self._staging = [
            torch.zeros(FIELDS * max_seqs, dtype=torch.int64, pin_memory=pinned)
            for _ in range(ring)
        ]
        self._host_out = [
            torch.zeros(max_seqs, k, dtype=torch.int64, pin_memory=pinned)
            for _ in range(host_buffers if pinned else 1)
        ]
        self._results = 0
        self._copied: list[torch.cuda.Event | None] = [None] * ring
        self._next = 0
        self.replays = 0  # steps whose passes replayed a graph (the worker counts them)

    def fields(self, n: int) -> torch.Tensor:
        """The device block of `n` rows: [FIELDS, n] int64 (LAST, AFTER, SAMPLED, DRAFTING)."""
        return self._rows[: FIELDS * n].view(FIELDS, n)

    def load(
        self, plan: StepPlan | None, tokens: torch.Tensor | None, spec: np.ndarray | None, n: int
    ) -> None:
        """Fill the buffers for a step of `plan`'s rows padded to `n`: `tokens` [B] its sampled
        tokens (device; None: a neutral step of no rows), `spec` StepResult.spec_tokens of a
        step that verified drafts (else None). Queued without waiting (the staging buffer's
        last copy is waited for only when the ring comes round to it)."""
        rows = np.zeros((FIELDS, n), dtype=np.int64)
        rows[LAST] = -1
        count = 0 if tokens is None else len(plan.seq_lens)
        if count:
            qsl = plan.query_start_loc.astype(np.int64)
            rows[LAST, :count] = qsl[1:] - 1
            rows[AFTER, :count] = np.maximum(plan.mtp_next, 0)
            rows[SAMPLED, :count] = plan.sample != 0
            rows[DRAFTING, :count] = (plan.mtp_draft != 0) & (plan.sample != 0)
            if spec is not None:  # a verify row: its last accepted draft, then the token drawn
                for row in draft_rows(plan).tolist():
                    new = spec[row][spec[row] >= 0]
                    rows[LAST, row], rows[AFTER, row] = qsl[row] + len(new) - 1, new[-1]
                    rows[SAMPLED, row] = 0
        k = self._next
        self._next = (k + 1) % len(self._staging)
        copied = self._copied[k]
        if copied is not None and not copied.query():
            copied.synchronize()  # (the copy that last read this staging buffer)
        host = self._staging[k]
        host.numpy()[: FIELDS * n] = rows.reshape(-1)
        cuda = self.device.type == "cuda"
        self._rows[: FIELDS * n].copy_(host[: FIELDS * n], non_blocking=cuda)
        if count:
            self.tokens[:count].copy_(tokens)
        if cuda:
            if self._copied[k] is None:
                self._copied[k] = torch.cuda.Event()
            self._copied[k].record()

    def body(
        self,
        n: int,
        attn: AttentionMetadata,
        inputs: dict[str, torch.Tensor],
        hidden: torch.Tensor,
        kv_cache,
    ) -> None:
        """The head's passes over a step of `n` rows (what a graph records, or run eagerly):
        `attn` the step's attention metadata, `inputs` its buffers (input_ids, positions,
        seq_lens, block_tables), `hidden` [T, H] the forward's output; the drafts go to `out`."""
        f = self.fields(n)
        after = torch.where(f[SAMPLED] != 0, self.tokens[:n], f[AFTER])
        drafts = mtp_drafts_static(
            self.model,
            kv_cache,
            attn,
            inputs["input_ids"],
            inputs["positions"],
            hidden,
            f[LAST],
            after,
            f[DRAFTING] != 0,
            inputs["seq_lens"][:n],
            inputs["block_tables"][:n],
            self.block_size,
            self.k,
        )
        self.out[:n].copy_(drafts)

    def result(self, num_seqs: int) -> torch.Tensor:
        """The last step's drafts [num_seqs, k] on the host: a pinned copy queued without
        waiting on CUDA (read it after the step's end event), a copy on the CPU."""
        if self.device.type != "cuda":
            return self.out[:num_seqs].clone()
        self._results += 1
        host = self._host_out[self._results % len(self._host_out)][:num_seqs]
        return host.copy_(self.out[:num_seqs], non_blocking=True)
