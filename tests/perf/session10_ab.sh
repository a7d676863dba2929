#!/usr/bin/env bash
# The structured row before and after greedy grammar rows moved from the launch to the collect
# (a165f2d), alternating in one call: `.carry/old.patch` (git diff HEAD 2a9e6f6 -- actors)
# turns a copy of `.carry/new` into the tree before. nvidia-h100-x1 after `carry_model.sh
# stage1`; carry .carry/smollm2.gguf.part2, .whl, .carry/new, .carry/old.patch. From the root.
set -u
N=${1:-2}
source tests/perf/device_setup.sh
start_device model && stage_old_and_new || exit 1
for i in $(seq "$N"); do
    for t in old new; do
        echo -n "$t: "
        (cd .carry/new && PYTHONPATH=/tmp/pkg_$t:/tmp/site:$PWD timeout -s ABRT 150 python3 -m \
            taipan.cli bench --workload structured --model smollm2 --device cuda \
            --dtype bfloat16 --num-prompts 64 --output-len 128 \
            --results "$OUT/results_$t.jsonl" 2>&1 | tail -1)
    done
done
