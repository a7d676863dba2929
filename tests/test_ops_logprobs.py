"""Log-probs: ops.logprobs on random logits, and the gpu worker's StepResult log-prob arrays on
the real SmolLM2 GGUF (CPU, fp32) against Hugging Face's `log_softmax(logits.float(), -1)`.

Worker checks: the sampled token's log-prob and the top-n (greedy and seeded sampling, per-row
top_n with -1 / NaN padding), prompt log-probs of a prompt split over two steps (the target of
a chunk's last token is the next chunk's first), chunked logits, and the greedy fast path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

import taipan.actors.gpu.logprobs as logprobs_module
from taipan.actors.gpu.worker import ModelWorker
from taipan.messages.gpu import LoadModel, StepPlan
from taipan.ops.logprobs import log_probs_and_top_n, prompt_log_probs, token_log_probs

BLOCK_SIZE = 16
ATOL = 1e-4


# ---- ops.logprobs on random logits ------------------------------------------------------------


def test_log_probs_and_top_n_match_log_softmax():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=gen) * 3
    tokens = torch.tensor([0, 7, 49, 3])
    counts = torch.tensor([3, 0, 5, 1], dtype=torch.int32)
    picked, ids, values = log_probs_and_top_n(logits, tokens, counts, 5)
    ref = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(picked, ref.gather(1, tokens[:, None]).squeeze(1))
    top_values, top_ids = ref.topk(5, dim=-1)
    for row, count in enumerate(counts.tolist()):
        assert ids[row, :count].tolist() == top_ids[row, :count].tolist()
        torch.testing.assert_close(values[row, :count], top_values[row, :count])
        assert (ids[row, count:] == -1).all() and values[row, count:].isnan().all()


def test_token_log_probs_are_the_first_output_alone():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 40, generator=gen) * 4
    tokens = torch.tensor([39, 0, 5, 5, 17])
    picked, _, _ = log_probs_and_top_n(logits, tokens, torch.zeros(5, dtype=torch.int32), 0)
    torch.testing.assert_close(token_log_probs(logits, tokens), picked)
    assert token_log_probs(logits.half(), tokens).dtype == torch.float32


def test_pending_log_probs_fill_only_the_rows_asked():
    """The raw path computes every sequence's log-prob and reads the sampled rows that asked:
    the others stay NaN (a prompt chunk's row, a row without logprobs)."""
    plan_rows, keep = np.array([0, 2, 3]), np.array([True, False, True])
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(2))
    tokens = torch.tensor([1, 2, 3, 4])
    pending = logprobs_module.PendingLogProbs(
        torch.device("cpu"), logprobs_module.no_log_probs(4, 0)
    )
    logprobs_module._raw_log_probs(pending, plan_rows, keep, logits, tokens)
    got = pending.take()["log_probs"]
    want = torch.log_softmax(logits, -1).gather(1, tokens[:, None]).squeeze(1).numpy()
    assert np.isnan(got[[1, 2]]).all()
    np.testing.assert_allclose(got[[0, 3]], want[[0, 3]], rtol=1e-5, atol=1e-6)


def test_top_n_wider_than_the_vocabulary_pads():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    _, ids, values = log_probs_and_top_n(logits, torch.tensor([1]), torch.tensor([5]), 5)
    assert ids.tolist() == [[2, 1, 0, -1, -1]]
    assert values[0, 3:].isnan().all() and not values[0, :3].isnan().any()


@pytest.mark.parametrize("chunk_rows", [1, 3, 100])
def test_prompt_log_probs_chunks_agree(chunk_rows):
    gen = torch.Generator().manual_seed(1)
    head = torch.randn(30, 8, generator=gen)
    hidden = torch.randn(11, 8, generator=gen)
    targets = torch.randint(0, 30, (11,), generator=gen)
    counts = torch.randint(0, 4, (11,), generator=gen)
    built = []

    def compute_logits(h):
        built.append(h.shape[0])
        return h @ head.T

    got = prompt_log_probs(hidden, targets, counts, 4, compute_logits, chunk_rows)
    want = log_probs_and_top_n(hidden @ head.T, targets, counts, 4)
    assert max(built) <= chunk_rows and sum(built) == 11
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, equal_nan=True)


def test_prompt_log_probs_of_nothing_keeps_shapes():
    picked, ids, values = prompt_log_probs(
        torch.zeros(0, 8), torch.zeros(0), torch.zeros(0), 3, lambda h: h, 16
    )
    assert picked.shape == (0,) and ids.shape == values.shape == (0, 3)


