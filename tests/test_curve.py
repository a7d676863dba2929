"""CurveZMQ (actors/curve.py, the bind rule in actors/channel.py, `taipan keys`): over real tcp
sockets, a Curve server answers authorized clients only and keeps serving them while others
are refused; tcp beyond loopback is never bound without server keys; key files are private and
checked when loaded.

The server is a tiny echo actor on our Actor base, then the real coordinator; clients are DEALER
channels (and the public AsyncClient). A socket monitor shows why a refused client got nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat

import pytest
import zmq
import zmq.asyncio
from structlog.testing import capture_logs
from zmq.utils.monitor import parse_monitor_message

from taipan import cli
from taipan.actors.base import Actor
from taipan.actors.channel import AddressError, check_bind, make_socket
from taipan.actors.coordinator.actor import CoordinatorActor
from taipan.actors.curve import (
    CurveClient,
    CurveError,
    load_client_keys,
    load_server_keys,
    write_keys,
)
from taipan.client import AsyncClient
from taipan.messages.common import Hello
from taipan.messages.lifecycle import Pause, Stop, Unpause
from taipan.messages.requests import SamplingParams
from tests.test_coordinator_actor import TOKEN, ScriptedEngine

REPLY_S = 5.0  # an authorized client is answered within this
SILENCE_S = 1.0  # how long a refused client is watched for a reply that must not come


class Echo(Actor):
    """Answers every Hello with the same Hello."""

    def __init__(self, channel):
        super().__init__("echo")
        self.on(Hello, self._echo)
        self.serve(channel)

    async def _echo(self, env, msg):
        await env.reply(msg)


@pytest.fixture
def keys(tmp_path):
    """A key set with two clients, and a second set whose keys the first server never saw."""
    write_keys(tmp_path / "keys", ["client", "engine"])
    write_keys(tmp_path / "other")
    return tmp_path / "keys", tmp_path / "other"


@contextlib.asynccontextmanager
async def echo_server(ctx, address: str, curve):
    """An Echo actor bound at `address`; yields the tcp address clients connect to."""
    chan = make_socket(ctx, zmq.ROUTER, address, bind=True, name="clients", curve=curve)
    port = chan.sock.getsockopt(zmq.LAST_ENDPOINT).decode().rpartition(":")[2]
    actor = Echo(chan)
    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(actor.run())
            yield f"tcp://127.0.0.1:{port}"
            actor.stop()
    finally:
        chan.close()


async def ask(ctx, address: str, curve: CurveClient | None, name: str) -> Hello:
    """Send a Hello from a fresh client; its echo (within REPLY_S)."""
    chan = make_socket(ctx, zmq.DEALER, address, bind=False, name="echo", curve=curve)
    try:
        await chan.send(Hello(name, -1))
        return (await asyncio.wait_for(chan.recv(), REPLY_S)).msg
    finally:
        chan.close()


async def unanswered(ctx, address: str, curve: CurveClient | None) -> bool:
    """True when a fresh client's Hello gets no reply within SILENCE_S."""
    chan = make_socket(ctx, zmq.DEALER, address, bind=False, name="echo", curve=curve)
    try:
        await chan.send(Hello("unwelcome", -1))
        with contextlib.suppress(TimeoutError):
            env = await asyncio.wait_for(chan.recv(), SILENCE_S)
            pytest.fail(f"a refused client got {env.msg!r}")
        return True
    finally:
        chan.close()


async def handshake_events(ctx, address: str, curve: CurveClient | None) -> set[int]:
    """The handshake events a client sees within SILENCE_S of connecting."""
    chan = make_socket(ctx, zmq.DEALER, address, bind=False, name="echo", curve=curve)
    monitor = chan.sock.get_monitor_socket()
    seen = set()
    try:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(SILENCE_S):
                while True:
                    frames = await monitor.recv_multipart()
                    seen.add(parse_monitor_message(frames)["event"])
    finally:
        chan.sock.disable_monitor()
        monitor.close(linger=0)
        chan.close()
    return seen


