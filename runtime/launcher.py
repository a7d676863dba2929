"""The process launcher: start a coordinator and engine ranks, wait until ready, stop cleanly.

    with Runtime("smollm2", InferenceConfig()) as rt:
        client = Client(rt.address)

Owns the runtime's child processes (runtime/children.py spawns and watches them), a private temp
dir for ipc sockets, and the runtime's control token (runtime/auth.py: handed to the coordinator
in a private file, published for the client address once the runtime is up, readable by this
user only, removed at shutdown). Which role takes which flag, and the LaunchSpec every child
starts from, are runtime/roles.py's. Shutdown sends PAUSE then STOP through the coordinator (STOP
is legal only while paused or suspended; every request gets its terminal output), waits for the
children, escalates to SIGTERM then SIGKILL, and removes the ipc files. Children also die with
this process.

Direct mode (`direct=True`, for `LLM(use_coordinator=False)`): only the engine rank starts; its
coordinator endpoint (`engine_address`) is bound by the caller's direct client
(actors/client/direct.py), which waits for the model and stops the engine; `start` returns once
the process is spawned, and `shutdown(stopped=True)` first lets a stopped engine exit by itself.

A child that exits while the runtime is not shutting down is logged as an error naming it and
how it ended and listed in `unexpected_exits`; the coordinator fails the requests of a dead
engine rank by itself, and `taipan serve` shuts down and exits non-zero.

Tensor parallel (`tensor_parallel_size` T > 1): each engine rank's process starts the rank's T-1
follower processes itself (runtime/procs.py), so they are not among `procs`; an engine process
whose follower died exits with code 4. With `keys_dir` every tcp socket is Curve (a server where
it binds, a client where it connects); tcp beyond loopback without keys is refused before
anything starts. torch.distributed's own traffic (the TCPStore, gloo, NCCL) is not authenticated
by Curve: keep those ports inside a trusted network.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import tempfile
import time

from taipan.actors.config import InferenceConfig, cuda_graph_sizes
from taipan.actors.log import get_logger
from taipan.auth import new_token, publish_token, remove_token, write_token
from taipan.children import Children
from taipan.messages.errors import ErrorCode
from taipan.models import resolve
from taipan.ops.chat_template import ChatTemplateError, template_source
from taipan.placement import LaunchError, check_ep_fields, check_parallel_sizes
from taipan.roles import ROLES, build_spec, check_peers, check_role, launch_keys
from taipan.spec import LaunchSpec

BUSY_RETRY_S = 0.2  # shutdown waits this long before retrying a control refused as "busy"


def http_options(
    port: int | None,
    host: str,
    api_key,
    served_model_name,
    max_queued,
    queue_timeout,
    prompt_tokens_details: bool = False,
    chat_template: str | None = None,
    trust_request_chat_template: bool = False,
) -> dict | None:
    """The OpenAI-compatible HTTP server's options (runtime/server/), checked; None without a
    port. A None limit means the server's default (runtime/server/admission.py).
    `chat_template`: a file's path or the template itself (read here, and compiled: a bad one
    is the launch's error, not every chat request's)."""
    if port is not None and not 0 <= port < 65536:
        raise LaunchError(f"http_port must be in 0..65535, got {port}")
    if api_key is not None and not api_key:
        raise LaunchError("api_key must not be empty")
    if max_queued is not None and max_queued < 1:
        raise LaunchError(f"max_queued must be >= 1, got {max_queued}")
    if queue_timeout is not None and not 0 <= queue_timeout < float("inf"):
        raise LaunchError(f"queue_timeout must be finite seconds >= 0, got {queue_timeout}")
    if port is None:
        given = {
            "enable_prompt_tokens_details": prompt_tokens_details,
            "chat_template": chat_template is not None,
            "trust_request_chat_template": trust_request_chat_template,
        }
        if any(given.values()):
            named = ", ".join(k for k, v in given.items() if v)
            raise LaunchError(f"{named}: options of the HTTP server, which needs http_port")
        return None
    if chat_template is not None:
        try:
            chat_template = template_source(chat_template)
        except ChatTemplateError as e:
            raise LaunchError(f"chat_template: {e}") from e
    return {
        "host": host,
        "port": port,
        "api_key": api_key,
        "served_model_name": served_model_name,
        "max_queued": max_queued,
        "queue_timeout": queue_timeout,
        "prompt_tokens_details": prompt_tokens_details,
        "chat_template": chat_template,
        "trust_request_chat_template": trust_request_chat_template,
    }


class Runtime:
    def __init__(
        self,
        model: str = "smollm2",
        config: InferenceConfig | None = None,
        *,
        address: str | None = None,
        record_dir: str | None = None,
        data_parallel_size: int = 1,
        tensor_parallel_size: int = 1,
        expert_parallel_size: int = 1,
        dtype: str = "float32",
        device: str = "cpu",
        log_level: str | None = None,
        http_port: int | None = None,
        http_host: str = "127.0.0.1",
        api_key: str | None = None,
        served_model_name: str | None = None,
        max_queued: int | None = None,
        queue_timeout: float | None = None,
        enable_prompt_tokens_details: bool = False,
        chat_template: str | None = None,
        trust_request_chat_template: bool = False,
        direct: bool = False,
        role: str = "all",
        engine_address: str | None = None,
        data_parallel_rank: int | None = None,
        keys_dir: str | None = None,
        key_name: str = "client",
        tp_address: str | None = None,
        tensor_parallel_rank: int | None = None,
        ep_inboxes: list[str] | str | None = None,
        ep_init: str | None = None,
    ):
        if role not in ROLES:
            raise LaunchError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        if direct and http_port is not None:
            raise LaunchError(
                "the HTTP server is a client of the coordinator, and direct mode starts none: "
                "use AsyncLLM.serve in direct mode, or coordinator mode"
            )
        check_parallel_sizes(data_parallel_size, tensor_parallel_size, expert_parallel_size)
        if direct and data_parallel_size != 1:
            raise LaunchError(
                "direct mode drives one engine rank from this process; with several ranks use "
                "coordinator mode (it routes and owns the lifecycle)"
            )
        self.model_name, self.model_path = resolve(model)
        self.config = config or InferenceConfig()
        if self.config.speculative_chain_steps > 1 and expert_parallel_size > 1:
            raise LaunchError(
                "speculative_chain_steps > 1 is not built yet under expert parallelism "
                "(expert_parallel_size must be 1)"
            )
        draft = self.config.speculative_model
        if self.config.num_speculative_tokens and draft and not draft.startswith("self:"):
            resolve(draft)  # (a draft that is not there fails here, not in a rank's start-up)
        self.num_ranks = data_parallel_size
        self.tp_size = tensor_parallel_size
        self.expert_parallel_size = expert_parallel_size
        check_ep_fields(self.config, expert_parallel_size)
        self.direct = direct
        self.dtype, self.device = dtype, device
        cuda_graph_sizes(self.config, device)  # graph fields on a device without graphs: refuse
        self.record_dir = os.path.abspath(record_dir) if record_dir else None
        self.log_level = log_level
        served_model_name = served_model_name or self.model_name
        self.http = http_options(
            http_port, http_host, api_key, served_model_name, max_queued, queue_timeout,
            enable_prompt_tokens_details, chat_template, trust_request_chat_template,
        )  # fmt: skip
        self.tmp = tempfile.mkdtemp(prefix="taipan-")
        self.address = address or f"ipc://{self.tmp}/frontend.sock"
        # Where engines connect: the coordinator binds it (roles all, coordinator); an engine
        # started alone (role engine) is given it.
        self.engine_address = engine_address or f"ipc://{self.tmp}/backend.sock"
        self.role, self.rank = role, data_parallel_rank
        self.keys_dir, self.key_name = keys_dir, key_name
        self.tp_address, self.tp_rank = tp_address, tensor_parallel_rank
        self.ep_inboxes, self.ep_init = ep_inboxes, ep_init
        # Across hosts: how long a leader waits for its followers, a follower for its leader
        # (start's timeout).
        self.tp_start_timeout: float | None = None
        try:
            self.engine_address = check_role(
                self, address=address, engine_address=engine_address, http_port=http_port
            )
            self.ep_inboxes = check_peers(self)
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        self.children = Children()
        self.control_token = new_token()
        self.token_path = None  # where same-user clients find it, once the runtime is up
        # Every rank loaded (the coordinator answers controls): until then a stop is signals.
        self.ready = False
        self.model_info = None  # the ModelInfo seen when the runtime became ready
        self.log = get_logger(component="launcher")

    @property
    def procs(self) -> list[tuple[str, subprocess.Popen]]:
        """The child processes (name, Popen), in the order they started."""
        return self.children.procs

    @property
    def unexpected_exits(self) -> list[tuple[str, int]]:
        """(name, returncode) of each child that exited while the runtime was not stopping."""
        return self.children.unexpected_exits

    def _spec(self) -> LaunchSpec:
        return build_spec(self)

    # --- start --------------------------------------------------------------------------------

    def start(self, timeout: float = 600.0) -> Runtime:
        """Start this role's processes. Roles all and coordinator return once every rank has
        loaded its model (within `timeout`); roles engine and tp-follower once the process is
        spawned (across hosts, a leader then waits as long for its followers, a follower for
        its leader)."""
        if self.direct:
            return self._start_direct()
        if self.tp_address is not None:
            self.tp_start_timeout = timeout
        spec = self._spec()
        write_token(spec.control_token_file, self.address, self.control_token)
        spec = spec.to_json()
        if self.record_dir:  # `taipan replay --check` re-plans engine steps with this config
            os.makedirs(self.record_dir, exist_ok=True)
            with open(os.path.join(self.record_dir, "config.json"), "w") as f:
                json.dump(self.config.to_dict(), f, indent=1)
            with open(os.path.join(self.record_dir, "runtime.json"), "w") as f:
                json.dump({"num_ranks": self.num_ranks, "tensor_parallel_size": self.tp_size}, f)
        try:
            if self.role == "engine":
                self.children.spawn(f"engine-{self.rank}", "engine", spec, str(self.rank))
                return self
            if self.role == "tp-follower":
                name = f"tp-follower-{self.rank}-{self.tp_rank}"
                self.children.spawn(name, "tp-follower", spec, str(self.rank), str(self.tp_rank))
                return self
            self.children.spawn("coordinator", "coordinator", spec)
            if self.role == "all":
                for rank in range(self.num_ranks):
                    self.children.spawn(f"engine-{rank}", "engine", spec, str(rank))
            asyncio.run(self._wait_ready(timeout))
            self.ready = True
            if self.http is not None:
                self.children.spawn("http", "http", spec)
                self._wait_http(timeout)
            self.token_path = publish_token(self.address, self.control_token)
        except BaseException:
            self.shutdown()
            raise
        return self

    def _start_direct(self) -> Runtime:
        """Spawn the engine rank only; the caller's direct client binds `engine_address`."""
        try:
            self.children.spawn("engine-0", "engine", self._spec().to_json(), "0")
        except BaseException:
            self.shutdown()
            raise
        return self

    @property
    def engine_pid(self) -> int | None:
        return next((p.pid for n, p in self.procs if n == "engine-0"), None)

    @property
    def engine_pids(self) -> list[int]:
        """The engine processes' pids, by rank."""
        return [p.pid for n, p in self.procs if n.startswith("engine-")]

    def engines_alive(self) -> int:
        return sum(n.startswith("engine-") and p.poll() is None for n, p in self.procs)

    async def _wait_ready(self, timeout: float) -> None:
        from taipan.client import AsyncClient

        loop = asyncio.get_running_loop()
        died = loop.create_future()

        def on_exit(name, code):
            loop.call_soon_threadsafe(lambda: died.done() or died.set_result((name, code)))

        self.children.on_exit(on_exit)
        for name, proc in self.procs:
            if proc.poll() is not None:
                on_exit(name, proc.returncode)
        # The children may take a while to import and bind; their exits are watched above.
        client = AsyncClient(
            self.address,
            connect_timeout=timeout,
            timeout=timeout,
            curve=launch_keys(self, self.address, server=False),
        )
        connect = asyncio.ensure_future(client.connect())
        try:
            done, _ = await asyncio.wait({connect, died}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.children.remove_on_exit(on_exit)
        if connect in done:
            try:
                connect.result()
            except TimeoutError:
                raise LaunchError(f"the runtime was not ready within {timeout:.0f} s") from None
            except (RuntimeError, ConnectionError) as e:
                raise LaunchError(str(e)) from None
            self.model_info = client.info
            await client.close()
            return
        connect.cancel()
        await asyncio.gather(connect, return_exceptions=True)
        name, code = died.result()
        raise LaunchError(f"{name} exited with code {code} during start-up (see its log above)")

    @property
    def http_url(self) -> str | None:
        """The OpenAI server's base URL (…/v1), once started with an http_port."""
        if self.http is None:
            return None
        return f"http://{self.http['host']}:{self.http['port']}/v1"

    def _wait_http(self, timeout: float) -> None:
        """Until the http child answers GET /health with 200 (LaunchError if it exits or
        does not within `timeout`)."""
        import urllib.error
        import urllib.request

        name, proc = self.procs[-1]
        url = f"http://{self.http['host']}:{self.http['port']}/health"
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise LaunchError(
                    f"{name} exited with code {proc.returncode} during start-up (is port "
                    f"{self.http['port']} taken? see its log above)"
                )
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise LaunchError(f"the HTTP server was not ready within {timeout:.0f} s")
            time.sleep(0.1)

    # --- stop ---------------------------------------------------------------------------------

    def on_child_exit(self, callback) -> None:
        """Call `callback(name, returncode)` (from a watcher thread) when a child process ends."""
        self.children.on_exit(callback)

    def alive(self) -> bool:
        return self.children.alive()

    def coordinator_alive(self) -> bool:
        return self.children.alive("coordinator")

    def shutdown(self, timeout: float = 30.0, *, stopped: bool = False) -> None:
        """Stop every child. `stopped`: the engines were already told to stop (direct mode), so
        give them `timeout` to exit by themselves before any signal."""
        self.children.stopping = True
        # The HTTP server first: it is a client, and would keep serving errors after the stop.
        self.children.terminate("http")
        # (before every rank loaded the coordinator cannot take a stop: a SIGTERM or Ctrl-C
        # during the start waited out the 30 s of a clean stop for nothing)
        if self.coordinator_alive() and self.ready:
            try:
                asyncio.run(asyncio.wait_for(self._send_stop(), timeout))
                stopped = True  # after a clean stop they exit by themselves
            except Exception as e:  # the coordinator is stuck or refused: signals take over
                self.log.warning("clean stop failed", error=repr(e))
        self.children.stop(timeout, stopped=stopped)
        shutil.rmtree(self.tmp, ignore_errors=True)
        if self.token_path is not None:
            remove_token(self.token_path, self.control_token)

    async def _send_stop(self) -> None:
        """PAUSE (unless already paused or suspended), then STOP. A failure raises, and
        `shutdown` falls back to signals."""
        import zmq
        import zmq.asyncio

        from taipan.actors.channel import make_socket
        from taipan.actors.client.actor import ClientActor, ControlError
        from taipan.messages.lifecycle import Pause, Stop

        ctx = zmq.asyncio.Context()
        keys = launch_keys(self, self.address, server=False)
        channel = make_socket(
            ctx, zmq.DEALER, self.address, bind=False, name="coordinator", curve=keys
        )
        actor = ClientActor(channel, address=self.address)
        task = asyncio.create_task(actor.run())
        try:
            try:
                await self._control_when_free(actor, Pause(self.control_token))
            except ControlError as e:
                # ILLEGAL_TRANSITION: already PAUSED or SUSPENDED, which is fine.
                if e.code is not ErrorCode.ILLEGAL_TRANSITION:
                    raise
            await self._control_when_free(actor, Stop(self.control_token, "launcher shutdown"))
        finally:
            actor.stop()
            await task
            channel.close()
            ctx.term()

    @staticmethod
    async def _control_when_free(actor, msg) -> None:
        """Send a control; while another client's command holds the coordinator ("busy"),
        try again shortly (the caller bounds the whole shutdown with a timeout)."""
        from taipan.actors.client.actor import ControlError

        while True:
            try:
                await actor.control(msg)
                return
            except ControlError as e:
                if e.code is not ErrorCode.BUSY:
                    raise
            await asyncio.sleep(BUSY_RETRY_S)

    def __enter__(self) -> Runtime:
        if not self.procs:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


# --- command line ---------------------------------------------------------------------------


def runtime_from_args(args, address: str | None = None) -> Runtime:
    """A Runtime (not started) from the flags of runtime/flags.py and, where `taipan serve`
    gave them, its role's (runtime/cli.py)."""
    config = InferenceConfig.from_cli(args.config, args.set)
    return Runtime(
        args.model,
        config,
        address=address,
        record_dir=args.record,
        data_parallel_size=args.data_parallel_size,
        tensor_parallel_size=args.tensor_parallel_size,
        expert_parallel_size=args.expert_parallel_size,
        dtype=args.dtype,
        device=args.device,
        log_level=args.log_level,
        http_port=getattr(args, "http_port", None),
        http_host=getattr(args, "http_host", "127.0.0.1"),
        api_key=getattr(args, "api_key", None),
        served_model_name=getattr(args, "served_model_name", None),
        max_queued=getattr(args, "max_queued", None),
        queue_timeout=getattr(args, "queue_timeout", None),
        enable_prompt_tokens_details=getattr(args, "enable_prompt_tokens_details", False),
        chat_template=getattr(args, "chat_template", None),
        trust_request_chat_template=getattr(args, "trust_request_chat_template", False),
        role=getattr(args, "role", "all"),
        engine_address=getattr(args, "engine_address", None) or getattr(args, "coordinator", None),
        data_parallel_rank=getattr(args, "data_parallel_rank", None),
        keys_dir=getattr(args, "keys", None),
        key_name=getattr(args, "key_name", "client"),
        tp_address=getattr(args, "tp_address", None),
        tensor_parallel_rank=getattr(args, "tensor_parallel_rank", None),
        ep_inboxes=getattr(args, "ep_inboxes", None),
        ep_init=getattr(args, "ep_init", None),
    )
