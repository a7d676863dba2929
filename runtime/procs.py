"""Child-process entry points: `python -m taipan.procs coordinator|engine|http SPEC_JSON [RANK]`
and `python -m taipan.procs tp-follower SPEC_JSON RANK TP_RANK`.

One process runs the coordinator; one process per engine rank runs engine, allocator and gpu
actors (and mamba_cache for a hybrid model) on one event loop, wired over inproc, on its own
device and, with several ranks, its own share of the cores (SPEC's `devices`, `cpu_sets`); with
an HTTP port, one more runs the OpenAI server (runtime/server/) over a client of the
frontend.
Tensor parallel (SPEC's `tensor_parallel_size` T > 1): the engine process's gpu actor is its
rank's leader, and the engine process starts the rank's T-1 followers (`tp-follower`) as its own
children, each on its device and cores (`tp_devices`, `tp_cpu_sets`), talking to the leader over
the rank's `tp_addresses` (actors/gpu/peers.py). Across hosts (SPEC's `tp_remote`) it starts
none: each follower is a `taipan serve --role tp-follower` process of its own host, connecting
to the rank's tcp `tp_addresses` (Curve with SPEC's `keys_dir`). A follower that exits or whose
connection closes while its rank runs ends the rank at once: the engine process logs which one
and how, and exits with EXIT_PEER_DIED (the coordinator then fails the rank's requests); a
follower whose leader is gone exits with EXIT_PEER_DIED too. Processes of a tensor-parallel rank
leave with os._exit: a thread blocked in a collective on a dead peer must not hold the exit.
The launcher (runtime/launcher.py) writes SPEC, a LaunchSpec (runtime/spec.py) as JSON.
Children die with their parent (PR_SET_PDEATHSIG), ignore SIGINT (the launcher coordinates a
clean stop through STOP messages) and treat SIGTERM as "stop now" (a follower dies of it).
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading

import zmq
import zmq.asyncio

from taipan.actors.base import FatalError
from taipan.actors.channel import make_socket
from taipan.actors.config import cuda_graph_sizes, plan_limits, routing_policy
from taipan.actors.gpu.peers import PeerGoneError, follower_identity
from taipan.actors.log import configure, get_logger
from taipan.auth import curve_keys, read_token_file
from taipan.spec import ExpertParallelSpec, LaunchSpec

PR_SET_PDEATHSIG = 1
EXIT_FATAL = 3  # an actor raised FatalError: it logged why; the launcher reports the code
EXIT_PEER_DIED = 4  # a tensor-parallel peer of this rank (a follower, or the leader) is gone
FOLLOWER_STOP_S = 5.0  # a follower told to stop (SIGTERM) is killed after this
BYE_LINGER_MS = 2000  # how long closing a socket may wait to deliver a goodbye (EpBye, PeerBye)


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not Linux: the launcher's own cleanup still stops us
        pass


def _recorder(record_dir: str | None, actor: str):
    if not record_dir:
        return None
    from taipan.actors.record import Recorder

    return Recorder(record_dir, actor)


async def _run_until_stopped(actors: list) -> None:
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, lambda: [a.stop() for a in actors])
    async with asyncio.TaskGroup() as tg:
        tasks = [tg.create_task(a.run()) for a in actors]
        # The first actor is the one whose end ends the process.
        await tasks[0]
        for a in actors[1:]:
            a.stop()


async def coordinator_main(spec: LaunchSpec) -> None:
    from taipan.actors.coordinator.actor import CoordinatorActor

    ctx = zmq.asyncio.Context()
    rec = _recorder(spec.record_dir, "coordinator")
    # Both sides watch their peers: a dead engine or a vanished client is noticed at once.
    frontend = make_socket(
        ctx,
        zmq.ROUTER,
        spec.frontend,
        bind=True,
        name="clients",
        recorder=rec,
        watch_peers=True,
        curve=curve_keys(spec.frontend, spec.keys_dir, server=True),
    )
    backend = make_socket(
        ctx,
        zmq.ROUTER,
        spec.backend,
        bind=True,
        name="engines",
        recorder=rec,
        watch_peers=True,
        curve=curve_keys(spec.backend, spec.keys_dir, server=True),
    )
    config = spec.config
    actor = CoordinatorActor(
        frontend,
        backend,
        spec.num_ranks,
        spec.model_name,
        config.max_sequence_length,
        control_token=read_token_file(spec.control_token_file),
        prefix_caching=config.enable_prefix_caching,
        routing_policy=routing_policy(config),
        routing_alpha=config.prefix_caching_routing_alpha,
        rank_capacity=plan_limits(config)[0],
    )
    try:
        await _run_until_stopped([actor])
    finally:
        frontend.close()
        backend.close()
        ctx.term()
        if rec is not None:
            rec.close()


def _ep_group(ctx, spec: LaunchSpec, rank: int, recorder):
    """This rank's expert-parallel group (actors/engine/ep.py: its inbox ROUTER, watching the
    peers, and a DEALER to each peer's inbox), and the LoadModel fields of its gpu actor; None
    and {} without expert parallelism."""
    ep: ExpertParallelSpec | None = spec.expert_parallel
    if ep is None:
        return None, {}
    from taipan.actors.engine.ep import EpConsensus, ep_identity

    index, group = ep.group_of(rank)
    inboxes, keys, key_name = ep.inboxes, spec.keys_dir, spec.key_name
    inbox = make_socket(ctx, zmq.ROUTER, inboxes[rank], bind=True, name="ep",
                        recorder=recorder, watch_peers=True,
                        curve=curve_keys(inboxes[rank], keys, server=True))  # fmt: skip
    peers = {
        p: make_socket(ctx, zmq.DEALER, inboxes[p], bind=False, name=f"ep-{p}",
                       identity=ep_identity(rank), recorder=recorder,
                       curve=curve_keys(inboxes[p], keys, server=False, key_name=key_name))
        for p in group if p != rank
    }  # fmt: skip
    load = {
        "expert_parallel_rank": group.index(rank),
        "expert_parallel_size": len(group),
        "expert_parallel_init": ep.inits[index],
    }
    return EpConsensus(rank, tuple(group), inbox, peers), load


def _pin_cpus(cpus: list[int] | None) -> None:
    """Keep this engine rank (and the matmul threads torch starts later) on its own cores."""
    if cpus is None:
        return
    os.sched_setaffinity(0, cpus)
    threads = str(len(cpus))
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # read when torch loads, below
        os.environ[var] = threads


class FollowerProcesses:
    """The T-1 tensor-parallel followers of rank `rank`, children of this engine process. Each
    is watched by a thread: one that exits before `stop` ends this process at once, naming it
    (os._exit: the leader may be blocked in a collective waiting for it)."""

    def __init__(self, spec: LaunchSpec, rank: int):
        self.rank, self.stopping = rank, False
        self.log = get_logger(process="engine", rank=rank)
        self.procs: list[tuple[int, subprocess.Popen]] = []
        cmd = [sys.executable, "-m", "taipan.procs", "tp-follower", spec.to_json(), str(rank)]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        for tp_rank in range(1, spec.tensor_parallel_size):
            # From the main thread: PR_SET_PDEATHSIG fires when the spawning thread ends.
            proc = subprocess.Popen([*cmd, str(tp_rank)], env=env, stdin=subprocess.DEVNULL)
            self.procs.append((tp_rank, proc))
            threading.Thread(target=self._watch, args=(tp_rank, proc), daemon=True).start()

    def _watch(self, tp_rank: int, proc: subprocess.Popen) -> None:
        proc.wait()  # a blocking wait in its own thread: no polling
        # `stop` reports it; exit 0 comes only after the leader's goodbye (the rank stops).
        if self.stopping or proc.returncode == 0:
            return
        self._report(tp_rank, proc)
        _exit_now(EXIT_PEER_DIED)

    def _report(self, tp_rank: int, proc: subprocess.Popen) -> None:
        from taipan.launcher import describe_exit

        self.log.critical(
            "a tensor-parallel follower died: this engine rank ends",
            follower=f"gpu-{self.rank}-tp{tp_rank}",
            pid=proc.pid,
            how=describe_exit(proc.returncode),
        )

    def stop(self) -> bool:
        """Stop every follower (SIGTERM, SIGKILL after FOLLOWER_STOP_S). True when one had
        ended by itself first (reported here: this process may be ending because of it, e.g.
        a collective failed when the peer's socket closed, before its watcher saw it exit)."""
        self.stopping = True
        for _, proc in self.procs:
            proc.terminate()  # a follower that already exited keeps its own exit status
        died, killed = False, set()
        for tp_rank, proc in self.procs:
            try:
                proc.wait(FOLLOWER_STOP_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                killed.add(tp_rank)
            if proc.returncode not in (0, -signal.SIGTERM) and tp_rank not in killed:
                self._report(tp_rank, proc)
                died = True
        return died


def _exit_now(code: int) -> None:
    """Leave at once (no interpreter shutdown, which would join a thread stuck in a collective)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


async def engine_main(spec: LaunchSpec, rank: int) -> None:
    tp = spec.tensor_parallel_size
    _pin_cpus(spec.tp_cpu_sets[rank][0] if tp > 1 else spec.cpu_sets[rank])
    # The followers start now: they import torch and load while this process does (across
    # hosts they are started there, and connect).
    local = tp > 1 and not spec.tp_remote
    followers = FollowerProcesses(spec, rank) if local else None
    try:
        await _engine_rank(spec, rank, tp)
    finally:
        if followers is not None and followers.stop():
            _exit_now(EXIT_PEER_DIED)


def load_model_message(spec: LaunchSpec, rank: int, ep_load: dict):
    """The LoadModel rank `rank`'s gpu actor gets (by keyword, the one place it is built)."""
    from taipan.messages.gpu import LoadModel

    config, tp = spec.config, spec.tensor_parallel_size
    max_requests, max_tokens = plan_limits(config)
    device = spec.devices[rank]
    decode_graphs, mixed_graphs = cuda_graph_sizes(config, device)
    state_config = config.mamba_inference_state_config
    return LoadModel(
        model=spec.model_path,
        dtype=spec.dtype,
        device=device,
        block_size=config.block_size_tokens,
        max_blocks=spec.max_blocks,
        kv_cache_gb=config.buffer_size_gb,
        max_tokens=max_tokens,
        max_requests=max_requests,
        max_sequence_length=config.max_sequence_length,
        cuda_graph_decode_sizes=decode_graphs,
        cuda_graph_mixed_sizes=mixed_graphs,
        static_kv_memory_pointers=config.static_kv_memory_pointers,
        mamba_memory_ratio=config.mamba_memory_ratio,
        mamba_snapshot_gb=config.prefix_caching_mamba_gb,
        mamba_state_config="" if state_config is None else json.dumps(state_config),
        # Every process of the ranks on this host shares its memory (followers on other hosts
        # do not).
        ranks_on_host=spec.ranks_on_host * (1 if spec.tp_remote else tp),
        **ep_load,
        custom_all_reduce=config.custom_all_reduce,
    )


async def _engine_rank(spec: LaunchSpec, rank: int, tp: int) -> None:
    from taipan.actors.allocator.actor import AllocatorActor
    from taipan.actors.engine.actor import EngineActor
    from taipan.actors.gpu.actor import GpuActor
    from taipan.actors.mamba_cache.actor import MambaCacheActor

    ctx = zmq.asyncio.Context()
    from taipan.models import has_mamba_layers

    # The mamba_cache actor runs only for a hybrid model (DESIGN.md §2).
    hybrid = has_mamba_layers(spec.model_path)
    names = ("engine", "allocator", "gpu") + (("mamba_cache",) if hybrid else ())
    recs = {name: _recorder(spec.record_dir, f"{name}-{rank}") for name in names}
    alloc_addr, gpu_addr = f"inproc://allocator-{rank}", f"inproc://gpu-{rank}"
    mamba_addr = f"inproc://mamba_cache-{rank}"
    # Each inproc pair: the served side binds, the engine connects.
    alloc_side = make_socket(
        ctx, zmq.PAIR, alloc_addr, bind=True, name="engine", recorder=recs["allocator"]
    )
    gpu_side = make_socket(ctx, zmq.PAIR, gpu_addr, bind=True, name="engine", recorder=recs["gpu"])
    to_alloc = make_socket(
        ctx, zmq.PAIR, alloc_addr, bind=False, name="allocator", recorder=recs["engine"]
    )
    to_gpu = make_socket(ctx, zmq.PAIR, gpu_addr, bind=False, name="gpu", recorder=recs["engine"])
    mamba_side = to_mamba = None
    if hybrid:
        mamba_side = make_socket(
            ctx, zmq.PAIR, mamba_addr, bind=True, name="engine", recorder=recs["mamba_cache"]
        )
        to_mamba = make_socket(
            ctx, zmq.PAIR, mamba_addr, bind=False, name="mamba_cache", recorder=recs["engine"]
        )
    to_coord = make_socket(
        ctx,
        zmq.DEALER,
        spec.backend,
        bind=False,
        name="coordinator",
        identity=f"engine-{rank}-{os.getpid()}".encode(),  # unique: a duplicate rank is refused
        recorder=recs["engine"],
        curve=curve_keys(spec.backend, spec.keys_dir, server=False, key_name=spec.key_name),
    )
    ep, ep_load = _ep_group(ctx, spec, rank, recs["engine"])
    config = spec.config
    load = load_model_message(spec, rank, ep_load)
    channels = [alloc_side, gpu_side, to_alloc, to_gpu, to_coord]
    channels += [ep.inbox, *ep.peers.values()] if ep else []
    channels += [mamba_side, to_mamba] if hybrid else []
    gpu_tp, goodbyes = {}, [*ep.peers.values()] if ep else []
    if tp > 1:
        from taipan.actors.gpu.peers import Followers, TPSetup

        addresses, keys = spec.tp_addresses[rank], spec.keys_dir
        plans = make_socket(
            ctx, zmq.XPUB, addresses["plans"], bind=True, name="followers",
            curve=curve_keys(addresses["plans"], keys, server=True),
        )  # fmt: skip
        reports = make_socket(
            ctx, zmq.ROUTER, addresses["reports"], bind=True, name="followers",
            recorder=recs["gpu"], watch_peers=True,
            curve=curve_keys(addresses["reports"], keys, server=True),
        )  # fmt: skip
        channels += [plans, reports]
        goodbyes.append(reports)
        gpu_tp = {
            "tp": TPSetup(0, tp, addresses["init"]),
            "followers": Followers(plans, reports, tp, rank, spec.tp_start_timeout),
        }
    try:
        engine = EngineActor(
            rank,
            config,
            load,
            to_coord,
            to_alloc,
            to_gpu,
            to_mamba,
            coordinator_timeout=spec.coordinator_timeout,
            ep=ep,
        )
        actors = [AllocatorActor(alloc_side), GpuActor(rank, gpu_side, **gpu_tp)]
        actors += [MambaCacheActor(mamba_side)] if hybrid else []
        await _run_until_stopped([engine, *actors])
    finally:
        for ch in goodbyes:  # an EpBye or PeerBye sent just before must go out
            ch.close(linger_ms=BYE_LINGER_MS)
        for ch in channels:
            ch.close()
        ctx.term()
        for rec in recs.values():
            if rec is not None:
                rec.close()


async def tp_follower_main(spec: LaunchSpec, rank: int, tp_rank: int) -> None:
    """Tensor-parallel peer `tp_rank` of engine rank `rank` (actors/gpu/follower.py): a child
    of the rank's engine process, which watches it, or a process of its own on another host
    (SPEC's `tp_remote`). SIGTERM (or the parent's death) ends it; so does its leader's."""
    _pin_cpus(spec.tp_cpu_sets[rank][tp_rank])
    from taipan.actors.gpu.follower import LEADER_TIMEOUT_S, FollowerActor
    from taipan.actors.gpu.peers import TPSetup

    ctx = zmq.asyncio.Context()
    rec = _recorder(spec.record_dir, f"gpu-{rank}-tp{tp_rank}")
    addresses, keys, key_name = spec.tp_addresses[rank], spec.keys_dir, spec.key_name
    plans = make_socket(
        ctx, zmq.SUB, addresses["plans"], bind=False, name="plans", recorder=rec,
        curve=curve_keys(addresses["plans"], keys, server=False, key_name=key_name),
    )  # fmt: skip
    reports = make_socket(
        ctx, zmq.DEALER, addresses["reports"], bind=False, name="reports", recorder=rec,
        identity=follower_identity(tp_rank), watch_peers=True,
        curve=curve_keys(addresses["reports"], keys, server=False, key_name=key_name),
    )  # fmt: skip
    setup = TPSetup(tp_rank, spec.tensor_parallel_size, addresses["init"])
    try:
        actor = FollowerActor(
            rank, plans, reports, setup, spec.tp_devices[rank][tp_rank], spec.model_path,
            leader_timeout=spec.tp_start_timeout or LEADER_TIMEOUT_S,
        )  # fmt: skip
        await actor.run()
    finally:
        plans.close()
        reports.close()
        ctx.term()
        if rec is not None:
            rec.close()


def main(argv: list[str]) -> None:
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    role = argv[0]
    if role not in ("coordinator", "engine", "tp-follower", "http"):
        raise SystemExit(f"unknown role {role!r}")
    spec = LaunchSpec.from_json(argv[1])
    configure(spec.log_level)
    import uvloop

    if role == "coordinator":
        run = coordinator_main(spec)
    elif role == "engine":
        run = engine_main(spec, int(argv[2]))
    elif role == "tp-follower":
        run = tp_follower_main(spec, int(argv[2]), int(argv[3]))
    else:
        from taipan.server import http_main

        run = http_main(spec.to_dict())  # the HTTP server reads the wire form's keys
    code = 0
    try:
        uvloop.run(run)
    except* FatalError as group:
        leaves = list(_leaves(group))
        for e in leaves:
            get_logger(process=role).critical("exiting", reason=str(e))
        peer_gone = any(isinstance(e, PeerGoneError) for e in leaves)
        code = EXIT_PEER_DIED if peer_gone else EXIT_FATAL
    # Not sys.exit where a gpu thread may still wait in a collective of a dead tensor- or
    # expert-parallel peer: interpreter shutdown would join it.
    if role in ("engine", "tp-follower") and (code or spec.tensor_parallel_size > 1):
        _exit_now(code)
    sys.exit(code)


def _leaves(group: BaseExceptionGroup):
    for e in group.exceptions:
        if isinstance(e, BaseExceptionGroup):
            yield from _leaves(e)
        else:
            yield e


if __name__ == "__main__":
    main(sys.argv[1:])
