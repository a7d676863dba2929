"""The `spec` workload of `taipan bench`: what speculative decoding (n-gram drafts, a draft
model's with `--spec-draft`, or the checkpoint's MTP head with `--spec-method mtp`) buys.
Two workloads in one run, each on the same chat-templated prompts with speculation off and on:
`grounded`, prompts whose answers copy spans of the prompt (repeat a passage, fix a typo and
print the whole code: prompt lookup's best case), and `free`, short open questions (its worst:
little to copy, the verify rows' extra positions mostly wasted). Issue 29's bars: >= 1.5x on
grounded at batch 1 on the CPU (>= 2x on a GPU), free no slower than 0.95x, outputs identical.

Two runtimes: speculation off (`num_speculative_tokens=0`) and on
(`num_speculative_tokens=--spec-tokens`, `speculative_method=ngram`, or `draft_model` with
`speculative_model=--spec-draft`), both up at once on a CPU
(an idle one costs nothing; their passes alternate, so a load that comes and goes on a shared
host favours neither), one after the other on a device. Each is warmed by one full request of
each workload, then timed ROUNDS times (alternating) on `--num-prompts` requests (8) of exactly
`--output-len` greedy tokens (128, EOS ignored: both sides do the same work), at most
`--spec-batch` in flight (1: batch-1 decode, where speculation pays); the fastest pass counts.
The passages and code are longer than 128 output tokens, so a copy lasts the whole output. One
row per workload: the output rates off and on and their ratio (`speedup`), the per-stream
inter-token time after the first token off and on (`decode_speedup`: prefill left out),
`outputs_equal` (every prompt's token ids off == on, and the same in every pass), and the
engine's counters over the fastest pass: steps, drafted and accepted tokens, verify rows, mean
accepted length per verify row ((accepted + rows) / rows), acceptance rate and accepted
drafts per position; and what a step costs the device: a plain step's with speculation off
(`off_device_step_ms`), a verify forward's with it on (`on_verify_step_ms`, RankStats
spec_verify_device_seconds / spec_verify_steps) and their ratio (`verify_vs_plain_device`).

`--spec-off-above N` gives the speculating runtimes speculative_disable_by_batch_size=N (no
verify rows in a step planned while more than N requests run; with `--spec-batch` above N only
the tail speculates).

`--spec-chain N` adds a third runtime, n-gram speculation with speculative_chain_steps=N (its
verify steps chained in the gpu actor, actors/gpu/chain.py), timed in the same alternation:
its columns `chain_*` (its rate, `chain_speedup` against off, `chain_vs_on` against the
unchained side, `chain_outputs_equal` against off, `chain_equals_on` against the unchained
side, `chain_chains` planned).

No HF side: HF's prompt-lookup decoding is another implementation, not a baseline of ours.
Never imports torch itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from taipan.bench.common import greedy, rounded, with_sets

ROUNDS = 2  # timed passes per runtime and workload, alternating; the fastest counts


# Input-grounded prompts: the answer copies the prompt's text (a passage to repeat, code to
# print back with one typo fixed).
PASSAGES = [
    "The lighthouse stood on a narrow spit of rock at the mouth of the harbour. Every evening "
    "the keeper climbed the one hundred and twelve steps, trimmed the wick, polished the great "
    "lens and wound the clockwork that turned it. Ships three leagues out could see its beam, "
    "and the fishermen said that no boat had been lost on the rocks since it was first lit. In "
    "winter the storms came in from the west, and the spray reached the gallery at the top of "
    "the tower, so that the keeper had to wipe the glass every hour through the night. He kept "
    "a log of every ship that passed, the direction of the wind and the height of the sea, and "
    "once a month a boat from the town brought him oil, flour, coffee and letters. His daughter "
    "learned to read from the old almanacs on the shelf, and by the age of ten she could name "
    "every star that rose above the cliffs. When the keeper grew too old to climb the stairs, "
    "she took his place, and she kept the light burning for forty more years.",
    "Photosynthesis is the process by which green plants use sunlight to turn water and carbon "
    "dioxide into glucose and oxygen. It takes place mainly in the leaves, inside small "
    "structures called chloroplasts, which contain the green pigment chlorophyll. The process "
    "has two stages. In the light-dependent reactions, chlorophyll absorbs light and uses its "
    "energy to split water molecules, releasing oxygen and storing energy in two carrier "
    "molecules, ATP and NADPH. In the second stage, the Calvin cycle, the plant uses that "
    "stored energy to fix carbon dioxide from the air into sugars. These sugars feed the plant "
    "and are stored as starch or used to build cellulose for its cell walls. The oxygen that "
    "plants release is the oxygen that most animals, including humans, need to breathe, and "
    "almost all of the energy in the food we eat was first captured from sunlight by plants.",
    "To reset the router, unplug it from the wall and wait thirty seconds. Plug it back in and "
    "wait until the power light turns solid green. Then press and hold the reset button on the "
    "back for ten seconds, until all the lights blink at once. The router will restart with its "
    "factory settings, and the default password is printed on the label underneath. Next, "
    "connect a laptop to the router with a network cable and open a web browser. Type the "
    "address shown on the label into the address bar and log in with the default user name and "
    "password. The setup page will ask you to choose a new name for your wireless network and "
    "a new password; pick one with at least twelve characters. Save the settings and wait for "
    "the router to restart once more. Finally, reconnect each of your devices to the new "
    "network, and write the new password down somewhere safe.",
    "Dear Ms. Alvarez, thank you for your letter of the fourth of March. We are pleased to "
    "confirm your booking of the garden room for the evening of the twentieth, for forty "
    "guests, with dinner served at eight o'clock. The room will be available from six o'clock, "
    "so that you and your guests may enjoy drinks on the terrace before dinner. As requested, "
    "the menu will begin with a chilled tomato soup, followed by roast chicken with lemon and "
    "thyme, or a mushroom risotto for the vegetarian guests, and will end with an apple tart "
    "and cream. A pianist will play in the room from seven until ten. We ask for a deposit of "
    "two hundred pounds by the fifteenth, and the rest of the payment on the evening itself. "
    "Please let us know of any dietary needs by the tenth, and do not hesitate to call us if "
    "you have any further questions. We look forward to welcoming you and your guests.",
]
CODE = [
    "def average(values):\n"
    "    if not values:\n"
    "        raise ValueError('average of an empty list')\n"
    "    total = 0\n"
    "    for value in values:\n"
    "        total += value\n"
    "    return totl / len(values)\n"
    "\n"
    "\n"
    "def median(values):\n"
    "    if not values:\n"
    "        raise ValueError('median of an empty list')\n"
    "    ordered = sorted(values)\n"
    "    middle = len(ordered) // 2\n"
    "    if len(ordered) % 2 == 0:\n"
    "        return (ordered[middle - 1] + ordered[middle]) / 2\n"
    "    return ordered[middle]\n"
    "\n"
    "\n"
    "def variance(values):\n"
    "    mean = average(values)\n"
    "    return sum((value - mean) ** 2 for value in values) / len(values)\n"
    "\n"
    "\n"
    "def summary(values):\n"
    "    return {\n"
    "        'count': len(values),\n"
    "        'average': average(values),\n"
    "        'median': median(values),\n"
    "        'variance': variance(values),\n"
    "        'minimum': min(values),\n"
    "        'maximum': max(values),\n"
    "    }\n",
    "class Stack:\n"
    "    def __init__(self):\n"
    "        self.items = []\n"
    "\n"
    "    def push(self, item):\n"
    "        self.items.append(item)\n"
    "\n"
    "    def pop(self):\n"
    "        if not self.items:\n"
    "            raise IndexError('pop from an empty stack')\n"
    "        return self.itmes.pop()\n"
    "\n"
    "    def peek(self):\n"
    "        if not self.items:\n"
    "            raise IndexError('peek at an empty stack')\n"
    "        return self.items[-1]\n"
    "\n"
    "    def is_empty(self):\n"
    "        return len(self.items) == 0\n"
    "\n"
    "    def __len__(self):\n"
    "        return len(self.items)\n"
    "\n"
    "\n"
    "def balanced(text):\n"
    "    pairs = {')': '(', ']': '[', '}': '{'}\n"
    "    stack = Stack()\n"
    "    for char in text:\n"
    "        if char in '([{':\n"
    "            stack.push(char)\n"
    "        elif char in pairs:\n"
    "            if stack.is_empty() or stack.pop() != pairs[char]:\n"
    "                return False\n"
    "    return stack.is_empty()\n",
    "import json\n"
    "import os\n"
    "\n"
    "DEFAULTS = {'host': 'localhost', 'port': 8080, 'debug': False, 'workers': 4}\n"
    "\n"
    "\n"
    "def load_config(path):\n"
    "    if not os.path.exists(path):\n"
    "        return dict(DEFAULTS)\n"
    "    with open(path) as f:\n"
    "        config = json.laod(f)\n"
    "    for key, value in DEFAULTS.items():\n"
    "        config.setdefault(key, value)\n"
    "    return config\n"
    "\n"
    "\n"
    "def save_config(path, config):\n"
    "    with open(path, 'w') as f:\n"
    "        json.dump(config, f, indent=2, sort_keys=True)\n"
    "\n"
    "\n"
    "def update_config(path, **changes):\n"
    "    config = load_config(path)\n"
    "    for key, value in changes.items():\n"
    "        if key not in DEFAULTS:\n"
    "            raise KeyError(f'unknown setting: {key}')\n"
    "        config[key] = value\n"
    "    save_config(path, config)\n"
    "    return config\n",
    "def count_words(text):\n"
    "    counts = {}\n"
    "    for word in text.lower().split():\n"
    "        word = word.strip('.,;:!?')\n"
    "        if word:\n"
    "            counts[word] = counts.get(word, 0) + 1\n"
    "    return sorted(counts.items(), key=lambda kv: kv[1], reverse=Ture)\n"
    "\n"
    "\n"
    "def top_words(text, n=10):\n"
    "    return [word for word, _ in count_words(text)[:n]]\n"
    "\n"
    "\n"
    "def read_file(path):\n"
    "    with open(path, encoding='utf-8') as f:\n"
    "        return f.read()\n"
    "\n"
    "\n"
    "def report(path, n=10):\n"
    "    text = read_file(path)\n"
    "    words = count_words(text)\n"
    "    print(f'{len(words)} different words in {path}')\n"
    "    for word, count in words[:n]:\n"
    "        print(f'{word:>20} {count:6d}')\n"
    "\n"
    "\n"
    "if __name__ == '__main__':\n"
    "    import sys\n"
    "\n"
    "    report(sys.argv[1])\n",
]

# Free generation: open questions whose answers copy little of the prompt.
QUESTIONS = [
    "Write a short story about a fox who learns to sail.",
    "What are the main causes of the seasons on Earth?",
    "Give some advice for someone starting to learn the piano.",
    "Describe a good breakfast for a long day of hiking.",
    "Why do cats purr?",
    "Write a poem about autumn in a big city.",
    "What should I pack for a weekend trip to the mountains?",
    "Explain how a bicycle stays upright when it moves.",
]


def grounded_prompts(n: int) -> list[str]:
    """n prompts alternating a passage to repeat and code to fix and print back."""
    out = []
    for i in range(n):
        if i % 2 == 0:
            text = PASSAGES[(i // 2) % len(PASSAGES)]
            out.append(f"Repeat the following text exactly:\n\n{text}")
        else:
            code = CODE[(i // 2) % len(CODE)]
            out.append(f"Fix the typo in this code and print the whole code:\n\n{code}")
    return out


def free_prompts(n: int) -> list[str]:
    return [QUESTIONS[i % len(QUESTIONS)] for i in range(n)]


SPEC_COUNTERS = (
    "spec_draft_tokens",
    "spec_accepted_tokens",
    "spec_verify_rows",
    "spec_backoffs",
    "spec_chains",
    "steps_total",
    "device_seconds_total",
    "spec_verify_steps",
    "spec_verify_device_seconds",
)


async def _timed_passes(
    addresses: dict[str, str], workloads: dict[str, list[str]], m: int, concurrency: int
) -> dict[str, dict[str, dict]]:
    """Per runtime (side) and workload: its first prompt once untimed, then ROUNDS timed passes
    over its prompts (at most `concurrency` in flight), alternating the workloads and the
    sides given; the fastest pass's wall seconds, every prompt's token ids, the per-stream
    seconds from the first token to the last and the engine's counter deltas, and whether
    every pass gave the same token ids (`stable`)."""
    from taipan.client import AsyncClient

    async def one(client, prompt: str, gate) -> tuple[list[int], float]:
        async with gate:
            ids: list[int] = []
            first = None
            async for delta in client.stream(prompt, greedy(m), chat=True):
                if delta.token_ids and first is None:
                    first = time.perf_counter()
                ids.extend(delta.token_ids)
            end = time.perf_counter()
            return ids, end - first if first is not None else 0.0

    async def timed(client, prompts: list[str]) -> dict:
        gate = asyncio.Semaphore(concurrency)
        before = (await client.stats()).merged()
        start = time.perf_counter()
        done = await asyncio.gather(*(one(client, p, gate) for p in prompts))
        seconds = time.perf_counter() - start
        after = (await client.stats()).merged()
        deltas = {c: getattr(after, c) - getattr(before, c) for c in SPEC_COUNTERS}
        was, now = list(before.spec_accepted_per_position), list(after.spec_accepted_per_position)
        was += [0] * (len(now) - len(was))
        deltas["spec_accepted_per_position"] = [a - b for a, b in zip(now, was, strict=True)]
        return {
            "seconds": seconds,
            "token_ids": [ids for ids, _ in done],
            "decode_seconds": [s for _, s in done],
            **deltas,
        }

    clients = {side: AsyncClient(address) for side, address in addresses.items()}
    best: dict[str, dict[str, dict]] = {side: {} for side in addresses}
    try:
        for client in clients.values():
            await client.__aenter__()
        for client in clients.values():
            for prompts in workloads.values():
                await one(client, prompts[0], asyncio.Semaphore(1))
        for _ in range(ROUNDS):
            for scenario, prompts in workloads.items():
                for side, client in clients.items():
                    got = await timed(client, prompts)
                    old = best[side].get(scenario)
                    stable = old is None or (old["stable"] and old["token_ids"] == got["token_ids"])
                    if old is None or got["seconds"] < old["seconds"]:
                        best[side][scenario] = got
                    best[side][scenario]["stable"] = stable
    finally:
        for client in clients.values():
            await client.__aexit__(None, None, None)
    return best


def spec_workload(args) -> list[dict]:
    from taipan.launcher import runtime_from_args
    from taipan.models import resolve
    from taipan.ops.hardware import gpu_name

    n, m = args.num_prompts or 8, args.output_len or 128
    k, batch = args.spec_tokens, args.spec_batch
    if n < 1 or m < 2 or k < 1 or batch < 1:
        raise ValueError(
            "--num-prompts, --spec-tokens and --spec-batch must be >= 1, --output-len >= 2"
        )
    name, _ = resolve(args.model)
    draft = getattr(args, "spec_draft", None)
    method = getattr(args, "spec_method", None) or ("draft_model" if draft else "ngram")
    if (method == "draft_model") != bool(draft):
        raise ValueError("--spec-draft goes with --spec-method draft_model (and only with it)")
    drafter = [f"speculative_method={method}"] + ([f"speculative_model={draft}"] if draft else [])
    off_above = getattr(args, "spec_off_above", None)
    if off_above is not None:  # (the speculating sides' batch limit)
        drafter.append(f"speculative_disable_by_batch_size={off_above}")
    workloads = {"grounded": grounded_prompts(n), "free": free_prompts(n)}
    sides = {
        "off": with_sets(args, "num_speculative_tokens=0"),
        "on": with_sets(args, f"num_speculative_tokens={k}", *drafter),
    }
    chain = getattr(args, "spec_chain", 1)
    if chain > 1:  # (the same n-gram speculation, its verify steps chained in the gpu actor)
        if method != "ngram":
            raise ValueError("--spec-chain chains n-gram verify steps: not with --spec-method")
        sides["chain"] = with_sets(
            args, f"num_speculative_tokens={k}", *drafter, f"speculative_chain_steps={chain}"
        )
    # On a CPU both runtimes are up at once (an idle one costs nothing) and their passes
    # alternate, so a load that comes and goes on the host favours neither; a device gets one
    # runtime at a time (two KV pools and two copies of the weights may not fit).
    together = str(args.device).startswith("cpu")
    got: dict[str, dict] = {}
    if together:
        with contextlib.ExitStack() as stack:
            addresses = {
                side: stack.enter_context(runtime_from_args(a)).address for side, a in sides.items()
            }
            got = asyncio.run(_timed_passes(addresses, workloads, m, batch))
    else:
        for side, side_args in sides.items():
            with runtime_from_args(side_args) as rt:
                got |= asyncio.run(_timed_passes({side: rt.address}, workloads, m, batch))
    rows = []
    for scenario in workloads:
        off, on = got["off"][scenario], got["on"][scenario]
        for side in sides:
            run = got[side][scenario]
            counts = sorted({len(ids) for ids in run["token_ids"]})
            if counts != [m]:
                raise RuntimeError(
                    f"{scenario}, speculation {side}: token counts {counts}, not {m}"
                )
        off_rate, on_rate = n * m / off["seconds"], n * m / on["seconds"]
        off_itl = sum(off["decode_seconds"]) / (n * (m - 1))
        on_itl = sum(on["decode_seconds"]) / (n * (m - 1))
        drafted, accepted = on["spec_draft_tokens"], on["spec_accepted_tokens"]
        verify_rows = on["spec_verify_rows"]
        row = {
            "workload": "spec",
            "scenario": scenario,
            "model": name,
            "gpu": gpu_name(args.device),
            "batch": batch,
            "dtype": args.dtype,
            "device": args.device,
            "num_prompts": n,
            "output_len": m,
            "speculative_method": method,
            "speculative_model": draft,
            "num_speculative_tokens": k,
            "speculative_disable_by_batch_size": off_above,
            "rounds": f"one untimed request, then the fastest of {ROUNDS} alternating passes"
            + (", both runtimes up" if together else ", one runtime at a time"),
            "off_seconds": off["seconds"],
            "on_seconds": on["seconds"],
            "off_output_tok_s": off_rate,
            "on_output_tok_s": on_rate,
            "speedup": on_rate / off_rate,
            # Per stream, from its first token to its last (prefill left out).
            "off_itl_ms": 1e3 * off_itl,
            "on_itl_ms": 1e3 * on_itl,
            "decode_speedup": off_itl / on_itl if on_itl > 0 else 0.0,
            # Every prompt's token ids off == on, and the same in every pass of either side.
            "outputs_equal": off["token_ids"] == on["token_ids"] and off["stable"] and on["stable"],
            "prompts_unequal": sum(
                a != b for a, b in zip(off["token_ids"], on["token_ids"], strict=True)
            ),
            "off_steps": off["steps_total"],
            "on_steps": on["steps_total"],
            "off_output_tokens_per_step": n * m / max(off["steps_total"], 1),
            "on_output_tokens_per_step": n * m / max(on["steps_total"], 1),
            "spec_draft_tokens": drafted,
            "spec_accepted_tokens": accepted,
            "spec_verify_rows": verify_rows,
            "spec_backoffs": on["spec_backoffs"],  # (speculation.py's back-off)
            "mean_accepted_length": (accepted + verify_rows) / verify_rows if verify_rows else 0.0,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            # Verify rows whose draft j was accepted (j = 0 .. k-1).
            "accepted_per_position": on["spec_accepted_per_position"],
            **_step_costs(off, on),
        }
        if "chain" in got:
            row |= _chain_columns(got["chain"][scenario], off, on, n, m, chain)
        rows.append(rounded(row))
    return rows


def _step_costs(off: dict, on: dict) -> dict:
    """What a step costs the device (the gpu actor's device time, StepResult.device_seconds):
    a plain step's with speculation off, a verify forward's with it on, and their ratio (the
    tokens a verify row must gain to pay for itself, before the overlap a verifying request
    gives up)."""
    plain = 1e3 * off["device_seconds_total"] / max(off["steps_total"], 1)
    verify = 1e3 * on["spec_verify_device_seconds"] / max(on["spec_verify_steps"], 1)
    return {
        "off_device_step_ms": plain,
        "on_verify_step_ms": verify if on["spec_verify_steps"] else 0.0,
        "verify_vs_plain_device": verify / plain if on["spec_verify_steps"] and plain else 0.0,
    }


def _chain_columns(run: dict, off: dict, on: dict, n: int, m: int, chain: int) -> dict:
    """The chained side's columns of a row (--spec-chain)."""
    rate, itl = n * m / run["seconds"], sum(run["decode_seconds"]) / (n * (m - 1))
    rows, accepted = run["spec_verify_rows"], run["spec_accepted_tokens"]
    return {
        "speculative_chain_steps": chain,
        "chain_seconds": run["seconds"],
        "chain_output_tok_s": rate,
        "chain_speedup": rate * off["seconds"] / (n * m),  # (against speculation off)
        "chain_vs_on": rate * on["seconds"] / (n * m),
        "chain_itl_ms": 1e3 * itl,
        "chain_outputs_equal": run["token_ids"] == off["token_ids"] and run["stable"],
        # (against unchained speculation: in bf16 on a GPU a verify row rounds unlike a decode
        # row, so both may differ from `off` somewhere; the chain's inner steps are verify rows
        # too, and where it drafts as the engine does it computes the same rows)
        "chain_equals_on": run["token_ids"] == on["token_ids"],
        "chain_steps": run["steps_total"],
        "chain_chains": run["spec_chains"],
        "chain_verify_rows": rows,
        "chain_mean_accepted_length": (accepted + rows) / rows if rows else 0.0,
        # (a chain's inner steps: its device time over the forwards it ran)
        "chain_verify_step_ms": 1e3 * run["spec_verify_device_seconds"] / run["spec_verify_steps"]
        if run["spec_verify_steps"]
        else 0.0,
    }


def spec_summary(row: dict) -> str:
    """The row's human line."""
    if "chain_output_tok_s" in row:
        chained = (
            f"; chained x{row['speculative_chain_steps']} {row['chain_output_tok_s']} tok/s, "
            f"speedup {row['chain_speedup']}x ({row['chain_vs_on']}x of unchained), outputs "
            f"equal {row['chain_outputs_equal']}"
        )
    else:
        chained = ""
    return (
        f"spec {row['scenario']} batch {row['batch']} x {row['output_len']} "
        f"({row.get('speculative_model') or row.get('speculative_method') or 'ngram'} k="
        f"{row['num_speculative_tokens']}): off {row['off_output_tok_s']} tok/s, on "
        f"{row['on_output_tok_s']} tok/s, speedup {row['speedup']}x (decode "
        f"{row['decode_speedup']}x), accepted length {row['mean_accepted_length']}, acceptance "
        f"{row['acceptance_rate']}, outputs equal {row['outputs_equal']}{chained}"
    )
