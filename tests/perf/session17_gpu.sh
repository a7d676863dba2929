#!/usr/bin/env bash
# The seventeenth session's GPU checks (one GPU; carry [".whl", ".carry/new"]; from the root).
#   part gemma: issue 27's Gemma 3 decode rows at batch 1 (bf16, graphs, no HF) for the 1B, 4B
#     and 12B shapes, with the Qwen2.5-7B row in the same call for reference; rows to $OUT.
set -u
#   part kernels: where the 12B and Qwen2.5-7B steps go (the torch profiler over one eager
#     batch-1 step, Llama-8B beside them), and the GEMV per projection shape with a block sweep.
#   part blocks: the GEMV block choice (kernels/gemv.py `_blocks`) on the GPU: the gemv, fused
#     decode, PDL and dense GPU tests, then the batch-1 decode rows of five shapes;
#   part model (SmolLM2 staged: `bash tests/perf/carry_model.sh stage1` with carry
#     [".carry/smollm2.gguf.part1"], then this within ~30 s with carry
#     [".carry/smollm2.gguf.part2", ".whl", ".carry/new"]): test_gemma3.py's head_dim-256 CUDA
#     graph test and test_gpu.py, which need the model file at collection.
PART=${1:?part gemma, kernels, blocks or model}
source tests/perf/device_setup.sh
if [ "$PART" = model ]; then enter_new_tree model || exit 1; else enter_new_tree || exit 1; fi
DEC="bench --workload decode --device cuda --dtype bfloat16 --output-len 128 --no-hf
--ours-modes graphs --batches 1"
if [ "$PART" = gemma ]; then
    for shape in gemma3-1b gemma3-4b gemma3-12b qwen2.5-7b; do
        timeout -s ABRT 150 python3 -m taipan.cli $DEC --model random:$shape \
            --results "$OUT/decode_$shape.jsonl" 2>&1 | grep -E "^decode|rror" | cut -c1-220
    done
fi
if [ "$PART" = kernels ]; then
    timeout -s ABRT 200 python3 tests/perf/fused_decode_bench.py profile gemma3-12b qwen2.5-7b \
        llama-8b 2>&1 | grep -v Warn | head -80
    timeout -s ABRT 300 python3 tests/perf/fused_decode_bench.py kernels 12b q7b 8b \
        > "$OUT/kernels.jsonl" 2>&1
    python3 -c "
import json
for l in open('$OUT/kernels.jsonl'):
    if l.startswith('{'):
        r = json.loads(l)
        if 'shape' in r:
            print(r['shape'], r['rows'], 'floor %.1f cublas %.1f gemv %.1f best %.1f' % (
                r['floor_us'], r['cublas_us'], r['gemv_us'], r['best_us']), r['default_blocks'], r['best_blocks'])
        else:
            print(r)
"
fi
if [ "$PART" = blocks ]; then
    timeout -s ABRT 240 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short \
        tests/test_kernels_gemv.py tests/test_ops_fused_decode.py tests/test_kernels_pdl.py \
        tests/test_e2e_dense.py tests/test_gpu_buffers.py > "$OUT/blocks_tests.log" 2>&1
    grep -E "FAILED|ERROR|^E  |passed|failed" "$OUT/blocks_tests.log" | cut -c1-200 | tail -12
    for shape in gemma3-1b gemma3-12b qwen2.5-7b llama-1b llama-8b; do
        timeout -s ABRT 100 python3 -m taipan.cli $DEC --model random:$shape \
            --results "$OUT/decode_$shape.jsonl" 2>&1 | grep -E "^decode|rror" | cut -c1-150 \
            | sed "s/^/$shape /"
    done
fi
if [ "$PART" = model ]; then
    timeout -s ABRT 330 python3 -m pytest -v -p no:cacheprovider -m gpu --tb=short \
        tests/test_gemma3.py tests/test_gpu.py > "$OUT/model.log" 2>&1
    grep -E "PASSED|FAILED|SKIPPED|^ERROR|passed|failed" "$OUT/model.log" | cut -c1-160 | tail -20
fi
