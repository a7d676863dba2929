"""Where a runtime's ranks and peers go, before any process starts: the parallel sizes that are
legal (`check_parallel_sizes`, `check_ep_fields`), each rank's and tensor-parallel peer's device
(`rank_device`, `peer_devices`) and CPU cores (`rank_cpu_sets`, `peer_cpu_sets`; on GPUs
`gpu_process_cpu_sets`), and the
addresses derived from one another across hosts (`next_port_address`, `tp_addresses`,
`check_ep_addresses`). Pure functions of their arguments; every refusal is a LaunchError naming
the flag. Starts nothing (runtime/launcher.py does).
"""

from __future__ import annotations

import os

from taipan.actors.config import InferenceConfig


class LaunchError(RuntimeError):
    pass


def next_port_address(address: str) -> str:
    """The coordinator's default engine address beside its client address `tcp://HOST:PORT`:
    tcp://HOST:PORT+1 (LaunchError for any other address: name it with --engine-address)."""
    host, sep, port = address.removeprefix("tcp://").rpartition(":")
    if not address.startswith("tcp://") or not sep or not port.isdigit():
        raise LaunchError(
            f"role coordinator with --address {address}: give the address engines connect to "
            "with --engine-address (the default, PORT+1, needs a tcp://HOST:PORT address)"
        )
    return f"tcp://{host}:{int(port) + 1}"


def tp_addresses(address: str) -> dict[str, str]:
    """A rank's tensor-parallel sockets and rendezvous from its leader's `tcp://HOST:PORT`: the
    plans on PORT, the reports on PORT+1, torch.distributed's TCPStore on PORT+2."""
    host, sep, port = address.removeprefix("tcp://").rpartition(":")
    if not address.startswith("tcp://") or not sep or not host or not port.isdigit():
        raise LaunchError(
            f"--tp-address {address!r}: give the leader's tcp://HOST:PORT (it binds PORT and "
            "PORT+1, and torch.distributed's rendezvous listens on PORT+2)"
        )
    if not 0 < int(port) <= 65533:
        raise LaunchError(f"--tp-address {address!r}: PORT must be in 1..65533 (PORT+2 is used)")
    p = int(port)
    return {
        "plans": f"tcp://{host}:{p}",
        "reports": f"tcp://{host}:{p + 1}",
        "init": f"tcp://{host}:{p + 2}",
    }


def check_ep_addresses(inboxes, init: str | None, num_ranks: int) -> list[str]:
    """Every data-parallel rank's consensus inbox, as a list (given as one or comma-separated);
    LaunchError unless each rank has a distinct tcp:// (or ipc://) address and the group's
    rendezvous `init` is given."""
    if inboxes is None or init is None:
        raise LaunchError(
            "role engine with --expert-parallel-size above 1 needs --ep-inboxes (every rank's "
            "consensus inbox, tcp://HOST:PORT, comma-separated, the same list on every engine) "
            "and --ep-init (its group's torch.distributed rendezvous, tcp://HOST:PORT on the "
            "host of the group's first rank)"
        )
    if isinstance(inboxes, str):
        inboxes = [a.strip() for a in inboxes.split(",") if a.strip()]
    inboxes = list(inboxes)
    if len(inboxes) != num_ranks:
        raise LaunchError(
            f"--ep-inboxes names {len(inboxes)} address(es); give one per data-parallel rank "
            f"({num_ranks}), in rank order"
        )
    bad = [a for a in inboxes if not a.startswith(("tcp://", "ipc://"))]
    if bad:
        raise LaunchError(f"--ep-inboxes: {bad[0]!r} is not a tcp:// (or ipc://) address")
    if len(set(inboxes)) != len(inboxes):
        raise LaunchError(f"--ep-inboxes: every rank needs an address of its own, got {inboxes}")
    if not init.startswith(("tcp://", "file://")):
        raise LaunchError(
            f"--ep-init {init!r}: give torch.distributed's rendezvous as tcp://HOST:PORT"
        )
    return inboxes


def check_parallel_sizes(data: int, tensor: int = 1, expert: int = 1) -> None:
    """LaunchError for a parallel size that is not >= 1 or not built yet. (Whether the model
    splits over `tensor` ranks is the loader's to say: ops/parallel.py, a load_failed.)"""
    for name, size in (("data", data), ("tensor", tensor), ("expert", expert)):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise LaunchError(f"{name}_parallel_size must be an int >= 1, got {size!r}")
    if data % expert:
        # An expert-parallel group is E consecutive data-parallel ranks (attention stays data
        # parallel; the experts are split over the group).
        raise LaunchError(
            f"expert_parallel_size={expert} must divide data_parallel_size={data}: each group "
            "of E consecutive engine ranks splits the experts between them"
        )


