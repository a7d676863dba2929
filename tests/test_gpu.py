"""GPU runs of the whole runtime (marker `gpu`): skipped without CUDA, run on the lent device.

The model is a random-weight Llama with SmolLM2-135M's shape (the GGUF cannot travel to the
device); correctness is checked against Hugging Face transformers on the same GPU.
"""

from __future__ import annotations

import pytest

from taipan.actors.config import InferenceConfig
from taipan.client import Client
from taipan.launcher import Runtime
from taipan.messages.requests import SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time", "1, 2, 3, 4,"]
CONFIG = dict(
    block_size_tokens=16,
    max_tokens=512,
    max_requests=32,
    buffer_size_gb=2,
    max_sequence_length=1024,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.random_llama import make_random_llama

    return make_random_llama(str(tmp_path_factory.mktemp("random-llama")))


def _hf_greedy(model_dir, dtype, prompt_ids, n):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda().eval()
    # As ours with ignore_eos: EOS neither stops nor is masked (min_new_tokens would mask it).
    model.generation_config.eos_token_id = None
    out = []
    with torch.inference_mode():
        for ids in prompt_ids:
            x = torch.tensor([ids], device="cuda")
            gen = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
            out.append(gen[0, len(ids) :].tolist())
    return out


def _ours(model_dir, dtype, n):
    sampling = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    with Runtime(model_dir, InferenceConfig(**CONFIG), device="cuda", dtype=dtype) as rt:
        with Client(rt.address) as c:
            done = c.generate(PROMPTS, sampling)
    return [d.prompt_token_ids for d in done], [d.token_ids for d in done]


def test_gpu_fp32_greedy_matches_hf(model_dir):
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    prompt_ids, ours = _ours(model_dir, "float32", 24)
    assert ours == _hf_greedy(model_dir, torch.float32, prompt_ids, 24)


def _hf_prompt_log_probs(model_dir, dtype, ids: list[int]):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda().eval()
    with torch.inference_mode():
        logits = model(torch.tensor([ids], device="cuda")).logits[0].float()
    lp = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:]).cuda()[:, None])
    return lp[:, 0].cpu().numpy()


def test_gpu_bf16_is_as_close_to_fp32_as_hf_bf16(model_dir):
    """bf16 flips near-tied argmaxes of a random model, so compare numbers, not tokens: our bf16
    prompt log-probs against HF fp32 must err no more than HF's own bf16 does (plus slack)."""
    import numpy as np
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    sampling = SamplingParams(max_tokens=1, temperature=0.0, return_log_probs=True)
    with Runtime(model_dir, InferenceConfig(**CONFIG), device="cuda", dtype="bfloat16") as rt:
        with Client(rt.address) as c:
            done = c.generate(PROMPTS, sampling)
    for d in done:
        ref = _hf_prompt_log_probs(model_dir, torch.float32, d.prompt_token_ids)
        hf16 = _hf_prompt_log_probs(model_dir, torch.bfloat16, d.prompt_token_ids)
        ours = np.asarray(d.prompt_log_probs)
        ours_err, hf_err = np.abs(ours - ref).max(), np.abs(hf16 - ref).max()
        assert ours_err <= 2 * hf_err + 0.05, (ours_err, hf_err)


def _blocks_gb(n: int, dtype_bytes: int) -> float:
    """buffer_size_gb holding `n` blocks of 16 tokens of the SmolLM2-shaped model."""
    per_block = 30 * 2 * 16 * 3 * 64 * dtype_bytes
    return (n + 0.5) * per_block / 1024**3


@pytest.mark.parametrize("top_n", [2, 0], ids=["top-n", "raw"])
def test_gpu_log_probs_match_hf(model_dir, top_n):
    """With top-n (computed per asking row) and without (every sequence's at once, into the
    launch's pinned arena: an RL rollout's steps)."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    sampling = SamplingParams(
        max_tokens=8, temperature=0.0, ignore_eos=True, return_log_probs=True, top_n_logprobs=top_n
    )
    with Runtime(model_dir, InferenceConfig(**CONFIG), device="cuda") as rt:
        with Client(rt.address) as c:
            done = c.generate(PROMPTS, sampling)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    for d in done:
        ids = d.prompt_token_ids + d.token_ids
        with torch.inference_mode():
            logits = model(torch.tensor([ids], device="cuda")).logits[0].float()
        ref = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:]).cuda()[:, None])
        ref = ref[:, 0].cpu().numpy()
        p = len(d.prompt_token_ids)
        assert np.allclose(d.prompt_log_probs, ref[: p - 1], atol=1e-3)
        assert np.allclose(d.log_probs, ref[p - 1 :], atol=1e-3)
        assert all(len(top) == top_n for top in d.top_n_logprobs or [[]] * len(d.token_ids))


@pytest.fixture(
    scope="module",
    params=[(None, True, True), (None, False, False), (0, False, True)],
    ids=["graphs-overlap", "graphs-serial-eager-prefills", "eager-serial"],
)
def tiny_pool(model_dir, request):
    """A runtime on CUDA whose 10-block pool makes every pause evict (paused requests may hold
    no block); with CUDA graphs (the default: mixed graphs up to max_tokens, so every step
    replays one; or, with cuda_graph_all_prefills=False, up to max_requests (32) tokens, so the
    chunked prefills of up to 64 tokens run both ways) and without (num_cuda_graphs=0); with
    steps overlapping (the default) and not."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    config = InferenceConfig(
        **dict(CONFIG, buffer_size_gb=_blocks_gb(10, 4), max_tokens=64),
        enable_chunked_prefill=True,
        paused_buffer_size_gb=0.0,
        num_cuda_graphs=request.param[0],
        overlap_steps=request.param[1],
        cuda_graph_all_prefills=request.param[2],
    )
    with Runtime(model_dir, config, device="cuda") as rt:
        yield rt


