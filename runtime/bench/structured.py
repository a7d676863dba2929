"""The `structured` workload of `taipan bench`: what structured outputs cost. `--num-prompts`
concurrent streams (64) of `--output-len` tokens (128; greedy, or drawn at `--temperature`),
once unconstrained and once under a json_schema, on the same prompts through the same runtime
(each warmed once, then the fastest of four alternating rounds); the row gives both output
rates and `structured_cost` = 1 -
constrained / unconstrained tokens/s (issue 28's bar: <= 0.05 at 64).

The same two again with whole requests (not streamed): `structured_cost_whole`, the engine's
own cost without the per-step outputs a streaming client reads.

The schema (an object holding an array of at least `--output-len` strings) cannot be complete
before `--output-len` tokens, so both runs generate exactly the same number of tokens: the rates
compare equal work, the grammar masks (computed on the host, beside the step) being the only
difference. EOS is ignored in the unconstrained run for the same reason. No HF side: HF has no
grammar engine of its own (its figure would be the unconstrained one).

Never imports torch itself.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

from taipan.bench.common import mixed_prompts, rounded

# Timed rounds per mode, alternating (a GPU's clocks and caches favour neither). 4, not 2: on
# an H200 one round of 64 x 128 takes 0.2-0.5 s and the same tree's cost scattered 0.12-0.42
# between runtimes of one call with 2 (NOTES, twenty-eighth session).
ROUNDS = 4


def array_schema(min_items: int) -> str:
    """A JSON schema whose shortest instance is longer than `min_items` tokens."""
    return json.dumps(
        {
            "type": "object",
            "properties": {
                "notes": {"type": "array", "items": {"type": "string"}, "minItems": min_items}
            },
            "required": ["notes"],
        }
    )


async def _timed_rounds(address: str, prompts: list[str], modes: dict, rounds: int) -> dict:
    """Each mode once untimed (graphs captured, the grammar compiled), then `rounds` timed
    rounds alternating the modes; per mode the fastest round's (seconds, tokens per request,
    the first request's text, engine steps, device seconds of those steps, rows a grammar
    check voided). A mode is
    (SamplingParams, stream): streamed requests as a chat client reads them, or whole ones."""
    from taipan.client import AsyncClient

    async def streamed(client, prompt: str, sampling) -> tuple[int, str]:
        count, text = 0, []
        async for delta in client.stream(prompt, sampling, chat=True):
            count += len(delta.token_ids)
            text.append(delta.text)
        return count, "".join(text)

    async def whole(client, prompt: str, sampling) -> tuple[int, str]:
        [done] = await client.generate([prompt], sampling, chat=True)
        return len(done.token_ids), done.text

    async def batch(client, sampling, stream: bool) -> tuple:
        one = streamed if stream else whole
        before = (await client.stats()).merged()
        start = time.perf_counter()
        done = await asyncio.gather(*(one(client, p, sampling) for p in prompts))
        seconds = time.perf_counter() - start
        after = (await client.stats()).merged()
        steps = after.steps_total - before.steps_total
        device = after.device_seconds_total - before.device_seconds_total
        void = after.grammar_void_rows - before.grammar_void_rows
        return seconds, [n for n, _ in done], done[0][1], steps, device, void

    best: dict = {}
    async with AsyncClient(address) as client:
        for sampling, stream in modes.values():
            await batch(client, sampling, stream)
        for _ in range(rounds):
            for mode, (sampling, stream) in modes.items():
                got = await batch(client, sampling, stream)
                if mode not in best or got[0] < best[mode][0]:
                    best[mode] = got
    return best


def structured_workload(args) -> list[dict]:
    from taipan.launcher import runtime_from_args
    from taipan.messages.requests import SamplingParams, StructuredOutput
    from taipan.models import resolve
    from taipan.ops.hardware import gpu_name

    n, m = args.num_prompts or 64, args.output_len or 128
    t = getattr(args, "temperature", 0.0)
    if n < 1 or m < 1:
        raise ValueError("--num-prompts and --output-len must be >= 1")
    if not t >= 0.0:
        raise ValueError(f"--temperature must be >= 0, got {t}")
    name, _ = resolve(args.model)
    prompts = [f"List notes about this text as JSON. {p}" for p in mixed_prompts(n)]
    free = SamplingParams(max_tokens=m, temperature=t, ignore_eos=True)
    schema = array_schema(m)
    constrained = SamplingParams(
        max_tokens=m, temperature=t, structured=StructuredOutput("json_schema", schema)
    )
    modes = {
        "unconstrained": (free, True),
        "json_schema": (constrained, True),
        "unconstrained_whole": (free, False),
        "json_schema_whole": (constrained, False),
    }
    with runtime_from_args(args) as rt:
        best = asyncio.run(_timed_rounds(rt.address, prompts, modes, ROUNDS))
    counts = {mode: sorted(set(got[1])) for mode, got in best.items()}
    if any(c != [m] for c in counts.values()):
        raise RuntimeError(f"every request must generate {m} tokens; got {counts}")
    row = {
        "workload": "structured",
        "model": name,
        "gpu": gpu_name(args.device),
        "batch": n,
        "dtype": args.dtype,
        "device": args.device,
        "output_len": m,
        "temperature": t,
        "rounds": f"one untimed, then the fastest of {ROUNDS} alternating",
        "schema": schema,
    }
    # Per mode: seconds, output tokens/s; the engine's steps in the round, wall ms per step,
    # and the share of the round the device was busy (the rest: host work between steps, or
    # a client slower than the engine). "_whole": the same requests not streamed (one output
    # each at its end): the engine's own rate, without the per-step outputs.
    # "_void_rows": decode rows voided because the grammar check replaced the token they read
    # (TAIPAN_GRAMMAR_MASKS "check": each costs its request a step; actors/gpu/grammar_masks.py).
    for mode, (seconds, _, _, steps, device, void) in best.items():
        row[f"{mode}_seconds"] = seconds
        row[f"{mode}_output_tok_s"] = n * m / seconds
        row[f"{mode}_steps"] = steps
        row[f"{mode}_ms_per_step"] = 1e3 * seconds / max(steps, 1)
        row[f"{mode}_device_busy_share"] = device / seconds
        row[f"{mode}_void_rows"] = void
    row["structured_cost"] = 1.0 - row["unconstrained_seconds"] / row["json_schema_seconds"]
    row["structured_cost_whole"] = (
        1.0 - row["unconstrained_whole_seconds"] / row["json_schema_whole_seconds"]
    )
    texts = [best["json_schema"][2], best["json_schema_whole"][2]]
    row["grammar_mode"] = os.environ.get("TAIPAN_GRAMMAR_MASKS", "check")
    row["invariants_hold"] = all(t.lstrip().startswith("{") for t in texts)  # the grammar bound
    return [rounded(row)]


def structured_summary(row: dict) -> str:
    """The row's human line."""
    return (
        f"structured batch {row['batch']} x {row['output_len']}"
        f"{' at temperature ' + str(row['temperature']) if row.get('temperature') else ''}: "
        "unconstrained "
        f"{row['unconstrained_output_tok_s']} tok/s, json_schema "
        f"{row['json_schema_output_tok_s']} tok/s, cost {row['structured_cost']} (whole "
        f"requests, not streamed: {row['structured_cost_whole']}); "
        f"{row.get('json_schema_void_rows', 0)} void rows ({row.get('grammar_mode', 'check')})"
    )
