"""Device-script helper: append the last N rows of a bench's results file to a kept file, each
with extra fields, and print one summary line of their decode steps.

    python3 tests/perf/keep_rows.py SRC OUT N LABEL key=value ...
"""

from __future__ import annotations

import json
import sys


def main(src: str, out: str, n: str, label: str, *fields: str) -> None:
    rows = [json.loads(line) for line in open(src)][-int(n) :]
    extra = dict(f.split("=", 1) for f in fields)
    with open(out, "a") as f:
        for r in rows:
            f.write(json.dumps(r | extra) + "\n")
    print(f"{label:7s}", " ".join(
        f"b{r['batch']}: {r['ours_step_ms']:.3f} ms (idle {100 * r['gpu_idle_share']:.1f} %)"
        for r in rows))  # fmt: skip


if __name__ == "__main__":
    main(*sys.argv[1:])
