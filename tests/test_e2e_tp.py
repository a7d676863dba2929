"""Tensor-parallel serving (issue 12 item 2) through real processes: CPU, gloo, fp32.

A tiny random Llama (4 query heads, 2 kv heads: both split over 2 peers) served with
`tensor_parallel_size=2` (an engine process whose gpu actor leads, and one tp-follower child)
against the same model at T = 1:

- greedy tokens equal and log-probs (sampled, top-3, prompt) within 1e-5, and seeded samples
  equal, on more prompts than max_requests, with prompts long enough to be chunked; in
  coordinator and in direct mode;
- a lifecycle round (pause, suspend offload, update_weights with a state dict that changes
  weights, resume, unpause) gives T = 1's tokens under the same update, and the update shows;
- `taipan replay --check` passes for the coordinator, engine and allocator of a T = 2 run; the
  follower's log (gpu-0-tp1) is reported as not checked, as gpu-0 is;
- a follower SIGKILLed under load takes its rank down: every stream ends with an error naming
  the rank within 5 s, `taipan serve` exits non-zero naming the follower, no process is left;
- a model whose heads do not split over T, a hybrid whose Mamba groups do not, and a MoE model
  whose experts' intermediate size does not split fail the start with a clear LaunchError, and
  leave no process;
- a tiny Qwen3-MoE (experts split along their intermediate size) at T = 2 gives T = 1's
  greedy tokens and log-probs;
- structured outputs with overlapped steps ("check" mode: rows voided where the grammar check
  replaced the token they read, on every peer alike) give T = 1's tokens;
- `taipan bench --tensor-parallel-size 2` rows carry the size, with per-device floors;
- DP=2 x TP=2, four model processes, equal T = 1; with a follower of rank 1 killed, rank 1's
  requests fail naming it and rank 0 serves on.
A gpu-marked test runs T = 2 over NCCL with CUDA graphs against T = 1 on 2 GPUs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from taipan import LLM, SamplingParams
from taipan.client import Client
from taipan.launcher import LaunchError, Runtime
from taipan.messages.requests import FinishReason
from taipan.placement import peer_cpu_sets, peer_devices
from tests.random_llama import GPU_TINY_SHAPE, TINY_SHAPE, make_random_llama
from tests.test_e2e_failures import serves_on_then_exits_1
from tests.test_e2e_replay import replay
from tests.test_e2e_robust import _alive, _children

ATOL = 1e-5
TP_CONFIG = dict(
    enable_chunked_prefill=True,
    block_size_tokens=16,
    max_tokens=64,  # prompts of up to 120 tokens: chunked
    max_requests=4,
    buffer_size_gb=0.1,
    max_sequence_length=256,
)
_gen = np.random.default_rng(12)
PROMPTS = [_gen.integers(0, 256, n).tolist() for n in (3, 17, 40, 90, 120, 9, 33, 64, 5, 71)]
LOG_PROBS = SamplingParams(max_tokens=10, temperature=0.0, return_log_probs=True, top_n_logprobs=3)
SAMPLINGS = [LOG_PROBS] * 5 + [
    SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=40 + i) for i in range(5)
]


def _descendants(pid: int) -> list[int]:
    out = []
    for child in _children(pid):
        out += [child, *_descendants(child)]
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_random_llama(str(tmp_path_factory.mktemp("tp-e2e") / "tiny"), TINY_SHAPE)


@pytest.fixture(scope="module")
def tp1(tiny):
    with LLM(tiny, **TP_CONFIG) as llm:
        yield llm


@pytest.fixture(scope="module")
def tp2(tiny, tmp_path_factory):
    rec = tmp_path_factory.mktemp("tp2-rec")
    with LLM(tiny, tensor_parallel_size=2, record_dir=str(rec), **TP_CONFIG) as llm:
        yield llm, rec


@pytest.fixture(scope="module")
def want(tp1) -> list:
    """T = 1's outputs for PROMPTS, SAMPLINGS with the checkpoint's weights (taken before the
    lifecycle test updates them)."""
    return tp1.generate(PROMPTS, SAMPLINGS, use_tqdm=False)


def assert_same(got, want) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.finish_reason == w.finish_reason == FinishReason.LENGTH, (i, g.error)
        assert g.token_ids == w.token_ids, f"prompt {i}"
        for field in ("log_probs", "prompt_log_probs"):
            a, b = getattr(g, field), getattr(w, field)
            assert (a is None) == (b is None), (i, field)
            if a is not None:
                np.testing.assert_allclose(a, b, atol=ATOL, rtol=0, err_msg=f"{i} {field}")
        for field in ("top_n_logprobs", "prompt_top_n_logprobs"):
            a, b = getattr(g, field), getattr(w, field)
            assert (a is None) == (b is None), (i, field)
            for x, y in zip(a or [], b or [], strict=True):  # per token: {id: log-prob}
                assert sorted(x) == sorted(y), f"prompt {i} {field}"
                np.testing.assert_allclose([x[t] for t in y], list(y.values()), atol=ATOL)


def test_tp2_equals_tp1(want, tp2):
    llm, _ = tp2
    got = llm.generate(PROMPTS, SAMPLINGS, use_tqdm=False)
    assert_same(got, want)
    assert want[0].log_probs is not None and want[0].prompt_log_probs is not None
    assert len({tuple(c.token_ids) for c in want}) > 5  # the prompts lead somewhere different
    [rank] = llm.stats().ranks
    assert rank.alive and rank.steps_total > len(PROMPTS)


def test_grammar_rows_at_tp2_equal_tp1_with_void_rows(tiny):
    """Structured outputs at T = 2 with overlapped steps ("check" mode: the next step does not
    wait for the grammar check; each peer checks its own rows, the leader reports): T = 1's
    tokens, rows voided on both peers alike (a follower that disagreed would diverge)."""
    from taipan.messages.requests import StructuredOutput

    number = {"type": "integer", "minimum": 0, "maximum": 99}
    schema = json.dumps({
        "type": "object", "properties": {"n": number}, "required": ["n"],
        "additionalProperties": False, "x-guidance": {"whitespace_flexible": False},
    })  # fmt: skip
    kinds = [("json_schema", schema), ("regex", "[0-9]{3}-[a-z]{20}")]
    sampling = [
        SamplingParams(max_tokens=40, temperature=0.0, structured=StructuredOutput(k, spec))
        for k, spec in kinds * 3
    ]
    prompts = [[5, 17, 42, 9], [3, 3, 3], [100, 7], [8, 8], [1, 2, 3, 4, 5], [9] * 20]
    got = {}
    for size in (1, 2):
        cfg = TP_CONFIG | {"overlap_steps": True}
        with LLM(tiny, tensor_parallel_size=size, **cfg) as llm:
            got[size] = [o.token_ids for o in llm.generate(prompts, sampling, use_tqdm=False)]
            void = llm.stats().merged().grammar_void_rows
        assert void > 0, (size, void)
    assert got[2] == got[1]


def test_direct_mode_at_tp2_equals_tp1(want, tiny):
    """LLM(use_coordinator=False): this process drives the engine rank and its follower."""
    with LLM(tiny, use_coordinator=False, tensor_parallel_size=2, **TP_CONFIG) as llm:
        got = llm.generate(PROMPTS[:5], SAMPLINGS[:5], use_tqdm=False)
    assert_same(got, want[:5])


def _update(tiny: str) -> dict[str, np.ndarray]:
    """New values for whole tensors of each kind the peers split (q rows, down columns, the
    vocabulary), in Hugging Face names."""
    from safetensors.numpy import load_file

    state = load_file(os.path.join(tiny, "model.safetensors"))
    gen = np.random.default_rng(5)
    names = [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
        "model.embed_tokens.weight",
    ]
    return {n: state[n] + gen.normal(0, 0.05, state[n].shape).astype(np.float32) for n in names}


def test_lifecycle_round_with_a_weight_update_equals_tp1(tp1, tp2, tiny):
    llm, _ = tp2
    prompts, samplings = PROMPTS[:4], [LOG_PROBS] * 4
    before = tp1.generate(prompts, samplings, use_tqdm=False)
    update = _update(tiny)
    outs = []
    for runtime in (tp1, llm):
        assert runtime.pause().state == "PAUSED"
        assert runtime.suspend("offload").state == "SUSPENDED"
        assert runtime.update_weights(state=update).weight_version == 1
        assert runtime.resume().state == "PAUSED"
        assert runtime.unpause().state == "RUNNING"
        outs.append(runtime.generate(prompts, samplings, use_tqdm=False))
    assert_same(outs[1], outs[0])
    changed = [
        a.prompt_log_probs != b.prompt_log_probs for a, b in zip(outs[0], before, strict=True)
    ]
    assert all(changed)  # the update reached the weights


def test_replay_checks_the_deciding_actors_of_a_tp2_run(tp2):
    llm, rec = tp2
    llm.shutdown()  # the logs are complete once every process has exited
    names = sorted(p.stem for p in rec.glob("*.tplog"))
    assert names == ["allocator-0", "coordinator", "engine-0", "gpu-0", "gpu-0-tp1"]
    done = replay(rec, "--check", "--allow-unchecked")
    assert done.returncode == 0, done.stdout + done.stderr
    for actor in ("coordinator", "engine-0", "allocator-0"):
        assert f"{actor}: ok" in done.stdout, done.stdout
    assert "gpu-0-tp1: not checked (a tensor-parallel follower" in done.stdout, done.stdout


def _serve(model: str, address: str, *args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "taipan.cli", "serve", "--model", model, "--address", address]
    for field, value in TP_CONFIG.items():
        cmd += ["--set", f"{field}={str(value).lower()}"]
    return subprocess.Popen([*cmd, *args], stderr=subprocess.PIPE, text=True)


def _follower_pid(serve: subprocess.Popen, rank: int) -> int:
    for pid in _descendants(serve.pid):
        with open(f"/proc/{pid}/cmdline") as f:
            args = f.read().split("\0")
        if "tp-follower" in args and args[-3:-1] == [str(rank), "1"]:  # ... RANK TP_RANK ''
            return pid
    raise AssertionError(f"no tensor-parallel follower of rank {rank}")


def _kill_follower_under_load(serve, address: str, rank: int, streams: int):
    """Stream `streams` long requests, SIGKILL rank's follower once all flow; returns
    (kill time, {stream: (end time, last delta)}, the client)."""
    client = Client(address, connect_timeout=120)
    started = threading.Barrier(streams + 1)
    ended: dict[int, tuple[float, object]] = {}

    def consume(i: int) -> None:
        sampling = SamplingParams(max_tokens=150, ignore_eos=True, temperature=0.0)
        for n, d in enumerate(client.stream(PROMPTS[i % len(PROMPTS)], sampling)):
            if n == 1:
                started.wait(60)
            if d.finished:
                ended[i] = (time.monotonic(), d)

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    started.wait(60)  # every stream has tokens flowing
    killed = time.monotonic()
    os.kill(_follower_pid(serve, rank), signal.SIGKILL)
    for t in threads:
        t.join(60)
    return killed, ended, client


def test_sigkilled_follower_takes_its_rank_down_loudly(tmp_path, tiny):
    address = f"ipc://{tmp_path}/front.sock"
    serve = _serve(tiny, address, "--tensor-parallel-size", "2")
    descendants: list[int] = []
    try:
        with Client(address, connect_timeout=120):
            descendants = _descendants(serve.pid)
        assert len(descendants) == 3  # coordinator, engine, its follower
        killed, ended, client = _kill_follower_under_load(serve, address, 0, streams=3)
        assert sorted(ended) == [0, 1, 2]
        for at, delta in ended.values():
            assert at - killed < 5.0
            assert delta.finish_reason == FinishReason.ERROR
            assert "engine rank 0 died" in delta.error, delta.error
        assert serve.wait(10) != 0
        client.close()
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
    stderr = serve.stderr.read()
    # (The leader may log its collective's failure, with a traceback, before the watcher.)
    assert "a tensor-parallel follower died: this engine rank ends" in stderr, stderr[-3000:]
    assert "follower=gpu-0-tp1" in stderr and "how='killed by signal SIGKILL'" in stderr
    assert "engine-0 exited with code 4" in stderr, stderr[-3000:]
    deadline = time.monotonic() + 10
    while [p for p in descendants if _alive(p)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in descendants if _alive(p)]


@pytest.mark.slow  # (15 s; make test-slow)
def test_a_model_that_does_not_split_fails_the_start(model_path, tiny, tmp_path):
    from taipan.actors.config import InferenceConfig
    from tests.random_moe import make_random_qwen3_moe
    from tests.random_nemotron_h import TINY_HYBRID, make_random_nemotron_h

    before = set(_children(os.getpid()))
    cases = [
        (model_path, 2, "num_heads (9) is not divisible by the tensor-parallel size (2)"),
        (tiny, 3, "num_heads (4) is not divisible by the tensor-parallel size (3)"),
        (
            make_random_nemotron_h(str(tmp_path / "hybrid"), shape=TINY_HYBRID | {"n_groups": 1}),
            2,
            "n_groups (1) is not divisible by the tensor-parallel size (2)",
        ),
        (
            make_random_qwen3_moe(str(tmp_path / "moe"), moe_intermediate_size=33),
            2,
            "moe_intermediate_size (33) is not divisible by the tensor-parallel size (2)",
        ),
    ]
    for model, size, text in cases:
        rt = Runtime(model, InferenceConfig(**TP_CONFIG), tensor_parallel_size=size)
        start = time.monotonic()
        with pytest.raises(LaunchError, match="cannot load") as e:
            rt.start(timeout=120)
        assert text in str(e.value), str(e.value)
        assert time.monotonic() - start < 60
        assert not _processes_naming(rt.tmp)  # followers too (their SPEC names the temp dir)
    assert not [p for p in set(_children(os.getpid())) - before if _alive(p)]


def _processes_naming(text: str) -> list[int]:
    """Live processes whose command line contains `text`."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline") as f:
                if entry.isdigit() and text in f.read() and _alive(int(entry)):
                    found.append(int(entry))
        except OSError:
            continue
    return found


