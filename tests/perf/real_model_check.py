"""The real SmolLM2-135M-Instruct GGUF through taipan against Hugging Face references (issue 24):

    python3 tests/perf/real_model_check.py --write-references        # HF, CPU, fp32 (0.5-3 min)
    python3 tests/perf/real_model_check.py --device cpu --dtype float32
    python3 tests/perf/real_model_check.py --device cuda --dtype bfloat16

`--write-references` greedy-decodes CASES with transformers on the CPU in fp32 (EOS ignored) and
writes REFERENCES: prompt ids, generated ids, the log-prob of every greedy token, its margin over
the runner-up, and the teacher-forced log-probs of the prompt. Without it, the script serves the
model with taipan's `LLM`, runs the same prompts (text through taipan's tokenizer, chats through
its chat template), and prints one JSON report; exit code 0 when it has no `problems` at that
dtype (TOLERANCES). tests/test_gpu_real_model.py runs the same functions on the GPU (the GGUF
gets there through tests/perf/carry_model.sh). Nothing here fetches the model.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

REFERENCES = Path(__file__).resolve().parents[1] / "data" / "smollm2_hf_greedy.json"
MAX_NEW_TOKENS = 32
MIN_MARGIN = 0.02

# Held out: none of these is in another test. Chats go through the model's own template (no
# system message means SmolLM2's default one); each asks for an answer longer than 32 tokens.
# Every greedy token beats its runner-up by at least MIN_MARGIN nat in the references (prompts
# that came near a tie were replaced), so that fp32's summation-order noise (~1e-5) cannot flip
# one and exact equality is a fair requirement.
CASES = [
    {"name": "reef", "prompt": "The Great Barrier Reef is located off the coast of"},
    {"name": "tea", "prompt": "Green tea is made from the leaves of"},
    {
        "name": "code",
        "prompt": "import numpy as np\n\n\ndef softmax(x):\n"
        '    """Numerically stable softmax."""\n',
    },
    {"name": "virus", "prompt": "The main difference between a virus and a bacterium is that"},
    {
        "name": "chat-sky",
        "chat": [{"role": "user", "content": "Explain why the sky looks blue during the day."}],
    },
    {
        "name": "chat-study",
        "chat": [
            {"role": "user", "content": "Give me three tips for staying focused while studying."}
        ],
    },
    {
        "name": "chat-system",
        "chat": [
            {"role": "system", "content": "You are a patient teacher who explains things simply."},
            {"role": "user", "content": "What does a compiler do?"},
        ],
    },
    {
        "name": "chat-turns",
        "chat": [
            {"role": "user", "content": "I have a cat named Miso."},
            {"role": "assistant", "content": "Miso is a lovely name! How old is your cat?"},
            {"role": "user", "content": "She is two. What should I feed her?"},
        ],
    },
]


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """How far taipan at one dtype may be from the fp32 CPU references. `mean_abs` / `max_abs`
    (nat) bound |log-prob diff| over every teacher-forced position of every case (the log-prob
    of each reference token given the reference prefix), and of the greedy tokens' own
    log-probs while they follow the reference. `divergence_margin`: None means greedy ids must
    be equal; else an output may leave the reference only at a token whose reference margin
    (over the runner-up) is below it."""

    mean_abs: float
    max_abs: float
    divergence_margin: float | None


# Measured on the CPU (2026-11-26, taipan vs these references, 8 cases, 481 positions):
#   float32: mean 7.0e-6, max 3.2e-5 nat; greedy 8/8 equal. TF32 stays off on the GPU (torch's
#     default for fp32 matmuls; the Triton kernels use "ieee" dots on fp32), so only summation
#     order differs there too: the limits leave 15-30x headroom over the CPU numbers, and every
#     reference token beats its runner-up by >= MIN_MARGIN (2000x the CPU error), so exact
#     greedy equality is required.
#   bfloat16: mean 0.039, max 0.46 nat (the worst are unlikely tokens of the default system
#     prompt); greedy 7/8 equal, the other left at a token of margin 0.029. The limits leave
#     2.5x / 2x headroom for the GPU's different kernels; a broken layer, RoPE or cast moves
#     log-probs by whole nats. bf16 may flip only tokens the reference was unsure of (< 1 nat).
TOLERANCES = {
    "float32": Tolerance(mean_abs=1e-4, max_abs=1e-3, divergence_margin=None),
    "bfloat16": Tolerance(mean_abs=0.1, max_abs=1.0, divergence_margin=1.0),
}


def cached_model_path() -> str:
    """Where `--model smollm2` finds the GGUF ($TAIPAN_CACHE or ~/.cache/taipan); not fetched."""
    from taipan.models import KNOWN, cache_dir

    return os.path.join(cache_dir(), KNOWN["smollm2"].filename)


def load_references(path: Path = REFERENCES) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


# ---- the references: transformers on the CPU, fp32 ------------------------------------------


def _hf_prompt_ids(tok, case: dict) -> list[int]:
    if "prompt" in case:
        return tok(case["prompt"]).input_ids
    ids = tok.apply_chat_template(case["chat"], add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "input_ids") or isinstance(ids, dict):  # newer transformers: a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def _hf_case(model, tok, case: dict) -> dict:
    import torch

    prompt = _hf_prompt_ids(tok, case)
    with torch.inference_mode():
        x = torch.tensor([prompt])
        out = model.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW_TOKENS, do_sample=False
        )
        new = out[0, len(prompt) :].tolist()
        # Teacher-forced over prompt + continuation in one forward: row t predicts token t + 1.
        logp = torch.log_softmax(model(out).logits[0].float(), dim=-1)
    targets = out[0, 1:]
    picked = logp[:-1].gather(1, targets[:, None])[:, 0]
    top2 = logp[len(prompt) - 1 : -1].topk(2, dim=-1).values
    margins = top2[:, 0] - top2[:, 1]
    if logp[len(prompt) - 1 : -1].argmax(-1).tolist() != new or margins.min() < MIN_MARGIN:
        raise RuntimeError(
            f"{case['name']}: a greedy token within {MIN_MARGIN} nat of a tie "
            f"(min margin {margins.min():.4f}): pick another prompt"
        )
    return {
        **case,
        "prompt_token_ids": prompt,
        "token_ids": new,
        "log_probs": [round(v, 6) for v in picked[len(prompt) - 1 :].tolist()],
        "margins": [round(v, 6) for v in margins.tolist()],
        "prompt_log_probs": [round(v, 6) for v in picked[: len(prompt) - 1].tolist()],
    }


def hf_references(path: str) -> dict:
    """Greedy references for CASES from transformers on `path` (CPU, fp32, EOS ignored)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from taipan.models import KNOWN, _sha256

    d, f = os.path.split(path)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    # As ours with ignore_eos: EOS neither stops nor is masked (min_new_tokens would mask it).
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = tok.eos_token_id
    digest = _sha256(path)
    if digest != KNOWN["smollm2"].sha256:
        raise RuntimeError(f"{path}: sha256 {digest} is not smollm2's")
    return {
        "model": {"name": "smollm2", "file": f, "sha256": digest},
        "oracle": {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "device": "cpu",
            "dtype": "float32",
            "decoding": "greedy",
            "max_new_tokens": MAX_NEW_TOKENS,
            "eos": "ignored: neither stops nor is masked (taipan: ignore_eos=True)",
            "log_probs": "log_softmax of fp32 logits of one forward over prompt + continuation",
            "margins": "greedy token's log-prob minus the runner-up's, at each generated token",
        },
        "cases": [_hf_case(model, tok, case) for case in CASES],
    }


