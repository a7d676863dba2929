"""Weights from a trainer's process into a running taipan (issue 26 item 1) through real
processes: CPU, gloo, fp32, a tiny random Llama served at tensor_parallel_size=2 (so a broadcast
reaches the engine's gpu actor and its tp follower, ranks 1 and 2 of the group).

The trainer is this test process: a Hugging Face copy of the model, changed by a few "optimizer
steps" (noise on every weight). After each `taipan.rl.push_weights` (in place, and staged) the
runtime's greedy tokens equal Hugging Face's with the trainer's current weights, the ack and the
stats carry the trainer's version, and the runtime refuses to take weights while RUNNING (before
any broadcast, so the trainer never waits on it).
"""

from __future__ import annotations

import pytest
import torch

from taipan import LLM, rl
from taipan.messages.requests import SamplingParams
from tests.ports import free_port
from tests.random_llama import TINY_SHAPE, make_random_llama

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[72, 101, 108, 108, 111], [3, 17, 40, 90, 120, 9, 33], [5, 71, 200, 14]]
CONFIG = dict(block_size_tokens=16, max_tokens=64, max_requests=4, buffer_size_gb=0.1,
              max_sequence_length=256)  # fmt: skip


def _hf_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids], device=model.device), max_new_tokens=n, min_new_tokens=n,
            do_sample=False, pad_token_id=0,
            attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=model.device),
        )  # fmt: skip
    return out[0, len(ids) :].tolist()