@pytest.mark.asyncio
async def test_gpu_tiny_pool_and_suspend_modes_keep_greedy_outputs(model_dir, tiny_pool):
    import torch

    from taipan.client import AsyncClient
    from tests.test_e2e_lifecycle import suspended_in_each_mode

    sampling = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    async with AsyncClient(tiny_pool.address) as c:
        done = await c.generate(PROMPTS, sampling)
        [stats] = (await c.stats()).ranks
    outs = await suspended_in_each_mode(tiny_pool.address, sampling, PROMPTS)
    want = _hf_greedy(model_dir, torch.float32, [d.prompt_token_ids for d in done], 24)
    assert [d.token_ids for d in done] == want
    assert stats.paused_total > 0 and stats.evicted_total > 0, stats
    if tiny_pool.config.num_cuda_graphs == 0:
        assert stats.steps_graphed == 0 < stats.steps_total
    elif tiny_pool.config.cuda_graph_all_prefills:
        assert stats.steps_graphed == stats.steps_total > 0  # prompt chunks in graphs too
    else:
        assert 0 < stats.steps_graphed < stats.steps_total  # chunks above 32 tokens eager
    assert 0 < stats.device_seconds_total
    assert outs == {"persist": want, "offload": want, "recompute": want}


def test_gpu_offload_checks_host_memory_then_round_trips_through_pinned_memory(
    tmp_path, monkeypatch
):
    import torch

    from taipan.actors.gpu import controls
    from taipan.actors.gpu.worker import ModelWorker
    from taipan.messages.gpu import GpuControl, LoadModel
    from tests.random_llama import TINY_SHAPE, make_random_llama

    model = make_random_llama(str(tmp_path), TINY_SHAPE)
    w = ModelWorker()
    w.load(LoadModel(model, "bfloat16", "cuda", 16, 64, 0.01, 256, 8, 256))
    kv = w.kv_cache
    kv.normal_()  # contents to compare after the round trip
    before = kv.clone()
    kv_bytes = kv.numel() * kv.element_size()

    def suspend():
        return w.control(GpuControl("suspend", "offload", None, None))

    monkeypatch.setattr(controls, "available_host_memory", lambda: kv_bytes)
    reply = suspend()
    assert "offload needs" in reply.error and w.suspend_mode is None and w.kv_cache is kv
    monkeypatch.undo()
    assert suspend().error is None and w.kv_cache is None
    assert w._kv_offloaded.is_pinned() and w._kv_offloaded.device.type == "cpu"
    assert w.control(GpuControl("resume", None, None, None)).error is None
    assert w.kv_cache.is_cuda and torch.equal(w.kv_cache, before)


def _graph_workers(model_dir, dtype):
    """The same model loaded twice: eager, and with decode graphs (1, 2, 4, 8) and mixed graphs
    (8, 32)."""
    from taipan.actors.gpu.worker import ModelWorker
    from taipan.messages.gpu import LoadModel

    workers = []
    for sizes in [((), ()), ((1, 2, 4, 8), (8, 32))]:
        w = ModelWorker()
        w.load(LoadModel(model_dir, dtype, "cuda", 16, 64, 0.05, 256, 8, 256, *sizes))
        workers.append(w)
    return workers


