"""Structured outputs: a request's grammar (a JSON schema, any JSON object, a regex, a choice of
strings, or a Lark / GBNF grammar) turned into the set of tokens it allows next, by llguidance
(a maintained grammar engine: Earley parser over a token trie, ~1 ms per mask).

Owns the grammar kinds and their checks (`GrammarSpec`, `check_grammar`: a bad spec is the
caller's error, named, before any request is accepted), one matcher per request in a gpu worker
(`Grammars`: start, consume the sampled token, the next mask, drop) and applying masks to a
step's logits (`apply_masks`). A mask is a packed bitmask, int32 words of 32 tokens (bit t % 32
of word t // 32 set: token t allowed), as llguidance fills it.

A matcher that has reached the end of its grammar allows only the end-of-sequence tokens; one
whose grammar is broken by a token it did not allow (never, when its masks were applied) allows
them too, so the request ends rather than running on unconstrained.

Must not touch the step: the worker decides when to consume and which rows to mask. Imports
neither torch nor llguidance at import time (the client and HTTP processes check specs with
`check_grammar` and never load torch).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import re

import numpy as np

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


class GrammarError(ValueError):
    """A grammar that cannot be compiled, with llguidance's reason."""


@dataclasses.dataclass(frozen=True)
class GrammarSpec:
    """`kind` (one of KINDS) and `spec`: the schema as JSON text (json_schema), "" (json_object),
    the pattern (regex), a JSON list of the strings (choice), the Lark or GBNF text (grammar)."""

    kind: str
    spec: str

    def grammar(self) -> str:
        """llguidance's grammar JSON for this spec (GrammarError when it is malformed)."""
        import llguidance

        if self.kind not in KINDS:
            raise GrammarError(f"unknown grammar kind {self.kind!r}; known: {', '.join(KINDS)}")
        if self.kind == "json_object":
            return llguidance.grammar_from(
                "json_schema", json.dumps(bounded_schema({"type": "object"}))
            )
        if self.kind == "choice":
            try:
                choices = json.loads(self.spec)
            except json.JSONDecodeError as e:
                raise GrammarError(f"choice: not a JSON list of strings ({e})") from None
            if not (
                isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)
            ):
                raise GrammarError("choice: needs a non-empty list of strings")
            return llguidance.grammar_from("regex", "|".join(f"({re.escape(c)})" for c in choices))
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.spec)
            except json.JSONDecodeError as e:
                raise GrammarError(f"json_schema: not JSON ({e})") from None
            if isinstance(schema, dict):
                return llguidance.grammar_from("json_schema", json.dumps(bounded_schema(schema)))
        spec = self.spec
        if self.kind == "grammar":  # Lark, or the GBNF / EBNF vLLM's and SGLang's users write
            from llguidance.gbnf_to_lark import any_to_lark

            try:
                spec = any_to_lark(spec)
            except Exception as e:  # (its converter raises plain Exceptions too: "Rule 'x' not
                # found"); any of them is a grammar the request cannot have
                raise GrammarError(f"grammar: {e}") from None
        try:
            return llguidance.grammar_from(self.kind if self.kind != "grammar" else "lark", spec)
        except ValueError as e:
            raise GrammarError(f"{self.kind}: {e}") from None


# JSON's whitespace between tokens: at most this much per gap (as xgrammar's
# max_whitespace_cnt), where JSON allows any amount: a model that favours whitespace would
# otherwise fill max_tokens with it. 32 holds a newline and the indentation of `json.dumps(...,
# indent=4)` seven levels deep; 8 rejected a second level's items (a newline and 8 spaces), and
# SmolLM2's pretty-printed JSON lost a step to a rejected token every few items (NOTES,
# twenty-seventh session). A schema's own "x-guidance" options take precedence.
JSON_WHITESPACE = "[ \\t\\n]{0,32}"


def bounded_schema(schema: dict) -> dict:
    """`schema` with llguidance's whitespace bounded (unless it sets its own options)."""
    if "x-guidance" in schema:
        return schema
    return schema | {
        "x-guidance": {"whitespace_flexible": True, "whitespace_pattern": JSON_WHITESPACE}
    }


def check_grammar(spec: GrammarSpec) -> None:
    """Raise GrammarError naming what is wrong with `spec` (no tokenizer needed)."""
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(spec.grammar())
    if error:
        raise GrammarError(f"{spec.kind}: {error}")


def grammar_problem(kind: str, spec: str) -> str | None:
    """Why the grammar (`kind`, `spec`) cannot run, as a sentence, or None (the engine's
    submission check and the HTTP server's 400 both say this)."""
    try:
        check_grammar(GrammarSpec(kind, spec))
    except GrammarError as e:
        return str(e)
    except ImportError:
        return "structured outputs need the llguidance package (pip install llguidance==1.9.1)"
    return None


