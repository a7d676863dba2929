"""The launcher's children (runtime/children.py): a signal handler wrapped by `deferring` runs
after a spawn under way has listed its child, never between the child's start and its
listing (a `taipan serve` shut down by SIGTERM while starting leaves no child behind)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import taipan.children as children_module
from taipan.children import Children, deferring


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
