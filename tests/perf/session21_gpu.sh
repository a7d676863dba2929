#!/usr/bin/env bash
# The twenty-first session's GPU calls (tests/perf/NOTES.md, "Twenty-first session"). From the
# root, carry [".whl"] (and the model's half where a part says so).
#   (no part) one GPU: what the twentieth session changed after its device time was spent: the
#     split pool's rows with the final chunk rule (session19_gpu.sh split), the offline rows
#     with their step counts, cuda_graph_all_prefills off and on (session20_prefill_graphs.sh),
#     the GPU offline bench test and the split's GPU test. Then, with the real model staged,
#     `session19_gpu.sh one` (tests/test_gemma3.py's head_dim-256 GPU test after the chunk rule).
#   two (two GPUs): the remote-follower NCCL test (its ports from tests/ports.py).
#   defaults (one GPU; the real model staged first: carry_model.sh stage1, then carry
#     [".carry/smollm2.gguf.part2", ".whl"]): every runtime-level single-GPU test with
#     cuda_graph_all_prefills on by default (mixed graphs up to max_tokens), verbose into
#     $OUT/defaults.log.
#   multi (four GPUs): the multi-GPU runtime tests with that default (TP=2 with graphs, hybrid
#     TP=2, DP=2 x EP=2 x TP=2 on four GPUs, EP workers, the NCCL weight push), then ws.
#   ws (four GPUs): the weight sync at TP=2 (trainer cuda:0, taipan cuda:1-2, 8B shape) with
#     the weight group's NCCL stream at normal, then high priority (TAIPAN_WEIGHT_STREAM_PRIORITY;
#     WS_PRIORITIES="normal high normal high" to alternate more; WS_TP=1 on two GPUs).
PART=${1:-}
if [ "$PART" = two ]; then
    source tests/perf/device_setup.sh
    enter_new_tree || exit 1
    timeout -s ABRT 300 python3 -m pytest -q -m gpu -p no:cacheprovider -rfs \
        tests/test_e2e_hosts_peers.py 2>&1 | tail -4
    exit 0
fi
if [ "$PART" = defaults ]; then
    source tests/perf/device_setup.sh
    enter_new_tree model || exit 1
    timeout -s ABRT 560 python3 -m pytest -v -m gpu -p no:cacheprovider -rfs --tb=short \
        tests/test_gpu.py tests/test_e2e_speculative.py tests/test_e2e_speculative_draft.py \
        tests/test_e2e_qwen3_next.py tests/test_gpu_prefix.py tests/test_gpu_hybrid.py \
        tests/test_e2e_speculative_hybrid.py tests/test_gpu_real_model.py \
        tests/test_structured_outputs.py tests/test_e2e_routed_experts.py \
        tests/test_gpu_buffers.py tests/test_draft_graphs.py tests/test_local_kv.py \
        tests/test_sampling_controls.py tests/test_speculative_verify.py \
        tests/test_gpu_prefill_graphs.py tests/test_e2e_dense.py tests/test_gemma3.py \
        > "$OUT/defaults.log" 2>&1
    grep -E "PASSED|FAILED|ERROR|SKIPPED" "$OUT/defaults.log" | sed 's/ *\[ *[0-9]*%\]//' \
        | cut -c1-150
    tail -3 "$OUT/defaults.log"
    exit 0
fi
if [ "$PART" = multi ]; then
    source tests/perf/device_setup.sh
    enter_new_tree || exit 1
    IN_TREE=1
    nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c
    timeout -s ABRT 270 python3 -m pytest -v -m gpu -p no:cacheprovider -rfs --tb=short \
        tests/test_e2e_tp.py tests/test_e2e_tp_hybrid.py tests/test_tp_ep.py \
        tests/test_expert_parallel.py tests/test_rl.py > "$OUT/multi.log" 2>&1
    grep -E "PASSED|FAILED|ERROR|SKIPPED" "$OUT/multi.log" | sed 's/ *\[ *[0-9]*%\]//' \
        | cut -c1-150
    tail -3 "$OUT/multi.log"
    PART=ws  # then the weight sync, in the same call
fi
if [ "$PART" = ws ]; then
    [ -n "${IN_TREE:-}" ] || { source tests/perf/device_setup.sh; enter_new_tree || exit 1; }
    WS="-m taipan.cli bench --workload weight-sync --model random:llama-8b --dtype bfloat16"
    WS="$WS --trainer-device cuda:0 --device cuda:1 --tensor-parallel-size ${WS_TP:-2} --sync-rounds 3"
    for prio in ${WS_PRIORITIES:-normal high}; do
        echo "== TP=${WS_TP:-2} weight sync, NCCL stream priority $prio"
        TAIPAN_WEIGHT_STREAM_PRIORITY=$prio timeout -s ABRT 130 python3 $WS \
            --results "$OUT/ws_$prio.jsonl" 2>&1 | grep -E "weight-sync|rror" | tail -3
    done
    exit 0
fi
bash tests/perf/session19_gpu.sh split
bash tests/perf/session20_prefill_graphs.sh random:llama-1b "false true"
source tests/perf/device_setup.sh
enter_new_tree || exit 1
timeout -s ABRT 300 python3 -m pytest -q -m gpu -p no:cacheprovider -rfs \
    -k "offline or windowed_pool" tests/test_bench.py tests/test_local_kv.py 2>&1 | tail -4
