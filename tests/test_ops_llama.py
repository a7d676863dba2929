"""ops.models.llama + ops.loader against Hugging Face transformers on the same weights (fp32, CPU).

The default GGUF is loaded once per module by both sides; a tiny random Llama saved as a
safetensors directory covers the Hugging Face loader. Our side runs the production attention
path, as the gpu worker drives it (metadata with the step's layout attached: decode rows and
prefill rows through slots and fused SDPA). Paged runs use block size 16 and shuffled,
non-contiguous block tables, so a wrong slot or gather shows up as a logits mismatch.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch

from taipan.models import resolve
from taipan.ops.attention import build_attention_metadata
from taipan.ops.loader import ModelLoadError, load_model
from taipan.ops.models.llama import allocate_kv_cache, kv_cache_bytes_per_block
from taipan.ops.sampling import sample
from tests.random_llama import TINY_SHAPE

# The default model as `make model` fetches it (runtime/models.py), wherever its cache is.
MODEL_PATH = Path(resolve("smollm2")[1])
MODEL_DIR = MODEL_PATH.parent
GGUF_NAME = MODEL_PATH.name
BLOCK_SIZE = 16
ATOL = 1e-3

PROMPTS = [
    "The capital of France is Paris. The capital of Germany is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a land far away, there lived a small dragon who loved 🍰.",
]


@pytest.fixture(scope="module")
def ours():
    model, config, tok = load_model(MODEL_DIR / GGUF_NAME)
    return model, config, tok


@pytest.fixture(scope="module")
def hf_model(hf):
    """The session's transformers model on the same GGUF (tests/conftest.py `hf`: loading
    it takes ~25 s on the 2-core box, once)."""
    return hf[0]


@torch.no_grad()
def hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([ids])).logits[0].float()  # [len, vocab]


class PagedRunner:
    """A minimal GPU-actor stand-in: shuffled blocks per sequence, steps over chunk dicts.
    `build_attention_metadata` attaches the layout with the block size, as the worker's
    `AttentionMetadata(...).with_layout(query_start, seq_lens, block_size)` does."""

    def __init__(self, model, config, num_blocks=128, seed=0, dtype=torch.float32):
        self.model = model
        self.cache = allocate_kv_cache(config, num_blocks, BLOCK_SIZE, dtype, "cpu")
        order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
        self.free = order.tolist()
        self.tables: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}

    def add(self, seq: int, max_len: int) -> None:
        self.tables[seq] = [self.free.pop() for _ in range(math.ceil(max_len / BLOCK_SIZE))]
        self.computed[seq] = 0

    @torch.no_grad()
    def step(self, chunks: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Run one forward over every sequence's chunk; logits [len(chunk), vocab] per seq."""
        seqs = list(chunks)
        query_lens = [len(chunks[s]) for s in seqs]
        seq_lens = [self.computed[s] + len(chunks[s]) for s in seqs]
        meta, positions = build_attention_metadata(
            query_lens, seq_lens, [self.tables[s] for s in seqs], BLOCK_SIZE
        )
        ids = torch.tensor([t for s in seqs for t in chunks[s]], dtype=torch.int64)
        logits = self.model.compute_logits(self.model(ids, positions, meta, self.cache))
        out = dict(zip(seqs, logits.split(query_lens), strict=True))
        for s, n in zip(seqs, query_lens, strict=True):
            self.computed[s] += n
        return out


def test_config_from_gguf(ours):
    _, config, tok = ours
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
    assert config.vocab_size == tok.vocab_size == 49152
    assert config.tie_word_embeddings and config.rope_theta == 100000.0
    assert config.eos_token_ids == (2,)
    cache = allocate_kv_cache(config, 3, BLOCK_SIZE, torch.float32, "cpu")
    assert cache.shape == (30, 2, 3, BLOCK_SIZE, 3, 64)
    assert kv_cache_bytes_per_block(config, BLOCK_SIZE, torch.float32) * 3 == cache.nbytes


@pytest.mark.parametrize("prompt", PROMPTS)
def test_full_prompt_logits_match_hf(ours, hf_model, prompt):
    model, config, tok = ours
    ids = tok.encode(prompt)
    runner = PagedRunner(model, config)
    runner.add(0, len(ids))
    logits = runner.step({0: ids})[0]
    torch.testing.assert_close(logits, hf_logits(hf_model, ids), atol=ATOL, rtol=0)


