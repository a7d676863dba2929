"""The gpu worker's side of a weight transfer from a trainer (actors/gpu/controls.py with
ops/weight_transfer.py), the worker alone on the CPU with a real gloo group: the trainer is a
thread of this process (or a child process that dies part way).

Checks: init / update / close through GpuControl; every weight of a Hugging Face model arrives
and our logits then equal HF's; the trainer's version becomes the worker's; a staged update
changes nothing until committed; bad names are refused with the weights untouched while the
trainer's broadcasts still complete; an update without a group, or a second init, is refused;
a trainer that dies part way leaves the weights marked incomplete (steps refused) until a
complete update lands.
"""

from __future__ import annotations

import multiprocessing as mp
import threading

import pytest
import torch

from taipan.messages.gpu import GpuCommand, GpuControl
from taipan.messages.lifecycle import WeightSpec, WeightTransferGroup
from taipan.rl import init_weight_transfer_group, named_tensors, send_weights, weight_buckets
from tests import test_gpu_worker_control as _control
from tests.ports import free_port
from tests.test_gpu_worker_control import (
    PROMPT,
    assert_matches_hf,
    assert_same_weights,
    our_logits,
    weights,
)

transformers = pytest.importorskip("transformers")
# The worker on a tiny random Llama and its Hugging Face copy: test_gpu_worker_control's fixtures.
model_dir, worker, hf_model = _control.model_dir, _control.worker, _control.hf_model


def _wire(buckets) -> list[list[WeightSpec]]:
    return [[WeightSpec(s.name, s.dtype, list(s.shape)) for s in b] for b in buckets]


def _control(worker, command, **fields):
    return worker.control(GpuControl(command, None, None, None, **fields))


class Trainer:
    """The trainer's rank 0 of a two-process group, on a thread (its joins and sends block)."""

    def __init__(self, worker):
        self.port = free_port()
        spec = WeightTransferGroup("127.0.0.1", self.port, 2, 1, "gloo")
        joined: dict = {}
        thread = threading.Thread(
            target=lambda: joined.update(g=init_weight_transfer_group("127.0.0.1", self.port, 2))
        )
        thread.start()
        reply = _control(worker, GpuCommand.INIT_WEIGHT_TRANSFER, transfer=spec)
        thread.join(30)
        assert reply.error is None, reply.error
        self.group = joined["g"]

    def update(self, worker, named, command=GpuCommand.UPDATE_WEIGHTS, version=None, size=4096):
        buckets = weight_buckets(named, size)
        sender = threading.Thread(target=send_weights, args=(named, self.group, buckets))
        sender.start()
        reply = _control(worker, command, buckets=_wire(buckets), weight_version=version)
        sender.join(30)
        assert not sender.is_alive()
        return reply


