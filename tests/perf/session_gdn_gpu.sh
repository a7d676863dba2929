#!/usr/bin/env bash
# One single-GPU device call (repo root; `.whl` and `.carry/new` (a `git archive`) carried): the
# GPU tests written on the CPU in the sixth session and never run on a device yet, then their
# bench rows:
# - issue 27 item 4: the Gated-DeltaNet kernels (chunked varlen + decode, CUDA graphs) and the
#   Qwen3-Next hybrid under CUDA graphs, snapshots on and off, fp32 and bf16;
# - issue 28 item 3: logit controls (penalties, logit_bias, min_tokens, bad words) under graphs;
# - the decode bench row of the Qwen3-Next-80B-A3B-like shape at reduced depth, and the 1B
#   Llama shape beside it (the host-step change of 867478a).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/*.whl || exit 1
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c
python3 -c "from tests.lint_imports import stage; from pathlib import Path; \
stage(Path('.carry/new'), Path('/tmp/pkg'))" || exit 1
cd .carry/new && export PYTHONPATH=/tmp/pkg:/tmp/site:$PWD
echo "== GPU tests"
timeout -s ABRT 300 python3 -m pytest -q -p no:cacheprovider -m gpu -rfs --tb=short \
    tests/test_kernels_gated_delta.py tests/test_ops_qwen3_next.py tests/test_e2e_qwen3_next.py \
    $(ls tests/test_sampling_controls*.py 2>/dev/null) 2>&1 | tee "$OUT/gdn_gpu.log" | tail -30
echo "== bench rows"
for model in random:qwen3-next-80b-a3b-8l random:llama-1b; do
    timeout -s ABRT 120 python3 -m taipan.cli bench --workload decode --model "$model" \
        --device cuda --dtype bfloat16 --batches 1,64 --no-hf --ours-modes graphs \
        --results "$OUT/results.jsonl" 2>&1 | grep -E "decode|floor|rror" | tail -6
done
