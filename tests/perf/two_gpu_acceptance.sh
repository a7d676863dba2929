#!/usr/bin/env bash
# Issue 12's two-GPU acceptance, for a machine of two GPUs (the device tool's nvidia-h200-x2 or
# nvidia-h100-x2). Run from the repository root after `source tests/perf/device_env.sh`, one
# part per device call (each fits the 10-minute limit):
#   bash tests/perf/two_gpu_acceptance.sh tests    # every 2-GPU test (NCCL, CUDA graphs)
#   bash tests/perf/two_gpu_acceptance.sh greedy   # TP=2 on the 8B shape, DP=2 on the 1B shape
#   bash tests/perf/two_gpu_acceptance.sh bench    # bench rows: TP=1 vs 2, DP=1 vs 2
# The bench rows append to tests/perf/results.jsonl (copy it to $OUT to bring them back).
set -uo pipefail
part=${1:?tests, greedy or bench}
case "$part" in
tests)
    python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_tp.py tests/test_e2e_tp.py \
        tests/test_expert_parallel.py tests/test_tp_moe.py tests/test_tp_hybrid.py \
        tests/test_e2e_tp_hybrid.py tests/test_e2e_hosts_peers.py
    ;;
greedy)
    python3 tests/perf/parallel_greedy.py --model random:llama-8b --tensor-parallel-size 2
    python3 tests/perf/parallel_greedy.py --model random:llama-1b --data-parallel-size 2
    ;;
bench)
    common=(--device cuda --dtype bfloat16 --no-hf)
    for t in 1 2; do
        python3 -m taipan.cli bench --workload decode --model random:llama-8b --batches 1,64 \
            --tensor-parallel-size "$t" "${common[@]}"
    done
    for d in 1 2; do
        python3 -m taipan.cli bench --workload offline --model random:llama-1b \
            --num-requests 1000 --data-parallel-size "$d" "${common[@]}"
    done
    ;;
*)
    echo "unknown part $part (tests, greedy or bench)" >&2
    exit 2
    ;;
esac
