"""The process launcher: start a coordinator and engine ranks, wait until ready, stop cleanly.

    with Runtime("smollm2", InferenceConfig()) as rt:
        client = Client(rt.address)

Owns the child processes, a private temp dir for ipc sockets, and the runtime's control token
(runtime/auth.py: handed to the coordinator in a private file, published for the client address
once the runtime is up, readable by this user only, removed at shutdown). Shutdown sends PAUSE
then STOP through the coordinator (STOP is legal only while paused or suspended; every request
gets its terminal output), waits for the children, escalates to SIGTERM then SIGKILL, and
removes the ipc files. Children also die with this process.

Direct mode (`direct=True`, for `LLM(use_coordinator=False)`): only the engine rank starts; its
coordinator endpoint (`engine_address`) is bound by the caller's direct client
(actors/client/direct.py), which waits for the model and stops the engine; `start` returns once
the process is spawned, and `shutdown(stopped=True)` first lets a stopped engine exit by itself.

A child that exits while the runtime is not shutting down is logged as an error naming it and
how it ended (exit code or signal) and listed in `unexpected_exits`; the coordinator fails the
requests of a dead engine rank by itself, and `taipan serve` shuts down and exits non-zero.

Tensor parallel (`tensor_parallel_size` T > 1): each engine rank's process starts the rank's
T-1 follower processes itself (runtime/procs.py), so they are not among `procs`; SPEC gives each
peer its device and cores (runtime/placement.py), and each rank its sockets and
rendezvous in the private temp dir. An engine process whose follower died exits with code 4.

Across hosts (`role`): "coordinator" starts the coordinator only; "engine" one engine rank that
joins it (`engine_address`, `data_parallel_rank`); "tp-follower" one tensor-parallel follower
(`tensor_parallel_rank` K of rank R) that joins its leader. A leader started with `tp_address`
tcp://HOST:PORT spawns no follower: it binds its plans on PORT and its followers' reports on
PORT+1, and the rank's torch.distributed rendezvous (a TCPStore, hosted by the leader) is
tcp://HOST:PORT+2; its followers are given the same address. Expert parallelism across hosts:
each engine of a group is given every rank's consensus inbox (`ep_inboxes`, one address per
data-parallel rank, the same list everywhere; it binds its own) and its group's rendezvous
(`ep_init`, tcp://HOST:PORT on the host of the group's first rank, which hosts the TCPStore; the
gpu worker's host-side gloo group is formed over the same store). With `keys_dir` every tcp
socket of these is Curve (a server where it binds, a client where it connects); tcp beyond
loopback without keys is refused before anything starts. torch.distributed's own traffic (the
TCPStore, gloo, NCCL) is not authenticated by Curve: keep those ports inside a trusted network.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from taipan.actors.channel import check_bind
from taipan.actors.config import InferenceConfig, cuda_graph_sizes, plan_limits
from taipan.actors.curve import CurveError
from taipan.actors.log import get_logger
from taipan.auth import curve_keys, new_token, publish_token, remove_token, write_token
from taipan.messages.errors import ErrorCode
from taipan.models import resolve
from taipan.placement import (
    LaunchError,
    check_ep_addresses,
    check_ep_fields,
    check_parallel_sizes,
    next_port_address,
    peer_cpu_sets,
    peer_devices,
    rank_cpu_sets,
    tp_addresses,
)
from taipan.spec import ExpertParallelSpec, LaunchSpec

BUSY_RETRY_S = 0.2  # shutdown waits this long before retrying a control refused as "busy"
ROLES = ("all", "coordinator", "engine", "tp-follower")
# An engine started alone (role engine) exits once its coordinator answers nothing for this long.
COORDINATOR_TIMEOUT_S = 10.0


def describe_exit(code: int | None) -> str:
    """'exited with code 3', 'killed by signal SIGKILL', ... for a Popen returncode."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


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
        self.num_ranks = data_parallel_size
        self.tp_size = tensor_parallel_size
        self.expert_parallel_size = expert_parallel_size
        check_ep_fields(self.config, expert_parallel_size)
        self.direct = direct
        self.dtype, self.device = dtype, device
        cuda_graph_sizes(self.config, device)  # graph fields on a device without graphs: refuse
        self.record_dir = os.path.abspath(record_dir) if record_dir else None
        self.log_level = log_level
        # The OpenAI-compatible HTTP server (runtime/server/), in its own process.
        if http_port is not None and not 0 <= http_port < 65536:
            raise LaunchError(f"http_port must be in 0..65535, got {http_port}")
        if api_key is not None and not api_key:
            raise LaunchError("api_key must not be empty")
        # None: the server's defaults (runtime/server/admission.py DEFAULT_MAX_QUEUED, ...).
        if max_queued is not None and max_queued < 1:
            raise LaunchError(f"max_queued must be >= 1, got {max_queued}")
        if queue_timeout is not None and not 0 <= queue_timeout < float("inf"):
            raise LaunchError(f"queue_timeout must be finite seconds >= 0, got {queue_timeout}")
        self.http = None
        if http_port is not None:
            self.http = {
                "host": http_host,
                "port": http_port,
                "api_key": api_key,
                "served_model_name": served_model_name or self.model_name,
                "max_queued": max_queued,
                "queue_timeout": queue_timeout,
            }
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
            self._check_role(role, address, engine_address, data_parallel_rank, http_port)
            self._check_peers(role)
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self._exit_callbacks: list = []
        self.unexpected_exits: list[tuple[str, int]] = []  # (child name, returncode)
        self.control_token = new_token()
        self.token_path = None  # where same-user clients find it, once the runtime is up
        self.model_info = None  # the ModelInfo seen when the runtime became ready
        self._stopping = False
        self.log = get_logger(component="launcher")

    def _check_role(self, role, address, engine_address, rank, http_port) -> None:
        """Each role's addresses, and the Curve keys any tcp binding beyond loopback needs
        (checked here, before any process starts: a clear error rather than a dead child)."""
        if role == "engine" and (engine_address is None or rank is None):
            raise LaunchError(
                "role engine needs the coordinator's engine address (--coordinator) and this "
                "engine's --data-parallel-rank"
            )
        if role == "tp-follower" and None in (rank, self.tp_address, self.tp_rank):
            raise LaunchError(
                "role tp-follower needs its leader's --tp-address, its --tensor-parallel-rank K "
                "(1..T-1, the leader being 0) and its engine rank's --data-parallel-rank"
            )
        if role == "tp-follower" and engine_address is not None:
            raise LaunchError(
                "role tp-follower talks to its leader only (--tp-address), not to the "
                "coordinator: no --coordinator"
            )
        if role in ("engine", "tp-follower"):
            if not 0 <= rank < self.num_ranks:
                raise LaunchError(
                    f"--data-parallel-rank {rank} is outside 0..{self.num_ranks - 1} "
                    f"(--data-parallel-size {self.num_ranks})"
                )
            if address is not None or http_port is not None:
                raise LaunchError(f"role {role} serves no clients: no --address or --http-port")
        elif rank is not None:
            raise LaunchError("--data-parallel-rank is for roles engine and tp-follower")
        if role == "coordinator" and engine_address is None:
            self.engine_address = next_port_address(self.address)
        if role in ("all", "coordinator"):
            check_bind(self.address, self._keys(self.address, server=True))
            check_bind(self.engine_address, self._keys(self.engine_address, server=True))

    def _check_peers(self, role: str) -> None:
        """Tensor- and expert-parallel peers across hosts: which role takes which flag, and
        the binds this process's rank will make."""
        if self.tp_address is not None:
            if role not in ("engine", "tp-follower"):
                raise LaunchError(
                    "--tp-address is for role engine (a rank's leader, which binds it) and role "
                    "tp-follower (which connects to it)"
                )
            if self.tp_size == 1:
                raise LaunchError("--tp-address needs --tensor-parallel-size above 1")
            addresses = tp_addresses(self.tp_address)
            if role == "engine":
                for kind in ("plans", "reports"):
                    check_bind(addresses[kind], self._keys(addresses[kind], server=True))
        if role == "tp-follower":
            if self.tp_size == 1 or not 1 <= self.tp_rank < self.tp_size:
                raise LaunchError(
                    f"--tensor-parallel-rank {self.tp_rank} is outside 1..{self.tp_size - 1} "
                    f"(--tensor-parallel-size {self.tp_size}; the leader is rank 0)"
                )
        elif self.tp_rank is not None:
            raise LaunchError(
                "--tensor-parallel-rank is for role tp-follower (the engine is its rank's "
                "leader, rank 0)"
            )
        if role == "engine" and self.expert_parallel_size > 1:
            self.ep_inboxes = check_ep_addresses(self.ep_inboxes, self.ep_init, self.num_ranks)
            own = self.ep_inboxes[self.rank]
            check_bind(own, self._keys(own, server=True))
        elif self.ep_inboxes is not None or self.ep_init is not None:
            raise LaunchError(
                "--ep-inboxes and --ep-init are for role engine with --expert-parallel-size "
                "above 1 (under one launcher, role all, the group meets in private files)"
            )

    def _keys(self, address: str, *, server: bool):
        try:
            return curve_keys(address, self.keys_dir, server=server, key_name=self.key_name)
        except CurveError as e:
            raise LaunchError(str(e)) from None

    # --- start --------------------------------------------------------------------------------

    def _spec(self) -> LaunchSpec:
        max_requests, _ = plan_limits(self.config)
        blocks_per_request = -(-self.config.max_sequence_length // self.config.block_size_tokens)
        local = self.role != "engine"  # an engine started alone shares its host with no rank
        return LaunchSpec(
            frontend=self.address,
            backend=self.engine_address,
            num_ranks=self.num_ranks,
            model_name=self.model_name,
            model_path=self.model_path,
            dtype=self.dtype,
            device=self.device,
            devices=[peers[0] for peers in self._peer_devices()],
            cpu_sets=self._cpu_sets(),
            tensor_parallel_size=self.tp_size,
            tp_devices=self._peer_devices(),
            tp_cpu_sets=self._tp_cpu_sets(),
            tp_addresses=self._tp_addresses(),
            tp_remote=self.tp_address is not None,
            tp_start_timeout=self.tp_start_timeout,
            config=self.config,
            max_blocks=max_requests * blocks_per_request,
            record_dir=self.record_dir,
            log_level=self.log_level,
            control_token_file=os.path.join(self.tmp, "control-token.json"),
            http=self.http,
            ranks_on_host=self.num_ranks if local else 1,
            coordinator_timeout=None if local else COORDINATOR_TIMEOUT_S,
            keys_dir=self.keys_dir,
            key_name=self.key_name,
            expert_parallel=self._ep_spec(),
        )

    def _ep_spec(self) -> ExpertParallelSpec | None:
        """Expert parallelism: the groups of engine ranks, each rank's consensus inbox and each
        group's torch.distributed meeting point (private files in this runtime's temp dir)."""
        if self.expert_parallel_size == 1:
            return None
        from taipan.actors.engine.ep import ep_groups

        groups = ep_groups(self.num_ranks, self.expert_parallel_size)
        if self.role == "engine":  # across hosts: the addresses given (only ours are used)
            return ExpertParallelSpec(
                groups=[list(g) for g in groups],
                inboxes=self.ep_inboxes,
                inits=[self.ep_init if self.rank in g else None for g in groups],
            )
        return ExpertParallelSpec(
            groups=[list(g) for g in groups],
            inboxes=[f"ipc://{self.tmp}/ep-{r}.sock" for r in range(self.num_ranks)],
            inits=[f"file://{self.tmp}/ep-init-{i}" for i in range(len(groups))],
        )

    def _tp_addresses(self) -> list[dict[str, str]]:
        """Per rank, its tensor-parallel sockets and rendezvous: in our private directory, or
        across hosts those of `tp_address` (only this process's rank uses its entry)."""
        if self.tp_address is not None:
            return [tp_addresses(self.tp_address)] * self.num_ranks
        return [
            {
                "plans": f"ipc://{self.tmp}/tp-{r}-plans.sock",
                "reports": f"ipc://{self.tmp}/tp-{r}-reports.sock",
                "init": f"file://{self.tmp}/tp-{r}.init",
            }
            for r in range(self.num_ranks)
        ]

    def _tp_cpu_sets(self) -> list[list[list[int] | None]]:
        if self.tp_address is not None:  # one peer of the rank on this host: every core
            return [[None] * self.tp_size] * self.num_ranks
        cpus = sorted(os.sched_getaffinity(0))
        return [peer_cpu_sets(rank_cpus, self.tp_size, cpus) for rank_cpus in self._cpu_sets()]

    def _peer_devices(self) -> list[list[str]]:
        """Per rank, its tensor-parallel peers' devices (one peer without tensor parallelism)."""
        if self.tp_address is not None:  # one peer of the rank on this host: the device named
            return [[self.device] * self.tp_size] * self.num_ranks
        if self.role == "engine":  # one rank on this host: its peers from the device as named
            return [peer_devices(self.device, 0, 1, self.tp_size)] * self.num_ranks
        return [
            peer_devices(self.device, r, self.num_ranks, self.tp_size)
            for r in range(self.num_ranks)
        ]

    def _cpu_sets(self) -> list[list[int] | None]:
        if self.role == "engine":
            return [None] * self.num_ranks
        return rank_cpu_sets(self.num_ranks, sorted(os.sched_getaffinity(0)))

    def _spawn(self, name: str, *args: str) -> None:
        cmd = [sys.executable, "-m", "taipan.procs", *args]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)
        self.procs.append((name, proc))
        threading.Thread(target=self._watch, args=(name, proc), daemon=True).start()

    def _watch(self, name: str, proc: subprocess.Popen) -> None:
        proc.wait()  # a blocking wait in its own thread: no polling
        if not self._stopping:
            how = describe_exit(proc.returncode)
            self.log.error("child process died", child=name, pid=proc.pid, how=how)
            self.unexpected_exits.append((name, proc.returncode))
        for callback in list(self._exit_callbacks):
            try:
                callback(name, proc.returncode)
            except RuntimeError:  # the waiting event loop has closed
                pass

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
                self._spawn(f"engine-{self.rank}", "engine", spec, str(self.rank))
                return self
            if self.role == "tp-follower":
                name = f"tp-follower-{self.rank}-{self.tp_rank}"
                self._spawn(name, "tp-follower", spec, str(self.rank), str(self.tp_rank))
                return self
            self._spawn("coordinator", "coordinator", spec)
            if self.role == "all":
                for rank in range(self.num_ranks):
                    self._spawn(f"engine-{rank}", "engine", spec, str(rank))
            asyncio.run(self._wait_ready(timeout))
            if self.http is not None:
                self._spawn("http", "http", spec)
                self._wait_http(timeout)
            self.token_path = publish_token(self.address, self.control_token)
        except BaseException:
            self.shutdown()
            raise
        return self

    def _start_direct(self) -> Runtime:
        """Spawn the engine rank only; the caller's direct client binds `engine_address`."""
        try:
            self._spawn("engine-0", "engine", self._spec().to_json(), "0")
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

        self._exit_callbacks.append(on_exit)
        for name, proc in self.procs:
            if proc.poll() is not None:
                on_exit(name, proc.returncode)
        # The children may take a while to import and bind; their exits are watched above.
        client = AsyncClient(
            self.address,
            connect_timeout=timeout,
            timeout=timeout,
            curve=self._keys(self.address, server=False),
        )
        connect = asyncio.ensure_future(client.connect())
        try:
            done, _ = await asyncio.wait({connect, died}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._exit_callbacks.remove(on_exit)
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
        self._exit_callbacks.append(callback)

    def alive(self) -> bool:
        return any(p.poll() is None for _, p in self.procs)

    def coordinator_alive(self) -> bool:
        return any(n == "coordinator" and p.poll() is None for n, p in self.procs)

    def shutdown(self, timeout: float = 30.0, *, stopped: bool = False) -> None:
        """Stop every child. `stopped`: the engines were already told to stop (direct mode), so
        give them `timeout` to exit by themselves before any signal."""
        self._stopping = True
        # The HTTP server first: it is a client, and would keep serving errors after the stop.
        for name, proc in self.procs:
            if name == "http" and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10.0)
                except subprocess.TimeoutExpired:
                    proc.kill()
        if self.coordinator_alive():
            try:
                asyncio.run(asyncio.wait_for(self._send_stop(), timeout))
                stopped = True
            except Exception as e:  # the coordinator is stuck or refused: signals take over
                self.log.warning("clean stop failed", error=repr(e))
        steps = [(None, timeout)] if stopped else []  # after a clean stop they exit by themselves
        for sig, wait in [*steps, (signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)]:
            for _, proc in self.procs:
                if sig is not None and proc.poll() is None:
                    proc.send_signal(sig)
            for _, proc in self.procs:
                try:
                    proc.wait(wait)
                except subprocess.TimeoutExpired:
                    pass
            if not self.alive():
                break
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
        keys = self._keys(self.address, server=False)
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
        "r*T .. r*T+T-1; CPU: the rank's cores split between them); Llama, Qwen3-MoE and "
        "NemotronH models",
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


def runtime_from_args(args, address: str | None = None) -> Runtime:
    """A Runtime (not started) from the options of `add_runtime_arguments`."""
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
