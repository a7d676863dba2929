"""The `relay` workload of `taipan bench`: how many output tokens and messages a second one
coordinator relays. Needs no model and no GPU. Per engine count N of `--num-engines`: the real
coordinator process, N synthetic engine ranks and `--clients` client processes (all three in
taipan.bench.relay_peers, started here as `python -m`). The engines stream tokens without
computing, one StepOutputs per step over their running requests (up to `--batch`), back to back
or `--steps-per-s` a second; the clients submit N x `--num-requests` requests at once
(`--output-len` tokens each, streamed unless `--no-stream`) and check every token. One row per
N: output tokens a second, the coordinator's messages in and out a second, its CPU share (from
/proc) and output tokens per CPU second, against eight ranks of the 1B shape (`TARGET_*`); a
lost, failed or out-of-order token, or counts that disagree, break `invariants_hold`.
tests/perf/NOTES.md defines every figure.

`TAIPAN_RELAY_PROFILE=PATH`: the coordinator runs under cProfile and writes its stats to
PATH-N.prof for N engines (`python -m pstats`). Imports no peer code and no torch.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time

# One H100 rank of the 1B shape: ~15,000 output tok/s offline with ~256 requests in each step,
# i.e. ~59 steps (StepOutputs) a second, each carrying 256 one-token outputs; eight such ranks.
TARGET_RANK_TOK_S = 15_000
TARGET_BATCH = 256
TARGET_RANKS = 8
PROMPT_LEN = 32
START_TIMEOUT_S = 60.0
RUN_TIMEOUT_S = 900.0
STOP_TIMEOUT_S = 10.0


def add_arguments(p) -> None:
    p.add_argument(
        "--num-engines", default="1,2,4,8", help="relay: comma-separated synthetic engine counts"
    )
    p.add_argument("--batch", type=int, default=256, help="relay: requests per engine step")
    p.add_argument(
        "--clients",
        type=int,
        default=None,
        help="relay: client processes (default: half the cores, 2 to 8)",
    )
    p.add_argument(
        "--steps-per-s",
        type=float,
        default=0.0,
        help="relay: each engine's step rate (0: as fast as the coordinator takes them)",
    )
    p.add_argument(
        "--no-stream", action="store_true", help="relay: one output per request, at its end"
    )


def relay_workload(args) -> list[dict]:
    engine_counts = [int(n) for n in str(args.num_engines).split(",") if n.strip()]
    output_len = args.output_len or 256
    if min(engine_counts, default=0) < 1 or args.num_requests < 1 or output_len < 1:
        raise ValueError("--num-engines, --num-requests and --output-len must be >= 1")
    if args.clients is None:
        args.clients = min(8, max(2, (os.cpu_count() or 2) // 2))
    if args.batch < 1 or args.clients < 1:
        raise ValueError("--batch and --clients must be >= 1")
    return [_run_one(args, n, output_len) for n in engine_counts]


def _spec(args, tmp: str, num_engines: int, output_len: int) -> dict:
    from taipan.actors.config import InferenceConfig
    from taipan.auth import new_token, write_token
    from taipan.spec import LaunchSpec

    frontend, backend = f"ipc://{tmp}/clients.sock", f"ipc://{tmp}/engines.sock"
    token_file = os.path.join(tmp, "control-token.json")
    write_token(token_file, frontend, new_token())
    total = num_engines * args.num_requests
    profile = os.environ.get("TAIPAN_RELAY_PROFILE")
    config = InferenceConfig(max_requests=args.batch)
    coordinator = LaunchSpec.for_coordinator(
        frontend, backend, num_engines, "synthetic", config, token_file, log_level="warning"
    )
    return {
        # The real coordinator's launch spec (runtime/procs.py), and where to profile it.
        "coordinator": coordinator.to_dict(),
        "profile": f"{profile}-{num_engines}.prof" if profile else None,
        # The synthetic engines' and the clients'.
        "frontend": frontend,
        "backend": backend,
        "log_level": "warning",
        "batch": args.batch,
        "steps_per_s": args.steps_per_s,
        "output_len": output_len,
        "prompt_len": PROMPT_LEN,
        "stream": not args.no_stream,
        "timeout": START_TIMEOUT_S,
        "requests": [
            total // args.clients + (i < total % args.clients) for i in range(args.clients)
        ],
    }


class Peer:
    """One process of the bench, its `RELAY {json}` lines read by a thread of its own (a
    blocking read, so nothing polls and no line waits in a buffer)."""

    def __init__(self, role: str, spec: str, *extra: str, stdin=None):
        cmd = [sys.executable, "-m", "taipan.bench.relay_peers", role, spec, *extra]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.name = " ".join([role, *extra])
        self.proc = subprocess.Popen(cmd, env=env, stdin=stdin, stdout=subprocess.PIPE, text=True)
        self.results: queue.Queue[dict | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("RELAY "):
                self.results.put(json.loads(line[len("RELAY ") :]))
        self.results.put(None)  # it exited

    def result(self, deadline: float) -> dict:
        """Its next result (RuntimeError if it exits or the deadline passes first)."""
        try:
            got = self.results.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise RuntimeError(f"relay bench: no result from {self.name} in time") from None
        if got is None:
            raise RuntimeError(f"relay bench: {self.name} exited ({self.proc.wait()})")
        return got

    def say(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        """SIGTERM is a peer's clean stop (the coordinator writes its profile then); a peer
        that does not exit in time is killed."""
        proc = self.proc
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdin is not None:
            proc.stdin.close()


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a live process, every thread of it."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _run_one(args, num_engines: int, output_len: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="taipan-relay-") as tmp:
        spec = _spec(args, tmp, num_engines, output_len)
        text = json.dumps(spec)
        peers: list[Peer] = []
        try:
            peers.append(coordinator := Peer("coordinator", text))
            engines = [Peer("engine", text, str(r)) for r in range(num_engines)]
            clients = [
                Peer("client", text, str(i), stdin=subprocess.PIPE) for i in range(args.clients)
            ]
            peers += engines + clients
            deadline = time.monotonic() + START_TIMEOUT_S
            for c in clients:
                c.result(deadline)  # ready: every rank has registered
            watched = [coordinator, *engines]
            cpu0 = [_cpu_seconds(p.proc.pid) for p in watched]
            t0 = time.perf_counter()
            for c in clients:
                c.say("go")
            deadline = time.monotonic() + RUN_TIMEOUT_S
            done = [c.result(deadline) for c in clients]
            wall = time.perf_counter() - t0
            cpu = [_cpu_seconds(p.proc.pid) - c0 for p, c0 in zip(watched, cpu0, strict=True)]
            coordinator.stop()  # first: engines that leave before it would be logged dead
            for e in engines:
                e.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + STOP_TIMEOUT_S
            counts = [e.result(deadline) for e in engines]
        finally:
            for p in peers:
                p.stop()
    return _row(args, spec, num_engines, done, counts, cpu, wall)


def _messages(done: list[dict], counts: list[dict]) -> tuple[int, int, dict[str, int]]:
    """(messages into the coordinator, messages out of it, what the clients got by type). In:
    submissions, StepOutputs, heartbeats (engines' and clients': a client's is answered); out:
    EngineSubmits, everything the clients got, the answers to the engines' heartbeats."""
    received: dict[str, int] = {}
    for d in done:
        for name, n in d["received"].items():
            received[name] = received.get(name, 0) + n
    engines = {k: sum(c.get(k, 0) for c in counts) for k in ("steps", "heartbeats", "submits")}
    msgs_in = sum(d["requests"] for d in done) + engines["steps"] + engines["heartbeats"]
    msgs_in += received.get("Heartbeat", 0)
    msgs_out = engines["submits"] + sum(c.get("heartbeats_answered", 0) for c in counts)
    msgs_out += sum(n for name, n in received.items() if name != "ModelInfo")
    return msgs_in, msgs_out, received


def _broken(spec: dict, done: list[dict], counts: list[dict]) -> list[str]:
    """The invariants the run broke, by name."""
    total, tokens = sum(d["requests"] for d in done), sum(d["tokens"] for d in done)
    checks = {
        "every request complete and in order": sum(d["failed"] for d in done) == 0,
        "clients got every token": tokens == total * spec["output_len"],
        "engines made every token": sum(c.get("tokens", 0) for c in counts) == tokens,
        "every engine output relayed": sum(d["outputs"] for d in done)
        == sum(c.get("entries", 0) for c in counts),
        "engines got every request": sum(c.get("submits", 0) for c in counts) == total,
    }
    return [name for name, ok in checks.items() if not ok]


def _row(args, spec, num_engines, done, counts, cpu, wall) -> dict:
    """The row of one engine count: `done` the clients' results, `counts` the engines', `cpu`
    the CPU seconds of the coordinator and each engine over the `wall` seconds of the run."""
    seconds = max(d["end"] for d in done) - min(d["start"] for d in done)
    tokens = sum(d["tokens"] for d in done)
    steps, entries = (
        sum(c.get("steps", 0) for c in counts),
        sum(c.get("entries", 0) for c in counts),
    )
    msgs_in, msgs_out, received = _messages(done, counts)
    row = {
        "workload": "relay",
        "synthetic_engines": True,
        "engines": num_engines,
        "clients": len(done),
        "batch": args.batch,
        "steps_per_s_asked": args.steps_per_s or None,
        "stream": spec["stream"],
        "num_requests": sum(d["requests"] for d in done),
        "output_len": spec["output_len"],
        "seconds": round(seconds, 3),
        "output_tokens": tokens,
        "output_tok_s": round(tokens / seconds, 1),
        "engine_steps": steps,
        "relayed_outputs": entries,
        "entries_per_step": round(entries / max(1, steps), 1),
        "coordinator_msgs_in": msgs_in,
        "coordinator_msgs_out": msgs_out,
        "coordinator_msgs_in_s": round(msgs_in / seconds, 1),
        "coordinator_msgs_out_s": round(msgs_out / seconds, 1),
        "client_messages": received,
        "coordinator_cpu_share": round(cpu[0] / wall, 3),
        "coordinator_tok_per_cpu_s": round(tokens / max(cpu[0], 1e-9), 1),
        "engines_cpu_share": round(sum(cpu[1:]) / wall, 3),
        "clients_cpu_share": round(sum(d["cpu_seconds"] for d in done) / wall, 3),
        "target_tok_s": TARGET_RANKS * TARGET_RANK_TOK_S,
        "target_steps_s": round(TARGET_RANKS * TARGET_RANK_TOK_S / TARGET_BATCH, 1),
    }
    broken = _broken(spec, done, counts)
    row["invariants_hold"] = not broken
    if broken:
        row["broken"] = broken
        row["problems"] = [p for d in done for p in d["problems"]][:5]
        print(f"taipan bench: relay with {num_engines} engines: {broken}", file=sys.stderr)
    return row


def relay_summary(row: dict) -> str:
    return (
        f"relay {row['engines']} synthetic engines x batch {row['batch']}, {row['clients']} "
        f"clients: {row['output_tok_s']} output tok/s, coordinator messages in "
        f"{row['coordinator_msgs_in_s']}/s out {row['coordinator_msgs_out_s']}/s, coordinator "
        f"CPU {row['coordinator_cpu_share']} ({row['coordinator_tok_per_cpu_s']} tok per CPU s; "
        f"target {row['target_tok_s']} tok/s), invariants hold {row['invariants_hold']}"
    )
