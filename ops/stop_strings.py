"""Stop strings: where a request's output text first contains one of its stop strings.

The engine matches token ids only (`stop_token_ids`, `stop_word_ids`). A stop string is found in
the detokenized text, where it may span tokens or sit inside one (a ".\\n\\n" token holds the
stop "\\n\\n"), so the client matches it (runtime/client.py) and aborts the request in the engine.
`StopMatcher` works on text alone; `StoppingDetokenizer` feeds it from token ids and says which
of them the output keeps. Pure Python: no torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

from taipan.ops.tokenizer import IncrementalDetokenizer, Tokenizer


class StopMatcher:
    """Text arriving in pieces in; the text to show out, up to the first stop string.

    The first stop string is the one the text completes first (of two completed by the same
    character, the longer), so the result depends only on the whole text, not on how it was cut
    into pieces. `feed` returns the new text that can no longer turn out to be part of a stop
    string: it holds back the longest suffix that begins some stop string (nothing with
    `include_stop`, where a completed stop string is shown anyway). On a match `matched` is set
    and the text ends just before the stop string, or just after it with `include_stop`; later
    text is dropped. What `feed` and `flush` return, concatenated, is the whole output text.
    """

    def __init__(self, stops: Sequence[str], include_stop: bool = False) -> None:
        if not stops or not all(isinstance(s, str) and s for s in stops):
            raise ValueError(f"stop strings must be non-empty strings, got {list(stops)!r}")
        self.stops = tuple(dict.fromkeys(stops))
        self.include_stop = include_stop
        self.matched: str | None = None
        self._lookback = max(map(len, self.stops)) - 1  # where a stop completed later may start
        # The last characters received: the ones not returned yet (the last `_pending`) and, for
        # a stop that may start among them, up to `_lookback` before those.
        self._window = ""
        self._pending = 0

    def feed(self, text: str, match: bool = True) -> str:
        """Add received text; return the text now safe to show (possibly ""). `match` False:
        no stop string completed by this text counts (min_tokens not reached), though one
        begun in it may complete later."""
        if self.matched is not None:
            return ""
        before = len(self._window)
        start = before - self._pending  # the first character not returned yet
        self._window += text
        hit = self._first_stop(before) if match else None
        if hit is not None:
            at, self.matched = hit
            end = at + len(self.matched) if self.include_stop else at
            out, self._window, self._pending = self._window[start:end], "", 0
            return out
        self._pending = 0 if self.include_stop else self._partial_stop_len()
        out = self._window[start : len(self._window) - self._pending]
        self._window = self._window[max(0, len(self._window) - self._lookback) :]
        return out

    def flush(self) -> str:
        """At the end of the output: the held-back text (it did not become a stop string)."""
        out = self._window[len(self._window) - self._pending :] if self._pending else ""
        self._window, self._pending = "", 0
        return out

    def _first_stop(self, before: int) -> tuple[int, str] | None:
        """(index, stop string) of the first stop the window completes after index `before`
        (none is complete within the first `before` characters)."""
        best = None
        for stop in self.stops:
            at = self._window.find(stop, max(0, before - len(stop) + 1))
            if at >= 0 and (
                best is None or (at + len(stop), at) < (best[0] + len(best[1]), best[0])
            ):
                best = (at, stop)
        return best

    def _partial_stop_len(self) -> int:
        """The length of the longest suffix of the window that is a proper prefix of a stop."""
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(self._window)), best, -1):
                if self._window.endswith(stop[:k]):
                    best = k
                    break
        return best


class StoppingDetokenizer:
    """Generated ids in, output text out, ending at the first of `stops` (none: never).

    With stop strings the ids are detokenized one at a time, so that the one that completed the
    stop string is known: `feed` returns the new text and how many of the new ids the output
    keeps (all, or those up to and including that one; none once stopped). `stop_reason` is
    the stop string matched, or None. Before `min_tokens` ids no stop string counts (as
    vLLM's: the request's min_tokens).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        stops: Sequence[str] = (),
        include_stop: bool = False,
        min_tokens: int = 0,
        skip_special_tokens: bool = True,
    ) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
        self._matcher = StopMatcher(stops, include_stop) if stops else None
        self._min_tokens = min_tokens
        self._fed = 0  # ids fed so far

    @property
    def stop_reason(self) -> str | None:
        return None if self._matcher is None else self._matcher.matched

    def feed(self, ids: Sequence[int]) -> tuple[str, int]:
        """Append generated ids; return (new text, how many of `ids` the output keeps)."""
        matcher = self._matcher
        if matcher is None:
            return self._detok.feed(list(ids)), len(ids)
        if matcher.matched is not None:
            return "", 0
        texts = []
        for i, token_id in enumerate(ids):
            self._fed += 1
            text = self._detok.feed([token_id])
            texts.append(matcher.feed(text, match=self._fed >= self._min_tokens))
            if matcher.matched is not None:
                return "".join(texts), i + 1
        return "".join(texts), len(ids)

    def flush(self) -> str:
        """At the end of the output: the text still held back (which may complete a stop)."""
        text = self._detok.flush()
        if self._matcher is None:
            return text
        return self._matcher.feed(text) + self._matcher.flush()
