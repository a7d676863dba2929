"""Child-process entry points: `python -m taipan.procs coordinator|engine|http SPEC_JSON [RANK]`
and `python -m taipan.procs tp-follower SPEC_JSON RANK TP_RANK`.

One process runs the coordinator; one process per engine rank runs engine, allocator and gpu
actors (and mamba_cache for a hybrid model) on one event loop, on its own device and, with
several ranks, its own share of the cores (SPEC's `devices`, `cpu_sets`); with an HTTP port, one
more runs the OpenAI server (runtime/server/) over a client of the frontend. Each process opens
its own rows of the wiring table (runtime/wiring.py: which actor binds or connects which socket,
where) and hands the channels to its actors; what it decides is which actors run and what each
is told (`load_model_message`: the LoadModel of a rank's gpu actor).
Tensor parallel (SPEC's `tensor_parallel_size` T > 1): the engine process's gpu actor is its
rank's leader, and the engine process starts the rank's T-1 followers (`tp-follower`) as its own
children (runtime/children.py), each on its device and cores (`tp_devices`, `tp_cpu_sets`).
Across hosts (SPEC's `tp_remote`) it starts none: each follower is a `taipan serve --role
tp-follower` process of its own host, connecting to the rank's tcp `tp_addresses`. A follower
that exits or whose connection closes while its rank runs ends the rank at once: the engine
process logs which one and how, and exits with EXIT_PEER_DIED (the coordinator then fails the
rank's requests); a follower whose leader is gone exits with EXIT_PEER_DIED too. Processes of a
tensor-parallel rank leave with os._exit: a thread blocked in a collective on a dead peer must
not hold the exit. The launcher (runtime/launcher.py) writes SPEC, a LaunchSpec (runtime/spec.py)
as JSON. Children die with their parent (PR_SET_PDEATHSIG), ignore SIGINT (the launcher
coordinates a clean stop through STOP messages) and treat SIGTERM as "stop now" (a follower dies
of it).
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import signal
import sys

from taipan.actors.base import FatalError
from taipan.actors.config import cuda_graph_sizes, plan_limits, routing_policy
from taipan.actors.gpu.peers import PeerGoneError
from taipan.actors.log import configure, get_logger
from taipan.auth import read_token_file
from taipan.children import EXIT_FATAL, EXIT_PEER_DIED, FollowerProcesses, exit_now
from taipan.placement import gil_switch_seconds
from taipan.spec import LaunchSpec
from taipan.wiring import open_process

PR_SET_PDEATHSIG = 1
BYE_LINGER_MS = 2000  # how long closing a socket may wait to deliver a goodbye (EpBye, PeerBye)


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not Linux: the launcher's own cleanup still stops us
        pass


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

    config = spec.config
    # Both ROUTERs watch their peers (wiring.py): a dead engine or a vanished client is noticed.
    with open_process(spec, "coordinator") as channels:
        actor = CoordinatorActor(
            channels["coordinator", "frontend"],
            channels["coordinator", "backend"],
            spec.num_ranks,
            spec.model_name,
            config.max_sequence_length,
            control_token=read_token_file(spec.control_token_file),
            prefix_caching=config.enable_prefix_caching,
            routing_policy=routing_policy(config),
            routing_alpha=config.prefix_caching_routing_alpha,
            rank_capacity=plan_limits(config)[0],
        )
        await _run_until_stopped([actor])


def _ep_group(spec: LaunchSpec, rank: int, channels: dict):
    """This rank's expert-parallel group (actors/engine/ep.py) over its consensus channels, and
    the LoadModel fields of its gpu actor; None and {} without expert parallelism."""
    ep = spec.expert_parallel
    if ep is None:
        return None, {}
    from taipan.actors.engine.ep import EpConsensus

    index, group = ep.group_of(rank)
    engine = f"engine-{rank}"
    peers = {p: channels[engine, f"ep-{p}"] for p in group if p != rank}
    load = {
        "expert_parallel_rank": group.index(rank),
        "expert_parallel_size": len(group),
        "expert_parallel_init": ep.inits[index],
    }
    return EpConsensus(rank, tuple(group), channels[engine, "ep"], peers), load


def _tp_leader(spec: LaunchSpec, rank: int, channels: dict) -> dict:
    """The gpu actor's tensor-parallel keyword arguments: it leads its rank's followers over
    its plans and reports channels ({} without tensor parallelism)."""
    tp = spec.tensor_parallel_size
    if tp == 1:
        return {}
    from taipan.actors.gpu.peers import Followers, TPSetup

    gpu = f"gpu-{rank}"
    plans, reports = channels[gpu, "plans"], channels[gpu, "reports"]
    return {
        "tp": TPSetup(0, tp, spec.tp_addresses[rank]["init"]),
        "followers": Followers(plans, reports, tp, rank, spec.tp_start_timeout),
    }


def _pin_cpus(cpus: list[int] | None) -> None:
    """Keep this engine rank (and the matmul threads torch starts later) on its own cores."""
    if cpus is None:
        return
    os.sched_setaffinity(0, cpus)
    threads = str(len(cpus))
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # read when torch loads, below
        os.environ[var] = threads
    torch = sys.modules.get("torch")
    if torch is not None:  # (forked with torch loaded, runtime/forked.py: too late for those)
        torch.set_num_threads(len(cpus))


async def engine_main(spec: LaunchSpec, rank: int) -> None:
    tp = spec.tensor_parallel_size
    _pin_cpus(spec.tp_cpu_sets[rank][0] if tp > 1 else spec.cpu_sets[rank])
    sys.setswitchinterval(gil_switch_seconds())  # (placement.py says why)
    # The followers start now: they import torch and load while this process does (across
    # hosts they are started there, and connect).
    local = tp > 1 and not spec.tp_remote
    followers = FollowerProcesses(spec, rank) if local else None
    try:
        await _engine_rank(spec, rank)
    finally:
        if followers is not None and followers.stop():
            exit_now(EXIT_PEER_DIED)


def load_model_message(spec: LaunchSpec, rank: int, ep_load: dict):
    """The LoadModel rank `rank`'s gpu actor gets (by keyword, the one place it is built)."""
    from taipan.messages.gpu import LoadModel

    config, tp = spec.config, spec.tensor_parallel_size
    max_requests, max_tokens = plan_limits(config)
    device = spec.devices[rank]
    decode_graphs, mixed_graphs = cuda_graph_sizes(config, device)
    mtp = bool(config.num_speculative_tokens) and config.speculative_method == "mtp"
    if mtp:  # (every step keeps its hidden states for the head: mixed graphs only)
        decode_graphs = ()
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
        speculative=config.num_speculative_tokens > 0,
        num_speculative_tokens=config.num_speculative_tokens,
        draft_model=_draft_model_path(config),
        # (a model without both windowed and global layers has none either way)
        local_kv_pool=not config.disable_hybrid_kv_cache_manager,
        local_kv_cache=config.enable_prefix_caching,
        mtp=mtp,
    )