EP_FIELDS = ("ep_consensus_interval", "disable_ep_consensus", "use_synchronous_zmq_collectives")


def check_ep_fields(config: InferenceConfig, expert: int) -> None:
    """LaunchError for an EP consensus field set without expert parallelism, where it would
    change nothing (an option is never silently ignored), and for what expert parallelism
    does not serve yet."""
    if expert > 1:
        if config.num_speculative_tokens and config.speculative_method == "draft_model":
            raise LaunchError(
                "speculative_method='draft_model' under expert parallelism is not built yet "
                "(the draft would have to join every dummy step)"
            )
        return
    default = InferenceConfig()
    for name in EP_FIELDS:
        if getattr(config, name) != getattr(default, name):
            raise LaunchError(
                f"{name}={getattr(config, name)!r} applies to expert-parallel groups only: "
                "set --expert-parallel-size above 1, or leave it at its default"
            )


def rank_device(device: str, rank: int, num_ranks: int) -> str:
    """The device of data-parallel rank `rank`: on CUDA each rank its own GPU, counted from the
    one named ("cuda" or "cuda:0": rank r on cuda:r; "cuda:2": rank r on cuda:2+r); elsewhere
    every rank shares `device`."""
    if num_ranks == 1 or not device.startswith("cuda"):
        return device
    _, _, index = device.partition(":")
    return f"cuda:{int(index or 0) + rank}"


def peer_devices(device: str, rank: int, num_ranks: int, tp: int) -> list[str]:
    """The devices of rank `rank`'s `tp` tensor-parallel peers (the leader first): on CUDA
    peer k of rank r on the (r*tp + k)-th GPU from the one named; elsewhere `device`."""
    return [rank_device(device, rank * tp + k, num_ranks * tp) for k in range(tp)]


def peer_cpu_sets(rank_cpus: list[int] | None, tp: int, cpus: list[int]) -> list[list[int] | None]:
    """The cores of a rank's `tp` peers: the rank's share (`rank_cpus`, None: all of `cpus`)
    split between them as `rank_cpu_sets` splits a machine between ranks."""
    if tp == 1:
        return [rank_cpus]
    return rank_cpu_sets(tp, rank_cpus if rank_cpus is not None else cpus)


def rank_cpu_sets(num_ranks: int, cpus: list[int]) -> list[list[int] | None]:
    """Each rank's CPU cores: with one rank, None (all of them, as torch chooses); with several,
    contiguous, disjoint and as equal as they can be (so the ranks' matmul threads do not fight
    over the same cores), and round-robin single cores when there are more ranks than cores."""
    if num_ranks == 1 or not cpus:
        return [None] * num_ranks
    if num_ranks > len(cpus):
        return [[cpus[r % len(cpus)]] for r in range(num_ranks)]
    base, extra = divmod(len(cpus), num_ranks)
    sets, start = [], 0
    for r in range(num_ranks):
        n = base + (r < extra)
        sets.append(cpus[start : start + n])
        start += n
    return sets


# A process that drives a GPU runs its step loop on one thread and waits for the device on
# another. Pinning it to cores of its own (TAIPAN_GPU_PROCESS_CORES=2) is opt-in: on one H100
# host (16 cores) the 1B shape's batch-64 step was 2.35-2.99 ms as is and 1.96-2.41 ms with the
# engine on two cores and every other process on the rest (`tests/perf/session8_pin.sh`), but
# with only the engine pinned, on a 32-core host, 2.01-2.37 vs 1.86-2.88 ms
# (`session8_pin2.sh`): no clear gain, and two cores would also cap what the engine process
# runs on its CPU (llguidance's mask threads, a GGUF's dequantization). tests/perf/NOTES.md.
GPU_PROCESS_CORES = 0
CORES_ENV = "TAIPAN_GPU_PROCESS_CORES"  # cores per GPU process; 0: no pinning


