#!/usr/bin/env bash
# Issue 24's bimodal host step: is it CPU placement? The 1B shape's decode (batch 1 and 64) of
# HEAD (.carry/new), N rounds (default 3) of three variants in turn: as is; OMP_NUM_THREADS=1
# (torch's CPU thread pool, 16 spinning threads by default on this host, kept small); and the
# engine process (every thread) pinned to 2 cores, everything else on others. Rows to
# $OUT/pin.jsonl with `variant`. `.whl` and `.carry/new` carried; one GPU, no model.
set -u
N=${1:-3}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/*.whl 2>/dev/null || exit 1
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
lscpu | grep -E "^(CPU\(s\)|Thread|Core|Socket|NUMA|Model name)" | head -8
python3 -c "from tests.lint_imports import stage; from pathlib import Path; \
stage(Path('.carry/new'), Path('/tmp/pkg_new'))" || exit 1
pin_engine() {  # pin every thread of the engine process to cores 2-3 once it is up
    for _ in $(seq 200); do
        pid=$(pgrep -f "taipan.procs engine" | head -1)
        if [ -n "$pid" ]; then sleep 0.5; taskset -a -p -c 2,3 "$pid" > /dev/null; return; fi
        sleep 0.1
    done
}
run() {  # variant
    local v=$1 pre="" envs=""
    [ "$v" = omp1 ] && envs="OMP_NUM_THREADS=1"
    [ "$v" = pinned ] && { pre="taskset -c 4-15"; envs="OMP_NUM_THREADS=2"; pin_engine & }
    (cd .carry/new && env $envs PYTHONPATH=/tmp/pkg_new:/tmp/site:$PWD timeout -s ABRT 120 $pre \
        python3 -m taipan.cli bench --workload decode --model random:llama-1b --device cuda \
        --dtype bfloat16 --batches 1,64 --output-len 256 --no-hf --ours-modes graphs \
        --results /tmp/pin_one.jsonl > /tmp/pin_one.log 2>&1) || { tail -3 /tmp/pin_one.log; }
    wait
    python3 tests/perf/keep_rows.py /tmp/pin_one.jsonl "$OUT/pin.jsonl" 2 "$v" variant="$v" \
        command=tests/perf/session8_pin.sh
}
for i in $(seq "$N"); do run default; run omp1; run pinned; done
