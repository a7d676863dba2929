#!/usr/bin/env bash
# The tenth session's device work, on nvidia-h100-x1 after `carry_model.sh stage1` (carry
# .carry/smollm2.gguf.part2, `.whl` and `.carry/new`, a `git archive` of HEAD). From the root.
#   part tests: every single-GPU test of the step path (the ninth session's last six commits
#     never ran on a GPU: lazy buffer views, plan_arrays' block tables, Verified, processed
#     log-probs and logit controls on verify rows, bias_offsets) and the structured-output GPU
#     test (greedy grammar rows now checked at collect);
#   part rows: where a verify step's time goes (tests/perf/verify_profile.py), the spec row
#     (issue 29: >= 2x at batch 1 on the grounded workload) and the structured row (issue 28:
#     cost <= 0.05).
set -u
PART=${1:?part tests or rows}
source tests/perf/device_setup.sh
install_wheels || exit 1
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
nvidia-smi --query-gpu=name --format=csv,noheader
ROOT=$PWD
stage_tree .carry/new /tmp/pkg_new || exit 1
(cd "$ROOT" && bash tests/perf/carry_model.sh stage2) || exit 1
cd .carry/new && export PYTHONPATH=/tmp/pkg_new:/tmp/site:$PWD
if [ "$PART" = tests ]; then
    timeout -s ABRT 540 python3 -m pytest -q -p no:cacheprovider -m gpu -rfs --tb=short \
        tests/test_structured_outputs.py tests/test_gpu.py tests/test_e2e_dense.py \
        tests/test_e2e_speculative.py tests/test_e2e_routed_experts.py tests/test_gpu_prefix.py \
        tests/test_gpu_hybrid.py tests/test_gpu_real_model.py tests/test_rl.py \
        tests/test_bench.py 2>&1 | grep -vE "^  File|^Extension" | tail -25
elif [ "$PART" = rows ]; then
    timeout -s ABRT 120 python3 tests/perf/verify_profile.py smollm2 4 1 8 2>&1 | tail -70
    echo "== spec k=4"
    timeout -s ABRT 200 python3 -m taipan.cli bench --workload spec --model smollm2 \
        --device cuda --dtype bfloat16 --spec-tokens 4 --results "$OUT/results.jsonl" 2>&1 \
        | grep -E "^spec|rror" | tail -3
    echo "== structured"
    timeout -s ABRT 200 python3 -m taipan.cli bench --workload structured --model smollm2 \
        --device cuda --dtype bfloat16 --num-prompts 64 --output-len 128 \
        --results "$OUT/results.jsonl" 2>&1 | tail -1
    echo "== the bench tests part tests' 540 s did not reach"
    timeout -s ABRT 150 python3 -m pytest -q -p no:cacheprovider -m gpu -rfs --tb=short \
        tests/test_bench.py::test_decode_workload_on_cuda \
        tests/test_bench.py::test_offline_workload_on_cuda 2>&1 | tail -4
fi
