#!/usr/bin/env bash
# After a3ef: GPU processes pinned by default (runtime/placement.py gpu_process_cpu_sets). On a
# two-GPU machine: the 1B shape's decode (batch 1 and 64) with the default (pinned) and with
# TAIPAN_GPU_PROCESS_CORES=0 (as before), N rounds (default 3) in turn, rows to $OUT/pin2.jsonl
# with `variant`; then the tensor-parallel GPU tests (pinned peers). `.whl`, `.carry/new`.
set -u
N=${1:-3}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/*.whl 2>/dev/null || exit 1
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -c "from tests.lint_imports import stage; from pathlib import Path; \
stage(Path('.carry/new'), Path('/tmp/pkg_new'))" || exit 1
cd .carry/new && export PYTHONPATH=/tmp/pkg_new:/tmp/site:$PWD
run() {  # variant cores
    TAIPAN_GPU_PROCESS_CORES=$2 CUDA_VISIBLE_DEVICES=0 timeout -s ABRT 120 python3 -m taipan.cli \
        bench --workload decode --model random:llama-1b --device cuda --dtype bfloat16 \
        --batches 1,64 --output-len 256 --no-hf --ours-modes graphs \
        --results /tmp/pin_one.jsonl > /tmp/pin_one.log 2>&1 || { tail -3 /tmp/pin_one.log; }
    python3 tests/perf/keep_rows.py /tmp/pin_one.jsonl "$OUT/pin2.jsonl" 2 "$1" variant="$1" \
        command=tests/perf/session8_pin2.sh
}
for i in $(seq "$N"); do run pinned 2; run off 0; done
echo "== tensor-parallel GPU tests"
timeout -s ABRT 240 python3 -m pytest -q -p no:cacheprovider -m gpu -rfs --tb=short \
    tests/test_e2e_tp.py 2>&1 | grep -vE "^  File" | tail -6
