"""Requests family (tags 20-39): submitting, streaming, aborting; model info for clients.

Ids: a client numbers its own requests (`SubmitRequest.request_id`, unique per client
connection); the coordinator maps (client, id) to a global id that engines see. Every accepted
request ends with exactly one `RequestOutput` whose `finished` is true.

Outputs travel engine -> coordinator in one `StepOutputs` per step, each RequestOutput already
encoded; the coordinator relays each to its client as that client's RequestOutput, changing only
the id and decoding nothing else.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import itertools
import math
import struct as _struct
from collections.abc import Sequence

import numpy as np

from taipan.messages.codec import (
    Array,
    MessageError,
    decode,
    encode_frame,
    list_head,
    message,
    pack_ints,
    pack_value,
    replace_first_field,
    share_empty,
    struct,
    wire_values,
)
from taipan.messages.errors import ErrorCode

MAX_TOP_N = 20


class FinishReason(enum.StrEnum):
    """How a request ended: "stop" (EOS, a stop token or word), "length" (max_tokens or
    max_sequence_length), "abort" (the client or a shutdown ended it), "error" (see `error`)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class EventType(enum.StrEnum):
    """The lifecycle events of a request (Megatron's DynamicInferenceEventType)."""

    ADD_ENGINE = "ADD_ENGINE"
    ADD_CONTEXT = "ADD_CONTEXT"
    GENERATED_TOKEN = "GENERATED_TOKEN"
    PAUSE = "PAUSE"
    EVICT = "EVICT"
    FINISH = "FINISH"
    FAIL = "FAIL"
    ERROR_TRANSIENT = "ERROR_TRANSIENT"
    ERROR_NONTRANSIENT = "ERROR_NONTRANSIENT"


class LogprobsMode(enum.StrEnum):
    """Which distribution returned log-probs are of (SamplingParams.logprobs_mode), as vLLM's
    raw_logprobs / processed_logprobs: "raw", log-softmax of the model's fp32 logits; or
    "processed", the distribution the token was drawn from: the logits after the controls
    (SamplingParams: logit_bias, min_tokens, bad words, penalties) / temperature, with the
    tokens min-p, top-k and top-p drop at -inf (kernels/sampling.py's order), log-softmaxed.
    A greedy request's processed log-probs are of its logits after the controls alone."""

    RAW = "raw"
    PROCESSED = "processed"

    @classmethod
    def _missing_(cls, value):
        choices = " or ".join(repr(m.value) for m in cls)
        raise ValueError(f"logprobs_mode must be {choices}, got {value!r}")


_EMPTIES: dict[tuple[np.dtype, int], np.ndarray] = {}


def _shared_empty(dtype, ndim: int) -> np.ndarray:
    key = (np.dtype(dtype), ndim)
    arr = _EMPTIES.get(key)
    if arr is None:
        arr = _EMPTIES[key] = np.zeros((0,) * ndim, dtype=dtype)
        arr.flags.writeable = False  # (shared by every message that leaves the field out)
        share_empty(arr)
    return arr


def empty_array_field(dtype, ndim: int = 1):
    """A default for an optional array field: empty, of the right dtype and rank (one read-only
    array per dtype and rank, shared: a step's outputs leave about ten such fields out per
    request; found once here, not per message, and encoded from a cached wire form)."""
    return dataclasses.field(default_factory=itertools.repeat(_shared_empty(dtype, ndim)).__next__)


# Structured outputs' grammar kinds (ops/grammar.py compiles them).
STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@struct
class StructuredOutput:
    """A grammar every generated token must keep to (SamplingParams.structured): `kind` one of
    STRUCTURED_KINDS and `spec` the schema as JSON text (json_schema), "" (json_object: any JSON
    object), the pattern (regex), a JSON list of strings (choice), or a Lark / GBNF grammar
    (grammar). Once the grammar is complete only EOS may follow."""

    kind: str
    spec: str = ""


@struct
class RequestEvent:
    """One lifecycle event of a request; `timestamp` is the engine's clock (seconds, from the
    inbound message that caused it); `payload` e.g. a token id."""

    type: EventType
    timestamp: float
    payload: int | None


