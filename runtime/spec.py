"""The launch spec: what the launcher (runtime/launcher.py) hands every child process it starts
(runtime/procs.py), as one JSON argument on the command line.

`LaunchSpec` is built once by the launcher and parsed once at each process's entry; both sides
read fields by name. The JSON wire form is a flat object with one key per field (the expert-
parallel part nested under `expert_parallel`); `from_json` refuses unknown or missing keys, so a
launcher and a child of different versions fail at once with the keys named. Frozen: a process
never writes its run-time discoveries back into it (`LaunchSpec.for_coordinator` builds one for
a coordinator started without engines of its own, as the relay bench does). The sockets each
process opens are derived from it, as data, by runtime/wiring.py. Imports no torch and no zmq.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from taipan.actors.config import InferenceConfig


class SpecError(ValueError):
    """A launch spec that does not parse: not JSON, or unknown or missing keys."""


@dataclass(frozen=True)
class ExpertParallelSpec:
    """Expert parallelism: the groups of engine ranks and where each meets (actors/engine/ep.py)."""

    groups: list[list[int]]  # the engine ranks of each group, consecutive
    inboxes: list[str]  # per data-parallel rank, its consensus inbox (it binds its own)
    # Per group, its torch.distributed meeting point (a file, or tcp://HOST:PORT across hosts;
    # None for the groups an engine started alone does not belong to).
    inits: list[str | None]

    def group_of(self, rank: int) -> tuple[int, list[int]]:
        """(index, ranks) of the group holding `rank`."""
        return next((i, g) for i, g in enumerate(self.groups) if rank in g)


@dataclass(frozen=True)
class LaunchSpec:
    """Everything a coordinator, engine, tensor-parallel follower or HTTP process needs to start."""

    frontend: str  # the coordinator's client address
    backend: str  # the coordinator's engine address
    num_ranks: int  # data-parallel engine ranks
    model_name: str
    model_path: str
    dtype: str
    device: str
    # Per rank: its device (rank r of a CUDA runtime uses its own GPU) and, with several ranks,
    # its own share of this machine's cores (None: all of them).
    devices: list[str]
    cpu_sets: list[list[int] | None]
    # Tensor parallel: per rank, each peer's device and cores (the leader first), and the rank's
    # sockets and rendezvous (actors/gpu/peers.py): in the launcher's private directory, or
    # across hosts those of --tp-address (runtime/placement.py tp_addresses).
    tensor_parallel_size: int
    tp_devices: list[list[str]]
    tp_cpu_sets: list[list[list[int] | None]]
    tp_addresses: list[dict[str, str]]  # per rank: "plans", "reports", "init"
    # Across hosts (tp_address): the followers are processes of their own hosts; a leader waits
    # for them, and a follower for its leader, as long as start waits.
    tp_remote: bool
    tp_start_timeout: float | None
    config: InferenceConfig
    max_blocks: int  # more blocks than every admissible request can hold would only waste memory
    record_dir: str | None  # record every actor's messages here (runtime/replay.py)
    log_level: str | None
    control_token_file: str  # the coordinator's control token, readable by this user only
    http: dict | None  # the HTTP server's options (runtime/server/app.py http_main reads them)
    # An engine on its own (role engine) shares its host with no other rank, and exits once its
    # coordinator (on another host) falls silent; local engines die with the launcher.
    ranks_on_host: int
    coordinator_timeout: float | None
    keys_dir: str | None  # the directory only: secrets never go on a command line
    key_name: str  # the Curve client key pair this host's connecting sockets use
    expert_parallel: ExpertParallelSpec | None  # None without expert parallelism

    @classmethod
    def for_coordinator(
        cls,
        frontend: str,
        backend: str,
        num_ranks: int,
        model_name: str,
        config: InferenceConfig,
        control_token_file: str,
        log_level: str | None = None,
    ) -> LaunchSpec:
        """The spec of a coordinator process alone (its engines start elsewhere, e.g. the relay
        bench's synthetic ones): the engine-side fields empty."""
        return cls(
            frontend=frontend, backend=backend, num_ranks=num_ranks, model_name=model_name,
            model_path="", dtype="", device="", devices=[], cpu_sets=[],
            tensor_parallel_size=1, tp_devices=[], tp_cpu_sets=[], tp_addresses=[],
            tp_remote=False, tp_start_timeout=None, config=config, max_blocks=0,
            record_dir=None, log_level=log_level, control_token_file=control_token_file,
            http=None, ranks_on_host=1, coordinator_timeout=None, keys_dir=None,
            key_name="client", expert_parallel=None,
        )  # fmt: skip

    def to_dict(self) -> dict:
        """The wire form: one key per field, `config` and `expert_parallel` as plain dicts."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values["config"] = self.config.to_dict()
        ep = self.expert_parallel
        values["expert_parallel"] = None if ep is None else dataclasses.asdict(ep)
        return values

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, values: dict) -> LaunchSpec:
        _check_keys(cls, values, "launch spec")
        ep = values["expert_parallel"]
        if ep is not None:
            _check_keys(ExpertParallelSpec, ep, "launch spec's expert_parallel")
            ep = ExpertParallelSpec(**ep)
        config = InferenceConfig.from_dict(values["config"])
        return cls(**{**values, "config": config, "expert_parallel": ep})

    @classmethod
    def from_json(cls, text: str) -> LaunchSpec:
        try:
            values = json.loads(text)
        except ValueError as e:
            raise SpecError(f"the launch spec is not JSON: {e}") from None
        if not isinstance(values, dict):
            raise SpecError(f"the launch spec must be a JSON object, got {type(values).__name__}")
        return cls.from_dict(values)


def _check_keys(cls, values: dict, what: str) -> None:
    if not isinstance(values, dict):
        raise SpecError(f"the {what} must be an object, got {type(values).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown, missing = sorted(set(values) - names), sorted(names - set(values))
    if unknown or missing:
        parts = [f"unknown key(s) {', '.join(unknown)}"] if unknown else []
        parts += [f"missing key(s) {', '.join(missing)}"] if missing else []
        raise SpecError(f"the {what} has {' and '.join(parts)} (launcher and child disagree?)")