# ---- taipan against the references ----------------------------------------------------------


def run_taipan(refs: dict, device: str, dtype: str, model: str = "smollm2") -> list[dict]:
    """Serve `model` (by default the name, resolved as `--model smollm2` is) with taipan's LLM;
    per case: prompt ids (from taipan's tokenizer or chat template), greedy ids and their
    log-probs, and the teacher-forced log-probs of the reference prompt + continuation (the
    prompt log-probs of a one-token request)."""
    from taipan import LLM, SamplingParams

    cases = refs["cases"]
    greedy = SamplingParams(
        max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True, return_log_probs=True
    )
    forced = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, return_log_probs=True)
    config = dict(block_size_tokens=16, max_requests=16, max_sequence_length=256, buffer_size_gb=1)
    texts = [c for c in cases if "prompt" in c]
    chats = [c for c in cases if "chat" in c]
    with LLM(model, device=device, dtype=dtype, **config) as llm:
        outs = llm.generate([c["prompt"] for c in texts], greedy, use_tqdm=False)
        outs += llm.chat([c["chat"] for c in chats], greedy, use_tqdm=False)
        by_name = dict(zip([c["name"] for c in texts + chats], outs, strict=True))
        full = [c["prompt_token_ids"] + c["token_ids"] for c in cases]
        teacher = llm.generate(full, forced, use_tqdm=False)
    got = []
    for case, tf in zip(cases, teacher, strict=True):
        out = by_name[case["name"]]
        for o in (out, tf):
            if o.error:
                raise RuntimeError(f"{case['name']}: {o.error}")
        got.append(
            {
                "name": case["name"],
                "prompt_token_ids": list(out.prompt_token_ids),
                "token_ids": list(out.token_ids),
                "log_probs": list(out.log_probs),
                "teacher_forced": list(tf.prompt_log_probs),
            }
        )
    return got


def _first_divergence(ours: list[int], ref: list[int]) -> int | None:
    """The first index where the greedy ids differ (a shorter output differs where it ends)."""
    for i, (a, b) in enumerate(zip(ours, ref, strict=False)):
        if a != b:
            return i
    return None if len(ours) == len(ref) else min(len(ours), len(ref))


