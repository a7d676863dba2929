"""A small reinforcement-learning loop with taipan as the rollout engine (issue 26 item 7).

This process is the trainer: a Hugging Face copy of the policy in plain torch. taipan serves
the same weights in its own processes. Each iteration:

1. rollouts: G sampled completions per prompt, with the log-probs taipan sampled them with;
2. a partial rollout: long requests in flight are cut by `pause(mode="abort")` (each ends with
   finish_reason "abort" and the tokens it had), to be finished after the update;
3. a REINFORCE step with a group baseline on a toy reward (the share of even token ids), the
   trainer's log-probs of the rollouts compared with taipan's (the train/inference mismatch);
4. the new weights straight from the trainer's tensors (`taipan.rl.push_weights`: one
   torch.distributed broadcast per bucket, gloo on the CPU, NCCL between GPUs), then unpause;
5. checks: greedy tokens equal the trainer's own (Hugging Face generate with its current
   weights), the partial rollouts finish under the new version, and every token carries the
   version that produced it (`Completion.weight_versions`).

One JSON line per iteration (rollout tokens/s, sync seconds, reward, mismatch, checks), then a
summary. On the CPU:

    python examples/rl_loop.py --model DIR            # DIR: a Hugging Face Llama directory
    python examples/rl_loop.py --model DIR --device cuda:1 --trainer-device cuda:0  # NCCL

The model directory needs config.json, safetensors and tokenizer.json (taipan and transformers
both read it). Exit code 0 only when every check held.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time

import torch

from taipan import LLM, SamplingParams, rl


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (6 + i % 5,), generator=gen).tolist() for i in range(n)]


def _spans(c) -> list[tuple[int, int]]:
    return [tuple(s) for s in c.weight_versions]


def reward(tokens: list[int]) -> float:
    """The toy task: emit even token ids."""
    return sum(t % 2 == 0 for t in tokens) / max(len(tokens), 1)


def completion_log_probs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The trainer's log-prob of each completion token (differentiable)."""
    ids = torch.tensor([prompt + tokens], device=model.device)
    logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt) :, None])[:, 0]


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt], device=model.device), max_new_tokens=n, min_new_tokens=n,
            do_sample=False, pad_token_id=0,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=model.device),
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def rollouts(llm, prompts, args, seed: int):
    """G completions per prompt, sampled, with taipan's log-probs of each token."""
    params = [
        SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=seed * 1000 + i,
                       ignore_eos=True, return_log_probs=True, skip_prompt_log_probs=True)
        for i in range(len(prompts) * args.group_size)
    ]  # fmt: skip
    batch = [p for p in prompts for _ in range(args.group_size)]
    start = time.perf_counter()
    done = llm.generate(batch, params, use_tqdm=False)
    return batch, done, time.perf_counter() - start


def train_step(trainer, optimizer, batch, done, group_size: int) -> tuple[float, float]:
    """REINFORCE with the group's mean reward as baseline; returns (mean reward, the largest
    |trainer log-prob - taipan log-prob| over the sampled tokens, before the step)."""
    rewards = torch.tensor([reward(c.token_ids) for c in done])
    advantages = rewards - rewards.view(-1, group_size).mean(1).repeat_interleave(group_size)
    optimizer.zero_grad()
    mismatch, loss = 0.0, 0.0
    for prompt, c, adv in zip(batch, done, advantages, strict=True):
        ours = completion_log_probs(trainer, prompt, list(c.token_ids))
        theirs = torch.tensor(c.log_probs, device=ours.device)
        mismatch = max(mismatch, (ours.detach() - theirs).abs().max().item())
        loss = loss - adv.item() * ours.sum() / len(done)
    loss.backward()
    optimizer.step()
    return rewards.mean().item(), mismatch


class PartialRollouts:
    """Long requests generating in a thread until a pause(mode="abort") cuts them."""

    def __init__(self, llm, prompts, max_tokens: int):
        self.prompts, self.done = prompts, None
        greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.thread = threading.Thread(
            target=lambda: setattr(self, "done", llm.generate(prompts, greedy, use_tqdm=False))
        )
        self.thread.start()

    def cut(self, llm, after_s: float) -> list:
        time.sleep(after_s)  # (let them generate a little)
        llm.pause(mode="abort")
        self.thread.join(60)
        if self.thread.is_alive() or self.done is None:
            raise RuntimeError("the requests in flight got no terminal reply after an abort pause")
        return self.done


