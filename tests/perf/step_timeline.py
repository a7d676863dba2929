"""Lay a recorded runtime's decode steps out in time (device tool helper, not a test):

    python3 tests/perf/step_timeline.py DIR [GAP_MS]   (DIR: `taipan bench ... --record DIR`)

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
share the logs; steps more than a second apart (or GAP_MS, the second argument: a bench's
rounds) start a new segment, printed apart with its span, its first and last 8 steps' share and
the middle's ms a step. A step with grammar rows is its kind's "+grammar".
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import numpy as np

from taipan.actors.record import read_log
from taipan.messages.codec import decode
from taipan.messages.gpu import StepPlan, StepResult

SEGMENT_GAP_S = 1.0  # (argv[2], in ms, cuts at shorter gaps: e.g. a bench's rounds)


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
            if len(msg.grammar_rows) and (msg.grammar_rows >= 0).any():
                kind += "+grammar"
            by_step[msg.step] = {"plan_in": rec.time, "kind": kind, "seqs": len(msg.seq_lens)}
        elif isinstance(msg, StepResult) and rec.direction == "out" and msg.step in by_step:
            by_step[msg.step].update(
                result_out=rec.time,
                elapsed=msg.forward_seconds,
                graphed=msg.graphed,
                device=msg.device_seconds,
            )
    return [s for _, s in sorted(by_step.items()) if "result_out" in s]


def _segments(steps: list[dict], gap_s: float = SEGMENT_GAP_S) -> list[list[dict]]:
    out: list[list[dict]] = []
    for s in steps:
        if not out or s["plan_in"] - out[-1][-1]["result_out"] > gap_s:
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


def phases(seg: list[dict], edge: int = 8) -> str:
    """A segment's span and where it went: its first `edge` steps (requests arriving,
    prefills), the middle and its last `edge`, each as ms in total."""

    def span(a: int, b: int) -> float:
        part = seg[a:b]
        return 1e3 * (
            part[-1]["result_out"] - (seg[a - 1]["result_out"] if a else part[0]["plan_in"])
        )

    n = len(seg)
    if n <= 2 * edge:
        return f"span {span(0, n):.1f} ms"
    return (f"span {span(0, n):.1f} ms: first {edge} steps {span(0, edge):.1f}, middle "
            f"{span(edge, n - edge):.1f} ({span(edge, n - edge) / (n - 2 * edge):.3f} a step), "
            f"last {edge} {span(n - edge, n):.1f}")  # fmt: skip


def main(directory: str, gap_ms: float | None = None) -> None:
    gap_s = SEGMENT_GAP_S if gap_ms is None else gap_ms / 1e3
    for log in sorted(Path(directory).glob("gpu-*.tplog")):
        for i, seg in enumerate(_segments(steps_of(log), gap_s)):
            print(f"{log.name} segment {i} ({len(seg)} steps), {phases(seg)}; medians in ms:")
            for kind, row in summarize(seg).items():
                cells = ", ".join(
                    f"{v} steps" if k == "steps" else f"{k} {v:.3f}" for k, v in row.items()
                )
                print(f"  {kind:7s} {cells}")


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else None)
