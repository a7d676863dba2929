"""Tensor parallelism on the CPU: T real processes in a gloo group, fp32, equal to T = 1.

Each rank loads the same checkpoint sharded (ops/loader.py with a TPGroup), runs the same batch
through the production paged-KV forward (three prompts of different lengths and the first chunk
of a fourth prefilled together, then decode rows with that fourth's second chunk after its
cached prefix, then decode rows only), and sends back every token's logits; the test process
computes the same at T = 1. Every rank must hold logits equal to T = 1's within 1e-5 and the
same greedy picks; unseeded sampling (ranks seeded differently before joining) must draw the
same tokens on every rank.

Checkpoints: a Hugging Face directory (tied embeddings, GQA 4/2, a vocabulary of 259: not
divisible by 2), one with an untied LM head and a single kv head (replicated on both ranks),
a GGUF file written from the first (Q8_0, llama.cpp's Q/K row order: the sliced rows are
dequantized and un-permuted), and `random:tiny`. The gpu worker at T = 2 (its KV cache holds
the rank's kv heads) gives T = 1's tokens and log-probs, also after weight updates from a
state dict and from a checkpoint. Refusals: a Qwen3-MoE model, heads that do not divide, a size
below 1, a group whose peers never come (bounded wait). SmolLM2's GGUF at T = 3 (9 heads, 3 kv
heads) is marked slow.
"""

from __future__ import annotations

import os
import queue
import time
import traceback

import numpy as np
import pytest
import torch

from taipan.actors.gpu.worker import ModelWorker
from taipan.messages.gpu import GpuControl, LoadModel
from taipan.ops.attention import build_attention_metadata
from taipan.ops.loader import ModelLoadError, load_model
from taipan.ops.models.llama import allocate_kv_cache
from taipan.ops.parallel import (
    SINGLE,
    TPError,
    TPGroup,
    destroy_tp,
    init_tp,
    shard_heads,
    vocab_shard,
)
from taipan.ops.sampling import sample
from tests.ports import free_port
from tests.random_llama import GPU_TINY_SHAPE, TINY_SHAPE, make_random_llama

BLOCK_SIZE = 16
ATOL = 1e-5
RANK_TIMEOUT_S = 240  # the whole session of ranks; a hang fails the test, never blocks it
_gen = np.random.default_rng(0)
PROMPTS = [_gen.integers(0, 259, n).tolist() for n in (13, 6, 21)]
LONG = _gen.integers(0, 259, 20).tolist()  # prefilled in two chunks: 8 tokens, then 12
UPDATE_SEED = 7


# ---- running T processes ------------------------------------------------------------------------


def _rank_main(rank: int, size: int, init: str, cuda: bool, job, args, results) -> None:
    torch.set_num_threads(1)  # T processes share the box's cores
    torch.manual_seed(1000 + rank)  # init_tp must make the generators agree again
    device = f"cuda:{rank}" if cuda else "cpu"
    try:
        tp = init_tp(rank, size, init, device=device, timeout_s=60)
    except BaseException:
        results.put((rank, None, traceback.format_exc()))
        return
    try:
        results.put((rank, job(tp, *args), None))
    except BaseException:
        results.put((rank, None, traceback.format_exc()))
    finally:
        destroy_tp(tp)