def _compare_case(ref: dict, ours: dict) -> tuple[dict, list[float]]:
    want = ref["prompt_log_probs"] + ref["log_probs"]
    diffs = [abs(a - b) for a, b in zip(ours["teacher_forced"], want, strict=True)]
    first = _first_divergence(ours["token_ids"], ref["token_ids"])
    # The greedy tokens' own log-probs (the decode path) while they follow the reference.
    same = len(ref["token_ids"]) if first is None else first
    decode = [
        abs(a - b) for a, b in zip(ours["log_probs"][:same], ref["log_probs"][:same], strict=True)
    ]
    case = {
        "name": ref["name"],
        "prompt_ids_equal": ours["prompt_token_ids"] == ref["prompt_token_ids"],
        "tokens_equal": first is None,
        "first_divergence": first,
        "ref_margin_there": ref["margins"][first] if first in range(len(ref["margins"])) else None,
        "ref_min_margin": min(ref["margins"]),
        "mean_abs": sum(diffs) / len(diffs),
        "max_abs": max(diffs),
        "decode_max_abs": max(decode, default=0.0),
    }
    return case, diffs


def compare(refs: dict, got: list[dict]) -> dict:
    """Per case: prompt ids equal, greedy ids equal (else the first divergence and the
    reference's margin there), |log-prob diff| of the teacher-forced tokens and of the greedy
    tokens while they follow the reference; overall counts, mean and maxima."""
    cases, all_diffs = [], []
    for ref, ours in zip(refs["cases"], got, strict=True):
        case, diffs = _compare_case(ref, ours)
        cases.append(case)
        all_diffs += diffs
    return {
        "cases": cases,
        "prompt_ids_equal": all(c["prompt_ids_equal"] for c in cases),
        "tokens_equal": sum(c["tokens_equal"] for c in cases),
        "num_cases": len(cases),
        "mean_abs": sum(all_diffs) / len(all_diffs),
        "max_abs": max(all_diffs),
        "decode_max_abs": max(c["decode_max_abs"] for c in cases),
    }


def problems(report: dict, dtype: str) -> list[str]:
    """What fails the tolerance of `dtype`, as sentences (empty: it passes)."""
    tol = TOLERANCES[dtype]
    out = [f"{c['name']}: prompt ids differ" for c in report["cases"] if not c["prompt_ids_equal"]]
    out += [
        f"{c['name']}: greedy ids differ from token {c['first_divergence']} "
        f"(reference margin there {c['ref_margin_there']} nat)"
        for c in report["cases"]
        if not c["tokens_equal"]
        and (
            tol.divergence_margin is None
            or c["ref_margin_there"] is None  # a longer output than the reference's
            or c["ref_margin_there"] >= tol.divergence_margin
        )
    ]
    if report["mean_abs"] > tol.mean_abs:
        out.append(f"mean |log-prob diff| {report['mean_abs']:.2e} > {tol.mean_abs} nat")
    if report["max_abs"] > tol.max_abs:
        worst = max(report["cases"], key=lambda c: c["max_abs"])["name"]
        out.append(f"max |log-prob diff| {report['max_abs']:.2e} > {tol.max_abs} nat ({worst})")
    if report["decode_max_abs"] > tol.max_abs:
        worst = max(report["cases"], key=lambda c: c["decode_max_abs"])["name"]
        out.append(
            f"max |log-prob diff| of the greedy tokens {report['decode_max_abs']:.2e} > "
            f"{tol.max_abs} nat ({worst})"
        )
    return out


def _dump(refs: dict) -> str:
    """JSON with one line per field of a case (diffs stay readable)."""
    head = {k: v for k, v in refs.items() if k != "cases"}
    lines = json.dumps(head, indent=1)[:-2] + ',\n "cases": [\n'
    cases = [
        "  {\n" + ",\n".join(f"   {json.dumps(k)}: {json.dumps(v)}" for k, v in c.items()) + "\n  }"
        for c in refs["cases"]
    ]
    return lines + ",\n".join(cases) + "\n ]\n}\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--write-references", action="store_true", help="run HF, write REFERENCES")
    p.add_argument("--model", default=None, help="the GGUF (default: the cached smollm2)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=sorted(TOLERANCES))
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.device == "cpu" and not os.path.exists("/dev/nvidiactl"):
        os.environ.setdefault("TRITON_INTERPRET", "1")  # as tests/conftest.py
    path = args.model or cached_model_path()
    if not os.path.isfile(path):
        raise SystemExit(f"{path}: no such file (tests/perf/carry_model.sh puts it there)")
    if args.write_references:
        refs = hf_references(path)
        REFERENCES.write_text(_dump(refs), encoding="utf-8")
        print(f"wrote {REFERENCES} ({len(refs['cases'])} cases)")
        return 0
    refs = load_references()
    report = compare(refs, run_taipan(refs, args.device, args.dtype, path))
    report["device"], report["dtype"] = args.device, args.dtype
    report["problems"] = problems(report, args.dtype)
    print(json.dumps(report, indent=1))
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