@struct(required=16)  # (logprobs_mode, return_routed_experts and the controls came later)
class SamplingParams:
    """How to sample one request. `max_tokens` counts generated tokens (OpenAI's meaning).

    temperature 0 is greedy; top_k 0, top_p 1.0 and min_p 0 are off (min_p drops a token whose
    probability is below min_p times the most likely one's, as vLLM's; kernels/sampling.py has
    the exact order of the filters); seed None draws from fresh entropy (the engine picks one),
    a given seed makes the draws reproducible whatever the batch holds.

    Stopping: EOS (unless `ignore_eos`), any of `stop_token_ids`, a stop word: a token sequence
    in `stop_word_ids` completed by the generated tokens (it may span any number of steps), or a
    stop string of `stop` (a str or a sequence of str) in the output text. The engine matches
    ids only; stop strings are matched by the client (runtime/client.py) on the detokenized
    text, where one may span tokens or sit inside one, and the client then aborts the request
    in the engine. `include_stop_word` keeps the stop word's tokens, or the stop string, in the
    output (default: dropped; the token that completed a stop string is always kept).
    Log-probs: `return_log_probs` returns one per generated token and, unless
    `skip_prompt_log_probs`, one per prompt token after the first; `top_n_logprobs` > 0 adds
    the top-n (id, log-prob) pairs per generated token (and per prompt token with
    `return_prompt_top_n_logprobs`). A generated token's log-prob and top-n are of the
    distribution `logprobs_mode` (LogprobsMode) names: "raw" (default), log-softmax of the
    model's logits, or "processed", the one the token was drawn from (after temperature,
    min-p, top-k and top-p; dropped tokens -inf). Prompt log-probs are always raw, as vLLM's:
    no prompt token was sampled. `streaming_interval`: a streaming request gets a delta every
    that many generated tokens (and always at the end).
    `return_routed_experts` (mixture-of-experts models only; refused at submission for others):
    the terminal output carries the top-k expert ids every MoE layer chose for each token run
    through the model (RequestOutput.routed_experts), for a trainer to replay the routing.

    Controls on the logits before sampling (vLLM's; the processed log-probs see them, the raw
    ones do not), in this order: `allowed_token_ids` (None: any token; never empty) lets only
    those tokens be sampled (every other's logit -inf); `logit_bias` adds a bias in [-100, 100]
    to a token's logit (token id -> bias: int keys, or their decimal strings as in OpenAI's
    JSON; the wire form is the strings, see `for_wire`); until `min_tokens` tokens are
    generated, EOS (unless `ignore_eos`) and `stop_token_ids` cannot be sampled and no stop word
    ends the request; `bad_words_ids` (token sequences) forbid a word's last token where the
    generated tokens end with the rest of it (a one-token word always); then
    `repetition_penalty` (> 0, 1 = off) divides a positive logit of a token in the prompt or the
    output and multiplies a negative one; `frequency_penalty` and `presence_penalty` (in [-2,
    2], 0 = off) subtract frequency * count + presence * (count > 0), count = the token's
    occurrences in the output.
    `structured` (StructuredOutput): a grammar the output keeps to, enforced while sampling by
    masking every token it does not allow (after the controls above); the engine refuses a
    grammar that does not compile, naming why.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # or one str: see stop_strings()
    stop_word_ids: tuple[tuple[int, ...], ...] = ()
    include_stop_word: bool = False
    return_log_probs: bool = False
    skip_prompt_log_probs: bool = False
    top_n_logprobs: int = 0
    return_prompt_top_n_logprobs: bool = False
    streaming_interval: int = 1
    logprobs_mode: LogprobsMode = LogprobsMode.RAW
    return_routed_experts: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None  # (int keys too: see above)
    min_tokens: int = 0
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    structured: StructuredOutput | None = None
    # Speculative decoding (InferenceConfig.num_speculative_tokens > 0): False opts this request
    # out (it decodes one token per step). Requests with a grammar never speculate (v1;
    # actors/engine/speculation.py); logit controls, log-probs (raw or processed), top-n and
    # routed experts do.
    speculative: bool = True
    # The output text leaves out special tokens (EOS, <|im_end|>, ...), as vLLM's default;
    # False keeps their text. Only the client's detokenizer reads it: token ids are the same.
    skip_special_tokens: bool = True
    allowed_token_ids: tuple[int, ...] | None = None  # (the controls, above)

    def problems(self) -> list[str]:
        """What is wrong with these parameters, as sentences a user can act on."""
        out = []
        if self.max_tokens < 1:
            out.append(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not self.temperature >= 0:
            out.append(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            out.append(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            out.append(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            out.append(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            out.append(f"seed must be in [0, 2**63), got {self.seed}")
        if any(t < 0 for t in self.stop_token_ids):
            out.append("stop_token_ids must be non-negative")
        try:
            self.stop_strings()
        except ValueError as e:
            out.append(str(e))
        if any(not w or min(w) < 0 for w in self.stop_word_ids):
            out.append("each of stop_word_ids must be a non-empty list of non-negative ids")
        if not 0 <= self.top_n_logprobs <= MAX_TOP_N:
            out.append(f"top_n_logprobs must be in [0, {MAX_TOP_N}], got {self.top_n_logprobs}")
        if self.return_prompt_top_n_logprobs and not (
            self.return_log_probs and self.top_n_logprobs and not self.skip_prompt_log_probs
        ):
            out.append(
                "return_prompt_top_n_logprobs needs return_log_probs, top_n_logprobs > 0 and "
                "skip_prompt_log_probs false"
            )
        if self.streaming_interval < 1:
            out.append(f"streaming_interval must be >= 1, got {self.streaming_interval}")
        if self.structured is not None and self.structured.kind not in STRUCTURED_KINDS:
            out.append(
                f"structured.kind must be one of {', '.join(STRUCTURED_KINDS)}, got "
                f"{self.structured.kind!r}"
            )
        return out + self._control_problems()

    def _control_problems(self) -> list[str]:
        out = []
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2 <= value <= 2:
                out.append(f"{name} must be in [-2, 2], got {value}")
        if not 0 < self.repetition_penalty < math.inf:
            out.append(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        try:
            self.logit_bias_ids()
        except ValueError as e:
            out.append(str(e))
        if self.min_tokens < 0:
            out.append(f"min_tokens must be >= 0, got {self.min_tokens}")
        elif self.min_tokens > self.max_tokens:
            out.append(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if any(not w or min(w) < 0 for w in self.bad_words_ids):
            out.append("each of bad_words_ids must be a non-empty list of non-negative ids")
        allowed = self.allowed_token_ids
        ids = allowed is None or all(type(t) is int or isinstance(t, np.integer) for t in allowed)
        if allowed is not None and (not allowed or not ids or min(allowed) < 0):
            out.append(
                "allowed_token_ids must be a non-empty list of non-negative ids (None: any token)"
            )
        return out

    def logit_bias_ids(self) -> dict[int, float]:
        """`logit_bias` keyed by int token id; ValueError naming the key if a key is not a
        non-negative token id (an int or its decimal string), two keys name one id, or a bias
        is not a number in [-100, 100]."""
        out: dict[int, float] = {}
        if not isinstance(self.logit_bias, dict | None):
            raise ValueError(f"logit_bias must map token ids to biases, got {self.logit_bias!r}")
        items = (self.logit_bias or {}).items()
        bad = [key for key, _ in items if _token_id(key) is None]
        if bad:  # (every bad key named at once, as vLLM does)
            got = ", ".join(repr(k) for k in bad[:8]) + (", ..." if len(bad) > 8 else "")
            raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {got}")
        for key, bias in items:
            token = _token_id(key)
            if token in out:
                raise ValueError(f"logit_bias names token {token} twice")
            number = isinstance(bias, int | float) and not isinstance(bias, bool)
            if not number or not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias!r}")
            out[token] = float(bias)
        return out

    def token_id_problems(self, vocab_size: int) -> list[str]:
        """The ids of `logit_bias`, `stop_token_ids`, `bad_words_ids` and `allowed_token_ids`
        outside the vocabulary (what only who knows the model can check: the engine, the HTTP
        server by its tokenizer), as sentences, each starting with its field's name."""
        try:
            bias = [t for t in self.logit_bias_ids() if t >= vocab_size]
        except ValueError as e:  # (problems() says it too: the coordinator refuses it first)
            return [str(e)]
        out = []
        if bias:
            ids = sorted(bias)[:8]
            out.append(f"logit_bias token ids {ids} are outside the vocabulary (size {vocab_size})")
        stops = sorted({t for t in self.stop_token_ids if t >= vocab_size})
        if stops:
            out.append(f"stop_token_ids {stops[:8]} are outside the vocabulary (size {vocab_size})")
        if any(max(w) >= vocab_size for w in self.bad_words_ids):
            out.append(f"bad_words_ids hold token ids outside the vocabulary (size {vocab_size})")
        outside = sorted({t for t in self.allowed_token_ids or () if t >= vocab_size})
        if outside:
            out.append(
                f"allowed_token_ids {outside[:8]} are outside the vocabulary (size {vocab_size})"
            )
        return out

    @property
    def has_controls(self) -> bool:
        """Whether any logit control is on (allowed tokens, penalties, logit_bias, min_tokens,
        bad words)."""
        return bool(
            self.allowed_token_ids is not None
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
            or self.bad_words_ids
        )

    def for_wire(self) -> SamplingParams:
        """These parameters as they travel: `stop` a tuple, `logit_bias` keyed by decimal
        strings (msgpack maps take string keys only), its biases floats. ValueError as
        `stop_strings` and `logit_bias_ids`."""
        bias = self.logit_bias
        if bias is not None:
            bias = {str(k): v for k, v in self.logit_bias_ids().items()}
        return dataclasses.replace(self, stop=self.stop_strings(), logit_bias=bias)

    def stop_strings(self) -> tuple[str, ...]:
        """`stop` as a tuple (a bare string is one stop string); ValueError if it is not a
        string or a sequence of non-empty strings (an empty one would match everywhere)."""
        stop = self.stop
        stops = (stop,) if isinstance(stop, str) else stop
        if not isinstance(stops, Sequence) or not all(isinstance(s, str) for s in stops):
            raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
        if not all(stops):
            raise ValueError(f"stop strings must be non-empty, got {stop!r}")
        return tuple(stops)


