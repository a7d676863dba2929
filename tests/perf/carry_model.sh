#!/usr/bin/env bash
# Carry the real SmolLM2-135M-Instruct GGUF (98,362,432 bytes) to the lent GPU machine, which
# cannot download it and takes at most 64 MiB of carried files per call: two halves (~47 MiB
# each) in two consecutive calls on the same warm machine (the second within ~30 s of the first).
#
#   here, once:     bash tests/perf/carry_model.sh split
#                   (and .whl/ as tests/perf/device_env.sh says, for call 2)
#   device call 1:  bash tests/perf/carry_model.sh stage1
#                   carry [".carry/smollm2.gguf.part1"]
#   device call 2:  bash tests/perf/carry_model.sh stage2 && source tests/perf/device_env.sh &&
#                   python3 -m pytest -q -m gpu tests/test_gpu_real_model.py
#                   carry [".carry/smollm2.gguf.part2", ".whl"]
#
# split:  cuts the cached GGUF ($TAIPAN_CACHE or ~/.cache/taipan, where `--model smollm2` looks)
#         into .carry/smollm2.gguf.part1 and .part2 (.carry/ is gitignored) and prints the calls.
# stage1: (device) copies part1 to /tmp/taipan-model/, out of the working tree that the next
#         call replaces.
# stage2: (device) joins /tmp/taipan-model/part1 and .carry/part2, checks the sha256 and moves
#         the file to where `--model smollm2` finds it; prints that path and exports nothing.
#         When the file is already there with the right sha256 (a later call on the same warm
#         machine), it only prints the path: later calls need neither stage nor half.
# Run from the repository root.
set -euo pipefail

NAME=SmolLM2-135M-Instruct.Q4_1.gguf
SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
CACHE=${TAIPAN_CACHE:-$HOME/.cache/taipan}
TARGET=$CACHE/$NAME
PARTS=.carry/smollm2.gguf
STAGE=/tmp/taipan-model

die() { echo "carry_model.sh: $*" >&2; exit 1; }
sha_ok() { [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$SHA256" ]; }
mib() { echo "$(( ($1 + 1048575) / 1048576 )) MiB"; }

split_model() {
    sha_ok "$TARGET" || die "$TARGET missing or not smollm2's sha256: python -m taipan.models smollm2"
    mkdir -p .carry
    local size half
    size=$(stat -c %s "$TARGET")
    half=$(( (size + 1) / 2 ))
    head -c "$half" "$TARGET" > "$PARTS.part1"
    tail -c +"$(( half + 1 ))" "$TARGET" > "$PARTS.part2"
    local p1 p2 tree whl=0
    p1=$(stat -c %s "$PARTS.part1")
    p2=$(stat -c %s "$PARTS.part2")
    [ $(( p1 + p2 )) -eq "$size" ] || die "the halves do not add up to $size bytes"
    # What travels besides the carried paths: tracked files and untracked, unignored ones.
    tree=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2>/dev/null \
        | tail -1 | cut -f1)
    [ -d .whl ] && whl=$(du -sb .whl | cut -f1)
    echo "part1 $p1 bytes, part2 $p2 bytes; working tree $tree bytes; .whl $whl bytes"
    echo "call 1 carries about $(mib $(( tree + p1 ))), call 2 about $(mib $(( tree + p2 + whl ))) (limit 64 MiB)"
    [ -d .whl ] || echo "note: no .whl/ here yet: see tests/perf/device_env.sh"
    echo
    echo "device call 1, carry [\"$PARTS.part1\"]:"
    echo "  bash tests/perf/carry_model.sh stage1"
    echo "device call 2 (right after), carry [\"$PARTS.part2\", \".whl\"]:"
    echo "  bash tests/perf/carry_model.sh stage2 && source tests/perf/device_env.sh &&" \
        "python3 -m pytest -q -m gpu tests/test_gpu_real_model.py"
}

stage1() {
    [ -f "$PARTS.part1" ] || die "no $PARTS.part1 here: carry it in this call"
    mkdir -p "$STAGE"
    cp "$PARTS.part1" "$STAGE/part1"
    echo "staged $(stat -c %s "$STAGE/part1") bytes in $STAGE/part1; now call 2 with part2"
}

stage2() {
    if sha_ok "$TARGET"; then
        echo "$TARGET"
        return
    fi
    local part1=$STAGE/part1
    [ -f "$part1" ] || part1=$PARTS.part1  # a kept copy of call 1's tree, if any
    [ -f "$part1" ] || die "no part1 in $STAGE: run stage1 in the call just before this one," \
        "on the same warm machine"
    [ -f "$PARTS.part2" ] || die "no $PARTS.part2 here: carry it in this call"
    mkdir -p "$CACHE"
    cat "$part1" "$PARTS.part2" > "$TARGET.partial"
    if ! sha_ok "$TARGET.partial"; then
        rm -f "$TARGET.partial"
        die "the joined file is not smollm2's (sha256 $SHA256): were both halves from one split?"
    fi
    mv "$TARGET.partial" "$TARGET"
    rm -f "$STAGE/part1"
    echo "$TARGET"
}

case "${1:-}" in
    split) split_model ;;
    stage1) stage1 ;;
    stage2) stage2 ;;
    *) die "usage: bash tests/perf/carry_model.sh split|stage1|stage2 (see the header)" ;;
esac
