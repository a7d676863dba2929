#!/usr/bin/env bash
# What the twenty-third session built after its device time was spent (from the root):
#   tests (one GPU, the real model: `bash tests/perf/carry_model.sh stage1` with carry
#     [".carry/smollm2.gguf.part1"], then this with carry [".carry/smollm2.gguf.part2", ".whl"]):
#     the GPU tests of what changed: the structured-output GPU test in both grammar modes (rows
#     and masks now pinned and queued), the draft model's GPU tests (its
#     eager forwards' index copies pinned and queued), and every GPU test with log-probs that
#     runs on one GPU (a step's log-probs now reach the host at collect: such steps launch
#     inline and overlap, actors/gpu/logprobs.py PendingLogProbs).
#   rows (one GPU, the model staged by `tests` on the same warm machine):
#     - tests/perf/host_sync_probe.py: which host calls wait for the stream (the unsorted top-k
#       of the checked grammar rows' candidates; a D2H copy into a row of a pinned ring, as the
#       worker's tokens take);
#     - the structured row with TAIPAN_GRAMMAR_MASKS check / mask / check / mask (issue 28's
#       bar: <= 5 %; if "mask" wins, it becomes the default);
#     - the 1B shape's decode rows at batch 1 and 64, without and with --log-probs (an RL
#       rollout's steps: they used to wait for their own forward in the launch).
#   tp (two GPUs): issue 24's TP=2 against TP=1 at batch 1 on the 8B shape, H200s (0.658x at
#     the fourteenth session; the target 0.6x), ours and NCCL-only sums in one run.
#   four (four GPUs): session22_gpu.sh four (never lent so far).
#   bisect (one GPU; carry [".carry/bisect", ".whl"], .carry/bisect/SHA.patch = `git diff HEAD
#     SHA` without results.jsonl, NOTES.md and README.md): the 1B batch-64 row at HEAD
#     and at the older trees, alternating (rows found 1.96-2.04 ms a step at HEAD, GPU idle 21 %,
#     where 81e4609 with the blocking end event gave 1.53-1.60 ms, idle 7 %).
#   logprobs (one GPU, the real model as for tests): raw log-probs of the sampled tokens
#     computed for every sequence at once into a pinned ring (rows found a log-prob step at
#     batch 1 1.79-2.01 ms against 1.04-1.35 plain, GPU idle 31-37 %: three pinned allocations
#     and two pageable index copies in each launch): the log-prob GPU tests, then the 1B decode
#     rows plain and --log-probs, twice.
#   spylp (one GPU): py-spy over the 1B decode bench at batch 1 with --log-probs, then without
#     (a log-prob step still took 1.63 ms against 1.16-1.27 plain after the ring, idle 23 %).
#   spyspec (one GPU, the real model as for tests): py-spy over the n-gram spec bench (k = 4):
#     where a verify step's ~3.55 ms go (a plain step ~1.19 ms; issue 29's 2x needs them near).
#   recspec (one GPU, the real model as for tests): the n-gram spec bench (k = 4) with every
#     actor's messages recorded (--record): each step's plan and result times at the gpu actor
#     and the engine, to lay the verify chain out step by step (tests/perf/step_timeline.py).
PART=${1:?part tests, rows, tp, bisect, logprobs, spylp, spyspec, recspec or four}
if [ "$PART" = four ]; then exec bash tests/perf/session22_gpu.sh four; fi
source tests/perf/device_setup.sh
if [ "$PART" = bisect ]; then
    patches=$PWD/.carry/bisect
    enter_new_tree || exit 1
    for sha in $(cd "$patches" && ls *.patch | sed 's/.patch$//'); do
        rm -rf "/tmp/t_$sha" && cp -r . "/tmp/t_$sha" \
            && (cd "/tmp/t_$sha" && patch -s -p1 < "$patches/$sha.patch") \
            && stage_tree "/tmp/t_$sha" "/tmp/pkg_$sha" || exit 1
    done
    row64() {  # TAG PKG TREE
        PYTHONPATH=$2:/tmp/site:$3 timeout -s ABRT 120 python3 -m taipan.cli bench \
            --workload decode --model random:llama-1b --device cuda --dtype bfloat16 \
            --batches 64 --output-len 256 --no-hf --ours-modes graphs \
            --results "$OUT/bisect_$1.jsonl" 2>&1 | grep -E "^decode|rror" | cut -c1-150 \
            | sed "s/^/$1 /"
    }
    for round in 1 2; do
        row64 "head$round" /tmp/pkg_new "$PWD"
        for sha in $(cd "$patches" && ls *.patch | sed 's/.patch$//'); do
            row64 "$sha$round" "/tmp/pkg_$sha" "/tmp/t_$sha"
        done
    done
    exit 0
