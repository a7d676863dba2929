"""Structured outputs' grammars (ops/grammar.py) over the default model's real tokenizer: specs
checked with the reason named, masks that allow exactly what the grammar can continue with, and
a property test that sampling any allowed token until the grammar ends always yields text that
parses against the schema."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from taipan.models import resolve
from taipan.ops.grammar import (
    GrammarError,
    Grammars,
    GrammarSpec,
    apply_masks,
    check_grammar,
    masked_argmax,
)
from taipan.ops.tokenizer import Tokenizer

pytest.importorskip("llguidance")


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(resolve("smollm2")[1])


@pytest.fixture(scope="module")
def grammars(tok) -> Grammars:
    return Grammars(tok, 49152 + 64)  # (logits wider than the vocabulary: padding never allowed)


def allowed(mask: np.ndarray) -> list[int]:
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")
    return np.flatnonzero(bits).tolist()


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        (GrammarSpec("yaml", ""), "unknown grammar kind"),
        (GrammarSpec("json_schema", "{not json"), "not JSON"),
        (GrammarSpec("json_schema", '{"type": 5}'), "json_schema"),
        (GrammarSpec("regex", "(unclosed"), "regex"),
        (GrammarSpec("choice", "[]"), "non-empty list"),
        (GrammarSpec("choice", '"a"'), "non-empty list"),
        (GrammarSpec("grammar", "start: ???"), "grammar"),
    ],
)
def test_a_bad_spec_is_refused_naming_why(spec, why):
    with pytest.raises(GrammarError, match=why):
        check_grammar(spec)


def test_a_choice_allows_only_its_strings_then_only_eos(tok, grammars):
    grammars.start(1, GrammarSpec("choice", json.dumps(["yes", "no"])))
    first = allowed(grammars.masks([1])[0])
    texts = {tok.decode([t]) for t in first}
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts), texts
    for t in tok.encode("yes", add_special_tokens=False):
        grammars.consume(1, t)
    assert allowed(grammars.masks([1])[0]) == [t for t in tok.eos_token_ids]
    grammars.drop(1)
    assert allowed(grammars.masks([1])[0]) == list(range(49152 + 64))  # (no matcher: all)


SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"kind": {"enum": ["a", "b"]},
     "n": {"type": "number"}}, "required": ["kind"]},
]  # fmt: skip


@pytest.mark.parametrize("schema", SCHEMAS)
def test_random_walks_through_the_masks_always_parse(tok, grammars, schema):
    """Sample uniformly among the allowed tokens (a model at its most adversarial) until only
    EOS is allowed: the text always parses, as JSON, against the schema's shape."""
    rng = random.Random(0)
    eos = set(tok.eos_token_ids)
    for walk in range(5):
        rid = 100 + walk
        grammars.start(rid, GrammarSpec("json_schema", json.dumps(schema)))
        out = []
        for step in range(400):
            choices = allowed(grammars.masks([rid])[0])
            ends = [c for c in choices if c in eos]
            others = [c for c in choices if c not in eos]
            if ends and (not others or step > 20 or rng.random() < 0.2):
                break
            if step > 20:  # wrap up: close what is open (a quote, a brace, a bracket)
                closing = [c for c in others if tok.decode([c]) in ('"', "}", "]", "1", "true")]
                others = closing or others
            tok_id = rng.choice(others)
            out.append(tok_id)
            grammars.consume(rid, tok_id)
        else:
            pytest.fail("the walk never ended")
        value = json.loads(tok.decode(out))
        if schema["type"] == "object":
            assert isinstance(value, dict) and set(schema["required"]) <= set(value)
        else:
            assert isinstance(value, list) and 1 <= len(value) <= 3
            assert all(isinstance(v, bool) for v in value)
        grammars.drop(rid)