@pytest.mark.asyncio
async def test_only_authorized_clients_are_answered_and_the_server_keeps_serving(keys):
    mine, other = keys
    server = load_server_keys(mine)
    client = load_client_keys(mine)
    stranger = load_client_keys(other)  # a pair this server never authorized...
    unknown_pair = CurveClient(stranger.public, stranger.secret, server.public)  # ...knowing it
    wrong_server = CurveClient(client.public, client.secret, stranger.server_public)
    ctx = zmq.asyncio.Context()
    try:
        async with echo_server(ctx, "tcp://0.0.0.0:*", server) as address:
            assert await ask(ctx, address, client, "before") == Hello("before", -1)
            with capture_logs() as logged:
                assert await unanswered(ctx, address, None)
                assert await unanswered(ctx, address, unknown_pair)
                assert await unanswered(ctx, address, wrong_server)
            # Refused by the ZAP check, and logged once with the key (it retries on its own).
            [refused] = [e for e in logged if e["log_level"] == "warning"]
            assert refused["event"].startswith("curve client refused")
            assert refused["public_key"] == unknown_pair.public.decode()
            assert refused["channel"] == "clients" and refused["address"] == "127.0.0.1"
            # The unknown pair reached the ZAP check and was refused there (status 400).
            failed = await handshake_events(ctx, address, unknown_pair)
            assert zmq.EVENT_HANDSHAKE_FAILED_AUTH in failed
            assert zmq.EVENT_HANDSHAKE_SUCCEEDED not in failed
            assert zmq.EVENT_HANDSHAKE_SUCCEEDED in await handshake_events(ctx, address, client)
            engine = load_client_keys(mine, "engine")
            assert await ask(ctx, address, client, "after") == Hello("after", -1)
            assert await ask(ctx, address, engine, "engine") == Hello("engine", -1)
    finally:
        ctx.term()  # returns: the channel's close also closed the ZAP handler's socket


@pytest.mark.asyncio
async def test_two_servers_of_one_context_admit_each_its_own_clients(keys):
    """As the coordinator's client and engine sockets do: one ZAP handler, two domains."""
    mine, other = keys
    first, second = load_server_keys(mine), load_server_keys(other)
    ctx = zmq.asyncio.Context()
    try:
        async with (
            echo_server(ctx, "tcp://127.0.0.1:*", first) as a,
            echo_server(ctx, "tcp://127.0.0.1:*", second) as b,
        ):
            to_first, to_second = load_client_keys(mine), load_client_keys(other)
            assert await ask(ctx, a, to_first, "a") == Hello("a", -1)
            assert await ask(ctx, b, to_second, "b") == Hello("b", -1)
            crossed = CurveClient(to_first.public, to_first.secret, second.public)
            assert await unanswered(ctx, b, crossed)
        # Both closed: the handler is gone, so a new server can start one on this context.
        async with echo_server(ctx, "tcp://127.0.0.1:*", first) as a:
            assert await ask(ctx, a, to_first, "again") == Hello("again", -1)
    finally:
        ctx.term()


