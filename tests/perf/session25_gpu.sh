#!/usr/bin/env bash
# What the twenty-fourth session built after its device time was spent (from the root):
#   all (one GPU, the real model: `bash tests/perf/carry_model.sh stage1` with carry
#     [".carry/smollm2.gguf.part1"], then this with carry [".carry/smollm2.gguf.part2", ".whl"]):
#     every GPU test that runs on one GPU (the multi-GPU ones skip themselves): launch-time
#     host arrays now go through a per-launch pinned arena (actors/gpu/host_staging.py: the
#     penalties', biases', grammar rows' and masks', verify and draft indexes'), a decode
#     step's routed experts through a pinned ring (test_e2e_routed_experts.py's GPU test), and
#     tests/test_host_staging.py's GPU test (staged copies queued behind a busy stream).
#   rows (one GPU, the model staged by `all` on the same warm machine): the structured row
#     check / mask / check / mask (issue 28: the grammar steps' arrays no longer pinned one by
#     one), the 1B decode rows plain and --log-probs twice, the n-gram spec row (k = 4), and
#     tests/perf/verify_profile.py on SmolLM2 and the 8B shape (issue 29: what a verify step
#     costs against a decode step where the step is host-bound and where it is device-bound),
#     and tests/perf/grammar_step_profile.py (issue 28: a json_schema step's device span against
#     a plain one's, serial and overlapped, and the profiler over grammar steps).
#   tp (two GPUs): session24_gpu.sh tp (issue 24's TP=2 against TP=1 at batch 1, 8B shape).
PART=${1:?part all, rows or tp}
if [ "$PART" = tp ]; then exec bash tests/perf/session24_gpu.sh tp; fi
source tests/perf/device_setup.sh
rm -rf .carry/new  # an ignored tree a previous call left on the warm machine is stale
enter_new_tree $([ "$PART" = verbose ] || echo model) || exit 1  # verbose: a fresh machine
if [ "$PART" = verbose ]; then  # `rest` hung where no signal reached it: each test named as it
    # starts, the run left behind after $SECS s, and what its processes wait on then
    python3 -u -m pytest -v -m gpu -p no:cacheprovider -rfs --tb=short \
        --continue-on-collection-errors \
        $(ls tests/test_*.py | sort | awk '$0 > "tests/test_gpu_hybrid.py"') \
        tests/test_gpu_hybrid.py > "$OUT/gpu_verbose.log" 2>&1 &
    pid=$!
    for _ in $(seq "${SECS:-360}"); do sleep 1; kill -0 $pid 2>/dev/null || break; done
    ps -eo pid,ppid,stat,etimes,wchan:32,args --sort=pid | grep -E "python|STAT" \
        | cut -c1-220 > "$OUT/procs.txt"
    nvidia-smi >> "$OUT/procs.txt" 2>&1
    kill -ABRT $pid 2>/dev/null
    grep -E "PASSED|FAILED|ERROR|SKIPPED" "$OUT/gpu_verbose.log" | tail -3
    grep -E "^(FAILED|ERROR)|^E  |passed|failed" "$OUT/gpu_verbose.log" | cut -c1-200 | tail -20
    exit 0
fi
if [ "$PART" = rest ]; then  # what `all` did not reach in 560 s: the files after test_gpu_hybrid
    # (files in order; multi-GPU ones skip), then the hybrid test with tracebacks at 60 s
    timeout -s ABRT 330 python3 -m pytest -q -m gpu -p no:cacheprovider -rfs --tb=short \
        --durations=12 -o faulthandler_timeout=90 --continue-on-collection-errors $(ls tests/test_*.py | sort \
        | awk '$0 > "tests/test_gpu_hybrid.py"') > "$OUT/gpu_rest.log" 2>&1
    grep -E "^(FAILED|ERROR)|^E  |passed|failed|s call" "$OUT/gpu_rest.log" | cut -c1-200 | tail -30
    timeout -s ABRT 140 python3 -m pytest -q -m gpu -p no:cacheprovider -rfs --tb=short -x \
        --durations=5 -o faulthandler_timeout=60 tests/test_gpu_hybrid.py \
        > "$OUT/gpu_hybrid.log" 2>&1
    grep -E "^(FAILED|ERROR)|^E  |passed|failed|s call" "$OUT/gpu_hybrid.log" | cut -c1-200 | tail -12
    exit 0
fi
if [ "$PART" = all ]; then
    timeout -s ABRT 560 python3 -m pytest -q -m gpu -p no:cacheprovider -rfs --tb=short --continue-on-collection-errors \
        tests/ > "$OUT/gpu_tests.log" 2>&1
    grep -E "^(FAILED|ERROR)|^E  |passed|failed" "$OUT/gpu_tests.log" | cut -c1-220 | tail -20
    exit 0
fi
for mode in check mask check mask; do structured_row "$mode" TAIPAN_GRAMMAR_MASKS=$mode; done
for run in 1 2; do
    decode_1b_row "plain$run"
    BENCH_EXTRA=--log-probs decode_1b_row "logprobs$run"
done
timeout -s ABRT 150 python3 -m taipan.cli bench --workload spec --model smollm2 --device cuda \
    --dtype bfloat16 --spec-tokens 4 --results "$OUT/spec_ngram.jsonl" 2>&1 \
    | grep -E "^spec|rror" | cut -c1-240
for model in smollm2 random:llama-8b; do
    timeout -s ABRT 150 python3 tests/perf/verify_profile.py "$model" 4 1 2>&1 \
        | grep -vE "^ *$|Warning" | head -40 > "$OUT/verify_${model#random:}.txt"
    head -8 "$OUT/verify_${model#random:}.txt"
done
PYTHONPATH=$PWD:$PYTHONPATH timeout -s ABRT 200 python3 tests/perf/grammar_step_profile.py cuda 64 40 \
    2>&1 | grep -vE "Warning|USDT" | tee "$OUT/grammar_profile.txt" | head -12
