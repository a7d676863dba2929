"""Bad input never stops the runtime; SIGTERM leaves no process or socket file behind."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq

from taipan.client import Client
from taipan.launcher import Runtime
from taipan.messages import decode, encode
from taipan.messages.allocator import BlockOps
from taipan.messages.common import ErrorReply
from taipan.messages.requests import RequestOutput, SamplingParams, SubmitRequest
from taipan.models import ModelNotFoundError


def test_garbage_frames_do_not_stop_the_coordinator(runtime, client):
    rng = random.Random(7)
    valid = encode(SubmitRequest(1, np.arange(3, dtype=np.int32), SamplingParams(), False))[0]
    garbage = [
        [b""],
        [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))],
        [valid[: len(valid) // 2]],  # truncated
        [msgpack.packb([20, 1, "not", "enough"])],
        [msgpack.packb([9999, 1])],  # unknown tag
        [msgpack.packb([20, 99, 1, 2, 3, 4])],  # wrong version
        [msgpack.packb({"a": 1})],
        [valid, b"extra frame that nothing refers to"],
        encode(BlockOps(1, *(np.zeros(0, np.int64),) * 2, np.zeros(0, np.int32))),  # wrong actor
    ]
    for _ in range(20):
        garbage.append([bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))])
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10000)
    sock.connect(runtime.address)
    try:
        for frames in garbage:
            sock.send_multipart(frames)
        # Every undecodable or misdirected message gets an ErrorReply; the one valid submission
        # (its extra frame is ignored) gets its terminal output. Read until both are in (the
        # generation may be slow on a loaded box: no fixed quiet period ends it), then a
        # little longer for any reply too many.
        replies, deadline = [], time.monotonic() + 120

        def kinds():
            errors = [r for r in replies if isinstance(r, ErrorReply)]
            outputs = [r for r in replies if isinstance(r, RequestOutput)]
            return errors, outputs

        while time.monotonic() < deadline:
            errors, outputs = kinds()
            if len(errors) >= len(garbage) - 1 and any(o.finished for o in outputs):
                break
            if sock.poll(500):
                replies.append(decode(sock.recv_multipart()))
        while sock.poll(500):
            replies.append(decode(sock.recv_multipart()))
        errors, outputs = kinds()
        assert len(errors) == len(garbage) - 1
        assert len(outputs) == 1 and outputs[0].finished
    finally:
        sock.close()
        ctx.term()
    [ok] = client.generate(["Still here?"], SamplingParams(max_tokens=4, temperature=0))
    assert ok.token_ids and ok.finish_reason in ("stop", "length")


def test_unknown_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no such file"):
        Runtime(str(tmp_path / "missing.gguf"))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "taipan.cli",
            "generate",
            "--model",
            str(tmp_path / "x.gguf"),
            "--prompt",
            "hi",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "taipan: error: model" in done.stderr and "Traceback" not in done.stderr


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                out.append(int(entry))
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigterm_mid_generation_leaves_nothing_behind(tmp_path, model_path):
    address = f"ipc://{tmp_path}/front.sock"
    serve = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "taipan.cli",
            "serve",
            "--model",
            model_path,
            "--address",
            address,
            "--set",
            "max_sequence_length=1024",
            "--set",
            "block_size_tokens=16",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        client = Client(address, connect_timeout=120)
        children = _children(serve.pid)
        assert len(children) == 2  # coordinator + one engine
        with open(f"/proc/{children[0]}/cmdline") as f:
            spec = json.loads(f.read().split("\0")[4])
        ipc_dir = os.path.dirname(spec["backend"][len("ipc://") :])
        assert os.path.isdir(ipc_dir)
        deltas = []
        generating = threading.Event()

        def consume():
            sampling = SamplingParams(max_tokens=900, ignore_eos=True)
            for d in client.stream("Tell me a long story.", sampling):
                deltas.append(d)
                if len(deltas) == 3:
                    generating.set()

        t = threading.Thread(target=consume)
        t.start()
        assert generating.wait(60), "generation did not start"
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(60) == 0
        t.join(30)
        assert deltas[-1].finished and deltas[-1].finish_reason == "abort"
        client.close()
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
    assert not [p for p in children if _alive(p)]
    assert "Traceback" not in serve.stderr.read()
    assert not os.path.exists(ipc_dir)


def test_sigterm_while_starting_stops_cleanly(model_path):
    """A SIGTERM while `taipan serve` starts (its processes spawned, the model loading) shuts
    the runtime down: exit 0, no child left (a stop asked for, not a crash)."""
    serve = subprocess.Popen(
        [sys.executable, "-m", "taipan.cli", "serve", "--model", model_path],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        children = _children(serve.pid)
        while not children and time.monotonic() < deadline:  # (the start is under way)
            time.sleep(0.02)
            children = _children(serve.pid)
        assert children and serve.poll() is None
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(60) == 0, serve.stderr.read()[-2000:]
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
    deadline = time.monotonic() + 10
    while [p for p in children if _alive(p)] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in children if _alive(p)]
