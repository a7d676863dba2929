"""`taipan bench`: its flags, the run of one workload family, the results file and the printed
lines. Ours vs Hugging Face transformers vs the hardware, on one model, the same token ids and
the same precision, greedy, every request generating exactly the tokens it asked for (EOS
neither stops nor is masked). Ours always runs first, through the real runtime, so that its
engine has the device to itself. Each run appends its rows, stamped with date, machine and
command, to tests/perf/results.jsonl (`--results`); tests/perf/NOTES.md says what they mean.

A row that breaks physics carries `invalid` (why): it is printed, never written, `taipan bench:
INVALID ...` goes to stderr and the run exits 1 (after writing its valid rows). A row whose
`outputs_equal` or `invariants_hold` is false is written, and the run exits 1 too. No workload
logic lives here: each family owns its rows and its summary line, and is imported by `run`, not
at CLI start (`add_arguments` imports only taipan.bench.relay's flags, plain stdlib).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys

RESULTS = os.path.join("tests", "perf", "results.jsonl")


def add_arguments(p) -> None:
    p.add_argument(
        "--workload",
        default="generate",
        choices=[
            "generate",
            "decode",
            "offline",
            "shared-prefix",
            "http-load",
            "relay",
            "weight-sync",
            "structured",
            "spec",
        ],
        help="generate: N prompts x M tokens vs HF (default); decode: step time per batch vs "
        "the floor; offline: many requests of ShareGPT-like lengths; shared-prefix: prefix "
        "caching off vs on, on a shared system prompt and on n samples of one prompt; "
        "http-load: N concurrent streams, some dropped mid-way, over HTTP vs AsyncClient; "
        "weight-sync: a trainer's weights into taipan over NCCL/gloo vs the raw broadcast; "
        "structured: concurrent streams with and without a json_schema; "
        "spec: speculative decoding (n-gram) off vs on, input-grounded and free generation",
    )
    p.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="generate, shared-prefix: prompts (32); http-load: requests (200); "
        "structured: streams (64); spec: requests per workload (8)",
    )
    p.add_argument(
        "--output-len",
        type=int,
        default=None,
        help="generate, shared-prefix, http-load: tokens (64); decode: steps (128); "
        "structured, spec: tokens (128)",
    )
    p.add_argument(
        "--drop-share",
        type=float,
        default=0.2,
        help="http-load: share of the requests (seeded) whose client hangs up mid-stream",
    )
    p.add_argument(
        "--drop-after",
        type=int,
        default=2,
        help="http-load: text chunks a dropped request reads before its client hangs up",
    )
    p.add_argument(
        "--prefix-len",
        type=int,
        default=None,
        help="shared-prefix: shared prompt tokens (1024 on CUDA, 512 on CPU)",
    )
    p.add_argument(
        "--eviction",
        default="lru",
        choices=["lru", "ref_zero"],
        help="shared-prefix: prefix_caching_eviction_policy of the caching-on runs",
    )
    p.add_argument(
        "--mamba-gb",
        type=float,
        default=None,
        help="shared-prefix, hybrid models: prefix_caching_mamba_gb of the caching-on runs "
        "(2 on CUDA, 0.01 on CPU)",
    )
    p.add_argument(
        "--hf-prompts",
        type=int,
        default=4,
        help="shared-prefix: HF runs the first K prompts of each scenario one at a time",
    )
    p.add_argument("--prompt-len", type=int, default=128, help="decode: prompt tokens")
    p.add_argument("--batches", default="1,8,64,256", help="decode: comma-separated batch sizes")
    p.add_argument(
        "--log-probs",
        action="store_true",
        help="decode: every request asks its generated tokens' log-probs (as an RL rollout "
        "does; not the prompt's)",
    )
    p.add_argument(
        "--num-requests", type=int, default=1000, help="offline: requests; relay: per engine"
    )
    p.add_argument(
        "--hf-requests",
        type=int,
        default=None,
        help="offline: time HF (and ours again, for the ratio) on the first K requests only",
    )
    p.add_argument("--hf-batch", type=int, default=64, help="offline: HF generate's batch size")
    p.add_argument("--max-len", type=int, default=1024, help="offline: longest prompt / output")
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="decode/offline/shared-prefix: prompts and lengths; http-load: the dropped requests",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="structured: the streams' sampling temperature (0: greedy; above it every stream "
        "draws, unseeded, with no top-k, top-p or min-p: an RL rollout's sampling)",
    )
    p.add_argument(
        "--copy-gib", type=float, default=1.0, help="decode: copy-bandwidth buffer size (GiB)"
    )
    p.add_argument(
        "--ours-modes",
        default=None,
        help="decode: comma list of ours' modes to time, from graphs,eager,serial,nccl (default: "
        "every one that applies; graphs, or eager on a CPU, must be in it)",
    )
    p.add_argument(
        "--hf-repeats",
        type=int,
        default=3,
        help="decode: timed T1/TN pairs per HF mode and batch (the step is from their medians)",
    )
    p.add_argument(
        "--trainer-device",
        default=None,
        help="weight-sync: the trainer's device (default cuda:0 on CUDA, else cpu); --device "
        "is taipan's and must be another GPU",
    )
    p.add_argument("--bucket-mb", type=int, default=1024, help="weight-sync: bucket size (MiB)")
    p.add_argument("--sync-rounds", type=int, default=3, help="weight-sync: timed updates")
    p.add_argument(
        "--sync-path",
        action="store_true",
        help="weight-sync: also time one update through a checkpoint saved to disk",
    )
    p.add_argument(
        "--in-flight",
        action="store_true",
        help="weight-sync: update while RUNNING (push_weights(in_flight=True)), no pause/unpause",
    )
    p.add_argument(
        "--spec-tokens",
        type=int,
        default=4,
        help="spec: num_speculative_tokens (n-gram drafts per step) of the speculation-on runs",
    )
    p.add_argument(
        "--spec-chain",
        type=int,
        default=1,
        help="spec: also run n-gram speculation with speculative_chain_steps N (verify steps "
        "chained in the gpu actor), a third side of the same run (1: not run)",
    )
    p.add_argument(
        "--spec-draft",
        default=None,
        help="spec: a draft model (a path, a name, or self:N, the target's first N layers) "
        "drafts instead of n-gram lookup",
    )
    p.add_argument(
        "--spec-method",
        choices=("ngram", "draft_model", "mtp"),
        default=None,
        help="spec: who drafts (default: draft_model with --spec-draft, else ngram; mtp: the "
        "checkpoint's own multi-token-prediction head)",
    )
    p.add_argument(
        "--spec-off-above",
        type=int,
        default=None,
        help="spec: speculative_disable_by_batch_size N of the speculating runs (no drafts in a "
        "step planned while more than N requests run)",
    )
    p.add_argument(
        "--spec-batch",
        type=int,
        default=1,
        help="spec: requests in flight at once (1: batch-1 decode)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object per workload")
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face side")
    p.add_argument("--results", default=RESULTS, help="JSONL file each run appends to")
    from taipan.bench.relay import add_arguments as add_relay_arguments

    add_relay_arguments(p)  # relay: one coordinator's capacity, synthetic engines


def run(args) -> int:
    # Here, not at module level: `taipan --help` loads no workload family.
    from taipan.bench.decode import decode_workload
    from taipan.bench.generate import generate_workload
    from taipan.bench.http_load import http_load_workload
    from taipan.bench.offline import offline_workload
    from taipan.bench.relay import relay_workload
    from taipan.bench.shared_prefix import shared_prefix_workload
    from taipan.bench.spec import spec_workload
    from taipan.bench.structured import structured_workload
    from taipan.bench.weight_sync import weight_sync_workload

    workloads = {
        "generate": generate_workload,
        "decode": decode_workload,
        "offline": offline_workload,
        "shared-prefix": shared_prefix_workload,
        "http-load": http_load_workload,
        "relay": relay_workload,
        "weight-sync": weight_sync_workload,
        "structured": structured_workload,
        "spec": spec_workload,
    }
    rows = workloads[args.workload](args)
    stamp = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus",
        "command": "taipan " + " ".join(sys.argv[1:]),
        "data_parallel_size": getattr(args, "data_parallel_size", 1),
        "tensor_parallel_size": getattr(args, "tensor_parallel_size", 1),
        "expert_parallel_size": getattr(args, "expert_parallel_size", 1),
    }
    os.makedirs(os.path.dirname(args.results) or ".", exist_ok=True)
    for row in rows:
        row.update(stamp)
        if not row.get("invalid"):
            with open(args.results, "a") as f:
                f.write(json.dumps(row) + "\n")
        line = json.dumps(row) if args.json else _summary(row)
        print(line if args.json or not row.get("invalid") else "INVALID " + line, flush=True)
    refused = [row for row in rows if row.get("invalid")]
    for row in refused:
        batch = f" batch {row['batch']}" if row.get("batch") is not None else ""
        print(
            f"taipan bench: INVALID {row['workload']}{batch}, not written to {args.results}: "
            f"{row['invalid']}",
            file=sys.stderr,
        )
    failed = any(
        row.get("outputs_equal") is False or row.get("invariants_hold") is False for row in rows
    )
    return 1 if failed or refused else 0


def _summary(row: dict) -> str:
    """One human line per row, in its family's words."""
    workload = row["workload"]
    if workload == "decode":
        from taipan.bench.decode import decode_summary

        return decode_summary(row)
    if workload == "offline":
        from taipan.bench.offline import offline_summary

        return offline_summary(row)
    if workload == "shared-prefix":
        from taipan.bench.shared_prefix import shared_prefix_summary

        return shared_prefix_summary(row)
    if workload == "relay":
        from taipan.bench.relay import relay_summary

        return relay_summary(row)
    if workload == "weight-sync":
        from taipan.bench.weight_sync import weight_sync_summary

        return weight_sync_summary(row)
    if workload == "structured":
        from taipan.bench.structured import structured_summary

        return structured_summary(row)
    if workload == "spec":
        from taipan.bench.spec import spec_summary

        return spec_summary(row)
    if workload == "http-load":
        from taipan.bench.http_load import http_load_summary

        return http_load_summary(row)
    from taipan.bench.generate import generate_summary  # generate-NxM

    return generate_summary(row)
