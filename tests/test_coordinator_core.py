"""CoordinatorCore: global ids, routes until the terminal output, round robin over ranks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from taipan.actors.coordinator.core import CoordinatorCore, NoRankError, Route


def core_with(*ranks: int) -> CoordinatorCore:
    core = CoordinatorCore()
    for rank in ranks:
        core.add_rank(rank)
    return core


def test_ids_are_unique_and_increasing_across_clients():
    core = core_with(0)
    gids = [core.admit(client, i)[0] for i in range(5) for client in (b"a", b"b")]
    assert gids == sorted(gids) and len(set(gids)) == len(gids) and gids[0] >= 1


def test_ids_are_never_reused_after_a_route_is_forgotten():
    core = core_with(0)
    gid, _ = core.admit(b"a", 1)
    core.route_of(gid, finished=True)
    again, _ = core.admit(b"a", 1)
    assert again > gid


def test_duplicate_in_flight_request_is_refused_without_side_effects():
    core = core_with(0, 1)
    gid, rank = core.admit(b"a", 7)
    with pytest.raises(ValueError, match="request id 7 is already in flight"):
        core.admit(b"a", 7)
    assert core.lookup(b"a", 7) == (gid, Route(b"a", 7, rank))
    # The refused request took neither an id nor a turn in the rotation.
    assert core.admit(b"a", 8) == (gid + 1, 1)


def test_same_client_id_from_another_client_is_a_different_request():
    core = core_with(0)
    g1, _ = core.admit(b"a", 1)
    g2, _ = core.admit(b"b", 1)
    assert g1 != g2
    assert core.lookup(b"a", 1)[0] == g1 and core.lookup(b"b", 1)[0] == g2


def test_route_is_kept_for_deltas_and_forgotten_at_the_terminal_output():
    core = core_with(3)
    gid, rank = core.admit(b"client", 42)
    route = Route(b"client", 42, 3)
    assert rank == 3
    assert core.route_of(gid, finished=False) == route
    assert core.route_of(gid, finished=False) == route
    assert core.route_of(gid, finished=True) == route
    assert core.route_of(gid, finished=True) is None
    assert core.route_of(gid, finished=False) is None
    assert core.lookup(b"client", 42) is None
    assert core.routes == {} and core.by_client == {}
    core.admit(b"client", 42)  # the client may reuse its id once the request ended


def test_one_steps_outputs_route_to_two_clients_under_their_own_ids():
    """A StepOutputs names global ids only: requests of two clients that both call theirs 1
    route apart; the finished one is forgotten, the other keeps its route for later deltas."""
    core = core_with(0)
    ga, _ = core.admit(b"a", 1)
    gb, _ = core.admit(b"b", 1)
    step = [(gb, True), (ga, False)]  # (request_ids[i], finished[i]) of one StepOutputs
    assert [core.route_of(g, f) for g, f in step] == [Route(b"b", 1, 0), Route(b"a", 1, 0)]
    assert core.lookup(b"b", 1) is None and core.lookup(b"a", 1) == (ga, Route(b"a", 1, 0))
    assert [core.route_of(g, True) for g in (gb, ga)] == [None, Route(b"a", 1, 0)]
    assert core.routes == {} and core.by_client == {}


def test_unknown_gid_has_no_route():
    core = core_with(0)
    assert core.route_of(999, finished=True) is None
    assert core.lookup(b"nobody", 1) is None


def test_round_robin_across_ranks():
    core = core_with(0, 1, 2)
    assert [core.admit(b"c", i)[1] for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert [core.pick_rank() for _ in range(3)] == [1, 2, 0]


def test_ranks_register_once_in_order():
    core = core_with(2, 0, 2, 1, 0)
    assert core.ranks == [2, 0, 1]
    assert [core.pick_rank() for _ in range(4)] == [2, 0, 1, 2]


def test_a_late_rank_joins_the_rotation():
    core = core_with(0)
    assert [core.pick_rank() for _ in range(2)] == [0, 0]
    core.add_rank(1)
    picks = [core.pick_rank() for _ in range(4)]
    assert sorted(picks) == [0, 0, 1, 1]


def test_no_rank_is_an_error_and_admits_nothing():
    core = CoordinatorCore()
    with pytest.raises(NoRankError, match="no engine"):
        core.pick_rank()
    with pytest.raises(NoRankError):
        core.admit(b"a", 1)
    assert core.routes == {} and core.by_client == {}
    core.add_rank(5)
    assert core.admit(b"a", 1) == (1, 5)  # nothing was consumed by the failed admit


# A random session: admit (client, id) pairs, send deltas and terminal outputs, compared with a
# plain model of what the core must remember.
ops = st.lists(
    st.tuples(
        st.sampled_from(["admit", "delta", "finish"]),
        st.sampled_from([b"a", b"b", b"c"]),
        st.integers(0, 4),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4), ops)
def test_random_sessions_match_a_model(num_ranks, session):
    core = core_with(*range(num_ranks))
    live: dict[tuple[bytes, int], tuple[int, int]] = {}  # (client, id) -> (gid, rank)
    last_gid = 0
    admitted = 0
    for op, client, cid in session:
        key = (client, cid)
        if op == "admit":
            if key in live:
                with pytest.raises(ValueError):
                    core.admit(client, cid)
                continue
            gid, rank = core.admit(client, cid)
            assert gid > last_gid and rank == admitted % num_ranks
            last_gid, admitted = gid, admitted + 1
            live[key] = (gid, rank)
        elif key in live:
            gid, rank = live[key]
            assert core.route_of(gid, finished=op == "finish") == Route(client, cid, rank)
            if op == "finish":
                del live[key]
        assert {k: core.lookup(*k) for k in live} == {
            k: (g, Route(k[0], k[1], r)) for k, (g, r) in live.items()
        }
        assert len(core.routes) == len(core.by_client) == len(live)
