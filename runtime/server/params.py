"""A request body as the engine's SamplingParams: the sampling fields and logit controls (vLLM's
`bad_words` tokenized as vLLM does), the structured output it asks for (OpenAI's
`response_format`, vLLM's `guided_*` / `structured_outputs`, SGLang's spellings; compiled here
so a bad grammar is the request's 400), the engine's seed of any int64 seed, and each choice's
own seed (`choice_params`). Each refusal an APIError naming its field.

Pure: no client, no event loop.
"""

from __future__ import annotations

import json

from taipan.messages.requests import SamplingParams, StructuredOutput
from taipan.server.schemas import APIError, BaseBody, shorten

SEED_RANGE = 2**63  # SamplingParams.seed lies in [0, 2**63)


def engine_seed(seed: int | None) -> int | None:
    """Any 64-bit seed (negative too) as the engine's [0, 2**63), deterministically."""
    return None if seed is None else seed % SEED_RANGE


def sampling_params(
    body: BaseBody,
    max_tokens: int,
    top_n: int,
    prompt_top: int = -1,
    bad_words_ids: tuple[tuple[int, ...], ...] = (),
) -> SamplingParams:
    """The body's SamplingParams: `top_n` candidates per generated token (-1: no log-probs),
    `prompt_top` per prompt token (-1: no prompt log-probs); the engine's top-n serves both
    (the larger), each cut to its own when shown. `bad_words_ids`: the body's `bad_words`
    tokenized (`bad_words_ids`, which needs the tokenizer)."""
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if any(not s for s in stop):
        raise APIError(400, "stop strings must be non-empty", "stop")
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=max(0, body.top_k or 0),
        min_p=body.min_p or 0.0,
        seed=engine_seed(body.seed),
        ignore_eos=body.ignore_eos,
        stop=tuple(stop),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        include_stop_word=body.include_stop_str_in_output or body.no_stop_trim,
        skip_special_tokens=body.skip_special_tokens,
        return_log_probs=top_n >= 0 or prompt_top >= 0,
        skip_prompt_log_probs=prompt_top < 0,
        top_n_logprobs=max(top_n, prompt_top, 0),
        return_prompt_top_n_logprobs=prompt_top > 0,
        logprobs_mode=body.logprobs_mode or "raw",
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        logit_bias=body.logit_bias or None,
        min_tokens=body.min_tokens,
        bad_words_ids=bad_words_ids,
        structured=structured_output(body),
        allowed_token_ids=None if body.allowed_token_ids is None else tuple(body.allowed_token_ids),
    )
    problems = params.problems()
    if problems:
        # (a problem that starts with a body field's name is about that field: the param)
        first = problems[0].split(" ", 1)[0]
        raise APIError(
            400, "; ".join(problems), first if first in type(body).model_fields else None
        )
    return params


def bad_words_ids(words: list[str] | None, encode) -> tuple[tuple[int, ...], ...]:
    """vLLM's `bad_words` as token sequences (its SamplingParams.update_from_tokenizer): each
    word, left-stripped, tokenized without and with a leading space (`encode(text)`, no special
    tokens); the spaced form only where it is a different word token of the same length. A
    400 naming `bad_words` for a word that is empty or all whitespace."""
    out: list[tuple[int, ...]] = []
    for word in words or []:
        if not word.strip():
            raise APIError(400, "each of bad_words must be a non-empty word", "bad_words")
        bare = tuple(encode(word.lstrip()))
        spaced = tuple(encode(" " + word.lstrip()))
        out.append(bare)
        if spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return tuple(out)


