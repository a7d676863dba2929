"""Weights from a trainer's process (ops/weight_transfer.py, runtime/rl.py), the ops layer alone on
the CPU: bucket layouts (offsets, alignment, every dtype, refusals), bucket plans, and a real
gloo group of three processes (a trainer and two receivers) in which the receivers map every
broadcast tensor of a Hugging Face Llama onto a loaded model of ours (`state_updates`) and end
with exactly the trainer's weights, then leave through `close`.
"""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from taipan.ops.weight_transfer import (
    ALIGN,
    BucketLayout,
    TensorSpec,
    WeightGroup,
    WeightTransferError,
    nccl_high_priority,
    plan_buckets,
)
from taipan.rl import named_tensors, send_weights, weight_buckets
from tests.ports import free_port
from tests.random_llama import TINY_SHAPE, make_random_llama

transformers = pytest.importorskip("transformers")


def test_layout_round_trip_every_dtype_aligned():
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "a": torch.randn(3, 5, generator=gen).to(torch.bfloat16),
        "b": torch.randn(7, generator=gen).to(torch.float16),
        "c": torch.randn(2, 3, 4, generator=gen),
        "d": torch.randn(1, generator=gen).to(torch.float64),
        "e": torch.empty(0, 4),
    }
    specs = [TensorSpec.of(n, t) for n, t in tensors.items()]
    layout = BucketLayout(specs)
    assert all(o % ALIGN == 0 for o in layout.offsets) and layout.nbytes % ALIGN == 0
    flat = layout.pack(tensors, "cpu")
    back = layout.unpack(flat.clone())
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name


def test_large_tensors_leave_the_packed_buffer(monkeypatch):
    from taipan.ops import weight_transfer

    monkeypatch.setattr(weight_transfer, "DIRECT_MIN_BYTES", 1024)
    specs = [TensorSpec("big", "float32", (16, 16)), TensorSpec("small", "float16", (8,)),
             TensorSpec("big2", "bfloat16", (1024,))]  # fmt: skip
    layout = BucketLayout(specs)
    assert [s.name for s in layout.packed] == ["small"] and layout.nbytes == ALIGN
    assert [s.name for s in layout.direct] == ["big", "big2"]


def test_layout_refusals():
    with pytest.raises(WeightTransferError, match="int64"):
        TensorSpec("x", "int64", (2,))
    with pytest.raises(WeightTransferError, match="twice"):
        BucketLayout([TensorSpec("x", "float32", (2,))] * 2)
    with pytest.raises(WeightTransferError, match="empty bucket"):
        BucketLayout([])
    layout = BucketLayout([TensorSpec("x", "float32", (2, 2))])
    with pytest.raises(WeightTransferError, match="does not match its spec"):
        layout.pack({"x": torch.zeros(4)}, "cpu")
    with pytest.raises(WeightTransferError, match="expected 256"):
        layout.unpack(torch.zeros(16, dtype=torch.uint8))


def test_buckets_keep_order_and_size():
    named = [(f"w{i}", torch.zeros(100)) for i in range(5)]  # 400 bytes -> 512 padded each
    buckets = plan_buckets(named, bucket_bytes=1100)
    assert [[s.name for s in b] for b in buckets] == [["w0", "w1"], ["w2", "w3"], ["w4"]]
    big = plan_buckets([("big", torch.zeros(1000)), ("s", torch.zeros(1))], bucket_bytes=100)
    assert [[s.name for s in b] for b in big] == [["big"], ["s"]]  # too big: alone
    with pytest.raises(WeightTransferError):
        plan_buckets(named, bucket_bytes=0)


def test_named_tensors_of_a_tied_module_once():
    hf = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**_hf_shape(), tie_word_embeddings=True)
    )
    names = [n for n, _ in named_tensors(hf)]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert len(names) == len(set(names))


def _hf_shape() -> dict:
    shape = dict(TINY_SHAPE)
    shape["vocab_size"] = 300
    return shape


def _receiver(model_dir: str, port: int, rank: int, buckets, out) -> None:
    from taipan.ops.loader import load_model
    from taipan.ops.weight_updates import state_updates

    try:
        model, _, _ = load_model(model_dir, dtype=torch.float32, device="cpu")
        group = WeightGroup("127.0.0.1", port, 3, rank, "gloo", "cpu", timeout_s=30)
        params = model.state_dict()
        with torch.no_grad():
            for specs in buckets:
                for name, rows, values in state_updates(group.receive(specs), model):
                    params[name][rows].copy_(values)
        group.close()
        out.put((rank, {n: t.numpy().copy() for n, t in model.state_dict().items()}))
    except Exception as e:  # the parent reports it
        out.put((rank, repr(e)))


def test_a_gloo_group_carries_a_whole_model_to_two_receivers(tmp_path):
    """The trainer perturbs every weight, broadcasts them in small buckets; each receiver's
    model then equals one loaded from the trainer's weights saved to disk."""
    from taipan.ops.loader import load_model

    model_dir = make_random_llama(str(tmp_path / "start"), TINY_SHAPE)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(tmp_path / "after")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "after" / name).write_bytes((tmp_path / "start" / name).read_bytes())
    expected, _, _ = load_model(str(tmp_path / "after"), dtype=torch.float32, device="cpu")

    buckets = weight_buckets(hf, bucket_bytes=20_000)
    assert len(buckets) > 3
    port = free_port()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_receiver, args=(model_dir, port, r, buckets, out)) for r in (1, 2)]
    for p in procs:
        p.start()
    try:
        group = WeightGroup("127.0.0.1", port, 3, 0, "gloo", "cpu", timeout_s=30)
        send_weights(hf, group, buckets)
        results = dict(out.get(timeout=60) for _ in procs)
        group.close()
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for rank in (1, 2):
        got = results[rank]
        assert not isinstance(got, str), got
        for name, t in expected.state_dict().items():
            assert torch.equal(torch.from_numpy(got[name]), t), (rank, name)


def test_joining_a_group_nobody_hosts_fails_within_its_timeout():
    port = free_port()
    with pytest.raises(WeightTransferError, match="could not join"):
        WeightGroup("127.0.0.1", port, 2, 1, "gloo", "cpu", timeout_s=1)


def test_bad_group_arguments():
    with pytest.raises(WeightTransferError, match="backend"):
        WeightGroup("127.0.0.1", 1, 2, 0, "mpi", "cpu")
    with pytest.raises(WeightTransferError, match="outside"):
        WeightGroup("127.0.0.1", 1, 2, 2, "gloo", "cpu")
    with pytest.raises(WeightTransferError, match="CUDA"):
        WeightGroup("127.0.0.1", 1, 2, 0, "nccl", "cpu")


def test_nccl_stream_priority_is_high_unless_the_variable_says_normal(monkeypatch):
    monkeypatch.delenv("TAIPAN_WEIGHT_STREAM_PRIORITY", raising=False)
    assert nccl_high_priority() is True
    monkeypatch.setenv("TAIPAN_WEIGHT_STREAM_PRIORITY", "normal")
    assert nccl_high_priority() is False
    monkeypatch.setenv("TAIPAN_WEIGHT_STREAM_PRIORITY", "low")
    with pytest.raises(WeightTransferError, match="'high' or 'normal', got 'low'"):
        nccl_high_priority()
