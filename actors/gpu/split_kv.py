"""Per-layer-group KV on the gpu side (the engine's half and the contract: actors/engine/
local_kv.py): whether a loaded model's windowed layers get a pool of their own (`SplitKV.of`),
the two pools' block bytes for the sizing, their one allocation and its per-layer view
(ops/models/llama.WindowedKV, made again when a resume moves the allocation), and the block
copies a plan asks for (a prefix hit's cached window into its ring, computed prompt blocks
into the cache).

Must not touch: the plan, the step buffers, the model's weights. One allocation, so suspend,
offload and resume move it as they move a one-pool cache.
"""

from __future__ import annotations

import numpy as np
import torch

from taipan.actors.config import local_chunk, ring_blocks
from taipan.actors.gpu.host_staging import to_device
from taipan.actors.gpu.window import windowed_layers
from taipan.messages.gpu import LoadModel
from taipan.ops.models.llama import LlamaForCausalLM, WindowedKV, kv_heads_per_rank
from taipan.ops.parallel import TPGroup


class SplitKV:
    """A model's split: `window` W, which layers have it, and (after the sizing) the pools'
    block counts; `view(flat)` the model's per-layer cache over the allocation."""

    def __init__(self, window: int, windowed: tuple[bool, ...], msg: LoadModel):
        self.window, self.windowed = window, windowed
        chunk = local_chunk(
            window, msg.block_size, msg.max_tokens, msg.max_sequence_length,
            msg.num_speculative_tokens,
        )  # fmt: skip
        self.ring_blocks = ring_blocks(window, msg.block_size, chunk)
        # (with prefix caching the rest of the windowed layers' share caches their keys)
        self.wanted = 2**62 if msg.local_kv_cache else msg.max_requests * self.ring_blocks
        self.num_blocks = self.num_local = 0
        self.per_block: tuple[int, int, int] = (msg.block_size, 0, 0)
        self._view: tuple[torch.Tensor, WindowedKV] | None = None

    @classmethod
    def of(cls, msg: LoadModel, model, config) -> SplitKV | None:
        """The split of this model, or None: one pool for every layer (LoadModel.local_kv_pool
        off, not a Llama-skeleton model, no windowed layers among global ones, or a ring that
        would hold a whole max_sequence_length request)."""
        if not msg.local_kv_pool or not isinstance(model, LlamaForCausalLM):
            return None
        found = windowed_layers(config)
        if found is None or config.num_kv_layers != len(found[1]):
            return None
        split = cls(*found, msg)
        if split.ring_blocks * msg.block_size >= msg.max_sequence_length:
            return None  # (nothing to gain)
        return split

    def block_bytes(self, per_block: int, num_kv_layers: int) -> tuple[int, int]:
        """(the main pool's block, the windowed pool's) from one pool's block of every layer."""
        local = per_block // num_kv_layers * sum(self.windowed)
        return per_block - local, local

    def allocate(self, config, num_blocks: int, num_local: int, dtype, device, tp: TPGroup):
        """The one allocation of both pools at the agreed sizes (flat)."""
        self.num_blocks, self.num_local, self._view = num_blocks, num_local, None
        self.per_block = (self.per_block[0], kv_heads_per_rank(config, tp), config.head_dim)
        n = WindowedKV.numel(self.windowed, num_blocks, num_local, self.per_block)
        return torch.empty(n, dtype=dtype, device=device)

    def view(self, flat: torch.Tensor) -> WindowedKV:
        """The model's per-layer cache over `flat` (made once per allocation)."""
        if self._view is None or self._view[0] is not flat:
            kv = WindowedKV(flat, self.windowed, self.num_blocks, self.num_local, self.per_block)
            self._view = (flat, kv)
        return self._view[1]

    def copy(self, flat: torch.Tensor, src: np.ndarray, dst: np.ndarray) -> None:
        """Blocks `src` of the windowed pool into `dst` (every windowed layer, keys and values;
        the gather reads them all before the scatter writes; pinned index uploads: a step may
        be in flight, which a pageable copy would wait for)."""
        local = self.view(flat).local  # [windowed layers, 2, blocks, block_size, heads, dim]
        s, d = (to_device(a, flat.device, torch.int64) for a in (src, dst))
        local[:, :, d] = local[:, :, s]