def test_gpu_graph_steps_equal_eager_steps(model_dir):
    """Prefills (eager: above the largest mixed graph, or in a mixed graph), decode steps at
    batch 3 and 5 (padded decode graphs, some fed their input tokens by prev_rows on the
    device), a mixed step (decode rows + prefill chunks in a mixed graph): tokens equal and
    log-probs within 1e-4 in fp32."""
    import dataclasses

    import numpy as np
    import torch

    from tests.test_ops_logprobs import Seq, make_plan

    torch.backends.cuda.matmul.allow_tf32 = False
    eager, graphed = _graph_workers(model_dir, "float32")
    assert graphed.graphs.captured and eager.graphs is None
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 250, n).tolist() for n in (40, 7, 19, 3, 12)]
    blocks = [[1 + 4 * i + j for j in range(4)] for i in range(len(prompts))]
    ctx = [0] * len(prompts)
    last = [0] * len(prompts)
    step = 0

    def run(seqs, want_graphed, prev_rows=None):
        """Both workers run the step; with `prev_rows`, the graphed one gets no input ids, only
        where in the previous step's sampled tokens they are (read on the device, in the
        graph)."""
        nonlocal step
        step += 1
        plan = make_plan(step, seqs)
        blind = plan
        if prev_rows is not None:
            blind = dataclasses.replace(
                plan,
                input_ids=np.zeros_like(plan.input_ids),
                prev_rows=np.asarray(prev_rows, dtype=np.int32),
            )
        a, b = eager.step(plan), graphed.step(blind)
        assert a.error is None and b.error is None
        assert b.graphed == want_graphed and not a.graphed
        assert np.array_equal(a.token_ids, b.token_ids), (step, a.token_ids, b.token_ids)
        np.testing.assert_allclose(a.log_probs, b.log_probs, atol=1e-4)
        return a.token_ids

    # Prompt 0 alone (40 tokens: eager), then prompts 1-2 (26 tokens: the 32-token mixed graph).
    for group, want in [([0], False), ([1, 2], True)]:
        seqs = [Seq(prompts[i], 0, blocks[i], logprobs=True) for i in group]
        for i, t in zip(group, run(seqs, want), strict=True):
            ctx[i], last[i] = len(prompts[i]), int(t)
    active = [0, 1, 2]
    for k in range(4):  # decode at batch 3: the 4-row decode graph
        seqs = [Seq([last[i]], ctx[i], blocks[i], logprobs=True) for i in active]
        prev = [0, 1, 2] if k else None  # after the first, the same rows as the step before
        for i, t in zip(active, run(seqs, True, prev), strict=True):
            ctx[i], last[i] = ctx[i] + 1, int(t)
    # Mixed: three decode rows and prompts 3-4 (3 + 15 = 18 tokens: the 32-token mixed graph).
    seqs = [Seq([last[i]], ctx[i], blocks[i], logprobs=True) for i in active]
    seqs += [Seq(prompts[i], 0, blocks[i], logprobs=True) for i in (3, 4)]
    for i, t in zip(active + [3, 4], run(seqs, True), strict=True):
        ctx[i] += 1 if i in active else len(prompts[i])
        last[i] = int(t)
    active = [0, 1, 2, 3, 4]
    for _ in range(4):  # batch 5: the 8-row decode graph
        seqs = [Seq([last[i]], ctx[i], blocks[i], logprobs=True) for i in active]
        for i, t in zip(active, run(seqs, True), strict=True):
            ctx[i], last[i] = ctx[i] + 1, int(t)
    # Prompt log-probs read every hidden state: eager even where a graph would hold the step.
    run([Seq([last[0]], ctx[0], blocks[0], targets=[5])], False)