def run_ranks(
    job, *args, size: int = 2, cuda: bool = False, timeout: float = RANK_TIMEOUT_S
) -> list:
    """Run `job(tp, *args)` in `size` spawned processes forming one group (gloo; `cuda`: NCCL,
    rank r on cuda:r); their results in rank order. A rank that fails or a session that
    outlives `timeout` fails the test (and every process is ended)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [
        ctx.Process(target=_rank_main, args=(r, size, init, cuda, job, args, results), daemon=True)
        for r in range(size)
    ]
    for p in procs:
        p.start()
    deadline, outs = time.monotonic() + timeout, {}
    try:
        while len(outs) < size:
            try:
                rank, out, error = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"tensor-parallel ranks timed out after {timeout} s ({sorted(outs)})")
            if error is not None:
                pytest.fail(f"tensor-parallel rank {rank} failed:\n{error}")
            outs[rank] = out
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    return [outs[r] for r in range(size)]


# ---- what every rank runs -----------------------------------------------------------------------


@torch.no_grad()
def run_batch(model, config, tp: TPGroup) -> dict:
    """Three steps over four sequences through the paged forward (shuffled blocks); every
    token's logits per step, the greedy picks, and one unseeded sample of the last logits."""
    num_blocks = 16
    cache = allocate_kv_cache(config, num_blocks, BLOCK_SIZE, torch.float32, "cpu", tp)
    free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(3)).tolist()
    tables = {s: [free.pop(), free.pop()] for s in range(4)}
    computed = dict.fromkeys(range(4), 0)
    picks: dict[int, int] = {}
    steps = [
        {0: PROMPTS[0], 1: PROMPTS[1], 2: PROMPTS[2], 3: LONG[:8]},
        None,  # decode rows 0-2 (their picks), then sequence 3's second chunk
        None,  # decode rows only
    ]
    out = {"logits": [], "picks": []}
    for i, chunks in enumerate(steps):
        if chunks is None:
            chunks = {s: [picks[s]] for s in range(3)}
            chunks[3] = LONG[8:] if i == 1 else [picks[3]]
        seqs = list(chunks)
        query_lens = [len(chunks[s]) for s in seqs]
        seq_lens = [computed[s] + n for s, n in zip(seqs, query_lens, strict=True)]
        meta, positions = build_attention_metadata(
            query_lens, seq_lens, [tables[s] for s in seqs], BLOCK_SIZE
        )
        ids = torch.tensor([t for s in seqs for t in chunks[s]])
        logits = model.compute_logits(model(ids, positions, meta, cache))  # [T, vocab]
        last = logits[torch.tensor(np.cumsum(query_lens) - 1)]
        for s, n, token in zip(seqs, query_lens, last.argmax(-1).tolist(), strict=True):
            computed[s] += n
            picks[s] = token
        out["logits"].append(logits.numpy())
        out["picks"].append(last.argmax(-1).numpy())
    n = len(last)
    out["sampled"] = sample(
        last,
        temperature=torch.ones(n),
        top_k=torch.zeros(n, dtype=torch.int32),
        top_p=torch.ones(n),
        seeds=torch.full((n,), -1, dtype=torch.int64),
        gen_index=torch.zeros(n, dtype=torch.int32),
    ).numpy()
    return out


def forward_job(tp: TPGroup, paths: list[str]) -> list[dict]:
    outs = []
    for path in paths:
        model, config, _ = load_model(path, tp=tp)
        out = run_batch(model, config, tp)
        out["shapes"] = {name: tuple(t.shape) for name, t in model.state_dict().items()}
        outs.append(out)
    return outs


def load_msg(path: str, device: str = "cpu") -> LoadModel:
    graphs = ((1, 2, 4), (32,)) if device != "cpu" else ((), ())
    return LoadModel(path, "float32", device, BLOCK_SIZE, 24, 1.0, 256, 8, 256, *graphs)


def worker_steps(worker: ModelWorker, first_step: int) -> list[dict]:
    """A prefill with prompt log-probs (row 1), then a decode with log-probs and top-3."""
    from tests.test_ops_logprobs import Seq, make_plan

    a, b = PROMPTS[2], PROMPTS[0]
    targets = b[1:] + [-1]
    plan = make_plan(
        first_step,
        [Seq(a, 0, [5, 2]), Seq(b, 0, [7], logprobs=True, top_n=3, targets=targets)],
        BLOCK_SIZE,
    )
    first = worker.step(plan)
    ta, tb = (int(t) for t in first.token_ids)
    decode = [Seq([ta], len(a), [5, 2], logprobs=True, top_n=3), Seq([tb], len(b), [7])]
    second = worker.step(make_plan(first_step + 1, decode, BLOCK_SIZE))
    fields = (
        "token_ids", "log_probs", "top_n_ids", "top_n_log_probs", "prompt_log_probs", "graphed"
    )  # fmt: skip
    return [{f: getattr(r, f) for f in fields} for r in (first, second)]