def _token_id(key) -> int | None:
    """A logit_bias key as a token id (an int, or its decimal string), None if it is neither."""
    if isinstance(key, int) and not isinstance(key, bool):
        return key if key >= 0 else None
    if isinstance(key, str) and key.isascii() and key.isdigit():
        return int(key)
    return None


@message(20)
class SubmitRequest:
    """Client -> coordinator. `prompt_token_ids` is a 1-D int32 array. `block_hashes`: the
    prompt's block hashes (messages/block_hash.py) with salt `hash_salt`, the weight version the
    client last saw (ModelInfo, ControlAck); empty when the client did not compute them. The
    coordinator routes by them and recomputes them when the salt is not the current version;
    the engine checks them against the tokens before it caches anything under them."""

    request_id: int
    prompt_token_ids: Array[np.int32, 1]
    sampling: SamplingParams
    stream: bool
    block_hashes: Array[np.int64, 1] = empty_array_field(np.int64)
    hash_salt: int = 0

    def problems(self) -> list[str]:
        """Why no engine may take this request (the coordinator's check, and the direct
        client's in its place), as sentences a user can act on."""
        out = self.sampling.problems()
        if self.prompt_token_ids.size == 0:
            out.append("the prompt is empty")
        return out


@message(21)
class EngineSubmit:
    """Coordinator -> engine: a request under its global id."""

    request_id: int
    prompt_token_ids: Array[np.int32, 1]
    sampling: SamplingParams
    stream: bool
    arrival_time: float
    block_hashes: Array[np.int64, 1] = empty_array_field(np.int64)
    hash_salt: int = 0


