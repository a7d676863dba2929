#!/usr/bin/env bash
# Verify steps before and after their index uploads moved to pinned memory (3 syncs fewer per
# step), alternating in one call on random weights (no model to carry): tests/perf/
# verify_profile.py on the 1B shape at batch 1 and 8 with 4 drafts, then the speculative GPU
# test on the new tree. `.carry/old.patch` (git diff HEAD HEAD~1 -- actors/gpu/speculative.py)
# turns a copy of `.carry/new` into the tree before. nvidia-h100-x1; carry .whl, .carry/new,
# .carry/old.patch. From the root.
set -u
source tests/perf/device_setup.sh
start_device || exit 1
old_tree || exit 1
for t in new old; do
    src=.carry/new; [ $t = old ] && src=/tmp/old
    stage_tree "$src" "/tmp/pkg_$t" || exit 1
done
cd .carry/new
for t in old new old new; do
    echo "== $t"
    PYTHONPATH=/tmp/pkg_$t:/tmp/site:$PWD timeout -s ABRT 60 python3 tests/perf/verify_profile.py \
        random:llama-1b 4 1 8 2>&1 | grep -E "^random"
done
PYTHONPATH=/tmp/pkg_new:/tmp/site:$PWD timeout -s ABRT 90 python3 -m pytest -q -p no:cacheprovider \
    -m gpu tests/test_e2e_speculative.py 2>&1 | tail -2