def test_apply_masks_leaves_only_the_allowed_tokens(grammars):
    grammars.start(7, GrammarSpec("regex", "[0-9]+"))
    masks = grammars.masks([7, 8])  # (8 has no grammar: every token)
    logits = torch.zeros(3, grammars.vocab_size)
    apply_masks(logits, torch.tensor([0, 2]), torch.from_numpy(masks))
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == allowed(masks[0])
    assert torch.isfinite(logits[1]).all() and torch.isfinite(logits[2]).all()
    # masked_argmax: the best allowed token of each row, the logits left as they were.
    scores = torch.arange(grammars.vocab_size, dtype=torch.float32).repeat(2, 1)
    best = masked_argmax(scores, torch.from_numpy(masks))
    assert best.tolist() == [max(allowed(masks[0])), grammars.vocab_size - 1]
    assert scores[0, -1] == grammars.vocab_size - 1  # (unchanged)
    grammars.drop(7)


def test_a_batch_of_masks_equals_each_alone(tok, grammars):
    """Several live matchers' masks come from llguidance's parallel executor: the same rows as
    one at a time, beside a finished grammar (EOS only) and an id without one (all)."""
    specs = [GrammarSpec("regex", "[0-9]+"), GrammarSpec("choice", '["yes", "no"]'),
             GrammarSpec("json_schema", json.dumps(SCHEMAS[0]))]  # fmt: skip
    for rid, spec in enumerate(specs, start=200):
        grammars.start(rid, spec)
    grammars.start(299, GrammarSpec("choice", '["x"]'))
    for t in tok.encode("x", add_special_tokens=False):
        grammars.consume(299, t)
    ids = [200, 201, 999, 202, 299]
    batch = grammars.masks(ids)
    for i, rid in enumerate(ids):
        assert np.array_equal(batch[i], grammars.masks([rid])[0]), rid
    assert allowed(batch[4]) == list(tok.eos_token_ids) and batch[2].min() == -1
    for rid in (200, 201, 202, 299):
        grammars.drop(rid)


def test_requests_of_one_grammar_share_its_compiled_template(tok, monkeypatch):
    """A second request of the same grammar starts from a copy of the first one's compiled
    matcher, which never advances: each request's matcher moves alone, and the templates kept
    are bounded (least recently used out first)."""
    import taipan.ops.grammar as grammar

    g = Grammars(tok, 49152)
    spec = GrammarSpec("choice", json.dumps(["yes", "no"]))
    g.start(1, spec)
    g.start(2, spec)
    assert len(g._templates) == 1 and g.matchers[1] is not g.matchers[2]
    fresh = allowed(g.masks([1])[0])
    for t in tok.encode("yes", add_special_tokens=False):
        g.consume(1, t)
    assert allowed(g.masks([1])[0]) == list(tok.eos_token_ids)
    assert allowed(g.masks([2])[0]) == fresh  # (request 2 has not moved)
    g.start(3, spec)  # (from the template, not from request 1's advanced matcher)
    assert allowed(g.masks([3])[0]) == fresh
    monkeypatch.setattr(grammar, "TEMPLATES", 2)
    for word in ("a", "b", "c"):
        g.start(4, GrammarSpec("choice", json.dumps([word])))
    assert len(g._templates) == 2 and spec.grammar() not in g._templates