def test_gpu_processed_log_probs_graphed_equal_eager_and_the_reference(model_dir):
    """logprobs_mode "processed" (issue 26 item 5) on CUDA, eager and after a CUDA graph's
    replay (mixed and decode buckets), five rows with their own temperature / top-k / top-p /
    min-p in one batch (one greedy, one raw): see `processed_log_probs_steps`."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    eager, graphed = _graph_workers(model_dir, "float32")
    assert graphed.graphs.captured and eager.graphs is None
    processed_log_probs_steps(eager, graphed)


# Per prompt row: (temperature, top_k, top_p, min_p, processed). top_k <= 20 keeps each kept set
# inside the raw top-20, which the reference filters.
PROCESSED_ROWS = [
    (0.7, 5, 1.0, 0.0, True),
    (1.2, 15, 0.8, 0.0, True),
    (1.0, 20, 0.9, 0.05, True),
    (0.0, 0, 1.0, 0.0, True),  # greedy: processed is raw
    (0.9, 10, 1.0, 0.0, False),  # raw in a batch with processed rows
]


def processed_log_probs_steps(eager, graphed) -> None:
    """Prefills (eager, and in the 32-token mixed graph), then decode steps at batch 5 (the
    8-row decode graph); each step run raw and processed on both workers. Checks: the mode
    changes no draw; processed log-probs and top-n equal between eager and graphed (1e-4, fp32,
    -inf where dropped); every drawn token is inside the kept set (the CUDA kernel's draws and
    the torch filters agree); the processed top-n equal the reference filters
    (tests/test_logprobs_mode.py `processed_ref`) applied to the raw top-20; greedy and raw rows
    of a processed plan equal the raw plan's. `graphed` may be a second eager worker (a CPU
    check of this function)."""
    import dataclasses
    import math

    import numpy as np

    from tests.test_logprobs_mode import processed_ref
    from tests.test_ops_logprobs import Seq, make_plan

    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 250, n).tolist() for n in (40, 7, 19, 3, 12)]
    blocks = [[1 + 4 * i + j for j in range(4)] for i in range(len(prompts))]
    ctx, last, step = [0] * 5, [0] * 5, 0

    def run(rows: list[int], ids: list[list[int]], want_graphed: bool) -> None:
        nonlocal step
        step += 1
        seqs = [
            Seq(x, ctx[i], blocks[i], logprobs=True, top_n=20,
                temperature=PROCESSED_ROWS[i][0], seed=100 + i)
            for i, x in zip(rows, ids, strict=True)
        ]  # fmt: skip
        params = [PROCESSED_ROWS[i] for i in rows]
        raw = dataclasses.replace(
            make_plan(step, seqs),
            top_k=np.asarray([p[1] for p in params], np.int32),
            top_p=np.asarray([p[2] for p in params], np.float32),
            min_p=np.asarray([p[3] for p in params], np.float32),
        )
        processed = dataclasses.replace(
            raw, logprobs_mode=np.asarray([p[4] for p in params], np.int8)
        )
        a_raw, a, b = eager.step(raw), eager.step(processed), graphed.step(processed)
        assert a_raw.error is None and a.error is None and b.error is None
        if graphed.graphs is not None:
            assert b.graphed == want_graphed
        assert np.array_equal(a_raw.token_ids, a.token_ids)  # the mode changes no draw
        assert np.array_equal(a.token_ids, b.token_ids), (step, a.token_ids, b.token_ids)
        np.testing.assert_allclose(a.log_probs, b.log_probs, atol=1e-4)
        np.testing.assert_allclose(a.top_n_log_probs, b.top_n_log_probs, atol=1e-4)
        assert np.isfinite(a.log_probs).all() and np.isfinite(b.log_probs).all(), a.log_probs
        for r, (t, k, p, min_p, is_processed) in enumerate(params):
            if not is_processed or t == 0.0:  # raw, or greedy: the raw plan's
                np.testing.assert_allclose(a.log_probs[r], a_raw.log_probs[r], atol=1e-6)
                np.testing.assert_allclose(a.top_n_log_probs[r], a_raw.top_n_log_probs[r],
                                           atol=1e-6)  # fmt: skip
                continue
            raw_ids = a_raw.top_n_ids[r].tolist()
            ref = dict(zip(raw_ids, processed_ref(a_raw.top_n_log_probs[r].tolist(), t, k, p,
                                                  min_p), strict=True))  # fmt: skip
            kept = sum(math.isfinite(v) for v in ref.values())
            values = a.top_n_log_probs[r]
            assert np.isfinite(values[:kept]).all() and np.isneginf(values[kept:]).all()
            for i, v in zip(a.top_n_ids[r][:kept].tolist(), values[:kept], strict=True):
                assert abs(ref[i] - v) < 1e-4, (step, r, i, ref[i], v)
            assert abs(ref[int(a.token_ids[r])] - a.log_probs[r]) < 1e-4
        for i, token in zip(rows, a.token_ids.tolist(), strict=True):
            ctx[i] += len(ids[rows.index(i)])
            last[i] = token

    run([0], [prompts[0]], False)  # 40 tokens: above the largest mixed graph, eager
    run([1, 2], [prompts[1], prompts[2]], True)  # 26 tokens: the 32-token mixed graph
    run([3, 4], [prompts[3], prompts[4]], True)  # 15 tokens: the 32-token mixed graph
    for _ in range(3):  # batch 5: the 8-row decode graph
        rows = [0, 1, 2, 3, 4]
        run(rows, [[last[i]] for i in rows], True)


def test_gpu_graphs_survive_persist_and_are_captured_again_when_the_kv_moves(model_dir):
    from taipan.messages.gpu import GpuControl

    _, w = _graph_workers(model_dir, "bfloat16")

    def control(command, mode=None):
        reply = w.control(GpuControl(command, mode, None, None))
        assert reply.error is None, reply.error

    kv, graphs = w.kv_cache, dict(w.graphs._graphs)
    control("suspend", "persist")
    control("resume")
    assert w.kv_cache is kv and w.graphs._graphs == graphs  # the very graphs, not recaptured
    for mode in ("offload", "recompute"):
        control("suspend", mode)
        assert not w.graphs.captured  # released with the KV cache
        control("resume")
        assert w.graphs.captured and all(
            w.graphs._graphs[b] is not graphs[b] for b in graphs
        )  # captured again, against the new KV address
