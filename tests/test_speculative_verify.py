"""Verification of speculative drafts, ops/speculative.py, on the CPU: greedy equals one token at
a time; sampled verification keeps the target's law exactly (chi-square over many seeds, for the
first two positions, with adversarial drafts); seeded draws are reproducible and k = 0 is the
plain sampler.

The target in most tests is a bigram toy model: the logits after a token t are T[t], so a verify
step's rows and plain decoding's steps are cheap to build for thousands of requests at once."""

from __future__ import annotations

import math

import pytest
import torch

from taipan.ops.sampling import processed_logits, sample
from taipan.ops.speculative import Verified, verify, verify_greedy

V = 6
START = 0  # every request's context ends with this token


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Small tensors: intra-op threads only contend (10x slower on the shared 2-core box)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def on(device: str, fn):
    """`fn` run with its tensor arguments moved to `device` and its results back on the CPU, so
    a test's bookkeeping stays on the CPU while the op under test runs on the GPU."""

    def move(t):
        return t.to(device) if isinstance(t, torch.Tensor) else t

    def run(*args, **kwargs):
        out = fn(*map(move, args), **{name: move(v) for name, v in kwargs.items()})
        if isinstance(out, Verified):
            return Verified(*(None if t is None else t.cpu() for t in out))
        return out.cpu()

    return run


CUDA = pytest.param("cuda", marks=pytest.mark.gpu)


def bigram(seed: int = 0) -> torch.Tensor:
    """Logits table T [V, V]: row t is the next-token logits after token t."""
    return torch.randn(V, V, generator=torch.Generator().manual_seed(seed)) * 1.5


def params(n: int, temperature=0.9, top_k=4, top_p=0.95, min_p=0.02, seed0=0):
    """Per-request sampling parameters (as `verify` takes them) for n requests, seeds distinct."""
    return dict(
        temperature=torch.full((n,), temperature),
        top_k=torch.full((n,), top_k, dtype=torch.int32),
        top_p=torch.full((n,), top_p),
        seeds=torch.arange(seed0, seed0 + n, dtype=torch.int64),
        gen_index=torch.zeros(n, dtype=torch.int32),
        min_p=torch.full((n,), min_p),
    )


def probs_of(logits: torch.Tensor, p: dict) -> torch.Tensor:
    """The law `sample` draws row r from, for rows that share request 0's parameters."""
    n = logits.shape[0]
    temperature, top_k = p["temperature"][:1].expand(n), p["top_k"][:1].expand(n)
    top_p, min_p = p["top_p"][:1].expand(n), p["min_p"][:1].expand(n)
    return torch.softmax(processed_logits(logits, temperature, top_k, top_p, min_p), -1)


