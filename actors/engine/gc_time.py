"""How long this process has spent in Python's garbage collector: `GcTime`, fed by
`gc.callbacks`. The engine reports it (RankStats.gc_seconds_total): a collection stops every
thread of the engine process (the engine, its allocator and gpu actors), and a step that waits
for one is time the GPU may idle. Touches nothing but its own counters."""

from __future__ import annotations

import gc
import time


class GcTime:
    """Seconds and collections of the garbage collector since construction (every generation,
    in any thread of the process). `close` stops counting."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.collections = 0
        self._began: float | None = None
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        # The collector is not reentrant and runs under the GIL: "start" and "stop" pair up.
        if phase == "start":
            self._began = time.perf_counter()
        elif self._began is not None:
            self.seconds += time.perf_counter() - self._began
            self.collections += 1
            self._began = None

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
