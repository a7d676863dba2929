"""The `taipan` command: serve, generate, replay, bench, keys.

Errors a user can fix (bad config, unknown model, a request the runtime refused, a corrupt log)
print one line `taipan: error: ...` and exit non-zero; no traceback.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading

from taipan.actors.client.actor import DEFAULT_TIMEOUT_S, RuntimeUnreachable
from taipan.actors.config import ConfigError
from taipan.actors.curve import CurveError
from taipan.actors.log import configure
from taipan.auth import curve_keys
from taipan.children import deferring, describe_exit
from taipan.flags import add_http_arguments, add_runtime_arguments
from taipan.launcher import runtime_from_args


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="taipan", description="LLM inference runtime")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run coordinator + engines until SIGINT/SIGTERM")
    add_runtime_arguments(serve)
    add_http_arguments(serve)
    serve.add_argument("--address", help="client address, e.g. tcp://127.0.0.1:5555")
    serve.add_argument(
        "--role",
        default="all",
        choices=["all", "coordinator", "engine", "tp-follower"],
        help="all (default): coordinator and every engine rank here; coordinator: only the "
        "coordinator (engines join from other hosts); engine: one engine rank, joining "
        "--coordinator; tp-follower: one tensor-parallel follower of an engine rank, joining "
        "its leader at --tp-address",
    )
    serve.add_argument(
        "--engine-address",
        help="where the coordinator listens for engines (role coordinator; default: the port "
        "after --address's)",
    )
    serve.add_argument(
        "--coordinator",
        metavar="ADDRESS",
        help="role engine: the coordinator's engine address, e.g. tcp://HOST:5556",
    )
    serve.add_argument(
        "--data-parallel-rank",
        type=int,
        metavar="R",
        help="roles engine and tp-follower: the engine rank",
    )
    serve.add_argument(
        "--tp-address",
        metavar="tcp://HOST:PORT",
        help="tensor parallelism across hosts: role engine (the rank's leader) binds PORT and "
        "PORT+1 and hosts torch.distributed's rendezvous on PORT+2, and starts no follower; "
        "each role tp-follower connects there",
    )
    serve.add_argument(
        "--tensor-parallel-rank",
        type=int,
        metavar="K",
        help="role tp-follower: this follower's rank in its engine rank's group (1..T-1)",
    )
    serve.add_argument(
        "--ep-inboxes",
        metavar="ADDRESSES",
        help="expert parallelism across hosts (role engine): every data-parallel rank's "
        "consensus inbox, comma-separated tcp://HOST:PORT in rank order, the same list on every "
        "engine; each engine binds its own",
    )
    serve.add_argument(
        "--ep-init",
        metavar="tcp://HOST:PORT",
        help="expert parallelism across hosts (role engine): the group's torch.distributed "
        "rendezvous, hosted by the group's first rank (every engine of a group the same)",
    )
    serve.add_argument(
        "--start-timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="how long to wait for every engine rank to load its model (with --tp-address: "
        "how long a leader waits for its followers, a follower for its leader) (default 600)",
    )
    add_key_arguments(serve)
    serve.set_defaults(log_level="info")  # a server logs its controls and start-up

    gen = sub.add_parser("generate", help="generate completions for prompts")
    add_runtime_arguments(gen)
    gen.add_argument("--address", help="use a running runtime instead of starting one")
    gen.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help=f"seconds a silent runtime is waited for (default {DEFAULT_TIMEOUT_S:g})",
    )
    add_key_arguments(gen)
    gen.add_argument("--prompt", action="append", required=True, help="repeatable")
    gen.add_argument("--max-tokens", type=int, default=16, help="tokens to generate")
    gen.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2]")
    gen.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2]")
    gen.add_argument("--repetition-penalty", type=float, default=1.0, help="> 0; 1 = off")
    gen.add_argument("--min-tokens", type=int, default=0, help="tokens before EOS may end it")
    gen.add_argument(
        "--logit-bias",
        type=json.loads,
        default=None,
        help="JSON object of token id -> bias in [-100, 100], e.g. '{\"13\": -100}'",
    )
    gen.add_argument(
        "--stop",
        action="append",
        default=[],
        help="end the text before this string (repeatable; matched on the generated text)",
    )
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt per line")

    from taipan import replay

    rep = sub.add_parser("replay", help="print or check a recorded message log")
    replay.add_arguments(rep)

    from taipan import bench

    b = sub.add_parser("bench", help="throughput: ours vs Hugging Face transformers")
    add_runtime_arguments(b)
    bench.add_arguments(b)

    keys = sub.add_parser(
        "keys",
        help="write CurveZMQ keys for serving over tcp beyond loopback",
        description="Write a CurveZMQ key set into DIR: the server's pair (server.key, "
        "server.secret) and client pairs (NAME.key, NAME.secret), each client's public key also "
        "in DIR/authorized/, the keys the server admits. Secrets are mode 0600, DIR 0700. Copy "
        "DIR to the server's host; a client needs server.key and its own pair.",
    )
    keys.add_argument("dir", metavar="DIR")
    who = keys.add_mutually_exclusive_group()
    who.add_argument(
        "--client",
        action="append",
        metavar="NAME",
        help="name a client pair of the new set (repeatable; default: one named 'client')",
    )
    who.add_argument(
        "--add-client",
        action="append",
        metavar="NAME",
        help="add a client pair to the set in DIR, keeping its server pair (repeatable)",
    )
    keys.add_argument("--force", action="store_true", help="replace keys that exist")
    return parser


def cmd_keys(args) -> int:
    from taipan.actors.curve import write_keys

    if args.add_client:
        written = write_keys(args.dir, args.add_client, server=False, force=args.force)
    else:
        written = write_keys(args.dir, args.client, force=args.force)
    for path in written:
        print(path)
    return 0


def add_key_arguments(p) -> None:
    p.add_argument(
        "--keys",
        metavar="DIR",
        help="CurveZMQ keys (`taipan keys DIR`): tcp sockets authenticate with them; binding "
        "tcp beyond loopback needs them",
    )
    p.add_argument(
        "--key-name", default="client", help="which client key pair of DIR to use (default client)"
    )


class Terminated(SystemExit):
    """SIGTERM while `taipan serve` starts (cmd_serve stops cleanly). The handler raises it
    wherever the main thread is; asyncio re-raises SystemExit and KeyboardInterrupt from its
    callbacks but logs and drops any other exception ("Exception in callback ..."): an
    Exception landing in a callback of the start's wait let the start go on to serve, the
    SIGTERM lost."""


def stop_signal_handler(started: threading.Event, stop: threading.Event):
    """`taipan serve`'s SIGINT/SIGTERM handler. Installed before the start: a SIGTERM that comes
    while the start returns (clients may already stream: the engines are up) stops the runtime
    cleanly, exit 0, instead of killing the process by its default action. During the start a
    SIGTERM aborts it (Terminated: exit 0, a stop asked for) and a SIGINT too
    (KeyboardInterrupt, exit 130)."""

    def on_signal(signum, _frame) -> None:
        if started.is_set():
            stop.set()
        elif signum == signal.SIGTERM:
            raise Terminated(0)
        else:
            raise KeyboardInterrupt

    return deferring(on_signal)  # (not while a child is being spawned)


def cmd_serve(args) -> int:
    """Serve until SIGINT/SIGTERM (exit 0), or until the coordinator, the HTTP server or the last
    engine rank dies (exit 1, naming it). While other ranks live, a dead rank is logged (its
    requests failed, the coordinator routes around it) and serving goes on; the exit code is
    then 1 too."""
    configure(args.log_level)
    rt = runtime_from_args(args, args.address)
    stop = threading.Event()

    def on_exit(name: str, code: int) -> None:
        if rt.role == "engine" or not name.startswith("engine-") or rt.engines_alive() == 0:
            stop.set()  # nothing left to serve with: shut down too

    rt.on_child_exit(on_exit)
    started = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop_signal_handler(started, stop))
    try:
        try:  # (a signal here: shut down, see above)
            if rt.role == "coordinator":
                _say(
                    f"taipan: coordinator at {rt.address}; waiting for {rt.num_ranks} engine "
                    f"rank(s) at {rt.engine_address}"
                )
            rt.start(timeout=args.start_timeout)
            started.set()
        except Terminated:
            return 0
        _print_serving(rt)
        stop.wait()
    finally:
        rt.shutdown()
    if rt.role in ("engine", "tp-follower") and all(c == 0 for _, c in rt.unexpected_exits):
        return 0  # the coordinator (or the follower's leader) stopped it
    if rt.unexpected_exits:
        for name, code in rt.unexpected_exits:
            print(f"taipan: error: {name} {describe_exit(code)}", file=sys.stderr)
        print("taipan: error: the runtime stopped", file=sys.stderr)
        return 1
    return 0


def _print_serving(rt) -> None:
    if rt.role == "tp-follower":
        _say(
            f"taipan: tensor-parallel follower {rt.tp_rank} of {rt.tp_size} of engine rank "
            f"{rt.rank} joining its leader at {rt.tp_address}"
        )
        return
    if rt.role == "engine":
        leads = f", leading its followers at {rt.tp_address}" if rt.tp_address else ""
        _say(f"taipan: engine rank {rt.rank} of {rt.num_ranks} joining {rt.engine_address}{leads}")
        return
    info = rt.model_info
    # Under tensor parallelism each peer holds its kv heads of every block: the bytes are one's.
    peers = f" of {rt.tp_size} tensor-parallel processes" if rt.tp_size > 1 else ""
    per = " per process" if rt.tp_size > 1 else ""
    _say(
        f"taipan: serving {rt.model_name} at {rt.address} on {rt.num_ranks} engine rank(s)"
        f"{peers}; KV cache of {info.kv_cache_tokens} tokens ({info.kv_cache_bytes / 1024**3:.2f}"
        f" GiB{per}) per rank; control token in {rt.token_path}"
    )
    if rt.http_url:
        _say(f"taipan: OpenAI API at {rt.http_url}")


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def cmd_generate(args) -> int:
    from taipan.client import Client
    from taipan.messages.requests import FinishReason, SamplingParams

    sampling = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        stop=tuple(args.stop),
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        min_tokens=args.min_tokens,
        logit_bias=args.logit_bias,
    )
    problems = sampling.problems()
    if problems:
        raise ConfigError("; ".join(problems))
    rt = None
    if args.address is None:
        rt = runtime_from_args(args).start()
    try:
        address = args.address or rt.address
        keys = curve_keys(address, args.keys, server=False, key_name=args.key_name)
        with Client(address, timeout=args.timeout, curve=keys) as client:
            done = client.generate(args.prompt, sampling, chat=args.chat, raise_on_error=False)
    finally:
        if rt is not None:
            rt.shutdown()
    failed = 0
    for prompt, c in zip(args.prompt, done, strict=True):
        failed += c.finish_reason == FinishReason.ERROR
        if args.json:
            row = {
                "prompt": prompt,
                "text": c.text,
                "token_ids": c.token_ids,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            if c.error:
                row["error"] = c.error
            print(json.dumps(row), flush=True)
        elif c.error:
            print(f"taipan: error: {c.error}", file=sys.stderr)
        else:
            print(c.text, flush=True)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> None:
    from taipan.launcher import LaunchError
    from taipan.models import ModelNotFoundError

    args = _parser().parse_args(argv)
    handlers = {"serve": cmd_serve, "generate": cmd_generate, "keys": cmd_keys}
    try:
        if args.command == "replay":
            from taipan import replay

            code = replay.run(args)
        elif args.command == "bench":
            from taipan import bench

            code = bench.run(args)
        else:
            code = handlers[args.command](args)
    except (
        ConfigError,
        CurveError,
        ModelNotFoundError,
        LaunchError,
        RuntimeUnreachable,
        ValueError,
    ) as e:
        print(f"taipan: error: {e}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)


if __name__ == "__main__":
    main()