def test_chunked_prefill_and_batched_decode_match_hf(ours, hf_model):
    """Four sequences: chunked prefill (two chunks), steps mixing prefill and decode rows, then
    token-by-token decode of all four batched together. Sequence 2 arrives while the others
    decode, and its second chunk is a prefill after a cached prefix in a batch of decode rows."""
    model, config, tok = ours
    texts = PROMPTS + ["Short one."]
    continuation = tok.encode(" and then the story continues with more words")[:7]
    full = [tok.encode(t) + continuation for t in texts]
    prompt_lens = [len(f) - len(continuation) for f in full]
    # Per sequence, the tokens it runs in each step (0 = not in that step's batch): prefill
    # chunks, then one token at a time.
    plans = [
        [prompt_lens[0] // 2, prompt_lens[0] - prompt_lens[0] // 2] + [1] * 6,
        [5, prompt_lens[1] - 5] + [1] * 6,
        [0, 0, 6, prompt_lens[2] - 6, 1, 1, 1, 1],
        [prompt_lens[3]] + [1] * 7,
    ]
    runner = PagedRunner(model, config, seed=1)
    for seq, ids in enumerate(full):
        runner.add(seq, len(ids))
        assert sum(plans[seq]) <= len(ids)
    expected = [hf_logits(hf_model, ids) for ids in full]
    mixed = []
    for step in range(len(plans[0])):
        chunks = {}
        for seq, plan in enumerate(plans):
            start = sum(plan[:step])
            if plan[step]:
                chunks[seq] = full[seq][start : start + plan[step]]
        starts = {seq: runner.computed[seq] for seq in chunks}
        out = runner.step(chunks)
        for seq, logits in out.items():
            ref = expected[seq][starts[seq] : starts[seq] + len(chunks[seq])]
            torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0, msg=f"step {step} seq {seq}")
        if any(len(c) == 1 for c in chunks.values()):
            mixed += [len(c) > 1 and starts[seq] > 0 for seq, c in chunks.items()]
    assert any(mixed), "no step mixed decode rows with a prefill after a cached prefix"


def _greedy_generate(model, config, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """Batched greedy decoding through the paged path and ops.sampling."""
    runner = PagedRunner(model, config, seed=2)
    for seq, ids in enumerate(prompts):
        runner.add(seq, len(ids) + max_new)
    outputs: list[list[int]] = [[] for _ in prompts]
    chunks = dict(enumerate(prompts))
    for step in range(max_new):
        logits = runner.step(chunks)
        last = torch.stack([logits[seq][-1] for seq in chunks])
        n = len(chunks)
        params = dict(
            temperature=torch.zeros(n),
            top_k=torch.zeros(n, dtype=torch.int32),
            top_p=torch.ones(n),
            seeds=torch.full((n,), -1, dtype=torch.int64),
            gen_index=torch.full((n,), step, dtype=torch.int32),
        )
        tokens = sample(last, **params).tolist()
        for seq, token in zip(chunks, tokens, strict=True):
            outputs[seq].append(token)
        chunks = {seq: [outputs[seq][-1]] for seq in chunks}
    return outputs


def test_greedy_continuation_matches_hf_generate(ours, hf_model):
    model, config, tok = ours
    conversations = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "user", "content": "Write a haiku about the sea."}],
    ]
    prompts = [tok.apply_chat_template(c) for c in conversations]
    ours_out = _greedy_generate(model, config, prompts, 16)
    for prompt, got in zip(prompts, ours_out, strict=True):
        with torch.no_grad():
            generated = hf_model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
                max_new_tokens=16,
                do_sample=False,
            )[0, len(prompt) :].tolist()
        # HF stops at EOS; ours runs on, so compare up to HF's length.
        assert got[: len(generated)] == generated, (tok.decode(got), tok.decode(generated))


def test_bf16_runs_and_agrees_roughly(ours):
    model, config, tok = ours
    model_bf16 = copy.deepcopy(model).to(torch.bfloat16)
    ids = tok.encode(PROMPTS[0])
    fp32 = PagedRunner(model, config)
    fp32.add(0, len(ids))
    bf16 = PagedRunner(model_bf16, config, dtype=torch.bfloat16)
    bf16.add(0, len(ids))
    a, b = fp32.step({0: ids})[0], bf16.step({0: ids})[0]
    assert b.dtype == torch.float32
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.8


@pytest.mark.parametrize("tied", [False, True])
def test_tiny_hf_directory_matches_hf(ours, tmp_path, tied):
    transformers = pytest.importorskip("transformers")
    _, _, tok = ours
    hf_config = transformers.LlamaConfig(
        vocab_size=tok.vocab_size,
        **TINY_SHAPE,
        rms_norm_eps=1e-6,
        rope_theta=50000.0,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(hf_config).eval()
    reference.save_pretrained(tmp_path)
    tok.save_json(tmp_path / "tokenizer.json")
    tokenizer_config = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
    tokenizer_config["chat_template"] = tok.chat_template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))

    model, config, loaded_tok = load_model(tmp_path)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 16)
    assert config.rope_theta == 50000.0 and config.tie_word_embeddings == tied
    assert loaded_tok.encode("hello <|im_end|>") == tok.encode("hello <|im_end|>")
    ids = torch.randint(0, tok.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    runner = PagedRunner(model, config)
    runner.add(0, 40)
    first, rest = runner.step({0: ids[:25].tolist()})[0], runner.step({0: ids[25:].tolist()})[0]
    with torch.no_grad():
        expected = reference(ids[None]).logits[0]
    torch.testing.assert_close(torch.cat([first, rest]), expected, atol=1e-4, rtol=0)


def test_missing_path_is_a_model_load_error(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelLoadError, match="nope.gguf"):
        load_model(missing)


def test_not_a_gguf_file(tmp_path):
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"PK\x03\x04 definitely a zip")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_model(bogus)


def test_unsupported_gguf_architecture(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="'mamba' is not supported"):
        load_model(path)


def test_unsupported_hf_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel"):
        load_model(tmp_path)


def test_hf_directory_without_weights(ours, tmp_path):
    _, _, tok = ours
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": tok.vocab_size,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    tok.save_json(tmp_path / "tokenizer.json")
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(tmp_path)


def test_empty_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(tmp_path)
