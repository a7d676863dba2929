"""Read a py-spy raw profile (`py-spy record --format raw --subprocesses`) of a taipan run: the
samples of one process below one frame, grouped by the frames under it.

    python3 tests/perf/spy_tree.py SPY.txt FRAME [DEPTH] [PROCESS]

FRAME: the start of a frame's name, e.g. "ModelWorker.launch" or "plan_arrays"; DEPTH: how many
frames below it name a group (default 1); PROCESS: a piece of the process's command line
(default "taipan.procs engine"). Prints samples per group, most first ("<self>": in FRAME itself).
"""

from __future__ import annotations

import collections
import re
import sys


def groups(path: str, root: str, depth: int, process: str) -> collections.Counter:
    counts: collections.Counter = collections.Counter()
    for line in open(path):
        stack, _, n = line.rstrip("\n").rpartition(" ")
        if process not in stack:
            continue
        names = [re.sub(r" \((.*/)?([^/]*?):\d+\)$", r" (\2)", f) for f in stack.split(";")]
        for i, name in enumerate(names):
            if name.startswith(root):
                counts[" > ".join(names[i + 1 : i + 1 + depth]) or "<self>"] += int(n)
                break
    return counts


if __name__ == "__main__":
    args = sys.argv[1:]
    depth = int(args[2]) if len(args) > 2 else 1
    process = args[3] if len(args) > 3 else "taipan.procs engine"
    for key, n in groups(args[0], args[1], depth, process).most_common(40):
        print(n, key)
