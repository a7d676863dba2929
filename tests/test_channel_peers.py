"""Peer watch on a ROUTER (and a DEALER) channel (actors/channel.py): `PeerGone` when a peer's
connection closes.

Over ipc: an inproc connection has no descriptor, so it cannot be watched. Some peers are
processes of their own (to be killed, or to leave this process's descriptors alone: the
descriptor-reuse tests need the kernel to hand a closed descriptor to the next connection).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time

import pytest
import zmq
import zmq.asyncio

from taipan.actors.channel import make_socket
from taipan.actors.record import Recorder, read_log
from taipan.messages.codec import decode
from taipan.messages.common import Hello, PeerGone

GONE_S = 2.0  # a closed connection is reported within this
QUIET_S = 0.5  # how long "nothing is reported" is watched for
CLOSED = PeerGone("its connection closed")

PEER_SCRIPT = """
import sys, time, zmq
from taipan.messages.codec import encode
from taipan.messages.common import Hello
address, identity, talk = sys.argv[1], sys.argv[2], sys.argv[3] == "talk"
sock = zmq.Context().socket(zmq.DEALER)
sock.setsockopt(zmq.IDENTITY, identity.encode())
handshake = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
sock.connect(address)
handshake.recv_multipart()
if talk:
    sock.send_multipart(encode(Hello(identity, -1)))
print("ready", flush=True)
time.sleep(600)
"""


class PeerProcesses:
    """Peer processes that say "ready" on one pipe, opened before any of them starts, so that
    starting one adds no descriptor to this process."""

    def __init__(self):
        read_end, self.write_end = os.pipe()
        self.ready = os.fdopen(read_end)
        self.procs: list[subprocess.Popen] = []

    async def start(self, address: str, identity: str, *, talk: bool) -> subprocess.Popen:
        """A peer connected to `address` (and, if `talk`, having sent a Hello)."""
        args = [sys.executable, "-c", PEER_SCRIPT, address, identity, "talk" if talk else "-"]
        proc = subprocess.Popen(args, stdout=self.write_end)
        self.procs.append(proc)
        line = await asyncio.wait_for(asyncio.to_thread(self.ready.readline), 60)
        assert line == "ready\n", line
        return proc

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()
        os.close(self.write_end)  # a readline still waiting gets end-of-file
        self.ready.close()


@pytest.fixture
def peers():
    processes = PeerProcesses()
    yield processes
    processes.close()


@contextlib.asynccontextmanager
async def watched_router(tmp_path, recorder: Recorder | None = None):
    """(context, watching ROUTER channel, its address)."""
    ctx = zmq.asyncio.Context()
    address = f"ipc://{tmp_path}/router.sock"
    router = make_socket(
        ctx, zmq.ROUTER, address, bind=True, name="peers", watch_peers=True, recorder=recorder
    )
    try:
        yield ctx, router, address
    finally:
        router.close()
        ctx.term()


def dealer(ctx, address: str, identity: bytes):
    return make_socket(ctx, zmq.DEALER, address, bind=False, name="router", identity=identity)


async def gone(router, timeout: float = GONE_S):
    """The next thing `recv` delivers, which must be a PeerGone."""
    env = await asyncio.wait_for(router.recv(), timeout)
    assert env.channel is router and env.error is None and isinstance(env.msg, PeerGone), env
    return env


async def assert_nothing_gone(router) -> None:
    with pytest.raises(TimeoutError):
        env = await asyncio.wait_for(router.recv(), QUIET_S)
        pytest.fail(f"{env.sender!r} sent {env.msg!r}")


def socket_descriptors() -> set[int]:
    """This process's open socket descriptors."""
    found = set()
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor is gone by now
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                found.add(int(name))
    return found


def test_only_a_router_or_dealer_watches_its_peers():
    ctx = zmq.asyncio.Context()
    try:
        with pytest.raises(ValueError, match="only a ROUTER or DEALER"):
            make_socket(ctx, zmq.PUSH, "ipc:///nowhere", bind=False, name="x", watch_peers=True)
    finally:
        ctx.term()


@pytest.mark.asyncio
async def test_a_watching_dealer_reports_its_peer_gone_after_its_last_messages(tmp_path):
    """A DEALER connected before its peer binds: the failed attempts are not a departure; once
    connected, the peer's messages come first, then its closed connection (no sender)."""
    ctx = zmq.asyncio.Context()
    address = f"ipc://{tmp_path}/server.sock"
    watcher = make_socket(ctx, zmq.DEALER, address, bind=False, name="server", watch_peers=True)
    try:
        await assert_nothing_gone(watcher)  # nobody there yet: ZMQ retries, no PeerGone
        server = make_socket(ctx, zmq.ROUTER, address, bind=True, name="peers")
        try:
            await watcher.send(Hello("watcher", -1))
            env = await asyncio.wait_for(server.recv(), GONE_S)
            for i in range(3):
                await server.send(Hello("last words", i), to=env.sender)
        finally:
            server.close(linger_ms=2000)
        got = [await asyncio.wait_for(watcher.recv(), GONE_S) for _ in range(4)]
        assert [e.msg for e in got[:3]] == [Hello("last words", i) for i in range(3)]
        assert (got[3].sender, got[3].msg) == (None, CLOSED)
        await assert_nothing_gone(watcher)
    finally:
        watcher.close()
        ctx.term()


@pytest.mark.asyncio
async def test_a_peer_whose_connection_closes_is_reported_gone(tmp_path):
    async with watched_router(tmp_path) as (ctx, router, address):
        peer = dealer(ctx, address, b"peer-1")
        try:
            await peer.send(Hello("peer", -1))
            env = await asyncio.wait_for(router.recv(), GONE_S)
            assert (env.sender, env.msg) == (b"peer-1", Hello("peer", -1))
        finally:
            peer.close()
        env = await gone(router)
        assert (env.sender, env.msg) == (b"peer-1", CLOSED)
        await assert_nothing_gone(router)  # once


