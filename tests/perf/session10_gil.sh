#!/usr/bin/env bash
# The engine processes' GIL switch interval (runtime/placement.py GIL_SWITCH_MS, 0.5 ms) against
# CPython's 5 ms (TAIPAN_GIL_SWITCH_MS=5), alternating on one tree (.carry/new): the 1B shape's
# decode row at batch 1 and 64 (random weights) and the structured row (the real model: after
# `carry_model.sh stage1`; carry .carry/smollm2.gguf.part2, .whl, .carry/new). From the root.
set -u
N=${1:-2}
source tests/perf/device_setup.sh
start_device model || exit 1
stage_tree .carry/new /tmp/pkg_new || exit 1
cd .carry/new && export PYTHONPATH=/tmp/pkg_new:/tmp/site:$PWD
for i in $(seq "$N"); do
    for ms in 5 0.5; do
        echo "== switch $ms ms"
        TAIPAN_GIL_SWITCH_MS=$ms timeout -s ABRT 100 python3 -m taipan.cli bench \
            --workload decode --model random:llama-1b --device cuda --dtype bfloat16 \
            --batches 1,64 --output-len 256 --no-hf --ours-modes graphs \
            --results "$OUT/decode_$ms.jsonl" 2>&1 | grep -E "^decode|rror" | cut -c1-200
        TAIPAN_GIL_SWITCH_MS=$ms timeout -s ABRT 100 python3 -m taipan.cli bench \
            --workload structured --model smollm2 --device cuda --dtype bfloat16 \
            --num-prompts 64 --output-len 128 --results "$OUT/structured_$ms.jsonl" 2>&1 | tail -1
    done
done
