#!/usr/bin/env bash
# The seventh session's device calls on a two-GPU machine (repo root; `.whl`, `.carry/new` (a
# `git archive` of HEAD) and `.carry/old` (of 3f2c8b5, before issue 25) carried):
#   part a (after `carry_model.sh stage1`; carry part2 too): the real model joined, then
#     tests/perf/session_gdn_gpu.sh's GPU tests (issue 27 item 4, issue 28 item 3), the
#     structured-output row on SmolLM2 (issue 28: json_schema streams at batch 64), and the
#     1B decode rows of the trees before and after issue 25 (issue 25: same machine, same call);
#   part b (after stage1 again: a machine idle 30 s is gone): the two bf16 tests part a failed,
#     fixed; the structured row again (warmed, alternating rounds: part a's first run was
#     cold); the 8B weight sync (issue 26) paused and in flight, trainer on cuda:0 and taipan on
#     cuda:1; the 1B decode rows of both trees alternating twice; the Qwen3-Next-like row;
#   part c (after stage1): the structured row with the engine's step counts, SmolLM2's decode
#     rows, the 1B rows under two GIL switch intervals alternating, the Qwen3-Next-like row
#     against the MoE floor;
#   part d (after stage1): the GPU tests of the kernels deduplicated and of speculative
#     decoding, the structured row again, the spec row;
#   part e (right after d): the weight-transfer GPU tests and the 8B weight sync with copies on
#     a side stream, and py-spy over a 1B batch-1 decode (not run: out of device time);
#   part f (after stage1): d's failed GPU test named, and e's first three items;
#   part g (after stage1): py-spy over the structured and spec benches (SmolLM2).
set -u
PART=${1:?part a or b}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/*.whl || exit 1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c
ROOT=$PWD
for tree in new old; do
    [ -d .carry/$tree ] && python3 -c "from tests.lint_imports import stage; from pathlib import Path; \
stage(Path('.carry/$tree'), Path('/tmp/pkg_$tree'))"
done
cd .carry/new && export PYTHONPATH=/tmp/pkg_new:/tmp/site:$PWD
if [ "$PART" = a ]; then
    (cd "$ROOT" && bash tests/perf/carry_model.sh stage2) || exit 1
    echo "== GPU tests"
    timeout -s ABRT 300 python3 -m pytest -q -p no:cacheprovider -m gpu -rfs --tb=short \
        tests/test_kernels_gated_delta.py tests/test_ops_qwen3_next.py \
        tests/test_e2e_qwen3_next.py $(ls tests/test_sampling_controls*.py 2>/dev/null) 2>&1 \
        | tee "$OUT/gdn_gpu.log" | tail -30
    echo "== structured"
    CUDA_VISIBLE_DEVICES=0 timeout -s ABRT 150 python3 -m taipan.cli bench --workload structured \
        --model smollm2 --device cuda --dtype bfloat16 --num-prompts 64 --output-len 128 \
        --results "$OUT/results.jsonl" 2>&1 | tail -4
    echo "== decode before/after issue 25 (1B shape)"
    for tree in old new; do
        (cd "$ROOT/.carry/$tree" && CUDA_VISIBLE_DEVICES=0 PYTHONPATH=/tmp/pkg_$tree:/tmp/site:$PWD \
            timeout -s ABRT 100 python3 -m taipan.cli bench --workload decode \
            --model random:llama-1b --device cuda --dtype bfloat16 --batches 1,64 --no-hf \
            --ours-modes graphs --results "$OUT/results_$tree.jsonl" 2>&1 \
            | grep -E "decode|rror" | tail -3)
    done
elif [ "$PART" = b ]; then
    (cd "$ROOT" && bash tests/perf/carry_model.sh stage2) || exit 1
    echo "== the two bf16 tests of part a, fixed"
    timeout -s ABRT 120 python3 -m pytest -q -p no:cacheprovider -m gpu -rfs --tb=short \
        tests/test_e2e_qwen3_next.py -k "bf16 or kernel_path" 2>&1 | tee "$OUT/gdn_gpu.log" \
        | tail -4
    echo "== structured (warmed, alternating rounds)"
    CUDA_VISIBLE_DEVICES=0 timeout -s ABRT 150 python3 -m taipan.cli bench --workload structured \
        --model smollm2 --device cuda --dtype bfloat16 --num-prompts 64 --output-len 128 \
        --results "$OUT/results.jsonl" 2>&1 | tail -2
    echo "== weight sync, 8B shape, paused then in flight"
    WS="-m taipan.cli bench --workload weight-sync --model random:llama-8b --dtype bfloat16"
    WS="$WS --trainer-device cuda:0 --device cuda:1 --sync-rounds 3 --results $OUT/results.jsonl"
    timeout -s ABRT 150 python3 $WS 2>&1 | grep -E "weight-sync|rror" | tail -4
    timeout -s ABRT 150 python3 $WS --in-flight 2>&1 | grep -E "weight-sync|rror" | tail -4
    echo "== decode before/after issue 25 (1B shape), alternating, and the Qwen3-Next-like row"
    for tree in old new old new; do
        (cd "$ROOT/.carry/$tree" && CUDA_VISIBLE_DEVICES=0 PYTHONPATH=/tmp/pkg_$tree:/tmp/site:$PWD \
            timeout -s ABRT 100 python3 -m taipan.cli bench --workload decode \
            --model random:llama-1b --device cuda --dtype bfloat16 --batches 1,64 --no-hf \
            --ours-modes graphs --results "$OUT/results_$tree.jsonl" 2>&1 \
            | grep -E "decode|rror" | tail -3)
    done
    CUDA_VISIBLE_DEVICES=0 timeout -s ABRT 120 python3 -m taipan.cli bench --workload decode \
        --model random:qwen3-next-80b-a3b-8l --device cuda --dtype bfloat16 --batches 1,64 \
        --no-hf --ours-modes graphs --results "$OUT/results.jsonl" 2>&1 | grep -E "decode|rror"
elif [ "$PART" = c ]; then
    (cd "$ROOT" && bash tests/perf/carry_model.sh stage2) || exit 1
    echo "== structured, with the engine's steps"
    CUDA_VISIBLE_DEVICES=0 timeout -s ABRT 150 python3 -m taipan.cli bench --workload structured \
        --model smollm2 --device cuda --dtype bfloat16 --num-prompts 64 --output-len 128 \
        --results "$OUT/results.jsonl" --json 2>&1 | tail -1
    echo "== SmolLM2 decode"
    CUDA_VISIBLE_DEVICES=0 timeout -s ABRT 100 python3 -m taipan.cli bench --workload decode \
        --model smollm2 --device cuda --dtype bfloat16 --batches 1,64 --no-hf \
        --ours-modes graphs --results "$OUT/results.jsonl" 2>&1 | grep -E "decode|rror"
    echo "== 1B decode: the GIL switch interval, default (5 ms) vs 0.2 ms, alternating"
    for si in "" 0.0002 "" 0.0002; do
        echo "switch interval ${si:-default}"
        TAIPAN_SWITCH_INTERVAL_S=$si CUDA_VISIBLE_DEVICES=0 timeout -s ABRT 100 python3 -m taipan.cli \
            bench --workload decode --model random:llama-1b --device cuda --dtype bfloat16 \
            --batches 1,64 --no-hf --ours-modes graphs --results "$OUT/results_si${si:-def}.jsonl" \
            2>&1 | grep -E "decode|rror"
    done
    echo "== Qwen3-Next-like decode, MoE floor"
    CUDA_VISIBLE_DEVICES=0 timeout -s ABRT 120 python3 -m taipan.cli bench --workload decode \
        --model random:qwen3-next-80b-a3b-8l --device cuda --dtype bfloat16 --batches 1,64 \
        --no-hf --ours-modes graphs --results "$OUT/results.jsonl" 2>&1 | grep -E "decode|rror"
elif [ "$PART" = d ]; then
    (cd "$ROOT" && bash tests/perf/carry_model.sh stage2) || exit 1
    echo "== GPU tests: the kernels deduplicated (5e846e9), speculative decoding on CUDA"
    CUDA_VISIBLE_DEVICES=0 timeout -s ABRT 330 python3 -m pytest -q -p no:cacheprovider -m gpu \
        -rfs --tb=short tests/test_kernels_elementwise.py tests/test_kernels_moe.py \
        tests/test_kernels_gated_delta.py tests/test_kernels_causal_conv1d.py \
        tests/test_kernels_ssd_scan.py tests/test_kernels_gated_rmsnorm.py \
        tests/test_kernels_selective_state.py tests/test_gemma3.py tests/test_ops_moe.py \
        tests/test_e2e_speculative.py tests/test_e2e_qwen3_next.py 2>&1 \
        | tee "$OUT/gpu_tests.log" | tail -12
    echo "== structured (templates, whole requests too)"
    CUDA_VISIBLE_DEVICES=0 timeout -s ABRT 150 python3 -m taipan.cli bench --workload structured \
        --model smollm2 --device cuda --dtype bfloat16 --num-prompts 64 --output-len 128 \
        --results "$OUT/results.jsonl" 2>&1 | tail -1
    if [ -f runtime/bench/spec.py ]; then
        echo "== speculative decoding, SmolLM2, batch 1"
        CUDA_VISIBLE_DEVICES=0 timeout -s ABRT 200 python3 -m taipan.cli bench --workload spec \
            --model smollm2 --device cuda --dtype bfloat16 --results "$OUT/results.jsonl" 2>&1 \
            | tail -3
    fi
elif [ "$PART" = e ]; then
    echo "== weight transfer GPU tests (copies beside the next bucket's broadcast)"
    timeout -s ABRT 200 python3 -m pytest -q -p no:cacheprovider -m gpu -rfs --tb=short \
        tests/test_gpu_weight_transfer.py tests/test_weight_transfer.py tests/test_rl.py 2>&1 \
        | tee "$OUT/wt_tests.log" | tail -6
    echo "== weight sync, 8B shape, paused then in flight"
    WS="-m taipan.cli bench --workload weight-sync --model random:llama-8b --dtype bfloat16"
    WS="$WS --trainer-device cuda:0 --device cuda:1 --sync-rounds 3 --results $OUT/results.jsonl"
    timeout -s ABRT 120 python3 $WS 2>&1 | grep -E "weight-sync [0-9]|rror" | tail -3
    timeout -s ABRT 120 python3 $WS --in-flight 2>&1 | grep -E "weight-sync [0-9]|rror" | tail -3
    echo "== py-spy over the 1B decode bench at batch 1 (every process, raw stacks)"
    CUDA_VISIBLE_DEVICES=0 timeout -s ABRT 120 /tmp/site/bin/py-spy record --subprocesses \
        --format raw -r 400 -o "$OUT/decode_b1.pyspy.txt" -- python3 -m taipan.cli bench \
        --workload decode --model random:llama-1b --device cuda --dtype bfloat16 --batches 1 \
        --output-len 512 --no-hf --ours-modes graphs --results "$OUT/results_pyspy.jsonl" 2>&1 \
        | grep -E "decode|rror" | tail -3
elif [ "$PART" = f ]; then
    (cd "$ROOT" && bash tests/perf/carry_model.sh stage2) || exit 1
    echo "== speculative decoding's GPU test (which one failed in d)"
    CUDA_VISIBLE_DEVICES=0 timeout -s ABRT 120 python3 -m pytest -q -p no:cacheprovider -m gpu \
        -rfs --tb=line tests/test_e2e_speculative.py 2>&1 | grep -vE "^  File|^Extension" \
        | tail -8
    echo "== weight transfer GPU tests (copies beside the next bucket's broadcast)"
    timeout -s ABRT 130 python3 -m pytest -q -p no:cacheprovider -m gpu -rfs --tb=short \
        tests/test_gpu_weight_transfer.py tests/test_rl.py 2>&1 | grep -vE "^  File|^Extension" \
        | tail -8
    echo "== weight sync, 8B shape, paused then in flight"
    WS="-m taipan.cli bench --workload weight-sync --model random:llama-8b --dtype bfloat16"
    WS="$WS --trainer-device cuda:0 --device cuda:1 --sync-rounds 3 --results $OUT/results.jsonl"
    timeout -s ABRT 80 python3 $WS 2>&1 | grep -E "weight-sync [0-9]|rror" | tail -3
    timeout -s ABRT 80 python3 $WS --in-flight 2>&1 | grep -E "weight-sync [0-9]|rror" | tail -3
elif [ "$PART" = g ]; then
    (cd "$ROOT" && bash tests/perf/carry_model.sh stage2) || exit 1
    echo "== py-spy over the structured bench and the spec bench (raw stacks, every process)"
    for w in "structured --num-prompts 64" "spec --num-prompts 4"; do
        CUDA_VISIBLE_DEVICES=0 timeout -s INT 100 /tmp/site/bin/py-spy record --subprocesses \
            --format raw -r 200 -o "$OUT/${w%% *}.pyspy.txt" -- python3 -m taipan.cli bench \
            --workload $w --model smollm2 --device cuda --dtype bfloat16 --output-len 128 \
            --results "$OUT/results_pyspy.jsonl" 2>&1 | grep -E "^(struct|spec)|rror" | tail -3
    done
fi