def ll_tokenizer(tokenizer):
    """llguidance's tokenizer of our `ops.tokenizer.Tokenizer` (its Rust backend's JSON; built
    once per model: ~0.3 s for a 49k vocabulary)."""
    import llguidance

    text = tokenizer._tok.to_str()
    eos = list(tokenizer.eos_token_ids)
    return llguidance.LLTokenizer(text, n_vocab=tokenizer.vocab_size, eos_token=eos or None)


TEMPLATES = 64  # compiled grammars kept per worker (Grammars._templates)
PROLOGUE_MASKS = 8  # a request's masks over its first tokens are cached (`Grammars.masks`)
CACHED_MASKS = 256  # masks cached per compiled grammar (~6 KB each for a 49k vocabulary)


class Grammars:
    """The live matchers of one gpu worker, by request id. Each is advanced by the tokens its
    request samples (`consume`) and asked for the next mask (`masks`); `drop` forgets one."""

    def __init__(self, tokenizer, vocab_size: int):
        """`tokenizer`: ops.tokenizer.Tokenizer; `vocab_size`: the logits' width (>= the
        tokenizer's: padded rows beyond it are never allowed)."""
        self.ll = ll_tokenizer(tokenizer)
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.ll_words = (self.ll.vocab_size + 31) // 32
        if self.ll_words > self.words:
            raise GrammarError(
                f"the tokenizer has {self.ll.vocab_size} tokens, the logits only {vocab_size}"
            )
        self.eos = [t for t in tokenizer.eos_token_ids if t < vocab_size]
        self._eos_set = set(self.eos)
        eos_only = np.zeros(self.words, dtype=np.uint32)
        for t in self.eos:
            eos_only[t // 32] |= np.uint32(1 << (t % 32))
        self._eos_only = eos_only.view(np.int32)
        self.matchers: dict[int, object] = {}
        # Per request: its template's entry (`start`) and every token its matcher has taken,
        # to build the matcher again when `advance` refused a token (llguidance's batched
        # consume leaves a refused token's matcher broken for good); and the requests whose
        # matcher has stopped (its grammar complete: end-of-sequence tokens only) or broke.
        self._origin: dict[int, list] = {}
        self._history: dict[int, list[int]] = {}
        self.dead: set[int] = set()
        # Per grammar text, a matcher that never advances: a new request's matcher is its
        # deep copy (0.002 ms, sharing the compiled lexer and its lazily built states, where a
        # fresh one costs ~1 ms and its first mask ~4 ms more: 64 streams of one schema spent
        # 70 ms in their first step). Least recently used first out, past TEMPLATES.
        self._templates: dict[str, list] = {}  # ([the template, its cached masks])
        import llguidance

        self.executor = llguidance.LLExecutor() if hasattr(llguidance, "LLExecutor") else None

    def start(self, request_id: int, spec: GrammarSpec) -> None:
        import llguidance

        grammar = spec.grammar()
        entry = self._templates.pop(grammar, None)
        if entry is None:
            # (silent: `advance` hands it refused tokens, which it would print a warning for)
            template = llguidance.LLMatcher(self.ll, grammar, log_level=0)
            error = template.get_error()
            if error:
                raise GrammarError(f"{spec.kind}: {error}")
            if len(self._templates) >= TEMPLATES:
                del self._templates[next(iter(self._templates))]
            entry = [template, {}]  # (its masks by the tokens taken: `masks`)
        self._templates[grammar] = entry  # (now the most recently used)
        self.matchers[request_id] = entry[0].deep_copy()
        self._origin[request_id] = entry
        self._history[request_id] = []
        self.dead.discard(request_id)

    def consume(self, request_id: int, token: int) -> None:
        """Advance `request_id`'s matcher past its sampled `token` (an end-of-sequence token at
        the end of the grammar stops it)."""
        m = self.matchers.get(request_id)
        if m is not None and not m.is_stopped():
            m.consume_token(int(token))
            self._history[request_id].append(int(token))
            self._note_end(request_id, m)

    def _note_end(self, request_id: int, m) -> None:
        if m.is_stopped() or m.is_error():
            self.dead.add(request_id)

    def live(self, request_id: int) -> bool:
        """Whether `request_id` has a matcher that still takes tokens (not stopped, no error)."""
        return request_id in self.matchers and request_id not in self.dead

    def advance(self, request_ids: list[int], tokens: list[int]) -> np.ndarray:
        """`try_consume` of a batch (int8 per row: 1 taken, 0 refused, -1 no matcher): each
        live matcher consumes its token (`consume_token`, which does not first check it); one
        that refused it is built again from its template and the tokens it took (refusals are
        rare: the grammar's own choices). A complete grammar takes an end-of-sequence token
        (what its mask allows) and nothing else. 64 rows on the H200 machines' hosts: 0.07-0.15
        ms, against 0.10-0.21 ms for `try_consume` one row at a time and 0.30-0.46 ms for
        llguidance's executor (consume_token_par: its thread hand-offs cost more than the
        work; tests/perf/grammar_advance_bench.py, NOTES, twenty-eighth session)."""
        n = len(request_ids)
        out = np.ones(n, dtype=np.int8)
        ms = list(map(self.matchers.get, request_ids))
        dead, vocab = self.dead, self.ll.vocab_size
        if (
            n
            and None not in ms
            and dead.isdisjoint(request_ids)
            and min(tokens) >= 0
            and max(tokens) < vocab
        ):  # (most checks: every row live, and every token taken)
            took = list(map(type(ms[0]).consume_token, ms, tokens))
            if all(took):
                collections.deque(map(list.append, map(self._history.__getitem__, request_ids),
                                      tokens), maxlen=0)  # fmt: skip
                if any(map(type(ms[0]).is_stopped, ms)):
                    dead.update(r for r, m in zip(request_ids, ms, strict=True) if m.is_stopped())
                return out
            return self._after_refusals(request_ids, tokens, ms, range(n), took, out)
        at = [
            i
            for i, (r, m, t) in enumerate(zip(request_ids, ms, tokens, strict=True))
            if m is None or r in dead or not 0 <= t < vocab
        ]
        for i in at:  # (no matcher, a stopped one, or the logits' padding: nothing taken)
            if ms[i] is None:
                out[i] = -1
            elif not (tokens[i] in self._eos_set and ms[i].is_stopped()):
                out[i] = 0
        skip = set(at)  # (a stopped grammar's end-of-sequence token: taken, nothing consumed)
        todo = [i for i in range(n) if i not in skip] if skip else range(n)
        took = [ms[i].consume_token(tokens[i]) for i in todo]
        return self._after_refusals(request_ids, tokens, ms, todo, took, out)

    def _after_refusals(self, request_ids, tokens, ms, todo, took, out) -> np.ndarray:
        """`advance`'s bookkeeping once rows `todo` consumed (`took`: whether each did): the
        history of those that took theirs, the others' matchers built again, the stops."""
        history, dead = self._history, self.dead
        for i, ok in zip(todo, took, strict=True):
            r = request_ids[i]
            if ok:
                history[r].append(tokens[i])
                continue
            out[i] = 0
            m = self._origin[r][0].deep_copy()
            m.consume_tokens(history[r])
            self.matchers[r] = ms[i] = m
        for i in todo:  # (a grammar complete: only end-of-sequence tokens from now on)
            if ms[i].is_stopped():
                dead.add(request_ids[i])
        return out

    def try_consume(self, request_id: int, token: int) -> bool:
        """Advance `request_id`'s live matcher past `token` if its grammar allows the token
        there; whether it did (nothing changes when it does not; False without a matcher: a
        request dropped meanwhile). A token past the tokenizer's (the logits' padding) is never
        allowed: llguidance would stop the matcher on it."""
        m = self.matchers.get(request_id)
        if m is None or not 0 <= token < self.ll.vocab_size:
            return False
        if m.try_consume_tokens([int(token)]) != 1:
            return False
        self._history[request_id].append(int(token))
        self._note_end(request_id, m)
        return True

    def masks(self, request_ids) -> np.ndarray:
        """The next allowed tokens of each request, [len(request_ids), words] int32 (all bits
        set for an id without a matcher). The live matchers' masks are computed in parallel
        (llguidance's executor: a batch of grammar rows costs about one row's time). A mask
        depends only on the grammar and the tokens taken, so a request's masks over its first
        PROLOGUE_MASKS tokens are kept with its template (CACHED_MASKS of them): requests of
        one schema start alike and mostly agree on its fixed opening (`{"notes": [`), where
        each rejected guess asks a mask (64 streams of one schema: 64 rows' masks in their
        first step, and again at each refused token of the opening)."""
        ms, young = [], []
        for i, rid in enumerate(request_ids):
            rid = int(rid)
            m = self.matchers.get(rid)
            if m is not None and rid not in self.dead:
                history = self._history[rid]
                if len(history) < PROLOGUE_MASKS:
                    young.append((i, self._origin[rid][1], tuple(history), m))
                    m = None
            ms.append(m)
        out = self.masks_of(ms)
        todo: dict[tuple, list] = {}
        for i, cache, key, m in young:
            row = cache.get(key)
            if row is not None:
                out[i] = row
            else:
                todo.setdefault((id(cache), key), [cache, key, m, []])[3].append(i)
        if todo:
            rows = self.masks_of([m for _, _, m, _ in todo.values()])
            for (cache, key, _, at), row in zip(todo.values(), rows, strict=True):
                if len(cache) < CACHED_MASKS:
                    cache[key] = row.copy()  # (not a view keeping the batch's array alive)
                out[at] = row
        return out

    def along(self, request_id: int, drafts) -> list:
        """Matchers of `request_id` after each prefix of `drafts` (copies: its own does not
        move): [its own, after drafts[:1], ...], as far as its grammar takes the drafts; None
        past a draft it rejects (or for an id without a matcher)."""
        m = self.matchers.get(request_id)
        out = [m]
        for token in drafts:
            if m is None or m.is_stopped() or m.is_error():
                m = None
            elif not 0 <= token < self.ll.vocab_size:  # (padding: never allowed)
                m = None
            else:
                m = m.deep_copy()  # (0.002 ms: shares the compiled grammar)
                if m.try_consume_tokens([int(token)]) != 1:
                    m = None
            out.append(m)
        return out

    def masks_of(self, matchers) -> np.ndarray:
        """`masks` of matcher objects (None: all bits set)."""
        out = np.full((len(matchers), self.words), -1, dtype=np.int32)
        live = []
        for i, m in enumerate(matchers):
            if m is None:
                continue
            if m.is_stopped() or m.is_error():
                out[i] = self._eos_only
            else:
                live.append((m, i))
        if live:
            # (llguidance fills the tokenizer's words; the logits' padding stays disallowed)
            rows = np.zeros((len(matchers), self.ll_words), dtype=np.int32)
            stride = self.ll_words * 4
            if self.executor is not None and len(live) > 1:
                self.executor.unsafe_compute_mask_ptr(live, rows.ctypes.data, stride, len(rows))
            else:
                for m, i in live:
                    m.unsafe_compute_mask_ptr(rows[i].ctypes.data, stride)
            at = [i for _, i in live]
            out[at, : self.ll_words] = rows[at]
            out[at, self.ll_words :] = 0
        return out

    def drop(self, request_id: int) -> None:
        self.matchers.pop(request_id, None)
        self._origin.pop(request_id, None)
        self._history.pop(request_id, None)
        self.dead.discard(request_id)


_BITS = None


def apply_masks(logits, rows, masks) -> None:
    """Set to -inf, in place, every logit of `rows` (torch int64 [n]) whose token `masks`
    ([n, words] int32, on the logits' device) does not allow."""
    sub = logits.index_select(0, rows)
    sub.masked_fill_(~_allowed(masks, logits.shape[1]), float("-inf"))
    logits.index_copy_(0, rows, sub)


def masked_argmax(logits, masks):
    """Each row's best token among those its mask allows ([n] int64; `logits` [n, V] and
    `masks` [n, words] int32 on one device; `logits` unchanged)."""
    return logits.masked_fill(~_allowed(masks, logits.shape[1]), float("-inf")).argmax(dim=-1)


def masked_draw(logits, masks, temperature, keys):
    """Each row's draw among the tokens its mask allows: ops.sampling.sample's race at the
    row's `temperature` ([n] float32 > 0; no top-k, top-p or min-p) with its own noise `keys`
    ([n] int64) over `logits` masked first, what a draw after masking gives for that key
    ([n] int64; `logits` [n, V] unchanged)."""
    import torch

    from taipan.ops.sampling import sample

    masked = logits.masked_fill(~_allowed(masks, logits.shape[1]), float("-inf"))
    n, device = logits.shape[0], logits.device
    off = torch.zeros(n, dtype=torch.int32, device=device)
    return sample(  # (seeds and gen_index unread: the keys are given)
        masked, temperature, off, torch.ones(n, device=device), seeds=keys, gen_index=off,
        min_p=torch.zeros(n, device=device), keys=keys,
    )  # fmt: skip


def _allowed(masks, vocab: int):
    """[n, vocab] bool: bit t % 32 of word t // 32 of each row's mask."""
    import torch

    global _BITS
    if _BITS is None or _BITS.device != masks.device:
        _BITS = torch.arange(32, dtype=torch.int32, device=masks.device)
    return ((masks.unsqueeze(-1) >> _BITS) & 1).view(masks.shape[0], -1)[:, :vocab].bool()
