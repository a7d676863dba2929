"""Summarize a py-spy raw profile (`py-spy record --idle --threads --subprocesses --format raw`)
on the machine that recorded it, when the raw file is too large to bring back: for each process
whose command line holds PROCESS (default "taipan.procs engine"), in the order they first
appear, and each of its threads, the samples in total and the functions with the most
samples under them (inclusive: a function counted once per sample it is on the stack of).

    python3 tests/perf/spy_summary.py SPY.txt [PROCESS] [TOP]
"""

from __future__ import annotations

import collections
import re
import sys


def summarize(path: str, process: str, top: int) -> None:
    threads: dict[str, dict[str, collections.Counter]] = {}
    totals: dict[tuple[str, str], int] = collections.Counter()
    for line in open(path, errors="replace"):
        stack, _, n = line.rstrip("\n").rpartition(" ")
        # (--subprocesses nests a child's frame under its parents'; the last one is its own,
        # and a command line may hold ";": split at the thread's frame)
        head, sep, rest = stack.rpartition(";thread (")
        procs = re.findall(r"process (\d+):", head)
        if not sep or not procs or not n.isdigit() or process not in head.rpartition("process ")[2]:
            continue
        proc = f"process {procs[-1]}"
        frames = rest.split(";")
        thread = "thread (" + frames[0]
        names = {re.sub(r" \((.*/)?([^/]*?):\d+\)$", r" (\2)", f) for f in frames[1:]}
        per = threads.setdefault(proc, {}).setdefault(thread, collections.Counter())
        for name in names:
            per[name] += int(n)
        totals[proc, thread] += int(n)
    for proc, per_thread in threads.items():
        for thread, counts in per_thread.items():
            total = totals[proc, thread]
            if total < 50:
                continue
            print(f"== {proc} {thread}: {total} samples")
            for name, c in counts.most_common(top):
                print(f"  {c:7d} {100 * c / total:5.1f}%  {name[:110]}")


if __name__ == "__main__":
    args = sys.argv[1:]
    summarize(args[0], args[1] if len(args) > 1 else "taipan.procs engine",
              int(args[2]) if len(args) > 2 else 45)  # fmt: skip
