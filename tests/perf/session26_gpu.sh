#!/usr/bin/env bash
# The twenty-sixth session's device parts (from the root). `pytest -m gpu tests/` on one GPU
# takes about 20 minutes on a fresh machine (Triton compiles every kernel test's variants:
# tests/perf/NOTES.md, twenty-fifth session), more than a call: `suite1`..`suite3` split it.
#   changed (one GPU, the real model: `bash tests/perf/carry_model.sh stage1` with carry
#     [".carry/smollm2.gguf.part1"], then this with carry [".carry/smollm2.gguf.part2", ".whl"]):
#     the GPU tests of what the twenty-fourth and twenty-fifth sessions built and no device has
#     run: chained verify steps (test_e2e_speculative_chain.py), the real model's log-probs
#     through the launch's pinned arena (test_gpu_real_model.py), the hybrid and its verify
#     rows (test_gpu_hybrid.py, test_e2e_speculative_hybrid.py: the hybrid test's runtime was
#     still shutting down when the twenty-fifth session's 560-s call ended), the prefix cache
#     and the RL paths (routed experts, log-probs).
#   spec (one GPU, the model staged by `changed` on the same warm machine): issue 29's row,
#     SmolLM2 n-gram speculation off / on / chained (k = 4, --spec-chain 8) at batch 1, bf16.
#   rows (one GPU, after `changed` on the same warm machine): structured check / mask, the
#     1B decode rows plain and --log-probs, verify_profile on SmolLM2 (decode, verify and
#     chained inner steps at the worker, no engine), grammar_step_profile.
#   batch (one GPU, the model staged): speculation at batch 8 (SmolLM2 bf16, k = 4), then the
#     same with --spec-off-above 4 (speculative_disable_by_batch_size; not yet run on a GPU).
#   spygrammar (one GPU, the model staged): py-spy over the structured bench (64 json_schema
#     streams, check mode): the engine process's threads, where a grammar step's host time goes.
#   trace (one GPU, the model staged): Chrome traces of SmolLM2's verify (k = 4) and decode
#     steps at batch 1 (verify_profile.py, VERIFY_TRACE_DIR) and where their device waits
#     (trace_gaps.py).
#   suite1, suite2, suite3 (one GPU, the model staged): the whole one-GPU suite in three calls.
#   tp (two GPUs): session24_gpu.sh tp (TP=2 against TP=1 at batch 1, 8B shape).
# Every pytest run names each test as it starts (-v, unbuffered) and is left behind after its
# share of the call, with what its processes wait on then (procs_*.txt).
PART=${1:?part changed, spec, batch, spygrammar, trace, rows, suite1, suite2, suite3 or tp}
if [ "$PART" = tp ]; then exec bash tests/perf/session24_gpu.sh tp; fi
source tests/perf/device_setup.sh
rm -rf .carry/new  # (an ignored tree a previous call left on the warm machine is stale)
enter_new_tree model || exit 1

gpu_tests() {  # NAME SECONDS FILE...: pytest -m gpu over the files, left behind after SECONDS
    local name=$1 secs=$2
    shift 2
    python3 -u -m pytest -v -m gpu -p no:cacheprovider -rfs --tb=short \
        --continue-on-collection-errors "$@" > "$OUT/gpu_$name.log" 2>&1 &
    local pid=$!
    for _ in $(seq "$secs"); do sleep 1; kill -0 $pid 2>/dev/null || break; done
    if kill -0 $pid 2>/dev/null; then
        ps -eo pid,ppid,stat,etimes,wchan:32,args --sort=pid | grep -E "python|ptxas|STAT" \
            | cut -c1-220 > "$OUT/procs_$name.txt"
        kill -ABRT $pid
        echo "$name: left behind after $secs s"
    fi
    grep -E "^(FAILED|ERROR)|^E  |passed|failed" "$OUT/gpu_$name.log" | cut -c1-200 | tail -20
}

if [ "$PART" = changed ]; then
    gpu_tests changed 520 tests/test_e2e_speculative_chain.py tests/test_gpu_real_model.py \
        tests/test_gpu_hybrid.py tests/test_e2e_speculative_hybrid.py tests/test_gpu_prefix.py \
        tests/test_rl.py
    exit 0
