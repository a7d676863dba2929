#!/usr/bin/env bash
# The twentieth session's GPU call (one GPU; from the root, carry [".whl"]: the tree is copied
# to .carry/new on the device): the split pool's rows again after the chunk floor (713d05b:
# wrapping rings compute chunks of 2,048 tokens, not of the window), its GPU tests, and where
# an eager step's host time goes (tests/perf/eager_host.py: the bench's eager rows are ~23 ms a
# step on the Gemma 3 1B shape). `rows`: issue 27's batch-1 decode rows again, the Gemma 3 12B
# shape twice (1.299x its floor in the seventeenth session: at the bar) and Qwen2.5-7B.
PART=${1:-one}
[ "$PART" = rows ] || bash tests/perf/session19_gpu.sh split  # (the split's rows, same bench)
source tests/perf/device_setup.sh
enter_new_tree || exit 1
if [ "$PART" = rows ]; then
    for shape in gemma3-12b qwen2.5-7b gemma3-12b; do
        timeout -s ABRT 150 python3 -m taipan.cli bench --workload decode --device cuda \
            --dtype bfloat16 --output-len 128 --no-hf --batches 1 --model random:$shape \
            --results "$OUT/decode_$shape.jsonl" 2>&1 | grep -E "^decode|rror" | cut -c1-150 \
            | sed "s/^/$shape /"
    done
    exit 0
fi
timeout -s ABRT 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_local_kv.py \
    tests/test_e2e_dense.py -k "not tp2" 2>&1 | tail -3
timeout -s ABRT 150 python3 tests/perf/eager_host.py random:gemma3-1b 1 512 2048 \
    > "$OUT/eager_host.txt" 2>&1
grep -E "eager: wall" "$OUT/eager_host.txt"
