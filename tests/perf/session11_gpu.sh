#!/usr/bin/env bash
# The eleventh session's device work, on nvidia-h100-x1 after `carry_model.sh stage1` (carry
# .carry/smollm2.gguf.part2, `.whl` and `.carry/new`, a `git archive` of HEAD). From the root.
#   part verify: the tenth session's commits after e41c38b never ran on a GPU (speculation with
#     grammars, candidates for rejected greedy tokens, the padding guard, the candidates' copy
#     queued before the step's end event): the GPU tests of the step path they touch, then the
#     spec row (issue 29) and the structured row (issue 28) on the real model.
set -u
PART=${1:?part verify}
source tests/perf/device_setup.sh
start_device model || exit 1
export PYTHONFAULTHANDLER=1
stage_tree .carry/new /tmp/pkg_new || exit 1
cd .carry/new && export PYTHONPATH=/tmp/pkg_new:/tmp/site:$PWD
if [ "$PART" = verify ]; then
    timeout -s ABRT 330 python3 -m pytest -q -p no:cacheprovider -m gpu -rfs --tb=short \
        tests/test_structured_outputs.py tests/test_e2e_speculative.py \
        tests/test_gpu_real_model.py tests/test_gpu.py 2>&1 | grep -vE "^  File|^Extension" | tail -25
    echo "== spec k=4"
    timeout -s ABRT 150 python3 -m taipan.cli bench --workload spec --model smollm2 \
        --device cuda --dtype bfloat16 --spec-tokens 4 --results "$OUT/results.jsonl" 2>&1 \
        | grep -E "^spec|rror" | tail -3
    echo "== structured"
    timeout -s ABRT 100 python3 -m taipan.cli bench --workload structured --model smollm2 \
        --device cuda --dtype bfloat16 --num-prompts 64 --output-len 128 \
        --results "$OUT/results.jsonl" 2>&1 | tail -1
fi
