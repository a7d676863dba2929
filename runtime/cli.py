"""The `taipan` command: serve, generate, replay, bench.

Errors a user can fix (bad config, unknown model, a request the runtime refused, a corrupt log)
print one line `taipan: error: ...` and exit non-zero; no traceback.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading

from runtime.config import ConfigError, InferenceConfig


def _runtime_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="smollm2, a .gguf file or an HF directory")
    p.add_argument("--config", help="JSON file with InferenceConfig fields")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="set an InferenceConfig field (repeatable)",
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--record", metavar="DIR", help="record every actor's messages into DIR")
    p.add_argument("--log-level", default=None, help="debug, info, warning (default), error")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="taipan", description="LLM inference runtime")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run coordinator + engines until SIGINT/SIGTERM")
    _runtime_args(serve)
    serve.add_argument("--address", help="client address, e.g. tcp://127.0.0.1:5555")

    gen = sub.add_parser("generate", help="generate completions for prompts")
    _runtime_args(gen)
    gen.add_argument("--address", help="use a running runtime instead of starting one")
    gen.add_argument("--prompt", action="append", required=True, help="repeatable")
    gen.add_argument("--max-tokens", type=int, default=16, help="tokens to generate")
    gen.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt per line")

    from runtime import replay

    rep = sub.add_parser("replay", help="print or check a recorded message log")
    replay.add_arguments(rep)

    from runtime import bench

    b = sub.add_parser("bench", help="throughput: ours vs Hugging Face transformers")
    _runtime_args(b)
    bench.add_arguments(b)
    return parser


def build_runtime(args, address: str | None = None):
    from runtime.launcher import Runtime

    config = InferenceConfig.from_cli(args.config, args.set)
    return Runtime(
        args.model,
        config,
        address=address,
        record_dir=args.record,
        dtype=args.dtype,
        device=args.device,
        log_level=args.log_level,
    )


def cmd_serve(args) -> int:
    rt = build_runtime(args, args.address)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    rt.on_child_exit(lambda name, code: stop.set())  # a child died: shut down too
    try:
        rt.start()
        print(f"taipan: serving {rt.model_name} at {rt.address}", file=sys.stderr, flush=True)
        stop.wait()
    finally:
        rt.shutdown()
    return 0


def cmd_generate(args) -> int:
    from messages.requests import SamplingParams
    from runtime.client import Client

    sampling = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    problems = sampling.problems()
    if problems:
        raise ConfigError("; ".join(problems))
    rt = None
    if args.address is None:
        rt = build_runtime(args).start()
    try:
        with Client(args.address or rt.address) as client:
            done = client.generate(args.prompt, sampling, chat=args.chat, raise_on_error=False)
    finally:
        if rt is not None:
            rt.shutdown()
    failed = 0
    for prompt, c in zip(args.prompt, done, strict=True):
        failed += c.finish_reason == "error"
        if args.json:
            row = {
                "prompt": prompt,
                "text": c.text,
                "token_ids": c.token_ids,
                "finish_reason": c.finish_reason,
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
    from runtime.launcher import LaunchError
    from runtime.models import ModelNotFoundError

    args = _parser().parse_args(argv)
    handlers = {"serve": cmd_serve, "generate": cmd_generate}
    try:
        if args.command == "replay":
            from runtime import replay

            code = replay.run(args)
        elif args.command == "bench":
            from runtime import bench

            code = bench.run(args)
        else:
            code = handlers[args.command](args)
    except (ConfigError, ModelNotFoundError, LaunchError, ValueError) as e:
        print(f"taipan: error: {e}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)


if __name__ == "__main__":
    main()