@pytest.mark.slow  # (the default run stays under ~15 min on the 2-core CI box)
def test_bench_rows_carry_the_tensor_parallel_size(tmp_path):
    """`taipan bench --tensor-parallel-size 2` serves through two peers; the row says so, and
    its floors are one device's share (half the bytes and FLOPs)."""
    from tests.test_bench import _bench_rows

    [row] = _bench_rows(
        tmp_path,
        *("--workload", "decode", "--model", "random:tiny", "--batches", "2"),
        *("--output-len", "4", "--prompt-len", "8", "--copy-gib", "0.0625"),
        "--tensor-parallel-size",
        "2",
    )
    assert row["tensor_parallel_size"] == 2 and row["data_parallel_size"] == 1
    bytes_per_device = (row["weight_bytes"] + row["kv_bytes"]) / 2
    assert row["floor_ms"] == pytest.approx(1e3 * bytes_per_device / (row["copy_gb_s"] * 1e9), 1e-3)
    assert row["ours_eager_tn_s"] > 0 and row["hf_best"] == "hf"


def test_peer_devices_and_cores():
    assert peer_devices("cuda", 0, 1, 2) == ["cuda:0", "cuda:1"]
    assert peer_devices("cuda", 1, 2, 2) == ["cuda:2", "cuda:3"]
    assert peer_devices("cuda:4", 1, 2, 2) == ["cuda:6", "cuda:7"]
    assert peer_devices("cuda:1", 0, 1, 1) == ["cuda:1"] and peer_devices("cpu", 1, 2, 2) == [
        "cpu",
        "cpu",
    ]
    assert peer_cpu_sets(None, 1, [0, 1, 2]) == [None]
    assert peer_cpu_sets(None, 2, [0, 1, 2]) == [[0, 1], [2]]
    assert peer_cpu_sets([4, 5, 6, 7], 2, [0, 1]) == [[4, 5], [6, 7]]
    assert peer_cpu_sets([3], 2, [0, 1]) == [[3], [3]]  # more peers than cores: shared


