"""The launch spec (runtime/spec.py): what the launcher hands each child process, typed on both
sides, the same JSON keys on the wire. Nothing is started here."""

from __future__ import annotations

import dataclasses
import json

import pytest

from taipan.actors.config import InferenceConfig
from taipan.launcher import Runtime
from taipan.spec import ExpertParallelSpec, LaunchSpec, SpecError


def a_spec(**changes) -> LaunchSpec:
    spec = LaunchSpec(
        frontend="ipc:///tmp/x/frontend.sock",
        backend="ipc:///tmp/x/backend.sock",
        num_ranks=2,
        model_name="tiny",
        model_path="random:tiny",
        dtype="float32",
        device="cpu",
        devices=["cpu", "cpu"],
        cpu_sets=[[0], [1]],
        tensor_parallel_size=2,
        tp_devices=[["cpu", "cpu"], ["cpu", "cpu"]],
        tp_cpu_sets=[[[0], None], [[1], None]],
        tp_addresses=[{"plans": "ipc:///p", "reports": "ipc:///r", "init": "file:///i"}] * 2,
        tp_remote=False,
        tp_start_timeout=None,
        config=InferenceConfig(max_sequence_length=512, block_size_tokens=16),
        max_blocks=4096,
        record_dir=None,
        log_level="info",
        control_token_file="/tmp/x/control-token.json",
        http={"host": "127.0.0.1", "port": 8000, "api_key": None},
        ranks_on_host=2,
        coordinator_timeout=10.0,
        keys_dir=None,
        key_name="client",
        expert_parallel=ExpertParallelSpec(
            groups=[[0, 1]], inboxes=["ipc:///e0", "ipc:///e1"], inits=["file:///g0"]
        ),
    )
    return dataclasses.replace(spec, **changes)


@pytest.mark.parametrize("ep", [True, False])
def test_the_json_round_trip_is_exact(ep):
    spec = a_spec() if ep else a_spec(expert_parallel=None)
    text = spec.to_json()
    assert LaunchSpec.from_json(text) == spec
    assert LaunchSpec.from_json(text).to_json() == text
    wire = json.loads(text)
    assert len(wire) == 26 and wire["config"]["max_sequence_length"] == 512
    assert wire["expert_parallel"] == ({"groups": [[0, 1]], "inboxes": ["ipc:///e0", "ipc:///e1"],
                                        "inits": ["file:///g0"]} if ep else None)  # fmt: skip


def test_unknown_and_missing_keys_are_named():
    wire = json.loads(a_spec().to_json())
    with pytest.raises(SpecError, match="unknown key.* colour"):
        LaunchSpec.from_json(json.dumps({**wire, "colour": "red"}))
    del wire["max_blocks"], wire["key_name"]
    with pytest.raises(SpecError, match="missing key.* key_name, max_blocks"):
        LaunchSpec.from_json(json.dumps(wire))
    wire = json.loads(a_spec().to_json())
    wire["expert_parallel"]["colour"] = "red"
    with pytest.raises(SpecError, match="expert_parallel has unknown key.* colour"):
        LaunchSpec.from_json(json.dumps(wire))
    with pytest.raises(SpecError, match="not JSON"):
        LaunchSpec.from_json("{")
    with pytest.raises(SpecError, match="must be a JSON object"):
        LaunchSpec.from_json("[]")


def test_a_coordinator_alone_has_a_whole_spec():
    """The relay bench's coordinator (runtime/bench/relay.py) gets a LaunchSpec like any other
    process: it round-trips and parses strictly."""
    config = InferenceConfig(max_requests=8)
    spec = LaunchSpec.for_coordinator("ipc://a", "ipc://b", 3, "synthetic", config, "/t", "warning")
    assert LaunchSpec.from_json(spec.to_json()) == spec
    assert (spec.num_ranks, spec.devices, spec.expert_parallel) == (3, [], None)


@pytest.mark.parametrize("parallel", [{}, {"data_parallel_size": 2, "expert_parallel_size": 2}])
def test_the_launchers_spec_parses(parallel):
    config = InferenceConfig(max_sequence_length=256, block_size_tokens=16)
    rt = Runtime("random:tiny", config, **parallel)
    try:
        spec = rt._spec()
        assert LaunchSpec.from_json(spec.to_json()) == spec
        assert spec.config is config and spec.max_blocks % (256 // 16) == 0
        assert spec.devices == ["cpu"] * rt.num_ranks and spec.ranks_on_host == rt.num_ranks
        if parallel:
            assert spec.expert_parallel.groups == [[0, 1]]
        else:
            assert spec.expert_parallel is None
    finally:
        rt.shutdown()