def test_advance_takes_allowed_tokens_and_leaves_a_refused_one_untaken(tok):
    """A batch check (`advance`): each allowed token is taken, a refused one is not (its
    matcher, broken by llguidance's consume, is built again from its template and the tokens
    it took: it goes on as if it had never seen the refused one), a request without a matcher
    is -1, the logits' padding is refused, a grammar that completes takes only an
    end-of-sequence token (what its mask allows)."""
    g = Grammars(tok, 49152 + 64)
    spec = GrammarSpec("json_schema", json.dumps(SCHEMAS[0]))
    for rid in (1, 2, 3):
        g.start(rid, spec)
    g.start(4, GrammarSpec("choice", json.dumps(["yes"])))
    brace = tok.encode("{", add_special_tokens=False)[0]
    hello = tok.encode("Hello", add_special_tokens=False)[0]
    yes = tok.encode("yes", add_special_tokens=False)
    assert len(yes) == 1
    took = g.advance([1, 2, 3, 9, 4], [brace, hello, 49152 + 3, brace, yes[0]])
    assert took.tolist() == [1, 0, 0, -1, 1]
    assert g._history[1] == [brace] and g._history[2] == [] and g._history[3] == []
    assert not g.matchers[2].is_error() and g.live(2)
    for rid in (2, 3):  # (untouched: they take what a fresh matcher takes)
        assert not np.array_equal(g.masks([rid])[0], g.masks([1])[0])
        assert brace in allowed(g.masks([rid])[0])
    assert g.advance([2], [brace]).tolist() == [1]
    assert np.array_equal(g.masks([2])[0], g.masks([1])[0])
    assert not g.live(4) and allowed(g.masks([4])[0]) == list(tok.eos_token_ids)
    eos = tok.eos_token_ids[0]
    assert g.advance([4, 4], [yes[0], eos]).tolist() == [0, 1]  # (complete: its EOS only)
    for rid in (5, 6):  # (every row live, every token in range: the batch's quick path)
        g.start(rid, spec)
    assert g.advance([5, 6], [hello, brace]).tolist() == [0, 1]
    assert g._history[5] == [] and g._history[6] == [brace] and not g.matchers[5].is_error()
    for rid in (1, 2, 3, 4, 5, 6):
        g.drop(rid)
    assert not g._history and not g._origin and not g.dead


def test_opening_masks_are_cached_by_the_tokens_taken_and_equal_a_matchers_own(tok, monkeypatch):
    """Over a request's first PROLOGUE_MASKS tokens its masks are kept with its template, by
    the tokens taken (requests of one schema share them): each equals the mask its own
    matcher gives; past the prologue, or beyond CACHED_MASKS, the matcher's own is used."""
    import taipan.ops.grammar as grammar

    g = Grammars(tok, 49152 + 64)
    spec = GrammarSpec("json_schema", json.dumps(SCHEMAS[0]))
    for rid in (1, 2, 3):
        g.start(rid, spec)
    cache = g._origin[1][1]
    assert cache is g._origin[2][1]
    first = g.masks([1, 2])
    own = g.masks_of([g.matchers[1]])[0]
    assert list(cache) == [()] and np.array_equal(first[0], own) and np.array_equal(first[1], own)
    text = tok.encode('{"name": "Ada", "age": 36}', add_special_tokens=False)
    for t in text[:3]:
        assert g.advance([1, 2], [t, t]).tolist() == [1, 1]
        got = g.masks([1, 3, 2])
        assert np.array_equal(got[0], g.masks_of([g.matchers[1]])[0])
        assert np.array_equal(got[0], got[2]) and np.array_equal(got[1], own)
    assert tuple(text[:3]) in cache and len(cache) == 4
    monkeypatch.setattr(grammar, "CACHED_MASKS", len(cache))
    assert g.advance([1], [text[3]]).tolist() == [1]
    assert np.array_equal(g.masks([1])[0], g.masks_of([g.matchers[1]])[0])
    assert len(cache) == 4  # (full: computed, not kept)
    monkeypatch.setattr(grammar, "PROLOGUE_MASKS", 2)
    assert np.array_equal(g.masks([2])[0], g.masks_of([g.matchers[2]])[0])


