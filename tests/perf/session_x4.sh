#!/usr/bin/env bash
# One four-GPU device call (run from the repo root with `.whl` carried): the four-GPU tests
# (`four_gpu_acceptance.sh tests4`: the custom all-reduce at T = 4 and DP=2 x EP=2 x TP=2) and
# EP=4 greedy on the Qwen3-30B-A3B-shaped MoE, with log-probs so a differing output can be told a
# near tie. Logs go to $OUT.
set -u
source tests/perf/device_env.sh || exit 1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONFAULTHANDLER=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout -s ABRT 280 bash tests/perf/four_gpu_acceptance.sh tests4
echo "== greedy EP=4"
timeout -s ABRT 280 python3 tests/perf/parallel_greedy.py --model /tmp/qwen3-30b-a3b-4l \
    --make-qwen3-30b-a3b-4l --data-parallel-size 4 --expert-parallel-size 4 --max-token-id 256 \
    > "$OUT/greedy-ep4.log" 2>&1
echo "greedy-ep4 exit $?"
tail -5 "$OUT/greedy-ep4.log"
