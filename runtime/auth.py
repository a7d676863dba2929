"""The control token: who may pause, suspend, update or stop a runtime.

Like a Jupyter server token: the launcher makes a random token when it starts a runtime and
writes it to a file only its user can read, named after the runtime's client address, in
`runtime_dir()`. A `Client` run by the same user on the same machine finds it there by the
address it connects to; anyone else passes it explicitly (`Client(..., control_token=...)` or
the `TAIPAN_CONTROL_TOKEN` environment variable). Requests and stats need no token.

The coordinator reads the token from a private file in the launcher's own temporary directory
(its path travels in the process spec; a token on a command line would be readable by every user
through /proc). The file named after the address is published only once the runtime is up, so
a second runtime that fails to bind a taken address never replaces the first one's token.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import stat
from pathlib import Path

ENV_TOKEN = "TAIPAN_CONTROL_TOKEN"
ENV_DIR = "TAIPAN_RUNTIME_DIR"


def runtime_dir() -> Path:
    """Where token files live: $TAIPAN_RUNTIME_DIR, else $XDG_RUNTIME_DIR/taipan, else
    ~/.cache/taipan/runtime."""
    if os.environ.get(ENV_DIR):
        return Path(os.environ[ENV_DIR])
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "taipan"
    return Path.home() / ".cache" / "taipan" / "runtime"


def normalize(address: str) -> str:
    """One spelling per endpoint: ipc paths made absolute, localhost as 127.0.0.1."""
    scheme, sep, rest = address.partition("://")
    if scheme == "ipc" and sep:
        return f"ipc://{os.path.abspath(rest)}"
    if scheme == "tcp" and sep and rest.startswith("localhost:"):
        return f"tcp://127.0.0.1:{rest.removeprefix('localhost:')}"
    return address


def token_file(address: str) -> Path:
    digest = hashlib.sha256(normalize(address).encode()).hexdigest()[:24]
    return runtime_dir() / f"control-{digest}.json"


def new_token() -> str:
    return secrets.token_urlsafe(32)


def write_token(path: str | os.PathLike, address: str, token: str) -> Path:
    """Store `token` (for the runtime at `address`) in `path`, readable by this user only."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    body = json.dumps({"address": normalize(address), "token": token, "pid": os.getpid()})
    tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(body)
    os.replace(tmp, path)  # atomic: a reader sees the old file or the whole new one
    return path


def publish_token(address: str, token: str) -> Path:
    """Where same-user clients of `address` will find `token` (see `find_token`)."""
    return write_token(token_file(address), address, token)


def read_token_file(path: str | os.PathLike) -> str:
    """The token in `path` (raises OSError or ValueError when it is unusable)."""
    with open(path) as f:
        token = json.load(f)["token"]
    if not isinstance(token, str) or not token:
        raise ValueError(f"{path} holds no control token")
    return token


def find_token(address: str) -> str | None:
    """The control token for `address`: $TAIPAN_CONTROL_TOKEN, else this user's token file for
    that address (ignored unless this user owns it and nobody else can read it), else None."""
    if os.environ.get(ENV_TOKEN):
        return os.environ[ENV_TOKEN]
    path = token_file(address)
    try:
        info = path.stat()
        if info.st_uid != os.getuid() or info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            return None
        return read_token_file(path)
    except (OSError, ValueError, KeyError):
        return None


def remove_token(path: Path, token: str) -> None:
    """Remove the token file, unless another runtime has replaced it since."""
    try:
        if read_token_file(path) == token:
            path.unlink()
    except (OSError, ValueError, KeyError):
        pass


def curve_keys(address: str, keys_dir: str | None, *, server: bool, key_name: str = "client"):
    """The Curve keys of a socket on `address` (actors/curve.py): with a key directory
    (`taipan keys DIR`), a tcp socket is a Curve server on the binding side (it admits only the
    authorized client keys) and a Curve client on the connecting side (the `key_name` pair);
    ipc and inproc sockets, which never leave this machine and sit in the user's private
    directories, use none. None without a key directory (loopback tcp only: actors/channel.py
    check_bind refuses anything wider)."""
    if keys_dir is None or not address.startswith("tcp://"):
        return None
    from taipan.actors.curve import load_client_keys, load_server_keys

    return load_server_keys(keys_dir) if server else load_client_keys(keys_dir, key_name)