def test_a_greedy_row_is_checked_and_masked_only_when_its_grammar_rejects_its_token(
    tok, monkeypatch
):
    """GrammarMasks (the gpu worker's), alone: a greedy row's own best token, allowed by its
    grammar, is kept and consumed without any mask computed; a rejected one is replaced by the
    best token its mask allows. A request's first token is masked (its matcher has taken
    nothing: its mask waits for no step) and checked. A sampled row is masked before sampling,
    as before."""
    import types

    from taipan.actors.gpu.grammar_masks import GrammarMasks
    from taipan.messages.gpu import GrammarStart
    from taipan.messages.requests import StructuredOutput

    vocab = 49152
    masks = GrammarMasks(tok)
    computed = []
    real_masks = Grammars.masks
    monkeypatch.setattr(Grammars, "masks", lambda self, ids: computed.append(list(ids)) or
                        real_masks(self, ids))  # fmt: skip
    yes, no = (tok.encode(w, add_special_tokens=False)[0] for w in ("yes", "no"))

    def plan(temperature, new=()):
        return types.SimpleNamespace(
            grammar_rows=np.array([7], np.int32), grammar_new=list(new),
            grammar_drop=np.zeros(0, np.int64), temperature=np.array([temperature], np.float32),
            sample=np.array([1], np.int8), logprobs_mode=np.zeros(0, np.int8),
            num_drafts=np.zeros(0, np.int32), prev_rows=np.zeros(0, np.int32),
        )  # fmt: skip

    start = GrammarStart(7, StructuredOutput("regex", "(yes|no)(yes|no)"))
    logits = torch.zeros(1, vocab)
    logits[0, 100] = 9.0  # (not allowed: masked away in the first token's step)
    logits[0, yes] = 5.0
    out = masks.masked(plan(0.0, [start]), logits, logits)
    assert computed == [[7]] and out is not logits and int(out.argmax()) == yes
    assert masks.checked(torch.tensor([yes]), out).tolist() == [yes]  # (consumed)

    computed.clear()
    logits = torch.zeros(1, vocab)
    logits[0, no] = 5.0  # allowed: kept, no mask
    out = masks.masked(plan(0.0), logits, logits)
    assert out is logits and computed == []
    assert masks.checked(torch.tensor([no]), logits).tolist() == [no] and computed == []
    assert allowed(masks.grammars.masks([7])[0]) == list(tok.eos_token_ids)  # (consumed)

    computed.clear()
    masks.grammars.drop(7)
    masks.masked(plan(0.0, [start]), logits, logits)
    masks.checked(torch.tensor([yes]), logits)
    computed.clear()
    logits = torch.zeros(1, vocab)
    logits[0, 100] = 9.0  # rejected: the best allowed token instead
    logits[0, no] = 3.0
    masks.masked(plan(0.0), logits, logits)
    assert masks.checked(torch.tensor([100]), logits).tolist() == [no] and computed == [[7]]

    computed.clear()
    masks.grammars.drop(7)
    out = masks.masked(plan(1.0, [start]), logits, logits)  # sampled: masked before
    assert computed == [[7]] and out is not logits and out[0, 100] == float("-inf")
    assert masks.checked(torch.tensor([no]), out).tolist() == [no]  # (nothing to check)


def test_greedy_rows_masked_before_sampling_when_asked(tok, monkeypatch):
    """TAIPAN_GRAMMAR_MASKS=mask: a greedy row is masked before sampling as a sampled row is
    (its mask computed, its disallowed tokens at -inf, nothing left to check); the variable
    defaults to "check" and any other value is refused, naming it."""
    import types

    from taipan.actors.gpu.grammar_masks import MODE_ENV, GrammarMasks, grammar_mode
    from taipan.messages.gpu import GrammarStart
    from taipan.messages.requests import StructuredOutput

    monkeypatch.delenv(MODE_ENV, raising=False)
    assert grammar_mode() == "check"
    monkeypatch.setenv(MODE_ENV, "mask")
    assert grammar_mode() == "mask"
    monkeypatch.setenv(MODE_ENV, "both")
    with pytest.raises(ValueError, match=MODE_ENV):
        grammar_mode()

    masks = GrammarMasks(tok, check_greedy=False)
    no = tok.encode("no", add_special_tokens=False)[0]
    start = GrammarStart(7, StructuredOutput("choice", json.dumps(["yes", "no"])))
    step = types.SimpleNamespace(
        grammar_rows=np.array([7], np.int32), grammar_new=[start],
        grammar_drop=np.zeros(0, np.int64), temperature=np.zeros(1, np.float32),
        sample=np.ones(1, np.int8), logprobs_mode=np.zeros(0, np.int8),
        num_drafts=np.zeros(0, np.int32), prev_rows=np.zeros(0, np.int32),
    )  # fmt: skip
    logits = torch.zeros(1, 49152)
    logits[0, 100], logits[0, no] = 9.0, 3.0
    out = masks.masked(step, logits, logits)
    assert out is not logits and out[0, 100] == float("-inf") and int(out.argmax()) == no
    assert masks.check_later(torch.tensor([no]), torch.tensor([no]), out) is None
    assert masks.checked(torch.tensor([no]), out).tolist() == [no]  # (nothing to check)


