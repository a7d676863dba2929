#!/usr/bin/env bash
# The twenty-eighth session's device parts (from the root; each after
# `bash tests/perf/carry_model.sh stage1` with carry [".carry/smollm2.gguf.part1"] on a fresh
# machine, then with carry [".carry/smollm2.gguf.part2", ".whl"]; a later call on the same warm
# machine needs only ".whl").
#   gil: which functions hold the engine process's GIL in a structured step: py-spy --gil over
#     tests/perf/structured_modes.py, whole json_schema requests alone (ROUNDS, 12, rounds),
#     then whole unconstrained ones alone (summaries spy_<mode>.txt).
#   ab: the structured row of the tree before (.carry/old.patch, carried, turns this tree into
#     it) and of this one, alternating, ROUNDS (2) times each.
#   wrap: the grammar check's host cost alone (grammar_advance_bench.py), then wall time per
#     function (tests/perf/prof_hooks) in the engine process, whole json_schema requests alone,
#     then whole unconstrained ones (ROUNDS, 4, rounds each).
#   timeline: the four structured modes (streamed and whole, unconstrained and json_schema) in
#     one recorded runtime, ROUNDS (3) rounds (each: every mode untimed, then timed, in order),
#     laid out by tests/perf/step_timeline.py (a segment per mode and round).
#   final: the structured GPU tests, the "check" row, temperature-1 rows in "check" and "mask"
#     (checked draws against masked ones), and `wrap` of whole json_schema requests.
#   grammar: the structured GPU tests, then SmolLM2's structured rows in "check" and "wait".
#   rows: the structured rows in "check" (twice), the 1B decode rows.
PART=${1:?part ab, gil, wrap, timeline, final, grammar or rows}
source tests/perf/device_setup.sh
rm -rf .carry/new  # (an ignored tree a previous call left on the warm machine is stale)
if [ "$PART" = ab ]; then  # (.carry/old.patch carried: the tree before, from this one)
    copy_new_tree && start_device model && stage_old_and_new || exit 1
    alternate_old_new structured_row
    exit 0
fi
enter_new_tree model || exit 1

if [ "$PART" = gil ]; then
    for mode in json_schema_whole unconstrained_whole; do
        timeout -s INT 200 /tmp/site/bin/py-spy record --gil --threads --subprocesses \
            --format raw -r 1000 -o /tmp/spy_$mode.txt -- python3 \
            tests/perf/structured_modes.py $mode "${ROUNDS:-12}" 2>&1 \
            | grep -E "^round|rror" | tail -4
        python3 tests/perf/spy_summary.py /tmp/spy_$mode.txt "taipan.procs engine" 70 \
            > "$OUT/spy_$mode.txt"
        gzip -c /tmp/spy_$mode.txt > "$OUT/spy_$mode.raw.gz"
    done
    exit 0
fi
if [ "$PART" = wrap ]; then  # (PROF_WRAP: the functions; default the prof_hooks list)
    python3 tests/perf/grammar_advance_bench.py 2>&1 | tee "$OUT/advance.txt"
    for mode in json_schema_whole unconstrained_whole; do
        mkdir -p "$OUT/wrap_$mode"
        PROF_WRAP_OUT="$OUT/wrap_$mode" PYTHONPATH=$PWD/tests/perf/prof_hooks:$PYTHONPATH \
            timeout -s ABRT 200 python3 tests/perf/structured_modes.py $mode "${ROUNDS:-4}" 2>&1 \
            | grep -E "^round|rror" | tail -3
        grep -l "procs.py engine" "$OUT/wrap_$mode"/*.txt | xargs -r cat | cut -c1-100 | tail -n +2
    done
    exit 0
fi
if [ "$PART" = timeline ]; then
    RECORD=/tmp/rec timeout -s ABRT 300 python3 tests/perf/structured_modes.py \
        unconstrained,json_schema,unconstrained_whole,json_schema_whole "${ROUNDS:-3}" 2>&1 \
        | grep -E "^round|rror" | tail -8
    python3 tests/perf/step_timeline.py /tmp/rec 15 > "$OUT/timeline.txt" 2>&1
    grep -c segment "$OUT/timeline.txt"
    exit 0
fi
if [ "$PART" = final ]; then  # (the GPU test, the "check" row, json_schema whole requests'
    # per-function times: what one call of the last minutes of device time can hold)
    timeout -s ABRT 200 python3 -u -m pytest -v -m gpu -p no:cacheprovider -rfs --tb=short \
        tests/test_structured_outputs.py > "$OUT/gpu_grammar.log" 2>&1
    grep -E "^(FAILED|ERROR)|^E  |passed|failed" "$OUT/gpu_grammar.log" | cut -c1-200 | tail -20
    structured_row check
    structured_drawn_and_wrap
    exit 0
fi
if [ "$PART" = grammar ]; then
    timeout -s ABRT 300 python3 -u -m pytest -v -m gpu -p no:cacheprovider -rfs --tb=short \
        tests/test_structured_outputs.py > "$OUT/gpu_grammar.log" 2>&1
    grep -E "^(FAILED|ERROR)|^E  |passed|failed" "$OUT/gpu_grammar.log" | cut -c1-200 | tail -20
    for mode in check wait; do structured_row "$mode" TAIPAN_GRAMMAR_MASKS=$mode; done
elif [ "$PART" = rows ]; then
    structured_row check1
    structured_row check2
    decode_1b_row plain
fi