@message(22, required=7)  # (the rest: left off by the sender while at their defaults)
class RequestOutput:
    """Engine -> coordinator -> client: new tokens of one request, and whether it ended.

    Streaming requests get a delta every `streaming_interval` tokens; others get one output
    with every generated token. The terminal output (`finished`) carries `finish_reason` in
    FinishReason and, for "error", the `error` text, and the request's `events`, `ttft`
    (first token time - arrival, seconds) and `tpot` (mean time per later token).

    Log-probs travel with the tokens they belong to: `log_probs` float32[new], `top_n_ids`
    int32[new, n] and `top_n_log_probs` float32[new, n] (empty when not asked). Prompt log-probs
    (float32[P-1], and [P-1, n] top-n) travel once, in the terminal output, as do the RL
    staleness counters (int32 per token of prompt + generated; actors/engine/history.py):
    `num_cached_tokens` (every output): prompt tokens whose K/V came from the prefix cache.
    `policy_staleness` (weight updates since the token was produced) and `kv_cache_staleness`
    (weight updates since its K/V were computed).
    `weight_versions` int64[S, 2]: the weight version of each of this output's tokens as spans
    (version, first token index), the index counted over all the request's generated tokens
    (the first span starts at this output's first token; a new span starts where the version
    changes); empty when the output has no tokens.
    `routed_experts` int16 (int32 past 32767 experts) [N, moe_layers, top_k], terminal output
    only, with SamplingParams.return_routed_experts: the expert ids each MoE layer chose for
    positions 0..N-1 of prompt + generated, N = tokens - 1 (the last generated token is never
    run through the model, as SGLang's and vLLM's); fewer for a request that ended before
    computing them (abort, error). Each is the routing of the forward that first computed the
    position (or of the one that computed a cached prefix block it reused): a recompute after
    preemption never replaces it. Empty when not asked.
    """

    request_id: int
    new_token_ids: Array[np.int32, 1]
    finished: bool
    finish_reason: FinishReason | None
    error: str | None
    num_prompt_tokens: int
    num_generated_tokens: int
    num_cached_tokens: int = 0
    log_probs: Array[np.float32, 1] = empty_array_field(np.float32)
    top_n_ids: Array[np.int32, 2] = empty_array_field(np.int32, 2)
    top_n_log_probs: Array[np.float32, 2] = empty_array_field(np.float32, 2)
    prompt_log_probs: Array[np.float32, 1] = empty_array_field(np.float32)
    prompt_top_n_ids: Array[np.int32, 2] = empty_array_field(np.int32, 2)
    prompt_top_n_log_probs: Array[np.float32, 2] = empty_array_field(np.float32, 2)
    events: tuple[RequestEvent, ...] = ()
    ttft: float | None = None
    tpot: float | None = None
    policy_staleness: Array[np.int32, 1] = empty_array_field(np.int32)
    kv_cache_staleness: Array[np.int32, 1] = empty_array_field(np.int32)
    weight_versions: Array[np.int64, 2] = empty_array_field(np.int64, 2)
    routed_experts: Array[(np.int16, np.int32), 3] = empty_array_field(np.int16, 3)