@pytest.mark.asyncio
async def test_a_peers_last_messages_come_before_its_departure(tmp_path):
    """An engine's last outputs, or its StopAck, must not be overtaken by its PeerGone."""
    async with watched_router(tmp_path) as (ctx, router, address):
        peer = dealer(ctx, address, b"peer-1")
        await peer.send(Hello("first", -1))
        assert (await asyncio.wait_for(router.recv(), GONE_S)).sender == b"peer-1"
        for i in range(200):
            await peer.send(Hello("last words", i))
        peer.sock.close(linger=2000)  # flushes them, then the connection closes
        got = [await asyncio.wait_for(router.recv(), GONE_S) for _ in range(201)]
        assert [e.msg for e in got[:200]] == [Hello("last words", i) for i in range(200)]
        assert (got[200].sender, got[200].msg) == (b"peer-1", CLOSED)
        await assert_nothing_gone(router)


@pytest.mark.asyncio
async def test_a_peer_that_never_sent_anything_is_not_reported(tmp_path):
    async with watched_router(tmp_path) as (ctx, router, address):
        silent = ctx.socket(zmq.DEALER)
        silent.setsockopt(zmq.IDENTITY, b"silent")
        handshake = silent.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)  # before connecting
        try:
            silent.connect(address)
            await asyncio.wait_for(handshake.recv_multipart(), GONE_S)  # it did connect
        finally:
            silent.disable_monitor()
            handshake.close(linger=0)
            silent.close(linger=0)
        await assert_nothing_gone(router)
        # The watch works all the same: the next peer to talk and close is reported, first.
        talker = dealer(ctx, address, b"talker")
        try:
            await talker.send(Hello("talker", -1))
            assert (await asyncio.wait_for(router.recv(), GONE_S)).sender == b"talker"
        finally:
            talker.close()
        assert (await gone(router)).sender == b"talker"


@pytest.mark.asyncio
async def test_a_killed_peer_process_is_reported_within_two_seconds(tmp_path, peers):
    async with watched_router(tmp_path) as (ctx, router, address):
        proc = await peers.start(address, "doomed", talk=True)
        env = await asyncio.wait_for(router.recv(), GONE_S)
        assert (env.sender, env.msg) == (b"doomed", Hello("doomed", -1))
        proc.kill()  # SIGKILL: no goodbye, the kernel closes its socket
        start = time.monotonic()
        env = await gone(router)
        assert time.monotonic() - start < GONE_S
        assert (env.sender, env.msg) == (b"doomed", CLOSED)


@pytest.mark.asyncio
async def test_peer_gone_is_recorded_as_an_inbound_message(tmp_path):
    with Recorder(tmp_path / "log", "watcher") as recorder:
        async with watched_router(tmp_path, recorder) as (ctx, router, address):
            peer = dealer(ctx, address, b"peer-1")
            try:
                await peer.send(Hello("peer", -1))
                await asyncio.wait_for(router.recv(), GONE_S)
            finally:
                peer.close()
            await gone(router)
    records = [(r.direction, r.channel, r.peer, decode(r.frames)) for r in read_log(recorder.path)]
    assert records == [
        ("in", "peers", b"peer-1", Hello("peer", -1)),
        ("in", "peers", b"peer-1", CLOSED),
    ]


@pytest.mark.asyncio
async def test_a_reused_descriptor_reports_the_old_peer_before_the_new_ones_message(
    tmp_path, peers
):
    async with watched_router(tmp_path) as (ctx, router, address):
        before = socket_descriptors()
        old = await peers.start(address, "old", talk=True)
        [old_fd] = socket_descriptors() - before
        assert (await asyncio.wait_for(router.recv(), GONE_S)).sender == b"old"
        old.kill()
        # Its disconnect report is queued, unread, while the next peer takes the descriptor.
        assert await router.monitor.poll(GONE_S * 1000) == zmq.POLLIN
        await peers.start(address, "new", talk=True)
        if socket_descriptors() - before != {old_fd}:
            pytest.skip("the kernel gave the new connection another descriptor")
        # The queued report is read before the new peer's message is noted: the old peer's
        # departure comes first, then the new one's message, and nothing is reported twice.
        env = await asyncio.wait_for(router.recv(), GONE_S)
        assert env.sender == b"old"
        assert env.msg == PeerGone("its connection closed")
        env = await asyncio.wait_for(router.recv(), GONE_S)
        assert (env.sender, env.msg) == (b"new", Hello("new", -1))
        await assert_nothing_gone(router)
        peers.procs[-1].kill()
        assert (await gone(router)).sender == b"new"


@pytest.mark.asyncio
async def test_a_silent_peers_late_disconnect_report_is_not_pinned_on_a_live_peer(tmp_path, peers):
    async with watched_router(tmp_path) as (ctx, router, address):
        before = socket_descriptors()
        silent = await peers.start(address, "silent", talk=False)
        [silent_fd] = socket_descriptors() - before
        silent.kill()
        assert await router.monitor.poll(GONE_S * 1000) == zmq.POLLIN
        live = await peers.start(address, "live", talk=True)
        if socket_descriptors() - before != {silent_fd}:
            pytest.skip("the kernel gave the new connection another descriptor")
        assert (await asyncio.wait_for(router.recv(), GONE_S)).sender == b"live"
        assert live.poll() is None
        await assert_nothing_gone(router)  # the live peer is still connected
        live.kill()
        assert (await gone(router)).sender == b"live"
