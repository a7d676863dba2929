"""The model worker: weights, the KV cache tensor, forward + sampling for one StepPlan.

The only place in actors/ that imports torch. It runs in the gpu actor's dedicated thread; it
never decides what to compute (the engine's plan does) and never talks to sockets.
"""

from __future__ import annotations

import json
import time

import numpy as np
import torch

from messages.gpu import LoadModel, ModelLoaded, StepPlan, StepResult
from ops.loader import load_model
from ops.models.llama import AttentionMetadata, allocate_kv_cache, kv_cache_bytes_per_block
from ops.sampling import sample

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelWorker:
    def __init__(self):
        self.model = None
        self.kv_cache: torch.Tensor | None = None
        self.device = torch.device("cpu")
        self.block_size = 0

    def load(self, msg: LoadModel) -> ModelLoaded:
        if msg.dtype not in DTYPES:
            raise ValueError(f"dtype {msg.dtype!r} is not one of {', '.join(DTYPES)}")
        dtype = DTYPES[msg.dtype]
        self.device = torch.device(msg.device)
        model, config, tokenizer = load_model(msg.model, dtype=dtype, device=self.device)
        per_block = kv_cache_bytes_per_block(config, msg.block_size, dtype)
        num_blocks = int(msg.kv_cache_gb * 1024**3 // per_block)
        if msg.max_blocks > 0:
            num_blocks = min(num_blocks, msg.max_blocks)
        if num_blocks < 1:
            raise ValueError(
                f"buffer_size_gb ({msg.kv_cache_gb}) holds no KV block of {per_block} bytes"
            )
        self.block_size = msg.block_size
        self.kv_cache = allocate_kv_cache(config, num_blocks, msg.block_size, dtype, self.device)
        self.model = model
        return ModelLoaded(
            model=msg.model,
            num_blocks=num_blocks,
            block_size=msg.block_size,
            vocab_size=config.vocab_size,
            max_position_embeddings=config.max_position_embeddings,
            tokenizer=json.dumps(tokenizer.to_wire()),
            eos_token_ids=tuple(config.eos_token_ids),
        )

    def _tensor(self, a: np.ndarray, dtype=None) -> torch.Tensor:
        # np.frombuffer views are read-only; torch wants writable memory.
        t = torch.from_numpy(np.array(a, copy=True))
        return t.to(self.device, dtype=dtype, non_blocking=True)

    @torch.inference_mode()
    def step(self, plan: StepPlan) -> StepResult:
        start = time.perf_counter()
        t = self._tensor
        attn = AttentionMetadata(
            query_start_loc=t(plan.query_start_loc),
            seq_lens=t(plan.seq_lens),
            block_tables=t(plan.block_tables),
            slot_mapping=t(plan.slot_mapping, torch.int64),
        ).with_layout(plan.query_start_loc.tolist(), plan.seq_lens.tolist(), self.block_size)
        hidden = self.model(
            t(plan.input_ids, torch.int64), t(plan.positions, torch.int64), attn, self.kv_cache
        )
        # hidden: [T, H]; only the last token of each sampled sequence needs logits.
        rows = np.flatnonzero(plan.sample)
        last = plan.query_start_loc[1:][rows] - 1
        logits = self.model.compute_logits(hidden[t(last, torch.int64)])
        if not (plan.temperature[rows] > 0).any():
            tokens = logits.argmax(dim=-1)  # all greedy: skip the sort and the noise
        else:
            tokens = sample(
                logits,
                t(plan.temperature[rows]),
                t(plan.top_k[rows]),
                t(plan.top_p[rows]),
                t(plan.seeds[rows]),
                t(plan.gen_index[rows]),
            )
        token_ids = np.full(len(plan.sample), -1, dtype=np.int32)
        token_ids[rows] = tokens.cpu().numpy()
        return StepResult(plan.step, token_ids, None, time.perf_counter() - start)
