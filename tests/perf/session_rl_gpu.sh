#!/usr/bin/env bash
# One two-GPU device call (repo root; `.whl` and `.carry/new` (a `git archive`) carried): the GPU
# tests of issue 26's per-token outputs and RL loop: processed log-probs under CUDA graphs, routed
# experts written in place by graphs, the NCCL weight push (coalesced buckets), and
# examples/rl_loop.py with the trainer on cuda:0 and taipan on cuda:1; then the 8B weight sync.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/*.whl || exit 1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c
python3 -c "from tests.lint_imports import stage; from pathlib import Path; \
stage(Path('.carry/new'), Path('/tmp/pkg'))" || exit 1
cd .carry/new && export PYTHONPATH=/tmp/pkg:/tmp/site:$PWD
timeout -s ABRT 290 python3 -m pytest -q -p no:cacheprovider -m gpu -rfs --tb=short \
    tests/test_gpu.py tests/test_e2e_routed_experts.py tests/test_rl.py tests/test_rl_loop.py \
    -k "processed_log_probs or routed or nccl or rl_loop" 2>&1 | tee "$OUT/rl_gpu.log" | tail -30
echo "== the loop itself, rows (GPU tiny Llama, fp32)"
python3 -c "from tests.random_llama import GPU_TINY_SHAPE, make_random_llama; \
make_random_llama('/tmp/gtiny', GPU_TINY_SHAPE)" >/dev/null 2>&1
timeout -s ABRT 120 python3 examples/rl_loop.py --model /tmp/gtiny --device cuda:1 \
    --trainer-device cuda:0 --prompts 8 --group-size 8 --max-tokens 64 2>/dev/null \
    | tee "$OUT/rl_loop.jsonl"
echo "== weight sync, 8B shape"
timeout -s ABRT 170 python3 -m taipan.cli bench --workload weight-sync --model random:llama-8b \
    --dtype bfloat16 --trainer-device cuda:0 --device cuda:1 --sync-rounds 3 \
    --results "$OUT/results.jsonl" 2>&1 | grep -E "weight-sync|rror" | tail -8
