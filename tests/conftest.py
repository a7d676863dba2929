"""Shared fixtures: the default model, one running runtime, and the Hugging Face oracle."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Without a GPU, Triton kernels run in its CPU interpreter; it reads this before triton loads.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
if "TAIPAN_RUNTIME_DIR" not in os.environ:  # control-token files of test runtimes stay private
    import tempfile

    os.environ["TAIPAN_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="taipan-test-runtime-")

import pytest  # noqa: E402

from taipan.actors.config import InferenceConfig  # noqa: E402
from taipan.children import use_fork_server  # noqa: E402

# The runtimes this process starts fork their processes from one that imported torch once
# (runtime/forked.py): the suite starts hundreds. `taipan serve` processes the tests start, and
# every run on a GPU machine, spawn as a user's runtime does.
if not os.path.exists("/dev/nvidiactl"):
    use_fork_server()

# A small engine so that tests exercise many blocks, several steps and chunking paths.
TEST_CONFIG = dict(
    block_size_tokens=16, max_tokens=256, max_requests=32, buffer_size_gb=1, max_sequence_length=512
)


# `make test` runs two pytest workers (pytest-xdist, `-n 2`) on the 2-core box. The tests that
# start runtimes and other processes keep both cores busy: they run one after another on one
# worker (the scope "processes"), as they would alone. These files run in-process on mostly one
# thread (the Triton interpreter, the pure cores, actors waiting on timeouts): the other worker
# takes them, file by file, into the core the first leaves idle (a serial run left 29 % of the
# box idle). Process tests on both workers at once ran 2-3x slower each (tests/perf/NOTES.md,
# seventeenth session). A file not named here is in "processes": a new file adds no overlap.
IN_PROCESS_FILES = frozenset(
    """test_ops_fused_decode test_grammar test_layout test_messages test_allocator_prefix
    test_allocator_window test_allocator_core test_engine_window test_scheduler
    test_scheduler_mamba test_scheduler_prefix test_routing test_speculative_verify
    test_speculative_engine test_ngram_drafter test_consensus test_stop_strings
    test_gguf_dequantize test_block_hash test_mamba_cache test_coordinator_fsm
    test_coordinator_core test_all_reduce_norm test_gemv_all_reduce test_random_models
    test_random_shapes test_curve test_coordinator_actor test_channel_peers test_engine_actor
    test_engine_link test_client_direct test_gpu_peers test_coordinator_relay
    test_coordinator_weights test_engine_ep test_forked""".split()
)


def xdist_scope(nodeid: str) -> str:
    """The xdist scope of a test: its file if that runs in-process, else "processes"."""
    stem = nodeid.split("::")[0].rsplit("/", 1)[-1].removesuffix(".py")
    in_process = stem in IN_PROCESS_FILES or stem.startswith("test_kernels_")
    return stem if in_process else "processes"


@pytest.hookimpl(optionalhook=True)  # (the GPU machines' image has no xdist)
def pytest_xdist_make_scheduler(config, log):
    """With `-n N` (and no other `--dist`): xdist's scope scheduling over `xdist_scope`. (Its
    own `--dist loadgroup` does not group under pytest 9: the group rides on a node id that
    pytest no longer reports.)"""
    if config.getoption("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Scopes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_scope(nodeid)

    return Scopes(config, log)


def pytest_collection_modifyitems(config, items):
    """GPU tests skip (with a reason) where CUDA is absent; CI never has a GPU."""
    gpu_items = [i for i in items if i.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU: run `pytest -m gpu` on the device")
        for item in gpu_items:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def model_path() -> str:
    from taipan.models import resolve

    return resolve("smollm2")[1]


@pytest.fixture(scope="session")
def runtime(model_path):
    """One real runtime (coordinator + engine processes) shared by the end-to-end tests."""
    from taipan.launcher import Runtime

    with Runtime(model_path, InferenceConfig(**TEST_CONFIG)) as rt:
        yield rt


@pytest.fixture(scope="session")
def client(runtime):
    from taipan.client import Client

    with Client(runtime.address) as c:
        yield c


@pytest.fixture(scope="session")
def hf(model_path):
    """(model, tokenizer) from transformers on the same GGUF, fp32: the oracle."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.hf_gguf import cached_gguf_reads

    d, f = os.path.split(model_path)
    with cached_gguf_reads():  # (the file parsed once: ~31 -> ~15 s on the 2-core box)
        tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    return model, tok
