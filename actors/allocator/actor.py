"""The allocator actor: a pure message -> reply service and the thin actor shell around it.

`AllocatorService` owns the rank's `BlockPool` and is the only thing that mutates it. It is a
deterministic function of the inbound message sequence (no clock, no randomness, no unordered
iteration), so `taipan replay --check` can re-drive it from a recording and expect the same
encoded replies byte for byte.

`AllocatorActor` owns nothing but the service and one channel (a zmq PAIR over inproc to the
engine of the same rank, created by the caller with `make_socket`). It must not hold pool state
of its own: every decision lives in the service, so the replay checker and the live actor agree.

Contract with the engine (messages/allocator.py): one `AllocatorInit` before anything else, then
one `BlockOps` per step. A `BlockOps` is validated in full before any state changes: a malformed
one gets `ErrorReply("bad_request")` and the pool is untouched.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from taipan.actors.allocator.core import AllocatorError, BlockPool
from taipan.actors.base import Actor
from taipan.actors.channel import Channel, Envelope
from taipan.messages.allocator import AllocatorInit, AllocatorReady, BlockOps, BlockOpsReply
from taipan.messages.codec import MessageError, decode
from taipan.messages.common import ErrorReply

# A pool is a Python heap of ints (~40 bytes per block); 4M blocks is far beyond any GPU's KV
# cache at useful block sizes, and the cap keeps a garbage AllocatorInit from eating the host.
MAX_BLOCKS = 1 << 22
ERROR_TEXT_LIMIT = 2000  # the same cut actors/base.py applies to its own ErrorReply texts


class AllocatorService:
    """Message in, reply out. `pool` is None until the first valid AllocatorInit."""

    def __init__(self, name: str = "allocator"):
        self.name = name
        self.pool: BlockPool | None = None

    def handle(self, msg) -> AllocatorReady | BlockOpsReply | ErrorReply | None:
        if isinstance(msg, BlockOps):
            return self._block_ops(msg)
        if isinstance(msg, AllocatorInit):
            return self._init(msg)
        if isinstance(msg, ErrorReply):
            return None  # never answer an error with an error: two actors would ping-pong
        # Same wording as actors/base.py's fallback for unregistered types, so that replaying
        # a recording through the service reproduces what the live actor sent.
        return ErrorReply(
            "unexpected_message", f"{self.name} does not take {type(msg).__name__}", None
        )

    def handle_frames(self, frames: Sequence[bytes | memoryview]):
        """What the live actor answers to these raw inbound frames (used by replay --check).

        Mirrors actors/base.py's policy for undecodable input: ErrorReply(code, text), no
        request id. tests/test_record_replay.py checks this against a real recording.
        """
        try:
            msg = decode(frames)
        except MessageError as e:
            return ErrorReply(e.code, str(e)[:ERROR_TEXT_LIMIT], None)
        return self.handle(msg)

    # --- handlers -------------------------------------------------------------------------------

    def _init(self, msg: AllocatorInit) -> AllocatorReady | ErrorReply:
        if not 1 <= msg.num_blocks <= MAX_BLOCKS:
            return _bad(f"AllocatorInit.num_blocks ({msg.num_blocks}) must be in 1..{MAX_BLOCKS}")
        if msg.block_size < 1:
            return _bad(f"AllocatorInit.block_size ({msg.block_size}) must be >= 1")
        # Re-sizing an idle pool is harmless (e.g. after the KV cache was re-created); re-sizing
        # one that holds blocks would orphan them, so the engine must free everything first.
        if self.pool is not None and self.pool.num_held:
            return ErrorReply(
                "illegal_state",
                f"{self.name}: AllocatorInit while {self.pool.num_held} blocks are held; "
                "free every request first",
                None,
            )
        self.pool = BlockPool(msg.num_blocks)
        return AllocatorReady(msg.num_blocks, self.pool.num_free)

    def _block_ops(self, msg: BlockOps) -> BlockOpsReply | ErrorReply:
        if self.pool is None:
            return ErrorReply(
                "illegal_state",
                f"{self.name}: BlockOps (step {msg.step}) before AllocatorInit",
                None,
            )
        problem = _check_block_ops(msg)
        if problem is not None:
            return _bad(f"BlockOps step {msg.step}: {problem}")
        pool = self.pool
        for rid in msg.free_ids.tolist():
            pool.free_request(rid)
        try:
            ids = pool.allocate_batch(msg.alloc_ids.tolist(), msg.alloc_counts.tolist())
        except AllocatorError as e:
            # Frees stay applied (those requests are gone either way); allocation is all or
            # nothing, and the engine learns the true free count to plan the next step with.
            empty = np.zeros(0, dtype=np.int32)
            return BlockOpsReply(msg.step, False, empty, pool.num_free, f"step {msg.step}: {e}")
        return BlockOpsReply(msg.step, True, np.asarray(ids, dtype=np.int32), pool.num_free, None)


def _bad(text: str) -> ErrorReply:
    return ErrorReply("bad_request", text, None)


def _check_block_ops(msg: BlockOps) -> str | None:
    """The first thing wrong with `msg`, or None (the codec already checked dtypes and ranks).
    Pure: looks, never changes anything."""
    if len(msg.alloc_ids) != len(msg.alloc_counts):
        return (
            f"alloc_ids has {len(msg.alloc_ids)} entries but alloc_counts has "
            f"{len(msg.alloc_counts)}"
        )
    for field in ("free_ids", "alloc_ids"):
        dup = _first_duplicate(getattr(msg, field))
        if dup is not None:
            return f"{field} lists request {dup} more than once"
    negative = np.flatnonzero(msg.alloc_counts < 0)
    if negative.size:
        i = int(negative[0])
        return f"alloc_counts[{i}] = {int(msg.alloc_counts[i])} (request {msg.alloc_ids[i]}) is < 0"
    return None


def _first_duplicate(ids: np.ndarray) -> int | None:
    if ids.size < 2:
        return None
    ordered = np.sort(ids)
    same = np.flatnonzero(ordered[1:] == ordered[:-1])
    return int(ordered[same[0]]) if same.size else None


class AllocatorActor(Actor):
    """Serves one channel; every message goes through `self.service` and its reply goes back."""

    def __init__(self, channel: Channel, name: str = "allocator"):
        super().__init__(name)
        self.channel = channel
        self.service = AllocatorService(name)
        self.on(AllocatorInit, self._handle)
        self.on(BlockOps, self._handle)
        self.serve(channel)

    async def _handle(self, env: Envelope, msg) -> None:
        reply = self.service.handle(msg)
        if isinstance(reply, ErrorReply):
            self.log.warning("rejected", msg=type(msg).__name__, code=reply.code, text=reply.text)
        if reply is not None:
            await env.reply(reply)
