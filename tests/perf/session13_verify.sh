#!/usr/bin/env bash
# What the twelfth session built and could not run on a GPU (carry .whl and .carry/new, a
# `git archive` of HEAD; no model needed). From the root.
#   part kernels (one GPU): every kernel's and model's GPU tests (PDL now in every kernel:
#     sampling, MoE, Mamba and Gated-DeltaNet ones too), test_gpu.py;
#   part one (one GPU): the q/k norms inside RoPE (Qwen3, Gemma 3) and Gemma 3's sandwich norms
#     in one launch each: their kernel GPU tests, the fused layers, the dense families served
#     against HF; then the Gemma 3 and Qwen2.5-7B decode rows at batch 1 (the issue 27 bar);
#   part two (two GPUs): the row-parallel GEMV with its sum (kernels/gemv_all_reduce.py,
#     TAIPAN_TP_GEMV_SUM=1): the custom all-reduce GPU test (against NCCL, eager and graphed,
#     and its latency against the product then the fused sum), Qwen2/Qwen3 served at TP=2
#     against HF with the switch off and on, then the 8B decode rows at TP=1 and at TP=2 with
#     the switch 0 and 1 (ROUNDS times).
#   part spec (one GPU; the thirteenth session's, CPU-tested only): speculative decoding of a
#     hybrid (the Mamba states rolled back to the last accepted draft) and with draft models
#     (a copy of the target and a self:1 draft, beside graphed target steps), served on CUDA
#     against plain decoding; then `bench --workload spec` rows on the 1B shape with a self:4
#     draft (the verify step's cost against a plain step, the mechanics' timing).
set -u
PART=${1:?part kernels, one, two or spec}
source tests/perf/device_setup.sh
start_device || exit 1
export PYTHONFAULTHANDLER=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_DISABLE_NVLS=1
stage_tree .carry/new /tmp/pkg_new || exit 1
cd .carry/new && export PYTHONPATH=/tmp/pkg_new:/tmp/site:$PWD
DEC="bench --workload decode --device cuda --dtype bfloat16 --output-len 128 --no-hf
--ours-modes graphs"
if [ "$PART" = kernels ]; then
    timeout -s ABRT 540 python3 -m pytest -q -p no:cacheprovider -m gpu -rfs --tb=short \
        tests/test_kernels_*.py tests/test_ops_*.py tests/test_gpu.py 2>&1 \
        | grep -vE "^  File|^Extension" | tail -12
elif [ "$PART" = one ]; then
    timeout -s ABRT 330 python3 -m pytest -q -p no:cacheprovider -m gpu -rfs --tb=short \
        tests/test_kernels_elementwise.py tests/test_ops_fused_decode.py \
        tests/test_kernels_pdl.py tests/test_e2e_dense.py -k "not tp2" 2>&1 \
        | grep -vE "^  File|^Extension" | tail -12
    for shape in gemma3-1b qwen2.5-7b; do
        timeout -s ABRT 120 python3 -m taipan.cli $DEC --model random:$shape --batches 1 \
            --results "$OUT/decode_$shape.jsonl" 2>&1 | grep -E "^decode|rror" | cut -c1-200
    done
elif [ "$PART" = spec ]; then
    timeout -s ABRT 300 python3 -m pytest -q -p no:cacheprovider -m gpu -rfs --tb=short \
        tests/test_e2e_speculative_hybrid.py tests/test_e2e_speculative_draft.py \
        tests/test_e2e_speculative.py 2>&1 | grep -vE "^  File|^Extension" | tail -12
    timeout -s ABRT 200 python3 -m taipan.cli bench --workload spec --device cuda \
        --dtype bfloat16 --model random:llama-1b --spec-draft self:4 --spec-tokens 4 \
        --num-prompts 4 --output-len 64 --results "$OUT/spec_self4.jsonl" 2>&1 \
        | grep -E "^spec|rror" | cut -c1-220
elif [ "$PART" = two ]; then
    timeout -s ABRT 300 python3 -m pytest -q -p no:cacheprovider -m gpu -rfs --tb=short -s \
        tests/test_custom_all_reduce.py \
        tests/test_e2e_dense.py::test_gpu_served_at_tp2_with_cuda_graphs_equal_hf 2>&1 \
        | grep -E "passed|failed|FAIL|Error|o_proj at TP" | tail -12
    for i in $(seq "${ROUNDS:-1}"); do
        timeout -s ABRT 150 python3 -m taipan.cli $DEC --model random:llama-8b --batches 1,64 \
            --results "$OUT/tp1.jsonl" 2>&1 | grep -E "^decode|rror" | cut -c1-160 | sed "s/^/TP=1 /"
        for s in 0 1; do
            TAIPAN_TP_GEMV_SUM=$s timeout -s ABRT 150 python3 -m taipan.cli $DEC \
                --model random:llama-8b --batches 1,64 --tensor-parallel-size 2 \
                --results "$OUT/tp2_sum$s.jsonl" 2>&1 | grep -E "^decode|rror" | cut -c1-160 \
                | sed "s/^/TP=2 sum=$s /"
        done
    done
fi
