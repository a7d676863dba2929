"""The coordinator's pure core: request ids, routes, rank choice. No zmq, no clock.

Owns the mapping client (identity, client request id) <-> global request id <-> rank, the
requests in flight per rank, and the prefix routing (routing.py: the table of each rank's
cached block hashes, fed by its allocator's events, and the routing policy). Only the
coordinator actor calls it, once per inbound message, so its decisions are a function of the
inbound sequence (replay re-drives it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from taipan.actors.config import PrefixCachingCoordinatorPolicy as Policy
from taipan.actors.coordinator.routing import RankPicker, RoutingTable
from taipan.messages.block_hash import block_hashes


@dataclasses.dataclass(frozen=True, slots=True)
class Route:
    client: bytes
    client_request_id: int
    rank: int


class NoRankError(RuntimeError):
    pass


def routing_hashes(
    prompt: np.ndarray, sent: np.ndarray, sent_salt: int, block_size: int, weight_version: int
) -> tuple[np.ndarray, int]:
    """(block hashes, salt) a request is routed by and forwarded with: the client's when they
    are salted with the current weight version and cover every complete block, else computed
    here (a client that hashed before a weight update, or did not hash). `block_size` 0: the
    coordinator does not hash (prefix caching and prefix routing off) and passes them on."""
    if block_size and (sent_salt != weight_version or len(sent) != len(prompt) // block_size):
        return block_hashes(prompt, block_size, weight_version), weight_version
    return sent, sent_salt


class CoordinatorCore:
    def __init__(
        self, policy: Policy | str = Policy.ROUND_ROBIN, alpha: float = 0.5, capacity: int = 1
    ):
        self.ranks: list[int] = []  # ranks with a loaded model, in registration order
        self.dead: dict[int, str] = {}  # rank -> why it is gone
        self.routes: dict[int, Route] = {}  # global id -> route, until the terminal output
        self.by_client: dict[tuple[bytes, int], int] = {}
        self.next_id = 1
        self.router = RankPicker(policy, alpha)
        self.table = RoutingTable()
        self.in_flight: dict[int, int] = {}  # rank -> requests routed there, not yet ended
        self.capacity = capacity  # requests a rank runs at once (its max_requests)

    def add_rank(self, rank: int) -> None:
        self.dead.pop(rank, None)
        if rank not in self.ranks:
            self.ranks.append(rank)

    def remove_rank(self, rank: int, reason: str) -> list[tuple[int, Route]]:
        """The rank is gone: route nothing more to it. Returns (and forgets) the requests that
        were on it, in admission order: they are lost and must be failed."""
        if rank in self.ranks:
            self.ranks.remove(rank)
        self.dead[rank] = reason
        self.table.drop_rank(rank)
        self.in_flight.pop(rank, None)
        lost = [(gid, r) for gid, r in self.routes.items() if r.rank == rank]
        for gid, route in lost:
            del self.routes[gid]
            del self.by_client[(route.client, route.client_request_id)]
        return lost

    def rank_refusal(
        self, rank: int, identity: bytes, engines: dict[int, bytes], num_ranks: int | None
    ) -> str | None:
        """Why an engine announcing itself as `rank` from `identity` cannot join (engines started
        by hand on other hosts can be misconfigured), or None. `engines`: the live ranks'
        identities; `num_ranks` None: the range is not known (a replay of an older log)."""
        if num_ranks is not None and not 0 <= rank < num_ranks:
            return f"rank {rank} is outside this runtime's {num_ranks} rank(s) (0..N-1)"
        if engines.get(rank, identity) != identity:
            return f"rank {rank} is already served by a live engine"
        if rank in self.dead:
            return f"rank {rank} {self.dead[rank]}; a dead rank does not rejoin"
        return None

    def routes_of_client(self, client: bytes) -> list[tuple[int, Route]]:
        """Every request of `client` still in flight, in admission order."""
        return [(gid, r) for gid, r in self.routes.items() if r.client == client]

    def pick_rank(self, hashes: Sequence[int] = ()) -> int:
        """The rank for a request with these prompt block hashes, by the routing policy."""
        if not self.ranks:
            if self.dead:
                why = "; ".join(f"rank {r} {reason}" for r, reason in sorted(self.dead.items()))
                raise NoRankError(f"no engine rank is alive ({why})")
            raise NoRankError("no engine has a model loaded yet")
        capacity = dict.fromkeys(self.ranks, self.capacity)
        return self.router.pick(self.ranks, hashes, self.in_flight, capacity, self.table)

    def admit(
        self, client: bytes, client_request_id: int, hashes: Sequence[int] = ()
    ) -> tuple[int, int]:
        """Give a new request a global id and a rank. Raises ValueError for a duplicate id."""
        key = (client, client_request_id)
        if key in self.by_client:
            raise ValueError(f"request id {client_request_id} is already in flight")
        rank = self.pick_rank(hashes)
        gid = self.next_id
        self.next_id += 1
        self.routes[gid] = Route(client, client_request_id, rank)
        self.by_client[key] = gid
        self.in_flight[rank] = self.in_flight.get(rank, 0) + 1
        return gid, rank

    def lookup(self, client: bytes, client_request_id: int) -> tuple[int, Route] | None:
        gid = self.by_client.get((client, client_request_id))
        return None if gid is None else (gid, self.routes[gid])

    def route_of(self, gid: int, finished: bool) -> Route | None:
        """Where an engine output goes; forgets the route at the terminal output."""
        route = self.routes.get(gid)
        if route is not None and finished:
            del self.routes[gid]
            del self.by_client[(route.client, route.client_request_id)]
            if route.rank in self.in_flight:
                self.in_flight[route.rank] -= 1
        return route
