"""Where a step's device waits, from a torch profiler Chrome trace (tests/perf/verify_profile.py
with VERIFY_TRACE_DIR; device tool helper, not a test; stdlib only).

Usage: python3 tests/perf/trace_gaps.py TRACE.json[.gz] [STEPS] (default 5: the profiled steps).

The device's work (kernels, copies, memsets) is cut into STEPS steps at its STEPS - 1 longest
gaps (between steps the host syncs and plans). For each step: its span (first start to last
end), the time something ran and the idle rest; then the longest idle gaps inside steps, each
with the work that ended it, the host call that launched that work (by correlation id), when
the host made that call against the gap's start (a launch after the gap began: the device
waited for the host), and the host op around that call (what the host was doing).
"""

from __future__ import annotations

import gzip
import json
import sys
from collections import defaultdict

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CALL_CATS = ("cuda_runtime", "cuda_driver")


def load(path: str) -> list[dict]:
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def steps_of(device: list[dict], steps: int) -> list[list[dict]]:
    """The device events cut at the steps - 1 longest gaps between consecutive events."""
    device = sorted(device, key=lambda e: e["ts"])
    gaps = []
    end = device[0]["ts"] + device[0]["dur"]
    for i in range(1, len(device)):
        gaps.append((device[i]["ts"] - end, i))
        end = max(end, device[i]["ts"] + device[i]["dur"])
    cuts = sorted(i for _, i in sorted(gaps, reverse=True)[: steps - 1])
    out, start = [], 0
    for i in [*cuts, len(device)]:
        out.append(device[start:i])
        start = i
    return out


def busy(events: list[dict]) -> float:
    """Union of the events' intervals (us)."""
    total, cur_s, cur_e = 0.0, None, None
    for e in sorted(events, key=lambda e: e["ts"]):
        s, t = e["ts"], e["ts"] + e["dur"]
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, t
        else:
            cur_e = max(cur_e, t)
    return total + (cur_e - cur_s if cur_e is not None else 0.0)


def enclosing(host_ops: list[dict], call: dict) -> str:
    """The innermost host op (cpu_op / python function) on the call's thread around it."""
    best = None
    for op in host_ops:
        if op.get("tid") != call.get("tid"):
            continue
        if op["ts"] <= call["ts"] and call["ts"] + call["dur"] <= op["ts"] + op["dur"]:
            if best is None or op["dur"] < best["dur"]:
                best = op
    return best["name"][:70] if best else "?"


def main(path: str, steps: int) -> None:
    events = load(path)
    device = [e for e in events if e.get("cat") in DEVICE_CATS]
    calls = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in HOST_CALL_CATS and "correlation" in e.get("args", {})
    }
    host_ops = [
        e for e in events if e.get("cat") in ("cpu_op", "python_function", "user_annotation")
    ]
    gaps = []
    for n, step in enumerate(steps_of(device, steps)):
        start = step[0]["ts"]
        stop = max(e["ts"] + e["dur"] for e in step)
        on = busy(step)
        print(f"step {n}: span {(stop - start) / 1e3:.3f} ms, busy {on / 1e3:.3f}, idle "
              f"{(stop - start - on) / 1e3:.3f} ({len(step)} device events)")  # fmt: skip
        end = step[0]["ts"] + step[0]["dur"]
        for prev, e in zip(step, step[1:], strict=False):
            gap = e["ts"] - end
            if gap > 3:
                gaps.append((gap, n, end, prev, e))
            end = max(end, e["ts"] + e["dur"])
    kinds: dict[str, list[float]] = defaultdict(list)
    print("\nlongest idle gaps inside steps (us; host call at: us after the gap began):")
    for gap, n, begun, prev, e in sorted(gaps, key=lambda g: -g[0])[:25]:
        call = calls.get(e.get("args", {}).get("correlation"))
        if call is not None:
            late = call["ts"] - begun
            who = f"{call['name'][:28]} at {late:+8.1f} in {enclosing(host_ops, call)}"
        else:
            who = "(no host call: inside a graph)"
        print(f"  {gap:8.1f}  step {n}  after {prev['name'][:30]:30}  before {e['name'][:30]:30}"
              f"  {who}")  # fmt: skip
    for gap, _, _, _, e in gaps:
        kinds[e["name"][:40]].append(gap)
    print("\nidle before each kind of work, summed over the steps (us):")
    for name, values in sorted(kinds.items(), key=lambda kv: -sum(kv[1]))[:15]:
        print(f"  {sum(values) / steps:8.1f} a step  x{len(values) / steps:5.1f}  {name}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 5)
