#!/usr/bin/env bash
# What the twenty-first session built or changed after its device time was spent (from the
# root, carry [".whl"]):
#   one (one GPU): the MTP head's GPU test (tests/test_e2e_mtp.py: mixed graphs that keep the
#     hidden states, the head's passes eager), the spec bench with --spec-method mtp on a random
#     Qwen3-Next of the GPU test's shape with a random head (acceptance ~0: the row shows what
#     the head's passes cost per step against plain decoding), then the split pool's rows again
#     now that prompt chunks replay CUDA graphs by default (session19_gpu.sh split).
#   four (four GPUs): the GPU tests not yet run with cuda_graph_all_prefills on by default: the
#     DP=2 x EP=2 x TP=2 runtime (tests/test_tp_ep.py) and the dense families at TP=2
#     (tests/test_e2e_dense.py -k tp2).
PART=${1:?part one or four}
source tests/perf/device_setup.sh
enter_new_tree || exit 1
if [ "$PART" = one ]; then
    timeout -s ABRT 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rfs \
        tests/test_e2e_mtp.py 2>&1 | tail -4
    python3 -c "
from tests.random_qwen3_next import add_mtp_head, make_random_qwen3_next
from tests.test_e2e_qwen3_next import GPU_SHAPE
add_mtp_head(make_random_qwen3_next('/tmp/q3n_mtp', 'moe', shape=GPU_SHAPE))" || exit 1
    timeout -s ABRT 240 python3 -m taipan.cli bench --workload spec --model /tmp/q3n_mtp \
        --device cuda --dtype bfloat16 --spec-method mtp --spec-tokens 3 \
        --results "$OUT/spec_mtp.jsonl" 2>&1 | grep -E "^spec|rror" | cut -c1-240
    cd - >/dev/null && bash tests/perf/session19_gpu.sh split
fi
if [ "$PART" = four ]; then
    nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c
    timeout -s ABRT 500 python3 -m pytest -q -m gpu -p no:cacheprovider -rfs \
        tests/test_tp_ep.py tests/test_e2e_dense.py -k "tp2 or dp2" 2>&1 | tail -6
fi
