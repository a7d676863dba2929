#!/usr/bin/env bash
# What the twenty-second session built after its device time was spent (from the root, carry
# [".whl"]):
#   one (one GPU): a hybrid's verify steps in mixed CUDA graphs (their recurrent snapshots in
#     the step buffers: actors/gpu/buffers.py snap_pos / snap_slots), with the MTP head's
#     graphs: the MTP worker GPU test (a graphed CUDA worker against an eager one, every step
#     graphed: 3 replays of the head's graph), the MTP and hybrid-speculation runtime GPU tests,
#     the prompt-chunk graph tests of the hybrids; then the spec bench with --spec-method mtp
#     (session 22: 4.77 ms a step with the head's graphs and eager verify steps, 0.98 plain).
#   four (four GPUs): the GPU tests not yet run with cuda_graph_all_prefills on by default
#     (session22_gpu.sh four).
#   sync (one GPU): issue 24's GPU idle at batch 64 (the engine's main thread sets the pace:
#     NOTES, twenty-second session, where the launch's CUDA calls took ~0.4 ms a step while the
#     collecting thread spun in Event.synchronize): the 1B decode rows at batch 1 and 64 with
#     TAIPAN_STEP_EVENT_SYNC=spin / blocking / spin / blocking, one tree.
PART=${1:?part one, four or sync}
if [ "$PART" = four ]; then exec bash tests/perf/session22_gpu.sh four; fi
source tests/perf/device_setup.sh
enter_new_tree || exit 1
if [ "$PART" = sync ]; then
    for mode in spin blocking spin blocking; do
        TAIPAN_STEP_EVENT_SYNC=$mode timeout -s ABRT 150 python3 -m taipan.cli bench \
            --workload decode --model random:llama-1b --device cuda --dtype bfloat16 \
            --batches 1,64 --output-len 256 --no-hf --ours-modes graphs \
            --results "$OUT/sync_$mode.jsonl" 2>&1 | grep -E "^decode|rror" | cut -c1-170 \
            | sed "s/^/$mode /"
    done
    exit 0
fi
timeout -s ABRT 300 python3 -m pytest -q -m gpu -p no:cacheprovider -rfs --tb=short \
    tests/test_gpu_worker_mtp.py tests/test_e2e_mtp.py tests/test_e2e_speculative_hybrid.py \
    tests/test_gpu_prefill_graphs.py > "$OUT/gpu_tests.log" 2>&1
grep -E "^(FAILED|ERROR)|^E  |passed|failed" "$OUT/gpu_tests.log" | cut -c1-220 | tail -15
python3 -c "
from tests.random_qwen3_next import add_mtp_head, make_random_qwen3_next
from tests.test_e2e_qwen3_next import GPU_SHAPE
add_mtp_head(make_random_qwen3_next('/tmp/q3n_mtp', 'moe', shape=GPU_SHAPE))" >/dev/null || exit 1
timeout -s ABRT 150 python3 -m taipan.cli bench --workload spec --model /tmp/q3n_mtp \
    --device cuda --dtype bfloat16 --spec-method mtp --spec-tokens 3 \
    --results "$OUT/spec_mtp.jsonl" 2>&1 | grep -E "^spec|rror" | cut -c1-240
