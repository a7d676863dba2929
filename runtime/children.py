"""Child processes: start `python -m taipan.procs ROLE ...`, watch each one, stop them.

Two owners use it. The launcher (runtime/launcher.py) keeps its children in a `Children`: each
is watched by a thread of its own (a blocking wait, no polling); one that exits while the
runtime is not stopping is logged as an error naming it and how it ended (`describe_exit`) and
listed in `unexpected_exits`, and the callbacks registered with `on_exit` are told. `stop` ends
them with escalating signals. An engine rank's process (runtime/procs.py) keeps the rank's T-1
tensor-parallel followers in a `FollowerProcesses`: a follower that dies ends the rank at once
(`exit_now(EXIT_PEER_DIED)`: the leader may be blocked in a collective waiting for it).
Knows nothing of sockets or messages; every child gets its spec on the command line.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

from taipan.actors.log import get_logger

EXIT_FATAL = 3  # an actor raised FatalError: it logged why; the launcher reports the code
EXIT_PEER_DIED = 4  # a tensor-parallel peer of this rank (a follower, or the leader) is gone
FOLLOWER_STOP_S = 5.0  # a follower told to stop (SIGTERM) is killed after this


def describe_exit(code: int | None) -> str:
    """'exited with code 3', 'killed by signal SIGKILL', ... for a Popen returncode."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def exit_now(code: int) -> None:
    """Leave at once (no interpreter shutdown, which would join a thread stuck in a collective)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def spawn(*args: str) -> subprocess.Popen:
    """Start `python -m taipan.procs ARGS...` (unbuffered, so its log lines arrive as written)."""
    cmd = [sys.executable, "-m", "taipan.procs", *args]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)


_fork_server = False  # use_fork_server


def use_fork_server(on: bool = True) -> None:
    """From now on, this process's launchers fork their children from a server process that
    imported torch once (runtime/forked.py) instead of starting `python -m taipan.procs` for
    each (~2 s of CPU per child for torch alone). For a program that starts many runtimes:
    the test suite calls it (tests/conftest.py). Not inherited by other processes (a `taipan
    serve` started from here spawns as usual)."""
    global _fork_server
    _fork_server = on


class _Spawning:
    """Spawns under way in this process, and the signals `deferring` kept meanwhile."""

    def __init__(self):
        self.depth = 0
        self.pending: list[int] = []


_spawning = _Spawning()


def deferring(handler):
    """`handler` (a signal handler) run after any `Children.spawn` under way has listed its
    child, not in the middle of it."""

    def deferred(signum, frame):
        if _spawning.depth:
            _spawning.pending.append(signum)
            return
        handler(signum, frame)

    return deferred


class Children:
    """The launcher's child processes, by name ("coordinator", "engine-0", "http", ...), in the
    order they started."""

    def __init__(self):
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.unexpected_exits: list[tuple[str, int]] = []  # (child name, returncode)
        self.stopping = False  # set before any child is told to stop: their exits are expected
        self._callbacks: list = []
        self.log = get_logger(component="launcher")

    def spawn(self, name: str, *args: str) -> None:
        # A handler wrapped by `deferring` waits until the child is on the list: `taipan serve`
        # raises from its handler while it starts (cli.py), and a child started but not yet
        # listed would outlive the shutdown that follows. (Not a blocked signal mask: children
        # inherit it across exec.)
        _spawning.depth += 1
        try:
            if _fork_server:
                from taipan.forked import spawn_forked

                proc = spawn_forked(*args)
            else:
                proc = spawn(*args)
            self.procs.append((name, proc))
            threading.Thread(target=self._watch, args=(name, proc), daemon=True).start()
        finally:
            _spawning.depth -= 1
            if not _spawning.depth and _spawning.pending:
                signum, _spawning.pending = _spawning.pending[0], []
                signal.raise_signal(signum)  # (its handler runs now, the child listed)

    def _watch(self, name: str, proc: subprocess.Popen) -> None:
        proc.wait()  # a blocking wait in its own thread: no polling
        if not self.stopping:
            how = describe_exit(proc.returncode)
            self.log.error("child process died", child=name, pid=proc.pid, how=how)
            self.unexpected_exits.append((name, proc.returncode))
        for callback in list(self._callbacks):
            try:
                callback(name, proc.returncode)
            except RuntimeError:  # the waiting event loop has closed
                pass

    def on_exit(self, callback) -> None:
        """Call `callback(name, returncode)` (from a watcher thread) when a child ends."""
        self._callbacks.append(callback)

    def remove_on_exit(self, callback) -> None:
        self._callbacks.remove(callback)

    def alive(self, name: str | None = None) -> bool:
        """Whether any child (or the one called `name`) still runs."""
        return any(p.poll() is None for n, p in self.procs if name in (None, n))

    def terminate(self, name: str, timeout: float = 10.0) -> None:
        """SIGTERM the child `name` if it runs; SIGKILL it after `timeout`."""
        for n, proc in self.procs:
            if n == name and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()

    def stop(self, timeout: float, *, stopped: bool) -> None:
        """End every child: those `stopped` (told to by a message) get `timeout` to exit by
        themselves, then each step sends a signal and waits: SIGTERM, then SIGKILL."""
        self.stopping = True
        steps = [(None, timeout)] if stopped else []
        for sig, wait in [*steps, (signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)]:
            for _, proc in self.procs:
                if sig is not None and proc.poll() is None:
                    proc.send_signal(sig)
            for _, proc in self.procs:
                try:
                    proc.wait(wait)
                except subprocess.TimeoutExpired:
                    pass
            if not self.alive():
                break


class FollowerProcesses:
    """The T-1 tensor-parallel followers of rank `rank`, children of this engine process. Each
    is watched by a thread: one that exits with a non-zero code before `stop` ends this process
    at once, naming it (os._exit: the leader may be blocked in a collective waiting for it)."""

    def __init__(self, spec, rank: int):
        self.rank, self.stopping = rank, False
        self.log = get_logger(process="engine", rank=rank)
        self.procs: list[tuple[int, subprocess.Popen]] = []
        for tp_rank in range(1, spec.tensor_parallel_size):
            # From the main thread: PR_SET_PDEATHSIG fires when the spawning thread ends.
            proc = spawn("tp-follower", spec.to_json(), str(rank), str(tp_rank))
            self.procs.append((tp_rank, proc))
            threading.Thread(target=self._watch, args=(tp_rank, proc), daemon=True).start()

    def _watch(self, tp_rank: int, proc: subprocess.Popen) -> None:
        proc.wait()  # a blocking wait in its own thread: no polling
        # `stop` reports it; exit 0 comes only after the leader's goodbye (the rank stops).
        if self.stopping or proc.returncode == 0:
            return
        self._report(tp_rank, proc)
        exit_now(EXIT_PEER_DIED)

    def _report(self, tp_rank: int, proc: subprocess.Popen) -> None:
        self.log.critical(
            "a tensor-parallel follower died: this engine rank ends",
            follower=f"gpu-{self.rank}-tp{tp_rank}",
            pid=proc.pid,
            how=describe_exit(proc.returncode),
        )

    def stop(self) -> bool:
        """Stop every follower (SIGTERM, SIGKILL after FOLLOWER_STOP_S). True when one had
        ended by itself first (reported here: this process may be ending because of it, e.g.
        a collective failed when the peer's socket closed, before its watcher saw it exit)."""
        self.stopping = True
        for _, proc in self.procs:
            proc.terminate()  # a follower that already exited keeps its own exit status
        died, killed = False, set()
        for tp_rank, proc in self.procs:
            try:
                proc.wait(FOLLOWER_STOP_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                killed.add(tp_rank)
            if proc.returncode not in (0, -signal.SIGTERM) and tp_rank not in killed:
                self._report(tp_rank, proc)
                died = True
        return died
