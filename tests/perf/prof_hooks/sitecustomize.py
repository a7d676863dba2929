"""Wall time per function in every taipan process, for a device run (not a test): put this
directory first on PYTHONPATH and set PROF_WRAP_OUT to a directory; each process that imports
the wrapped modules writes `<pid>.txt` there at exit (calls, total ms, mean, median and p90 µs,
max ms; by total).

Wrapped: PROF_WRAP (comma-separated `module:Class.method` or `module:function`), else TARGETS.
A wrapper costs ~0.3 µs a call; nested wrapped calls count in both.
"""

import atexit
import functools
import importlib.abc
import os
import sys
import time

TARGETS = (
    "taipan.actors.gpu.grammar_masks:GrammarMasks.masked",
    "taipan.actors.gpu.grammar_masks:GrammarMasks.check_later",
    "taipan.actors.gpu.grammar_masks:GrammarMasks.run_check",
    "taipan.actors.gpu.grammar_masks:GrammarMasks._rejected",
    "taipan.actors.gpu.grammar_masks:GrammarMasks.sampled",
    "taipan.actors.gpu.grammar_masks:GrammarMasks._checkable",
    "taipan.actors.gpu.grammar_check:void_of",
    "taipan.actors.gpu.grammar_check:top_candidates",
    "taipan.actors.gpu.grammar_masks:GrammarMasks._consume_last",
    "taipan.actors.gpu.grammar_check:first_allowed",
    "taipan.ops.grammar:Grammars.masks",
    "taipan.ops.grammar:apply_masks",
    "taipan.actors.gpu.host_staging:to_device",
    "taipan.actors.gpu.worker:ModelWorker._launch",
    "taipan.actors.gpu.worker:ModelWorker._tokens_to_host",
    "taipan.actors.gpu.sampling_controls:controlled_logits",
    "taipan.actors.gpu.worker:ModelWorker.collect",
    "taipan.actors.gpu.worker:ModelWorker.finish_check",
    "taipan.actors.gpu.worker:ModelWorker.launches_inline",
    "taipan.actors.gpu.worker:ModelWorker._forward_logits",
    "taipan.actors.gpu.worker:ModelWorker._sample",
    "taipan.actors.gpu.actor:GpuActor.on_step",
    "taipan.actors.engine.flow:StepFlow.on_result",
    "taipan.actors.engine.scheduler:Scheduler.schedule",
    "taipan.actors.engine.scheduler:Scheduler.update",
    "taipan.actors.engine.step:StepRunner.plan",
    "taipan.actors.engine.step:StepRunner.dispatch",
    "taipan.actors.engine.step:StepRunner.collect",
    "taipan.messages.codec:encode",
    "taipan.messages.codec:decode",
    "taipan.actors.gpu.forward:plan_arrays",
    "taipan.actors.gpu.buffers:StepBuffers.stage",
    "taipan.actors.gpu.logprobs:log_prob_arrays",
    "taipan.actors.gpu.plan_checks:check_prev_rows",
    "taipan.actors.gpu.plan_checks:check_sampling_controls",
    "taipan.actors.gpu.plan_checks:check_logprobs_mode",
    "taipan.actors.gpu.plan_checks:check_local_kv",
    "taipan.actors.gpu.plan_checks:check_mamba_slots",
    "taipan.actors.gpu.worker:ModelWorker._bucket",
    "taipan.actors.engine.wire:step_plan",
)
# Marks of the calling thread's CPU time at each call of this one (the engine's step loop):
# `_dump` gives the share of wall time that thread was on a CPU between steps < 20 ms apart.
MARK = "taipan.actors.engine.scheduler:Scheduler.schedule"
marks: list = []
OUT = os.environ.get("PROF_WRAP_OUT")
totals: dict = {}


def _wrap(owner, attr: str, label: str, full: str) -> None:
    fn = getattr(owner, attr)

    marked = full == MARK

    @functools.wraps(fn)
    def timed(*a, **k):
        start = time.perf_counter()
        if marked:
            marks.append((start, time.thread_time()))
        try:
            return fn(*a, **k)
        finally:
            totals.setdefault(label, []).append(time.perf_counter() - start)

    if __import__("inspect").iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def timed(*a, **k):  # noqa: F811 (an async target: its awaits count)
            start = time.perf_counter()
            try:
                return await fn(*a, **k)
            finally:
                totals.setdefault(label, []).append(time.perf_counter() - start)

    setattr(owner, attr, timed)


def _targets() -> dict:
    spec = os.environ.get("PROF_WRAP")
    out: dict = {}
    for item in spec.split(",") if spec else TARGETS:
        module, _, path = item.partition(":")
        out.setdefault(module, []).append(path)
    return out


class _After(importlib.abc.MetaPathFinder):
    def __init__(self, targets: dict) -> None:
        self.targets = targets

    def find_spec(self, name, path, target=None):
        if name not in self.targets:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        loader, paths = spec.loader, self.targets[name]

        class Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                for p in paths:
                    parts = p.split(".")
                    owner = module
                    for part in parts[:-1]:
                        owner = getattr(owner, part)
                    _wrap(owner, parts[-1], f"{name.rpartition('.')[2]}:{p}", f"{name}:{p}")

        spec.loader = Loader()
        return spec


def _busy() -> str:
    wall = cpu = 0.0
    for (w0, c0), (w1, c1) in zip(marks, marks[1:], strict=False):
        if w1 - w0 < 0.02:
            wall, cpu = wall + w1 - w0, cpu + c1 - c0
    if not wall:
        return ""
    return f"step loop thread on a CPU {100 * cpu / wall:.1f} % of {wall:.3f} s between steps\n"


def _dump() -> None:
    if not totals:
        return
    rows = sorted(totals.items(), key=lambda kv: -sum(kv[1]))
    with open(os.path.join(OUT, f"{os.getpid()}.txt"), "w") as f:
        f.write(" ".join(sys.argv[:2]) + "\n" + _busy())
        f.write("   calls   total ms   mean us median us    p90 us    max ms\n")
        for label, d in rows:
            d = sorted(d)
            n, s = len(d), sum(d)
            f.write(
                f"{n:8d} {s * 1e3:10.1f} {s / n * 1e6:9.1f} {d[n // 2] * 1e6:9.1f} "
                f"{d[n * 9 // 10] * 1e6:9.1f} {d[-1] * 1e3:9.2f}  {label}\n"
            )


if OUT:
    import importlib.util

    sys.meta_path.insert(0, _After(_targets()))
    atexit.register(_dump)
