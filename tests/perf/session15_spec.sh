#!/usr/bin/env bash
# The fifteenth session's look at speculative decoding on a GPU (issue 29's >= 2x bar on the real
# model): where a verify step's time goes. One GPU, the real model (call `bash
# tests/perf/carry_model.sh stage1` with carry [".carry/smollm2.gguf.part1"] first, then this
# with carry [".carry/smollm2.gguf.part2", ".whl", ".carry/new"] within ~30 s). From the root.
#   part profile: tests/perf/verify_profile.py on SmolLM2 (the worker alone: a decode step and
#     a verify step of k = 4 at batch 1 and 4, and the verify step's host calls and kernels),
#     then the spec bench under py-spy (--idle, every process, summarized by
#     tests/perf/spy_summary.py into $OUT/spy_summary.txt, the raw stacks gzipped beside it);
#   part bench: the spec bench alone (k = 6 and 8), rows to $OUT;
#   part draft (no model): the draft-model GPU tests (a draft's update reaching its graphs);
#   part ab: verify steps as decode rows (each token a one-token row, the decode graph
#     replayed) and collected in their launch's thread hop, against the tree before
#     (`.carry/old.patch` turns a copy of .carry/new into it) and against
#     TAIPAN_VERIFY_AS_DECODE=0, the spec bench (k = 4) of each in turn, then the speculative
#     GPU tests on the new tree. Run at commit 892e7c0 (NOTES.md, fifteenth session); the
#     decode rows gained nothing there and were taken out again (the variable is gone).
set -u
PART=${1:?part profile, bench, ab or draft}
source tests/perf/device_setup.sh
if [ "$PART" = draft ]; then enter_new_tree || exit 1; else enter_new_tree model || exit 1; fi
SPEC="bench --workload spec --device cuda --dtype bfloat16 --model smollm2"
if [ "$PART" = profile ]; then
    [ -n "${SKIP_WORKER:-}" ] || timeout -s ABRT 120 python3 tests/perf/verify_profile.py smollm2 4 1 4 2>&1 | cut -c1-200
    timeout -s INT 200 /tmp/site/bin/py-spy record --idle --threads --subprocesses --format raw \
        -r 400 -o /tmp/spy_spec.txt -- python3 -m taipan.cli $SPEC --spec-tokens 4 \
        --results "$OUT/spy_spec.jsonl" 2>&1 | grep -E "^spec|rror|Samples" | cut -c1-250
    python3 tests/perf/spy_summary.py /tmp/spy_spec.txt > "$OUT/spy_summary.txt"
    gzip -c /tmp/spy_spec.txt > "$OUT/spy_spec.txt.gz"
elif [ "$PART" = ab ]; then
    (cd "$OLDPWD" && old_tree && stage_tree /tmp/old /tmp/pkg_old) || exit 1
    for t in old new0 new old new; do
        pkg=/tmp/pkg_new; [ $t = old ] && pkg=/tmp/pkg_old
        v=""; [ $t = new0 ] && v=0
        TAIPAN_VERIFY_AS_DECODE=$v PYTHONPATH=$pkg:/tmp/site:$PWD timeout -s ABRT 120 \
            python3 -m taipan.cli $SPEC --spec-tokens 4 --results "$OUT/ab_$t.jsonl" 2>&1 \
            | grep -E "^spec|rror" | cut -c1-250 | sed "s/^/$t /"
    done
    timeout -s ABRT 200 python3 -m pytest -v -p no:cacheprovider -m gpu --tb=short \
        tests/test_e2e_speculative.py tests/test_e2e_speculative_draft.py > "$OUT/spec.log" 2>&1
    grep -E "PASSED|FAILED|ERROR|^E  |passed|failed" "$OUT/spec.log" | cut -c1-200 | tail -12
elif [ "$PART" = draft ]; then
    timeout -s ABRT 300 python3 -m pytest -v -p no:cacheprovider -m gpu --tb=short \
        tests/test_e2e_speculative_draft.py > "$OUT/draft.log" 2>&1
    grep -E "PASSED|FAILED|ERROR|^E  |passed|failed" "$OUT/draft.log" | cut -c1-200 | tail -12
elif [ "$PART" = bench ]; then
    for k in 6 8; do
        timeout -s ABRT 200 python3 -m taipan.cli $SPEC --spec-tokens $k \
            --results "$OUT/spec_k$k.jsonl" 2>&1 | grep -E "^spec|rror" | cut -c1-250
    done
fi