def flat_rows(table: torch.Tensor, contexts: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """Verify rows for n requests with k drafts each: [n * (k + 1), V], request-major; row j of
    request i is T[its last token before position j] (the context's, then draft j-1)."""
    prev = torch.cat([contexts[:, None], drafts], dim=1)  # [n, k + 1]
    return table[prev.reshape(-1)]


def sub(p: dict, idx: torch.Tensor, gen_index: torch.Tensor | None = None) -> dict:
    out = {name: t[idx] for name, t in p.items()}
    if gen_index is not None:
        out["gen_index"] = gen_index.to(torch.int32)
    return out


# ---- greedy ------------------------------------------------------------------------------------


def test_greedy_hand_example():
    # Three requests: k = 3, 0, 2. Argmax per row marked with 9.0.
    rows = [
        [0, 9, 0, 0],  # req 0, j=0: argmax 1, draft 1 -> accept
        [0, 0, 9, 0],  # j=1: argmax 2, draft 2 -> accept
        [9, 0, 0, 0],  # j=2: argmax 0, draft 3 -> reject, emit 0
        [0, 0, 0, 9],  # j=3: bonus row (never reached)
        [0, 0, 9, 0],  # req 1, j=0: bonus, emit 2
        [0, 0, 0, 9],  # req 2, j=0: argmax 3, draft 3 -> accept
        [9, 0, 0, 0],  # j=1: argmax 0, draft 0 -> accept
        [0, 9, 0, 0],  # j=2: bonus, emit 1
    ]
    logits = torch.tensor(rows, dtype=torch.float32)
    drafts = torch.tensor([1, 2, 3, 3, 0])
    got = verify_greedy(logits, drafts, torch.tensor([3, 0, 2]))
    assert got.num_accepted.tolist() == [2, 0, 2]
    assert got.tokens.tolist() == [1, 2, 0, -1, 2, 3, 0, 1]
    assert got.tokens[got.tokens >= 0].tolist() == [1, 2, 0, 2, 3, 0, 1]
    assert got.logprobs is None


def test_greedy_ties_go_to_the_lowest_id():
    logits = torch.tensor([[1.0, 5.0, 5.0], [0.0, 0.0, 0.0]])
    assert verify_greedy(logits, torch.tensor([2]), torch.tensor([1])).tokens.tolist() == [1, -1]
    assert verify_greedy(logits, torch.tensor([1]), torch.tensor([1])).tokens.tolist() == [1, 0]


def greedy_decode(table: torch.Tensor, steps: int, prev: int = START) -> list[int]:
    out = []
    for _ in range(steps):
        prev = int(table[prev].argmax())
        out.append(prev)
    return out


@pytest.mark.parametrize("drafter", ["right", "wrong", "random"])
def test_greedy_equals_one_token_at_a_time(drafter):
    table, steps = bigram(1), 12
    plain = greedy_decode(table, steps)
    rng = torch.Generator().manual_seed(2)
    out = []
    while len(out) < steps:
        k = int(torch.randint(0, 4, (1,), generator=rng))
        truth = torch.tensor(greedy_decode(table, len(out) + k)[len(out) :], dtype=torch.long)
        if drafter == "right":  # the true continuation
            drafts = truth
        elif drafter == "wrong":  # never the argmax
            drafts = (truth + 1) % V
        else:
            drafts = torch.randint(0, V, (k,), generator=rng)
        context = torch.tensor([out[-1] if out else START])
        logits = flat_rows(table, context, drafts[None, :])
        got = verify_greedy(logits, drafts, torch.tensor([k]), with_logprobs=True)
        if drafter != "random":
            assert int(got.num_accepted) == (k if drafter == "right" else 0)
        new = got.tokens[got.tokens >= 0].tolist()
        assert len(new) == int(got.num_accepted) + 1
        expected = torch.log_softmax(logits, -1)[torch.arange(len(new)), torch.tensor(new)]
        torch.testing.assert_close(got.logprobs[: len(new)], expected)
        # verify() with temperature 0 is the same rule.
        p = params(1, temperature=0.0)
        p["gen_index"] = torch.tensor([len(out)], dtype=torch.int32)
        assert verify(logits, drafts, torch.tensor([k]), **p).tokens.tolist() == got.tokens.tolist()
        out += new
    assert out[:steps] == plain


# ---- k = 0 and reproducibility -----------------------------------------------------------------


def random_batch(n: int, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, 50, generator=g) * 2
    p = dict(
        temperature=torch.rand(n, generator=g) * 1.5,
        top_k=torch.randint(0, 10, (n,), generator=g, dtype=torch.int32),
        top_p=torch.where(torch.rand(n, generator=g) < 0.5, 1.0, 0.8),
        seeds=torch.randint(0, 2**40, (n,), generator=g),
        gen_index=torch.randint(0, 100, (n,), generator=g, dtype=torch.int32),
        min_p=torch.where(torch.rand(n, generator=g) < 0.5, 0.0, 0.05),
    )
    p["temperature"][::7] = 0.0  # greedy rows in the mix
    return logits, p


def test_k_zero_is_the_plain_sampler():
    n = 64
    logits, p = random_batch(n)
    none = torch.zeros(n, dtype=torch.int64)
    got = verify(logits, torch.zeros(0, dtype=torch.long), none, **p)
    plain = sample(
        logits, p["temperature"], p["top_k"], p["top_p"], p["seeds"], p["gen_index"], p["min_p"]
    )
    assert got.num_accepted.tolist() == [0] * n
    assert got.tokens.tolist() == plain.tolist()
    processed = processed_logits(logits, p["temperature"], p["top_k"], p["top_p"], p["min_p"])
    expected = torch.log_softmax(processed, -1).gather(1, plain[:, None]).squeeze(1)
    torch.testing.assert_close(got.logprobs, expected)
    with_q = verify(
        logits, torch.zeros(0, dtype=torch.long), none, **p, draft_probs=torch.zeros(0, 50)
    )
    assert with_q.tokens.tolist() == plain.tolist()


@pytest.mark.parametrize("with_q", [False, True])
def test_seeded_draws_are_reproducible_and_batch_independent(with_q):
    """The same request gets the same tokens again, and alone or in any batch position."""
    n = 12
    g = torch.Generator().manual_seed(4)
    num_drafts = torch.randint(0, 4, (n,), generator=g)
    rows, drafts_total = int(num_drafts.sum()) + n, int(num_drafts.sum())
    logits = torch.randn(rows, 50, generator=g)
    row_start = torch.cumsum(num_drafts + 1, 0) - (num_drafts + 1)
    draft_start = row_start - torch.arange(n)
    # Drafts: mostly the argmax of the row that scores them (so some land), some random.
    draft_rows = torch.cat(
        [torch.arange(k) + r for k, r in zip(num_drafts, row_start, strict=True)]
    )
    drafts = logits[draft_rows].argmax(-1)
    replace = torch.rand(drafts_total, generator=g) < 0.3
    drafts[replace] = torch.randint(0, 50, (int(replace.sum()),), generator=g)
    q = torch.softmax(torch.randn(drafts_total, 50, generator=g), -1) if with_q else None
    _, p = random_batch(n, seed=5)
    first = verify(logits, drafts, num_drafts, **p, draft_probs=q)
    again = verify(logits, drafts, num_drafts, **p, draft_probs=q)
    assert first.tokens.tolist() == again.tokens.tolist()
    assert first.num_accepted.sum() > 0
    for i in range(n):  # a_i accepted drafts, then one drawn token, then -1
        r0, d0, a = int(row_start[i]), int(draft_start[i]), int(first.num_accepted[i])
        assert 0 <= a <= int(num_drafts[i])
        assert first.tokens[r0 : r0 + a].tolist() == drafts[d0 : d0 + a].tolist()
        rest = first.tokens[r0 + a : r0 + int(num_drafts[i]) + 1].tolist()
        assert rest[0] >= 0 and all(t == -1 for t in rest[1:])
        assert torch.isfinite(first.logprobs[r0 : r0 + a + 1]).all()
    for i in [0, 5, n - 1]:
        r0, d0, k = int(row_start[i]), int(draft_start[i]), int(num_drafts[i])
        alone = verify(
            logits[r0 : r0 + k + 1],
            drafts[d0 : d0 + k],
            num_drafts[i : i + 1],
            **sub(p, torch.tensor([i])),
            draft_probs=None if q is None else q[d0 : d0 + k],
        )
        assert alone.tokens.tolist() == first.tokens[r0 : r0 + k + 1].tolist()
        assert alone.num_accepted.tolist() == first.num_accepted[i : i + 1].tolist()
        torch.testing.assert_close(alone.logprobs, first.logprobs[r0 : r0 + k + 1], equal_nan=True)


def plain_decode(table: torch.Tensor, p: dict, steps: int, device: str = "cpu") -> torch.Tensor:
    """Seeded plain decoding of n requests: [n, steps]."""
    sample_ = on(device, sample)
    n = p["seeds"].shape[0]
    prev, out = torch.full((n,), START), []
    for step in range(steps):
        gen = torch.full((n,), step, dtype=torch.int32)
        prev = sample_(
            table[prev], p["temperature"], p["top_k"], p["top_p"], p["seeds"], gen, p["min_p"]
        )
        out.append(prev)
    return torch.stack(out, 1)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("drafter", ["random", "argmax"])
def test_deterministic_drafts_give_plain_decodings_tokens(drafter, device):
    """With point-mass drafts, a seeded request's speculative output is the plain decoding's,
    token for token, whatever the drafts and however many land per step."""
    table, n, steps = bigram(6), 40, 10
    p = params(n, seed0=100)
    plain = plain_decode(table, p, steps, device)
    verify_ = on(device, verify)
    g = torch.Generator().manual_seed(7)
    outs = [[] for _ in range(n)]
    while min(len(o) for o in outs) < steps:
        live = [i for i in range(n) if len(outs[i]) < steps]
        num_drafts = torch.randint(0, 4, (len(live),), generator=g)
        contexts = torch.tensor([outs[i][-1] if outs[i] else START for i in live])
        drafts, rows = [], []
        for j in range(len(live)):
            k, prev = int(num_drafts[j]), int(contexts[j])
            if drafter == "random":
                d = torch.randint(0, V, (k,), generator=g)
            else:  # greedy chain: often right where p is peaked
                d = torch.tensor(greedy_decode(table, k, prev), dtype=torch.long)
            drafts.append(d)
            rows.append(flat_rows(table, contexts[j : j + 1], d[None, :]))
        gen = torch.tensor([len(outs[i]) for i in live])
        got = verify_(
            torch.cat(rows), torch.cat(drafts), num_drafts, **sub(p, torch.tensor(live), gen)
        )
        new, starts = got.tokens, torch.cumsum(num_drafts + 1, 0) - (num_drafts + 1)
        for j, i in enumerate(live):
            a = int(got.num_accepted[j])
            outs[i] += new[int(starts[j]) : int(starts[j]) + a + 1].tolist()
    assert [o[:steps] for o in outs] == plain.tolist()


# ---- the law of the output: first and second positions ----------------------------------------

# Point-mass drafts ("wrong", "argmax", "random", "oracle") give plain decoding's very tokens
# (the test above), so for them these tests come down to plain sampling's law; the q-*
# strategies exercise the rejection sampler proper.
N = 40_000  # requests (= seeds) per law test


def chi2_limit(df: int, z: float = 3.719) -> float:
    """Upper 1e-4 quantile of chi-square(df) (Wilson-Hilferty; z = the normal's 1e-4 quantile)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def draft_for(strategy: str, table, prev, p, gen, g):
    """One draft per request after tokens `prev` [n]: (draft [n], its law q [n, V] or None)."""
    n = prev.shape[0]
    if strategy == "wrong":  # a token p gives no mass to (top-k = 4 of 6 drops the two lowest)
        return table[prev].argmin(-1), None
    if strategy == "argmax":
        return table[prev].argmax(-1), None
    if strategy == "random":
        return torch.randint(0, V, (n,), generator=g), None
    if strategy == "oracle":  # the very token the sampler draws at that position: always right
        return sample(
            table[prev], p["temperature"], p["top_k"], p["top_p"], p["seeds"], gen, p["min_p"]
        ), None
    if strategy == "q=p":
        q = probs_of(table[prev], p)
    elif strategy == "q-adversarial":  # most mass where p has none
        q = torch.full((n, V), 0.1 / V).scatter_(1, table[prev].argmin(-1, keepdim=True), 0.9)
        q = q / q.sum(-1, keepdim=True)
    elif strategy in ("q-random", "q-mislabelled"):
        q = torch.distributions.Dirichlet(torch.full((V,), 0.5)).sample((n,))
        q = q.clamp(min=1e-6) / q.clamp(min=1e-6).sum(-1, keepdim=True)
    draft = torch.multinomial(q, 1, generator=g).squeeze(1)
    if strategy == "q-mislabelled":  # the negative control: claims q = p, drew from elsewhere
        return draft, probs_of(table[prev], p)
    return draft, q


def speculative_pairs(
    strategy: str, table: torch.Tensor, p: dict, k: int = 2, device: str = "cpu"
) -> torch.Tensor:
    """The first two tokens of N requests decoded speculatively: [N, 2]. Step 1 verifies k
    drafts; requests that landed one token take a second step with one draft."""
    verify_ = on(device, verify)
    n = p["seeds"].shape[0]
    torch.manual_seed(11)  # Dirichlet draws
    g = torch.Generator().manual_seed(12)
    contexts = torch.full((n,), START)
    drafts, qs, prev = [], [], contexts
    for j in range(k):
        d, q = draft_for(strategy, table, prev, p, torch.full((n,), j, dtype=torch.int32), g)
        drafts.append(d)
        qs.append(q)
        prev = d
    drafts_nk = torch.stack(drafts, 1)  # [n, k]
    q_flat = None if qs[0] is None else torch.stack(qs, 1).reshape(n * k, V)
    got = verify_(
        flat_rows(table, contexts, drafts_nk),
        drafts_nk.reshape(-1),
        torch.full((n,), k),
        **p,
        draft_probs=q_flat,
        with_logprobs=False,
    )
    if strategy in ("oracle", "q=p"):
        assert got.num_accepted.tolist() == [k] * n, "a draft that cannot miss was rejected"
    if strategy in ("wrong", "q-adversarial"):
        assert (got.num_accepted == 0).float().mean() > 0.8
    new = got.tokens.reshape(n, k + 1)
    pairs = new[:, :2].clone()
    # Requests with one token so far: a second step from it, gen_index 1, one draft.
    short = torch.nonzero(got.num_accepted == 0).squeeze(1)
    gen = torch.ones(short.shape[0], dtype=torch.int32)
    ps = sub(p, short, gen)
    d, q = draft_for(strategy, table, pairs[short, 0], ps, gen, g)
    second = verify_(
        flat_rows(table, pairs[short, 0], d[:, None]),
        d,
        torch.ones(short.shape[0], dtype=torch.int64),
        **ps,
        draft_probs=q,
        with_logprobs=False,
    )
    pairs[short, 1] = second.tokens.reshape(-1, 2)[:, 0]
    return pairs


def law_gap(pairs: torch.Tensor, table: torch.Tensor, p: dict) -> tuple[float, float, float]:
    """(chi-square, its 1e-4 limit, total variation) of the pairs against the exact joint law
    p(a) p(b | a); asserts no pair has law 0."""
    p0 = probs_of(table[START : START + 1], p)[0]  # [V]
    p1 = probs_of(table, p)  # [V, V]: row a is p(. | a)
    expected = (p0[:, None] * p1).reshape(-1) * pairs.shape[0]
    observed = torch.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V).double()
    assert observed[expected == 0].sum() == 0, "drew a pair the target gives no mass"
    live = expected > 0
    chi2 = float(((observed[live] - expected[live]) ** 2 / expected[live]).sum())
    tv = float((observed - expected).abs().sum() / (2 * pairs.shape[0]))
    return chi2, chi2_limit(int(live.sum()) - 1), tv


STRATEGIES = ["wrong", "argmax", "random", "oracle", "q=p", "q-adversarial", "q-random"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sampled_output_has_the_target_law(strategy):
    table, p = bigram(8), params(N, seed0=10_000)
    chi2, limit, tv = law_gap(speculative_pairs(strategy, table, p), table, p)
    assert chi2 < limit, f"{strategy}: chi-square {chi2:.1f} >= {limit:.1f} (tv {tv:.4f})"
    assert tv < 0.02


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["random", "q-random", "q-adversarial"])
def test_gpu_sampled_output_has_the_target_law(strategy):
    """The same on CUDA (the Triton sampler draws the plain rows there)."""
    table, p = bigram(8), params(N, seed0=20_000)
    pairs = speculative_pairs(strategy, table, p, device="cuda")
    chi2, limit, tv = law_gap(pairs, table, p)
    assert chi2 < limit, f"{strategy}: chi-square {chi2:.1f} >= {limit:.1f} (tv {tv:.4f})"


def test_the_law_test_catches_a_wrong_q():
    """Power check: drafts drawn from one law but verified as if drawn from p are accepted too
    often, and the same statistic flags it."""
    table, p = bigram(8), params(N, seed0=10_000)
    chi2, limit, _ = law_gap(speculative_pairs("q-mislabelled", table, p), table, p)
    assert chi2 > 10 * limit


def test_greedy_rows_with_a_draft_law_follow_the_argmax():
    table, n = bigram(9), 200
    p = params(n, temperature=0.0)
    g = torch.Generator().manual_seed(1)
    q = torch.softmax(torch.randn(n * 2, V, generator=g), -1)
    drafts = torch.multinomial(q, 1, generator=g).squeeze(1)
    contexts = torch.full((n,), START)
    got = verify(
        flat_rows(table, contexts, drafts.reshape(n, 2)),
        drafts,
        torch.full((n,), 2),
        **p,
        draft_probs=q,
    )
    plain = greedy_decode(table, 3)
    for i in range(n):
        new = got.tokens[3 * i : 3 * i + 3]
        new = new[new >= 0].tolist()
        assert new == plain[: len(new)]


@pytest.mark.gpu
def test_gpu_verify_replays_in_a_cuda_graph():
    """`verify` (point-mass drafts) and `verify_greedy` captured once on static buffers, then
    replayed after the inputs changed in place, the split of rows between requests included (a
    graph depends on the request and row counts only): each replay equals an eager call."""
    dev, num_requests, vocab = "cuda", 8, 1000
    g = torch.Generator().manual_seed(13)
    num_drafts = torch.tensor([3, 0, 2, 1, 3, 0, 1, 2], device=dev)
    rows = int(num_drafts.sum()) + num_requests
    logits = torch.zeros(rows, vocab, device=dev)
    drafts = torch.zeros(rows - num_requests, dtype=torch.long, device=dev)
    _, p = random_batch(num_requests, seed=14)
    p = {name: t.to(dev) for name, t in p.items()}

    def run():
        return (
            verify(logits, drafts, num_drafts, **p, with_logprobs=False),
            verify_greedy(logits, drafts, num_drafts),
        )

    def load(split):
        num_drafts.copy_(torch.tensor(split))
        logits.copy_(torch.randn(rows, vocab, generator=g) * 3)
        is_draft_row = torch.ones(rows, dtype=torch.bool)
        is_draft_row[torch.cumsum(torch.tensor(split) + 1, 0) - 1] = False  # not the bonus rows
        guess = logits.cpu()[is_draft_row].argmax(-1)  # right for greedy rows, often for others
        wrong = torch.rand(guess.shape[0], generator=g) < 0.3
        drafts.copy_(torch.where(wrong, torch.randint(0, vocab, guess.shape, generator=g), guess))

    load([3, 0, 2, 1, 3, 0, 1, 2])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile the Triton kernels outside the capture
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed = run()
    for split in ([3, 0, 2, 1, 3, 0, 1, 2], [0, 0, 0, 0, 0, 0, 6, 6], [1, 2, 3, 1, 2, 1, 1, 1]):
        load(split)
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(graphed, run(), strict=True):
            assert got.num_accepted.tolist() == want.num_accepted.tolist(), split
            assert got.tokens.tolist() == want.tokens.tolist(), split
        assert graphed[1].num_accepted.sum() > 0  # some drafts landed


# ---- inputs ------------------------------------------------------------------------------------


def test_unseeded_rows_draw_from_the_kept_set():
    logits, p = random_batch(32, seed=6)
    p["seeds"][:] = -1
    drafts = logits[:16].argmax(-1)  # requests 0..15 bring one draft (scored by their row 0)
    num_drafts = (torch.arange(32) < 16).long()
    rows = torch.cat([torch.stack([logits[:16], logits[:16]], 1).reshape(32, 50), logits[16:]])
    got = verify(rows, drafts, num_drafts, **p)
    kept = got.tokens >= 0
    assert int(kept.sum()) == 32 + int(got.num_accepted.sum())
    # Log-probs are of the processed law: finite exactly where a token survived the filters.
    assert torch.isfinite(got.logprobs[kept]).all()


def test_empty_batch():
    got = verify(
        torch.zeros(0, V),
        torch.zeros(0, dtype=torch.long),
        torch.zeros(0, dtype=torch.long),
        **params(0),
    )
    assert isinstance(got, Verified) and got.tokens.shape == (0,) and got.num_accepted.shape == (0,)


def test_shape_errors_name_the_layout():
    logits = torch.zeros(4, V)
    with pytest.raises(ValueError, match="need 4 rows"):
        verify_greedy(torch.zeros(3, V), torch.tensor([1, 2]), torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="sum to len"):
        verify_greedy(torch.zeros(5, V), torch.tensor([1, 2]), torch.tensor([2, 1, -1]))
    with pytest.raises(ValueError, match="draft_probs"):
        verify(
            logits,
            torch.tensor([1, 2]),
            torch.tensor([2, 0]),
            **params(2),
            draft_probs=torch.zeros(3, V),
        )