def gpu_process_cores() -> int:
    """Cores each GPU process is pinned to (TAIPAN_GPU_PROCESS_CORES; default 0: none)."""
    raw = os.environ.get(CORES_ENV, str(GPU_PROCESS_CORES))
    if not raw.strip().isdigit():
        raise LaunchError(f"{CORES_ENV}={raw!r}: give a number of cores (0: do not pin)")
    return int(raw)


# An engine process runs its step loop on the event loop's thread beside the threads that launch
# and collect the gpu actor's steps; a thread whose CUDA wait has ended waits for the GIL while
# the loop runs Python (a batch-64 stream's outputs are ~3 ms of it per step), up to CPython's
# switch interval (5 ms) before it may take it. A shorter interval bounds that wait: the step
# after a grammar check, and every step's collect, reach the device sooner.
GIL_SWITCH_MS = 0.5
SWITCH_ENV = "TAIPAN_GIL_SWITCH_MS"  # the engine and tensor-parallel processes' switch interval


def gil_switch_seconds() -> float:
    """The switch interval engine processes set (TAIPAN_GIL_SWITCH_MS, default GIL_SWITCH_MS;
    CPython's own is 5), in seconds for sys.setswitchinterval."""
    raw = os.environ.get(SWITCH_ENV, str(GIL_SWITCH_MS))
    try:
        ms = float(raw)
    except ValueError:
        ms = float("nan")
    if not 0.01 <= ms <= 100:  # (nan fails too)
        raise LaunchError(
            f"{SWITCH_ENV}={raw!r}: give milliseconds in [0.01, 100] (CPython's is 5)"
        )
    return ms / 1e3


# The GPU processes' fused one-row decode layers (ops/layers.py reads it when torch loads there;
# a bad value is checked here first, so that it is the launch's error, not a child's).
FUSED_GEMV_ENV = "TAIPAN_FUSED_GEMV"


# The other switches of the decode kernels, each 0 or 1 (read by the children at import):
# kernels/pdl.py's programmatic dependent launch, ops/custom_all_reduce.py's products with sums.
KERNEL_SWITCHES = {
    FUSED_GEMV_ENV: ("1", "unfused layers", "fused"),
    "TAIPAN_PDL": ("1", "no programmatic dependent launch", "PDL where the GPU has it"),
    "TAIPAN_TP_GEMV_SUM": ("0", "product, then sum", "TP products with their sums"),
}


def check_fused_gemv() -> None:
    """TAIPAN_FUSED_GEMV, TAIPAN_PDL and TAIPAN_TP_GEMV_SUM, if set, are 0 or 1 (KERNEL_SWITCHES:
    their defaults and meanings): anything else is the launch's error, not a child's."""
    for name, (default, off, on) in KERNEL_SWITCHES.items():
        raw = os.environ.get(name, default)
        if raw not in ("0", "1"):
            raise LaunchError(f"{name}={raw!r}: give 0 ({off}) or 1 ({on})")


def physical_gpu(device: str) -> int:
    """The index of CUDA `device` among the host's GPUs (through CUDA_VISIBLE_DEVICES where it
    lists indices; else the index as named)."""
    _, _, index = device.partition(":")
    n = int(index) if index.isdigit() else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
    if n < len(visible) and visible[n].strip().isdigit():
        return int(visible[n])
    return n


def gpu_process_cpu_sets(gpus: list[int], cpus: list[int], cores: int) -> list[list[int]] | None:
    """The cores of each process driving GPU `gpus[i]`: `cores` of its own, counted down from
    the last of `cpus` by its GPU's index (so runtimes on other GPUs of the host take other
    cores), the rest of the host left to clients, the coordinator and the caller. None (leave
    placement to the OS) when `cores` is 0 or no process drives a GPU. Every set must fit and
    leave at least as many cores for the rest: a LaunchError naming TAIPAN_GPU_PROCESS_CORES
    when the host cannot spare them (asked for, never silently dropped)."""
    if cores < 1 or not gpus:
        return None
    need = (max(gpus) + 1) * cores
    rest = max(cores, len(gpus) * cores)
    if need + rest > len(cpus):
        raise LaunchError(
            f"{CORES_ENV}={cores}: the processes of GPUs {sorted(gpus)} need cores up to "
            f"{need} of their own and {rest} left for the rest, and this process may use "
            f"{len(cpus)}; set it lower, or to 0 to leave placement to the OS"
        )
    return [cpus[len(cpus) - (g + 1) * cores : len(cpus) - g * cores] for g in gpus]
