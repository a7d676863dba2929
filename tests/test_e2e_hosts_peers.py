"""Tensor-parallel followers and expert-parallel groups on other hosts, on one machine: every
`taipan serve` role in its own process group, over tcp, authenticated with CurveZMQ keys:

- a remote follower started before its leader is waited for; a STOP through the coordinator
  ends the engine cleanly and, by its goodbye, the follower (exit 0);
- DP=2 x TP=2 with both followers started as `--role tp-follower` (each leader bound on 0.0.0.0
  with keys) gives T = 1's greedy tokens on both ranks; rank 1's follower SIGKILLed: its leader
  ends within seconds naming it (exit code 4 behind `taipan serve`'s 1), the coordinator shows
  rank 1 dead and rank 0 serves on; rank 0's leader SIGKILLed: its follower exits non-zero
  within seconds; SIGINT to the coordinator stops what is left cleanly (exit 0);
- EP=2 with the two engines started as separate `--role engine` processes (`--ep-inboxes`,
  `--ep-init`, Curve on the inboxes) gives the greedy tokens of EP=2 under one launcher;
- missing or contradictory flags are LaunchErrors naming them, before anything starts, and a
  leader or inbox bound beyond loopback without keys is refused.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from taipan.actors.channel import AddressError
from taipan.actors.config import InferenceConfig
from taipan.actors.curve import load_client_keys, write_keys
from taipan.client import Client, ControlError
from taipan.launcher import LaunchError, Runtime
from taipan.messages.requests import SamplingParams
from taipan.placement import tp_addresses
from tests.ports import free_ports
from tests.random_llama import GPU_TINY_SHAPE, TINY_SHAPE, make_random_llama

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12] * 10, [40, 41], [200, 3, 17, 90] * 5]
CONFIG = dict(
    block_size_tokens=16,
    max_tokens=48,
    max_requests=4,
    buffer_size_gb=0.05,
    max_sequence_length=256,
    enable_chunked_prefill=True,
)
GONE_S = 10.0  # a peer's end is noticed within this (a loaded 2-core box: generous)


def _serve(model: str, *args: str, cwd: str | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "taipan.cli", "serve", "--model", model, *args]
    cmd += [x for k, v in CONFIG.items() for x in ("--set", f"{k}={str(v).lower()}")]
    # Its own process group, as on another host: nothing here is its parent's business.
    return subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, start_new_session=True, cwd=cwd)


def _stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _greedy(runtime: Runtime) -> list[list[int]]:
    with runtime as rt, Client(rt.address) as c:
        return [d.token_ids for d in c.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("keys") / "set"
    write_keys(directory)
    return str(directory)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_random_llama(str(tmp_path_factory.mktemp("hosts-tp") / "tiny"), TINY_SHAPE)


def _wait_dead(client: Client, rank: int) -> None:
    deadline = time.monotonic() + GONE_S
    while client.stats().ranks[rank].alive:
        assert time.monotonic() < deadline, f"rank {rank} not declared dead within {GONE_S} s"
        time.sleep(0.1)


@pytest.mark.slow
def test_tp_followers_on_other_hosts(tiny, keys):
    want = _greedy(Runtime(tiny, InferenceConfig(**CONFIG)))
    assert len({tuple(w) for w in want}) > 1  # the prompts lead somewhere different
    port, tp_base = free_ports(2), free_ports(6)
    tp_ports = [tp_base, tp_base + 3]  # each leader: PORT, PORT+1, PORT+2
    sizes = ["--data-parallel-size", "2", "--tensor-parallel-size", "2", "--keys", keys]
    coord = _serve(tiny, "--role", "coordinator", "--address", f"tcp://127.0.0.1:{port}", *sizes)
    leaders, followers = [], []
    for r in (0, 1):
        ranked = [*sizes, "--data-parallel-rank", str(r)]
        leaders.append(
            _serve(
                tiny,
                "--role",
                "engine",
                "--coordinator",
                f"tcp://127.0.0.1:{port + 1}",
                "--tp-address",
                f"tcp://0.0.0.0:{tp_ports[r]}",
                *ranked,
            )  # fmt: skip
        )
        followers.append(
            _serve(
                tiny,
                "--role",
                "tp-follower",
                "--tp-address",
                f"tcp://127.0.0.1:{tp_ports[r]}",
                "--tensor-parallel-rank",
                "1",
                *ranked,
            )  # fmt: skip
        )
    everyone = [coord, *leaders, *followers]
    try:
        address = f"tcp://127.0.0.1:{port}"
        with Client(address, curve=load_client_keys(keys), connect_timeout=180) as c:
            assert [d.token_ids for d in c.generate(PROMPTS, GREEDY)] == want
            assert all(r.alive and r.steps_total > 0 for r in c.stats().ranks)
            # Rank 1's follower host goes down: its leader ends at once, naming it.
            os.killpg(followers[1].pid, signal.SIGKILL)
            killed = time.monotonic()
            assert leaders[1].wait(GONE_S) == 1
            assert time.monotonic() - killed < GONE_S
            _wait_dead(c, 1)
            assert [d.token_ids for d in c.generate(PROMPTS, GREEDY)] == want  # rank 0 serves
            # Rank 0's leader host goes down: its follower exits within seconds.
            os.killpg(leaders[0].pid, signal.SIGKILL)
            killed = time.monotonic()
            assert followers[0].wait(GONE_S) == 1
            assert time.monotonic() - killed < GONE_S
            _wait_dead(c, 0)
        coord.send_signal(signal.SIGINT)
        assert coord.wait(60) == 0
    finally:
        _stop(*everyone)
    err = leaders[1].stderr.read()
    assert "tensor-parallel follower 1" in err and "is gone" in err, err[-3000:]
    assert "engine-1 exited with code 4" in err, err[-3000:]
    err = followers[0].stderr.read()
    assert "the connection to the leader closed without a goodbye" in err, err[-3000:]
    assert "tp-follower-0-1 exited with code 4" in err and "Traceback" not in err


def test_a_remote_follower_without_the_checkpoint_and_a_clean_stop(tiny, keys, tmp_path):
    """A weight update from a path the follower's host lacks (relative to each process's
    directory: only the leader's has it) fails as a whole, naming the follower, and the rank
    serves on with its old weights; one every peer can read lands. STOP through the
    coordinator: the engine says goodbye, and its follower exits 0."""
    leader_dir, follower_dir = tmp_path / "leader-host", tmp_path / "follower-host"
    follower_dir.mkdir()
    make_random_llama(str(leader_dir / "ckpt"), TINY_SHAPE, seed=7)
    port, tp_port = free_ports(2), free_ports(3)
    address = f"tcp://127.0.0.1:{port}"
    coord = _serve(tiny, "--role", "coordinator", "--address", address, "--keys", keys)
    rank = ["--tensor-parallel-size", "2", "--data-parallel-rank", "0", "--keys", keys]
    follower = _serve(
        tiny, "--role", "tp-follower", "--tp-address", f"tcp://127.0.0.1:{tp_port}",
        "--tensor-parallel-rank", "1", *rank, cwd=str(follower_dir),
    )  # fmt: skip
    leader = _serve(
        tiny, "--role", "engine", "--coordinator", f"tcp://127.0.0.1:{port + 1}",
        "--tp-address", f"tcp://127.0.0.1:{tp_port}", *rank, cwd=str(leader_dir),
    )  # fmt: skip
    try:
        with Client(address, curve=load_client_keys(keys), connect_timeout=180) as c:
            before = c.generate(PROMPTS[:1], GREEDY)[0].token_ids
            assert len(before) == GREEDY.max_tokens
            c.pause()
            c.suspend("persist")
            with pytest.raises(ControlError, match="tensor-parallel peer 1") as e:
                c.update_weights("ckpt")
            assert "ckpt" in str(e.value)
            c.resume()
            c.unpause()
            assert c.generate(PROMPTS[:1], GREEDY)[0].token_ids == before  # old weights
            c.pause()
            c.suspend("persist")
            c.update_weights(str(leader_dir / "ckpt"))
            c.resume()
            c.unpause()
            after = c.generate(PROMPTS[:1], GREEDY)[0].token_ids
            assert after != before and len(after) == GREEDY.max_tokens
        coord.send_signal(signal.SIGINT)
        assert coord.wait(60) == 0
        assert leader.wait(60) == 0
        assert follower.wait(30) == 0
    finally:
        _stop(coord, leader, follower)
    assert "the leader stops: leaving" in follower.stderr.read()


@pytest.mark.slow
def test_ep_group_of_engines_on_other_hosts(tmp_path, keys):
    from tests.random_moe import make_random_qwen3_moe

    moe = make_random_qwen3_moe(str(tmp_path / "moe"))
    want = _greedy(
        Runtime(moe, InferenceConfig(**CONFIG), data_parallel_size=2, expert_parallel_size=2)
    )
    port, ep_port = free_ports(2), free_ports(3)
    sizes = ["--data-parallel-size", "2", "--expert-parallel-size", "2", "--keys", keys]
    coord = _serve(moe, "--role", "coordinator", "--address", f"tcp://127.0.0.1:{port}", *sizes)
    inboxes = f"tcp://127.0.0.1:{ep_port},tcp://127.0.0.1:{ep_port + 1}"
    engines = [
        _serve(
            moe,
            "--role",
            "engine",
            "--coordinator",
            f"tcp://127.0.0.1:{port + 1}",
            "--data-parallel-rank",
            str(r),
            "--ep-inboxes",
            inboxes,
            "--ep-init",
            f"tcp://127.0.0.1:{ep_port + 2}",
            *sizes,
        )  # fmt: skip
        for r in (0, 1)
    ]
    try:
        address = f"tcp://127.0.0.1:{port}"
        with Client(address, curve=load_client_keys(keys), connect_timeout=180) as c:
            assert [d.token_ids for d in c.generate(PROMPTS, GREEDY)] == want
            assert all(r.alive and r.steps_total > 0 for r in c.stats().ranks)
        coord.send_signal(signal.SIGINT)
        assert coord.wait(60) == 0
        assert [e.wait(60) for e in engines] == [0, 0]
    finally:
        _stop(coord, *engines)
    assert all("Traceback" not in e.stderr.read() for e in engines)


def test_refusals(tiny, keys):
    engine = dict(role="engine", engine_address="tcp://127.0.0.1:9", data_parallel_rank=0)
    follower = dict(role="tp-follower", data_parallel_rank=0, tensor_parallel_size=2)
    cases = [
        (dict(follower), "role tp-follower needs its leader's --tp-address"),
        (dict(follower, tp_address="tcp://127.0.0.1:7000", tensor_parallel_rank=2),
         r"--tensor-parallel-rank 2 is outside 1..1"),
        (dict(follower, tp_address="tcp://127.0.0.1:7000", tensor_parallel_rank=0),
         r"outside 1..1 \(--tensor-parallel-size 2; the leader is rank 0\)"),
        (dict(follower, tp_address="tcp://127.0.0.1:7000", tensor_parallel_rank=1,
              engine_address="tcp://127.0.0.1:9"), "no --coordinator"),
        (dict(follower, tp_address="tcp://127.0.0.1:7000", tensor_parallel_rank=1,
              data_parallel_rank=None), "and its engine rank's --data-parallel-rank"),
        (dict(tp_address="tcp://127.0.0.1:7000", tensor_parallel_size=2),
         "--tp-address is for role engine"),
        (dict(engine, tp_address="tcp://127.0.0.1:7000"), "needs --tensor-parallel-size above 1"),
        (dict(engine, tp_address="ipc:///tmp/x", tensor_parallel_size=2), "tcp://HOST:PORT"),
        (dict(engine, tp_address="tcp://127.0.0.1:65534", tensor_parallel_size=2),
         "PORT must be in 1..65533"),
        (dict(engine, tensor_parallel_size=2, tensor_parallel_rank=1),
         "--tensor-parallel-rank is for role tp-follower"),
        (dict(engine, data_parallel_size=2, expert_parallel_size=2), "needs --ep-inboxes"),
        (dict(engine, data_parallel_size=2, expert_parallel_size=2,
              ep_inboxes="tcp://127.0.0.1:7000", ep_init="tcp://127.0.0.1:7002"),
         r"names 1 address\(es\); give one per data-parallel rank \(2\)"),
        (dict(engine, data_parallel_size=2, expert_parallel_size=2,
              ep_inboxes=["tcp://127.0.0.1:7000"] * 2, ep_init="tcp://127.0.0.1:7002"),
         "every rank needs an address of its own"),
        (dict(engine, data_parallel_size=2, expert_parallel_size=2,
              ep_inboxes="tcp://127.0.0.1:7000,tcp://127.0.0.1:7001", ep_init="127.0.0.1:7002"),
         "--ep-init '127.0.0.1:7002'"),
        (dict(data_parallel_size=2, expert_parallel_size=2, ep_init="tcp://127.0.0.1:7002"),
         "--ep-inboxes and --ep-init are for role engine"),
        (dict(engine, ep_init="tcp://127.0.0.1:7002"), "with --expert-parallel-size above 1"),
    ]  # fmt: skip
    for kwargs, match in cases:
        with pytest.raises(LaunchError, match=match):
            Runtime(tiny, **kwargs)
    # Binding beyond loopback needs keys: a leader's plans, an engine's consensus inbox.
    with pytest.raises(AddressError, match="taipan keys"):
        Runtime(tiny, **engine, tensor_parallel_size=2, tp_address="tcp://0.0.0.0:7000")
    inboxes = "tcp://0.0.0.0:7000,tcp://127.0.0.1:7001"
    ep = dict(engine, data_parallel_size=2, expert_parallel_size=2, ep_inboxes=inboxes)
    with pytest.raises(AddressError, match="taipan keys"):
        Runtime(tiny, **ep, ep_init="tcp://127.0.0.1:7002")
    rt = Runtime(tiny, **ep, ep_init="tcp://127.0.0.1:7002", keys_dir=keys)
    rt.shutdown()  # (nothing started: its temp dir goes)
    assert tp_addresses("tcp://[::1]:7000") == {
        "plans": "tcp://[::1]:7000",
        "reports": "tcp://[::1]:7001",
        "init": "tcp://[::1]:7002",
    }


def test_the_cli_names_what_a_follower_lacks(tiny):
    cmd = [sys.executable, "-m", "taipan.cli", "serve", "--model", tiny, "--role", "tp-follower"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "--tp-address" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.gpu
def test_gpu_remote_follower_over_nccl_equals_tp1(tmp_path):
    """A leader on cuda:0 and a `--role tp-follower` on cuda:1 (each its device as named, NCCL
    meeting at the leader's TCPStore, the custom all-reduce between them): greedy tokens equal
    T = 1's on one GPU. head_dim 64: the CUDA attention kernels take 64 or 128."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    tiny = make_random_llama(str(tmp_path / "tiny"), GPU_TINY_SHAPE)
    want = _greedy(Runtime(tiny, InferenceConfig(**CONFIG), device="cuda"))
    port, tp_port = free_ports(2), free_ports(3)
    address = f"tcp://127.0.0.1:{port}"
    coord = _serve(tiny, "--role", "coordinator", "--address", address)
    rank = ["--tensor-parallel-size", "2", "--data-parallel-rank", "0"]
    tp = ["--tp-address", f"tcp://127.0.0.1:{tp_port}"]
    leader = _serve(
        tiny, "--role", "engine", "--coordinator", f"tcp://127.0.0.1:{port + 1}",
        "--device", "cuda:0", *tp, *rank,
    )  # fmt: skip
    follower = _serve(
        tiny, "--role", "tp-follower", "--device", "cuda:1", "--tensor-parallel-rank", "1",
        *tp, *rank,
    )  # fmt: skip
    try:
        with Client(address, connect_timeout=300) as c:
            assert [d.token_ids for d in c.generate(PROMPTS, GREEDY)] == want
        coord.send_signal(signal.SIGINT)
        assert coord.wait(60) == 0
        assert (leader.wait(60), follower.wait(30)) == (0, 0)
    finally:
        _stop(coord, leader, follower)
