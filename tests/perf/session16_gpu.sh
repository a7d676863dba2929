#!/usr/bin/env bash
# The sixteenth session's GPU checks (one GPU; carry [".whl", ".carry/new"]; from the root).
#   part draft: the draft-model GPU tests (a draft's updates from a path and from a trainer's
#     CUDA tensors by IPC reaching its graphed forwards) and the IPC weight-transfer GPU tests.
set -u
PART=${1:?part draft, transfers or regime}
source tests/perf/device_setup.sh
enter_new_tree || exit 1
if [ "$PART" = draft ]; then
    timeout -s ABRT 400 python3 -m pytest -v -p no:cacheprovider -m gpu --tb=short \
        tests/test_e2e_speculative_draft.py tests/test_rl_ipc.py > "$OUT/draft.log" 2>&1
    grep -E "PASSED|FAILED|SKIPPED|ERROR|^E  |passed|failed" "$OUT/draft.log" | cut -c1-200 | tail -16
fi
#   part transfers (two GPUs): the weight-transfer GPU tests (NCCL from a trainer on one GPU into
#     taipan on the other, IPC at TP = 1 and 2, a trainer dying part way).
if [ "$PART" = transfers ]; then
    timeout -s ABRT 500 python3 -m pytest -v -p no:cacheprovider -m gpu --tb=short \
        tests/test_rl.py tests/test_rl_ipc.py tests/test_gpu_weight_transfer.py \
        tests/test_e2e_speculative_draft.py > "$OUT/transfers.log" 2>&1
    grep -E "PASSED|FAILED|SKIPPED|ERROR|^E  |passed|failed" "$OUT/transfers.log" | cut -c1-200 | tail -20
fi
#   part regime (one GPU): issue 24 item 4's check, the 1B shape's decode at batch 1 and 64
#     (bf16, graphs, no HF) in five consecutive runs, rows to $OUT.
if [ "$PART" = regime ]; then
    for i in 1 2 3 4 5; do
        timeout -s ABRT 100 python3 -m taipan.cli bench --workload decode --device cuda \
            --dtype bfloat16 --output-len 128 --no-hf --ours-modes graphs --batches 1,64 \
            --model random:llama-1b --results "$OUT/regime_$i.jsonl" 2>&1 \
            | grep -E "^decode|rror" | cut -c1-200 | sed "s/^/run $i /"
    done
fi
