#!/usr/bin/env bash
# The nineteenth session's GPU checks, none of which ran then (no device time); the twentieth
# ran them (tests/perf/NOTES.md). From the root; carry [".whl"] (and the model's half, below).
#   part one (one GPU): per-layer-group KV under CUDA graphs (tests/test_local_kv.py), the
#     sampling controls' CUDA tests (their cases now hold allowed_token_ids), the windowed dense
#     and Gemma 3 GPU tests (the split pool serves them now), the structured GPU test
#     (allow_rows in verify rows).
#   part two (two GPUs): the GPU tests whose helpers moved to tests/ports.py in the eighteenth
#     session (test_tp.py run_ranks users, the NCCL push of test_rl.py, the weight-transfer ones).
#   part split (one GPU): issue 27's bench rows of the split pool, a Gemma 3 1B shape with 4,096-
#     token prompts (rings of the 512-token window, not whole requests), split and one pool
#     (disable_hybrid_kv_cache_manager) in one call: step times and the pools' blocks.
PART=${1:?part one, two or split}
source tests/perf/device_setup.sh
# parts one and two collect modules that need the real model (test_gemma3.py's tokenizer,
# test_ops_dense.py through test_ops_llama.py): its halves go first (tests/perf/carry_model.sh),
# then carry [".carry/smollm2.gguf.part2", ".whl"] (enter_new_tree makes .carry/new from the tree)
if [ "$PART" = split ]; then enter_new_tree || exit 1; else enter_new_tree model || exit 1; fi
if [ "$PART" = one ]; then
    timeout -s ABRT 560 python3 -m pytest -q -m gpu -x -p no:cacheprovider \
        tests/test_local_kv.py tests/test_sampling_controls.py tests/test_e2e_dense.py \
        tests/test_gemma3.py tests/test_gpu_speculative.py tests/test_structured_outputs.py \
        2>&1 | tail -15
fi
if [ "$PART" = two ]; then
    timeout -s ABRT 560 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_tp.py \
        tests/test_custom_all_reduce.py tests/test_ops_dense.py tests/test_tp_moe.py \
        tests/test_rl.py tests/test_gpu_weight_transfer.py tests/test_e2e_dense.py 2>&1 | tail -25
fi
if [ "$PART" = split ]; then
    for one in false true; do
        timeout -s ABRT 250 python3 -m taipan.cli bench --workload decode --device cuda \
            --dtype bfloat16 --model random:gemma3-1b --batches 1,8 --prompt-len 4096 \
            --output-len 64 --no-hf --set max_sequence_length=4224 \
            --set disable_hybrid_kv_cache_manager=$one --results "$OUT/split_$one.jsonl" 2>&1 \
            | grep -E "^decode|rror|blocks" | cut -c1-220
    done
fi
