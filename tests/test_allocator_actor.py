"""The allocator service (message -> reply) and the actor, driven only through a zmq PAIR."""

from __future__ import annotations

import asyncio

import msgpack
import numpy as np
import pytest
import zmq
import zmq.asyncio

from taipan.actors.allocator.actor import MAX_BLOCKS, AllocatorActor, AllocatorService
from taipan.actors.channel import make_socket
from taipan.messages.allocator import (
    AllocatorInit,
    AllocatorReady,
    BlockOps,
    BlockOpsReply,
    PrefixCachingEvictionPolicy,
)
from taipan.messages.codec import EXT_ARRAY_INLINE, decode, encode
from taipan.messages.common import ErrorReply, Heartbeat
from taipan.messages.errors import ErrorCode


def ops(step, free=(), alloc=(), counts=()):
    return BlockOps(
        step,
        np.asarray(free, dtype=np.int64),
        np.asarray(alloc, dtype=np.int64),
        np.asarray(counts, dtype=np.int32),
    )


def ready_service(num_blocks=8) -> AllocatorService:
    svc = AllocatorService()
    assert svc.handle(AllocatorInit(num_blocks, 16)) == AllocatorReady(num_blocks, num_blocks)
    return svc


def test_block_ops_frees_first_then_allocates_in_request_order():
    svc = ready_service(8)
    r = svc.handle(ops(1, alloc=[10, 11], counts=[3, 2]))
    assert isinstance(r, BlockOpsReply) and r.ok and r.error is None
    assert r.step == 1 and r.num_free == 3
    assert r.block_ids.dtype == np.int32 and r.block_ids.tolist() == [0, 1, 2, 3, 4]
    # Request 10's blocks are free again before request 12 asks, so it gets the low ids.
    r = svc.handle(ops(2, free=[10], alloc=[12, 11], counts=[4, 1]))
    assert r.ok and r.block_ids.tolist() == [0, 1, 2, 5, 6] and r.num_free == 1
    svc.pool.check()


def test_not_enough_blocks_allocates_nothing_but_keeps_the_frees():
    svc = ready_service(4)
    svc.handle(ops(1, alloc=[1, 2], counts=[2, 2]))
    r = svc.handle(ops(2, free=[1], alloc=[3, 4], counts=[1, 2]))
    assert isinstance(r, BlockOpsReply) and not r.ok
    assert "asked for 3 blocks but only 2 of 4 are free" in r.error and "step 2" in r.error
    assert r.block_ids.dtype == np.int32 and r.block_ids.size == 0
    assert r.num_free == 2
    assert svc.pool.blocks_of(3) == [] and svc.pool.blocks_of(1) == []


def test_block_ops_before_init_is_illegal_state():
    r = AllocatorService().handle(ops(0, alloc=[1], counts=[1]))
    assert isinstance(r, ErrorReply) and r.code == "illegal_state"
    assert "before AllocatorInit" in r.text


def test_reinit_only_when_idle():
    svc = ready_service(4)
    assert svc.handle(AllocatorInit(6, 16)) == AllocatorReady(6, 6)
    svc.handle(ops(1, alloc=[1], counts=[1]))
    r = svc.handle(AllocatorInit(8, 16))
    assert isinstance(r, ErrorReply) and r.code == "illegal_state"
    assert svc.pool.num_blocks == 6


@pytest.mark.parametrize(
    "init",
    [AllocatorInit(0, 16), AllocatorInit(-3, 16), AllocatorInit(MAX_BLOCKS + 1, 16)]
    + [AllocatorInit(4, 0)],
)
def test_bad_init(init):
    svc = AllocatorService()
    r = svc.handle(init)
    assert isinstance(r, ErrorReply) and r.code == "bad_request"
    assert svc.pool is None


def test_init_policy_is_checked_at_decode():
    svc = AllocatorService()
    frames = [msgpack.packb([AllocatorInit.TAG, 1, 4, 16, "fifo"], use_bin_type=True)]
    r = svc.handle_frames(frames)
    assert r.code is ErrorCode.BAD_FIELD and "'fifo' is not a PrefixCachingEvictionPolicy" in r.text
    assert svc.pool is None
    assert svc.handle(AllocatorInit(4, 16, "lru")) == AllocatorReady(4, 4)
    assert svc.pool.policy is PrefixCachingEvictionPolicy.LRU


BAD_OPS = {
    "alloc_ids has 2 entries but alloc_counts has 1": ops(1, alloc=[1, 2], counts=[1]),
    "alloc_ids lists request 5 more than once": ops(1, alloc=[5, 6, 5], counts=[1, 1, 1]),
    "free_ids lists request 2 more than once": ops(1, free=[2, 2]),
    "alloc_counts[1] = -1 (request 6) is < 0": ops(1, alloc=[5, 6], counts=[1, -1]),
}


