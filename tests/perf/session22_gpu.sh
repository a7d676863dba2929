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
#   blocks (one GPU): the graphed batch-1 step of the Gemma 3 12B, Qwen2.5-7B, Llama 8B and 1B
#     shapes under the GEMV block policies, the twenty-second session's new ones among them
#     (tests/perf/fused_decode_bench.py blocks; issue 27's 12B row sits at 1.31x its floor).
#   gemv (one GPU): after the new GEMV blocks (kernels/gemv.py `_blocks`): the GEMV, fused
#     decode, PDL and dense end-to-end GPU tests, then issue 27's batch-1 decode rows (Gemma 3
#     12B twice, Qwen2.5-7B) and the 1B shape's (issue 24).
#   final (one GPU): the attention-sink kernels' GPU test (tests/test_kernels_attention_sinks.py:
#     bf16 and fp32, head dims 64, 80, 128, 256, windows), then where the host goes at batch 64
#     on the 1B shape (issue 24's GPU idle share, 12-27 % there): py-spy over every process of
#     `taipan bench --workload decode --batches 64` (graphs), summarized on the device
#     (tests/perf/spy_summary.py: the engine process, whose threads hold the gpu actor, and all).
#   mtp (one GPU): the MTP head's passes recorded in CUDA graphs (actors/gpu/mtp.py): the
#     worker's and the runtime's MTP GPU tests, the draft model's graphs and one prompt-chunk
#     graph test (StepGraphs' capture changed), then the spec bench with --spec-method mtp as
#     in part one (plain 1.39 ms a step, the eager head 8.2 ms there).
PART=${1:?part one, four, blocks, gemv, final or mtp}
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
if [ "$PART" = blocks ]; then
    BLOCK_ROWS=1 timeout -s ABRT 540 python3 tests/perf/fused_decode_bench.py blocks ${SHAPES:-gemma3-12b \
        qwen2.5-7b llama-8b llama-1b} 2>&1 | tee "$OUT/blocks.jsonl" | grep -v "^{\"part" | tail -5
    python3 -c "
import json
for line in open('$OUT/blocks.jsonl'):
    r = json.loads(line)
    if r.get('part') != 'blocks':
        continue
    base = r['default']
    best = sorted((v, k) for k, v in r.items() if isinstance(v, float) and k not in ('floor_ms',))
    print(r['shape'], 'floor', round(r['floor_ms'], 3), 'default', base,
          ' '.join(f'{k}={v / base:.3f}' for v, k in best[:6]))"
fi
if [ "$PART" = gemv ]; then
    timeout -s ABRT 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_gemv.py \
        tests/test_ops_fused_decode.py tests/test_kernels_pdl.py tests/test_e2e_dense.py \
        -k "not tp2" 2>&1 | tail -2
    for shape in gemma3-12b qwen2.5-7b gemma3-12b llama-1b; do
        timeout -s ABRT 150 python3 -m taipan.cli bench --workload decode --device cuda \
            --dtype bfloat16 --output-len 128 --no-hf --batches 1 --model random:$shape \
            --results "$OUT/decode_$shape.jsonl" 2>&1 | grep -E "^decode|rror" | cut -c1-150 \
            | sed "s/^/$shape /"
    done
fi
if [ "$PART" = final ]; then
    timeout -s ABRT 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rfs \
        tests/test_kernels_attention_sinks.py 2>&1 | tail -2
    timeout -s INT 200 /tmp/site/bin/py-spy record --idle --threads --subprocesses --format raw \
        -r 200 -o /tmp/spy_b64.txt -- python3 -m taipan.cli bench --workload decode \
        --model random:llama-1b --device cuda --dtype bfloat16 --batches 64 --output-len 2400 \
        --no-hf --ours-modes graphs --results "$OUT/spy_b64.jsonl" 2>&1 \
        | grep -E "^decode|rror|Samples" | cut -c1-200
    python3 tests/perf/spy_summary.py /tmp/spy_b64.txt "taipan.procs engine" 30 \
        > "$OUT/spy_engine.txt"
    python3 tests/perf/spy_summary.py /tmp/spy_b64.txt "" 30 > "$OUT/spy_all.txt"
    gzip -c /tmp/spy_b64.txt > "$OUT/spy_b64.txt.gz"
    head -c 4000 "$OUT/spy_engine.txt"; [ -s "$OUT/spy_engine.txt" ] || head -c 4000 "$OUT/spy_all.txt"
fi
if [ "$PART" = mtp ]; then
    timeout -s ABRT 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rfs \
        tests/test_qwen3_next_mtp.py tests/test_e2e_mtp.py tests/test_draft_graphs.py 2>&1 | tail -3
    timeout -s ABRT 100 python3 -m pytest -q -m gpu -p no:cacheprovider -rfs \
        tests/test_gpu_prefill_graphs.py -k "qwen3_next-8" 2>&1 | tail -1
    python3 -c "
from tests.random_qwen3_next import add_mtp_head, make_random_qwen3_next
from tests.test_e2e_qwen3_next import GPU_SHAPE
add_mtp_head(make_random_qwen3_next('/tmp/q3n_mtp', 'moe', shape=GPU_SHAPE))" >/dev/null || exit 1
    timeout -s ABRT 150 python3 -m taipan.cli bench --workload spec --model /tmp/q3n_mtp \
        --device cuda --dtype bfloat16 --spec-method mtp --spec-tokens 3 \
        --results "$OUT/spec_mtp.jsonl" 2>&1 | grep -E "^spec|rror" | cut -c1-240
fi