@message(23)
class AbortRequest:
    request_id: int


@message(24)
class GetModelInfo:
    """Client -> coordinator. Answered with ModelInfo once an engine has loaded its model."""


@message(25, required=9)  # (tensor_parallel_size came later)
class ModelInfo:
    """What a client needs to tokenize and detokenize: the tokenizer travels with the model.
    `kv_cache_tokens` / `kv_cache_bytes`: the KV cache of one engine rank (the first loaded).
    With prefix caching the client hashes prompts itself (messages/block_hash.py, `block_size`
    tokens per block, salt `weight_version`) and sends the hashes with each request."""

    model: str
    tokenizer: str
    max_sequence_length: int
    num_ranks: int
    kv_cache_tokens: int
    kv_cache_bytes: int
    block_size: int = 0
    prefix_caching: bool = False  # whether SubmitRequest.block_hashes are of any use
    weight_version: int = 0  # the hash salt, as of this answer
    tensor_parallel_size: int = 1  # gpu processes per rank (num_ranks x this join a weight group)
    draft_weights: bool = False  # a draft model with weights of its own (updates with draft=True)


def stream_frame(
    request_id: int,
    new_token_ids: Sequence[int],
    num_prompt_tokens: int,
    num_generated_tokens: int,
    num_cached_tokens: int,
    weight_versions: Sequence[tuple[int, int]],
) -> bytes:
    """`encode_frame(RequestOutput(...))`, byte for byte, of a streamed output that is not the
    last (not finished, no log-probs; `new_token_ids` non-empty, `weight_versions` its
    (version, first token index) spans): the engine sends one per streaming request per
    step. Composed from bytes (codec `list_head`, `pack_value`, `pack_ints`), the constant
    fields packed once (a request's own, its id, prompt and cached tokens, once per request):
    no RequestOutput, no numpy array (an output 4.6 -> 1.8 us on the 2-core box, the engine's
    slicing included, and 1.3 with a decode step's one token and one span packed directly;
    64 a step at batch 64). tests/test_messages.py holds the two equal."""
    before, between, after = _request_parts(request_id, num_prompt_tokens, num_cached_tokens)
    if len(new_token_ids) == 1 and len(weight_versions) == 1:  # (a decode step's output)
        token_head, span_head = _one_token_heads()
        ((version, first),) = weight_versions
        return b"".join((
            before, token_head, _INT32.pack(new_token_ids[0]),
            between, pack_value(num_generated_tokens),
            after, span_head, _SPAN.pack(version, first),
        ))  # fmt: skip
    spans = [v for span in weight_versions for v in span]
    return b"".join((
        before, pack_ints(new_token_ids, "int32", (len(new_token_ids),)),
        between, pack_value(num_generated_tokens),
        after, pack_ints(spans, "int64", (len(weight_versions), 2)),
    ))  # fmt: skip


_INT32, _SPAN = _struct.Struct("<i"), _struct.Struct("<2q")  # (as pack_ints packs them)


