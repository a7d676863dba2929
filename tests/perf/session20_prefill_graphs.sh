#!/usr/bin/env bash
# What graphs for prompt chunks are worth (`cuda_graph_all_prefills`, Megatron's field, default
# off): the offline bench on the 1B Llama shape (1,000 requests of lognormal lengths, so steps
# that mix admissions and decode rows come all the time), off then on then off, one GPU; the
# log's load lines say what capturing took. From the root, carry [".whl"].
mkdir -p .carry/new && tar --exclude=./.carry --exclude=./.whl -cf - . | tar -xf - -C .carry/new
source tests/perf/device_setup.sh
enter_new_tree || exit 1
for on in false true false; do
    start=$(date +%s.%N)
    timeout -s ABRT 170 python3 -m taipan.cli bench --workload offline --device cuda \
        --dtype bfloat16 --model random:llama-1b --num-requests 1000 --no-hf \
        --set cuda_graph_all_prefills=$on --results "$OUT/offline_$on.jsonl" 2>&1 \
        | grep -E "^offline|rror|graphs" | cut -c1-220
    echo "all_prefills=$on: $(echo "$(date +%s.%N) - $start" | bc) s in all"
done
