"""actors/engine/gc_time.py: the garbage collector's time, as the engine reports it."""

from __future__ import annotations

import gc

from taipan.actors.engine.gc_time import GcTime


def test_counts_collections_until_closed():
    timer = GcTime()
    gc.collect()
    gc.collect(0)
    counted = timer.collections
    assert counted >= 2 and timer.seconds > 0
    timer.close()
    timer.close()  # (twice: no error)
    gc.collect()
    assert timer.collections == counted
