#!/usr/bin/env bash
# What the seventh session left for the device (repo root; `.whl` (incl. llguidance and py-spy)
# and `.carry/new` (a `git archive` of HEAD) carried):
#   part a, on nvidia-h100-x2 after `carry_model.sh stage1` (carry part2 too): the speculative
#     GPU test (verify steps in mixed graphs, 5e0f627), the structured row (greedy grammar rows
#     checked after sampling, c739fd9; issue 28's bar: cost <= 0.05 at 64 streams), the spec row
#     (issue 29's bar: >= 2x at batch 1 on the grounded workload), and py-spy over the spec bench
#     kept small enough to come back (issue 24's bimodal step: profile the engine process);
#   part b, on nvidia-h100-x4 (no model): the 8B weight sync at TP = 2, trainer on cuda:0 and
#     taipan on cuda:1-2, paused and in flight (issue 26's last acceptance row, after the side-
#     stream copies of 3e00230).
set -u
PART=${1:?part a, b or c}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/*.whl 2>/dev/null || exit 1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c
ROOT=$PWD
python3 -c "from tests.lint_imports import stage; from pathlib import Path; \
stage(Path('.carry/new'), Path('/tmp/pkg_new'))" || exit 1
cd .carry/new && export PYTHONPATH=/tmp/pkg_new:/tmp/site:$PWD
if [ "$PART" = a ]; then
    (cd "$ROOT" && bash tests/perf/carry_model.sh stage2) || exit 1
    echo "== speculative GPU test"
    CUDA_VISIBLE_DEVICES=0 timeout -s ABRT 150 python3 -m pytest -q -p no:cacheprovider -m gpu \
        -rfs --tb=short tests/test_e2e_speculative.py 2>&1 | grep -vE "^  File|^Extension" \
        | tail -8
    echo "== structured"
    CUDA_VISIBLE_DEVICES=0 timeout -s ABRT 150 python3 -m taipan.cli bench --workload structured \
        --model smollm2 --device cuda --dtype bfloat16 --num-prompts 64 --output-len 128 \
        --results "$OUT/results.jsonl" 2>&1 | tail -1
    echo "== spec"
    CUDA_VISIBLE_DEVICES=0 timeout -s ABRT 150 python3 -m taipan.cli bench --workload spec \
        --model smollm2 --device cuda --dtype bfloat16 --results "$OUT/results.jsonl" 2>&1 \
        | tail -2
    echo "== py-spy over a 1B batch-1 decode (every process, 100 Hz, 20 s)"
    CUDA_VISIBLE_DEVICES=0 timeout -s INT 90 /tmp/site/bin/py-spy record --subprocesses \
        --format raw -r 100 -d 20 -o "$OUT/decode_b1.pyspy.txt" -- python3 -m taipan.cli bench \
        --workload decode --model random:llama-1b --device cuda --dtype bfloat16 --batches 1 \
        --output-len 2048 --no-hf --ours-modes graphs --results "$OUT/results_pyspy.jsonl" 2>&1 \
        | grep -E "^decode|rror" | tail -2
elif [ "$PART" = b ]; then
    WS="-m taipan.cli bench --workload weight-sync --model random:llama-8b --dtype bfloat16"
    WS="$WS --trainer-device cuda:0 --device cuda:1 --tensor-parallel-size 2 --sync-rounds 3"
    WS="$WS --results $OUT/results.jsonl"
    timeout -s ABRT 200 python3 $WS 2>&1 | grep -E "weight-sync [0-9]|rror" | tail -3
    timeout -s ABRT 200 python3 $WS --in-flight 2>&1 | grep -E "weight-sync [0-9]|rror" | tail -3
fi
# part c, on nvidia-h100-x1 after `carry_model.sh stage1` (carry part2, .whl, .carry/new and
# .carry/old = 3f2c8b5): the spec row with the back-off (issue 29), py-spy over the spec bench's
# speculating runtime (where a verify step's ~4.3 ms goes), and issue 25's A/B again after the
# host-step trims (session8_ab.sh, 2 pairs).
if [ "$PART" = c ]; then
    (cd "$ROOT" && bash tests/perf/carry_model.sh stage2) || exit 1
    echo "== spec (py-spy, every process, 50 Hz)"
    CUDA_VISIBLE_DEVICES=0 timeout -s INT 200 /tmp/site/bin/py-spy record --subprocesses \
        --format raw -r 50 -o "$OUT/spec.pyspy.txt" -- python3 -m taipan.cli bench --workload \
        spec --model smollm2 --device cuda --dtype bfloat16 --results "$OUT/results.jsonl" \
        2>&1 | grep -E "^spec|rror|Samples" | tail -3
    cd "$ROOT" && bash .carry/new/tests/perf/session8_ab.sh 2 | grep -E "^(old|new)"
fi
# part d, on nvidia-h100-x1 after `carry_model.sh stage1` (carry part2, .whl, .carry/new): the
# spec row after the host-side greedy verify and the back-off (issue 29), no profiler; then
# py-spy over the structured bench (issue 28: where a json_schema step's extra time goes now).
if [ "$PART" = d ]; then
    (cd "$ROOT" && bash tests/perf/carry_model.sh stage2) || exit 1
    echo "== spec"
    CUDA_VISIBLE_DEVICES=0 timeout -s ABRT 200 python3 -m taipan.cli bench --workload spec \
        --model smollm2 --device cuda --dtype bfloat16 --results "$OUT/results.jsonl" 2>&1 \
        | grep -E "^spec|rror" | tail -3
    echo "== structured (py-spy, every process, 50 Hz)"
    CUDA_VISIBLE_DEVICES=0 timeout -s INT 200 /tmp/site/bin/py-spy record --subprocesses \
        --format raw -r 50 -o "$OUT/structured.pyspy.txt" -- python3 -m taipan.cli bench \
        --workload structured --model smollm2 --device cuda --dtype bfloat16 --num-prompts 64 \
        --output-len 128 --results "$OUT/results_pyspy.jsonl" 2>&1 | grep -E "^structured|rror" \
        | tail -2
fi
# part e, on nvidia-h100-x1 after `carry_model.sh stage1` (carry part2, .whl, .carry/new): the
# spec row with 6 and 8 drafts per row (grounded acceptance held at 0.76-0.94 per later
# position with 4).
if [ "$PART" = e ]; then
    (cd "$ROOT" && bash tests/perf/carry_model.sh stage2) || exit 1
    for k in 8 6; do
        echo "== spec k=$k"
        CUDA_VISIBLE_DEVICES=0 timeout -s ABRT 200 python3 -m taipan.cli bench --workload spec \
            --model smollm2 --device cuda --dtype bfloat16 --spec-tokens $k \
            --results "$OUT/results.jsonl" 2>&1 | grep -E "^spec|rror" | tail -3
    done
fi
# part f, on nvidia-h100-x1 after `carry_model.sh stage1` (carry part2, .whl, .carry/new): the
# speculative GPU test with raw log-probs on verify rows (be09bb0), fp32 and bf16.
if [ "$PART" = f ]; then
    (cd "$ROOT" && bash tests/perf/carry_model.sh stage2) || exit 1
    CUDA_VISIBLE_DEVICES=0 timeout -s ABRT 200 python3 -m pytest -q -p no:cacheprovider -m gpu \
        -rfs --tb=short tests/test_e2e_speculative.py tests/test_gpu_speculative.py 2>&1 \
        | grep -vE "^  File|^Extension" | tail -8
fi
