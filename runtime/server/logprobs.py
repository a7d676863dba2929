"""Tokens as the OpenAI API shows them, and the log-prob fields built from them.

A token's text is its exact bytes: the tokenizer's byte-level piece (GPT-2's byte alphabet, or
a sentencepiece `<0xE2>` byte token) read back into bytes. A token that is a whole UTF-8 text
shows as that text; one that holds part of a multi-byte character shows as vLLM and OpenAI
show it, "bytes:\\xe2\\x80" (`token_text`), and `bytes` is always the exact bytes. Character
offsets count the characters complete before a token (`Offsets`), so they index the decoded
text whatever the tokens split.

Pure functions over a Tokenizer: no client, no event loop. The endpoints decide which tokens to
show; this module only formats them.
"""

from __future__ import annotations

import codecs
import functools
import re

from taipan.ops.tokenizer import Tokenizer, bytes_to_unicode
from taipan.server.schemas import json_log_prob

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


class TokenTexts:
    """Each token's exact bytes and its text as the API shows it, cached per token id (one
    per tokenizer: a server holds one)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._bytes: dict[int, bytes] = {}

    def bytes_of(self, token_id: int) -> bytes:
        raw = self._bytes.get(token_id)
        if raw is None:
            raw = self._bytes[token_id] = token_bytes(self.tokenizer, token_id)
        return raw

    def text(self, token_id: int) -> str:
        return token_text(self.bytes_of(token_id))

    def shown_bytes(self, token_id: int) -> bytes:
        """The bytes a chat log-prob entry shows (its `bytes`)."""
        return self.bytes_of(token_id)


class TokenIdTexts(TokenTexts):
    """vLLM's `return_tokens_as_token_ids`: each token shown as "token_id:N" (a chat entry's
    `bytes` those of that string), so that a client never has to map text back to ids; text
    offsets still count each token's own text."""

    def text(self, token_id: int) -> str:
        return f"token_id:{token_id}"

    def shown_bytes(self, token_id: int) -> bytes:
        return self.text(token_id).encode()


def token_bytes(tok: Tokenizer, token_id: int) -> bytes:
    """The bytes token `token_id` stands for. Its plain decode where that is whole UTF-8;
    else its vocabulary piece read back through the byte-level alphabet (or a sentencepiece
    byte token's value)."""
    decoded = tok.decode([token_id], skip_special_tokens=False)
    if "\ufffd" not in decoded:
        return decoded.encode()
    piece = tok.id_to_token(token_id) or ""
    byte = _BYTE_TOKEN.fullmatch(piece)
    if byte:
        return bytes([int(byte.group(1), 16)])
    table = _unicode_to_byte()
    if piece and all(c in table for c in piece):
        raw = bytes(table[c] for c in piece)
        if raw.decode("utf-8", "replace") == decoded:  # the piece is the token's bytes
            return raw
    return decoded.encode()


def token_text(raw: bytes) -> str:
    """A token's text: its UTF-8 text, or "bytes:\\xe2\\x80" for bytes that are not whole
    UTF-8 (part of a multi-byte character), as vLLM and OpenAI write them."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class Offsets:
    """Character offsets of tokens into their decoded text: a token's offset is the count of
    characters complete before it (a token inside a multi-byte character points at that
    character). `next(raw)` gives the offset of the token with bytes `raw`, then counts it."""

    def __init__(self, start: int = 0) -> None:
        self.chars = start
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def next(self, raw: bytes) -> int:
        offset = self.chars
        self.chars += len(self._decoder.decode(raw))
        return offset


def completion_logprobs(
    texts: TokenTexts,
    token_ids: list[int],
    log_probs: list[float | None],
    tops: list[dict[int, float] | None],
    offsets: Offsets,
    top_n: int,
) -> dict:
    """OpenAI's completion `logprobs` of tokens: `tokens`, `token_logprobs`, `top_logprobs`
    and `text_offset`. A top entry is None where the token has no log-prob (a prompt's first),
    else the token itself with its `top_n` best candidates (vLLM's: up to N + 1, so 0 gives
    the token alone)."""
    strs, offs, top_out = [], [], []
    log_probs, tops = _fit(log_probs, len(token_ids)), _fit(tops, len(token_ids))
    for t, lp, top in zip(token_ids, log_probs, tops, strict=True):
        strs.append(texts.text(t))
        offs.append(offsets.next(texts.bytes_of(t)))
        if lp is None:
            top_out.append(None)
            continue
        entry = {texts.text(t): json_log_prob(lp)}
        for i, v in sorted((top or {}).items(), key=lambda kv: -kv[1])[:top_n]:
            entry.setdefault(texts.text(i), json_log_prob(v))
        top_out.append(entry)
    return {
        "tokens": strs,
        "token_logprobs": [json_log_prob(lp) for lp in log_probs],
        "top_logprobs": top_out,
        "text_offset": offs,
    }


def prompt_logprobs(
    texts: TokenTexts,
    token_ids: list[int],
    log_probs: list[float] | None,
    tops: list[dict[int, float]] | None,
    top_n: int,
) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token (None for the first) {token id: {"logprob",
    "rank", "decoded_token"}} of the token and its `top_n` best candidates. A rank is the
    place among the engine's candidates; None for a prompt token not among them."""
    out: list[dict | None] = [None]
    rest = token_ids[1:]
    for t, lp, top in zip(rest, _fit(log_probs or [], len(rest)), _fit(tops or [], len(rest)),
                          strict=True):  # fmt: skip
        ranked = sorted((top or {}).items(), key=lambda kv: -kv[1])
        rank = {i: r + 1 for r, (i, _) in enumerate(ranked)}
        entry = {str(t): _vllm_logprob(texts, t, lp, rank.get(t))}
        for i, v in ranked[:top_n]:
            entry.setdefault(str(i), _vllm_logprob(texts, i, v, rank[i]))
        out.append(entry)
    return out


def _vllm_logprob(texts: TokenTexts, t: int, lp: float | None, rank: int | None) -> dict:
    return {"logprob": json_log_prob(lp), "rank": rank, "decoded_token": texts.text(t)}


def chat_entry(texts: TokenTexts, token_id: int, lp: float | None) -> dict:
    return {
        "token": texts.text(token_id),
        "logprob": json_log_prob(lp),
        "bytes": list(texts.shown_bytes(token_id)),
    }


def chat_logprobs(
    texts: TokenTexts,
    token_ids: list[int],
    log_probs: list[float],
    tops: list[dict[int, float]] | None,
    top_n: int,
) -> list[dict]:
    """OpenAI's chat `logprobs.content`: per token its text, log-prob, bytes and its `top_n`
    candidates ([] for 0)."""
    out = []
    log_probs, tops = _fit(log_probs or [], len(token_ids)), _fit(tops or [], len(token_ids))
    for t, lp, top in zip(token_ids, log_probs, tops, strict=True):
        entry = chat_entry(texts, t, lp)
        ranked = sorted((top or {}).items(), key=lambda kv: -kv[1])[:top_n]
        entry["top_logprobs"] = [chat_entry(texts, i, v) for i, v in ranked]
        out.append(entry)
    return out


def _fit(values: list, n: int) -> list:
    """`values` cut or padded with None to n (a list the engine sent short: no log-prob)."""
    return list(values[:n]) + [None] * (n - len(values))