def test_refusals(tiny):
    with pytest.raises(LaunchError, match="tensor_parallel_size must be an int >= 1, got 0"):
        Runtime(tiny, tensor_parallel_size=0)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(address="ipc:///nowhere", tensor_parallel_size=2)


@pytest.mark.slow  # (the default run keeps a lighter test of the same path)
def test_dp2_by_tp2_equals_tp1_and_a_dead_follower_leaves_the_other_rank_serving(
    want, tiny, tmp_path
):
    """Two ranks of two peers each (four model processes on this box's cores)."""
    with LLM(tiny, data_parallel_size=2, tensor_parallel_size=2, **TP_CONFIG) as llm:
        got = llm.generate(PROMPTS, SAMPLINGS, use_tqdm=False)
        assert_same(got, want)
        assert all(r.steps_total > 0 for r in llm.stats().ranks)
    address = f"ipc://{tmp_path}/front.sock"
    serve = _serve(tiny, address, "--tensor-parallel-size", "2", "--data-parallel-size", "2")
    try:
        killed, ended, client = _kill_follower_under_load(serve, address, 1, streams=4)
        assert sorted(ended) == [0, 1, 2, 3]
        failed = [d for _, d in ended.values() if d.finish_reason == FinishReason.ERROR]
        assert len(failed) == 2  # round robin: rank 1 had two of the four
        assert all("engine rank 1 died" in d.error for d in failed)
        assert all(at - killed < 5.0 for at, d in ended.values() if d in failed)
        assert [(r.rank, r.alive) for r in client.stats().ranks] == [(0, True), (1, False)]
        serves_on_then_exits_1(serve, client, PROMPTS[:2])
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
    stderr = serve.stderr.read()
    # (The leader may log its collective's failure, with a traceback, before the watcher.)
    assert "a tensor-parallel follower died: this engine rank ends" in stderr, stderr[-3000:]
    assert "follower=gpu-1-tp1" in stderr and "engine-1 exited with code 4" in stderr


