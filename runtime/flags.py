"""The command-line flags that build a Runtime: `add_runtime_arguments` (the model, its config,
dtype and device, recording, the parallel sizes, the log level: `taipan serve`, `generate` and
`bench`) and `add_http_arguments` (`taipan serve`'s OpenAI-compatible HTTP server). The launcher
reads them back (runtime/launcher.py `runtime_from_args`); the flags of one role or another
(`--role`, `--coordinator`, `--tp-address`, ...) are `taipan serve`'s own (runtime/cli.py).
Argument parsing only: it imports nothing of the runtime.
"""

from __future__ import annotations


def add_runtime_arguments(p) -> None:
    """The command-line options that build a Runtime (serve, generate, bench)."""
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
    p.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="engine ranks behind the coordinator, each with its own model replica (CUDA: rank r "
        "on the r-th GPU; CPU: each rank its share of the cores)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        metavar="T",
        help="each engine rank's weights split over T processes (CUDA: rank r's peers on GPUs "
        "r*T .. r*T+T-1; CPU: the rank's cores split between them); Llama, Qwen3-MoE, "
        "NemotronH and Qwen3-Next models",
    )
    p.add_argument(
        "--expert-parallel-size",
        type=int,
        default=1,
        metavar="E",
        help="split each mixture-of-experts model's experts over groups of E consecutive "
        "engine ranks (E divides --data-parallel-size); attention stays data parallel; with "
        "--tensor-parallel-size, each expert split over the rank's T processes too",
    )
    p.add_argument("--log-level", default=None, help="debug, info, warning (default), error")


def add_http_arguments(p) -> None:
    """`taipan serve`'s OpenAI-compatible HTTP server options."""
    p.add_argument("--http-port", type=int, help="serve the OpenAI API on this port")
    p.add_argument("--http-host", default="127.0.0.1", help="its address (default 127.0.0.1)")
    p.add_argument("--api-key", help="require Authorization: Bearer KEY on /v1/*")
    p.add_argument("--served-model-name", help="the model id of the API (default: the model's)")
    p.add_argument(
        "--max-queued",
        type=int,
        metavar="N",
        help="at most N requests in flight through the HTTP server, each choice counted (n x "
        "prompts); more wait (default 1024)",
    )
    p.add_argument(
        "--queue-timeout",
        type=float,
        metavar="SECONDS",
        help="how long a request waits for room before a 503 with Retry-After (0: refuse at "
        "once; default 10)",
    )
    p.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="usage carries prompt_tokens_details.cached_tokens (as vLLM's flag)",
    )
    p.add_argument(
        "--chat-template",
        metavar="FILE_OR_TEMPLATE",
        help="the Jinja chat template chat requests render with instead of the model's: a "
        "file's path or the template itself (as vLLM's flag)",
    )
    p.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let a chat request bring its own chat_template (refused otherwise, as vLLM)",
    )
