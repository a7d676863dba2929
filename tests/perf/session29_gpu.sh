#!/usr/bin/env bash
# The twenty-ninth session's device parts, for the next session with device time (this one had
# 174 s, under a machine's start; from the root, each after `bash tests/perf/carry_model.sh
# stage1` with carry [".carry/smollm2.gguf.part1"] on a fresh machine, then with carry
# [".carry/smollm2.gguf.part2", ".whl"]; a later call on the same warm machine needs ".whl").
#   first: what no GPU has run yet: the structured GPU tests (the end-of-sequence acceptance,
#     the quick paths and checked draws of the twenty-eighth session, the steady path of this
#     one; `test_gpu_checked_draws_equal_masked_ones_with_graphs_and_overlap` never ran), the
#     speculative GPU tests (the verify path's grammar walk moved to speculative.py), the dense
#     and real-model ones (the engine's plan cache under overlap and graphs).
#   rows: the "check" structured row twice, temperature-1 rows in "check" and "mask", and the
#     per-function medians of whole json_schema requests (tests/perf/prof_hooks). (Two calls,
#     first then rows: together they would pass a call's 600 s.)
#   decode: the 1B decode rows (issue 24's batch-64 idle).
#   ab: the tree before this session's host trims (.carry/old.patch, carried: `git diff HEAD
#     369e5d7 > .carry/old.patch` turns this tree into it) against this one, alternating
#     ROUNDS (2) times: the 1B decode rows (batch 1 and 64; each ~1 min with its start).
PART=${1:?part first, rows, decode or ab}
source tests/perf/device_setup.sh
rm -rf .carry/new  # (an ignored tree a previous call left on the warm machine is stale)
if [ "$PART" = ab ]; then
    copy_new_tree && start_device model && stage_old_and_new || exit 1
    export PYTHONFAULTHANDLER=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
    export NVSHMEM_DISABLE_NVLS=1
    alternate_old_new decode_1b_row
    exit 0
fi
enter_new_tree model || exit 1

if [ "$PART" = first ]; then
    timeout -s ABRT 500 python3 -u -m pytest -v -m gpu -p no:cacheprovider -rfs --tb=short \
        tests/test_structured_outputs.py tests/test_speculative_verify.py \
        tests/test_e2e_speculative.py tests/test_e2e_dense.py tests/test_gpu_real_model.py \
        > "$OUT/gpu_tests.log" 2>&1
    grep -E "^(FAILED|ERROR)|^E  |passed|failed" "$OUT/gpu_tests.log" | cut -c1-200 | tail -20
elif [ "$PART" = rows ]; then
    structured_row check1
    structured_row check2
    structured_drawn_and_wrap
elif [ "$PART" = decode ]; then
    decode_1b_row plain
fi