@pytest.mark.asyncio
async def test_the_coordinator_serves_authorized_clients_over_curve_tcp(keys):
    """The real coordinator, both ROUTERs Curve servers on 0.0.0.0, a scripted engine and the
    public AsyncClient as Curve clients; a stranger's controls never reach it."""
    mine, other = keys
    server = load_server_keys(mine)
    stranger = load_client_keys(other)
    unknown_pair = CurveClient(stranger.public, stranger.secret, server.public)
    ctx = zmq.asyncio.Context()
    channels = []

    def socket(kind, address, **options):
        channels.append(make_socket(ctx, kind, address, **options))
        return channels[-1]

    def tcp(chan) -> str:
        port = chan.sock.getsockopt(zmq.LAST_ENDPOINT).decode().rpartition(":")[2]
        return f"tcp://127.0.0.1:{port}"

    try:
        # As runtime/procs.py makes them: both ROUTERs watch their peers.
        watched = dict(bind=True, watch_peers=True, curve=server)
        front = socket(zmq.ROUTER, "tcp://0.0.0.0:*", name="clients", **watched)
        back = socket(zmq.ROUTER, "tcp://0.0.0.0:*", name="engines", **watched)
        engine = ScriptedEngine(
            socket(
                zmq.DEALER,
                tcp(back),
                bind=False,
                name="coordinator",
                identity=b"engine-0",
                curve=load_client_keys(mine, "engine"),
            ),
            heartbeat_s=1.0,
        )
        actor = CoordinatorActor(front, back, 1, "test-model", 512, control_token=TOKEN)
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(t) for t in (actor.run(), engine.run(), engine.heartbeats())]
            try:
                await engine.hello()
                # A stranger holding the control token but no authorized key: never heard.
                intruder = socket(zmq.DEALER, tcp(front), bind=False, name="c", curve=unknown_pair)
                for control in (Pause(TOKEN), Stop(TOKEN, "intruder")):
                    await intruder.send(control)
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(intruder.recv(), SILENCE_S)
                assert actor.fsm.state == "RUNNING" and engine.controls == []
                client = load_client_keys(mine)
                async with AsyncClient(
                    tcp(front), connect_timeout=REPLY_S, control_token=TOKEN, curve=client
                ) as c:
                    [done] = await c.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
                    assert done.token_ids == [5, 6]
                    assert (await c.pause()).state == "PAUSED"
                    assert (await c.unpause()).state == "RUNNING"
                assert [type(m) for m in engine.controls] == [Pause, Unpause]
            finally:
                actor.stop()
                for task in tasks[1:]:
                    task.cancel()
    finally:
        for chan in channels:
            chan.close()
        ctx.term()


# --- the bind rule -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "address",
    [
        "tcp://0.0.0.0:5555",
        "tcp://*:5555",
        "tcp://10.1.2.3:5555",
        "tcp://[::]:5555",
        "tcp://eth0:1",
    ],
)
def test_binding_beyond_loopback_without_server_keys_is_refused(address, keys):
    with pytest.raises(AddressError, match="needs CurveZMQ server keys.*taipan keys DIR"):
        check_bind(address)
    client = load_client_keys(keys[0])
    with pytest.raises(AddressError, match="got client keys"):
        check_bind(address, client)
    check_bind(address, load_server_keys(keys[0]))  # with them it may


@pytest.mark.parametrize(
    "address",
    [
        "tcp://127.0.0.1:5555",
        "tcp://127.3.4.5:5555",
        "tcp://localhost:5555",
        "tcp://[::1]:5555",
        "ipc:///tmp/x.sock",
        "inproc://x",
    ],
)
def test_loopback_ipc_and_inproc_need_no_keys(address):
    check_bind(address)


@pytest.mark.asyncio
async def test_make_socket_applies_the_bind_rule():
    ctx = zmq.asyncio.Context()
    try:
        with pytest.raises(AddressError, match="taipan keys"):
            make_socket(ctx, zmq.ROUTER, "tcp://0.0.0.0:*", bind=True, name="clients")
        plain = make_socket(ctx, zmq.ROUTER, "tcp://127.0.0.1:*", bind=True, name="clients")
        plain.close()
    finally:
        ctx.term()


def test_a_curve_server_channel_needs_a_running_event_loop(keys):
    ctx = zmq.asyncio.Context()
    try:
        with pytest.raises(CurveError, match="event loop"):
            make_socket(
                ctx,
                zmq.ROUTER,
                "tcp://127.0.0.1:*",
                bind=True,
                name="x",
                curve=load_server_keys(keys[0]),
            )
    finally:
        ctx.term()


def test_a_libzmq_without_curve_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(zmq, "has", lambda capability: capability != "curve")
    with pytest.raises(CurveError, match="built without CurveZMQ"):
        write_keys(tmp_path / "keys")


# --- key files -----------------------------------------------------------------------------


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def taipan(*args: str) -> int:
    with pytest.raises(SystemExit) as done:
        cli.main(["keys", *args])
    return done.value.code


