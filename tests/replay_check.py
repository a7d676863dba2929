"""`taipan replay DIR --check` as the end-to-end tests run it over a recorded session."""

from __future__ import annotations

import subprocess
import sys


def replay_check(rec, *args: str, allow_unchecked: bool = True) -> str:
    """Replay the log folder `rec` with --check (and `args`); assert it passed; its stdout."""
    cmd = [sys.executable, "-m", "taipan.cli", "replay", str(rec), "--check", *args]
    if allow_unchecked:
        cmd.append("--allow-unchecked")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout
