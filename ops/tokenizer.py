"""Tokenizer, chat template and incremental detokenizer: text <-> token ids.

Owns building a `tokenizers.Tokenizer` from a GGUF file's metadata or from a Hugging Face
directory, rendering the model's Jinja2 chat template, shipping both to another process
(`to_wire` / `from_wire`, plain values for msgpack) and turning a stream of token ids back into
text deltas. The gpu actor builds a `Tokenizer` while loading the model (sent in `ModelLoaded`);
the client rebuilds it from the wire.

Must not import torch (the client process imports this module, and must start fast). `gguf` and
`jinja2` are imported lazily, only by the methods that need them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as _BackendTokenizer
from tokenizers.models import BPE

from taipan.ops.chat_template import ChatTemplateError, cached_chat_template, read_chat_template
from taipan.ops.gguf_reader import gguf_reader

# llama.cpp's token types (`tokenizer.ggml.token_type`).
_CONTROL, _USER_DEFINED = 3, 4
# Architectures whose sentencepiece (`tokenizer.ggml.model` "llama") vocabulary we build as
# transformers builds it for them (`_gemma_bpe`).
_GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")

# Pre-tokenizer regexes named by `tokenizer.ggml.pre`. A name missing here gets GPT-2's regex
# (ByteLevel's built-in one), which is what transformers does for the same file; keeping the same
# table keeps our ids equal to its ids.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(
        ["llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe"], _LLAMA3_SPLIT
    ),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "megrez"], _QWEN2_SPLIT),
}


class TokenizerError(ValueError):
    """A tokenizer that cannot be built or used, with a message naming the file or the cause."""


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level BPE vocabularies are spelled in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


class Tokenizer:
    """Encodes text and chat conversations to ids and decodes ids to text.

    Immutable after construction; safe to share between threads (the backend is Rust).
    """

    def __init__(
        self,
        backend: _BackendTokenizer,
        *,
        chat_template: str | None,
        bos_token_id: int | None,
        eos_token_ids: tuple[int, ...],
        add_bos: bool,
    ) -> None:
        self._tok = backend
        self.chat_template = chat_template
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.add_bos = add_bos

    # ---- construction -----------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """Build from a GGUF file's `tokenizer.*` metadata (byte-level BPE or Gemma's SPM)."""
        try:
            reader = gguf_reader()(str(path))
        except (OSError, ValueError, KeyError) as exc:
            raise TokenizerError(f"cannot read GGUF file {path}: {exc}") from exc
        return cls.from_gguf_reader(reader, path)

    @classmethod
    def from_gguf_reader(cls, reader: Any, path: str | Path = "<gguf>") -> Tokenizer:
        """Build from an open `gguf.GGUFReader` (the model loader reuses its reader)."""

        def field(key: str, default: Any = None) -> Any:
            f = reader.fields.get(key)
            return default if f is None else f.contents()

        model = field("tokenizer.ggml.model")
        arch = field("general.architecture")
        gemma = model == "llama" and arch in _GEMMA_ARCHITECTURES
        if model != "gpt2" and not gemma:
            raise TokenizerError(
                f"{path}: tokenizer model {model!r} ({arch}) is not supported; only byte-level "
                "BPE ('gpt2', as in Llama 3, Qwen2, SmolLM) and Gemma's sentencepiece GGUF "
                "vocabularies are"
            )
        tokens: list[str] = field("tokenizer.ggml.tokens")
        if not tokens:
            raise TokenizerError(f"{path}: no tokenizer.ggml.tokens in the GGUF metadata")
        token_types: list[int] = field("tokenizer.ggml.token_type") or []
        # llama.cpp adds BOS to a sentencepiece vocabulary whose file does not say otherwise.
        add_bos = bool(field("tokenizer.ggml.add_bos_token", gemma))
        bos = field("tokenizer.ggml.bos_token_id")
        eos = field("tokenizer.ggml.eos_token_id")

        if gemma:
            backend = _gemma_bpe(tokens)
        else:
            merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges", [])]
            backend = _byte_level_bpe(tokens, merges, field("tokenizer.ggml.pre"))
        _add_gguf_special_tokens(backend, tokens, token_types, byte_level=not gemma)
        _set_bos_post_processor(backend, bos if add_bos else None, tokens)
        return cls(
            backend,
            chat_template=field("tokenizer.chat_template"),
            bos_token_id=bos,
            eos_token_ids=() if eos is None else (int(eos),),
            add_bos=add_bos and bos is not None,
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Build from a Hugging Face directory: tokenizer.json plus tokenizer_config.json.

        The chat template comes from tokenizer_config.json, or chat_template.jinja /
        chat_template.json next to it (newer transformers save it there). End-of-sequence ids
        are the tokenizer's eos token plus any `eos_token_id` in generation_config.json.
        """
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerError(f"{path}: no tokenizer.json (needed to build the tokenizer)")
        backend = _BackendTokenizer.from_file(str(tokenizer_file))
        config = _read_json(path / "tokenizer_config.json")

        def token_id(name: str) -> int | None:
            token = config.get(name)
            if isinstance(token, dict):  # an AddedToken written out as a dict
                token = token.get("content")
            return None if token is None else backend.token_to_id(token)

        bos = token_id("bos_token")
        eos_ids = [] if token_id("eos_token") is None else [token_id("eos_token")]
        generation_eos = _read_json(path / "generation_config.json").get("eos_token_id")
        for extra in generation_eos if isinstance(generation_eos, list) else [generation_eos]:
            if isinstance(extra, int) and extra not in eos_ids:
                eos_ids.append(extra)

        adds_bos = bos is not None and backend.encode("").ids[:1] == [bos]
        if config.get("add_bos_token") and bos is not None and not adds_bos:
            _set_bos_post_processor(backend, bos, None)
            adds_bos = True
        try:
            chat_template = read_chat_template(path, config)
        except ChatTemplateError as exc:
            raise TokenizerError(str(exc)) from exc
        return cls(
            backend,
            chat_template=chat_template,
            bos_token_id=bos,
            eos_token_ids=tuple(eos_ids),
            add_bos=adds_bos,
        )

    def to_wire(self) -> dict:
        """Plain str/int/bool/list values that `from_wire` rebuilds this tokenizer from."""
        return {
            "tokenizer_json": self._tok.to_str(),
            "chat_template": self.chat_template,
            "bos_token_id": self.bos_token_id,
            "eos_token_ids": list(self.eos_token_ids),
            "add_bos": self.add_bos,
        }

    @classmethod
    def from_wire(cls, d: dict) -> Tokenizer:
        return cls(
            _BackendTokenizer.from_str(d["tokenizer_json"]),
            chat_template=d.get("chat_template"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=tuple(d.get("eos_token_ids") or ()),
            add_bos=bool(d.get("add_bos", False)),
        )

    def save_json(self, path: str | Path) -> None:
        """Write the backend as a `tokenizer.json` (special tokens and pre-tokenizer included)."""
        self._tok.save(str(path))

    # ---- encoding and decoding ----------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Ids for raw text. Special tokens written in the text (`<|im_start|>`) stay whole;
        BOS is prepended only when the model's tokenizer asks for it (`add_bos`)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    # ---- chat template --------------------------------------------------------------------------

    def render_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        *,
        template: str | None = None,
        **extra: Any,
    ) -> str:
        """The prompt text the chat template (the model's, or `template`'s source) makes of
        `messages` (variables as transformers passes them: messages, add_generation_prompt,
        bos_token, eos_token, plus `extra`).

        A template that rejects the conversation (`raise_exception(...)`, e.g. "roles must
        alternate") or does not parse raises `TokenizerError` with the template's message.
        """
        import jinja2

        source = template or self.chat_template
        if not source:
            raise TokenizerError("this model has no chat template; send a plain-text prompt")
        try:
            compiled = cached_chat_template(source)
        except ChatTemplateError as exc:
            raise TokenizerError(str(exc)) from exc
        special = {"bos_token": self._token_str(self.bos_token_id)}
        special["eos_token"] = self._token_str(
            self.eos_token_ids[0] if self.eos_token_ids else None
        )
        variables = {"tools": None, "documents": None, **special, **extra}
        try:
            return compiled.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **variables
            )
        except jinja2.exceptions.TemplateError as exc:
            raise TokenizerError(f"chat template error: {exc}") from exc

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        *,
        template: str | None = None,
        **extra: Any,
    ) -> list[int]:
        """Ids of the rendered chat prompt. The template writes its own special tokens, so none
        are added (as transformers' `apply_chat_template(tokenize=True)`)."""
        text = self.render_chat_template(
            messages, add_generation_prompt, template=template, **extra
        )
        return self.encode(text, add_special_tokens=False)

    def _token_str(self, token_id: int | None) -> str:
        token = None if token_id is None else self._tok.id_to_token(token_id)
        return token or ""


