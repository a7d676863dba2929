"""Recording a real allocator session over inproc zmq, reading it back, and `taipan replay`."""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio
import zmq
import zmq.asyncio

from taipan import replay
from taipan.actors.allocator.actor import AllocatorActor
from taipan.actors.channel import make_socket
from taipan.actors.record import (
    FILE_HEADER,
    RECORD_HEADER,
    LogError,
    Recorder,
    _record_header,
    read_log,
)
from taipan.messages.allocator import AllocatorInit, BlockOps, BlockOpsReply
from taipan.messages.codec import decode, encode
from taipan.messages.common import Heartbeat

REPO = Path(__file__).resolve().parents[1]


def ops(step, free=(), alloc=(), counts=()):
    return BlockOps(
        step,
        np.asarray(free, np.int64),
        np.asarray(alloc, np.int64),
        np.asarray(counts, np.int32),
    )


async def _session(directory: Path, name: str) -> None:
    """Engine side and allocator side both record; the engine sends one of everything."""
    ctx = zmq.asyncio.Context()
    address = f"inproc://replay-{name}"
    with Recorder(directory, name) as rec_alloc, Recorder(directory, "engine") as rec_engine:
        side = make_socket(ctx, zmq.PAIR, address, bind=True, name="engine", recorder=rec_alloc)
        engine = make_socket(
            ctx, zmq.PAIR, address, bind=False, name="allocator", recorder=rec_engine
        )
        actor = AllocatorActor(side, name=name)
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(actor.run())
                try:
                    for msg in [
                        AllocatorInit(8, 16),
                        ops(1, alloc=[100, 101], counts=[2, 3]),
                        b"\xc1garbage",  # raw frames the codec rejects
                        Heartbeat(1.5),  # a valid message the allocator does not take
                        ops(2, free=[100], alloc=[102], counts=[4]),
                        ops(3, alloc=[103], counts=[50]),  # too many: ok=False
                        ops(4, free=[101, 102]),
                    ]:
                        if isinstance(msg, bytes):
                            await engine.sock.send_multipart([msg])
                        else:
                            await engine.send(msg)
                        await asyncio.wait_for(engine.recv(), 5)
                finally:
                    actor.stop()
        finally:
            side.close()
            engine.close()
            ctx.term()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def session(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("rec")
    await _session(directory, "allocator")
    return directory


def replay_run(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    replay.add_arguments(parser)
    return replay.run(parser.parse_args([str(a) for a in argv]))


def copy_session(session: Path, dest: Path) -> Path:
    shutil.copytree(session, dest)
    return dest


# --- the log itself ------------------------------------------------------------------------------


def test_log_holds_every_message_in_order(session):
    recs = list(read_log(session / "allocator.tplog"))
    assert [r.direction for r in recs] == ["in", "out"] * 7
    assert recs[0].offset == FILE_HEADER.size
    assert all(r.channel == "engine" and r.peer is None for r in recs)
    assert type(decode(recs[0].frames)).__name__ == "AllocatorInit"
    assert recs[4].frames == (b"\xc1garbage",)
    engine = list(read_log(session / "engine.tplog"))
    assert len(engine) == 13  # the raw garbage bypassed the engine's channel
    assert all(b.time >= a.time for a, b in zip(engine, engine[1:], strict=False))


def test_recorder_appends_and_copies_frames(tmp_path):
    buf = bytearray(b"abc")
    with Recorder(tmp_path, "a") as rec:
        rec.write("in", "ch", b"peer", [memoryview(buf)], 1.0)
        buf[0] = ord("X")  # the caller reuses its buffer: the record must not change
    with Recorder(tmp_path, "a") as rec:
        rec.write("out", "ch", None, [b"d", b"e"], 2.0)
    recs = list(read_log(tmp_path / "a.tplog"))
    assert [(r.direction, r.peer, r.frames, r.time) for r in recs] == [
        ("in", b"peer", (b"abc",), 1.0),
        ("out", None, (b"d", b"e"), 2.0),
    ]
    # Only this user may read it: logs hold prompts, outputs and control tokens.
    assert (tmp_path / "a.tplog").stat().st_mode & 0o777 == 0o600


def _three_records(tmp_path: Path) -> tuple[Path, list[int]]:
    with Recorder(tmp_path, "x") as rec:
        for i in range(3):
            rec.write("in", "ch", None, [bytes(100)], float(i))
    path = tmp_path / "x.tplog"
    return path, [r.offset for r in read_log(path)]


def _damage(path: Path, cut: int | None = None, flip: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    if flip is not None:
        data[flip] ^= 0xFF
    path.write_bytes(bytes(data[:cut]))


H = RECORD_HEADER.size


@pytest.mark.parametrize(
    "damage, expected",
    [
        (lambda o: {"flip": 0}, "{path} is not a taipan log (bad magic at byte 0)"),
        (lambda o: {"cut": 5}, "{path} is not a taipan log: 5 bytes"),
        (lambda o: {"flip": 8}, "{path} is log format version"),
        (
            lambda o: {"cut": o[2] + H + 30},
            "truncated record at byte {o[2]} of {path}: header says 120 bytes, 30 remain",
        ),
        (
            lambda o: {"cut": o[2] + 5},
            "truncated record header at byte {o[2]} of {path}: 16 bytes needed, 5 remain",
        ),
        (lambda o: {"flip": o[1] + 3}, "corrupt record header at byte {o[1]} of {path}"),
        (lambda o: {"flip": o[1] + H + 50}, "corrupt record at byte {o[1]} of {path}: checksum"),
    ],
)
def test_damaged_logs_name_the_offset(tmp_path, damage, expected):
    path, offsets = _three_records(tmp_path)
    _damage(path, **damage(offsets))
    with pytest.raises(LogError) as info:
        list(read_log(path))
    assert expected.format(o=offsets, path=path) in str(info.value)


def test_bad_body_is_reported_not_raised(tmp_path):
    path, offsets = _three_records(tmp_path)
    with open(path, "ab") as f:
        body = b"\x93\xa2in\x01\x02"  # valid msgpack, wrong shape
        f.write(_record_header(len(body), zlib.crc32(body)) + body)
    with pytest.raises(LogError, match="is not \\[direction, time, channel, peer, frames\\]"):
        list(read_log(path))


def test_recorder_refuses_to_append_to_a_damaged_log(tmp_path):
    path, _ = _three_records(tmp_path)
    _damage(path, cut=-40)
    with pytest.raises(LogError, match="move the old log away"):
        Recorder(tmp_path, "x")


# --- replay --check ------------------------------------------------------------------------------


def test_check_passes_on_a_real_session(session, capsys):
    assert replay_run(session, "--check") == 3  # the bare engine log cannot be checked ...
    assert replay_run(session, "--check", "--allow-unchecked") == 0  # ... which may be accepted
    out = capsys.readouterr().out
    assert "allocator: ok, 14 records checked (7 in, 7 out)" in out
    assert "engine: not checked (no config.json beside the log)" in out  # a bare session


@pytest.mark.asyncio
async def test_check_covers_named_allocators(tmp_path, capsys):
    await _session(tmp_path, "allocator-0")
    assert replay_run(tmp_path, "--check", "--actor", "allocator-0") == 0
    assert "allocator-0: ok, 14 records checked" in capsys.readouterr().out


def test_check_reports_an_altered_reply(session, tmp_path, capsys):
    altered = tmp_path / "altered"
    with Recorder(altered, "allocator") as rec:
        for r in read_log(session / "allocator.tplog"):
            frames = r.frames
            msg = decode(frames) if r.direction == "out" else None
            if isinstance(msg, BlockOpsReply) and msg.step == 2:
                ids = msg.block_ids.copy()
                ids[0] = 7
                frames = encode(BlockOpsReply(2, True, ids, msg.num_free, None))
            rec.write(r.direction, r.channel, r.peer, frames, r.time)
    assert replay_run(altered, "--check") == 1
    out = capsys.readouterr().out
    assert "allocator: DIVERGES at record #9 (byte " in out
    assert "reply to inbound record #8 differs" in out
    assert "recorded: → engine  BlockOpsReply step=2 ok=True block_ids=int32[4] [7 1 5 6]" in out
    assert "replayed: → engine  BlockOpsReply step=2 ok=True block_ids=int32[4] [0 1 5 6]" in out


def test_check_reports_a_missing_reply(session):
    recs = list(read_log(session / "allocator.tplog"))[:-1]
    respond = replay.CHECKERS["allocator"]("allocator")
    div = replay.check_actor(recs, respond)
    assert div is not None and "the log has no reply" in div.what and div.offset == -1


def test_truncated_log_exits_2_naming_the_offset(session, tmp_path, capsys):
    broken = copy_session(session, tmp_path / "broken")
    log = broken / "allocator.tplog"
    third = list(read_log(log))[2]
    log.write_bytes(log.read_bytes()[: third.offset + 20])
    for flags in ([], ["--check"]):
        assert replay_run(broken, *flags) == 2
        err = capsys.readouterr().err
        assert f"truncated record at byte {third.offset} of {log}" in err
        assert err.count("\n") == 1 and "Traceback" not in err
    code = "import sys; from taipan.replay import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.run(
        [sys.executable, "-c", code, str(broken), "--check"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert f"byte {third.offset}" in proc.stderr


def test_missing_dir_and_unknown_actor(tmp_path, session, capsys):
    assert replay_run(tmp_path / "nope") == 2
    assert "does not exist" in capsys.readouterr().err
    assert replay_run(session, "--actor", "gpu") == 2
    assert "no log for actor gpu (have: allocator, engine)" in capsys.readouterr().err
    assert replay_run(session, "--type", "BlockOp") == 2
    err = capsys.readouterr().err
    assert "unknown message type BlockOp; known: " in err and "BlockOps," in err


# --- the timeline --------------------------------------------------------------------------------


def timeline(capsys, *argv) -> list[str]:
    """The printed lines, runs of spaces collapsed (column padding is not under test)."""
    assert replay_run(*argv) == 0
    return [" ".join(x.split()) for x in capsys.readouterr().out.splitlines()]


def test_timeline_merges_both_actors(session, capsys):
    lines = timeline(capsys, session)
    assert len(lines) == 14 + 13
    assert "engine → allocator AllocatorInit num_blocks=8 block_size=16" in lines[0]
    assert lines[0].lstrip().startswith("0.000 ms")
    assert any("allocator ← engine <bad message: not a msgpack message" in x for x in lines)
    assert any("ErrorReply code=unexpected_message" in x for x in lines)
    assert any("free_ids=int64[0] alloc_ids=int64[2] [100 101]" in x for x in lines)


def test_timeline_filters(session, capsys):
    lines = timeline(capsys, session, "--actor", "allocator", "--type", "BlockOpsReply")
    assert len(lines) == 4 and all("allocator → engine BlockOpsReply" in x for x in lines)
    lines = timeline(capsys, session, "--request", "101")
    # Step 1 allocates for 101, step 4 frees it: each seen leaving the engine and arriving.
    assert len(lines) == 4 and all("BlockOps step=" in x for x in lines)
    assert [x.split("step=")[1][0] for x in lines] == ["1", "1", "4", "4"]
    lines = timeline(capsys, session, "--type", "ErrorReply", "--type", "AllocatorReady")
    assert len(lines) == 6


def test_timeline_shows_records_before_a_torn_tail(session, tmp_path, capsys):
    broken = copy_session(session, tmp_path / "torn")
    log = broken / "engine.tplog"
    log.write_bytes(log.read_bytes()[:-3])
    assert replay_run(broken) == 2
    captured = capsys.readouterr()
    assert len(captured.out.splitlines()) == 14 + 12
    assert "truncated record at byte" in captured.err