# ---- the worker on the real model -------------------------------------------------------------


@dataclass
class Seq:
    """One sequence's part of a step: `ids` are this step's tokens, after `start` cached ones."""

    ids: list[int]
    start: int
    blocks: list[int]
    sample: bool = True
    logprobs: bool = False
    top_n: int = 0
    targets: list[int] = field(default_factory=list)  # prompt targets per token; [] = none
    temperature: float = 0.0
    seed: int = -1


def make_plan(step: int, seqs: list[Seq], block_size: int = BLOCK_SIZE) -> StepPlan:
    """A StepPlan as the engine would build it for `seqs`."""
    positions = [np.arange(s.start, s.start + len(s.ids)) for s in seqs]
    slots = [np.asarray(s.blocks)[p // block_size] * block_size + p % block_size
             for s, p in zip(seqs, positions, strict=True)]  # fmt: skip
    tables = np.zeros((len(seqs), max(len(s.blocks) for s in seqs)), dtype=np.int32)
    for i, s in enumerate(seqs):
        tables[i, : len(s.blocks)] = s.blocks
    targets = [s.targets or [-1] * len(s.ids) for s in seqs]
    return StepPlan(
        step=step,
        input_ids=np.concatenate([s.ids for s in seqs]).astype(np.int32),
        positions=np.concatenate(positions).astype(np.int32),
        slot_mapping=np.concatenate(slots).astype(np.int64),
        query_start_loc=np.cumsum([0] + [len(s.ids) for s in seqs]).astype(np.int32),
        seq_lens=np.asarray([s.start + len(s.ids) for s in seqs], dtype=np.int32),
        block_tables=tables,
        sample=np.asarray([s.sample for s in seqs], dtype=np.int8),
        temperature=np.asarray([s.temperature for s in seqs], dtype=np.float32),
        top_k=np.zeros(len(seqs), dtype=np.int32),
        top_p=np.ones(len(seqs), dtype=np.float32),
        min_p=np.zeros(len(seqs), dtype=np.float32),
        seeds=np.asarray([s.seed for s in seqs], dtype=np.int64),
        gen_index=np.zeros(len(seqs), dtype=np.int32),
        logprobs=np.asarray([s.logprobs for s in seqs], dtype=np.int8),
        top_n=np.asarray([s.top_n for s in seqs], dtype=np.int32),
        prompt_targets=np.concatenate(targets).astype(np.int32),
    )


@pytest.fixture(scope="module")
def worker(model_path):
    w = ModelWorker()
    w.load(LoadModel(model_path, "float32", "cpu", BLOCK_SIZE, 32, 1.0, 512, 16, 512))
    return w


@pytest.fixture(scope="module")
def oracle(hf):
    model, tok = hf

    @torch.no_grad()
    def log_softmax(ids: list[int]) -> torch.Tensor:  # [len, vocab]
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)

    return log_softmax, lambda text: tok(text)["input_ids"]


def assert_top_n(ids: np.ndarray, values: np.ndarray, ref: torch.Tensor, count: int) -> None:
    """Our top-`count` against one row of reference log-probs; -1 / NaN past `count`.
    Checked by value (the reference's value at our ids, and the reference's top values), so a
    near-tie that orders two ids differently does not fail it."""
    top = ref.topk(count).values.numpy()
    np.testing.assert_allclose(values[:count], top, atol=ATOL, rtol=0)
    np.testing.assert_allclose(ref[ids[:count]].numpy(), values[:count], atol=ATOL, rtol=0)
    assert (ids[count:] == -1).all() and np.isnan(values[count:]).all()


