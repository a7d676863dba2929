"""What each launcher role may be given, and the LaunchSpec its processes start from.

Roles (`ROLES`): "all" starts the coordinator and every engine rank here; "coordinator" the
coordinator only (engines join from other hosts); "engine" one engine rank that joins the
coordinator's `engine_address` as `data_parallel_rank`; "tp-follower" one tensor-parallel
follower (`tensor_parallel_rank` K of rank R) that joins its leader at `tp_address`.
`check_role` and `check_peers` refuse, before any process starts, a flag its role does not take
and a bind it would make without the Curve keys that tcp beyond loopback needs (a LaunchError
naming it, rather than a dead child). `build_spec` places each rank and tensor-parallel peer on
its device and cores (runtime/placement.py) and gives every socket and rendezvous its address:
private files in the runtime's temp dir under one launcher; across hosts, those of the flags (a
leader's `tp_address` tcp://HOST:PORT serves its plans on PORT, its followers' reports on PORT+1
and its TCPStore on PORT+2; each engine of an expert-parallel group is given every rank's
consensus inbox, `ep_inboxes`, and its group's rendezvous, `ep_init`). These functions read a
Runtime's fields (runtime/launcher.py) and never write them; they start nothing.
"""

from __future__ import annotations

import os

from taipan.actors.channel import check_bind
from taipan.actors.config import plan_limits
from taipan.actors.curve import CurveError
from taipan.auth import curve_keys
from taipan.placement import (
    LaunchError,
    check_ep_addresses,
    check_fused_gemv,
    gil_switch_seconds,
    gpu_process_cores,
    gpu_process_cpu_sets,
    next_port_address,
    peer_cpu_sets,
    peer_devices,
    physical_gpu,
    rank_cpu_sets,
    tp_addresses,
)
from taipan.spec import ExpertParallelSpec, LaunchSpec

ROLES = ("all", "coordinator", "engine", "tp-follower")
# An engine started alone (role engine) exits once its coordinator answers nothing for this long.
COORDINATOR_TIMEOUT_S = 10.0


def launch_keys(rt, address: str, *, server: bool):
    """The Curve keys of `rt`'s socket on `address` (runtime/auth.py), a LaunchError if the
    key directory cannot give them."""
    try:
        return curve_keys(address, rt.keys_dir, server=server, key_name=rt.key_name)
    except CurveError as e:
        raise LaunchError(str(e)) from None


def check_role(rt, *, address: str | None, engine_address: str | None, http_port) -> str:
    """Each role's addresses (`address` and `engine_address` as given, None when not), and the
    keys its binds need. Returns the coordinator's engine address (role coordinator without
    one: the port after `address`'s)."""
    _check_role_flags(rt, address, engine_address, http_port)
    backend = rt.engine_address
    if rt.role == "coordinator" and engine_address is None:
        backend = next_port_address(rt.address)
    if rt.role in ("all", "coordinator"):
        for bound in (rt.address, backend):
            check_bind(bound, launch_keys(rt, bound, server=True))
    return backend


def _check_role_flags(rt, address, engine_address, http_port) -> None:
    role, rank = rt.role, rt.rank
    if role == "engine" and (engine_address is None or rank is None):
        raise LaunchError(
            "role engine needs the coordinator's engine address (--coordinator) and this "
            "engine's --data-parallel-rank"
        )
    if role == "tp-follower" and None in (rank, rt.tp_address, rt.tp_rank):
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
        if not 0 <= rank < rt.num_ranks:
            raise LaunchError(
                f"--data-parallel-rank {rank} is outside 0..{rt.num_ranks - 1} "
                f"(--data-parallel-size {rt.num_ranks})"
            )
        if address is not None or http_port is not None:
            raise LaunchError(f"role {role} serves no clients: no --address or --http-port")
    elif rank is not None:
        raise LaunchError("--data-parallel-rank is for roles engine and tp-follower")


def check_peers(rt) -> list[str] | None:
    """Tensor- and expert-parallel peers across hosts: which role takes which flag, and the
    binds this process's rank will make. Returns the consensus inboxes as a list (role engine
    with expert parallelism), else as given."""
    role = rt.role
    if rt.tp_address is not None:
        if role not in ("engine", "tp-follower"):
            raise LaunchError(
                "--tp-address is for role engine (a rank's leader, which binds it) and role "
                "tp-follower (which connects to it)"
            )
        if rt.tp_size == 1:
            raise LaunchError("--tp-address needs --tensor-parallel-size above 1")
        addresses = tp_addresses(rt.tp_address)
        if role == "engine":
            for kind in ("plans", "reports"):
                check_bind(addresses[kind], launch_keys(rt, addresses[kind], server=True))
    if role == "tp-follower":
        if rt.tp_size == 1 or not 1 <= rt.tp_rank < rt.tp_size:
            raise LaunchError(
                f"--tensor-parallel-rank {rt.tp_rank} is outside 1..{rt.tp_size - 1} "
                f"(--tensor-parallel-size {rt.tp_size}; the leader is rank 0)"
            )
    elif rt.tp_rank is not None:
        raise LaunchError(
            "--tensor-parallel-rank is for role tp-follower (the engine is its rank's "
            "leader, rank 0)"
        )
    if role == "engine" and rt.expert_parallel_size > 1:
        inboxes = check_ep_addresses(rt.ep_inboxes, rt.ep_init, rt.num_ranks)
        own = inboxes[rt.rank]
        check_bind(own, launch_keys(rt, own, server=True))
        return inboxes
    if rt.ep_inboxes is not None or rt.ep_init is not None:
        raise LaunchError(
            "--ep-inboxes and --ep-init are for role engine with --expert-parallel-size "
            "above 1 (under one launcher, role all, the group meets in private files)"
        )
    return rt.ep_inboxes


