"""The n-gram (prompt-lookup) drafter, ops/ngram.py: hand examples, the rule against a
brute-force oracle, and the incremental index against the from-scratch lookup."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from taipan.ops.ngram import NgramDrafter, NgramIndex


def oracle(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The module docstring's rule, written the slow obvious way."""
    length = len(tokens)
    if k == 0:
        return []
    for n in range(max_n, min_n - 1, -1):
        if n > length - 1:
            continue
        suffix = tokens[length - n :]
        for end in range(length - 1, n - 1, -1):  # most recent first
            if tokens[end - n : end] == suffix:
                return tokens[end : end + k]
    return []


def propose_both(drafter: NgramDrafter, tokens: list[int]) -> list[int]:
    """From scratch and through a fresh index; asserts they agree."""
    scratch = drafter.propose(tokens)
    incremental = drafter.new_index().propose(np.asarray(tokens, np.int32))
    assert scratch.dtype == np.int32 and incremental.dtype == np.int32
    assert scratch.tolist() == incremental.tolist()
    return scratch.tolist()


# ---- hand examples -----------------------------------------------------------------------------


def test_copies_what_followed_the_earlier_occurrence():
    drafter = NgramDrafter(min_n=1, max_n=3, k=3)
    #            0  1  2  3  4  5  6  7
    tokens = [5, 6, 7, 8, 9, 1, 6, 7]  # "6 7" recurs: it was followed by 8 9 1
    assert propose_both(drafter, tokens) == [8, 9, 1]


def test_longest_n_wins_over_a_more_recent_shorter_match():
    drafter = NgramDrafter(min_n=1, max_n=3, k=2)
    # suffix "1 2 3": its 3-gram occurs at [0:3] (followed by 4 4); "3" alone occurs later at 5
    # (followed by 9 9), which is more recent but shorter.
    tokens = [1, 2, 3, 4, 4, 3, 9, 9, 1, 2, 3]
    assert propose_both(drafter, tokens) == [4, 4]
    # Capped at max_n = 1, the most recent "3" wins.
    assert propose_both(NgramDrafter(1, 1, 2), tokens) == [9, 9]


def test_most_recent_occurrence_among_equal_lengths():
    drafter = NgramDrafter(min_n=2, max_n=2, k=1)
    tokens = [1, 2, 10, 1, 2, 20, 1, 2]
    assert propose_both(drafter, tokens) == [20]


def test_proposal_stops_at_the_known_tokens():
    drafter = NgramDrafter(min_n=1, max_n=1, k=5)
    assert propose_both(drafter, [7, 7, 7, 7]) == [7]  # latest "7" with a follower ends at 3
    assert propose_both(drafter, [1, 2, 1]) == [2, 1]  # runs into the suffix itself
    assert propose_both(NgramDrafter(1, 3, 5), [1, 2, 1, 2, 1]) == [2, 1]  # "1 2 1" at e = 3


def test_no_match_min_n_and_k_zero():
    assert propose_both(NgramDrafter(1, 3, 4), [1, 2, 3, 4]) == []
    assert propose_both(NgramDrafter(1, 3, 4), []) == []
    assert propose_both(NgramDrafter(1, 3, 4), [3]) == []
    # "4" recurs but min_n = 2 asks for a 2-gram, and "3 4" does not recur.
    assert propose_both(NgramDrafter(2, 3, 4), [4, 1, 3, 4]) == []
    assert propose_both(NgramDrafter(1, 3, 0), [1, 2, 1, 2]) == []


def test_k_per_call_caps_the_drafters():
    drafter = NgramDrafter(1, 2, 3)
    tokens = [1, 2, 3, 4, 5, 1]
    index = drafter.new_index()
    assert drafter.propose(tokens).tolist() == index.propose(tokens).tolist() == [2, 3, 4]
    assert drafter.propose(tokens, k=2).tolist() == index.lookup(k=2).tolist() == [2, 3]
    assert drafter.propose(tokens, k=9).tolist() == index.lookup(k=9).tolist() == [2, 3, 4]
    assert drafter.propose(tokens, k=0).tolist() == index.propose(tokens, k=0).tolist() == []


def test_accepts_lists_and_numpy():
    drafter = NgramDrafter(1, 2, 2)
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 1]
    as_list = drafter.propose(tokens)
    as_array = drafter.propose(np.asarray(tokens, np.int64))
    assert as_list.tolist() == as_array.tolist() == [5, 9]
    index = drafter.new_index()
    assert index.propose(tokens).tolist() == [5, 9]


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="min_n <= max_n"):
        NgramDrafter(3, 2, 4)
    with pytest.raises(ValueError, match="min_n <= max_n"):
        NgramDrafter(0, 2, 4)
    with pytest.raises(ValueError, match="k"):
        NgramDrafter(1, 2, -1)
    with pytest.raises(ValueError, match="1-d"):
        NgramDrafter(1, 2, 2).propose([[1, 2]])


# ---- the incremental index ---------------------------------------------------------------------


def test_index_follows_a_decode_one_token_at_a_time():
    drafter = NgramDrafter(1, 4, 3)
    index = drafter.new_index()
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 6, 50).astype(np.int32)
    for length in range(len(tokens) + 1):
        assert index.propose(tokens[:length]).tolist() == drafter.propose(tokens[:length]).tolist()
        assert index.num_tokens == length


