"""Draft tokens from a model's multi-token-prediction head (issue 29 item 2, the drafting half;
the model side is ops/models/qwen3_next.py `mtp_forward`): `mtp_drafts`.

A step's forward gives the model's hidden state at every position it computed. The head at
position p reads that state and the token at p + 1 and scores the token at p + 2, so drafting
happens at the end of the step that computed the positions, in two parts:
1. one pass of the head over every token of the step (its attention writes the head's KV at
   those positions, as the model's layers wrote theirs): the token after a position is the
   row's next input token, or, for the row's last valid position (its last token, or a verify
   row's last accepted one), `after_last` (the token sampled there, the bonus token of a verify
   row, or a non-final prompt chunk's next prompt token). The head's KV at a verify row's
   rejected positions lies where the next step's pass rewrites it before any query reads it.
2. for the drafting rows, draft 1 is the argmax of the head's scores at the last valid
   position; then k - 1 one-token passes at the following positions, each fed the head's own
   output and its previous draft, give drafts 2..k (greedy: deterministic drafts, which the
   verify path takes as n-gram ones). A pass writes the head's KV only inside the row's last
   KV block (positions below ceil(seq_len / block_size) * block_size: a partial last block
   belongs to its request alone), so a row near a block's end gets fewer drafts.

`mtp_drafts` is the reference: eager, over the drafting rows only, reading row facts on the
host. `mtp_drafts_static` computes the same drafts from device tensors of fixed shapes (every
row of a padded step, the rows that do not draft masked), never waiting for the device, so the
gpu worker records it in a CUDA graph (actors/gpu/mtp.py). Must not touch: the model's layers'
KV (the head's layer has its own cache layer), the recurrent state, the step's buffers.
"""

from __future__ import annotations

import numpy as np
import torch

from taipan.ops.attention import AttentionMetadata, build_attention_metadata

__all__ = ["mtp_drafts", "mtp_drafts_static"]