@pytest.mark.parametrize("family", ["qwen3", pytest.param("nemotron_h", marks=pytest.mark.slow)])
def test_moe_at_tp2_equals_tp1(tmp_path, family):
    """A tiny Qwen3-MoE (8 experts, top 2, a dense layer), or a NemotronH hybrid with `E` layers
    (grouped sigmoid routing, latent projections, a shared expert, Mamba layers), served at
    T = 1 and at T = 2: the same greedy tokens, log-probs within 1e-5, chunked prompts included."""
    from tests.random_moe import make_random_nemotron_h_moe, make_random_qwen3_moe

    if family == "qwen3":
        moe = make_random_qwen3_moe(str(tmp_path / "moe"))
    else:
        moe = make_random_nemotron_h_moe(str(tmp_path / "moe"), latent_size=16)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, return_log_probs=True)
    outs = []
    for size in (1, 2):
        with LLM(moe, tensor_parallel_size=size, **TP_CONFIG) as llm:
            outs.append(llm.generate(PROMPTS[:6], greedy, use_tqdm=False))
    for i, (a, b) in enumerate(zip(outs[1], outs[0], strict=True)):
        assert a.finish_reason == b.finish_reason == FinishReason.LENGTH, (i, a.error)
        assert a.token_ids == b.token_ids, f"prompt {i}"
        np.testing.assert_allclose(a.log_probs, b.log_probs, atol=ATOL, rtol=0)
    assert len({tuple(c.token_ids) for c in outs[0]}) > 3  # the prompts lead somewhere different


