"""tests/perf/parallel_greedy.py's near-tie rule: which differing greedy outputs it forgives."""

from tests.perf.parallel_greedy import _tie


def test_a_flip_between_near_equal_tokens_is_a_near_tie():
    want = ([5, 7, 9], [{5: -0.1}, {7: -1.0, 8: -1.0004}, {9: -0.2}])
    got = ([5, 8, 2], [{5: -0.1}, {8: -1.0, 7: -1.0003}, {2: -0.3}])
    assert _tie(want, got, margin=1e-3) == {"token": 1, "log_prob_gap": 0.0004}


def test_a_clear_winner_lost_or_a_token_outside_the_top_n_is_not():
    want = ([5, 7], [{5: -0.1}, {7: -0.5, 8: -2.0}])
    got = ([5, 8], [{5: -0.1}, {8: -0.4, 7: -0.6}])
    assert _tie(want, got, margin=1e-3) is None  # 1.5 apart in the size-1 run
    outside = ([5, 3], [{5: -0.1}, {3: -0.4, 7: -0.6}])
    assert _tie(want, outside, margin=10.0) is None  # 3 is not in the size-1 run's top n
