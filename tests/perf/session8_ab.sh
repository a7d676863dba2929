#!/usr/bin/env bash
# Issue 25's before/after (3f2c8b5 in .carry/old vs HEAD in .carry/new) and issue 24's bimodal
# batch-1 step: the 1B shape's decode at batch 1 and 64, old/new alternating, first unpinned
# then every process pinned to the CPUs of the GPU's NUMA node (`taskset`), N pairs each
# (default 3). PINS="0" runs the unpinned pairs only; SPY=1 then runs py-spy over the new
# tree (session9_ab.sh does both). Rows to $OUT/ab.jsonl (each with `tree` and `pinned`). One GPU, no model carried;
# `.whl`, `.carry/old` and `.carry/new` carried. Run from the repository root.
set -u
N=${1:-3}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/*.whl 2>/dev/null || exit 1
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
nvidia-smi topo -m 2>&1 | head -4
AFF=$(nvidia-smi topo -m 2>/dev/null | awk '/^GPU0/ {for (i = 2; i <= NF; i++) if ($i ~ /^[0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*$/ && $i ~ /-/) {print $i; exit}}')
echo "GPU0 CPU affinity: ${AFF:-unknown}; nproc $(nproc)"
for t in old new; do
    python3 -c "from tests.lint_imports import stage; from pathlib import Path; \
stage(Path('.carry/$t'), Path('/tmp/pkg_$t'))" 2>/dev/null || \
    (cd .carry/$t && python3 -c "from tests.lint_imports import stage; from pathlib import Path; \
stage(Path('.'), Path('/tmp/pkg_$t'))") || exit 1
done
run() {  # tree pinned
    local tree=$1 pin=$2 pre=""
    [ "$pin" = 1 ] && [ -n "$AFF" ] && pre="taskset -c $AFF"
    (cd .carry/$tree && PYTHONPATH=/tmp/pkg_$tree:/tmp/site:$PWD timeout -s ABRT 120 $pre \
        python3 -m taipan.cli bench --workload decode --model random:llama-1b --device cuda \
        --dtype bfloat16 --batches 1,64 --output-len 256 --no-hf --ours-modes graphs \
        --results /tmp/ab_one.jsonl > /tmp/ab_one.log 2>&1) || { tail -3 /tmp/ab_one.log; return; }
    python3 - "$tree" "$pin" "$OUT/ab.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open("/tmp/ab_one.jsonl")][-2:]
with open(sys.argv[3], "a") as f:
    for r in rows:
        r.update(tree=sys.argv[1], pinned=sys.argv[2] == "1",
                 command="tests/perf/session8_ab.sh")
        f.write(json.dumps(r) + "\n")
print(sys.argv[1], "pinned" if sys.argv[2] == "1" else "free  ", " ".join(
    f"b{r['batch']}: {r['ours_step_ms']:.3f} ms (idle {100 * r['gpu_idle_share']:.1f} %)"
    for r in rows))
PY
}
for pin in ${PINS:-0 1}; do
    for i in $(seq "$N"); do run old $pin; run new $pin; done
done
[ "${SPY:-0}" = 1 ] || exit 0
# Then where the engine's host time goes now: py-spy over the new tree's batch-64 decode (every
# process at 100 Hz; raw stacks to $OUT/spy_new.txt).
(cd .carry/new && PYTHONPATH=/tmp/pkg_new:/tmp/site:$PWD timeout -s INT 100 \
    /tmp/site/bin/py-spy record --subprocesses --format raw -r 100 -o "$OUT/spy_new.txt" -- \
    python3 -m taipan.cli bench --workload decode --model random:llama-1b --device cuda \
    --dtype bfloat16 --batches 64 --output-len 2400 --no-hf --ours-modes graphs \
    --results /tmp/spy_new.jsonl 2>&1 | grep -E "^decode|rror|Samples" | cut -c1-160)