@pytest.mark.gpu
@pytest.mark.parametrize("custom_all_reduce", [None, False])
def test_gpu_nccl_tp2_with_cuda_graphs_equals_tp1(tmp_path, custom_all_reduce):
    """The tiny Llama (head_dim 64: the CUDA attention kernels take 64 or 128) in fp32 on two
    GPUs: the decode steps replay CUDA graphs that captured the all-reduces (the custom one-shot
    kernel by default, NCCL with custom_all_reduce=false) and the logits' all-gather; greedy
    tokens equal T = 1's on one GPU, log-probs within 1e-4 (TF32 is off: torch's default for
    fp32 matmuls)."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    tiny = make_random_llama(str(tmp_path / "tiny"), GPU_TINY_SHAPE)
    config = dict(TP_CONFIG, max_requests=8, buffer_size_gb=1)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, return_log_probs=True)
    outs = []
    for size in (1, 2):
        if size == 2:
            config["custom_all_reduce"] = custom_all_reduce
        with LLM(tiny, device="cuda", tensor_parallel_size=size, **config) as llm:
            outs.append(llm.generate(PROMPTS, greedy, use_tqdm=False))
            [rank] = llm.stats().ranks
            assert rank.steps_graphed > 0, rank
    for i, (a, b) in enumerate(zip(outs[1], outs[0], strict=True)):
        assert a.finish_reason == b.finish_reason and a.error is None, (i, a.error)
        assert a.token_ids == b.token_ids, f"prompt {i}"
        np.testing.assert_allclose(a.log_probs, b.log_probs, atol=1e-4, rtol=0)
