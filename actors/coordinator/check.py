"""Replay check of the coordinator's routing (`taipan replay --check`, DESIGN.md §10).

Re-drives a fresh `CoordinatorCore` (its prefix `RoutingTable` and `RankPicker`) from the
coordinator's recorded log, as the actor (actor.py) drives it and through the actor's own
decisions (`EngineLinks` for which engine is which rank, `relay_outputs` for where a route
ends), and compares every recorded `EngineSubmit` byte for byte with the one the replay builds:
same rank (the engine it went to), same global id, same block hashes and salt (re-hashed by
on_submit's rule), same prompt, sampling and arrival time. A submission the coordinator refused
must be one the replay refuses, and every `PrefixEvents` must apply to the replayed table (a
contradiction means lost events).

Why the log is enough: the core changes only in handlers that make no await before their
change, and a submission is admitted in the same breath as its outcome (the EngineSubmit, or
the refusal to its client) is recorded. So the replay admits a submission where its outcome is
recorded, not where it arrived (the channel records a whole batch of arrivals before handling
any), and applies every other change where its inbound message is recorded. What the
coordinator's own clock decides is recorded too: a rank declared dead (after a silence, or its
connection closing) leaves a record-only `RankGone`, and the weight version, the hash salt,
moves only in a control round's `ControlAck` to its client. Outputs relayed to clients, aborts,
stats and controls do not route and are not compared (but an output the coordinator could not
relay ends its route: only for clients that did not say Hello, whose outputs it renumbers one
by one; a client that did gets the frames unread). One thing the log cannot show: a socket
send that blocks on a full queue lets another message be handled in between; the replay then
sees the arrivals in the wrong order.

Pure: decoded messages in, a divergence text out. No sockets, no clock.
"""

from __future__ import annotations

import dataclasses
from collections import deque

import numpy as np

from taipan.actors.config import HASHING_POLICIES, PrefixCachingCoordinatorPolicy
from taipan.actors.coordinator.core import CoordinatorCore, NoRankError, routing_hashes
from taipan.actors.coordinator.relay import relay_outputs
from taipan.actors.coordinator.routing import RoutingError
from taipan.actors.engine_link import EngineLinks, ServedModel
from taipan.messages.codec import same_encoding
from taipan.messages.common import ErrorReply, Hello, PeerGone, RankGone
from taipan.messages.errors import ErrorCode
from taipan.messages.gpu import ModelLoaded
from taipan.messages.lifecycle import ControlAck, Stop
from taipan.messages.requests import (
    EngineSubmit,
    FinishReason,
    RequestOutput,
    StepOutputs,
    SubmitRequest,
)
from taipan.messages.stats import PrefixEvents
from taipan.messages.summary import summarize

# The coordinator's channels, as runtime/wiring.py names them in its log.
CLIENTS, ENGINES = "clients", "engines"
STOPPING = "the runtime is stopping"  # on_submit's refusal while a STOP is in flight


@dataclasses.dataclass(frozen=True, slots=True)
class Submission:
    client: bytes
    msg: SubmitRequest
    time: float  # when it arrived: the EngineSubmit's arrival_time


