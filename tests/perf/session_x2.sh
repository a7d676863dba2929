#!/usr/bin/env bash
# One two-GPU device call (run from the repo root, `.whl` and `.carry/old` carried; .carry/old is
# `git archive <older rev>`): issue 26's weight sync at the 8B shape (trainer cuda:0 -> taipan
# cuda:1, beside the raw NCCL broadcast), the GPU tests this session's changes touch, and
# issue 25's decode before/after on one GPU (old and new trees alternating, ours only).
set -u
source tests/perf/device_env.sh || exit 1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=$OUT/results.jsonl
echo "== weight sync, 8B shape"
timeout 240 python3 -m taipan.cli bench --workload weight-sync --model random:llama-8b \
    --device cuda:1 --trainer-device cuda:0 --dtype bfloat16 --sync-rounds 3 --results "$R"
echo "== GPU tests"
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_custom_all_reduce.py \
    tests/test_bench.py -k "custom or weight_sync" 2>&1 | tail -15
echo "== decode before/after (1B shape, ours, CUDA graphs)"
python3 -c "from tests.lint_imports import stage; from pathlib import Path; \
stage(Path('.carry/old'), Path('/tmp/pkg_old'))"
DEC="bench --workload decode --model random:llama-1b --device cuda:0 --dtype bfloat16 \
--batches 1,64 --output-len 128 --no-hf --ours-modes graphs --json"
for i in 1 2; do
    (cd .carry/old && PYTHONPATH=/tmp/pkg_old:/tmp/site:$PWD timeout 100 python3 -m taipan.cli \
        $DEC --results "$OUT/old.jsonl" | grep -o '"batch": [0-9]*\|"ours_graphs_ms": [0-9.]*' \
        | paste -sd' ' | sed "s/^/old $i: /")
    timeout 100 python3 -m taipan.cli $DEC --results "$OUT/new.jsonl" \
        | grep -o '"batch": [0-9]*\|"ours_graphs_ms": [0-9.]*' | paste -sd' ' | sed "s/^/new $i: /"
done