def build_spec(rt) -> LaunchSpec:
    """The LaunchSpec every child of `rt` starts from (runtime/spec.py)."""
    config = rt.config
    max_requests, _ = plan_limits(config)
    blocks_per_request = -(-config.max_sequence_length // config.block_size_tokens)
    local = rt.role != "engine"  # an engine started alone shares its host with no rank
    devices = _peer_devices(rt)
    gil_switch_seconds()  # (a bad TAIPAN_GIL_SWITCH_MS is the launch's error, not a child's)
    check_fused_gemv()  # (and so is a bad TAIPAN_FUSED_GEMV, TAIPAN_PDL or TAIPAN_TP_GEMV_SUM)
    return LaunchSpec(
        frontend=rt.address,
        backend=rt.engine_address,
        num_ranks=rt.num_ranks,
        model_name=rt.model_name,
        model_path=rt.model_path,
        dtype=rt.dtype,
        device=rt.device,
        devices=[peers[0] for peers in devices],
        cpu_sets=_cpu_sets(rt),
        tensor_parallel_size=rt.tp_size,
        tp_devices=devices,
        tp_cpu_sets=_tp_cpu_sets(rt),
        tp_addresses=_tp_addresses(rt),
        tp_remote=rt.tp_address is not None,
        tp_start_timeout=rt.tp_start_timeout,
        config=config,
        max_blocks=max_requests * blocks_per_request,
        record_dir=rt.record_dir,
        log_level=rt.log_level,
        control_token_file=os.path.join(rt.tmp, "control-token.json"),
        http=rt.http,
        ranks_on_host=rt.num_ranks if local else 1,
        coordinator_timeout=None if local else COORDINATOR_TIMEOUT_S,
        keys_dir=rt.keys_dir,
        key_name=rt.key_name,
        expert_parallel=_ep_spec(rt),
    )


def _ep_spec(rt) -> ExpertParallelSpec | None:
    """Expert parallelism: the groups of engine ranks, each rank's consensus inbox and each
    group's torch.distributed meeting point (private files in the runtime's temp dir)."""
    if rt.expert_parallel_size == 1:
        return None
    from taipan.actors.engine.ep import ep_groups

    groups = ep_groups(rt.num_ranks, rt.expert_parallel_size)
    if rt.role == "engine":  # across hosts: the addresses given (only ours are used)
        return ExpertParallelSpec(
            groups=[list(g) for g in groups],
            inboxes=rt.ep_inboxes,
            inits=[rt.ep_init if rt.rank in g else None for g in groups],
        )
    return ExpertParallelSpec(
        groups=[list(g) for g in groups],
        inboxes=[f"ipc://{rt.tmp}/ep-{r}.sock" for r in range(rt.num_ranks)],
        inits=[f"file://{rt.tmp}/ep-init-{i}" for i in range(len(groups))],
    )


def _tp_addresses(rt) -> list[dict[str, str]]:
    """Per rank, its tensor-parallel sockets and rendezvous: in the private directory, or
    across hosts those of `tp_address` (only this process's rank uses its entry)."""
    if rt.tp_address is not None:
        return [tp_addresses(rt.tp_address)] * rt.num_ranks
    return [
        {
            "plans": f"ipc://{rt.tmp}/tp-{r}-plans.sock",
            "reports": f"ipc://{rt.tmp}/tp-{r}-reports.sock",
            "init": f"file://{rt.tmp}/tp-{r}.init",
        }
        for r in range(rt.num_ranks)
    ]


def _tp_cpu_sets(rt) -> list[list[list[int] | None]]:
    if rt.tp_address is not None:  # one peer of the rank on this host: every core
        return [[None] * rt.tp_size] * rt.num_ranks
    pinned = _gpu_cpu_sets(rt)
    if pinned is not None:
        return pinned
    cpus = sorted(os.sched_getaffinity(0))
    return [peer_cpu_sets(rank_cpus, rt.tp_size, cpus) for rank_cpus in _cpu_sets(rt)]


def _gpu_cpu_sets(rt) -> list[list[list[int]]] | None:
    """On CUDA, per rank its peers' own cores (placement.py `gpu_process_cpu_sets`), or None."""
    if rt.role == "engine" or not str(rt.device).startswith("cuda"):
        return None
    devices = _peer_devices(rt)
    gpus = [physical_gpu(d) for peers in devices for d in peers]
    cpus = sorted(os.sched_getaffinity(0))
    sets = gpu_process_cpu_sets(gpus, cpus, gpu_process_cores())
    if sets is None:
        return None
    tp = rt.tp_size
    return [sets[r * tp : (r + 1) * tp] for r in range(rt.num_ranks)]


def _peer_devices(rt) -> list[list[str]]:
    """Per rank, its tensor-parallel peers' devices (one peer without tensor parallelism)."""
    if rt.tp_address is not None:  # one peer of the rank on this host: the device named
        return [[rt.device] * rt.tp_size] * rt.num_ranks
    if rt.role == "engine":  # one rank on this host: its peers from the device as named
        return [peer_devices(rt.device, 0, 1, rt.tp_size)] * rt.num_ranks
    return [peer_devices(rt.device, r, rt.num_ranks, rt.tp_size) for r in range(rt.num_ranks)]


def _cpu_sets(rt) -> list[list[int] | None]:
    if rt.role == "engine":
        return [None] * rt.num_ranks
    pinned = _gpu_cpu_sets(rt)
    if pinned is not None:
        return [peers[0] for peers in pinned]
    return rank_cpu_sets(rt.num_ranks, sorted(os.sched_getaffinity(0)))
