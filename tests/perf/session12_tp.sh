#!/usr/bin/env bash
# The fused rank path under tensor parallelism (DecoderLayer._fused_tp_forward) on two GPUs
# (nvidia-h100-x2; carry .whl and .carry/new, a `git archive` of HEAD). From the root.
#   part check: the GPU tests of the fused path (one GPU: the GEMV kernels with RoPE in the qkv
#     product, which had never run on a GPU; the layer fused against unfused) and of TP = 2
#     (graphs equal to TP = 1, the dense families served at TP = 2 against HF, the custom
#     all-reduce), then the model steps of fused_decode_bench.py;
#   part final: the TP = 2 GPU tests with PDL on (the custom all-reduces take part), then ab;
#   part ab: the 8B decode rows at batch 1 and 64: TP = 1, TP = 2 fused (custom and NCCL-only
#     sums in one run), TP = 2 unfused (TAIPAN_FUSED_GEMV=0), in that order, ROUNDS times.
set -u
PART=${1:?part check or ab}
source tests/perf/device_setup.sh
start_device || exit 1
export PYTHONFAULTHANDLER=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_DISABLE_NVLS=1
stage_tree .carry/new /tmp/pkg_new || exit 1
cd .carry/new && export PYTHONPATH=/tmp/pkg_new:/tmp/site:$PWD
if [ "$PART" = check ]; then
    timeout -s ABRT 420 python3 -m pytest -q -p no:cacheprovider -m gpu -rfs --tb=short \
        tests/test_kernels_gemv.py tests/test_ops_fused_decode.py tests/test_e2e_dense.py \
        tests/test_tp.py tests/test_e2e_tp.py ${TESTS:-} 2>&1 \
        | grep -vE "^  File|^Extension" | tail -20
    timeout -s ABRT 120 python3 tests/perf/fused_decode_bench.py model 2>&1 | tail -6
elif [ "$PART" = ab ] || [ "$PART" = final ]; then
    if [ "$PART" = final ]; then
        timeout -s ABRT 300 python3 -m pytest -q -p no:cacheprovider -m gpu -rfs --tb=short \
            tests/test_kernels_pdl.py tests/test_custom_all_reduce.py tests/test_tp.py \
            tests/test_e2e_tp.py \
            tests/test_e2e_dense.py::test_gpu_served_at_tp2_with_cuda_graphs_equal_hf \
            2>&1 | grep -vE "^  File|^Extension" | tail -12
    fi
    DEC="bench --workload decode --model random:llama-8b --device cuda --dtype bfloat16
--batches 1,64 --output-len 128 --no-hf"
    for i in $(seq "${ROUNDS:-1}"); do
        echo "== round $i: TP=1"
        timeout -s ABRT 150 python3 -m taipan.cli $DEC --ours-modes graphs \
            --results "$OUT/tp1.jsonl" 2>&1 | grep -E "^decode|rror" | cut -c1-240
        echo "== round $i: TP=2 fused (custom, NCCL)"
        timeout -s ABRT 170 python3 -m taipan.cli $DEC --ours-modes graphs,nccl \
            --tensor-parallel-size 2 --results "$OUT/tp2.jsonl" 2>&1 \
            | grep -E "^decode|rror" | cut -c1-240
        echo "== round $i: TP=2 unfused"
        TAIPAN_FUSED_GEMV=0 timeout -s ABRT 150 python3 -m taipan.cli $DEC --ours-modes graphs \
            --tensor-parallel-size 2 --results "$OUT/tp2_unfused.jsonl" 2>&1 \
            | grep -E "^decode|rror" | cut -c1-240
    done
fi
