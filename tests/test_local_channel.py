"""In-process channels (actors/local.py): objects handed over unencoded, encoding's checks at the
sender, read-only arrays on both sides, recording as over a socket, and clear errors."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from taipan.actors.local import LocalPairs
from taipan.actors.record import Recorder, read_log
from taipan.messages.allocator import BlockOpsReply
from taipan.messages.codec import decode, encode, same_encoding
from taipan.messages.common import Heartbeat

pytestmark = pytest.mark.asyncio


def a_reply(added) -> BlockOpsReply:
    blocks = np.array([3, 4], dtype=np.int32)
    return BlockOpsReply(7, True, blocks, 10, None, added_hashes=added)


def a_pair(engine_log=None, served_log=None):
    pairs = LocalPairs()
    served = pairs.open("local://gpu-0", bind=True, name="engine", recorder=served_log)
    engine = pairs.open("local://gpu-0", bind=False, name="gpu", recorder=engine_log)
    return engine, served


async def test_the_receiver_gets_the_senders_object_with_read_only_arrays():
    engine, served = a_pair()
    added = np.arange(4, dtype=np.int64)
    sent = a_reply(added)
    await served.send(sent)
    got = await asyncio.wait_for(engine.recv(), 5)
    assert got.msg is sent and got.sender is None and got.error is None
    assert got.channel is engine and got.time > 0
    with pytest.raises(ValueError, match="read-only"):
        added[0] = 9  # the sender's own array: it must not change what it sent
    with pytest.raises(ValueError, match="read-only"):
        got.msg.added_hashes[0] = 9


async def test_messages_arrive_in_order_and_a_waiting_receive_wakes():
    engine, served = a_pair()
    waiting = asyncio.create_task(served.recv())
    await asyncio.sleep(0)
    for t in (1.0, 2.0, 3.0):
        await engine.send(Heartbeat(t))
    first = await asyncio.wait_for(waiting, 5)
    rest = [(await served.recv()).msg.time for _ in range(2)]
    assert [first.msg.time, *rest] == [1.0, 2.0, 3.0]


async def test_two_waiting_receives_each_get_a_message_and_a_cancelled_one_leaves():
    engine, served = a_pair()
    cancelled = asyncio.create_task(served.recv())
    first, second = asyncio.create_task(served.recv()), asyncio.create_task(served.recv())
    await asyncio.sleep(0)
    cancelled.cancel()
    await asyncio.sleep(0)
    await engine.send(Heartbeat(1.0))
    await engine.send(Heartbeat(2.0))
    got = await asyncio.wait_for(asyncio.gather(first, second), 5)
    assert sorted(e.msg.time for e in got) == [1.0, 2.0] and not served._waiters


async def test_a_senders_bug_is_the_senders_type_error():
    engine, served = a_pair()
    with pytest.raises(TypeError, match="added_hashes"):
        await served.send(a_reply(np.zeros(2, dtype=np.float32)))
    with pytest.raises(TypeError, match="not a registered message"):
        await served.send(object())
    await served.send(Heartbeat(1.0))  # nothing of the refused ones went
    assert (await engine.recv()).msg == Heartbeat(1.0)


async def test_with_a_recorder_both_ends_log_the_same_frames_and_the_receiver_decodes_them(
    tmp_path,
):
    engine_log, served_log = Recorder(tmp_path, "engine-0"), Recorder(tmp_path, "gpu-0")
    engine, served = a_pair(engine_log, served_log)
    sent = a_reply(np.arange(3, dtype=np.int64))
    await served.send(sent)
    got = await engine.recv()
    assert got.msg is not sent and same_encoding(sent, encode(got.msg))  # decoded, as over a socket
    engine.record_only(Heartbeat(4.0))
    engine_log.close()
    served_log.close()
    (out,) = list(read_log(tmp_path / "gpu-0.tplog"))
    received, noted = list(read_log(tmp_path / "engine-0.tplog"))
    assert (out.direction, out.channel, received.direction, received.channel) == (
        "out",
        "engine",
        "in",
        "gpu",
    )
    assert out.frames == received.frames and same_encoding(sent, list(received.frames))
    assert noted.direction == "out" and decode(list(noted.frames)) == Heartbeat(4.0)


async def test_a_recorded_large_array_reaches_the_receiver_as_the_logged_copy(tmp_path):
    """An array over the inline limit travels as an extra frame: the receiver decodes the
    logged bytes, not a view of the sender's array."""
    engine, served = a_pair(Recorder(tmp_path, "engine-0"), None)
    added = np.arange(20_000, dtype=np.int64)  # 160 KB: an extra frame
    await served.send(a_reply(added))
    added[:] = -1  # (a sender that broke the contract cannot reach what was sent)
    got = await engine.recv()
    assert got.msg.added_hashes[:3].tolist() == [0, 1, 2] and got.msg.added_hashes[-1] == 19_999


async def test_only_one_end_recording_still_hands_over_what_it_logs(tmp_path):
    served_log = Recorder(tmp_path, "gpu-0")
    engine, served = a_pair(None, served_log)
    await engine.send(Heartbeat(5.0))
    got = await served.recv()
    served_log.close()
    (received,) = list(read_log(tmp_path / "gpu-0.tplog"))
    assert got.msg == Heartbeat(5.0) and decode(list(received.frames)) == got.msg


async def test_relayed_frames_that_do_not_decode_arrive_as_an_error():
    engine, served = a_pair()
    await served.send_frames([b"\xc1"])
    got = await engine.recv()
    assert got.msg is None and "msgpack" in str(got.error).lower()


async def test_closing_wakes_a_waiting_receive_and_drops_later_sends():
    engine, served = a_pair()
    waiting = asyncio.create_task(engine.recv())
    await asyncio.sleep(0)
    engine.close()
    with pytest.raises(ConnectionError, match="closed"):
        await asyncio.wait_for(waiting, 5)
    await served.send(Heartbeat(1.0))  # to a closed end: dropped, as a closed socket's
    assert not engine._inbox


async def test_addresses_are_checked():
    pairs = LocalPairs()
    with pytest.raises(ValueError, match="bind first"):
        pairs.open("local://gpu-0", bind=False, name="gpu")
    pairs.open("local://gpu-0", bind=True, name="engine")
    with pytest.raises(ValueError, match="bound already"):
        pairs.open("local://gpu-0", bind=True, name="engine")
    pairs.open("local://gpu-0", bind=False, name="gpu")
    with pytest.raises(ValueError, match="two ends already"):
        pairs.open("local://gpu-0", bind=False, name="gpu")
    with pytest.raises(ValueError, match="not a local://NAME"):
        pairs.open("inproc://gpu-0", bind=True, name="engine")
