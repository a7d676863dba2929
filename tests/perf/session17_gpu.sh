#!/usr/bin/env bash
# The seventeenth session's GPU checks (one GPU; carry [".whl", ".carry/new"]; from the root).
#   part gemma: issue 27's Gemma 3 decode rows at batch 1 (bf16, graphs, no HF) for the 1B, 4B
#     and 12B shapes, with the Qwen2.5-7B row in the same call for reference; rows to $OUT.
set -u
PART=${1:?part gemma}
source tests/perf/device_setup.sh
enter_new_tree || exit 1
DEC="bench --workload decode --device cuda --dtype bfloat16 --output-len 128 --no-hf
--ours-modes graphs --batches 1"
if [ "$PART" = gemma ]; then
    for shape in gemma3-1b gemma3-4b gemma3-12b qwen2.5-7b; do
        timeout -s ABRT 150 python3 -m taipan.cli $DEC --model random:$shape \
            --results "$OUT/decode_$shape.jsonl" 2>&1 | grep -E "^decode|rror" | cut -c1-220
    done
fi
