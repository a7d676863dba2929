"""Weights from a trainer on the same host by CUDA IPC handles (issue 26 item 1,
`update_weights_from_ipc`), through real processes.

CPU: the records (messages/lifecycle.py IpcTensor) round-trip the codec and a GpuControl of an
older sender still decodes; a record that describes no tensor of its storage, or a CPU tensor, is
refused before any handle is touched; the gpu worker checks names and shapes before it opens a
handle; a running taipan on the CPU refuses the update (naming update_weights_from_ipc) and
serves on, refuses it while RUNNING, and refuses malformed records; over HTTP, 403 without an
API key and 400 on a malformed record.

GPU (`-m gpu`): the trainer is this test process, a Hugging Face copy of a tiny random Llama on
cuda:0, taipan on cuda:0 too (and at tensor_parallel_size=2 on cuda:0-1, the follower opening
the trainer's memory on cuda:0): after each push (noise on every weight between them, the last
one staged) greedy tokens equal Hugging Face's with the trainer's weights and the ack carries the
trainer's version; a push with a bad name changes nothing.
"""

from __future__ import annotations

import base64
import dataclasses

import httpx
import msgpack
import numpy as np
import pytest
import torch

from taipan import LLM, rl
from taipan.actors.config import InferenceConfig
from taipan.actors.gpu.worker import ModelWorker
from taipan.client import AsyncClient, Client, ControlError
from taipan.launcher import Runtime
from taipan.messages.codec import decode, encode
from taipan.messages.gpu import GpuCommand, GpuControl, LoadModel
from taipan.messages.lifecycle import IpcTensor, UpdateWeightsFromIpc
from taipan.messages.requests import SamplingParams
from taipan.ops.weight_transfer import WeightTransferError, ipc_handles, open_ipc_tensor
from taipan.ops.weight_updates import WeightUpdateError
from tests.random_llama import TINY_SHAPE, make_random_llama
from tests.test_rl import _hf_greedy, _train_step

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[72, 101, 108, 108, 111], [3, 17, 40, 90, 120, 9, 33], [5, 71, 200, 14]]
CONFIG = dict(block_size_tokens=16, max_tokens=64, max_requests=4, buffer_size_gb=0.1,
              max_sequence_length=256)  # fmt: skip
KEY = "ipc-test-key"


def record(name: str, shape=(64,), dtype="float32", **changes) -> IpcTensor:
    """A well-formed record of a contiguous tensor (the handles are not real ones)."""
    stride = [int(np.prod(shape[i + 1 :])) for i in range(len(shape))]
    nbytes = int(np.prod(shape)) * 4
    fields = dict(
        name=name, dtype=dtype, shape=list(shape), stride=stride, storage_offset=0, device=0,
        device_uuid="GPU-00000000-0000-0000-0000-000000000000", handle=bytes(range(64)),
        storage_size_bytes=nbytes, storage_offset_bytes=512, ref_counter_handle=b"/torch_1_2",
        ref_counter_offset=3, event_handle=bytes(64), event_sync_required=True,
    )  # fmt: skip
    return IpcTensor(**(fields | changes))


def as_json(r: IpcTensor) -> dict:
    """A record as an HTTP client sends it (bytes as base64)."""
    out = dataclasses.asdict(r)
    for k in ("handle", "ref_counter_handle", "event_handle"):
        out[k] = None if out[k] is None else base64.b64encode(out[k]).decode()
    return out


# ---- the records -------------------------------------------------------------------------------


def test_records_roundtrip_the_codec_and_old_gpu_controls_still_decode():
    records = [record("model.norm.weight"), record("lm_head.weight", event_handle=None)]
    msg = UpdateWeightsFromIpc("token", records, 7, True)
    back = decode(encode(msg))
    assert back.tensors[1].event_handle is None and back.weight_version == 7 and back.stage
    assert [dataclasses.astuple(t) for t in back.tensors] == [
        dataclasses.astuple(dataclasses.replace(t, shape=tuple(t.shape), stride=tuple(t.stride)))
        for t in records
    ]
    control = GpuControl(GpuCommand.STAGE_WEIGHTS, None, None, None, weight_version=7, ipc=records)
    assert decode(encode(control)).ipc == back.tensors
    old = GpuControl(GpuCommand.UPDATE_WEIGHTS, None, "/ckpt", None)  # (as logged before ipc)
    head = msgpack.unpackb(encode(old)[0])
    assert decode([msgpack.packb(head[: 2 + 4])]).ipc is None


def test_a_record_past_its_storage_or_a_cpu_tensor_is_refused_before_any_handle():
    with pytest.raises(WeightTransferError, match="past its storage"):
        open_ipc_tensor(record("w", storage_size_bytes=100))
    with pytest.raises(WeightTransferError, match="differ in rank"):
        open_ipc_tensor(record("w", stride=[1, 1]))
    with pytest.raises(WeightTransferError, match="cannot travel"):
        open_ipc_tensor(record("w", dtype="int8"))
    with pytest.raises(WeightTransferError, match="CUDA tensors only; w is on cpu"):
        ipc_handles([("w", torch.zeros(4))])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_random_llama(str(tmp_path_factory.mktemp("random-llama")), TINY_SHAPE)


def test_the_worker_checks_names_and_shapes_before_opening_a_handle(model_dir):
    worker = ModelWorker()
    worker.load(LoadModel(model_dir, "float32", "cpu", 16, 8, 1.0, 256, 8, 128))
    control = GpuControl(GpuCommand.UPDATE_WEIGHTS, None, None, None, ipc=[record("x")])
    reply = worker.control(control)
    assert "update_weights_from_ipc needs taipan on a CUDA device" in reply.error
    assert reply.weight_version == 0 and not reply.weights_incomplete
    with pytest.raises(WeightUpdateError, match="unknown parameter 'model.layers.9"):
        worker._ipc_updates([record("model.layers.9.mlp.up_proj.weight")])
    with pytest.raises(WeightUpdateError, match=r"model.norm.weight: shape .*5.*expected \(64,\)"):
        worker._ipc_updates([record("model.norm.weight", shape=(5,))])
    with pytest.raises(WeightTransferError, match="needs CUDA"):  # names fit: now it opens
        worker._ipc_updates([record("model.norm.weight")])


# ---- a running taipan on the CPU ---------------------------------------------------------------


@pytest.fixture(scope="module")
def cpu_runtime(model_dir):
    with Runtime(model_dir, InferenceConfig(**CONFIG)) as rt, Client(rt.address) as c:
        yield rt, c


def test_a_cpu_runtime_refuses_it_by_name_and_serves_on(cpu_runtime):
    _, c = cpu_runtime
    before = [x.token_ids for x in c.generate(PROMPTS, GREEDY)]
    with pytest.raises(ControlError, match="RUNNING") as err:
        c.update_weights_from_ipc([record("model.norm.weight")], weight_version=5)
    assert err.value.code == "illegal_transition"
    c.pause()
    for stage in (False, True):
        with pytest.raises(ControlError, match="update_weights_from_ipc needs taipan on a CUDA"):
            c.update_weights_from_ipc([record("model.norm.weight")], weight_version=5, stage=stage)
    assert str(c.stats().state) == "PAUSED" and c.stats().merged().weight_version == 0
    with pytest.raises(ControlError, match="names a tensor twice") as err:
        c.update_weights_from_ipc([record("model.norm.weight")] * 2)
    assert err.value.code == "bad_request"
    with pytest.raises(ControlError, match="at least one tensor"):
        c.update_weights_from_ipc([])
    with pytest.raises(ValueError, match="IpcTensor.name: expected str"):
        c.update_weights_from_ipc([dataclasses.replace(record("w"), name=3)])
    with pytest.raises(ValueError, match="IPC record 0"):
        c.update_weights_from_ipc([{"name": "w"}])
    c.unpause()
    assert [x.token_ids for x in c.generate(PROMPTS, GREEDY)] == before


@pytest.mark.asyncio
async def test_over_http_403_without_a_key_and_400_on_a_malformed_record(cpu_runtime):
    from taipan.server.app import build_app

    rt, c = cpu_runtime
    good = {"tensors": [as_json(record("model.norm.weight"))]}
    async with AsyncClient(rt.address) as client:
        for app, headers in ((build_app(client), {}), (build_app(client, api_key=KEY), None)):
            auth = headers if headers is not None else {"authorization": f"Bearer {KEY}"}
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as h:
                r = await h.post("/update_weights_from_ipc", json=good, headers=auth)
                if headers is not None:  # no --api-key: every control refused
                    assert r.status_code == 403 and "--api-key" in r.json()["error"]["message"]
                    continue
                assert r.status_code == 409  # (RUNNING)
                broken = as_json(record("w")) | {"handle": "not base64!"}
                for body in (
                    {"tensors": [broken]},
                    {"tensors": [{"name": "w"}]},
                    {"tensors": [as_json(record("w")) | {"shape": "64"}]},
                    {"tensors": 3},
                    {"records": []},
                ):
                    r = await h.post("/update_weights_from_ipc", json=body, headers=auth)
                    assert r.status_code == 400, (body, r.text)
                await client.pause()
                r = await h.post("/update_weights_from_ipc", json=good, headers=auth)
                assert r.status_code == 500 and "CUDA device" in r.json()["error"]["message"]
                await client.unpause()
    assert str(c.stats().state) == "RUNNING"


# ---- GPU: a trainer on the same GPU ------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [1, 2])
def test_a_trainer_on_the_same_gpu_pushes_by_ipc(tmp_path, tp):
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    from tests.random_llama import GPU_TINY_SHAPE

    path = make_random_llama(str(tmp_path / "tiny"), GPU_TINY_SHAPE)
    trainer = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    trainer = trainer.to("cuda:0").eval()
    trainer.generation_config.eos_token_id = None
    with LLM(path, device="cuda:0", tensor_parallel_size=tp, **CONFIG) as llm:
        with pytest.raises(ControlError, match="RUNNING"):
            rl.push_weights_ipc(llm, trainer)
        for step in range(1, 4):
            _train_step(trainer, step)
            llm.pause()
            timings: dict = {}
            ack = rl.push_weights_ipc(
                llm, trainer, weight_version=100 + step, stage=step == 3, timings=timings
            )
            assert ack.weight_version == 100 + step and str(ack.state) == "PAUSED"
            assert 0 < timings["shared"] <= timings["acked"]
            llm.unpause()
            assert llm.stats().merged().weight_version == 100 + step
            got = [c.token_ids for c in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
            want = [_hf_greedy(trainer, p, GREEDY.max_tokens) for p in PROMPTS]
            assert got == want, step
        # A bad name (after good ones) is refused before anything is copied, on every process.
        _train_step(trainer, 9)  # (what would be copied if the check came late)
        named = rl.named_tensors(trainer)
        bad = named + [("model.layers.9.mlp.up_proj.weight", torch.zeros(3, device="cuda:0"))]
        llm.pause()
        with pytest.raises(ControlError, match="model.layers.9"):
            llm.update_weights_from_ipc(rl.ipc_handles(bad), weight_version=200)
        llm.unpause()
        assert llm.stats().merged().weight_version == 103
        assert [c.token_ids for c in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == got
