#!/usr/bin/env bash
# The sixteenth session's GPU checks (one GPU; carry [".whl", ".carry/new"]; from the root).
#   part draft: the draft-model GPU tests (a draft's updates from a path and from a trainer's
#     CUDA tensors by IPC reaching its graphed forwards) and the IPC weight-transfer GPU tests.
set -u
PART=${1:?part draft or transfers}
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
