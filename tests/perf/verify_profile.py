"""Where a speculative verify step's time goes, next to a plain decode step's (device tool
helper; not a test).

Usage: python3 tests/perf/verify_profile.py [MODEL] [K] [BATCH ...] (default smollm2, 4, 1 8).
The worker loads as a speculative config loads it (decode and mixed CUDA graphs, every token's
hidden state kept in the mixed ones). For each batch: B sequences of 256 cached tokens decode
one token (the decode graph), then verify K drafts each (K + 1 query tokens, a mixed graph,
greedy), each timed with CUDA events over 30 steps (host + device, as the gpu actor's launch
and collect), with the step's device part; then the same rows chained (actors/gpu/chain.py:
8 inner verify steps a plan, a periodic history the n-gram rule drafts from): ms an inner step
and tokens gained a row each; then one verify step under the torch profiler (CPU and CUDA):
the host calls and the kernels that take its time (with VERIFY_TRACE_DIR set, the verify and
decode steps' Chrome traces there: tests/perf/trace_gaps.py reads them).
"""

from __future__ import annotations

import dataclasses
import os
import sys

import numpy as np
import torch

from taipan.actors.gpu.worker import ModelWorker
from taipan.messages.gpu import LoadModel
from taipan.models import resolve
from tests.perf.gpu_profile import BLOCK, CTX, plan

SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def verify_plan(step: int, batch: int, k: int, tables: np.ndarray):
    """B sequences whose last K + 1 tokens (one known, K drafts) end at position CTX - 1."""
    q = k + 1
    base = plan(step, batch, CTX, tables)
    pos = np.concatenate([np.arange(CTX - q, CTX) for _ in range(batch)]).astype(np.int32)
    blocks = tables[np.repeat(np.arange(batch), q), pos // BLOCK].astype(np.int64)
    return dataclasses.replace(
        base,
        input_ids=(np.arange(batch * q) % 1000).astype(np.int32),
        positions=pos,
        slot_mapping=blocks * BLOCK + pos % BLOCK,
        query_start_loc=np.arange(0, batch * q + 1, q, dtype=np.int32),
        prompt_targets=np.full(batch * q, -1, dtype=np.int32),
        num_drafts=np.full(batch, k, dtype=np.int32),
    )


def chain_plan(step: int, batch: int, k: int, tables: np.ndarray, steps: int = 8):
    """verify_plan's rows chained (StepPlan.chain_steps = `steps`): each row's known tokens a
    pattern of period 7 (the n-gram rule always drafts; a model that copies the pattern
    accepts), ending with its last known token."""
    v = verify_plan(step, batch, k, tables)
    q = k + 1
    history = []
    for i in range(batch):
        h = (np.arange(CTX - q + 1) % 7 + 300 + 10 * i).astype(np.int32)
        history.append(h)
    ids = v.input_ids.copy()
    for i, h in enumerate(history):  # (its last known token, then the pattern's next k)
        ids[i * q : (i + 1) * q] = np.arange(CTX - q, CTX) % 7 + 300 + 10 * i
        assert ids[i * q] == h[-1]
    return dataclasses.replace(
        v,
        input_ids=ids,
        chain_steps=steps,
        chain_ngram=np.asarray([1, 4, k], np.int32),
        chain_history=np.concatenate(history),
        chain_history_loc=np.arange(batch + 1, dtype=np.int32) * len(history[0]),
        chain_limit=np.full(batch, 1024, np.int32),
        chain_capacity=np.full(batch, tables.shape[1] * BLOCK, np.int32),
        chain_stops=np.zeros(0, np.int32),
        chain_stops_loc=np.zeros(batch + 1, np.int32),
    )


def prefill(w: ModelWorker, p) -> None:
    """The KV of a chain plan's known tokens before its rows (its history but the last known
    token), one eager prefill step, so that the model sees the pattern it may copy."""
    hist, loc = p.chain_history, p.chain_history_loc
    batch = len(loc) - 1
    tables = p.block_tables
    ids = np.concatenate([hist[loc[i] : loc[i + 1] - 1] for i in range(batch)])
    lens = np.diff(loc) - 1
    pos = np.concatenate([np.arange(n) for n in lens]).astype(np.int64)
    owner = np.repeat(np.arange(batch), lens)
    first = plan(0, batch, CTX, tables)
    w.step(
        dataclasses.replace(
            first,
            input_ids=ids.astype(np.int32),
            positions=pos.astype(np.int32),
            slot_mapping=tables[owner, pos // BLOCK].astype(np.int64) * BLOCK + pos % BLOCK,
            query_start_loc=np.concatenate([[0], np.cumsum(lens)]).astype(np.int32),
            seq_lens=lens.astype(np.int32),
            sample=np.zeros(batch, np.int8),
            prompt_targets=np.full(len(ids), -1, np.int32),
        )
    )


def timed_chain(w: ModelWorker, p, n: int = 10) -> tuple[float, float]:
    """(median ms per inner step of a chain, host + device; mean tokens a row gains per inner
    step). Each chain starts from the same KV (its inner steps write past the history)."""
    prefill(w, p)
    w.step(p)
    per_step, gains = [], []
    for ms, r in _event_timed(w, p, n):
        ran = int((r.spec_chain[:, :, 0] >= 0).any(axis=0).sum())
        per_step.append(ms / ran)
        gains.append((r.spec_tokens >= 0).sum() / (len(r.spec_tokens) * ran))
    return float(np.median(per_step)), float(np.mean(gains))


def _event_timed(w: ModelWorker, p, n: int) -> list:
    """`n` steps of `p`, each timed with CUDA events (host + device): [(ms, StepResult)]."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(True), torch.cuda.Event(True)
    out = []
    for _ in range(n):
        start.record()
        r = w.step(p)
        end.record()
        end.synchronize()
        assert r.error is None, r.error
        out.append((start.elapsed_time(end), r))
    return out


def timed(w: ModelWorker, p, n: int = 30) -> tuple[float, float, bool]:
    """(median ms per step, host + device; median device ms; graphed)."""
    for _ in range(3):
        w.step(p)
    steps = _event_timed(w, p, n)
    walls = [ms for ms, _ in steps]
    devs = [r.device_seconds * 1e3 for _, r in steps]
    return float(np.median(walls)), float(np.median(devs)), steps[-1][1].graphed


def profile(w: ModelWorker, p, trace: str | None = None) -> None:
    """The host calls and kernels of 5 steps of `p`; with `trace`, their timeline too (a
    Chrome trace: tests/perf/trace_gaps.py reads where the device waits)."""
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(5):
            w.step(p)
        torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(trace)
    avg = prof.key_averages()
    cpu = sorted(avg, key=lambda e: -e.self_cpu_time_total)[:16]
    print("  host (self CPU per verify step):")
    for e in cpu:
        print(f"    {e.self_cpu_time_total / 5e3:7.3f} ms x{e.count // 5:<4} {e.key[:80]}")
    gpu = sorted((e for e in avg if e.self_device_time_total > 0),
                 key=lambda e: -e.self_device_time_total)[:12]  # fmt: skip
    total = sum(e.self_device_time_total for e in avg) / 5e3
    print(f"  kernels ({total:.3f} ms GPU per verify step):")
    for e in gpu:
        print(f"    {e.self_device_time_total / 5e3:7.3f} ms x{e.count // 5:<4} {e.key[:80]}")


def main(model: str, k: int, batches: list[int]) -> None:
    w = ModelWorker()
    w.load(
        LoadModel(
            resolve(model)[1],
            "bfloat16",
            "cuda",
            BLOCK,
            4096,
            8.0,
            4096,
            256,
            2560,
            SIZES,
            SIZES,
            speculative=True,
        )  # fmt: skip
    )
    for b in batches:
        tables = np.arange(b * 10, dtype=np.int32).reshape(b, 10)
        dec = timed(w, plan(1, b, CTX, tables))
        ver = timed(w, verify_plan(2, b, k, tables))
        print(f"{model} batch {b}: decode step {dec[0]:.3f} ms (device {dec[1]:.3f}, graphed "
              f"{dec[2]}); verify k={k} step {ver[0]:.3f} ms (device {ver[1]:.3f}, graphed "
              f"{ver[2]}): {ver[0] / dec[0]:.2f}x")  # fmt: skip
        inner, gain = timed_chain(w, chain_plan(4, b, k, tables))
        print(f"  chained (8 inner verify steps a plan): {inner:.3f} ms an inner step, "
              f"{gain:.2f} tokens a row each: {inner / gain:.3f} ms a token against "
              f"{dec[0]:.3f} decoding ({dec[0] * gain / inner:.2f}x)")  # fmt: skip
        profile(w, verify_plan(3, b, k, tables), _trace(f"verify_b{b}"))
        if TRACE_DIR:  # (the decode step's timeline beside it)
            profile(w, plan(5, b, CTX, tables), _trace(f"decode_b{b}"))


TRACE_DIR = os.environ.get("VERIFY_TRACE_DIR")  # Chrome traces of the profiled steps go here


def _trace(name: str) -> str | None:
    return os.path.join(TRACE_DIR, name + ".json") if TRACE_DIR else None


if __name__ == "__main__":
    args = sys.argv[1:]
    main(
        args[0] if args else "smollm2",
        int(args[1]) if len(args) > 1 else 4,
        [int(x) for x in args[2:]] or [1, 8],
    )
