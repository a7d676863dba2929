#!/usr/bin/env bash
# What graphs for prompt chunks are worth (`cuda_graph_all_prefills`, Megatron's field, default
# off): the offline bench on the 1B Llama shape (1,000 requests of lognormal lengths, so steps
# that mix admissions and decode rows come all the time), off then on then off, one GPU; the
# wall time of each call (load, capture and run) beside. `bash ... [MODEL] [ORDER]` (default
# random:llama-1b, "false true false"). From the root, carry [".whl"].
MODEL=${1:-random:llama-1b}
ORDER=${2:-false true false}
source tests/perf/device_setup.sh
enter_new_tree || exit 1
for on in $ORDER; do
    start=$(date +%s)
    timeout -s ABRT 170 python3 -m taipan.cli bench --workload offline --device cuda \
        --dtype bfloat16 --model $MODEL --num-requests 1000 --no-hf \
        --set cuda_graph_all_prefills=$on --results "$OUT/offline_$on.jsonl" 2>&1 \
        | grep -E "^offline|rror|graphs" | cut -c1-220
    echo "all_prefills=$on: $(( $(date +%s) - start )) s in all (load, capture, run)"
done