@functools.cache
def _one_token_heads() -> tuple[bytes, bytes]:
    """The array headers `pack_ints` puts before one int32 token and one int64 span."""
    return (
        pack_ints([0], "int32", (1,))[: -_INT32.size],
        pack_ints([0, 0], "int64", (1, 2))[: -_SPAN.size],
    )


@functools.lru_cache(maxsize=4096)  # (a request's every streamed output reuses them)
def _request_parts(request_id: int, num_prompt: int, num_cached: int) -> tuple[bytes, ...]:
    """A request's constant bytes of `stream_frame`: up to its tokens, between them and
    num_generated_tokens, and from num_cached_tokens to weight_versions."""
    head, middle, tail = _stream_parts()
    return (
        head + pack_value(request_id),
        middle + pack_value(num_prompt),
        pack_value(num_cached) + tail,
    )


@functools.cache
def _stream_parts() -> tuple[bytes, bytes, bytes]:
    """`stream_frame`'s constant bytes: the list's header with the tag and version, the three
    fields after the tokens (not finished, no reason, no error), and the fields between
    num_cached_tokens and weight_versions (their defaults: no log-probs)."""
    one = np.ones(1, np.int32)
    spans = np.ones((1, 2), np.int64)
    sample = RequestOutput(0, one, False, None, None, 1, 1, 1, weight_versions=spans)
    values = wire_values(sample)  # (the fields after weight_versions, at their defaults,
    # are not sent: it is the last value)
    head = list_head(len(values)) + pack_value(values[0]) + pack_value(values[1])
    middle = b"".join(pack_value(v) for v in values[4:7])
    tail = b"".join(pack_value(v) for v in values[10:-1])
    return head, middle, tail


@message(26)
class StepOutputs:
    """Engine -> coordinator, and coordinator -> client: every RequestOutput of one step in
    one message (also those of requests that ended without running in it), or of one event that
    ended requests between steps (an abort, a refused submission, a shutdown).

    Entry i: `request_ids[i]` and `finished[i]` are all the coordinator reads, to route and to
    forget a finished route; `outputs[i]` is that request's RequestOutput, encoded by the engine
    as one frame (`encode_frame`). To a client that said Hello("client") the coordinator sends
    one StepOutputs per engine step with that client's entries, `request_ids` its own ids and
    each frame unread (still holding the engine's global id; the client decodes and checks it);
    to any other client each output as its own message, renumbered (`relayed`). A direct-mode
    client gets the engine's StepOutputs as sent. Build one with `of`.
    """

    request_ids: Array[np.int64, 1]
    finished: Array[np.bool_, 1]
    outputs: tuple[bytes, ...]

    @classmethod
    def of(cls, outputs: Sequence[RequestOutput]) -> StepOutputs:
        return cls(
            np.array([o.request_id for o in outputs], dtype=np.int64),
            np.array([o.finished for o in outputs], dtype=np.bool_),
            tuple(encode_frame(o) for o in outputs),
        )

    def problem(self) -> str | None:
        """What makes the entries unusable as a whole, or None."""
        n, f, o = len(self.request_ids), len(self.finished), len(self.outputs)
        if not n == f == o:
            return f"StepOutputs: {n} request_ids, {f} finished flags and {o} outputs differ"
        return None

    def relayed(self, i: int, client_request_id: int) -> bytes:
        """Entry i as its client gets it: the engine's RequestOutput frame, renumbered. Raises
        MessageError if that frame is not a RequestOutput for request_ids[i] and finished[i]."""
        frame, (rid, _, finished) = replace_first_field(
            self.outputs[i], RequestOutput, client_request_id, peek=3
        )
        want_id, want_finished = int(self.request_ids[i]), bool(self.finished[i])
        if type(rid) is not int or rid != want_id or finished is not want_finished:
            raise MessageError(
                f"StepOutputs entry {i}: a RequestOutput of request {rid!r} (finished "
                f"{finished!r}) filed under request {want_id} (finished {want_finished})",
                ErrorCode.BAD_FIELD,
            )
        return frame

    def decoded(self) -> list[RequestOutput]:
        """Every output, decoded (replay and tests; the coordinator never needs it). Raises
        MessageError for a frame that is not a RequestOutput."""
        out = []
        for i, frame in enumerate(self.outputs):
            msg = decode([frame])
            if not isinstance(msg, RequestOutput):
                raise MessageError(
                    f"StepOutputs entry {i} is a {type(msg).__name__}", ErrorCode.BAD_FIELD
                )
            out.append(msg)
        return out
