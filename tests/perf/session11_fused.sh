#!/usr/bin/env bash
# The fused few-row decode path (kernels/gemv.py, DecoderLayer._fused_forward) on one GPU
# (carry .whl and .carry/new, a `git archive` of HEAD; no model needed). From the root.
#   part check: its GPU tests (the kernel in bf16 against the unfused kernels; the layer path
#     fused against unfused, fp32/bf16, eager and graphed, four families), the GPU tests that
#     compare whole models with HF (test_gpu.py), then the kernel sweep and the model steps
#     (tests/perf/fused_decode_bench.py);
#   part ab N: the 1B decode row (batch 1, 4 and 64) with TAIPAN_FUSED_GEMV 1 and 0 alternating,
#     N rounds, and the 8B row at batch 1 once each;
#   part models: issue 27's batch-1 bar (Qwen2.5-7B and Gemma 3 shapes, <= 1.3x the floor): the
#     Gemma path's GPU tests (fused against unfused; served with graphs against HF), the model
#     steps fused and unfused, and the decode rows with TAIPAN_FUSED_GEMV 1 and 0.
set -u
PART=${1:?part check or ab}
source tests/perf/device_setup.sh
start_device || exit 1
export PYTHONFAULTHANDLER=1
stage_tree .carry/new /tmp/pkg_new || exit 1
cd .carry/new && export PYTHONPATH=/tmp/pkg_new:/tmp/site:$PWD
if [ "$PART" = check ]; then
    timeout -s ABRT 200 python3 -m pytest -q -p no:cacheprovider -m gpu -rfs --tb=short \
        tests/test_kernels_gemv.py tests/test_ops_fused_decode.py ${TESTS:-} 2>&1 \
        | grep -vE "^  File|^Extension" | tail -15
    timeout -s ABRT 150 python3 tests/perf/fused_decode_bench.py model 2>&1 | tail -6
    [ -z "${KERNELS:-}" ] || timeout -s ABRT 200 python3 tests/perf/fused_decode_bench.py kernels 2>&1 | tail -26
elif [ "$PART" = ab ]; then
    for i in $(seq "${2:-2}"); do
        for f in 1 0; do
            echo "== fused $f"
            TAIPAN_FUSED_GEMV=$f timeout -s ABRT 100 python3 -m taipan.cli bench \
                --workload decode --model random:llama-1b --device cuda --dtype bfloat16 \
                --batches 1,4,64 --output-len 256 --no-hf --ours-modes graphs \
                --results "$OUT/decode_1b_$f.jsonl" 2>&1 | grep -E "^decode|rror" | cut -c1-220
        done
    done
    for f in 1 0; do
        echo "== 8B fused $f"
        TAIPAN_FUSED_GEMV=$f timeout -s ABRT 150 python3 -m taipan.cli bench \
            --workload decode --model random:llama-8b --device cuda --dtype bfloat16 \
            --batches 1 --output-len 128 --no-hf --ours-modes graphs \
            --results "$OUT/decode_8b_$f.jsonl" 2>&1 | grep -E "^decode|rror" | cut -c1-220
    done
elif [ "$PART" = models ]; then
    timeout -s ABRT 200 python3 -m pytest -q -p no:cacheprovider -m gpu -rfs --tb=short \
        tests/test_kernels_gemv.py tests/test_ops_fused_decode.py tests/test_e2e_dense.py 2>&1 \
        | grep -vE "^  File|^Extension" | tail -8
    timeout -s ABRT 150 python3 tests/perf/fused_decode_bench.py model gemma3-1b qwen2.5-7b 2>&1 \
        | grep '"rows": 1' | tail -4
    for shape in qwen2.5-7b gemma3-1b; do
        for f in 1 0; do
            echo "== $shape fused $f"
            TAIPAN_FUSED_GEMV=$f timeout -s ABRT 120 python3 -m taipan.cli bench \
                --workload decode --model random:$shape --device cuda --dtype bfloat16 \
                --batches 1 --output-len 128 --no-hf --ours-modes graphs \
                --results "$OUT/decode_${shape}_$f.jsonl" 2>&1 | grep -E "^decode|rror" | cut -c1-200
        done
    done
elif [ "$PART" = final1 ]; then  # the last kernel's GPU tests and model steps
    timeout -s ABRT 280 python3 -m pytest -q -p no:cacheprovider -m gpu -rfs --tb=short \
        tests/test_kernels_gemv.py tests/test_ops_fused_decode.py tests/test_gpu.py \
        tests/test_e2e_dense.py 2>&1 | grep -vE "^  File|^Extension" | tail -6
    timeout -s ABRT 200 python3 tests/perf/fused_decode_bench.py model llama-1b llama-8b \
        gemma3-1b qwen2.5-7b 2>&1 | grep '"part"'
    timeout -s ABRT 40 python3 tests/perf/fused_decode_bench.py profile llama-1b 2>&1 | grep -A6 '"part"'
elif [ "$PART" = final2 ]; then  # the decode rows, fused and not, alternating
    for i in $(seq "${2:-2}"); do
        for f in 1 0; do
            echo "== 1B fused $f"
            TAIPAN_FUSED_GEMV=$f timeout -s ABRT 100 python3 -m taipan.cli bench \
                --workload decode --model random:llama-1b --device cuda --dtype bfloat16 \
                --batches 1,64 --output-len 256 --no-hf --ours-modes graphs \
                --results "$OUT/decode_1b_$f.jsonl" 2>&1 | grep -E "^decode|rror" | cut -c1-200
        done
    done
    for shape in llama-8b qwen2.5-7b; do
        for f in 1 ${UNFUSED-0}; do  # (UNFUSED= : the fused rows only)
            echo "== $shape fused $f"
            TAIPAN_FUSED_GEMV=$f timeout -s ABRT 120 python3 -m taipan.cli bench \
                --workload decode --model random:$shape --device cuda --dtype bfloat16 \
                --batches 1 --output-len 128 --no-hf --ours-modes graphs \
                --results "$OUT/decode_${shape}_$f.jsonl" 2>&1 | grep -E "^decode|rror" | cut -c1-200
        done
    done
fi