fi
if [ "$PART" = spec ]; then  # (three runtimes one after the other: off, on, chained)
    timeout -s ABRT 500 python3 -m taipan.cli bench --workload spec --model smollm2 \
        --device cuda --dtype bfloat16 --spec-tokens 4 --spec-chain 8 \
        --results "$OUT/spec_chain.jsonl" 2>&1 | grep -E "^spec|rror" | cut -c1-400
    exit 0
fi
if [ "$PART" = batch ]; then  # (speculation at batch 8, with and without the batch limit)
    for extra in "" "--spec-off-above 4"; do
        # shellcheck disable=SC2086
        timeout -s ABRT 280 python3 -m taipan.cli bench --workload spec --model smollm2 \
            --device cuda --dtype bfloat16 --spec-tokens 4 --spec-batch 8 $extra \
            --results "$OUT/spec_batch8.jsonl" 2>&1 | grep -E "^spec|rror" | cut -c1-300
    done
    exit 0
fi
if [ "$PART" = spygrammar ]; then  # (where a json_schema stream's host time goes, check mode)
    timeout -s INT 200 /tmp/site/bin/py-spy record --idle --threads --subprocesses \
        --format raw -r 250 -o /tmp/spy_grammar.txt -- python3 -m taipan.cli bench \
        --workload structured --model smollm2 --device cuda --dtype bfloat16 \
        --num-prompts 64 --output-len 256 --results "$OUT/spy_grammar.jsonl" 2>&1 \
        | grep -E "^structured|rror" | cut -c1-230
    python3 tests/perf/spy_summary.py /tmp/spy_grammar.txt "taipan.procs engine" 70 \
        > "$OUT/spy_grammar.txt"
    head -40 "$OUT/spy_grammar.txt"
    gzip -c /tmp/spy_grammar.txt > "$OUT/spy_grammar.raw.gz"
    exit 0
fi
if [ "$PART" = trace ]; then  # (the verify and decode steps' timelines, SmolLM2 batch 1)
    VERIFY_TRACE_DIR=$OUT timeout -s ABRT 150 python3 tests/perf/verify_profile.py smollm2 4 1 \
        2>&1 | grep -E "batch 1:|chained"
    for t in verify_b1 decode_b1; do
        python3 tests/perf/trace_gaps.py "$OUT/$t.json" > "$OUT/gaps_$t.txt" 2>&1
        head -40 "$OUT/gaps_$t.txt"
        gzip "$OUT/$t.json"
    done
    exit 0
fi
if [ "$PART" = rows ]; then
    for mode in check mask; do structured_row "$mode" TAIPAN_GRAMMAR_MASKS=$mode; done
    decode_1b_row plain
    BENCH_EXTRA=--log-probs decode_1b_row logprobs
    timeout -s ABRT 120 python3 tests/perf/verify_profile.py smollm2 4 1 2>&1 \
        | grep -vE "^ *$|Warning" | head -40 > "$OUT/verify_smollm2.txt"
    head -8 "$OUT/verify_smollm2.txt"
    PYTHONPATH=$PWD:$PYTHONPATH timeout -s ABRT 150 python3 tests/perf/grammar_step_profile.py \
        cuda 64 40 2>&1 | grep -vE "Warning|USDT" | tee "$OUT/grammar_profile.txt" | head -12
    exit 0
fi
# The whole suite in three parts by file name (multi-GPU files skip themselves on one GPU).
files=$(ls tests/test_*.py | sort)
case "$PART" in
    suite1) part=$(echo "$files" | awk '$0 < "tests/test_gpu_hybrid.py"') ;;
    suite2) part=$(echo "$files" | awk '$0 >= "tests/test_gpu_hybrid.py" &&
        $0 < "tests/test_kernels_gated_rmsnorm.py"') ;;
    suite3) part=$(echo "$files" | awk '$0 >= "tests/test_kernels_gated_rmsnorm.py"') ;;
    *) echo "unknown part $PART" && exit 2 ;;
esac
# shellcheck disable=SC2086
gpu_tests "$PART" 540 $part
