"""CurveZMQ for channels: the key set on disk, each side's keys, and the ZAP check of clients.

Owns: the key-set layout (`write_keys`, what `taipan keys DIR` runs, and the loaders
`load_server_keys` / `load_client_keys`), the socket options of a Curve server or client
(`apply_curve`), and the ZAP handler that admits only authorized client keys. It does not decide
when keys are needed: the bind rule lives in channel.py (`check_bind`).

A key set in DIR (mode 0700):

    server.key       the server's public key: every client needs it
    server.secret    the server's secret key (0600): only where the server runs
    NAME.key         a client's public key (the default client is named "client")
    NAME.secret      that client's secret key (0600): only where that client runs
    authorized/      public keys the server admits, NAME.key each (0700): delete one to revoke

Each file holds one Z85 key (40 characters) and a newline. A trusted cluster copies the whole DIR
to every host; a less trusted client gets only server.key and its own pair.

The ZAP handler: libzmq asks one inproc endpoint per context about every Curve handshake; the
handler answers from this event loop (a reader callback on the socket's descriptor: no thread, no
task) and lives while any Curve server socket of that context is open. Each server socket has its
own ZAP domain, so two channels of one process may admit different clients; an admitted
connection's ZMQ User-Id is the client's name. Curve servers also set ZMQ_ZAP_ENFORCE_DOMAIN, so a
handshake with no handler to ask fails instead of passing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import re
import stat
from collections.abc import Mapping
from pathlib import Path

import zmq
from zmq.utils import z85

from taipan.actors.log import get_logger

DEFAULT_CLIENT = "client"
SERVER = "server"
AUTHORIZED = "authorized"
ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by the ZAP protocol (ZMQ RFC 27)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_LOGGED_REFUSALS = 1024  # distinct refused (address, key) pairs logged at warning, then debug


class CurveError(Exception):
    """Curve keys are missing, unsafe or malformed, or libzmq cannot do Curve."""


@dataclasses.dataclass(frozen=True)
class CurveServer:
    """A Curve server's keys (Z85) and the client public keys it admits (Z85 -> name)."""

    public: bytes
    secret: bytes
    authorized: Mapping[bytes, str]

    def __repr__(self) -> str:  # never print a secret into a log
        return f"CurveServer(public={self.public!r}, authorized={sorted(self.authorized.values())})"


@dataclasses.dataclass(frozen=True)
class CurveClient:
    """A Curve client's own key pair and the public key of the server it talks to (Z85)."""

    public: bytes
    secret: bytes
    server_public: bytes

    def __repr__(self) -> str:
        return f"CurveClient(public={self.public!r}, server_public={self.server_public!r})"


def require_curve() -> None:
    if not zmq.has("curve"):
        raise CurveError(
            f"this libzmq ({zmq.zmq_version()}, under pyzmq {zmq.__version__}) was built without "
            "CurveZMQ; install a pyzmq wheel that bundles it (pip install --force-reinstall "
            "pyzmq) to use tcp beyond loopback"
        )


# --- key files ------------------------------------------------------------------------------


def _check_name(name: str) -> None:
    if name in (SERVER, AUTHORIZED):
        raise CurveError(f"{name!r} is reserved; name the client something else")
    if not _NAME.fullmatch(name):
        raise CurveError(f"client name {name!r} must be letters, digits, '_', '.' or '-'")


