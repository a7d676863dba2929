#!/usr/bin/env bash
# Issue 24 item 4: the 1B shape's decode step at batch 1 and 64, N consecutive runs on one GPU
# (default 5), rows to $OUT/regime.jsonl, every run's log to $OUT/regime.log (two files in all:
# the device tool brings back at most 8, and on 2026-11-26 one log per run left the rows
# behind). Run from the repository root after `source tests/perf/device_env.sh`:
#   bash tests/perf/regime_1b.sh [N] [ENV=VALUE ...]   # e.g. TAIPAN_BLOCKING_SYNC=1
set -uo pipefail
n=${1:-5}
shift || true
out=${OUT:-/tmp}
lscpu -e=CPU,CORE,SOCKET,NODE 2>/dev/null | head -40 >> "$out/regime.log"
status=0
for i in $(seq "$n"); do
    env "$@" python3 -m taipan.cli bench --workload decode --model random:llama-1b --device cuda \
        --dtype bfloat16 --batches 1,64 --no-hf --ours-modes graphs \
        --results "$out/regime.jsonl" >> "$out/regime.log" 2>&1 || status=1
    python3 - "$out/regime.jsonl" "$*" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])][-2:]
print(sys.argv[2] or "default", " ".join(
    f"b{r['batch']}: {r['ours_step_ms']:.3f} ms ({r['step_vs_floor']:.2f}x floor "
    f"{r['floor_ms']:.3f}, idle {100 * r['gpu_idle_share']:.1f} %)" for r in rows))
EOF
done
exit $status
