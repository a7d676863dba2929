"""Lay a recorded runtime's decode steps out in time (device tool helper, not a test):

    python3 tests/perf/step_timeline.py DIR   (DIR: `taipan bench ... --record DIR`)

From the gpu actor's log (every StepPlan in, every StepResult out, stamped when its channel saw
it) and the engine's (the same messages from the other side), per kind of step, plain decode
(every sequence one query token) or verify (a sequence carries drafts), the medians of:

- `gap`: from the previous step's result leaving the gpu actor to this plan reaching it (the
  engine's turn: the result read, the outputs sent, the next step planned; 0 when the plan came
  first, as overlapped steps do);
- `in_gpu`: from the plan in to its result out (launch, device, collect, and any wait for the
  step before);
- `launch_to_collect`: StepResult.forward_seconds, from the launch's start to the end of its
  collect; `device`: StepResult.device_seconds (the step's events);
- `period`: from one result out to the next (what a step costs the request);
and the share of them replayed from a CUDA graph.

Runtimes recorded into one directory one after the other (the spec bench's "off" and "on")
share the logs; steps more than a second apart start a new segment, printed apart.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import numpy as np

from taipan.actors.record import read_log
from taipan.messages.codec import decode
from taipan.messages.gpu import StepPlan, StepResult

SEGMENT_GAP_S = 1.0


def steps_of(log: Path) -> list[dict]:
    """Per step id: the plan's arrival, the result's departure and what they say."""
    by_step: dict[int, dict] = {}
    for rec in read_log(log):
        try:
            msg = decode(rec.frames)
        except Exception:  # (a control or a message this script does not need)
            continue
        if isinstance(msg, StepPlan) and rec.direction == "in":
            drafts = len(msg.num_drafts) and bool(msg.num_drafts.any())
            decode_only = bool((np.diff(msg.query_start_loc) == 1).all())
            kind = "verify" if drafts else "decode" if decode_only else "mixed"
            by_step[msg.step] = {"plan_in": rec.time, "kind": kind, "seqs": len(msg.seq_lens)}
        elif isinstance(msg, StepResult) and rec.direction == "out" and msg.step in by_step:
            by_step[msg.step].update(
                result_out=rec.time,
                elapsed=msg.forward_seconds,
                graphed=msg.graphed,
                device=msg.device_seconds,
            )
    return [s for _, s in sorted(by_step.items()) if "result_out" in s]


def _segments(steps: list[dict]) -> list[list[dict]]:
    out: list[list[dict]] = []
    for s in steps:
        if not out or s["plan_in"] - out[-1][-1]["result_out"] > SEGMENT_GAP_S:
            out.append([])
        out[-1].append(s)
    return out


def summarize(steps: list[dict]) -> dict[str, dict[str, float]]:
    rows: dict[str, dict[str, list[float]]] = {}
    for prev, s in zip(steps, steps[1:], strict=False):
        r = rows.setdefault(s["kind"], {})
        for name, value in (
            ("gap", max(0.0, s["plan_in"] - prev["result_out"])),
            ("in_gpu", s["result_out"] - s["plan_in"]),
            ("launch_to_collect", s["elapsed"]),
            ("device", s["device"]),
            ("period", s["result_out"] - prev["result_out"]),
        ):
            r.setdefault(name, []).append(value)
        r.setdefault("graphed", []).append(float(s["graphed"]))
    return {
        kind: {"steps": len(v["period"]), "graphed_share": statistics.mean(v.pop("graphed"))}
        | {k: 1e3 * statistics.median(x) for k, x in v.items()}
        for kind, v in rows.items()
    }


def main(directory: str) -> None:
    for log in sorted(Path(directory).glob("gpu-*.tplog")):
        for i, seg in enumerate(_segments(steps_of(log))):
            print(f"{log.name} segment {i} ({len(seg)} steps), medians in ms:")
            for kind, row in summarize(seg).items():
                cells = ", ".join(
                    f"{v} steps" if k == "steps" else f"{k} {v:.3f}" for k, v in row.items()
                )
                print(f"  {kind:7s} {cells}")


if __name__ == "__main__":
    main(sys.argv[1])