def _write(path: Path, text: bytes, mode: int) -> None:
    """Write `path` atomically, created with `mode` (a secret is never readable by others, not
    even for a moment)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(text + b"\n")
    os.chmod(tmp, mode)  # the umask may have narrowed it; public keys are meant to be readable
    os.replace(tmp, path)


def write_keys(
    directory: str | os.PathLike,
    clients: list[str] | None = None,
    *,
    server: bool = True,
    force: bool = False,
) -> list[Path]:
    """Write a key set into `directory` (see the module docstring): the server's pair (unless
    `server` is False: adding clients to a set) and one pair per name in `clients` (default
    ["client"]), each authorized. Refuses to replace an existing key unless `force`. Returns
    the files written."""
    require_curve()
    directory = Path(directory)
    clients = [DEFAULT_CLIENT] if clients is None else clients
    if not clients and not server:
        raise CurveError("nothing to write: name at least one client")
    for name in clients:
        _check_name(name)
    if len(set(clients)) != len(clients):
        raise CurveError(f"client names repeat: {clients}")
    names = ([SERVER] if server else []) + clients
    targets = [directory / f"{n}.{ext}" for n in names for ext in ("key", "secret")]
    targets += [directory / AUTHORIZED / f"{n}.key" for n in clients]
    existing = [str(p) for p in targets if p.exists()]
    if existing and not force:
        raise CurveError(f"keys exist: {', '.join(existing)}; pass --force to replace them")
    written = []
    try:
        for d in (directory, directory / AUTHORIZED):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(d, 0o700)
        for name in names:
            public, secret = zmq.curve_keypair()
            _write(directory / f"{name}.secret", secret, 0o600)
            _write(directory / f"{name}.key", public, 0o644)
            written += [directory / f"{name}.secret", directory / f"{name}.key"]
            if name != SERVER:
                _write(directory / AUTHORIZED / f"{name}.key", public, 0o644)
                written.append(directory / AUTHORIZED / f"{name}.key")
    except OSError as e:
        raise CurveError(f"cannot write keys into {directory}: {e}") from None
    return written


def _parse_key(path: Path, text: bytes) -> bytes:
    key = text.strip()
    try:
        ok = len(key) == 40 and len(z85.decode(key)) == 32
    except (ValueError, KeyError, IndexError):
        ok = False
    if not ok:
        raise CurveError(
            f"{path} does not hold a Curve key (40 Z85 characters); write a new set with "
            "`taipan keys DIR`"
        )
    return key


def _read(path: Path, what: str, secret: bool = False) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise CurveError(
            f"no {what} at {path}: write a key set with `taipan keys {path.parent}` and pass "
            "its directory"
        ) from None
    except OSError as e:
        raise CurveError(f"cannot read {what} at {path}: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())  # the file opened, not whatever the path names now
        if not stat.S_ISREG(info.st_mode):
            raise CurveError(f"{what} at {path} is not a file")
        if secret and (info.st_uid != os.getuid() or info.st_mode & 0o077):
            raise CurveError(
                f"{what} {path} must belong to this user and be readable by nobody else "
                f"(mode {stat.S_IMODE(info.st_mode):04o}): chmod 600 {path}"
            )
        return _parse_key(path, f.read(1024))


def _pair(directory: Path, name: str) -> tuple[bytes, bytes]:
    """(public, secret) of `name` in `directory`; the public file must match the secret."""
    secret = _read(directory / f"{name}.secret", f"{name} secret key", secret=True)
    public = zmq.curve_public(secret)
    path = directory / f"{name}.key"
    if path.exists() and _read(path, f"{name} public key") != public:
        raise CurveError(
            f"{path} is not the public key of {name}.secret (a pair mixed from two sets?); "
            "copy both files of one pair"
        )
    return public, secret


def _check_not_writable_by_others(path: Path) -> None:
    info = path.stat()
    if info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise CurveError(
            f"{path} must belong to this user and be writable by nobody else (whoever can "
            f"write there can authorize a client): chmod go-w {path}"
        )


def load_server_keys(directory: str | os.PathLike) -> CurveServer:
    """The server side of the key set in `directory`: its pair and authorized/*.key."""
    require_curve()
    directory = Path(directory)
    public, secret = _pair(directory, SERVER)
    folder = directory / AUTHORIZED
    if not folder.is_dir():
        raise CurveError(f"no {folder}: the server admits only the client keys listed there")
    _check_not_writable_by_others(folder)
    authorized = {}
    for path in sorted(folder.glob("*.key")):
        _check_not_writable_by_others(path)
        authorized[_read(path, "authorized client key")] = path.stem
    if not authorized:
        raise CurveError(
            f"{folder} holds no client key, so no client could connect: add one with "
            f"`taipan keys {directory} --add-client NAME`"
        )
    return CurveServer(public, secret, authorized)


def load_client_keys(directory: str | os.PathLike, name: str = DEFAULT_CLIENT) -> CurveClient:
    """The client side of the key set in `directory`: server.key and the pair `name`."""
    require_curve()
    directory = Path(directory)
    _check_name(name)
    server_public = _read(directory / f"{SERVER}.key", "server public key")
    public, secret = _pair(directory, name)
    return CurveClient(public, secret, server_public)


# --- sockets --------------------------------------------------------------------------------


class ZapGuard:
    """A Curve server socket's hold on its context's ZAP handler; `release` after the socket
    closes (before, its next handshake would find no handler and fail)."""

    def __init__(self, handler: _ZapHandler, domain: str):
        self.handler, self.domain = handler, domain

    def release(self) -> None:
        if self.handler is not None:
            self.handler.unregister(self.domain)
            self.handler = None


def apply_curve(sock: zmq.Socket, curve: CurveServer | CurveClient, name: str) -> ZapGuard | None:
    """Set `sock`'s Curve options, before it binds or connects. A server also registers its
    authorized keys with the ZAP handler of the socket's context (started here on the running
    event loop if need be); the caller releases the returned guard after closing the socket."""
    require_curve()
    if isinstance(curve, CurveClient):
        sock.setsockopt(zmq.CURVE_SERVERKEY, curve.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, curve.secret)
        return None
    if not isinstance(curve, CurveServer):
        raise TypeError(f"curve must be a CurveServer or a CurveClient, not {type(curve).__name__}")
    handler = _ZapHandler.of(sock.context)
    domain = handler.register(name, curve.authorized)
    try:
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, curve.secret)
        sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
    except BaseException:
        handler.unregister(domain)
        raise
    return ZapGuard(handler, domain)


class _ZapHandler:
    """Answers libzmq's ZAP requests for one context: CURVE from an authorized key is admitted
    (its name becomes the connection's User-Id), anything else refused."""

    _by_context: dict[int, _ZapHandler] = {}
    _domains = itertools.count()

    def __init__(self, ctx: zmq.Context, loop: asyncio.AbstractEventLoop):
        self.key = ctx.underlying
        self.loop = loop
        self.sock = zmq.Socket(ctx, zmq.REP)  # plain socket: answered without waiting
        self.sock.setsockopt(zmq.LINGER, 0)
        try:
            self.sock.bind(ZAP_ENDPOINT)
        except zmq.ZMQError as e:
            self.sock.close()
            raise CurveError(
                f"cannot serve ZAP on {ZAP_ENDPOINT} ({e}): another authenticator owns this "
                "context; give taipan's Curve channels a context of their own"
            ) from None
        self.domains: dict[str, tuple[str, dict[bytes, str]]] = {}
        self.refused: set[tuple[str, bytes]] = set()
        self.log = get_logger(component="zap")
        loop.add_reader(self.sock.getsockopt(zmq.FD), self._drain)

    @classmethod
    def of(cls, ctx: zmq.Context) -> _ZapHandler:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise CurveError(
                "a Curve server channel must be made on the event loop that runs its actor"
            ) from None
        handler = cls._by_context.get(ctx.underlying)
        if handler is None:
            handler = cls._by_context[ctx.underlying] = cls(ctx, loop)
        elif handler.loop is not loop:
            raise CurveError("the Curve server channels of one context must share an event loop")
        return handler

    def register(self, channel: str, authorized: Mapping[bytes, str]) -> str:
        domain = f"taipan.{channel}.{next(self._domains)}"
        binary = {z85.decode(k): name for k, name in authorized.items()}
        self.domains[domain] = (channel, binary)
        return domain

    def unregister(self, domain: str) -> None:
        self.domains.pop(domain, None)
        if self.domains:
            return
        del self._by_context[self.key]
        if not self.loop.is_closed():
            self.loop.remove_reader(self.sock.getsockopt(zmq.FD))
        # Unbind first: a closed socket frees its endpoint only later, in libzmq's own thread,
        # and a new handler of this context must be able to bind it at once.
        self.sock.unbind(ZAP_ENDPOINT)
        self.sock.close()

    def _drain(self) -> None:
        # The descriptor only signals a change: read every queued request each time.
        while not self.sock.closed and self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                request = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.sock.send_multipart(self._answer(request), zmq.NOBLOCK)

    def _answer(self, request: list[bytes]) -> list[bytes]:
        """The ZAP reply: [version, request id, status, text, user id, metadata]."""
        if len(request) < 6 or request[0] != b"1.0":
            request_id = request[1] if len(request) > 1 else b""
            return [b"1.0", request_id, b"500", b"malformed ZAP request", b"", b""]
        _, request_id, domain, address, _, mechanism, *credentials = request
        channel, authorized = self.domains.get(domain.decode(errors="replace"), ("?", {}))
        key = credentials[0] if mechanism == b"CURVE" and credentials else b""
        name = authorized.get(key)
        if name is not None:
            self.log.debug(
                "curve client admitted",
                channel=channel,
                client=name,
                address=address.decode(errors="replace"),
            )
            return [b"1.0", request_id, b"200", b"OK", name.encode(), b""]
        self._log_refusal(channel, address.decode(errors="replace"), mechanism, key)
        return [b"1.0", request_id, b"400", b"client key not authorized", b"", b""]

    def _log_refusal(self, channel: str, address: str, mechanism: bytes, key: bytes) -> None:
        # A refused client reconnects on its own: warn once per address and key, not per try.
        seen = (address, key)
        first = seen not in self.refused and len(self.refused) < _LOGGED_REFUSALS
        if first:
            self.refused.add(seen)
        level = self.log.warning if first else self.log.debug
        public = z85.encode(key).decode() if len(key) == 32 else None
        level(
            "curve client refused: its key is not in authorized/",
            channel=channel,
            address=address,
            mechanism=mechanism.decode(errors="replace"),
            public_key=public,
        )
