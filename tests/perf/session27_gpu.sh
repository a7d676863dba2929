#!/usr/bin/env bash
# The twenty-seventh session's device parts (from the root; each after
# `bash tests/perf/carry_model.sh stage1` with carry [".carry/smollm2.gguf.part1"] on a fresh
# machine, then with carry [".carry/smollm2.gguf.part2", ".whl"]; a later call on the same warm
# machine needs only ".whl").
#   grammar: issue 28's "check" mode (the next step does not wait for the grammar check; rows
#     that read a replaced token are void): the structured GPU tests (test_structured_outputs.py,
#     graphs and overlap, "check" against "wait" and masked rows), then SmolLM2's structured rows (64 json_schema streams x 128) in
#     "check", "wait" and "mask" modes, and grammar_step_profile.py (the worker alone).
#   rows: the same three structured rows again (the scatter between runs), the 1B decode rows.
#   spy: the "check" row again under py-spy (the engine process's threads; spy_summary.py).
PART=${1:?part grammar, rows or spy}
source tests/perf/device_setup.sh
rm -rf .carry/new  # (an ignored tree a previous call left on the warm machine is stale)
enter_new_tree model || exit 1

if [ "$PART" = spy ]; then
    timeout -s INT 200 /tmp/site/bin/py-spy record --idle --threads --subprocesses \
        --format raw -r 250 -o /tmp/spy.txt -- python3 -m taipan.cli bench \
        --workload structured --model smollm2 --device cuda --dtype bfloat16 \
        --num-prompts 64 --output-len 128 --results "$OUT/spy_check.jsonl" 2>&1 \
        | grep -E "^structured|rror" | cut -c1-260
    python3 tests/perf/spy_summary.py /tmp/spy.txt "taipan.procs engine" 60 > "$OUT/spy.txt"
    gzip -c /tmp/spy.txt > "$OUT/spy.raw.gz"
    exit 0
fi

if [ "$PART" = grammar ]; then
    timeout -s ABRT 300 python3 -u -m pytest -v -m gpu -p no:cacheprovider -rfs --tb=short \
        tests/test_structured_outputs.py > "$OUT/gpu_grammar.log" 2>&1
    grep -E "^(FAILED|ERROR)|^E  |passed|failed" "$OUT/gpu_grammar.log" | cut -c1-200 | tail -20
fi
for mode in check wait mask; do structured_row "$mode" TAIPAN_GRAMMAR_MASKS=$mode; done
if [ "$PART" = grammar ]; then
    PYTHONPATH=$PWD:$PYTHONPATH timeout -s ABRT 150 python3 tests/perf/grammar_step_profile.py \
        cuda 64 40 2>&1 | grep -vE "Warning|USDT" | tee "$OUT/grammar_profile.txt" | head -10
elif [ "$PART" = rows ]; then
    decode_1b_row plain
fi
