#!/usr/bin/env bash
# What the twentieth session changed after its device time was spent, for the next GPU session
# (one GPU; from the root, carry [".whl"]):
#   - the split pool's rows with the final chunk rule (chunks held to max_sequence_length // 2 -
#     W: 1,600 tokens at the bench's 4,224, three chunks for a 4,096-token prompt; the rows in
#     NOTES ran with 2,048): session19_gpu.sh split;
#   - the offline rows with their new step counts (`ours_steps`, `ours_steps_graphed_share`),
#     cuda_graph_all_prefills off and on: session20_prefill_graphs.sh;
#   - the GPU offline bench test (it runs the new counters) and the split's GPU test.
# Then, with the real model staged (carry_model.sh stage1, then carry the part2 half and .whl):
# `bash tests/perf/session19_gpu.sh one`, for tests/test_gemma3.py's head_dim-256 GPU test,
# whose window-24 layer now gets rings of 5 blocks (chunks of 32, not 24) and which last ran
# before that change (its CPU twin of the same config passes: 64 cached tokens, equal to HF).
# `two` (a machine of two GPUs): the remote-follower NCCL test, whose ports now come from
# tests/ports.py (the eighteenth session's helper) and which has not run on GPUs since.
if [ "${1:-one}" = two ]; then
    source tests/perf/device_setup.sh
    enter_new_tree || exit 1
    timeout -s ABRT 300 python3 -m pytest -q -m gpu -p no:cacheprovider -rfs \
        tests/test_e2e_hosts_peers.py 2>&1 | tail -4
    exit 0
fi
bash tests/perf/session19_gpu.sh split
bash tests/perf/session20_prefill_graphs.sh random:llama-1b "false true"
source tests/perf/device_setup.sh
enter_new_tree || exit 1
timeout -s ABRT 300 python3 -m pytest -q -m gpu -p no:cacheprovider -rfs \
    -k "offline or windowed_pool" tests/test_bench.py tests/test_local_kv.py 2>&1 | tail -4
