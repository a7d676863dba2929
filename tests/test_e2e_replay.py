"""Record a real session (`--record`), then `taipan replay --check` it, intact and altered."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest

from messages import decode, encode
from messages.allocator import BlockOpsReply
from messages.requests import SamplingParams
from runtime.client import Client
from runtime.config import InferenceConfig
from runtime.launcher import Runtime
from runtime.record import Recorder, read_log
from tests.conftest import TEST_CONFIG


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, model_path):
    rec = tmp_path_factory.mktemp("rec")
    with Runtime(model_path, InferenceConfig(**TEST_CONFIG), record_dir=str(rec)) as rt:
        with Client(rt.address) as c:
            c.generate(
                [f"Count to {i}:" for i in range(6)], SamplingParams(max_tokens=20, temperature=0)
            )
            c.generate(["One more"], SamplingParams(max_tokens=5, temperature=0.7, seed=3))
    return rec


def replay(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "runtime.cli", "replay", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_every_actor_is_recorded(recorded):
    names = sorted(p.stem for p in recorded.glob("*.tplog"))
    assert names == ["allocator-0", "coordinator", "engine-0", "gpu-0"]


def test_check_passes_on_recorded_session(recorded):
    done = replay(recorded, "--check")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "allocator-0" in done.stdout and "ok" in done.stdout


def test_timeline_filters_by_actor_and_type(recorded):
    done = replay(recorded, "--actor", "coordinator", "--type", "SubmitRequest")
    assert done.returncode == 0
    lines = [x for x in done.stdout.splitlines() if x.strip()]
    assert len(lines) == 7 and all("SubmitRequest" in x for x in lines)


def test_check_fails_on_altered_allocator_log(recorded, tmp_path):
    altered = tmp_path / "altered"
    changed = False
    with Recorder(altered, "allocator-0") as out:
        for r in read_log(recorded / "allocator-0.tplog"):
            frames = [bytes(f) for f in r.frames]
            msg = decode(frames)
            if not changed and r.direction == "out" and isinstance(msg, BlockOpsReply):
                if len(msg.block_ids):
                    ids = np.asarray(msg.block_ids).copy()
                    ids[0] += 1
                    frames = encode(dataclasses.replace(msg, block_ids=ids))
                    changed = True
            out.write(r.direction, r.channel, r.peer, frames, r.time)
    assert changed
    done = replay(altered, "--check")
    assert done.returncode == 1
    assert "allocator-0" in done.stdout + done.stderr
    assert "Traceback" not in done.stderr
