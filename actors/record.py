"""Message recording: one append-only log per actor, and the reader for it.

Owns: the `.tplog` file format. `Recorder` is the only writer of a log and only ever appends;
channels call `Recorder.write` for every inbound and outbound message (actors/channel.py), and
`read_log` is the only reader (`taipan replay`). Must not touch: sockets, actors, message
decoding (a log stores raw frames, so a message that failed to decode is recorded as it came).

File format, version 1 (all integers little-endian):

    file header    8 bytes magic b"TPLOG\\x00\\r\\n", uint32 format version
    record*        uint64 body length, uint32 crc32(body), uint32 crc32(the 12 bytes before), body

    body           msgpack array [direction, time, channel, peer, frames]
                   direction "in" | "out"; time float seconds (time.time() when the channel saw
                   it); channel str (the actor's local channel name); peer bin | nil (routing
                   identity on ROUTER sockets); frames array of bin (the encoded message, without
                   the routing identity frame)

Each record goes to the OS in one write() as soon as it is made, so a crash of the process loses
at most the record being written (an OS crash may lose more: there is no fsync per record). The
header checksum tells a damaged length from a torn tail, the body checksum a damaged body, and
`read_log` names the byte offset of the bad record.
"""

from __future__ import annotations

import dataclasses
import os
import struct
import threading
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import msgpack

MAGIC = b"TPLOG\x00\r\n"  # the \r\n makes a text-mode copy (CRLF mangling) fail at the magic
FORMAT_VERSION = 1
SUFFIX = ".tplog"
FILE_HEADER = struct.Struct("<8sI")
RECORD_HEADER = struct.Struct("<QII")
DIRECTIONS = ("in", "out")


class LogError(Exception):
    """A log that cannot be read (missing, not a log, truncated or corrupt); says where."""


@dataclasses.dataclass(frozen=True, slots=True)
class Record:
    """One recorded message. `offset` is the byte offset of its record header in the file."""

    offset: int
    direction: str
    time: float
    channel: str
    peer: bytes | None
    frames: tuple[bytes, ...]


class Recorder:
    """Appends every message an actor sends or receives to `DIR/<actor_name>.tplog`.

    One Recorder per actor, shared by all of that actor's channels. `write` may be called from
    any thread (the gpu actor's forward thread included); a lock keeps records whole.
    """

    def __init__(self, directory: str | os.PathLike, actor_name: str):
        if not actor_name or "/" in actor_name or os.sep in actor_name or actor_name[0] == ".":
            raise ValueError(f"actor name {actor_name!r} cannot be a log file name")
        self.actor_name = actor_name
        self.path = Path(directory) / f"{actor_name}{SUFFIX}"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fresh = not self.path.exists() or self.path.stat().st_size == 0
        if not fresh:
            # Appending after a torn tail would hide every new record behind the bad one.
            try:
                for _ in read_log(self.path):
                    pass
            except LogError as e:
                raise LogError(f"{e}; move the old log away before recording again") from None
        # Unbuffered: each write() below is one system call holding one whole record. Readable
        # by this user only: a log holds prompts, outputs and control tokens.
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._file = open(fd, "ab", buffering=0)  # closed by close()
        if fresh:
            self._file.write(FILE_HEADER.pack(MAGIC, FORMAT_VERSION))
        self._lock = threading.Lock()
        self.records_written = 0

    def write(
        self,
        direction: str,
        channel: str,
        peer: bytes | None,
        frames: Sequence[bytes | memoryview],
        t: float,
    ) -> None:
        """Append one record. Packing copies the frames, so the caller may reuse them after."""
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be 'in' or 'out', got {direction!r}")
        body = msgpack.packb([direction, float(t), channel, peer, list(frames)], use_bin_type=True)
        data = _record_header(len(body), zlib.crc32(body)) + body
        with self._lock:
            if self._file is None:
                raise ValueError(f"recorder for {self.actor_name} is closed")
            self._file.write(data)
            self.records_written += 1

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_log(path: str | os.PathLike) -> Iterator[Record]:
    """Yield the records of one log in file order.

    Raises LogError (never anything else for bad input) when the file cannot be opened, is not a
    taipan log, or has a truncated or corrupt record; records before the bad one are yielded
    first. Reads up to the file size seen at open, so a log still being written is safe to read.
    """
    name = str(path)
    try:
        f = open(path, "rb")  # closed by the with below
    except OSError as e:
        raise LogError(f"cannot open {name}: {e.strerror or e}") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        _read_file_header(f.read(FILE_HEADER.size), name)
        offset = FILE_HEADER.size
        while offset < size:
            head = f.read(RECORD_HEADER.size)
            if len(head) < RECORD_HEADER.size:
                raise LogError(
                    f"truncated record header at byte {offset} of {name}: "
                    f"{RECORD_HEADER.size} bytes needed, {len(head)} remain"
                )
            length, crc, head_crc = RECORD_HEADER.unpack(head)
            if zlib.crc32(head[:12]) != head_crc:
                raise LogError(
                    f"corrupt record header at byte {offset} of {name}: checksum mismatch"
                )
            remain = size - offset - RECORD_HEADER.size
            if length > remain:
                raise LogError(
                    f"truncated record at byte {offset} of {name}: "
                    f"header says {length} bytes, {remain} remain"
                )
            body = f.read(length)
            if zlib.crc32(body) != crc:
                raise LogError(f"corrupt record at byte {offset} of {name}: checksum mismatch")
            yield _parse_body(body, offset, name)
            offset += RECORD_HEADER.size + length


def _record_header(length: int, crc: int) -> bytes:
    lead = struct.pack("<QI", length, crc)
    return lead + struct.pack("<I", zlib.crc32(lead))


def _read_file_header(head: bytes, name: str) -> None:
    if len(head) < FILE_HEADER.size:
        raise LogError(
            f"{name} is not a taipan log: {len(head)} bytes, the file header alone is "
            f"{FILE_HEADER.size}"
        )
    magic, version = FILE_HEADER.unpack(head)
    if magic != MAGIC:
        raise LogError(f"{name} is not a taipan log (bad magic at byte 0)")
    if version != FORMAT_VERSION:
        raise LogError(
            f"{name} is log format version {version}; this taipan reads version {FORMAT_VERSION}"
        )


def _parse_body(body: bytes, offset: int, name: str) -> Record:
    def corrupt(what: str) -> LogError:
        return LogError(f"corrupt record at byte {offset} of {name}: {what}")

    try:
        obj = msgpack.unpackb(body, raw=False, use_list=True, strict_map_key=True)
    except Exception as e:  # msgpack raises many types for garbage; all mean "not msgpack"
        raise corrupt(f"body is not msgpack ({type(e).__name__})") from None
    if not isinstance(obj, list) or len(obj) != 5:
        raise corrupt("body is not [direction, time, channel, peer, frames]")
    direction, t, channel, peer, frames = obj
    if direction not in DIRECTIONS:
        raise corrupt(f"direction {direction!r} is not 'in' or 'out'")
    if not isinstance(t, float | int) or isinstance(t, bool):
        raise corrupt(f"time is a {type(t).__name__}, not a number")
    if not isinstance(channel, str):
        raise corrupt(f"channel is a {type(channel).__name__}, not a string")
    if peer is not None and not isinstance(peer, bytes):
        raise corrupt(f"peer is a {type(peer).__name__}, not bytes or nil")
    if not isinstance(frames, list) or not all(isinstance(x, bytes) for x in frames):
        raise corrupt("frames is not a list of byte strings")
    return Record(offset, direction, float(t), channel, peer, tuple(frames))
