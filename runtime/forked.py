"""The launcher's children forked from a server process that imported torch once
(runtime/children.py `use_fork_server`): what the test suite uses, which starts hundreds of
runtimes on a 2-core machine where each child's own `import torch` was ~2 s.

`spawn_forked(*args)` runs what `python -m taipan.procs ARGS...` runs, in a child of
multiprocessing's fork server (started once per launcher process, PRELOAD imported there: of
ours only the wire, so module-level settings such as TAIPAN_FUSED_GEMV are read by each child
as it imports the rest of taipan). The child gets the launcher's environment and its stdout /
stderr as they are at the call (as a subprocess would), and runs the role's main; its exit
status is the one the main gives (a code, or the signal that killed it). The handle has the
slice of subprocess.Popen's interface runtime/children.py uses: pid, poll, wait
(TimeoutExpired), returncode, send_signal, terminate, kill.

The child's parent is the fork server, not the launcher: PR_SET_PDEATHSIG (procs.py) fires when
the server ends, which it does as soon as the launcher process ends (it watches a pipe the
launcher holds), so children still die with their launcher. A forked engine starts its
tensor-parallel followers as plain subprocesses (`use_fork_server` is this process's choice).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import multiprocessing.context
import multiprocessing.popen_forkserver
import multiprocessing.process
import multiprocessing.spawn
import os
import runpy
import signal
import subprocess
import sys
import threading
from multiprocessing import reduction

# What the fork server imports once for every child: third-party packages (their import reads
# no setting of ours), and the wire (taipan.messages: plain message types, reads no setting).
# structlog imports rich where it is installed (as with the test extras); with triton, gguf
# and the wire that was ~1.6 s of CPU per runtime in its children (py-spy, 2-core box).
PRELOAD = [
    "torch",
    "numpy",
    "zmq",
    "msgpack",
    "structlog",
    "triton",
    "triton.language",
    "gguf",
    "tokenizers",
    "uvloop",
    "taipan.messages",
]

_lock = threading.Lock()  # one child sent at a time
_preloaded = False


def _forkserver() -> None:
    """The fork server imports PRELOAD (it starts with the first child)."""
    global _preloaded
    with _lock:
        if not _preloaded:
            multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
            _preloaded = True


@contextlib.contextmanager
def _without_main():
    """multiprocessing prepares a child as `spawn` does, re-running the parent's __main__ (a
    script's whole body) in it: our children run taipan.procs and nothing of the parent's, so
    that step is left out while a child is sent (under `_lock`: the patch is the module's)."""
    real = multiprocessing.spawn.get_preparation_data

    def prepared(name):
        data = real(name)
        data.pop("init_main_from_path", None)
        data.pop("init_main_from_name", None)
        return data

    multiprocessing.spawn.get_preparation_data = prepared
    try:
        yield
    finally:
        multiprocessing.spawn.get_preparation_data = real


class _Popen(multiprocessing.popen_forkserver.Popen):
    def _launch(self, process_obj):
        with _lock, _without_main():
            super()._launch(process_obj)


class _Process(multiprocessing.context.ForkServerProcess):
    @staticmethod
    def _Popen(process_obj):
        return _Popen(process_obj)


class _Fd:
    """A file descriptor of the launcher, handed to the child when the process is sent to the
    fork server (multiprocessing passes it along with the request)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _received_fd, (reduction.DupFd(self.fd),)


def _received_fd(dup) -> int:
    return dup.detach()


def _child_main(args: list[str], env: dict[str, str], stdout: int, stderr: int) -> None:
    """In the forked child: the launcher's stdio and environment, then the role's main."""
    for fd, target in ((stdout, 1), (stderr, 2)):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=True)
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # (procs.main sets its own)
    sys.argv = ["taipan.procs", *args]
    runpy.run_module("taipan.procs", run_name="__main__")  # (as `python -m taipan.procs`)


class ForkedProcess:
    """A forked child, with the part of subprocess.Popen's interface children.py uses. Its exit
    status is read once, under a lock (two threads may wait on it: the watcher and `stop`)."""

    def __init__(self, process: multiprocessing.process.BaseProcess, args: tuple[str, ...]):
        self._process = process
        self.args = ["taipan.procs", *args]
        self.pid = process.pid
        self._poll_lock = threading.Lock()
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            if not multiprocessing.connection.wait([self._process.sentinel], 0):
                return None
            with self._poll_lock:
                if self.returncode is None:
                    self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not multiprocessing.connection.wait([self._process.sentinel], timeout):
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.poll()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def spawn_forked(*args: str) -> ForkedProcess:
    """`python -m taipan.procs ARGS...`, forked from the fork server (the module docstring)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    _forkserver()
    process = _Process(
        target=_child_main,
        args=(list(args), env, _Fd(1), _Fd(2)),
        name=f"taipan.procs {args[0]}",
        daemon=True,
    )
    process.start()
    # Its exit status is read by ForkedProcess alone: multiprocessing's own bookkeeping polls
    # its children from whichever thread starts the next one, and a second reader of the
    # status pipe would see it empty.
    multiprocessing.process._children.discard(process)
    return ForkedProcess(process, args)
