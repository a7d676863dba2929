"""ops.stop_strings: stop strings matched on text arriving in pieces, and on real SmolLM2 tokens.

The reference is the whole text cut at the stop string it completes first (`cut`); streaming
must give the same text whatever the pieces, and never show the beginning of a stop string that
later completes.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from taipan.messages.requests import SamplingParams
from taipan.models import resolve
from taipan.ops.stop_strings import StopMatcher, StoppingDetokenizer
from taipan.ops.tokenizer import Tokenizer

NEWLINES_3 = 16506  # SmolLM2's "\n\n\n" token: holds the stop "\n\n" inside it


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(resolve("smollm2")[1])


def cut(text: str, stops, include: bool = False) -> tuple[str, str | None]:
    """(text up to the first stop string it completes, that stop): the reference."""
    found = [(text.find(s) + len(s), -len(s), s) for s in stops if s in text]
    if not found:
        return text, None
    end, _, stop = min(found)
    return text[: end if include else end - len(stop)], stop


def stream(matcher: StopMatcher, pieces) -> list[str]:
    """What `matcher` shows for each piece, and at the end (unless a stop matched)."""
    out = []
    for piece in pieces:
        out.append(matcher.feed(piece))
        if matcher.matched is not None:
            return out
    return [*out, matcher.flush()]


def detokenize(tok, ids, stops, include=False, chunks=None) -> tuple[list[str], int, str | None]:
    """(text deltas, tokens kept, stop matched) of `ids` fed in `chunks` (default: one by one)."""
    reader = StoppingDetokenizer(tok, tok.encode("Say:"), stops, include)
    deltas, kept, i = [], 0, 0
    for n in chunks or [1] * len(ids):
        text, keep = reader.feed(ids[i : i + n])
        deltas.append(text)
        kept += keep
        i += n
        if reader.stop_reason is not None:
            return deltas, kept, reader.stop_reason
    return [*deltas, reader.flush()], kept, reader.stop_reason


# --- the matcher on text -------------------------------------------------------------------------


def test_a_stop_across_pieces_is_held_back_and_cut():
    m = StopMatcher(["bcd"])
    assert m.feed("ab") == "a"  # "b" may begin "bcd"
    assert m.feed("c") == ""
    assert m.feed("dz") == "" and m.matched == "bcd"
    assert m.feed("more") == "" and m.flush() == ""


def test_held_back_text_that_does_not_become_a_stop_is_shown_later():
    m = StopMatcher(["bcd"])
    assert [m.feed("ab"), m.feed("c"), m.feed("x")] == ["a", "", "bcx"]
    assert m.feed("b") == "" and m.flush() == "b" and m.matched is None


def test_the_stop_completed_first_wins_and_of_two_ending_together_the_longer():
    assert stream(StopMatcher(["abcd", "c"]), ["abcd"]) == ["ab"]
    assert stream(StopMatcher(["b", "ab"]), ["xab"]) == ["x"]
    m = StopMatcher(["world", "lo"])
    assert stream(m, ["hello world"]) == ["hel"] and m.matched == "lo"


def test_include_stop_keeps_the_stop_and_holds_nothing_back():
    m = StopMatcher(["\n\n"], include_stop=True)
    assert m.feed("one.\n") == "one.\n"  # shown at once: kept even if the stop completes
    assert m.feed("\ntwo") == "\n" and m.matched == "\n\n"


def test_a_stop_inside_one_piece_drops_the_rest_of_it():
    m = StopMatcher(["\n\n"])
    assert stream(m, ["Done", ".\n\n\nNext"]) == ["Done", "."]


@pytest.mark.parametrize("stops", [[], [""], ["ok", ""], [None]])
def test_empty_or_missing_stop_strings_are_errors(stops):
    with pytest.raises(ValueError, match="non-empty strings"):
        StopMatcher(stops)


@pytest.mark.parametrize(
    "stop, problem",
    [
        ("", "stop strings must be non-empty"),
        (("a", ""), "stop strings must be non-empty"),
        (5, "stop must be a string or a list of strings"),
        (("a", 3), "stop must be a string or a list of strings"),
    ],
)
def test_sampling_params_name_a_bad_stop(stop, problem):
    assert any(problem in p for p in SamplingParams(stop=stop).problems())
    with pytest.raises(ValueError, match=problem):
        SamplingParams(stop=stop).stop_strings()


def test_a_bare_string_is_one_stop_string():
    assert SamplingParams(stop="\n\n").stop_strings() == ("\n\n",)
    assert SamplingParams(stop=["a", "b"]).stop_strings() == ("a", "b")
    assert SamplingParams().problems() == [] and SamplingParams().stop_strings() == ()


TEXT = st.text(alphabet="ab\n.é😀 ", max_size=40)
STOPS = st.lists(st.text(alphabet="ab\n.é😀 ", min_size=1, max_size=4), min_size=1, max_size=3)


@settings(max_examples=500, deadline=None)
@given(text=TEXT, stops=STOPS, include=st.booleans(), data=st.data())
def test_any_pieces_give_the_cut_text_and_hold_back_exactly_a_partial_stop(
    text, stops, include, data
):
    bounds = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    pieces = [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)], strict=True)]
    m = StopMatcher(stops, include)
    shown, received = "", ""
    for piece in pieces:
        shown += m.feed(piece)
        received += piece
        if m.matched is not None:
            break
        # Held back: exactly the longest end of the text that begins a stop (nothing if kept).
        held = received[len(shown) :]
        assert received.startswith(shown)
        partial = max(
            (k for s in stops for k in range(1, len(s)) if received.endswith(s[:k])), default=0
        )
        assert len(held) == (0 if include else partial)
    else:
        shown += m.flush()
    assert (shown, m.matched) == cut(text, stops, include)


# --- on real tokens ------------------------------------------------------------------------------


def test_a_stop_spanning_tokens_keeps_the_token_that_completed_it(tok):
    ids = tok.encode("Hello world. END of it", add_special_tokens=False)
    deltas, kept, stop = detokenize(tok, ids, ["d. E"])
    assert "".join(deltas) == "Hello worl" and stop == "d. E"
    assert tok.decode(ids[:kept]) == "Hello world. END"  # " END" completed it
    assert "world" not in "".join(deltas[:2])  # "d. E" began in " world": it was held back


def test_a_stop_inside_one_token(tok):
    ids = tok.encode("Done.", add_special_tokens=False) + [NEWLINES_3] + tok.encode("Next")
    assert tok.decode([NEWLINES_3]) == "\n\n\n"
    deltas, kept, stop = detokenize(tok, ids, ["\n\n"])
    assert ("".join(deltas), kept, stop) == ("Done.", len(ids) - 1, "\n\n")
    deltas, kept, _ = detokenize(tok, ids, ["\n\n"], include=True)
    assert ("".join(deltas), kept) == ("Done.\n\n", len(ids) - 1)


def test_a_stop_ending_inside_a_token(tok):
    ids = tok.encode('He said "hi." Then', add_special_tokens=False)
    assert tok.decode(ids[4:5]) == '."'
    deltas, kept, stop = detokenize(tok, ids, ["i."])
    assert ("".join(deltas), kept, stop) == ('He said "h', 5, "i.")


def test_several_stops_the_first_completed_wins(tok):
    ids = tok.encode("one, two; three, four", add_special_tokens=False)
    deltas, _, stop = detokenize(tok, ids, [", four", "; ", "two"])
    assert ("".join(deltas), stop) == ("one, ", "two")


def test_a_multibyte_character_split_across_tokens(tok):
    ids = tok.encode("café 😀 ok", add_special_tokens=False)
    emoji = [i for i in ids if tok.decode([i]).strip() == "\ufffd"]
    assert len(emoji) >= 2, "the emoji should span byte tokens"
    deltas, kept, stop = detokenize(tok, ids, ["😀"])
    assert ("".join(deltas), stop) == ("café ", "😀")
    assert ids[kept - 1] == emoji[-1]  # its last byte completed it
    deltas, kept, stop = detokenize(tok, ids, ["é 😀 o"])
    assert ("".join(deltas), stop) == ("caf", "é 😀 o")
    assert "\ufffd" not in "".join(deltas)


def test_without_stops_every_token_is_kept(tok):
    ids = tok.encode("plain text", add_special_tokens=False)
    deltas, kept, stop = detokenize(tok, ids, [], chunks=[len(ids)])
    assert ("".join(deltas), kept, stop) == ("plain text", len(ids), None)


WORDS = ["Hello", " world", ".", "\n", "\n\n", " the", "é", "😀", "日本", " END", ":", " 42", '"']


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    words=st.lists(st.sampled_from(WORDS), min_size=1, max_size=20),
    stops=st.lists(st.sampled_from(["\n\n", "d.", " E", "😀", "é", "o w", "\n", ' "', "42"])),
    include=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_streamed_equals_whole_and_the_full_text_cut(tok, words, stops, include, seed):
    text = "".join(words)
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    rng = random.Random(seed)
    chunks = []
    while sum(chunks) < len(ids):
        chunks.append(rng.randint(1, 4))
    streamed, kept, stop = detokenize(tok, ids, stops, include, chunks)
    whole, whole_kept, whole_stop = detokenize(tok, ids, stops, include, [len(ids)])
    assert ("".join(streamed), kept, stop) == ("".join(whole), whole_kept, whole_stop)
    want, want_stop = cut(text, stops, include)
    assert ("".join(streamed), stop) == (want, want_stop)
    if stop is None:
        assert kept == len(ids)
    else:  # the kept tokens hold the text and the whole stop string
        assert tok.decode(ids[:kept]).startswith(want if include else want + stop)
