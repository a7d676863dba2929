#!/usr/bin/env bash
# The fourteenth session's device runs (carry .whl and .carry/new, a `git archive` of HEAD; no
# model needed). From the root. Logs go to $OUT (pytest -v: a run cut by its timeout still
# says which test it was in).
#   part kernels (one GPU): every kernel and op GPU test (the ones needing the SmolLM2 GGUF are
#     skipped at collection: use session13_verify.sh's model staging for those);
#   part spec (one GPU): speculative decoding on CUDA (hybrids, draft models, the draft's CUDA
#     graphs against its eager forwards), then `bench --workload spec` with a self:4 draft on
#     the 1B shape (the verify step's and the draft's cost against a plain step);
#   part two (two GPUs): the elementwise GPU test, the custom all-reduce test, the 8B decode
#     rows at batch 1, TP=1 and TP=2 with TAIPAN_TP_GEMV_SUM 1 and 0;
#   part dense (one GPU): the Gemma 3 1B and Qwen2.5-7B decode rows at batch 1 (issue 27);
#   part model (one GPU, the real model: call `bash tests/perf/carry_model.sh stage1` with
#     carry [".carry/smollm2.gguf.part1"] first, then this with carry
#     [".carry/smollm2.gguf.part2", ".whl", ".carry/new"] within ~30 s): the GPU tests that
#     need SmolLM2 (test_gpu.py, the real-model and speculative ones), then the issue 29 bar,
#     `bench --workload spec` with n-gram drafts on SmolLM2 at batch 1 (grounded and free).
set -u
PART=${1:?part kernels, spec, two, dense or model}
source tests/perf/device_setup.sh
if [ "$PART" = model ]; then enter_new_tree model || exit 1; else enter_new_tree || exit 1; fi
PYTEST="python3 -m pytest -v -p no:cacheprovider -m gpu --tb=short --durations=15"
show() { grep -E "PASSED|FAILED|ERROR|^E  |passed|failed|^\S+ (decode|spec)|o_proj at TP|KiB" "$1" \
    | grep -v Retry | cut -c1-220 | tail -"${2:-40}"; }
DEC="bench --workload decode --device cuda --dtype bfloat16 --output-len 128 --no-hf
--ours-modes graphs --batches 1"
if [ "$PART" = kernels ]; then
    timeout -s ABRT 560 $PYTEST --continue-on-collection-errors tests/test_kernels_*.py \
        tests/test_ops_*.py > "$OUT/kernels.log" 2>&1
    show "$OUT/kernels.log"
elif [ "$PART" = spec ]; then
    timeout -s ABRT 240 $PYTEST tests/test_draft_graphs.py tests/test_e2e_speculative_draft.py \
        tests/test_e2e_speculative_hybrid.py > "$OUT/spec.log" 2>&1
    show "$OUT/spec.log" 12
    timeout -s ABRT 150 python3 -m taipan.cli bench --workload spec --device cuda \
        --dtype bfloat16 --model random:llama-1b --spec-draft self:4 --spec-tokens 4 \
        --num-prompts 4 --output-len 64 --results "$OUT/spec_self4.jsonl" 2>&1 \
        | grep -E "^spec|rror" | cut -c1-250
elif [ "$PART" = two ]; then
    timeout -s ABRT 60 $PYTEST tests/test_kernels_elementwise.py > "$OUT/el.log" 2>&1
    show "$OUT/el.log" 3
    timeout -s ABRT 110 $PYTEST -s tests/test_custom_all_reduce.py > "$OUT/ar.log" 2>&1
    show "$OUT/ar.log" 12
    timeout -s ABRT 80 python3 -m taipan.cli $DEC --model random:llama-8b \
        --results "$OUT/tp1.jsonl" 2>&1 | grep -E "^decode|rror" | cut -c1-160 | sed "s/^/TP=1 /"
    for s in 1 0; do
        TAIPAN_TP_GEMV_SUM=$s timeout -s ABRT 80 python3 -m taipan.cli $DEC \
            --model random:llama-8b --tensor-parallel-size 2 --results "$OUT/tp2_sum$s.jsonl" \
            2>&1 | grep -E "^decode|rror" | cut -c1-160 | sed "s/^/TP=2 sum=$s /"
    done
elif [ "$PART" = model ]; then
    timeout -s ABRT 330 $PYTEST tests/test_gpu.py tests/test_gpu_real_model.py \
        tests/test_ops_llama.py tests/test_ops_logprobs.py tests/test_ops_tokenizer.py \
        tests/test_e2e_speculative.py > "$OUT/model.log" 2>&1
    show "$OUT/model.log" 20
    timeout -s ABRT 200 python3 -m taipan.cli bench --workload spec --device cuda \
        --dtype bfloat16 --model smollm2 --spec-tokens 4 --results "$OUT/spec_ngram.jsonl" \
        2>&1 | grep -E "^spec|rror" | cut -c1-250
elif [ "$PART" = dense ]; then
    for shape in gemma3-1b qwen2.5-7b; do
        timeout -s ABRT 100 python3 -m taipan.cli $DEC --model random:$shape \
            --results "$OUT/decode_$shape.jsonl" 2>&1 | grep -E "^decode|rror" | cut -c1-200
    done
fi
