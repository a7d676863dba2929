#!/usr/bin/env bash
# Programmatic dependent launch (kernels/pdl.py) on one GPU (carry .whl and .carry/new, a
# `git archive` of HEAD; no model needed). From the root.
#   part check: the GPU tests of the kernels that take part (PDL on, the default), then the
#     model steps (tests/perf/fused_decode_bench.py model) with TAIPAN_PDL 1 and 0;
#   part quick: the PDL, GEMV and fused-layer GPU tests, then `ab 1`;
#   part variants N: .carry/old (another gemv.py) against .carry/new, PDL on, the 1B rows (batch
#     1 and 64) and the 8B row (batch 1), N rounds alternating; then new with PDL off, once;
#   part ab N: the 1B decode row (batch 1 and 64) and the 8B row (batch 1) with TAIPAN_PDL 1
#     and 0 alternating, N rounds.
set -u
PART=${1:?part check or ab}
source tests/perf/device_setup.sh
start_device || exit 1
export PYTHONFAULTHANDLER=1
stage_tree .carry/new /tmp/pkg_new || exit 1
rows() {  # TREE PDL LABEL: the decode rows of that tree with TAIPAN_PDL=PDL
    (cd "$1" && export PYTHONPATH=/tmp/pkg_$(basename "$1"):/tmp/site:$PWD TAIPAN_PDL=$2 &&
        timeout -s ABRT 100 python3 -m taipan.cli bench --workload decode \
            --model random:llama-1b --device cuda --dtype bfloat16 --batches 1,64 \
            --output-len 256 --no-hf --ours-modes graphs --results "$OUT/1b_$3.jsonl" \
            2>&1 | grep -E "^decode|rror" | cut -c1-150 | sed "s/^/$3 1B /" &&
        timeout -s ABRT 120 python3 -m taipan.cli bench --workload decode \
            --model random:llama-8b --device cuda --dtype bfloat16 --batches 1 \
            --output-len 128 --no-hf --ours-modes graphs --results "$OUT/8b_$3.jsonl" \
            2>&1 | grep -E "^decode|rror" | cut -c1-150 | sed "s/^/$3 8B /")
}
if [ "$PART" = variants ]; then
    stage_tree .carry/old /tmp/pkg_old || exit 1
    (cd .carry/new && PYTHONPATH=/tmp/pkg_new:/tmp/site:$PWD timeout -s ABRT 200 python3 -m \
        pytest -q -p no:cacheprovider -m gpu -rfs --tb=short tests/test_kernels_pdl.py \
        tests/test_kernels_gemv.py tests/test_ops_fused_decode.py 2>&1 | tail -2)
    for i in $(seq "${2:-1}"); do
        rows .carry/old 1 old
        rows .carry/new 1 new
    done
    rows .carry/new 0 new_nopdl
    exit 0
fi
cd .carry/new && export PYTHONPATH=/tmp/pkg_new:/tmp/site:$PWD
if [ "$PART" = check ]; then
    timeout -s ABRT 300 python3 -m pytest -q -p no:cacheprovider -m gpu -rfs --tb=short \
        tests/test_kernels_gemv.py tests/test_ops_fused_decode.py tests/test_gpu.py \
        tests/test_kernels_decode_attention.py tests/test_kernels_elementwise.py ${TESTS:-} \
        2>&1 | grep -vE "^  File|^Extension" | tail -12
    for p in 1 0; do
        echo "== TAIPAN_PDL=$p"
        TAIPAN_PDL=$p timeout -s ABRT 120 python3 tests/perf/fused_decode_bench.py model \
            2>&1 | grep '"rows": 1'
    done
    TAIPAN_PDL=1 timeout -s ABRT 60 python3 tests/perf/fused_decode_bench.py profile 2>&1 \
        | head -30
elif [ "$PART" = ab ] || [ "$PART" = quick ]; then
    if [ "$PART" = quick ]; then
        timeout -s ABRT 200 python3 -m pytest -q -p no:cacheprovider -m gpu -rfs --tb=short \
            tests/test_kernels_pdl.py tests/test_kernels_gemv.py tests/test_ops_fused_decode.py \
            2>&1 | grep -vE "^  File|^Extension" | tail -4
    fi
    for i in $(seq "${2:-1}"); do
        for p in 1 0; do
            echo "== round $i: TAIPAN_PDL=$p"
            TAIPAN_PDL=$p timeout -s ABRT 100 python3 -m taipan.cli bench --workload decode \
                --model random:llama-1b --device cuda --dtype bfloat16 --batches 1,64 \
                --output-len 256 --no-hf --ours-modes graphs --results "$OUT/decode_1b_$p.jsonl" \
                2>&1 | grep -E "^decode|rror" | cut -c1-220
            TAIPAN_PDL=$p timeout -s ABRT 120 python3 -m taipan.cli bench --workload decode \
                --model random:llama-8b --device cuda --dtype bfloat16 --batches 1 \
                --output-len 128 --no-hf --ours-modes graphs --results "$OUT/decode_8b_$p.jsonl" \
                2>&1 | grep -E "^decode|rror" | cut -c1-220
        done
    done
fi