@pytest.mark.parametrize("expected", list(BAD_OPS))
def test_bad_block_ops_change_nothing(expected):
    svc = ready_service(8)
    svc.handle(ops(0, alloc=[2], counts=[3]))
    r = svc.handle(BAD_OPS[expected])
    assert isinstance(r, ErrorReply) and r.code == "bad_request"
    assert expected in r.text and "step 1" in r.text
    assert svc.pool.blocks_of(2) == [0, 1, 2] and svc.pool.num_free == 5  # the free of 2 too


def _array(dtype: str, values) -> msgpack.ExtType:
    arr = np.asarray(values, dtype=dtype)
    body = msgpack.packb([arr.dtype.name, list(arr.shape), arr.tobytes()], use_bin_type=True)
    return msgpack.ExtType(EXT_ARRAY_INLINE, body)


@pytest.mark.parametrize(
    "free, alloc, counts, expected",
    [
        (_array("int32", [1]), _array("int64", []), _array("int32", []), "free_ids: dtype int32"),
        (_array("int64", []), _array("float64", [1.0]), _array("int32", [1]), "alloc_ids: dtype"),
        (_array("int64", []), _array("int64", [1]), _array("int64", [1]), "alloc_counts: dtype"),
        (_array("int64", [[1]]), _array("int64", []), _array("int32", []), "free_ids: 2-D"),
        (_array("int64", []), _array("int64", [1]), _array("int32", 1), "alloc_counts: 0-D"),
    ],
)
def test_wrong_dtypes_and_ranks_never_reach_the_pool(free, alloc, counts, expected):
    """The codec checks every array field's dtype and rank (Array[...] in messages/): the
    allocator does not re-check, and such a message changes nothing."""
    svc = ready_service(8)
    svc.handle(ops(0, alloc=[2], counts=[3]))
    rest = [_array("int64", []), _array("int32", []), _array("int64", [])]  # pins
    rest += [_array("int64", []), _array("int32", []), _array("int64", []), _array("int64", [])]
    fields = [BlockOps.TAG, 1, 1, free, alloc, counts, *rest, False]  # (regs, drop_cache)
    frames = [msgpack.packb(fields, use_bin_type=True)]
    r = svc.handle_frames(frames)
    assert isinstance(r, ErrorReply) and r.code == "bad_array" and expected in r.text, r
    assert svc.pool.blocks_of(2) == [0, 1, 2] and svc.pool.num_free == 5


def test_other_messages():
    svc = ready_service()
    assert svc.handle(ErrorReply(ErrorCode.INTERNAL, "y", None)) is None
    r = svc.handle(Heartbeat(1.0))
    assert r == ErrorReply("unexpected_message", "allocator does not take Heartbeat", None)
    r = svc.handle_frames([b"\xc1garbage"])
    assert isinstance(r, ErrorReply) and r.code == "bad_msgpack"


def test_replies_survive_the_wire():
    svc = ready_service()
    r = svc.handle(ops(3, alloc=[1], counts=[2]))
    assert decode(encode(r)).block_ids.tolist() == [0, 1]


# --- the actor, through its socket only ----------------------------------------------------------


async def _drive_actor():
    ctx = zmq.asyncio.Context()
    chan = make_socket(ctx, zmq.PAIR, "inproc://alloc-test", bind=True, name="engine")
    engine = ctx.socket(zmq.PAIR)
    engine.setsockopt(zmq.LINGER, 0)
    engine.connect("inproc://alloc-test")
    actor = AllocatorActor(chan)

    async def ask(frames):
        await engine.send_multipart(frames)
        return decode(await asyncio.wait_for(engine.recv_multipart(), 5))

    replies = []
    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(actor.run())
            try:
                replies.append(await ask(encode(ops(0, alloc=[1], counts=[1]))))
                replies.append(await ask(encode(AllocatorInit(4, 16))))
                replies.append(await ask(encode(ops(1, alloc=[1, 2], counts=[2, 1]))))
                replies.append(await ask([b"\x93\xff not a message"]))
                replies.append(await ask(encode(ops(2, alloc=[3], counts=[9]))))
                replies.append(await ask(encode(ops(3, free=[1], alloc=[3], counts=[2]))))
            finally:
                actor.stop()
    finally:
        chan.close()
        engine.close(linger=0)
        ctx.term()
    return replies


@pytest.mark.asyncio
async def test_actor_over_inproc_pair():
    early, ready, first, garbage, too_many, after = await _drive_actor()
    assert isinstance(early, ErrorReply) and early.code == "illegal_state"
    assert ready == AllocatorReady(4, 4)
    assert first.ok and first.block_ids.tolist() == [0, 1, 2] and first.num_free == 1
    assert isinstance(garbage, ErrorReply) and garbage.code != "internal"
    assert not too_many.ok and too_many.num_free == 1
    assert after.ok and after.step == 3 and after.block_ids.tolist() == [0, 1]
    assert after.num_free == 1
