"""Engines on other hosts (issue 12 item 6), on one machine: `taipan serve --role coordinator`
and `taipan serve --role engine` processes in separate process groups, over tcp, authenticated
with CurveZMQ keys (`taipan keys`):

- two engine ranks join a coordinator bound to 0.0.0.0; a client with the keys gets the same
  greedy tokens as the session runtime, and both ranks serve;
- a client without keys gets no reply and the runtime keeps serving;
- a second engine claiming a live rank is refused and exits naming why;
- one engine's process group SIGKILLed: the coordinator shows it dead and serves on the other;
- SIGINT to the coordinator stops the runtime: the remaining engine exits 0;
- an engine whose coordinator vanishes exits within seconds, naming it;
- binding 0.0.0.0 without keys is refused before anything starts.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from taipan.actors.curve import load_client_keys, write_keys
from taipan.client import Client, RuntimeUnreachable
from taipan.messages.requests import SamplingParams
from tests.conftest import TEST_CONFIG
from tests.ports import free_ports

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
PROMPTS = ["The capital of France is", "Water boils at", "One, two, three,", "Hello, my"]


def _serve(model_path: str, *args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "taipan.cli", "serve", "--model", model_path, *args]
    cmd += [x for k, v in TEST_CONFIG.items() for x in ("--set", f"{k}={v}")]
    # Its own process group, as on another host: nothing here is its parent's business.
    return subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("keys") / "set"
    write_keys(directory)
    return str(directory)


@pytest.mark.slow  # (30 s on the 2-core box; make test-slow)
def test_engines_on_other_hosts_join_over_curve(model_path, keys, client):
    port = free_ports(2)
    coord = _serve(
        model_path,
        "--role", "coordinator", "--address", f"tcp://0.0.0.0:{port}",
        "--data-parallel-size", "2", "--keys", keys,
    )  # fmt: skip
    engine_args = ["--role", "engine", "--coordinator", f"tcp://127.0.0.1:{port + 1}"]
    engine_args += ["--data-parallel-size", "2", "--keys", keys]
    engines = [_serve(model_path, *engine_args, "--data-parallel-rank", str(r)) for r in (0, 1)]
    address = f"tcp://127.0.0.1:{port}"
    try:
        with Client(address, curve=load_client_keys(keys), connect_timeout=120) as c:
            want = [w.token_ids for w in client.generate(PROMPTS, GREEDY)]
            assert [d.token_ids for d in c.generate(PROMPTS, GREEDY)] == want
            stats = c.stats()
            assert [(r.rank, r.alive) for r in stats.ranks] == [(0, True), (1, True)]
            assert all(r.steps_total > 0 for r in stats.ranks)
            # No keys: no reply, within the client's timeout; the runtime serves on.
            start = time.monotonic()
            with pytest.raises((TimeoutError, RuntimeUnreachable)):
                Client(address, connect_timeout=2.0).close()
            assert time.monotonic() - start < 10.0
            assert [d.token_ids for d in c.generate(PROMPTS[:2], GREEDY)] == want[:2]
            # A second engine claiming rank 1 is refused, and exits saying why.
            dup = _serve(model_path, *engine_args, "--data-parallel-rank", "1")
            assert dup.wait(60) != 0
            assert "rank 1 is already served by a live engine" in dup.stderr.read()
            # Rank 1's host goes down: it is shown dead, rank 0 serves everything.
            os.killpg(engines[1].pid, signal.SIGKILL)
            engines[1].wait()
            deadline = time.monotonic() + 5.0
            while c.stats().ranks[1].alive:
                assert time.monotonic() < deadline, "rank 1 not declared dead within 5 s"
                time.sleep(0.1)
            assert [d.token_ids for d in c.generate(PROMPTS, GREEDY)] == want
        coord.send_signal(signal.SIGINT)  # PAUSE then STOP through the coordinator
        assert coord.wait(60) == 0
        assert engines[0].wait(60) == 0  # stopped by its coordinator: a clean exit
    finally:
        _stop(coord, *engines)
    err = engines[0].stderr.read()
    assert "joining" in err and "Traceback" not in err


@pytest.mark.slow  # (the default run stays under ~15 min on the 2-core CI box)
def test_an_engine_exits_when_its_coordinator_vanishes(model_path, keys):
    port = free_ports(2)
    coord = _serve(
        model_path, "--role", "coordinator", "--address", f"tcp://127.0.0.1:{port}", "--keys", keys
    )
    engine = _serve(
        model_path,
        "--role", "engine", "--coordinator", f"tcp://127.0.0.1:{port + 1}",
        "--data-parallel-rank", "0", "--keys", keys,
    )  # fmt: skip
    try:
        with Client(f"tcp://127.0.0.1:{port}", curve=load_client_keys(keys), connect_timeout=120):
            pass  # the runtime is up: the engine has joined
        os.killpg(coord.pid, signal.SIGKILL)
        killed = time.monotonic()
        assert engine.wait(30) != 0
        assert time.monotonic() - killed < 15.0
    finally:
        _stop(coord, engine)
    assert "the coordinator sent nothing for" in engine.stderr.read()


def test_binding_beyond_loopback_needs_keys(model_path):
    cmd = [sys.executable, "-m", "taipan.cli", "serve", "--model", model_path]
    cmd += ["--role", "coordinator", "--address", f"tcp://0.0.0.0:{free_ports(2)}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "taipan keys" in done.stderr and "Traceback" not in done.stderr
    cmd = [sys.executable, "-m", "taipan.cli", "serve", "--model", model_path, "--role", "engine"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--coordinator" in done.stderr, done.stderr
