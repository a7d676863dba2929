"""The launcher's children (runtime/children.py): a signal handler wrapped by `deferring` runs
after a spawn under way has listed its child, never between the child's start and its
listing (a `taipan serve` shut down by SIGTERM while starting leaves no child behind), and
`taipan serve`'s stop handler ends a start wherever the signal lands."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading

import pytest

import taipan.children as children_module
from taipan.children import Children, deferring
from taipan.cli import Terminated, stop_signal_handler


def test_a_signal_during_a_spawn_is_handled_once_the_child_is_listed(monkeypatch):
    kids = Children()
    seen = []

    def handler(signum, frame):
        seen.append((signum, len(kids.procs)))

    def spawn(*args):  # (a real child; the signal arrives while it is being started)
        proc = subprocess.Popen([sys.executable, "-c", "pass"])
        os.kill(os.getpid(), signal.SIGUSR1)
        assert not seen  # (kept until the spawn is over)
        return proc

    monkeypatch.setattr(children_module, "spawn", spawn)
    monkeypatch.setattr(children_module, "_fork_server", False)
    before = signal.signal(signal.SIGUSR1, deferring(handler))
    try:
        kids.spawn("child")
        assert seen == [(signal.SIGUSR1, 1)]
        os.kill(os.getpid(), signal.SIGUSR1)  # (outside a spawn: handled at once)
        assert seen == [(signal.SIGUSR1, 1)] * 2
    finally:
        signal.signal(signal.SIGUSR1, before)
        kids.stop(5.0, stopped=False)
    assert not kids.alive()


def test_a_sigterm_inside_an_event_loop_callback_still_stops_the_start():
    """`taipan serve`'s handler raises where the main thread is; in an asyncio callback of the
    start's wait (asyncio logs and drops an Exception there) the stop must still end the wait."""
    started, stop = threading.Event(), threading.Event()

    async def start():  # (the start's wait; the signal lands inside a loop callback)
        asyncio.get_running_loop().call_soon(os.kill, os.getpid(), signal.SIGTERM)
        await asyncio.sleep(10)

    before = signal.signal(signal.SIGTERM, stop_signal_handler(started, stop))
    try:
        with pytest.raises(Terminated):
            asyncio.run(start())
        started.set()
        os.kill(os.getpid(), signal.SIGTERM)  # (once started: the runtime is told to stop)
        assert stop.is_set()
    finally:
        signal.signal(signal.SIGTERM, before)