def _perturbed(hf_model, seed: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in hf_model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return named_tensors(hf_model)


def test_a_whole_model_from_the_trainer_matches_hf(worker, hf_model):
    trainer = Trainer(worker)
    before = our_logits(worker, PROMPT)
    reply = trainer.update(worker, _perturbed(hf_model, 1), version=7)
    assert reply.error is None and reply.weight_version == 7 and not reply.weights_incomplete
    assert not torch.allclose(our_logits(worker, PROMPT), before, atol=1e-3)
    assert_matches_hf(worker, hf_model)
    again = _control(worker, GpuCommand.INIT_WEIGHT_TRANSFER, transfer=None)
    assert "needs its group" in again.error
    assert _control(worker, GpuCommand.CLOSE_WEIGHT_TRANSFER).error is None
    assert (
        "not in a weight-transfer group" in _control(worker, GpuCommand.CLOSE_WEIGHT_TRANSFER).error
    )
    no_group = _control(worker, GpuCommand.UPDATE_WEIGHTS, buckets=[])
    assert "init_weight_transfer first" in no_group.error


def test_a_staged_transfer_changes_nothing_until_committed(worker, hf_model):
    trainer = Trainer(worker)
    before = weights(worker)
    named = _perturbed(hf_model, 2)
    reply = trainer.update(worker, named, GpuCommand.STAGE_WEIGHTS, version=3)
    assert reply.error is None and reply.weight_version == 0
    assert_same_weights(worker, before)
    reply = _control(worker, GpuCommand.COMMIT_WEIGHTS)
    assert reply.error is None and reply.weight_version == 3
    assert_matches_hf(worker, hf_model)


def test_bad_names_are_refused_and_the_trainer_still_finishes(worker, hf_model):
    trainer = Trainer(worker)
    before = weights(worker)
    named = _perturbed(hf_model, 3) + [("model.layers.9.mlp.up_proj.weight", torch.zeros(3))]
    reply = trainer.update(worker, named, size=1 << 20)
    assert "model.layers.9" in reply.error and not reply.weights_incomplete
    assert_same_weights(worker, before)
    shape = [("model.norm.weight", torch.zeros(5))]
    reply = trainer.update(worker, shape)
    assert "model.norm.weight" in reply.error
    reply = trainer.update(worker, _perturbed(hf_model, 4))  # the group still works
    assert reply.error is None and reply.weight_version == 1
    assert_matches_hf(worker, hf_model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_large_tensors_travel_alone_into_their_parameters(worker, hf_model, monkeypatch, dtype):
    """Tensors of DIRECT_MIN_BYTES and more travel one broadcast each: straight into the
    parameter where its rows are a contiguous view of its dtype (float32 here), else into a
    buffer and copied (float64: converted)."""
    from taipan.ops import weight_transfer

    monkeypatch.setattr(weight_transfer, "DIRECT_MIN_BYTES", 4096)
    trainer = Trainer(worker)
    named = [(n, t.to(dtype)) for n, t in _perturbed(hf_model, 6)]
    layout = weight_transfer.BucketLayout(weight_buckets(named, 1 << 20)[0])
    assert layout.direct and layout.packed  # both kinds in one bucket
    direct = {s.name for s in layout.direct}
    assert "model.layers.0.self_attn.q_proj.weight" in direct  # a fused part, whole at TP = 1
    reply = trainer.update(worker, named, version=2, size=1 << 20)
    assert reply.error is None and reply.weight_version == 2
    assert_matches_hf(worker, hf_model)


def _dying_trainer(port: int, named, buckets) -> None:
    group = init_weight_transfer_group("127.0.0.1", port, 2)
    group.send(buckets[0], dict(named))
    # exits here: the receiver waits for the next bucket from a peer that is gone


def test_a_trainer_that_dies_part_way_leaves_the_weights_marked(worker, hf_model):
    port = free_port()
    named = [(n, t.detach().clone()) for n, t in _perturbed(hf_model, 5)]
    buckets = weight_buckets(named, 4096)
    assert len(buckets) > 2
    child = mp.get_context("spawn").Process(target=_dying_trainer, args=(port, named, buckets))
    child.start()
    spec = WeightTransferGroup("127.0.0.1", port, 2, 1, "gloo")
    assert _control(worker, GpuCommand.INIT_WEIGHT_TRANSFER, transfer=spec).error is None
    reply = _control(worker, GpuCommand.UPDATE_WEIGHTS, buckets=_wire(buckets))
    child.join(30)
    assert reply.error is not None and reply.weights_incomplete, reply
    assert "incomplete" in worker.step_refusal()
    _control(worker, GpuCommand.CLOSE_WEIGHT_TRANSFER)
    # A complete update (here from a state dict) clears it.
    state = {n: t.numpy() for n, t in named}
    reply = worker.control(GpuControl(GpuCommand.UPDATE_WEIGHTS, None, None, state))
    assert reply.error is None and not reply.weights_incomplete
    assert worker.step_refusal() is None
    assert_matches_hf(worker, hf_model)