@torch.no_grad()
def mtp_drafts(
    model,
    kv_cache: torch.Tensor,
    attn: AttentionMetadata,
    block_tables: list[list[int]],
    block_size: int,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    hidden: torch.Tensor,
    last: np.ndarray,
    after_last: np.ndarray,
    drafting: np.ndarray,
    k: int,
    with_logits: bool = False,
) -> np.ndarray | tuple[np.ndarray, torch.Tensor]:
    """Drafts int64 [B, k] (-1 past a row's last draft, and for rows not `drafting`); with
    `with_logits`, also the head's fp32 logits of each draft [B, k, V] (NaN where no draft: the
    draft distributions a sampled verification would read; tests compare them).

    The step's B rows: `attn` its metadata (query_start_loc, seq_lens, the rows' tables),
    `block_tables` the rows' block ids (host lists), `input_ids` / `positions` [T] the step's
    tokens, `hidden` [T, H] the model's output at them (after its final norm). Per row:
    `last` the index (into T) of its last valid position, inside the row; `after_last` the token
    after it; `drafting` bool, whether it wants drafts."""
    qsl = attn.query_start_loc.cpu().numpy().astype(np.int64)
    if not (len(last) == len(after_last) == len(drafting) == len(qsl) - 1):
        raise ValueError("last, after_last and drafting need one entry per row")
    if ((last < qsl[:-1]) | (last >= qsl[1:])).any():
        raise ValueError("each row's last valid position must be one of its tokens")
    if (after_last < 0).any():
        raise ValueError("each row needs the token after its last valid position")
    device = hidden.device
    at_last = torch.as_tensor(last, dtype=torch.int64).to(device)
    next_ids = torch.roll(input_ids.long(), -1)  # (a row's own next token; its last: below)
    next_ids[at_last] = torch.as_tensor(after_last, dtype=torch.int64).to(device)
    out = model.mtp_forward(next_ids, positions, hidden, attn, kv_cache)  # [T, H]
    run = _Drafts(model, kv_cache, block_tables, block_size, len(last), k, with_logits)
    rows = np.flatnonzero(drafting)
    if len(rows):
        state = out[at_last[torch.as_tensor(rows).to(device)]]  # [R, H]
        token = run.take(rows, 0, state)
        position = positions.cpu().numpy()[last[rows]]  # the rows' last valid positions
        seq_lens = attn.seq_lens.cpu().numpy().astype(np.int64)[rows]
        room = -(-seq_lens // block_size) * block_size  # one past the last KV slot they own
        run.chain(rows, position, room, state, token)
    return run.result(device)


class _Drafts:
    """The drafts of one `mtp_drafts` call, and its chain of one-token passes (part 2)."""

    def __init__(self, model, kv_cache, block_tables, block_size, batch, k, with_logits):
        self.model, self.kv_cache = model, kv_cache
        self.block_tables, self.block_size, self.k = block_tables, block_size, k
        self.drafts = np.full((batch, k), -1, dtype=np.int64)
        self.kept = [] if with_logits else None  # (rows, j, logits) of every pass

    def take(self, rows: np.ndarray, j: int, state: torch.Tensor) -> torch.Tensor:
        """Draft j of `rows` from the head's output `state` [R, H]: its argmax [R]."""
        logits = self.model.compute_logits(state)  # [R, V] fp32
        token = logits.argmax(-1)
        self.drafts[rows, j] = token.cpu().numpy()
        if self.kept is not None:
            self.kept.append((rows, j, logits))
        return token

    def chain(self, rows, position, room, state, token) -> None:
        """Drafts 2..k: row r's pass j at position[r] + j, while that is below room[r]."""
        device = state.device
        for j in range(1, self.k):
            live = np.flatnonzero(position + j < room)
            if not len(live):
                return
            at = position[live] + j
            meta, pos = build_attention_metadata(
                [1] * len(live),
                (at + 1).tolist(),
                [self.block_tables[r] for r in rows[live]],
                self.block_size,
                device,
            )
            keep = torch.as_tensor(live).to(device)
            state = self.model.mtp_forward(token[keep], pos, state[keep], meta, self.kv_cache)
            rows, position, room = rows[live], position[live], room[live]
            token = self.take(rows, j, state)

    def result(self, device) -> np.ndarray | tuple[np.ndarray, torch.Tensor]:
        if self.kept is None:
            return self.drafts
        vocab = self.kept[0][2].shape[-1] if self.kept else self.model.config.vocab_size
        logits = torch.full((*self.drafts.shape, vocab), float("nan"), device=device)
        for rows, j, values in self.kept:
            logits[torch.as_tensor(rows).to(device), j] = values
        return self.drafts, logits


@torch.no_grad()
def mtp_drafts_static(
    model,
    kv_cache: torch.Tensor,
    attn: AttentionMetadata,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    hidden: torch.Tensor,
    last: torch.Tensor,
    after: torch.Tensor,
    drafting: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    k: int,
) -> torch.Tensor:
    """`mtp_drafts` over device tensors of fixed shapes: drafts int64 [B, k] (-1 past a row's
    last draft and for rows not drafting). The step's T tokens (`input_ids`, `positions`,
    `hidden`, `attn`, padding included: a padding token's slot is -1) and its B rows:
    `last` [B] the index of each row's last valid position (-1: a padding row), `after` [B]
    the token after it, `drafting` [B] bool, `seq_lens` [B] and `block_tables` [B, max_blocks]
    the step's. Every pass runs all B rows; a row that does not draft (or has no room left in
    its last block) is a one-key row that writes no slot, and its outputs are dropped."""
    num_tokens, batch = input_ids.shape[0], last.shape[0]
    valid = last >= 0
    at = last.clamp(min=0)
    # The token after each position: the next one of the step, or at a row's last valid
    # position `after` (padding rows write theirs into one spare element past the end).
    next_ids = torch.cat([torch.roll(input_ids.long(), -1), input_ids.new_zeros(1).long()])
    spare = torch.full_like(at, num_tokens)
    next_ids.index_put_((torch.where(valid, at, spare),), after.long())
    out = model.mtp_forward(next_ids[:num_tokens], positions, hidden, attn, kv_cache)
    state = out[at]  # [B, H]
    token = model.compute_logits(state).argmax(-1)
    drafting = drafting & valid
    drafts = torch.full((batch, k), -1, dtype=torch.int64, device=hidden.device)
    drafts[:, 0] = torch.where(drafting, token, -1)
    position = positions[at].long()
    room = (seq_lens.long() + block_size - 1) // block_size * block_size
    query_start = torch.arange(batch + 1, dtype=torch.int32, device=hidden.device)
    rows = torch.arange(batch, device=hidden.device)
    for j in range(1, k):
        p = position + j
        live = drafting & (p < room)
        column = (p // block_size).clamp(max=block_tables.shape[1] - 1)
        block = block_tables[rows, column].long()
        meta = AttentionMetadata(
            query_start_loc=query_start,
            seq_lens=torch.where(live, p + 1, 1).int(),
            block_tables=block_tables,
            slot_mapping=torch.where(live, block * block_size + p % block_size, -1),
            num_decodes=batch,
            max_query_len=1,
        )
        if not hidden.is_cuda:  # (the CPU's attention wants its layout)
            meta.with_layout(np.arange(batch + 1), meta.seq_lens.numpy(), block_size)
        state = model.mtp_forward(token, p, state, meta, kv_cache)
        token = model.compute_logits(state).argmax(-1)
        drafts[:, j] = torch.where(live, token, -1)
    return drafts