def update_state(path: str) -> dict[str, np.ndarray]:
    """New values for a few whole tensors in Hugging Face names: each kind the ranks split."""
    from safetensors.numpy import load_file

    state = load_file(os.path.join(path, "model.safetensors"))
    names = [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.1.self_attn.v_proj.weight",
        "model.layers.1.self_attn.o_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
        "model.embed_tokens.weight",
    ]
    gen = np.random.default_rng(UPDATE_SEED)
    return {n: state[n] + gen.normal(0, 0.05, state[n].shape).astype(np.float32) for n in names}


def worker_job(tp: TPGroup, path: str, other: str) -> dict:
    """Load, step, update from a state dict, step, update from a checkpoint, step (on a CUDA
    device with CUDA graphs: the decode steps replay one, all-reduces and gather inside)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    worker = ModelWorker()
    loaded = worker.load(load_msg(path, str(tp.device)), tp=tp)
    out = {"num_blocks": loaded.num_blocks, "kv_shape": tuple(worker.kv_cache.shape)}
    out["loaded"] = worker_steps(worker, 1)
    for name, control in [
        ("state", GpuControl("update_weights", None, None, update_state(path))),
        ("path", GpuControl("update_weights", None, other, None)),
    ]:
        replies = [
            worker.control(c) for c in (GpuControl("suspend", "recompute", None, None), control)
        ]
        replies.append(worker.control(GpuControl("resume", None, None, None)))
        assert [r.error for r in replies] == [None] * 3, [r.error for r in replies]
        out[name] = worker_steps(worker, 10)
    return out


def refusal_job(tp: TPGroup, paths: list[str]) -> list[str]:
    errors = []
    for path in paths:
        try:
            load_model(path, tp=tp)
        except ModelLoadError as e:
            errors.append(str(e))
        else:
            errors.append("loaded")
    return errors


# ---- fixtures -----------------------------------------------------------------------------------


def write_gguf(hf_dir: str, path: str) -> str:
    """A GGUF file of the Hugging Face checkpoint at `hf_dir` as llama.cpp's converter writes
    it: Q and K rows permuted per head, matrices quantized to Q8_0, the byte-level vocabulary."""
    import json

    import gguf
    from safetensors.numpy import load_file

    from taipan.ops.tokenizer import bytes_to_unicode

    hf = json.loads(open(os.path.join(hf_dir, "config.json")).read())
    state = load_file(os.path.join(hf_dir, "model.safetensors"))
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(hf["num_hidden_layers"])
    writer.add_embedding_length(hf["hidden_size"])
    writer.add_feed_forward_length(hf["intermediate_size"])
    writer.add_head_count(hf["num_attention_heads"])
    writer.add_head_count_kv(hf["num_key_value_heads"])
    writer.add_key_length(hf["head_dim"])
    writer.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    theta = (hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta"))
    writer.add_rope_freq_base(theta)
    writer.add_context_length(hf["max_position_embeddings"])
    tokens = list(bytes_to_unicode().values()) + ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 256 + [3] * 3)
    writer.add_token_merges([])
    writer.add_eos_token_id(258)
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    heads = {"q": hf["num_attention_heads"], "k": hf["num_key_value_heads"]}
    for name, array in state.items():
        if name in names:
            ours = names[name]
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            ours = f"blk.{layer}.{names[rest.removesuffix('.weight')]}.weight"
        if ours.endswith(("attn_q.weight", "attn_k.weight")):  # HF row order -> llama.cpp's
            n = heads[ours[-8]]
            array = array.reshape(n, 2, -1, array.shape[1]).swapaxes(1, 2).reshape(array.shape)
        if array.ndim == 2:
            quantized = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(ours, quantized, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(ours, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    import transformers

    root = tmp_path_factory.mktemp("tp")
    tied = make_random_llama(str(root / "tied"), TINY_SHAPE)
    untied = str(root / "untied")
    os.makedirs(untied)
    make_random_llama(untied, TINY_SHAPE, seed=1)
    hf = transformers.AutoConfig.from_pretrained(untied)
    hf.tie_word_embeddings, hf.num_key_value_heads = False, 1  # one kv head, replicated at T=2
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(hf)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.06)
    model.save_pretrained(untied, safe_serialization=True)
    return {
        "tied": tied,
        "untied": untied,
        "gguf": write_gguf(tied, str(root / "tied-q8.gguf")),
        "random": "random:tiny",
        "other": make_random_llama(str(root / "other"), TINY_SHAPE, seed=2),
    }


FORWARD_CASES = ("tied", "untied", "gguf", "random")


@pytest.fixture(scope="module")
def tp2_forward(checkpoints):
    return run_ranks(forward_job, [checkpoints[c] for c in FORWARD_CASES])


def assert_ranks_match(ranks: list[dict], expected: dict, vocab_size: int) -> None:
    """Every rank's `run_batch` logits (whole vocabulary) within ATOL of T = 1's, step by step,
    with the same greedy picks."""
    for rank, got in enumerate(ranks):
        for step, (a, b) in enumerate(zip(got["logits"], expected["logits"], strict=True)):
            assert a.shape == b.shape == (a.shape[0], vocab_size)
            np.testing.assert_allclose(a, b, atol=ATOL, rtol=0, err_msg=f"rank {rank} step {step}")
        for a, b in zip(got["picks"], expected["picks"], strict=True):
            assert a.tolist() == b.tolist(), f"rank {rank}"


# ---- tests --------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", FORWARD_CASES)
def test_tp2_forward_equals_tp1(checkpoints, tp2_forward, case):
    model, config, _ = load_model(checkpoints[case])
    expected = run_batch(model, config, SINGLE)
    ranks = [outs[FORWARD_CASES.index(case)] for outs in tp2_forward]
    assert_ranks_match(ranks, expected, config.vocab_size)
    # Every rank holds the very same logits (gathered, not recomputed), so unseeded sampling,
    # with generators that init_tp made agree, draws the same tokens everywhere.
    assert all(np.array_equal(r["logits"][-1], ranks[0]["logits"][-1]) for r in ranks)
    assert ranks[0]["sampled"].tolist() == ranks[1]["sampled"].tolist()
    # Each rank holds only its shards: half the heads (at least one kv head), half the
    # intermediate size, half the vocabulary (rounded up), whole norms.
    d, hidden, inter = config.head_dim, config.hidden_size, config.intermediate_size
    kv = max(config.num_kv_heads // 2, 1)
    want = {
        "embed_tokens.weight": (-(-config.vocab_size // 2), hidden),
        "layers.0.self_attn.qkv_proj.weight": ((config.num_heads // 2 + 2 * kv) * d, hidden),
        "layers.0.self_attn.o_proj.weight": (hidden, config.num_heads // 2 * d),
        "layers.0.mlp.gate_up_proj.weight": (inter, hidden),
        "layers.0.mlp.down_proj.weight": (hidden, inter // 2),
        "layers.0.input_layernorm.weight": (hidden,),
    }
    if not config.tie_word_embeddings:
        want["lm_head.weight"] = want["embed_tokens.weight"]
    for rank in ranks:
        assert {n: rank["shapes"][n] for n in want} == want


def test_head_and_vocabulary_shards():
    assert shard_heads(4, 2, rank=1, size=2) == (2, 2, 1, 1)
    assert shard_heads(4, 1, rank=1, size=2) == (2, 2, 0, 1)  # the one kv head, replicated
    assert shard_heads(8, 2, rank=3, size=4) == (6, 2, 1, 1)  # ranks 2, 3 share kv head 1
    assert vocab_shard(259, 0, 2) == (0, 130, 130) and vocab_shard(259, 1, 2) == (130, 129, 130)
    assert vocab_shard(5, 3, 4) == (6, 0, 2)  # a rank past the end: all padding


def check_workers(checkpoints, device: str, atol: float) -> None:
    """Workers at T = 2 (`device` "cpu", or "cuda": rank r on cuda:r) against one at T = 1 on
    the same kind of device."""
    path, other = checkpoints["tied"], checkpoints["other"]
    ranks = run_ranks(worker_job, path, other, cuda=device == "cuda")
    single = SINGLE if device == "cpu" else TPGroup(device=torch.device("cuda:0"))
    expected = worker_job(single, path, other)
    layers, _, blocks, block_size, heads, head_dim = expected["kv_shape"]
    for rank, got in enumerate(ranks):
        assert got["num_blocks"] == expected["num_blocks"] == 24
        assert got["kv_shape"] == (layers, 2, blocks, block_size, heads // 2, head_dim)
        for name in ("loaded", "state", "path"):
            for step, (a, b) in enumerate(zip(got[name], expected[name], strict=True)):
                where = f"rank {rank}, {name}, step {step}"
                assert a["token_ids"].tolist() == b["token_ids"].tolist(), where
                assert a["top_n_ids"].tolist() == b["top_n_ids"].tolist(), where
                assert a["graphed"] == b["graphed"] == (device == "cuda" and step == 1), where
                for f in ("log_probs", "top_n_log_probs", "prompt_log_probs"):
                    np.testing.assert_allclose(a[f], b[f], atol=atol, rtol=0, err_msg=where)
    # The updates changed something: the three phases do not all agree.
    logprobs = [expected[n][0]["prompt_log_probs"] for n in ("loaded", "state", "path")]
    assert not np.allclose(logprobs[0], logprobs[1]) and not np.allclose(logprobs[1], logprobs[2])


def test_worker_at_tp2_equals_tp1_with_weight_updates(checkpoints):
    check_workers(checkpoints, "cpu", ATOL)


@pytest.mark.gpu
def test_gpu_nccl_tp2_with_cuda_graphs_equals_tp1(tmp_path):
    """Two GPUs; the decode steps replay CUDA graphs that captured the all-reduces (the custom
    one-shot kernel's, ops/custom_all_reduce.py) and the logits' all-gather (NCCL); fp32, TF32
    off. The tiny shape with head_dim 64 (the CUDA attention kernels take 64 or 128)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    paths = {
        "tied": make_random_llama(str(tmp_path / "tied"), GPU_TINY_SHAPE),
        "other": make_random_llama(str(tmp_path / "other"), GPU_TINY_SHAPE, seed=2),
    }
    check_workers(paths, "cuda", 1e-4)


def test_refusals_at_tp2(model_path):
    for [smollm_error] in run_ranks(refusal_job, [model_path]):
        assert "num_heads (9) is not divisible by the tensor-parallel size (2)" in smollm_error


def test_sizes_and_shapes_that_cannot_split():
    with pytest.raises(TPError, match="must be >= 1, got 0"):
        TPGroup(size=0)
    with pytest.raises(TPError, match="must be >= 1, got 0"):
        init_tp(0, 0, "tcp://127.0.0.1:1")
    with pytest.raises(TPError, match="needs a process group"):
        TPGroup(rank=0, size=2)
    with pytest.raises(TPError, match=r"num_kv_heads \(3\) is not divisible .* \(2\)"):
        shard_heads(6, 3, rank=0, size=2)
    with pytest.raises(TPError, match=r"num_heads \(6\) is not divisible .* \(4\)"):
        shard_heads(6, 2, rank=0, size=4)
    assert init_tp(0, 1, "unused").size == 1  # size 1 needs no group


def test_a_group_whose_peers_never_come_fails_in_bounded_time():
    import torch.distributed as dist

    start = time.monotonic()
    with pytest.raises(TPError, match="could not join the group"):
        init_tp(1, 2, f"tcp://127.0.0.1:{free_port()}", timeout_s=2)
    assert time.monotonic() - start < 30
    assert not dist.is_initialized()


@pytest.mark.slow
def test_smollm2_gguf_at_tp3_equals_tp1(model_path):
    """The default model's GGUF (Q4_1 / Q8_0) over 3 ranks: 3 query heads and 1 kv head each,
    un-permuted per rank's slice, a vocabulary of 49152 (divisible by 3)."""
    ranks = run_ranks(forward_job, [model_path], size=3)
    model, config, _ = load_model(model_path)
    expected = run_batch(model, config, SINGLE)
    # 30 layers of real weights, logits of magnitude ~20: the partial sums' other order costs
    # up to ~6e-5 (1e-5 holds for the tiny models above).
    for rank, (got,) in enumerate(ranks):
        for a, b in zip(got["logits"], expected["logits"], strict=True):
            np.testing.assert_allclose(a, b, atol=1e-4, rtol=0, err_msg=f"rank {rank}")
        for a, b in zip(got["picks"], expected["picks"], strict=True):
            assert a.tolist() == b.tolist(), f"rank {rank}"