def _train_step(model, seed: int) -> None:
    """Noise on every weight, in place on the device each lives on (a stand-in optimizer step)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_((torch.randn(p.shape, generator=gen) * 0.05).to(p.device))


def test_a_trainer_pushes_its_weights_three_times(tmp_path):
    path = make_random_llama(str(tmp_path / "tiny"), TINY_SHAPE)
    trainer = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    trainer.generation_config.eos_token_id = None
    with LLM(path, tensor_parallel_size=2, **CONFIG) as llm:
        assert llm.weight_transfer_world_size() == 3
        group = rl.join(llm, "127.0.0.1", free_port())
        with pytest.raises(RuntimeError, match="RUNNING"):
            rl.push_weights(llm, trainer, group)
        for step in range(1, 4):
            _train_step(trainer, step)
            llm.pause()
            ack = rl.push_weights(
                llm, trainer, group, weight_version=100 + step, bucket_bytes=8192,
                stage=step == 3,
            )  # fmt: skip
            assert ack.weight_version == 100 + step and str(ack.state) == "PAUSED"
            llm.unpause()
            assert llm.stats().merged().weight_version == 100 + step
            got = [c.token_ids for c in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
            want = [_hf_greedy(trainer, p, GREEDY.max_tokens) for p in PROMPTS]
            assert got == want, step
        assert str(llm.close_weight_transfer().state) == "RUNNING"
        group.close()


@pytest.mark.gpu
def test_nccl_push_from_one_gpu_into_taipan_on_another(tmp_path):
    """The same over NCCL: the trainer on cuda:0, taipan on cuda:1 (fp32, CUDA graphs on)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    from tests.random_llama import GPU_TINY_SHAPE

    path = make_random_llama(str(tmp_path / "tiny"), GPU_TINY_SHAPE)
    trainer = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    trainer = trainer.to("cuda:0").eval()
    trainer.generation_config.eos_token_id = None
    with LLM(path, device="cuda:1", **CONFIG) as llm:
        group = rl.join(llm, "127.0.0.1", free_port(), device="cuda:0")
        for step in range(1, 3):
            _train_step(trainer.cpu(), step)
            trainer.to("cuda:0")
            llm.pause()
            ack = rl.push_weights(llm, trainer, group, weight_version=step, bucket_bytes=1 << 16)
            assert ack.weight_version == step
            llm.unpause()
            got = [c.token_ids for c in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
            want = [_hf_greedy(trainer, p, GREEDY.max_tokens) for p in PROMPTS]
            assert got == want, step
        llm.close_weight_transfer()
        group.close()


def _dying_trainer(port: int, world: int, named, buckets) -> None:
    group = rl.init_weight_transfer_group("127.0.0.1", port, world)
    group.send(buckets[0], dict(named))  # then exits: the rest never comes


def test_a_transfer_cut_off_part_way_is_never_served(tmp_path):
    """The trainer dies after its first bucket: the update fails, steps and unpause are refused
    naming why, and a complete update (here a state dict) makes the runtime serve again."""
    import multiprocessing as mp

    from taipan.client import ControlError

    path = make_random_llama(str(tmp_path / "tiny"), TINY_SHAPE)
    trainer = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    trainer.generation_config.eos_token_id = None
    _train_step(trainer, 9)
    named = rl.named_tensors(trainer)
    buckets = rl.weight_buckets(named, 8192)
    with LLM(path, **CONFIG) as llm:
        port, world = free_port(), llm.weight_transfer_world_size()
        child = mp.get_context("spawn").Process(
            target=_dying_trainer, args=(port, world, [(n, t.detach()) for n, t in named], buckets)
        )
        child.start()
        llm.init_weight_transfer("127.0.0.1", port, world)
        llm.pause()
        with pytest.raises(ControlError, match="incomplete"):
            llm.update_weights_from_distributed(buckets, weight_version=5)
        child.join(30)
        with pytest.raises(ControlError, match="incomplete"):
            llm.unpause()
        llm.close_weight_transfer()
        state = {n: t.detach().numpy() for n, t in named}
        assert llm.update_weights(state=state, weight_version=6).weight_version == 6
        llm.unpause()
        got = [c.token_ids for c in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        assert got == [_hf_greedy(trainer, p, GREEDY.max_tokens) for p in PROMPTS]


def test_an_in_flight_update_lands_between_steps_of_running_requests(tmp_path):
    """`in_flight=True`: no pause. Requests generating when the weights arrive go on, their
    tokens after the switch carrying the new version; the runtime stays RUNNING, and a new
    request's greedy tokens are the trainer's. Without `in_flight`, RUNNING still refuses, with
    the way out in the error."""
    import threading
    import time

    from taipan.client import ControlError

    path = make_random_llama(str(tmp_path / "tiny"), TINY_SHAPE)
    trainer = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    trainer.generation_config.eos_token_id = None
    long = SamplingParams(max_tokens=1500, temperature=0.0, ignore_eos=True)
    with LLM(path, **(CONFIG | {"max_sequence_length": 1536})) as llm:
        group = rl.join(llm, "127.0.0.1", free_port())
        _train_step(trainer, 3)
        with pytest.raises(ControlError, match="in_flight=True"):
            llm.update_weights(state={"lm_head.weight": trainer.lm_head.weight.detach().numpy()})
        done: list = []
        running = threading.Thread(
            target=lambda: done.extend(llm.generate(PROMPTS, long, use_tqdm=False))
        )
        running.start()
        while llm.stats().ranks[0].step < 20:  # (they are generating: push mid-way)
            time.sleep(0.01)
        ack = rl.push_weights(llm, trainer, group, weight_version=7, in_flight=True)
        assert ack.weight_version == 7 and str(ack.state) == "RUNNING"
        running.join(120)
        assert len(done) == len(PROMPTS) and all(len(c.token_ids) == 1500 for c in done)
        spans = [c.weight_versions for c in done]
        assert all(s[0] == (0, 0) for s in spans), spans
        switched = [s for s in spans if len(s) == 2]
        assert switched and all(s[1][0] == 7 and 0 < s[1][1] < 1500 for s in switched), spans
        assert str(llm.stats().merged().state) == "RUNNING"
        got = [c.token_ids for c in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        assert got == [_hf_greedy(trainer, p, GREEDY.max_tokens) for p in PROMPTS]
        llm.close_weight_transfer()
        group.close()