def test_index_rebuilds_after_a_rollback_or_a_rewrite():
    drafter = NgramDrafter(1, 2, 2)
    index = drafter.new_index()
    index.propose([1, 2, 3, 1, 2, 9, 9])
    assert index.propose([1, 2, 3, 1, 2]).tolist() == [3, 1]
    assert index.num_tokens == 5
    # Same length, last token changed: not an extension, so rebuilt.
    assert index.propose([1, 2, 3, 1, 3]).tolist() == [1, 3]
    assert index.tokens.tolist() == [1, 2, 3, 1, 3]


def test_append_then_lookup_with_lists():
    """The engine's way: the prompt once, then each step's new tokens (a list), then a lookup."""
    drafter = NgramDrafter(1, 3, 3)
    index = drafter.new_index()
    prompt = [4, 8, 15, 16, 23, 42, 8, 15]
    index.append(prompt)
    assert index.lookup().tolist() == [16, 23, 42]
    generated = []
    for step in ([16], [23, 42], [], [7], [4, 8]):
        index.append(step)
        generated += step
        assert index.lookup().tolist() == drafter.propose(prompt + generated).tolist()
    assert index.tokens.tolist() == prompt + generated
    assert index.num_tokens == len(prompt) + len(generated)


def test_index_memory_is_one_entry_per_distinct_ngram():
    index = NgramIndex(NgramDrafter(1, 3, 4))
    index.append([7] * 100)  # one distinct n-gram per n
    assert len(index) == 3
    index.reset()
    assert len(index) == 0 and index.num_tokens == 0


def test_index_is_fast_on_a_long_context():
    """A 200k-token prompt ingests in bulk; each decode step then costs O(1) in the length."""
    drafter = NgramDrafter(1, 4, 4)
    rng = np.random.default_rng(1)
    prompt, steps = 200_000, 200
    buffer = rng.integers(0, 50_000, prompt + steps).astype(np.int32)  # grows by views
    index = drafter.new_index()
    start = time.perf_counter()
    index.append(buffer[:prompt])
    ingest = time.perf_counter() - start
    start = time.perf_counter()
    for length in range(prompt + 1, prompt + steps + 1):
        index.propose(buffer[:length])
    per_step = (time.perf_counter() - start) / steps
    assert ingest < 3.0, f"bulk ingest of {prompt} tokens took {ingest:.2f} s"
    assert per_step < 1e-3, f"a decode step's proposal took {per_step * 1e3:.2f} ms"
    full = buffer[: prompt + steps]
    assert index.propose(full).tolist() == drafter.propose(full).tolist()


# ---- properties (hypothesis) -------------------------------------------------------------------

sizes = st.integers(1, 4).flatmap(lambda lo: st.tuples(st.just(lo), st.integers(lo, lo + 3)))
small_vocab_tokens = st.lists(st.integers(0, 3), max_size=40)


@settings(max_examples=300, deadline=None)
@given(sizes, st.integers(0, 6), small_vocab_tokens)
def test_matches_the_oracle(ns, k, tokens):
    min_n, max_n = ns
    assert propose_both(NgramDrafter(min_n, max_n, k), tokens) == oracle(tokens, min_n, max_n, k)


@settings(max_examples=300, deadline=None)
@given(sizes, st.integers(1, 6), small_vocab_tokens)
def test_proposal_continues_an_earlier_matching_occurrence(ns, k, tokens):
    """Whatever it proposes follows some earlier window equal to a suffix n-gram, n in range;
    empty only when no such window exists; never longer than k."""
    min_n, max_n = ns
    proposal = NgramDrafter(min_n, max_n, k).propose(tokens).tolist()
    length = len(tokens)
    assert len(proposal) <= k
    occurrences = [
        (n, end)
        for n in range(min_n, min(max_n, length - 1) + 1)
        for end in range(n, length)
        if tokens[end - n : end] == tokens[length - n :]
    ]
    if not occurrences:
        assert proposal == []
        return
    assert proposal, "a suffix n-gram recurs but nothing was proposed"
    assert any(tokens[end : end + k] == proposal for _, end in occurrences)
    # ... and it is the longest n's most recent one.
    n_best = max(n for n, _ in occurrences)
    end_best = max(end for n, end in occurrences if n == n_best)
    assert proposal == tokens[end_best : end_best + k]


@settings(max_examples=200, deadline=None)
@given(sizes, st.integers(0, 5), small_vocab_tokens, st.lists(st.integers(1, 7), max_size=12))
def test_incremental_equals_from_scratch(ns, k, tokens, chunks):
    """Feeding the tokens in arbitrary chunks (prefill chunks, then decode steps that land one or
    several tokens) gives the from-scratch proposal after every call."""
    min_n, max_n = ns
    drafter = NgramDrafter(min_n, max_n, k)
    index, appended = drafter.new_index(), drafter.new_index()
    arr = np.asarray(tokens, np.int32)
    cuts = np.cumsum(chunks).tolist()
    done = 0
    for cut in [c for c in cuts if c < len(arr)] + [len(arr)]:
        expected = drafter.propose(arr[:cut]).tolist()
        assert index.propose(arr[:cut]).tolist() == expected  # the whole sequence each time
        appended.append(tokens[done:cut])  # only the new tokens, as a list
        assert appended.lookup().tolist() == expected
        done = cut
    assert index.num_tokens == appended.num_tokens == len(arr)
