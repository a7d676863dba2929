"""runtime/forked.py: children forked from the fork server behave as `python -m taipan.procs`
subprocesses do where the launcher looks (runtime/children.py): exit codes and signals in
Popen's convention, the caller's stderr, waits with timeouts from two threads at once; and the
caller's __main__ is not run again in them. (Every end-to-end test in this suite uses them:
tests/conftest.py calls use_fork_server.)"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import pytest

from taipan.forked import ForkedProcess, _forkserver, _Process, spawn_forked


def test_a_bad_role_exits_1_naming_it_on_the_callers_stderr(capfd):
    proc = spawn_forked("no-such-role", "{}")
    assert proc.wait(60) == 1 and proc.poll() == 1 and proc.returncode == 1
    assert "unknown role 'no-such-role'" in capfd.readouterr().err


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def test_signals_and_waits_follow_popen():
    proc = ForkedProcess(_Process(target=_sleep, args=(60,), daemon=True), ("sleep",))
    proc._process.start()
    proc.pid = proc._process.pid
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.1)
    seen = []
    watcher = threading.Thread(target=lambda: seen.append(proc.wait()))  # (a launcher's watcher)
    watcher.start()
    proc.kill()
    assert proc.wait(30) == -signal.SIGKILL
    watcher.join(30)
    assert seen == [-signal.SIGKILL]
    proc.terminate()  # (gone: nothing happens)


def test_the_callers_main_script_is_not_run_again_in_the_child(tmp_path):
    script = tmp_path / "launch.py"
    script.write_text(
        "from taipan.forked import spawn_forked\n"
        "print('body ran', flush=True)\n"
        "print('exit', spawn_forked('no-such-role', '{}').wait(60), flush=True)\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.stdout.count("body ran") == 1 and "exit 1" in out.stdout, out


def _threads_after_pinning() -> None:
    import torch

    from taipan.procs import _pin_cpus

    _pin_cpus([0])
    sys.exit(torch.get_num_threads())


def test_a_pinned_child_runs_as_many_torch_threads_as_its_cores():
    """torch is loaded before the fork: an engine rank pinned to its cores sets torch's
    threads itself (OMP_NUM_THREADS is read only when torch loads; two ranks of two threads
    each on one core were 5-10x slower)."""
    _forkserver()
    proc = ForkedProcess(_Process(target=_threads_after_pinning, daemon=True), ("pin",))
    proc._process.start()
    assert proc.wait(60) == 1
