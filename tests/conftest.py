"""Shared fixtures: the default model, one running runtime, and the Hugging Face oracle."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Without a GPU, Triton kernels run in its CPU interpreter; it reads this before triton loads.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # One torch thread per process (read before torch loads, and by every process a test
    # starts): `make test` runs two xdist workers on the 2-core box, each starting runtimes
    # whose processes compute at once; with two threads each they oversubscribed the cores and
    # ran 2-3x slower, with one the two workers share them (tests/perf/NOTES.md, 18th session).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
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