def _draft_model_path(config) -> str:
    """The draft model's path for speculative_method 'draft_model' ("" without one)."""
    if not (config.num_speculative_tokens and config.speculative_method == "draft_model"):
        return ""
    if config.speculative_model.startswith("self:"):
        return config.speculative_model  # (the target's first layers: the worker builds it)
    from taipan.models import resolve

    return resolve(config.speculative_model)[1]


async def _engine_rank(spec: LaunchSpec, rank: int) -> None:
    from taipan.actors.allocator.actor import AllocatorActor
    from taipan.actors.engine.actor import EngineActor
    from taipan.actors.gpu.actor import GpuActor
    from taipan.actors.mamba_cache.actor import MambaCacheActor
    from taipan.models import has_mamba_layers

    # The mamba_cache actor runs only for a hybrid model (DESIGN.md §2).
    hybrid = has_mamba_layers(spec.model_path)
    engine, gpu = f"engine-{rank}", f"gpu-{rank}"
    with open_process(spec, engine, hybrid=hybrid) as channels:
        goodbyes = []  # where an EpBye or PeerBye is sent just before the end: it must go out
        try:
            ep, ep_load = _ep_group(spec, rank, channels)
            goodbyes += ep.peers.values() if ep else []
            gpu_tp = _tp_leader(spec, rank, channels)
            goodbyes += [gpu_tp["followers"].reports] if gpu_tp else []
            to_mamba = channels[engine, "mamba_cache"] if hybrid else None
            engine_actor = EngineActor(
                rank,
                spec.config,
                load_model_message(spec, rank, ep_load),
                channels[engine, "coordinator"],
                channels[engine, "allocator"],
                channels[engine, "gpu"],
                to_mamba,
                coordinator_timeout=spec.coordinator_timeout,
                ep=ep,
            )
            actors = [AllocatorActor(channels[f"allocator-{rank}", "engine"])]
            actors += [GpuActor(rank, channels[gpu, "engine"], **gpu_tp)]
            if hybrid:
                actors += [MambaCacheActor(channels[f"mamba_cache-{rank}", "engine"])]
            await _run_until_stopped([engine_actor, *actors])
        finally:
            for channel in goodbyes:
                channel.close(linger_ms=BYE_LINGER_MS)


async def tp_follower_main(spec: LaunchSpec, rank: int, tp_rank: int) -> None:
    """Tensor-parallel peer `tp_rank` of engine rank `rank` (actors/gpu/follower.py): a child
    of the rank's engine process, which watches it, or a process of its own on another host
    (SPEC's `tp_remote`). SIGTERM (or the parent's death) ends it; so does its leader's."""
    _pin_cpus(spec.tp_cpu_sets[rank][tp_rank])
    sys.setswitchinterval(gil_switch_seconds())
    from taipan.actors.gpu.follower import LEADER_TIMEOUT_S, FollowerActor
    from taipan.actors.gpu.peers import TPSetup

    setup = TPSetup(tp_rank, spec.tensor_parallel_size, spec.tp_addresses[rank]["init"])
    actor = f"gpu-{rank}-tp{tp_rank}"
    with open_process(spec, f"tp-follower-{rank}-{tp_rank}") as channels:
        follower = FollowerActor(
            rank, channels[actor, "plans"], channels[actor, "reports"], setup,
            spec.tp_devices[rank][tp_rank], spec.model_path,
            leader_timeout=spec.tp_start_timeout or LEADER_TIMEOUT_S,
        )  # fmt: skip
        await follower.run()


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
        exit_now(code)
    sys.exit(code)


def _leaves(group: BaseExceptionGroup):
    for e in group.exceptions:
        if isinstance(e, BaseExceptionGroup):
            yield from _leaves(e)
        else:
            yield e


if __name__ == "__main__":
    main(sys.argv[1:])