def test_taipan_keys_writes_private_files_and_refuses_to_overwrite(tmp_path, capsys):
    folder = tmp_path / "keys"
    assert taipan(str(folder)) == 0
    assert mode(folder) == 0o700 and mode(folder / "authorized") == 0o700
    assert mode(folder / "server.secret") == 0o600 and mode(folder / "client.secret") == 0o600
    assert mode(folder / "server.key") == 0o644
    assert sorted(os.listdir(folder / "authorized")) == ["client.key"]
    server, client = load_server_keys(folder), load_client_keys(folder)
    assert list(server.authorized.values()) == ["client"] and client.public in server.authorized
    assert client.server_public == server.public
    assert server.secret.decode() not in repr(server) and client.secret.decode() not in repr(client)
    before = (folder / "server.secret").read_bytes()

    capsys.readouterr()
    assert taipan(str(folder)) == 2
    err = capsys.readouterr().err
    assert err.startswith("taipan: error: keys exist:") and "pass --force" in err
    assert (folder / "server.secret").read_bytes() == before

    assert taipan(str(folder), "--add-client", "engine-1") == 0  # keeps the server pair
    assert (folder / "server.secret").read_bytes() == before
    assert sorted(load_server_keys(folder).authorized.values()) == ["client", "engine-1"]
    assert taipan(str(folder), "--add-client", "engine-1") == 2

    assert taipan(str(folder), "--force") == 0
    assert (folder / "server.secret").read_bytes() != before
    assert load_client_keys(folder).server_public == load_server_keys(folder).public

    assert taipan(str(folder), "--client", "server") == 2
    assert "reserved" in capsys.readouterr().err
    assert taipan(str(folder), "--add-client", "../escape") == 2
    assert "must be letters" in capsys.readouterr().err


def test_missing_keys_name_the_file_and_the_command(tmp_path):
    with pytest.raises(CurveError, match="no server secret key at .*server.secret.*taipan keys"):
        load_server_keys(tmp_path / "nowhere")
    write_keys(tmp_path / "keys")
    with pytest.raises(CurveError, match="no nobody secret key at .*nobody.secret"):
        load_client_keys(tmp_path / "keys", "nobody")
    (tmp_path / "keys" / "server.key").unlink()  # a client cannot do without it
    with pytest.raises(CurveError, match="no server public key at .*server.key"):
        load_client_keys(tmp_path / "keys")


def test_a_secret_others_can_read_is_refused(tmp_path):
    folder = tmp_path / "keys"
    write_keys(folder)
    for loose in (0o640, 0o604):
        os.chmod(folder / "client.secret", loose)
        with pytest.raises(CurveError, match=rf"\(mode 0{loose:o}\): chmod 600 .*client.secret"):
            load_client_keys(folder)
    os.chmod(folder / "client.secret", 0o600)
    assert load_client_keys(folder).server_public == load_server_keys(folder).public


@pytest.mark.parametrize(
    "text",
    ["not a key", "", "x" * 39, "~" * 40],  # "~" is not a Z85 character
)
def test_a_malformed_key_is_refused(tmp_path, text):
    folder = tmp_path / "keys"
    write_keys(folder)
    secret = folder / "server.secret"
    secret.write_text(text + "\n")
    with pytest.raises(CurveError, match="server.secret does not hold a Curve key"):
        load_server_keys(folder)
    write_keys(folder, force=True)
    (folder / "authorized" / "mallory.key").write_text(text + "\n")
    with pytest.raises(CurveError, match="mallory.key does not hold a Curve key"):
        load_server_keys(folder)


def test_a_pair_mixed_from_two_sets_is_refused(tmp_path):
    write_keys(tmp_path / "a")
    write_keys(tmp_path / "b")
    os.replace(tmp_path / "b" / "client.key", tmp_path / "a" / "client.key")
    with pytest.raises(CurveError, match="client.key is not the public key of client.secret"):
        load_client_keys(tmp_path / "a")


def test_the_authorized_folder_must_be_private_and_not_empty(tmp_path):
    folder = tmp_path / "keys"
    write_keys(folder)
    os.chmod(folder / "authorized", 0o722)  # others could add a key of their own
    with pytest.raises(CurveError, match="writable by nobody else.*chmod go-w"):
        load_server_keys(folder)
    os.chmod(folder / "authorized", 0o700)
    (folder / "authorized" / "client.key").unlink()
    with pytest.raises(CurveError, match="holds no client key.*--add-client NAME"):
        load_server_keys(folder)