def test_a_checked_row_is_checked_at_collect_and_the_next_launch_waits_for_it(tok, monkeypatch):
    """GrammarMasks' deferred check (a step without log-probs or drafts): `check_later` takes
    the step's checked rows; `run_check` (at the step's collect, its tokens on the host)
    replaces a rejected token in the host copy and in the device tokens the next step reads;
    `wait_check` (before the next forward) returns once it ran, raises the collect's error
    when it failed, and names the wait when no collect came."""
    import types

    from taipan.actors.gpu import grammar_check
    from taipan.actors.gpu.grammar_masks import GrammarMasks
    from taipan.messages.gpu import GrammarStart
    from taipan.messages.requests import StructuredOutput

    yes, no = (tok.encode(w, add_special_tokens=False)[0] for w in ("yes", "no"))
    masks = GrammarMasks(tok)
    start = GrammarStart(7, StructuredOutput("choice", json.dumps(["yes", "no"])))
    step = types.SimpleNamespace(
        grammar_rows=np.array([-1, 7], np.int32), grammar_new=[start],
        grammar_drop=np.zeros(0, np.int64), temperature=np.zeros(2, np.float32),
        sample=np.ones(2, np.int8), logprobs_mode=np.zeros(0, np.int8),
        num_drafts=np.zeros(0, np.int32), prev_rows=np.zeros(0, np.int32),
    )  # fmt: skip
    logits = torch.zeros(2, 49152)
    logits[1, 100], logits[1, no] = 9.0, 3.0  # row 1's choice (100) is rejected: `no` instead
    masks.masked(step, logits, logits)
    host, sampled = torch.tensor([5, 100]), torch.tensor([5, 100, 0])
    check = masks.check_later(host, sampled, logits)
    assert masks.pending and check.rows.tolist() == [1]
    masks.run_check(check)  # (`no` is its second candidate: no mask computed)
    assert host.tolist() == [5, no] and sampled.tolist() == [5, no, 0]
    masks.wait_check()
    assert not masks.pending
    assert allowed(masks.grammars.masks([7])[0]) == list(tok.eos_token_ids)  # (consumed)

    # No candidate above the K-th logit is allowed (`no` ties with every token at the floor):
    # its mask decides, the lowest allowed id among the ties, as argmax under the mask does.
    masks.grammars.drop(7)
    masks.masked(step, logits, logits)
    flat = torch.zeros(2, 49152)
    flat[1, 100] = 9.0
    host, sampled = torch.tensor([5, 100]), torch.tensor([5, 100, 0])
    lowest = min(allowed(masks.grammars.masks([7])[0]))
    masks.run_check(masks.check_later(host, sampled, flat))
    assert host.tolist() == [5, lowest] and sampled.tolist() == [5, lowest, 0]
    masks.wait_check()

    masks.grammars.drop(7)
    masks.masked(step, logits, logits)
    masks.check_later(host, sampled, logits).fail(RuntimeError("device lost"))
    with pytest.raises(RuntimeError, match="grammar check failed: .*device lost"):
        masks.wait_check()

    monkeypatch.setattr(grammar_check, "CHECK_TIMEOUT_S", 0.05)
    masks.grammars.drop(7)
    masks.masked(step, logits, logits)
    masks.check_later(host, sampled, logits)
    with pytest.raises(RuntimeError, match="did not run within"):
        masks.wait_check()


