#!/usr/bin/env bash
# One four-GPU device call (repo root; `.whl`, `.carry/old` and `.carry/new` carried, each a
# `git archive` of a commit): issue 26's weight sync at the 8B shape, the tree before and after a
# change side by side (trainer cuda:0 -> taipan cuda:1), then the new tree with taipan at TP=2
# (cuda:1 and cuda:2) and one update through a checkpoint on disk. Rows go to $OUT/results.jsonl.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/*.whl || exit 1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c
for t in old new; do
    python3 -c "from tests.lint_imports import stage; from pathlib import Path; \
stage(Path('.carry/$t'), Path('/tmp/pkg_$t'))" || exit 1
done
R=$OUT/results.jsonl
WS="-m taipan.cli bench --workload weight-sync --model random:llama-8b --dtype bfloat16 \
--trainer-device cuda:0 --sync-rounds 3 --results $R"
in_tree() {  # in_tree TREE SECONDS ARGS...: python3 in that tree's staged package
    local t=$1 s=$2
    shift 2
    (cd ".carry/$t" && PYTHONPATH=/tmp/pkg_$t:/tmp/site:$PWD timeout -s ABRT "$s" python3 "$@")
}
echo "== the NCCL weight-transfer GPU test (new tree)"
in_tree new 150 -m pytest -q -p no:cacheprovider -m gpu tests/test_rl.py \
    2>&1 | tail -4
for t in old new; do
    echo "== $t, TP=1"
    in_tree "$t" 170 $WS --device cuda:1 2>&1 | grep -E "weight-sync|Error|error" | tail -8
done
echo "== new, TP=2, and a checkpoint on disk"
in_tree new 200 $WS --device cuda:1 --tensor-parallel-size 2 --sync-path 2>&1 \
    | grep -E "weight-sync|Error|error" | tail -10