def iteration(it: int, llm, trainer, optimizer, group, prompts, args) -> dict:
    batch, done, seconds = rollouts(llm, prompts, args, seed=it)
    version = llm.stats().merged().weight_version
    tokens = sum(len(c.token_ids) for c in done)
    versions_ok = all(_spans(c) == [(version, 0)] for c in done)
    partial = PartialRollouts(llm, prompts[:2], args.partial_tokens)
    cut = partial.cut(llm, args.cut_after)  # paused from here on
    aborted = [(p, c) for p, c in zip(partial.prompts, cut, strict=True)
               if str(c.finish_reason) == "abort"]  # fmt: skip
    cut_versions_ok = all(_spans(c) in ([(version, 0)], []) for c in cut)
    mean_reward, mismatch = train_step(trainer, optimizer, batch, done, args.group_size)
    start = time.perf_counter()
    ack = rl.push_weights(llm, trainer, group, weight_version=version + 1)
    llm.unpause()
    sync = time.perf_counter() - start
    # Finish the partial rollouts under the new weights: prompt + what they had, the rest to go.
    rest = [
        SamplingParams(max_tokens=args.partial_tokens - len(c.token_ids), temperature=0.0,
                       ignore_eos=True)
        for _, c in aborted
    ]  # fmt: skip
    ends = llm.generate([p + list(c.token_ids) for p, c in aborted], rest, use_tqdm=False)
    resumed_ok = all(_spans(e) == [(version + 1, 0)] for e in ends)
    trainer.eval()
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    got = [c.token_ids for c in llm.generate(prompts, greedy, use_tqdm=False)]
    want = [hf_greedy(trainer, p, args.max_tokens) for p in prompts]
    trainer.train()
    return {
        "iteration": it,
        "version": ack.weight_version,
        "rollouts": len(done),
        "rollout_tokens": tokens,
        "rollout_tok_s": round(tokens / seconds, 1),
        "sync_s": round(sync, 4),
        "reward": round(mean_reward, 4),
        "logprob_mismatch": mismatch,
        "aborted": len(aborted),
        "aborted_tokens": sum(len(c.token_ids) for _, c in aborted),
        "versions_ok": versions_ok and cut_versions_ok and resumed_ok,
        "greedy_equal": got == want,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a Hugging Face model directory")
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group-size", type=int, default=4, help="completions per prompt (G)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--partial-tokens", type=int, default=400, help="the cut requests' length")
    p.add_argument("--cut-after", type=float, default=0.2, help="seconds before the abort")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--device", default="cpu", help="taipan's device")
    p.add_argument("--trainer-device", default="cpu")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--mismatch-tol", type=float, default=1e-3, help="fp32 log-prob agreement")
    args = p.parse_args(argv)
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    trainer = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    trainer.to(args.trainer_device).train()
    trainer.generation_config.eos_token_id = None
    optimizer = torch.optim.SGD(trainer.parameters(), lr=args.lr)
    prompts = _prompts(args.prompts, trainer.config.vocab_size, seed=1)
    config = dict(max_requests=max(16, args.prompts * args.group_size), max_tokens=512,
                  max_sequence_length=512, buffer_size_gb=0.2)  # fmt: skip
    rows = []
    with LLM(args.model, device=args.device, dtype="float32",
             tensor_parallel_size=args.tensor_parallel_size, **config) as llm:  # fmt: skip
        group = rl.join(llm, "127.0.0.1", _port(), device=args.trainer_device)
        for it in range(args.iterations):
            rows.append(iteration(it, llm, trainer, optimizer, group, prompts, args))
            print(json.dumps(rows[-1]), flush=True)
        llm.close_weight_transfer()
        group.close()
    ok = all(
        r["versions_ok"] and r["greedy_equal"] and r["logprob_mismatch"] < args.mismatch_tol
        for r in rows
    )
    summary = {"iterations": len(rows), "ok": ok, "sync_s": [r["sync_s"] for r in rows],
               "rollout_tok_s": [r["rollout_tok_s"] for r in rows],
               "aborted": sum(r["aborted"] for r in rows)}  # fmt: skip
    print(json.dumps(summary), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