class IncrementalDetokenizer:
    """Turns ids arriving a few at a time into text deltas whose concatenation is the full decode.

    vLLM's scheme: decode a small window twice, from `prefix_offset` to `read_offset` (text
    already emitted) and to the end; emit the difference. Text ending in U+FFFD is held back: it
    is a multi-byte UTF-8 character whose remaining bytes are still to come. The window (rather
    than single tokens) keeps tokenizers that strip a leading space at decode time correct.
    `prompt_ids` seed the window so the first generated token is decoded in context.
    """

    _PROMPT_CONTEXT = 5  # prompt tokens kept as left context, as vLLM does

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids)[-self._PROMPT_CONTEXT :]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""  # everything emitted so far

    def feed(self, new_ids: list[int]) -> str:
        """Append ids; return the newly completed text (possibly "")."""
        self._ids.extend(new_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end of the stream: emit held-back text, replacement characters included."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset], self._skip)
        new_text = decode(self._ids[self._prefix_offset :], self._skip)
        if not final and (len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd")):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self.text += delta
        return delta


# ---- helpers ----------------------------------------------------------------------------------


def _byte_level_bpe(tokens: list[str], merges: list[tuple], pre: str | None) -> _BackendTokenizer:
    """A GPT-2 style byte-level BPE over the GGUF vocabulary.

    llama.cpp stores some tokens in plain UTF-8 rather than in the byte alphabet; those are
    re-spelled byte by byte (a later duplicate wins, as in transformers' GGUF converter).
    """
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {
        tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode("utf-8")): i
        for i, tok in enumerate(tokens)
    }
    backend = _BackendTokenizer(
        BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    split = _PRE_TOKENIZER_SPLITS.get(pre)
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    return backend


def _gemma_bpe(tokens: list[str]) -> _BackendTokenizer:
    """Gemma's sentencepiece vocabulary as transformers builds it from a GGUF file (its
    `gemma_tokenizer` and `GemmaTokenizer`): a BPE with byte fallback over the tokens as the file
    spells them, except that a token of two or more spaces is looked up as that many "▁".
    The file holds no merges: they are rebuilt from the vocabulary, best first in the order the
    tokens appear (Gemma's scores do not follow its merge order)."""
    respelled = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {tok: i for i, tok in enumerate(respelled)}  # (a later duplicate wins)
    backend = _BackendTokenizer(
        BPE(
            vocab=vocab,
            merges=_merges_in_vocabulary_order(vocab),
            fuse_unk=True,
            unk_token="<unk>",
            dropout=None,
            byte_fallback=True,
        )
    )
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return backend


def _merges_in_vocabulary_order(vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens of the vocabulary, as a merge; ordered by the
    merged token's id, then the longer left piece (transformers' `generate_merges` with the
    negated ids as scores: one token's splits differ in their left piece's length)."""
    merges = [
        (token_id, -i, token[:i], token[i:])
        for token, token_id in vocab.items()
        for i in range(1, len(token))
        if token[:i] in vocab and token[i:] in vocab
    ]
    merges.sort(key=lambda m: m[:2])
    return [(left, right) for _, _, left, right in merges]


def _add_gguf_special_tokens(
    backend: _BackendTokenizer, tokens: list[str], types: list[int], byte_level: bool = True
):
    """CONTROL tokens become special (matched whole, skipped on decode); USER_DEFINED ones become
    plain added tokens (matched whole, kept on decode). In a byte-level vocabulary, a CONTROL
    token spelled outside the byte alphabet is a llama.cpp mislabel and is skipped, as
    transformers does."""
    alphabet = set(bytes_to_unicode().values())
    control = [
        AddedToken(tok, normalized=False, special=True)
        for tok, kind in zip(tokens, types, strict=False)
        if kind == _CONTROL and (not byte_level or set(tok) <= alphabet)
    ]
    if control:
        backend.add_special_tokens(control)
    vocab = backend.get_vocab()
    user = [
        AddedToken(tok, normalized=False, special=False)
        for tok, kind in zip(tokens, types, strict=False)
        if kind == _USER_DEFINED and tok in vocab
    ]
    if user:
        backend.add_tokens(user)


def _set_bos_post_processor(backend: _BackendTokenizer, bos: int | None, tokens: list[str] | None):
    """`encode(add_special_tokens=True)` prepends BOS iff `bos` is given."""
    if bos is None:
        backend.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B:1")
        return
    bos_token = tokens[bos] if tokens is not None else backend.id_to_token(bos)
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos_token} $A",
        pair=f"{bos_token} $A {bos_token}:1 $B:1",
        special_tokens=[(bos_token, bos)],
    )


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"cannot parse {path}: {exc}") from exc