def test_a_check_the_next_step_did_not_wait_for_voids_the_rows_that_read_its_fixes(tok):
    """ "check" mode (GrammarMasks(optimistic=True)): step 2 is launched reading step 1's
    unchecked tokens before step 1's check runs. The check replaces a rejected token in the
    host copy only (the device's was read already) and lists its row in `fixed`; step 2's row
    that read it is void: its check leaves it alone (no fix, its matcher not advanced), while a
    row that read a kept token is checked as usual. A launch after the check leaves the void
    rows out from the start; a row whose request was dropped meanwhile is left alone. The row
    that computes a void position again is masked as well as checked."""
    import types

    from taipan.actors.gpu.grammar_masks import GrammarMasks
    from taipan.messages.gpu import GrammarStart
    from taipan.messages.requests import StructuredOutput

    yes, no = (tok.encode(w, add_special_tokens=False)[0] for w in ("yes", "no"))
    masks = GrammarMasks(tok, optimistic=True)
    two = StructuredOutput("regex", "(yes|no)(yes|no)")
    new = [GrammarStart(7, two), GrammarStart(8, two)]

    def step(prev_rows, new=()):
        return types.SimpleNamespace(
            grammar_rows=np.array([7, 8], np.int32), grammar_new=list(new),
            grammar_drop=np.zeros(0, np.int64), temperature=np.zeros(2, np.float32),
            sample=np.ones(2, np.int8), logprobs_mode=np.zeros(0, np.int8),
            num_drafts=np.zeros(0, np.int32), prev_rows=np.array(prev_rows, np.int32),
            query_start_loc=np.array([0, 1, 2], np.int32),
        )  # fmt: skip

    def logits_for(best):
        out = torch.zeros(2, 49152)
        for row, token in enumerate(best):
            out[row, token] = 9.0
        out[:, no] = torch.maximum(out[:, no], torch.tensor(3.0))  # (the runner-up)
        return out

    first = step([], new)
    masks.masked(first, logits_for([100, yes]), None)
    host1, sampled1 = torch.tensor([100, yes]), torch.tensor([100, yes])
    check1 = masks.check_later(host1, sampled1, logits_for([100, yes]))
    masks.launched(check1)
    assert masks.skips_wait(step([0, 1]), False) and not masks.skips_wait(step([0, 1]), True)
    # (inline on the actor's loop only then: a launch that checks in itself waits for check 1)
    assert masks.inline(step([0, 1]), False) and not masks.inline(step([0, 1]), True)
    assert not masks.inline(step([0, 1], new), False)  # (a grammar to compile)
    masks.masked(step([0, 1]), logits_for([yes, no]), None)  # (launched before check 1 ran)
    host2 = torch.tensor([yes, no])
    check2 = masks.check_later(host2, torch.tensor([yes, no]), logits_for([yes, no]))
    masks.launched(check2)

    masks.run_check(check1)  # row 0's 100 is rejected: `no`, its best allowed candidate
    assert host1.tolist() == [no, yes] and sampled1.tolist() == [100, yes]
    assert check1.fixed.tolist() == [0]
    assert masks.pending
    masks.run_check(check2)  # row 0 read 100: void; row 1 read `yes` and takes `no`
    assert not masks.pending  # (checks that ran leave plain steps nothing to do)
    assert check2.void.tolist() == [0] and check2.fixed.tolist() == []
    assert host2.tolist() == [yes, no]
    assert {yes, no} <= set(allowed(masks.grammars.masks([7])[0]))  # (one token consumed)
    assert allowed(masks.grammars.masks([8])[0]) == list(tok.eos_token_ids)  # (two)
    # Request 7's next row computes the void position again from the plan's input (prev -1):
    # masked as well as checked (its matcher is current: check 1 ran).
    assert masks._redo == {7}
    redo = logits_for([100, yes])
    masks.masked(step([-1, 1]), redo, None)
    assert redo[0, 100] == float("-inf") and redo[0, no] == 3.0 and masks._redo == set()
    check3 = masks.check_later(torch.tensor([no, 2]), torch.tensor([no, 2]), redo)
    masks.launched(check3)
    masks.run_check(check3)
    assert check3.rows.tolist() == [0] and check3.fixed.tolist() == []

    # Launched once the check before it ran: its void rows are left out at the launch.
    masks.grammars.drop(7)
    masks.grammars.drop(8)
    masks.masked(step([], new), logits_for([100, yes]), None)
    tokens = torch.tensor([100, yes])
    check1 = masks.check_later(tokens, tokens.clone(), logits_for([100, yes]))
    masks.launched(check1)
    masks.run_check(check1)
    masks.masked(step([0, 1]), logits_for([yes, no]), None)
    tokens = torch.tensor([yes, no])
    check2 = masks.check_later(tokens, tokens.clone(), logits_for([yes, no]))
    assert check2.rows.tolist() == [1] and check2.before is None

    # A request dropped (aborted) by a launch before its row's check ran: the row is left as
    # it is, nothing raises.
    masks.grammars.drop(8)
    masks.run_check(check2)
    assert check2.void.tolist() == [1] and check2.fixed.tolist() == []


