"""examples/rl_loop.py run as a user would (issue 26 item 7): a trainer process (plain torch, a
Hugging Face copy of a tiny random Llama) drives taipan's real processes for three iterations of
rollouts, a REINFORCE step and a weight push; partial rollouts are cut by an abort pause and
finished under the new weights. Every iteration's checks must hold: greedy tokens equal the
trainer's own, the trainer's log-probs of the rollouts equal taipan's (fp32), and every token
carries the version that produced it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.random_llama import TINY_SHAPE, make_random_llama

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]


def _run_loop(model: str, *extra: str, timeout: float = 240) -> list[dict]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TQDM_DISABLE="1")
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "rl_loop.py"), "--model", model,
         "--prompts", "2", "--group-size", "2", "--max-tokens", "8", *extra],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def _check(rows: list[dict]) -> None:
    *iterations, summary = rows
    assert summary["ok"] and summary["iterations"] == 3
    assert [r["version"] for r in iterations] == [1, 2, 3]
    for r in iterations:
        assert r["greedy_equal"] and r["versions_ok"], r
        assert r["logprob_mismatch"] < 1e-3 and r["rollout_tokens"] == 2 * 2 * 8, r
        assert r["aborted"] >= 1 and r["sync_s"] > 0, r  # (a partial rollout every iteration)


@pytest.mark.slow  # (the default run keeps a lighter test of the same path)
def test_the_rl_loop_example_on_the_cpu(tmp_path):
    _check(_run_loop(make_random_llama(str(tmp_path / "tiny"), TINY_SHAPE)))


@pytest.mark.gpu
def test_the_rl_loop_example_over_nccl(tmp_path):
    """The trainer on cuda:0, taipan on cuda:1 (NCCL, CUDA graphs)."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    from tests.random_llama import GPU_TINY_SHAPE  # (a head_dim the CUDA kernels take)

    model = make_random_llama(str(tmp_path / "tiny"), GPU_TINY_SHAPE)
    _check(_run_loop(model, "--device", "cuda:1", "--trainer-device", "cuda:0"))
