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
#   grammar (one GPU, the real model: carry_model.sh stage1 first, then carry
#     [".carry/smollm2.gguf.part2", ".whl"]): issue 28's structured row (SmolLM2, batch 64 x 128,
#     json_schema against unconstrained) with TAIPAN_GRAMMAR_MASKS=check / mask / check / mask
#     (greedy rows checked after sampling, the next forward waiting for the check, or masked
#     before sampling as sampled rows are); the structured GPU test in mask mode; the MTP worker
#     GPU test (on head dims the kernels serve now); issue 29's n-gram row (k = 4) on the
#     blocking step-event default.
#   spy (one GPU, the real model as for grammar): py-spy over the structured bench (every
#     thread of the engine process, where the gpu actor's launch and collect threads run).
#   gil (one GPU, the real model as for grammar): the structured row and the 1B decode rows at
#     batch 1 and 64 with TAIPAN_GIL_SWITCH_MS 0.5 / 0.1 / 0.5 / 0.1 (a thread that released
#     the GIL, for a CUDA wait or llguidance's masks, waits up to the interval to take it back
#     while the engine's loop runs: 64 masks took 0.5 ms alone and 17 ms beside a spinning
#     thread at CPython's 5 ms, on the 2-core box).
#   (ahead: masks computed by a thread of their own, the stream waiting on a pinned host flag,
#     ran twice from an uncommitted tree and was taken out: NOTES, twenty-third session.)
#   inline (one GPU, the real model as for grammar): run at afad14e + "mask" grammar steps
#     launched inline (taken out after: no gain): the structured GPU test under "mask", then the
#     structured row check / mask / check / mask.
PART=${1:?part one, four, sync, grammar, gil, inline or spy}
if [ "$PART" = four ]; then exec bash tests/perf/session22_gpu.sh four; fi
source tests/perf/device_setup.sh
if [ "$PART" = grammar ]; then
    enter_new_tree model || exit 1
    for mode in check mask check mask; do structured_row "$mode" TAIPAN_GRAMMAR_MASKS=$mode; done
    TAIPAN_GRAMMAR_MASKS=mask timeout -s ABRT 200 python3 -m pytest -q -m gpu \
        -p no:cacheprovider -rfs --tb=short tests/test_structured_outputs.py \
        tests/test_gpu_worker_mtp.py > "$OUT/gpu_tests.log" 2>&1
    grep -E "^(FAILED|ERROR)|^E  |passed|failed" "$OUT/gpu_tests.log" | cut -c1-220 | tail -12
    timeout -s ABRT 150 python3 -m taipan.cli bench --workload spec --model smollm2 \
        --device cuda --dtype bfloat16 --spec-tokens 4 --results "$OUT/spec_ngram.jsonl" 2>&1 \
        | grep -E "^spec|rror" | cut -c1-240
    exit 0
fi
if [ "$PART" = inline ]; then  # (the real model: as for grammar)
    enter_new_tree model || exit 1
    TAIPAN_GRAMMAR_MASKS=mask timeout -s ABRT 120 python3 -m pytest -q -m gpu \
        -p no:cacheprovider -rfs --tb=short tests/test_structured_outputs.py \
        > "$OUT/inline_tests.log" 2>&1
    grep -E "^(FAILED|ERROR)|^E  |passed|failed" "$OUT/inline_tests.log" | cut -c1-220 | tail -8
    for mode in check mask check mask; do structured_row "$mode" TAIPAN_GRAMMAR_MASKS=$mode; done
    exit 0
fi
if [ "$PART" = gil ]; then  # (the real model: as for grammar)
    enter_new_tree model || exit 1
    for ms in 0.5 0.1 0.5 0.1; do
        structured_row "gil$ms" TAIPAN_GIL_SWITCH_MS=$ms
        decode_1b_row "gil$ms" TAIPAN_GIL_SWITCH_MS=$ms
    done
    exit 0
fi
if [ "$PART" = spy ]; then
    enter_new_tree model || exit 1
    timeout -s INT 240 /tmp/site/bin/py-spy record --idle --threads --subprocesses --format raw \
        -r 200 -o /tmp/spy_structured.txt -- python3 -m taipan.cli bench \
        --workload structured --model smollm2 --device cuda --dtype bfloat16 \
        --num-prompts 64 --output-len 128 --results "$OUT/structured_spy.jsonl" 2>&1 \
        | grep -E "^structured|rror|Samples" | cut -c1-230
    python3 tests/perf/spy_summary.py /tmp/spy_structured.txt "taipan.procs engine" 45 \
        > "$OUT/spy_engine.txt"
    gzip -c /tmp/spy_structured.txt > "$OUT/spy_structured.txt.gz"
    ls -la "$OUT"
    exit 0
fi
enter_new_tree || exit 1
if [ "$PART" = sync ]; then
    for mode in spin blocking spin blocking; do decode_1b_row "$mode" TAIPAN_STEP_EVENT_SYNC=$mode; done
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