@pytest.mark.parametrize("later", [False, True])
def test_a_refused_draw_is_drawn_again_over_the_allowed_tokens_with_its_noise(tok, later):
    """ "check" mode, a temperature draw with no top-k / top-p / min-p: its unmasked draw is
    checked; refused, it is replaced by the draw over the allowed tokens with the same noise
    key: the token a draw after masking gives (in the launch, `checked`, or at the collect,
    `check_later` then `run_check`). A top-p row is masked before drawing instead."""
    import types

    from taipan.actors.gpu.grammar_masks import GrammarMasks
    from taipan.messages.gpu import GrammarStart
    from taipan.messages.requests import StructuredOutput
    from taipan.ops.grammar import masked_draw
    from taipan.ops.sampling import row_keys, sample

    vocab = 49152
    masks = GrammarMasks(tok, optimistic=True)
    spec = StructuredOutput("regex", "[0-9]{3}-[a-z]{40}")

    def plan(new=(), top_p=1.0):
        return types.SimpleNamespace(
            grammar_rows=np.array([7], np.int32), grammar_new=list(new),
            grammar_drop=np.zeros(0, np.int64), temperature=np.array([1.0], np.float32),
            top_k=np.zeros(1, np.int32), top_p=np.array([top_p], np.float32),
            min_p=np.zeros(1, np.float32), sample=np.array([1], np.int8),
            logprobs_mode=np.zeros(0, np.int8), num_drafts=np.zeros(0, np.int32),
            prev_rows=np.zeros(0, np.int32),
        )  # fmt: skip

    gen = torch.Generator().manual_seed(0)
    one = torch.ones(1)
    digit = tok.encode("4", add_special_tokens=False)[0]
    masks.masked(plan([GrammarStart(7, spec)]), torch.zeros(1, vocab), None)  # (first: masked)
    assert masks.checked(torch.tensor([digit]), torch.zeros(1, vocab)).tolist() == [digit]
    for gen_index in range(1, 6):
        logits = torch.randn(1, vocab, generator=gen) * 4
        keys = row_keys(torch.tensor([11]), torch.tensor([gen_index], dtype=torch.int32))
        off = torch.zeros(1, dtype=torch.int32)
        unmasked = int(sample(logits, one, off, one, torch.tensor([11]), off, keys=keys))
        mask = torch.from_numpy(masks.grammars.masks([7]))
        want = int(masked_draw(logits, mask, one, keys))
        out = masks.masked(plan(), logits, logits)
        assert out is logits  # (checked, not masked)
        if later:
            host = torch.tensor([unmasked])
            check = masks.check_later(host, host.clone(), logits, keys)
            masks.launched(check)
            masks.run_check(check)
            got = int(host[0])
            assert check.fixed.tolist() == ([0] if unmasked != want else [])
            masks._redo.clear()  # (the next row would be the void position's redo)
        else:
            got = int(masks.checked(torch.tensor([unmasked]), logits, keys)[0])
        assert got == want, (gen_index, unmasked, want)
        assert (unmasked == want) == (unmasked in allowed(mask[0].numpy()))
    masks.grammars.drop(7)
    masks.masked(plan([GrammarStart(7, spec)]), torch.zeros(1, vocab), None)
    masks.checked(torch.tensor([digit]), torch.zeros(1, vocab))
    out = masks.masked(plan(top_p=0.9), logits, logits)  # (a nucleus: masked before)
    assert out is not logits and out[0, 100] == float("-inf")