def test_generated_token_log_probs_and_top_n_match_hf(worker, oracle):
    log_softmax, encode = oracle
    a, b, c = (encode(t) for t in ("The capital of France is", "def add(a, b):", "Hello there"))
    seqs = [
        Seq(a, 0, [3], logprobs=True, top_n=5),
        Seq(b, 0, [7], logprobs=True, top_n=2, temperature=0.8, seed=7),
        Seq(c, 0, [1]),  # sampled, asks for nothing
        Seq(a[:4], 0, [9], sample=False, top_n=3),  # a prefill chunk: nothing sampled
    ]
    r = worker.step(make_plan(1, seqs))
    assert r.error is None and r.token_ids[3] == -1
    assert r.top_n_ids.shape == r.top_n_log_probs.shape == (4, 5)
    refs = [log_softmax(a)[-1], log_softmax(b)[-1]]
    assert r.token_ids[0] == refs[0].argmax()
    for row, (ref, count) in enumerate(zip(refs, (5, 2), strict=True)):
        assert abs(r.log_probs[row] - ref[r.token_ids[row]]) < ATOL
        assert_top_n(r.top_n_ids[row], r.top_n_log_probs[row], ref, count)
    for row in (2, 3):
        assert np.isnan(r.log_probs[row]) and np.isnan(r.top_n_log_probs[row]).all()
        assert (r.top_n_ids[row] == -1).all()

    # One decode step of the two that asked, batched, continues to match.
    a2, b2 = a + [int(r.token_ids[0])], b + [int(r.token_ids[1])]
    seqs = [Seq(a2[-1:], len(a), [3], logprobs=True, top_n=1), Seq(b2[-1:], len(b), [7])]
    r = worker.step(make_plan(2, seqs))
    ref = log_softmax(a2)[-1]
    assert r.token_ids[0] == ref.argmax() and abs(r.log_probs[0] - ref.max()) < ATOL
    assert_top_n(r.top_n_ids[0], r.top_n_log_probs[0], ref, 1)
    assert np.isnan(r.log_probs[1]) and r.token_ids[1] >= 0


def test_prompt_log_probs_across_two_chunks_match_hf(worker, oracle, monkeypatch):
    monkeypatch.setattr(logprobs_module, "PROMPT_LOGITS_MAX_ROWS", 5)  # several logits chunks
    log_softmax, encode = oracle
    p = encode("Once upon a time, in a land far away, there lived a small dragon.")
    q = encode("1, 2, 3, 4,")
    split = 12
    step1 = [
        Seq(p[:split], 0, [4, 11], sample=False, top_n=3, targets=p[1 : split + 1]),
        Seq(q, 0, [2], logprobs=True, targets=q[1:] + [-1]),
    ]
    step2 = [Seq(p[split:], split, [4, 11], logprobs=True, top_n=3, targets=p[split + 1 :] + [-1])]
    r1, r2 = worker.step(make_plan(1, step1)), worker.step(make_plan(2, step2))
    assert r1.error is None and r2.error is None
    assert r1.prompt_log_probs.shape == (split + len(q) - 1,)
    assert r2.prompt_log_probs.shape == (len(p) - split - 1,)

    ref_p, ref_q = log_softmax(p)[:-1], log_softmax(q)[:-1]
    got_p = np.concatenate([r1.prompt_log_probs[:split], r2.prompt_log_probs])
    want_p = ref_p.gather(1, torch.tensor(p[1:])[:, None]).squeeze(1).numpy()
    np.testing.assert_allclose(got_p, want_p, atol=ATOL, rtol=0)
    want_q = ref_q.gather(1, torch.tensor(q[1:])[:, None]).squeeze(1).numpy()
    np.testing.assert_allclose(r1.prompt_log_probs[split:], want_q, atol=ATOL, rtol=0)

    ids = np.concatenate([r1.prompt_top_n_ids[:split], r2.prompt_top_n_ids])
    values = np.concatenate([r1.prompt_top_n_log_probs[:split], r2.prompt_top_n_log_probs])
    for k in range(len(p) - 1):
        assert_top_n(ids[k], values[k], ref_p[k], 3)
    # q asked for no top-n: its rows are padding (N = 3 from p's top_n in the same step).
    assert (r1.prompt_top_n_ids[split:] == -1).all()
    assert np.isnan(r1.prompt_top_n_log_probs[split:]).all()


def test_greedy_fast_path_does_no_log_prob_work(worker, oracle, monkeypatch):
    log_softmax, encode = oracle
    prompts = [encode("The sky is"), encode("Water boils at")]

    def forbidden(*args, **kwargs):
        raise AssertionError("log-prob work on a step that asked for none")

    monkeypatch.setattr(logprobs_module, "log_probs_and_top_n", forbidden)
    monkeypatch.setattr(logprobs_module, "prompt_log_probs", forbidden)
    r = worker.step(make_plan(1, [Seq(p, 0, [5 + i]) for i, p in enumerate(prompts)]))
    assert r.error is None
    assert r.token_ids.tolist() == [int(log_softmax(p)[-1].argmax()) for p in prompts]
    assert np.isnan(r.log_probs).all() and r.log_probs.shape == (2,)
    assert r.top_n_ids.shape == r.top_n_log_probs.shape == (2, 0)
    assert r.prompt_log_probs.shape == (0,) and r.prompt_top_n_ids.shape == (0, 0)
