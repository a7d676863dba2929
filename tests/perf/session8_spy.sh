#!/usr/bin/env bash
# Where the 1B shape's batch-64 decode step lost ~0.7 ms of host time since 3f2c8b5 (issue 25's
# before/after, session8_ab.sh): py-spy over the engine process of each tree in steady decode
# (every process at 100 Hz over a bench of 2,400 steps; the analysis keeps the engine's step loop). Raw stacks
# to $OUT/spy_{old,new}.txt. `.whl`, `.carry/old`, `.carry/new` carried; one GPU, no model.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/*.whl 2>/dev/null || exit 1
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
for t in old new; do
    python3 -c "from tests.lint_imports import stage; from pathlib import Path; \
stage(Path('.carry/$t'), Path('/tmp/pkg_$t'))" || exit 1
done
for t in old new; do
    (cd .carry/$t && PYTHONPATH=/tmp/pkg_$t:/tmp/site:$PWD timeout -s INT 100 \
        /tmp/site/bin/py-spy record --subprocesses --format raw -r 100 -o "$OUT/spy_$t.txt" -- \
        python3 -m taipan.cli bench --workload decode --model random:llama-1b --device cuda \
        --dtype bfloat16 --batches 64 --output-len 2400 --no-hf --ours-modes graphs \
        --results /tmp/spy_$t.jsonl 2>&1 | grep -E "^decode|rror|Samples" | cut -c1-160)
done
