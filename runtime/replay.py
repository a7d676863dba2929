"""`taipan replay DIR`: read a `--record` directory, print a timeline, or `--check` determinism.

Owns: turning `.tplog` files (actors/record.py) into a merged, filtered, readable timeline, and
re-driving deterministic actors from their recorded inbound messages. Reads logs, never writes
them; builds fresh actor cores and never touches live actors or sockets.

Two actors have checkers that read their whole log and the config the launcher saved beside
it (`LOG_CHECKERS`): the engine (`check_engine`: it re-plans every step and compares BlockOps
and StepPlan, see actors/engine/check.py) and the coordinator (`check_coordinator`: it
re-routes every submission and compares each EngineSubmit, see actors/coordinator/check.py).
Other checkers: `CHECKERS` maps an actor-name prefix ("allocator" covers "allocator" and
"allocator-0"; "mamba_cache" likewise) to a factory `make(actor_name) -> respond`;
`respond(record)` takes one recorded inbound record and returns the outbound messages the
actor's deterministic core produces for it, as `(channel, peer, frames)`. Exit codes: 0 ok,
1 a divergence, 2 unreadable input, 3 some actor not checked (unless --allow-unchecked).
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import os
import re
import sys
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from taipan.actors.allocator.actor import AllocatorService
from taipan.actors.config import ConfigError, InferenceConfig, plan_limits, routing_policy
from taipan.actors.coordinator.check import CoordinatorReplay
from taipan.actors.engine.check import EngineReplay
from taipan.actors.mamba_cache.actor import MambaCacheService
from taipan.actors.record import SUFFIX, LogError, Record, read_log
from taipan.messages.codec import MessageError, decode, encode, registry
from taipan.messages.requests import RequestOutput, StepOutputs
from taipan.messages.summary import cut as _cut
from taipan.messages.summary import summarize

Outbound = tuple[str, bytes | None, tuple[bytes, ...]]
Responder = Callable[[Record], list[Outbound]]
REQUEST_ID_FIELDS = ("request_id",)
REQUEST_ID_ARRAYS = ("request_ids", "alloc_ids", "free_ids")
ARROWS = {"in": "←", "out": "→"}
CONFIG_FILE = "config.json"  # the InferenceConfig, written by the launcher when recording
RUNTIME_FILE = "runtime.json"  # {"num_ranks": N, "tensor_parallel_size": T}, written beside it


def _service_checker(service) -> Responder:
    """Re-drive a pure service (allocator, mamba_cache): its replies to the recorded inbound
    frames must be the recorded outbound ones."""

    def respond(rec: Record) -> list[Outbound]:
        reply = service.handle_frames(rec.frames)
        if reply is None:
            return []
        return [(rec.channel, rec.peer, tuple(bytes(f) for f in encode(reply)))]

    return respond


CHECKERS: dict[str, Callable[[str], Responder]] = {
    "allocator": lambda name: _service_checker(AllocatorService(name)),
    "mamba_cache": lambda name: _service_checker(MambaCacheService(name)),
}


class ReplayError(Exception):
    """Input that replay cannot use (missing directory, no logs, unknown actor)."""


# --- CLI ------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", help="a --record directory, or one .tplog file")
    parser.add_argument(
        "--actor", action="append", default=[], metavar="NAME", help="only this actor (repeat)"
    )
    parser.add_argument(
        "--request",
        type=int,
        metavar="ID",
        help="only messages about request ID (request_id, request_ids, alloc_ids or free_ids; "
        "of a StepOutputs, only that request's output)",
    )
    parser.add_argument(
        "--type",
        action="append",
        default=[],
        dest="types",
        metavar="NAME",
        help="only messages of this class, e.g. BlockOps (repeat); RequestOutput also shows "
        "the StepOutputs that carry them",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="re-drive deterministic actors from their inbound messages and compare the replies",
    )
    parser.add_argument(
        "--allow-unchecked",
        action="store_true",
        help="with --check: exit 0 even when some selected actor could not be checked",
    )


def run(args: argparse.Namespace) -> int:
    try:
        try:
            logs = _select(_find_logs(args.dir), args.actor)
            _check_types(args.types)
        except ReplayError as e:
            print(f"taipan replay: {e}", file=sys.stderr)
            return 2
        loaded, errors = _load(logs)
        if args.check:
            if errors:
                for err in errors:
                    print(f"taipan replay: {err}", file=sys.stderr)
                return 2
            try:
                return check(loaded, logs, allow_unchecked=args.allow_unchecked)
            except ReplayError as e:  # a file beside the logs is unusable
                print(f"taipan replay: {e}", file=sys.stderr)
                return 2
        # A crash leaves a torn tail: show everything before it, then say where it broke.
        print_timeline(loaded, request=args.request, types=set(args.types))
        for err in errors:
            print(f"taipan replay: {err}", file=sys.stderr)
        return 2 if errors else 0
    except BrokenPipeError:  # `taipan replay DIR | head`: the reader left, which is fine
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="taipan replay", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


def _find_logs(path: str) -> dict[str, Path]:
    p = Path(path)
    if p.is_file():
        return {p.name.removesuffix(SUFFIX): p}
    if not p.is_dir():
        raise ReplayError(f"{path} does not exist")
    logs = {f.name.removesuffix(SUFFIX): f for f in sorted(p.glob(f"*{SUFFIX}"))}
    if not logs:
        raise ReplayError(f"no {SUFFIX} files in {path}")
    return logs


def _select(logs: dict[str, Path], actors: list[str]) -> dict[str, Path]:
    missing = [a for a in actors if a not in logs]
    if missing:
        raise ReplayError(f"no log for actor {', '.join(missing)} (have: {', '.join(logs)})")
    return {name: p for name, p in logs.items() if not actors or name in actors}


def _check_types(types: list[str]) -> None:
    known = {cls.__name__ for cls in registry().values()}
    unknown = [t for t in types if t not in known]
    if unknown:
        raise ReplayError(
            f"unknown message type {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )


def _load(logs: dict[str, Path]) -> tuple[dict[str, list[Record]], list[str]]:
    loaded: dict[str, list[Record]] = {}
    errors: list[str] = []
    for name, path in logs.items():
        records = loaded.setdefault(name, [])
        try:
            for rec in read_log(path):  # keep the good records before a bad one
                records.append(rec)
        except LogError as e:
            errors.append(str(e))
    return loaded, errors


# --- timeline -------------------------------------------------------------------------------------


def print_timeline(
    loaded: dict[str, list[Record]], request: int | None = None, types: set[str] = frozenset()
) -> None:
    """Every record of every actor, merged by time (each actor's own order kept). A StepOutputs
    is followed by the RequestOutputs it carries, one indented line each."""
    times = [r.time for recs in loaded.values() for r in recs]
    if not times:
        return
    t0 = min(times)  # relative to the first record of all, so filters do not shift times
    width = max(len(name) for name in loaded)
    lines = []
    streams = [[(name, r) for r in recs] for name, recs in loaded.items()]
    for name, rec in heapq.merge(*streams, key=lambda item: item[1].time):
        msg, error = _decode(rec.frames)
        if types and (msg is None or not types & _type_names(msg)):
            continue
        if request is not None and (msg is None or not _mentions(msg, request)):
            continue
        where = f"{ARROWS[rec.direction]} {_endpoint(rec.channel, rec.peer)}"
        head = f"{(rec.time - t0) * 1e3:10.3f} ms  {name:<{width}}"
        lines.append((head, where, _text(msg, error)))
        if isinstance(msg, StepOutputs):
            lines += [(" " * len(head), "", f"  ↳ {x}") for x in _carried(msg, request)]
    # Pad the channel column to the widest one shown, so that summaries line up.
    pad = max((len(where) for _, where, _ in lines), default=0)
    for head, where, text in lines:
        print(f"{head} {where:<{pad}}  {text}")


def _decode(frames: tuple[bytes, ...]):
    try:
        return decode(frames), None
    except MessageError as e:
        return None, e


def _text(msg, error: MessageError | None) -> str:
    return f"<bad message: {_cut(str(error), 80)}>" if msg is None else summarize(msg)


def _type_names(msg) -> set[str]:
    """The class names a --type filter matches: a StepOutputs also counts as RequestOutput."""
    names = {type(msg).__name__}
    if isinstance(msg, StepOutputs):
        names.add(RequestOutput.__name__)
    return names


def _carried(msg: StepOutputs, request: int | None) -> list[str]:
    """Summaries of the outputs a StepOutputs carries (only `request`'s, when given)."""
    try:
        outputs = msg.decoded()
    except MessageError as e:
        return [f"<bad output: {_cut(str(e), 80)}>"]
    return [summarize(o) for o in outputs if request is None or o.request_id == request]


def _endpoint(channel: str, peer: bytes | None) -> str:
    return channel if peer is None else f"{channel}[{_peer(peer)}]"


def _mentions(msg, request_id: int) -> bool:
    for field in REQUEST_ID_FIELDS:
        if getattr(msg, field, None) == request_id:
            return True
    for field in REQUEST_ID_ARRAYS:
        arr = getattr(msg, field, None)
        if isinstance(arr, np.ndarray) and bool(np.any(arr == request_id)):
            return True
    return False


def _peer(peer: bytes) -> str:
    if peer.isascii() and peer.decode("ascii").isprintable():
        return _cut(peer.decode("ascii"), 16)
    return _cut(peer.hex(), 16)


# --- check ----------------------------------------------------------------------------------------


@dataclasses.dataclass
class Divergence:
    index: int  # position of the offending record in the actor's log
    offset: int  # its byte offset, or -1 when the log ended early
    what: str
    recorded: str
    replayed: str


# Actors without a checker, and why (the first whose pattern matches the whole name). A check
# that could not run is reported, never a pass.
UNCHECKED = {
    r"gpu-\d+-tp\d+": "a tensor-parallel follower: it runs its leader's messages (the engine's "
    "plans) and computes; its outputs depend on the weights",
    r"gpu.*": "it computes; its outputs depend on the weights, so replay checks the actors that "
    "decide (engine, allocator, coordinator), not the one that computes",
    r"client.*": "no checker: clients are user code",
}


def check(
    loaded: dict[str, list[Record]],
    paths: dict[str, Path] | None = None,
    *,
    allow_unchecked: bool = False,
) -> int:
    """Re-drive every actor that has a checker; print one line per actor. Exit code: 0 all
    checked and equal; 1 a divergence; 3 no divergence but some actor could not be checked
    (0 with `allow_unchecked`)."""
    failed, unchecked = False, []
    for name, records in loaded.items():
        n_in = sum(r.direction == "in" for r in records)
        counts = f"{len(records)} records checked ({n_in} in, {len(records) - n_in} out)"
        log_checker = _prefixed(LOG_CHECKERS, name)
        if log_checker is not None:
            directory = paths[name].parent if paths else None
            div, note = log_checker(records, directory)
            if div is None and note.startswith("not"):
                print(f"{name}: {note}")
                unchecked.append(name)
                continue
            if div is None:
                print(f"{name}: ok, {note}")
                continue
        else:
            make = _prefixed(CHECKERS, name)
            if make is None:
                why = next((w for p, w in UNCHECKED.items() if re.fullmatch(p, name)), "no checker")
                print(f"{name}: not checked ({why})")
                unchecked.append(name)
                continue
            div = check_actor(records, make(name))
            if div is None:
                print(f"{name}: ok, {counts}")
                continue
        failed = True
        where = f"byte {div.offset} of {paths[name]}" if paths and div.offset >= 0 else "end of log"
        print(f"{name}: DIVERGES at record #{div.index} ({where}): {div.what}")
        print(f"  recorded: {div.recorded}")
        print(f"  replayed: {div.replayed}")
    if failed:
        return 1
    if unchecked and not allow_unchecked:
        print(
            f"taipan replay: {len(unchecked)} actor(s) not checked ({', '.join(unchecked)}); "
            "choose actors with --actor, or pass --allow-unchecked to accept that",
            file=sys.stderr,
        )
        return 3
    return 0


def check_engine(records: list[Record], directory: Path | None) -> tuple[Divergence | None, str]:
    """Re-plan every step of an engine log (actors/engine/check.py) with the config the launcher
    saved beside it; (divergence, "") or (None, a note on what was checked)."""
    config, note = _saved_config(directory)
    if config is None:
        return None, note
    replay = EngineReplay(config)

    def feed(rec: Record, msg) -> str | None:
        if rec.direction == "in":
            return replay.inbound(rec.channel, msg, rec.time)
        return replay.outbound(msg, rec.frames) if msg is not None else None

    div = _drive(records, feed)
    return div, "" if div else f"{replay.steps_checked} steps re-planned ({len(records)} records)"


def check_coordinator(
    records: list[Record], directory: Path | None
) -> tuple[Divergence | None, str]:
    """Re-route every submission of the coordinator's log (actors/coordinator/check.py) with
    the routing settings of the config the launcher saved beside it, as runtime/procs.py builds
    the live coordinator; (divergence, "") or (None, a note on what was checked)."""
    config, note = _saved_config(directory)
    if config is None:
        return None, note
    replay = CoordinatorReplay(
        policy=routing_policy(config),
        alpha=config.prefix_caching_routing_alpha,
        capacity=plan_limits(config)[0],
        prefix_caching=config.enable_prefix_caching,
        num_ranks=_saved_num_ranks(directory),
    )

    def feed(rec: Record, msg) -> str | None:
        if rec.direction == "in":
            return replay.inbound(rec.channel, rec.peer, msg, rec.time)
        return replay.outbound(rec.channel, rec.peer, msg, rec.frames)

    div = _drive(records, feed, lambda: replay.replayed)
    return div, "" if div else f"{replay.summary()} ({len(records)} records)"


def _saved_num_ranks(directory: Path | None) -> int | None:
    """The engine ranks the runtime was started with (RUNTIME_FILE), None when not saved."""
    path = directory / RUNTIME_FILE if directory is not None else None
    if path is None or not path.exists():
        return None
    try:
        num_ranks = json.loads(path.read_text())["num_ranks"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ReplayError(f"cannot read {path}: {e!r}") from None
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
        raise ReplayError(f"{path}: num_ranks must be an int >= 1, got {num_ranks!r}")
    return num_ranks


def _saved_config(directory: Path | None) -> tuple[InferenceConfig | None, str]:
    """The InferenceConfig the launcher wrote beside the logs, or (None, why not checked)."""
    config_path = directory / CONFIG_FILE if directory is not None else None
    if config_path is None or not config_path.exists():
        return None, f"not checked (no {CONFIG_FILE} beside the log)"
    try:
        return InferenceConfig.from_dict(json.loads(config_path.read_text())), ""
    except (ValueError, ConfigError) as e:
        return None, f"not checked ({config_path} is unusable: {e})"


def _drive(
    records: list[Record],
    feed: Callable[[Record, object], str | None],
    replayed: Callable[[], str | None] = lambda: None,
) -> Divergence | None:
    """Feed every record, decoded, to a log checker; the first text it returns diverges.
    `replayed()` then describes what the checker produces instead (None: that text does)."""
    for index, rec in enumerate(records):
        msg, _ = _decode(rec.frames)
        try:
            what = feed(rec, msg)
        except Exception as e:  # a crashing core is a divergence to report, not to raise
            return Divergence(index, rec.offset, "the checker raised", "-", repr(e))
        if what is not None:
            recorded = _describe(rec.channel, rec.peer, rec.frames)
            return Divergence(index, rec.offset, what, recorded, replayed() or what)
    return None


# Checkers that read a whole log and the config beside it: (divergence, note).
LOG_CHECKERS: dict[str, Callable[[list[Record], Path | None], tuple[Divergence | None, str]]] = {
    "engine": check_engine,
    "coordinator": check_coordinator,
}


def _prefixed(checkers: dict, name: str):
    """The checker registered under the longest prefix of `name`, or None."""
    prefixes = [p for p in checkers if name.startswith(p)]
    return checkers[max(prefixes, key=len)] if prefixes else None


def check_actor(records: Iterable[Record], respond: Responder) -> Divergence | None:
    """Compare what `respond` produces for each inbound record with the recorded outbound ones.

    Replies are matched in order; an actor may answer one inbound message with zero or more
    outbound ones, so expected replies queue up until the next recorded "out" consumes them.
    """
    pending: deque[tuple[int, Outbound]] = deque()
    index = -1
    for index, rec in enumerate(records):
        if rec.direction == "in":
            try:
                pending.extend((index, out) for out in respond(rec))
            except Exception as e:  # a crashing core is a divergence to report, not to raise
                return Divergence(index, rec.offset, "the checker raised", "-", repr(e))
            continue
        recorded = _describe(rec.channel, rec.peer, rec.frames)
        if not pending:
            return Divergence(
                index, rec.offset, "recorded a message replay did not produce", recorded, "nothing"
            )
        source, (channel, peer, frames) = pending.popleft()
        if (channel, peer, frames) != (rec.channel, rec.peer, tuple(rec.frames)):
            replayed = _describe(channel, peer, frames)
            what = f"reply to inbound record #{source} differs"
            if recorded == replayed:
                what += " (same summary, different encoded bytes)"
            return Divergence(index, rec.offset, what, recorded, replayed)
    if pending:
        source, (channel, peer, frames) = pending[0]
        return Divergence(
            index + 1,
            -1,
            f"replay answered inbound record #{source}, the log has no reply",
            "nothing",
            _describe(channel, peer, frames),
        )
    return None


def _describe(channel: str, peer: bytes | None, frames: tuple[bytes, ...]) -> str:
    return f"{ARROWS['out']} {_endpoint(channel, peer)}  {_text(*_decode(frames))}"


if __name__ == "__main__":
    sys.exit(main())
