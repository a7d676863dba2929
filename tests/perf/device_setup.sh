# Sourced by the tenth session's device scripts (tests/perf/session10_*.sh), from the root:
# the carried wheels (.whl) installed to /tmp/site, a tree staged as the `taipan` package, and
# the tree before a change rebuilt from `.carry/new` and `.carry/old.patch`.
install_wheels() {
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target /tmp/site .whl/*.whl 2>/dev/null
}
stage_tree() {  # SRC DEST
    python3 -c "from tests.lint_imports import stage; from pathlib import Path; \
stage(Path('$1'), Path('$2'))"
}
old_tree() {  # /tmp/old: .carry/new with .carry/old.patch applied
    rm -rf /tmp/old && cp -r .carry/new /tmp/old && (cd /tmp/old && patch -s -p1 < "$OLDPWD/.carry/old.patch")
}
start_device() {  # [model]: the wheels, the environment, the GPU's name; `model`: smollm2 too
    install_wheels || return 1
    export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
    nvidia-smi --query-gpu=name --format=csv,noheader
    [ "${1:-}" != model ] || bash tests/perf/carry_model.sh stage2
}
copy_new_tree() {  # .carry/new from the working tree the call brought (unless there)
    # (not carried: the working tree holds the same files as a `git archive` of it, and the
    # call stays under its 64 MiB with the model)
    if [ ! -d .carry/new ]; then
        mkdir -p .carry/new && tar --exclude=./.carry --exclude=./.whl -cf - . \
            | tar -xf - -C .carry/new || return 1
    fi
}
stage_old_and_new() {  # .carry/new and the tree before it (old_tree) as /tmp/pkg_{new,old}
    old_tree || return 1
    local t src
    for t in new old; do
        src=.carry/new; [ $t = old ] && src=/tmp/old
        stage_tree "$src" "/tmp/pkg_$t" || return 1
    done
}
enter_new_tree() {  # [model]: start_device, NVLS off, .carry/new staged as `taipan`, cd there
    copy_new_tree || return 1
    start_device "${1:-}" || return 1
    export PYTHONFAULTHANDLER=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
    export NVSHMEM_DISABLE_NVLS=1
    stage_tree .carry/new /tmp/pkg_new || return 1
    cd .carry/new && export PYTHONPATH=/tmp/pkg_new:/tmp/site:$PWD
}
structured_row() {  # TAG [VAR=VALUE ...]: SmolLM2's structured row (64 streams x 128 tokens)
    # ($STRUCTURED_EXTRA: more bench arguments, e.g. --temperature 1)
    local tag=$1
    shift
    # shellcheck disable=SC2086
    env "$@" timeout -s ABRT 150 python3 -m taipan.cli bench --workload structured \
        --model smollm2 --device cuda --dtype bfloat16 --num-prompts 64 --output-len 128 \
        --results "$OUT/structured_$tag.jsonl" ${STRUCTURED_EXTRA:-} 2>&1 \
        | grep -E "^structured|rror" | cut -c1-230 | sed "s/^/$tag /"
}
decode_1b_row() {  # TAG [VAR=VALUE ...]: the 1B shape's decode rows at batch 1 and 64
    # ($BENCH_EXTRA: more bench arguments, e.g. --log-probs)
    local tag=$1
    shift
    # shellcheck disable=SC2086
    env "$@" timeout -s ABRT 150 python3 -m taipan.cli bench --workload decode \
        --model random:llama-1b --device cuda --dtype bfloat16 --batches 1,64 \
        --output-len 256 --no-hf --ours-modes graphs --results "$OUT/decode_$tag.jsonl" \
        ${BENCH_EXTRA:-} 2>&1 | grep -E "^decode|rror" | cut -c1-170 | sed "s/^/$tag /"
}
structured_drawn_and_wrap() {  # temperature-1 structured rows in "check" (checked draws) and
    # "mask", then the per-function medians of whole json_schema requests (tests/perf/prof_hooks)
    for mode in check mask; do
        STRUCTURED_EXTRA="--temperature 1" structured_row "drawn_$mode" TAIPAN_GRAMMAR_MASKS=$mode
    done
    mkdir -p "$OUT/wrap_json"
    PROF_WRAP_OUT="$OUT/wrap_json" PYTHONPATH=$PWD/tests/perf/prof_hooks:$PYTHONPATH \
        timeout -s ABRT 100 python3 tests/perf/structured_modes.py json_schema_whole 2 2>&1 \
        | grep -E "^round|rror" | tail -2
    grep -h -A 16 "procs.py engine" "$OUT"/wrap_json/*.txt | cut -c1-100 | tail -n +2
}
alternate_old_new() {  # ROW_FN: `ROW_FN TAG` for the tree before (old) and this one (new),
    # alternating ROUNDS (2) times, each staged as the `taipan` package (stage_old_and_new)
    local i t
    for i in $(seq "${ROUNDS:-2}"); do
        for t in old new; do
            (cd .carry/new && export PYTHONPATH=/tmp/pkg_$t:/tmp/site:$PWD && "$1" "${t}$i")
        done
    done
}
