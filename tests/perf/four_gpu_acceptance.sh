#!/usr/bin/env bash
# Issue 24's multi-GPU acceptance on a machine of four GPUs (the device tool's nvidia-h100-x4 or
# nvidia-h200-x4; `tests2` alone needs two). Run from the repository root after
# `source tests/perf/device_env.sh`, one part per device call (each fits the 10-minute limit):
#   bash tests/perf/four_gpu_acceptance.sh tests2  # every 2-GPU test, on GPUs 0 and 1 only
#   bash tests/perf/four_gpu_acceptance.sh tests4  # the 4-GPU tests (custom all-reduce, TP x EP)
#   bash tests/perf/four_gpu_acceptance.sh greedy  # TP=2, DP=2 x TP=2 (8B shape), EP=4 (MoE)
#   bash tests/perf/four_gpu_acceptance.sh bench   # TP=1 vs 2 (custom vs NCCL), DP=1 vs 4
#   bash tests/perf/four_gpu_acceptance.sh bench4  # DP=2 x TP=2 (8B), EP=1 vs 4 (the MoE;
#                                                  # after `greedy`, which writes it)
# Logs go to $OUT (when set) and the bench rows append to tests/perf/results.jsonl (copied to
# $OUT). NVLink multicast stays off (the machines set NCCL_NVLS_ENABLE=0; so do we).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
part=${1:?tests2, tests4, greedy, bench or bench4}
out=${OUT:-/tmp}
status=0
run() {  # run NAME CMD...: the command's output to $out/NAME.log and the terminal; keep going
    local name=$1
    shift
    echo "== $name: $*"
    "$@" 2>&1 | tee "$out/$name.log" | tail -n 25
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc"
    [ "$rc" = 0 ] || status=1
}
pytest_gpu=(python3 -m pytest -q -m gpu -p no:cacheprovider -rfs --tb=short --timeout 240)
case "$part" in
tests2)
    export CUDA_VISIBLE_DEVICES=0,1
    run tests2 "${pytest_gpu[@]}" "${@:2}" tests/test_custom_all_reduce.py tests/test_tp.py \
        tests/test_e2e_tp.py tests/test_expert_parallel.py tests/test_tp_moe.py \
        tests/test_tp_hybrid.py tests/test_e2e_tp_hybrid.py tests/test_e2e_hosts_peers.py
    ;;
tests4)
    run tests4 "${pytest_gpu[@]}" -s "${@:2}" tests/test_custom_all_reduce.py tests/test_tp_ep.py
    ;;
greedy)
    g=(python3 tests/perf/parallel_greedy.py)
    run greedy-tp2 "${g[@]}" --model random:llama-8b --tensor-parallel-size 2
    run greedy-dp2-tp2 "${g[@]}" --model random:llama-8b --data-parallel-size 2 \
        --tensor-parallel-size 2
    run greedy-ep4 "${g[@]}" --model /tmp/qwen3-30b-a3b-4l --make-qwen3-30b-a3b-4l \
        --data-parallel-size 4 --expert-parallel-size 4 --max-token-id 256
    ;;
bench)
    common=(--device cuda --dtype bfloat16 --no-hf)
    decode=(python3 -m taipan.cli bench --workload decode --model random:llama-8b --batches 1,64)
    run bench-tp1 "${decode[@]}" --ours-modes graphs "${common[@]}"
    run bench-tp2 "${decode[@]}" --tensor-parallel-size 2 --ours-modes graphs,nccl "${common[@]}"
    for d in 1 4; do
        run "bench-dp$d" python3 -m taipan.cli bench --workload offline --model random:llama-1b \
            --num-requests 1000 --data-parallel-size "$d" "${common[@]}"
    done
    cp tests/perf/results.jsonl "$out/" 2>/dev/null
    ;;
bench4)
    common=(--device cuda --dtype bfloat16 --no-hf --workload offline)
    run bench-dp2-tp2 python3 -m taipan.cli bench --model random:llama-8b --num-requests 1000 \
        --data-parallel-size 2 --tensor-parallel-size 2 "${common[@]}"
    for e in 1 4; do
        run "bench-ep$e" python3 -m taipan.cli bench --model /tmp/qwen3-30b-a3b-4l \
            --num-requests 500 --data-parallel-size "$e" --expert-parallel-size "$e" "${common[@]}"
    done
    cp tests/perf/results.jsonl "$out/" 2>/dev/null
    ;;
*)
    echo "unknown part $part (tests2, tests4, greedy, bench or bench4)" >&2
    exit 2
    ;;
esac
exit $status