class CoordinatorReplay:
    """Feed it the coordinator log's records in order (`inbound` / `outbound`; `msg` None for
    frames that did not decode); a non-None return is the first divergence, and `replayed`
    then says what the replay sends instead (None: the text says it). Built with the
    coordinator's own settings."""

    def __init__(
        self,
        *,
        policy: PrefixCachingCoordinatorPolicy,
        alpha: float,
        capacity: int,
        prefix_caching: bool,
        num_ranks: int | None = None,
    ):
        self.core = CoordinatorCore(policy, alpha, capacity)
        # As the actor decides.
        self.hashing = prefix_caching or self.core.router.policy in HASHING_POLICIES
        # The actor's engine bookkeeping: live ranks, block size (what is served is not replayed).
        self.links = EngineLinks(ServedModel("", 0, num_ranks or 1, prefix_caching))
        self.num_ranks = num_ranks  # None: unknown (no runtime.json), ranks not range-checked
        self.weight_version = 0
        self.stop_asked = False
        self.waiting: deque[Submission] = deque()  # arrived, outcome not recorded yet
        self.batch_clients: set[bytes] = set()  # clients that said Hello (actor.py)
        self.replayed: str | None = None
        self.routed = self.refused = self.events = self.ranks_gone = 0

    # --- inbound ------------------------------------------------------------------------------

    def inbound(self, channel: str, peer: bytes | None, msg, time: float) -> str | None:
        if channel == CLIENTS:
            if isinstance(msg, SubmitRequest):
                self.waiting.append(Submission(peer, msg, time))
            elif isinstance(msg, Hello) and msg.name == "client":
                self.batch_clients.add(peer)
            elif isinstance(msg, PeerGone):
                self.batch_clients.discard(peer)
            elif isinstance(msg, Stop):
                self.stop_asked = True
            return None
        if channel != ENGINES:
            return None
        links = self.links
        if isinstance(msg, Hello) and msg.name == "engine":
            if self.core.rank_refusal(msg.rank, peer, links.engines, self.num_ranks) is None:
                links.join(msg.rank, peer, time)
        elif isinstance(msg, ModelLoaded):
            rank = links.rank_of(peer)
            if rank is not None and links.loaded_model(rank, msg, self.weight_version) is None:
                self.core.add_rank(rank)
        elif isinstance(msg, PrefixEvents):
            return self._prefix_events(peer, msg)
        elif isinstance(msg, StepOutputs):
            # Forget the routes of terminal outputs, and of entries the actor cannot relay.
            relay_outputs(msg, self.core, self.batch_clients)
        return None

    def _prefix_events(self, peer: bytes | None, msg: PrefixEvents) -> str | None:
        rank = self.links.rank_of(peer)
        if rank is None:
            return None
        try:
            self.core.table.apply(rank, msg.added.tolist(), msg.evicted.tolist())
        except RoutingError as e:
            return f"PrefixEvents from rank {rank} contradict the routing table: {e}"
        self.events += 1
        return None

    # --- outbound -----------------------------------------------------------------------------

    def outbound(self, channel: str, peer: bytes | None, msg, frames) -> str | None:
        self.replayed = None
        if channel == ENGINES:
            if isinstance(msg, EngineSubmit):
                return self._routed(peer, msg, frames)
            if isinstance(msg, RankGone):
                return self._rank_gone(msg)
            return None
        if channel != CLIENTS:
            return None
        if isinstance(msg, ControlAck):  # a control round succeeded: the salt may move
            self.weight_version = msg.weight_version
        head = self.waiting[0] if self.waiting else None
        if head is None or peer != head.client:
            return None
        if isinstance(msg, RequestOutput) and _is_refusal(msg, head.msg.request_id):
            return self._refused(self.waiting.popleft(), msg.error or "")
        if isinstance(msg, ErrorReply) and msg.code is ErrorCode.INTERNAL:
            try:
                self._plan(head)
            except ValueError:  # on_submit raised the same way: nothing was admitted
                self.waiting.popleft()
                self.refused += 1
        return None

    def _routed(self, peer: bytes | None, got: EngineSubmit, frames) -> str | None:
        where = self._where(peer)
        if not self.waiting:
            return f"the coordinator sent request {got.request_id} to {where}; no submission waits"
        sub = self.waiting.popleft()
        name = _request_name(sub)
        try:
            plan = self._plan(sub)
        except ValueError as e:
            return f"{name}: the coordinator routed it to {where}, replay's on_submit fails: {e}"
        if isinstance(plan, str):
            self.replayed = f"→ {CLIENTS}  a refusal: {plan}"
            return f"{name}: the coordinator routed it to {where}, replay refuses it: {plan}"
        hashes, salt = plan
        try:
            gid, rank = self.core.admit(sub.client, sub.msg.request_id, hashes.tolist())
        except (ValueError, NoRankError) as e:
            self.replayed = f"→ {CLIENTS}  a refusal: {e}"
            return f"{name}: the coordinator routed it to {where}, replay refuses it: {e}"
        m = sub.msg
        want = EngineSubmit(gid, m.prompt_token_ids, m.sampling, m.stream, sub.time, hashes, salt)
        self.replayed = f"→ {ENGINES}[rank {rank}]  {summarize(want)}"
        if peer == self.links.engines.get(rank) and same_encoding(want, frames):
            self.routed += 1
            return None
        text = (
            f"{name}: the coordinator sent it to {where} as request {got.request_id}, "
            f"replay routes it to rank {rank} as request {gid}"
        )
        if not np.array_equal(got.block_hashes, hashes):
            text += "; the block hashes differ"
        if got.hash_salt != salt:
            text += f"; hash salt {got.hash_salt}, replay {salt}"
        return text

    def _refused(self, sub: Submission, error: str) -> str | None:
        """The coordinator refused `sub` (a RequestOutput with its error to the client)."""
        name = _request_name(sub)
        try:
            plan = self._plan(sub)
        except ValueError as e:
            return f"{name}: the coordinator refused it ({error}), replay's on_submit fails: {e}"
        if isinstance(plan, str) or (self.stop_asked and STOPPING in error):
            self.refused += 1
            return None
        try:
            gid, rank = self.core.admit(sub.client, sub.msg.request_id, plan[0].tolist())
        except (ValueError, NoRankError):
            self.refused += 1
            return None
        self.replayed = f"→ {ENGINES}[rank {rank}]  EngineSubmit request_id={gid} ..."
        return f"{name}: the coordinator refused it ({error}), replay routes it to rank {rank}"

    def _plan(self, sub: Submission) -> tuple[np.ndarray, int] | str:
        """What on_submit does before the core admits: (hashes, salt) to route by, or why it
        refuses. Raises ValueError where on_submit's hashing would raise."""
        msg, prompt = sub.msg, sub.msg.prompt_token_ids
        problems = msg.sampling.problems()
        if prompt.size == 0:
            problems.append("the prompt is empty")
        if problems:
            return "; ".join(problems)
        block_size = self.links.block_size if self.hashing else 0
        return routing_hashes(
            prompt, msg.block_hashes, msg.hash_salt, block_size, self.weight_version
        )

    def _rank_gone(self, msg: RankGone) -> str | None:
        if msg.rank not in self.links.engines:
            return f"the coordinator declared rank {msg.rank} dead, a rank replay does not know"
        self.links.gone(self.links.engines[msg.rank])
        self.core.remove_rank(msg.rank, f"died: {msg.reason}")
        self.ranks_gone += 1
        return None

    # --- helpers ------------------------------------------------------------------------------

    def _where(self, identity: bytes | None) -> str:
        rank = self.links.rank_of(identity)
        return f"rank {rank}" if rank is not None else f"engine {identity!r} (no live rank)"

    def summary(self) -> str:
        text = (
            f"{self.routed} submissions routed as recorded, {self.refused} refused, "
            f"{self.events} PrefixEvents applied, {self.ranks_gone} rank(s) gone"
        )
        if self.waiting:  # the log ends before their outcome (the process was stopped)
            text += f", {len(self.waiting)} submission(s) with no recorded outcome"
        return text


def _is_refusal(out: RequestOutput, request_id: int) -> bool:
    """on_submit's refusal: a terminal error output with no token, for that client's request."""
    return (
        out.request_id == request_id
        and out.finished
        and out.finish_reason == FinishReason.ERROR
        and out.num_generated_tokens == 0
        and out.new_token_ids.size == 0
    )


def _request_name(sub: Submission) -> str:
    client = sub.client or b""
    shown = client.decode() if client.isascii() and client.decode().isprintable() else client.hex()
    return f"request {sub.msg.request_id} of client {shown}"