def test_json_takes_indented_text_and_bounds_each_whitespace_gap(tok, grammars):
    """A json_schema's whitespace between tokens (JSON_WHITESPACE): `json.dumps(indent=4)` of
    an instance nested three deep parses token by token (a newline and 12 spaces before its
    innermost items), while a gap of 40 spaces is refused: a model cannot fill its output with
    whitespace."""
    strings = {"type": "array", "items": {"type": "string"}}
    schema = {
        "type": "object",
        "properties": {"a": {"type": "object", "properties": {"b": strings}}},
    }
    text = json.dumps({"a": {"b": ["x", "y"]}}, indent=4)
    assert "\n            " in text
    grammars.start(31, GrammarSpec("json_schema", json.dumps(schema)))
    assert all(grammars.try_consume(31, t) for t in tok.encode(text, add_special_tokens=False))
    grammars.start(32, GrammarSpec("json_schema", json.dumps(schema)))
    taken = [
        grammars.try_consume(32, t) for t in tok.encode("{" + " " * 40, add_special_tokens=False)
    ]
    assert not all(taken)


def test_matchers_along_drafts_are_copies_and_end_at_a_rejected_draft(tok, grammars):
    """Grammars.along (masks at every scored position of a verify row): the matcher as is,
    then a copy after each draft its grammar takes (its own never moves), None from the first
    draft it rejects; masks_of gives None all bits."""
    yes, no = (tok.encode(w, add_special_tokens=False)[0] for w in ("yes", "no"))
    grammars.start(21, GrammarSpec("choice", json.dumps(["yes", "no"])))
    own = grammars.matchers[21]
    chain = grammars.along(21, [yes, no, yes])
    assert chain[0] is own and chain[1] is not own and chain[2] is None and chain[3] is None
    masks = grammars.masks_of(chain)
    assert {yes, no} <= set(allowed(masks[0]))
    assert allowed(masks[1]) == list(tok.eos_token_ids)  # (after "yes": the end)
    assert (masks[2] == -1).all() and (masks[3] == -1).all()
    assert allowed(grammars.masks([21])[0]) == allowed(masks[0])  # (its own did not move)
    grammars.drop(21)


def test_a_padding_token_is_never_allowed_and_leaves_the_matcher_live(tok, grammars):
    """Logits wider than the tokenizer: a token id past it (a candidate or a greedy choice in
    the padding) is refused without touching the matcher (llguidance would stop it)."""
    grammars.start(31, GrammarSpec("choice", json.dumps(["yes", "no"])))
    past = grammars.ll.vocab_size + 3
    assert not grammars.try_consume(31, past) and grammars.live(31)
    assert grammars.along(31, [past])[1] is None and grammars.live(31)
    grammars.drop(31)