def structured_output(body: BaseBody) -> StructuredOutput | None:
    """The grammar the body asks its output to keep to: OpenAI's `response_format`
    (json_object, json_schema), one of vLLM's guided_json / guided_regex / guided_choice /
    guided_grammar / structured_outputs or SGLang's regex / ebnf / json_schema; None: none (or
    response_format "text"). A 400 naming the field for two of them, an unknown type, or a
    grammar that does not compile (a grammar is Lark, or GBNF / EBNF with `::=`)."""
    given: list[tuple[str, StructuredOutput]] = []
    rf = body.response_format
    if rf is not None and rf.get("type") != "text":
        given.append(("response_format", _response_format(rf)))
    if body.guided_json is not None:
        spec = body.guided_json
        spec = spec if isinstance(spec, str) else json.dumps(spec)
        given.append(("guided_json", StructuredOutput("json_schema", spec)))
    if body.guided_regex is not None:
        given.append(("guided_regex", StructuredOutput("regex", body.guided_regex)))
    if body.guided_choice is not None:
        given.append(("guided_choice", StructuredOutput("choice", json.dumps(body.guided_choice))))
    if body.guided_grammar is not None:
        given.append(("guided_grammar", StructuredOutput("grammar", body.guided_grammar)))
    if body.structured_outputs:
        given.append(("structured_outputs", _vllm_structured(body.structured_outputs)))
    if body.regex is not None:
        given.append(("regex", StructuredOutput("regex", body.regex)))
    if body.ebnf is not None:
        given.append(("ebnf", StructuredOutput("grammar", body.ebnf)))
    if body.json_schema is not None:
        given.append(("json_schema", StructuredOutput("json_schema", body.json_schema)))
    if len(given) > 1:
        names = ", ".join(name for name, _ in given)
        raise APIError(400, f"give one structured output, not several ({names})", given[1][0])
    if not given:
        return None
    name, structured = given[0]
    check_structured(structured, name)
    return structured


def check_structured(structured: StructuredOutput, field: str) -> None:
    """A 400 naming `field` when `structured` does not compile (ops/grammar.py, llguidance)."""
    from taipan.ops.grammar import grammar_problem

    why = grammar_problem(structured.kind, structured.spec)
    if why is not None:
        raise APIError(400, f"{field}: {why}", field)


def _response_format(rf: dict) -> StructuredOutput:
    kind = rf.get("type")
    if kind == "json_object":
        return StructuredOutput("json_object", "")
    if kind == "json_schema":
        inner = rf.get("json_schema")
        schema = inner.get("schema") if isinstance(inner, dict) else None
        if not isinstance(schema, dict):
            raise APIError(
                400, "response_format.json_schema.schema must be a JSON schema object",
                "response_format",
            )  # fmt: skip
        return StructuredOutput("json_schema", json.dumps(schema))
    raise APIError(
        400, f"response_format type {shorten(kind)} is not text, json_object or json_schema",
        "response_format",
    )  # fmt: skip


def _vllm_structured(so: dict) -> StructuredOutput:
    """vLLM's `structured_outputs` (json, regex, choice, grammar or json_object: one)."""
    keys = [k for k in ("json", "regex", "choice", "grammar", "json_object") if so.get(k)]
    if len(keys) != 1:
        raise APIError(
            400, "structured_outputs needs exactly one of json, regex, choice, grammar, "
            "json_object", "structured_outputs",
        )  # fmt: skip
    value = so[keys[0]]
    if keys[0] == "json":
        return StructuredOutput(
            "json_schema", value if isinstance(value, str) else json.dumps(value)
        )
    if keys[0] == "json_object":
        return StructuredOutput("json_object", "")
    if keys[0] == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise APIError(400, "structured_outputs.choice must be a list of strings",
                           "structured_outputs")  # fmt: skip
        return StructuredOutput("choice", json.dumps(value))
    if not isinstance(value, str):  # (a regex or a grammar is text)
        raise APIError(400, f"structured_outputs.{keys[0]} must be a string, got "
                       f"{type(value).__name__}", "structured_outputs")  # fmt: skip
    return StructuredOutput(keys[0], value)


def choice_params(params: SamplingParams, j: int) -> SamplingParams:
    """Choice j of n: its own draws when seeded (the same seed would repeat choice 0)."""
    if params.seed is None or j == 0:
        return params
    return SamplingParams(**{**_fields(params), "seed": (params.seed + j) % SEED_RANGE})


def _fields(params: SamplingParams) -> dict:
    return {k: getattr(params, k) for k in params.__dataclass_fields__}