fi
if [ "$PART" = spylp ]; then
    enter_new_tree || exit 1
    for tag in logprobs plain; do
        extra=""
        [ $tag = plain ] || extra=--log-probs
        # shellcheck disable=SC2086
        timeout -s INT 150 /tmp/site/bin/py-spy record --idle --threads --subprocesses \
            --format raw -r 500 -o "/tmp/spy_$tag.txt" -- python3 -m taipan.cli bench \
            --workload decode --model random:llama-1b --device cuda --dtype bfloat16 \
            --batches 1 --output-len 1024 --no-hf --ours-modes graphs $extra \
            --results "$OUT/spy_$tag.jsonl" 2>&1 | grep -E "^decode|rror" | cut -c1-170
        python3 tests/perf/spy_summary.py "/tmp/spy_$tag.txt" "taipan.procs engine" 60 \
            > "$OUT/spy_$tag.txt"
        gzip -c "/tmp/spy_$tag.txt" > "$OUT/spy_$tag.raw.gz"
    done
    exit 0
fi
if [ "$PART" = tp ]; then
    enter_new_tree || exit 1
    timeout -s ABRT 280 python3 -m taipan.cli bench --workload decode --model random:llama-8b \
        --device cuda --dtype bfloat16 --batches 1 --output-len 128 --no-hf \
        --ours-modes graphs --results "$OUT/tp1.jsonl" 2>&1 | grep -E "^decode|rror" | cut -c1-170
    timeout -s ABRT 280 python3 -m taipan.cli bench --workload decode --model random:llama-8b \
        --device cuda --dtype bfloat16 --batches 1 --output-len 128 --no-hf \
        --ours-modes graphs,nccl --tensor-parallel-size 2 --results "$OUT/tp2.jsonl" 2>&1 \
        | grep -E "^decode|rror" | cut -c1-170
    exit 0
fi
enter_new_tree model || exit 1
if [ "$PART" = recspec ]; then
    timeout -s INT 200 python3 -m taipan.cli bench --workload spec --model smollm2 \
        --device cuda --dtype bfloat16 --spec-tokens 4 --record /tmp/rec \
        --results "$OUT/rec_spec.jsonl" 2>&1 | grep -E "^spec|rror" | cut -c1-240
    tar -czf "$OUT/rec_spec.tgz" -C /tmp rec && ls -la "$OUT"
    exit 0
fi
if [ "$PART" = spyspec ]; then
    timeout -s INT 200 /tmp/site/bin/py-spy record --idle --threads --subprocesses \
        --format raw -r 250 -o /tmp/spy_spec.txt -- python3 -m taipan.cli bench \
        --workload spec --model smollm2 --device cuda --dtype bfloat16 --spec-tokens 4 \
        --results "$OUT/spy_spec.jsonl" 2>&1 | grep -E "^spec|rror" | cut -c1-240
    python3 tests/perf/spy_summary.py /tmp/spy_spec.txt "taipan.procs engine" 70 \
        > "$OUT/spy_spec.txt"
    gzip -c /tmp/spy_spec.txt > "$OUT/spy_spec.raw.gz"
    exit 0
fi
if [ "$PART" = logprobs ]; then
    timeout -s ABRT 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rfs --tb=short \
        tests/test_gpu.py tests/test_gpu_real_model.py -k "log_probs" > "$OUT/lp_tests.log" 2>&1
    grep -E "^(FAILED|ERROR)|^E  |passed|failed" "$OUT/lp_tests.log" | cut -c1-200 | tail -6
    for run in 1 2; do
        decode_1b_row "plain$run"
        BENCH_EXTRA=--log-probs decode_1b_row "logprobs$run"
    done
    exit 0
fi
if [ "$PART" = rows ]; then
    timeout -s ABRT 60 python3 tests/perf/host_sync_probe.py 2>&1 | tee "$OUT/probe.txt"
    for mode in check mask check mask; do structured_row "$mode" TAIPAN_GRAMMAR_MASKS=$mode; done
    for run in 1 2; do
        decode_1b_row "plain$run"
        BENCH_EXTRA=--log-probs decode_1b_row "logprobs$run"
    done
    exit 0
fi
for mode in check mask; do
    TAIPAN_GRAMMAR_MASKS=$mode timeout -s ABRT 120 python3 -m pytest -q -m gpu \
        -p no:cacheprovider -rfs --tb=short tests/test_structured_outputs.py \
        > "$OUT/structured_tests_$mode.log" 2>&1
    grep -E "^(FAILED|ERROR)|^E  |passed|failed" "$OUT/structured_tests_$mode.log" | tail -4
done
timeout -s ABRT 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rfs --tb=short \
    tests/test_e2e_speculative_draft.py tests/test_draft_graphs.py > "$OUT/draft_tests.log" 2>&1
grep -E "^(FAILED|ERROR)|^E  |passed|failed" "$OUT/draft_tests.log" | tail -4
timeout -s ABRT 300 python3 -m pytest -q -m gpu -p no:cacheprovider -rfs --tb=short \
    tests/test_gpu.py tests/test_gpu_real_model.py tests/test_gpu_buffers.py \
    tests/test_sampling_controls.py tests/test_e2e_dense.py tests/test_e2e_speculative.py \
    -k "not tp2" > "$OUT/logprob_tests.log" 2>&1
grep -E "^(FAILED|ERROR)|^E  |passed|failed" "$OUT/logprob_tests.log" | tail -6
