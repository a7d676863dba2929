"""The Hugging Face side of `taipan bench`: transformers on the same model, token ids and
precision as ours, in each of its timed modes: `generate` with its default (dynamic) cache, with a
static cache (which transformers compiles by itself on CUDA: `torch.compile`, "reduce-overhead",
its fastest decode), on static left-padded batches (offline), with continuous batching (the
manager behind `generate_batch`, driven directly so each request gets its own output length),
and one prompt at a time (shared-prefix). On both sides EOS neither stops a request nor is
masked (`never_stop_at_eos`).

The runtime's bench (runtime/bench/) imports it inside its workloads' functions, on use; test and
bench code, never the serving path (nothing under actors/ or the rest of ops/ imports it).
"""

from __future__ import annotations

import os
import time

import torch

from taipan.ops.hardware import as_dtype, sync
from taipan.ops.loader import RANDOM_PREFIX, random_config, random_state
from taipan.ops.models.gemma3 import Gemma3Config
from taipan.ops.models.llama import LlamaConfig
from taipan.ops.models.mistral import MistralConfig
from taipan.ops.models.qwen2 import Qwen2Config
from taipan.ops.models.qwen3_next import Qwen3NextConfig
from taipan.ops.weight_updates import hf_name_to_ours

# ---- the Hugging Face model ------------------------------------------------------------------


def _import_transformers():
    try:
        import transformers
    except ImportError:
        raise RuntimeError("the HF side needs transformers: pip install -e '.[dev]'") from None
    return transformers


def load_hf(model_path: str, dtype: str | torch.dtype, device: str):
    """transformers' model for a GGUF file, an HF directory or `random:<shape>`
    (`hf_random_model`: our random weights), in eval mode, never stopping at EOS."""
    transformers = _import_transformers()
    dtype = as_dtype(dtype)
    if model_path.startswith(RANDOM_PREFIX):
        model = hf_random_model(model_path, dtype, device)
    elif model_path.endswith(".gguf"):
        d, f = os.path.split(model_path)
        model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=dtype)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    model = model.to(device).eval()
    never_stop_at_eos(model)
    return model


def hf_random_model(spec: str, dtype: torch.dtype, device: str):
    """transformers' LlamaForCausalLM, MistralForCausalLM, Gemma3ForCausalLM or
    Qwen3NextForCausalLM (the shape's family) holding exactly the weights `load_model(spec)`
    gives ours (ops/random_model.py `random_state`, same seed and device), un-fused into q/k/v
    and gate/up views (Qwen3-Next's experts as whole stacked tensors). Built on the
    meta device, then the tensors are adopted; the buffers a meta-built model lacks are rebuilt:
    the rotary tables in fp32 (`.to(bf16)` would round them), Gemma's embedding scale."""
    transformers = _import_transformers()
    config = random_config(spec)
    hf_config, cls = _hf_config(transformers, config, dtype)
    with torch.device("meta"):
        model = cls(hf_config)
    ours = random_state(config, dtype, device)
    state = {}
    for name in model.state_dict():
        ours_name, rows = hf_name_to_ours(name, config)
        state[name] = ours[ours_name][rows]  # a view: no copy of the weights
    model.load_state_dict(state, strict=True, assign=True)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=hf_config).to(device)
    if isinstance(config, Gemma3Config):  # (a non-persistent fp32 buffer, as HF builds it)
        model.model.embed_tokens.embed_scale = torch.tensor(config.hidden_size**0.5, device=device)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"HF model still has meta tensors after loading: {left[:5]}")
    return model.eval()


def _hf_config(transformers, config, dtype: torch.dtype) -> tuple[object, type]:
    """(transformers' config, model class) of one of our random shapes' configs."""
    common = dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=config.eos_token_ids[0],
        pad_token_id=None,
        dtype=dtype,  # as from_pretrained(dtype=...) records it
    )
    rope = {"rope_type": "default", "rope_theta": config.rope_theta}
    if isinstance(config, Gemma3Config):
        full = rope
        if config.rope_scaling_factor != 1.0:
            full = dict(rope, rope_type="linear", factor=config.rope_scaling_factor)
        local = {"rope_type": "default", "rope_theta": config.rope_local_theta}
        kinds = {True: "sliding_attention", False: "full_attention"}
        hf = transformers.Gemma3TextConfig(
            **common,
            sliding_window=config.sliding_window,
            layer_types=[kinds[config.is_local(i)] for i in range(config.num_layers)],
            rope_parameters={"full_attention": full, "sliding_attention": local},
            query_pre_attn_scalar=int(config.query_pre_attn_scalar),  # (HF types it int)
        )
        return hf, transformers.Gemma3ForCausalLM
    if isinstance(config, MistralConfig):
        hf = transformers.MistralConfig(
            **common, rope_parameters=rope, sliding_window=config.sliding_window
        )
        return hf, transformers.MistralForCausalLM
    if isinstance(config, Qwen2Config):
        hf = transformers.Qwen2Config(**common, rope_parameters=rope, use_sliding_window=False)
        return hf, transformers.Qwen2ForCausalLM
    if isinstance(config, Qwen3NextConfig):
        return _hf_qwen3_next_config(transformers, config, common, rope), (
            transformers.Qwen3NextForCausalLM
        )
    if type(config) is not LlamaConfig:
        raise RuntimeError(f"no Hugging Face model for a random {type(config).__name__}")
    return transformers.LlamaConfig(**common, rope_parameters=rope), transformers.LlamaForCausalLM


def _hf_qwen3_next_config(transformers, config: Qwen3NextConfig, common: dict, rope: dict):
    """transformers' Qwen3NextConfig of one of our Qwen3-Next configs (no experts: num_experts
    0, every MLP dense)."""
    moe = config.moe
    experts = {"num_experts": 0}
    if moe is not None:
        experts = dict(
            num_experts=moe.num_experts,
            num_experts_per_tok=moe.top_k,
            moe_intermediate_size=moe.intermediate_size,
            norm_topk_prob=moe.renormalize,
            shared_expert_intermediate_size=config.shared_expert_intermediate_size,
        )
    return transformers.Qwen3NextConfig(
        **common,
        **experts,
        rope_parameters=rope | {"partial_rotary_factor": config.partial_rotary_factor},
        layer_types=list(config.layer_types),
        linear_num_key_heads=config.linear_num_key_heads,
        linear_num_value_heads=config.linear_num_value_heads,
        linear_key_head_dim=config.linear_key_head_dim,
        linear_value_head_dim=config.linear_value_head_dim,
        linear_conv_kernel_dim=config.linear_conv_kernel,
        decoder_sparse_step=config.decoder_sparse_step,
        mlp_only_layers=list(config.mlp_only_layers),
    )


def never_stop_at_eos(model) -> None:
    """EOS as ours treats it (SamplingParams(ignore_eos=True)): never a stop, never masked, so an
    EOS argmax is emitted and decoding goes on. `min_new_tokens` would mask the EOS logit
    (MinNewTokensLengthLogitsProcessor) and pick another token. `generate` fills unset options
    from `model.generation_config` (the checkpoint's eos_token_id lives there); with
    eos_token_id None, transformers 5.23's `_get_stopping_criteria` adds no EosTokenCriteria,
    `_get_logits_processor` no MinLength/MinNewTokens processor, and `_sample` never swaps in
    pad for finished rows: the one stop left is MaxLengthCriteria at width + max_new_tokens."""
    gen = model.generation_config
    gen.eos_token_id = gen.forced_eos_token_id = None
    gen.min_length = gen.min_new_tokens = None


def _pad_id(model) -> int:
    eos = model.config.eos_token_id
    return eos if isinstance(eos, int) else 0


def _left_padded(model, prompt_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), every prompt left-padded to the longest and masked out (HF
    derives position ids from the mask, so positions match ours)."""
    width = max(len(p) for p in prompt_ids)
    pad = _pad_id(model)
    ids = [[pad] * (width - len(p)) + list(p) for p in prompt_ids]
    mask = [[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids]
    return (
        torch.tensor(ids, device=model.device),
        torch.tensor(mask, device=model.device),
    )


def _generate(model, prompt_ids: list[list[int]], max_new_tokens: int, **kw) -> torch.Tensor:
    ids, mask = _left_padded(model, prompt_ids)
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=_pad_id(model),
        **kw,
    )
    if out.shape != (len(prompt_ids), ids.shape[1] + max_new_tokens):
        raise RuntimeError(
            f"HF returned {tuple(out.shape)}, not {len(prompt_ids)} x "
            f"{ids.shape[1]}+{max_new_tokens}"
        )
    return out[:, ids.shape[1] :]


def hf_generate(
    args, model_path: str, prompt_ids: list[list[int]]
) -> tuple[float, list[list[int]]]:
    """The `generate-NxM` workload: one static batch, left-padded, `args.output_len` tokens."""
    model = load_hf(model_path, args.dtype, args.device)
    with torch.inference_mode():
        _generate(model, prompt_ids[:2], 2)  # warm-up
        sync(args.device)
        start = time.perf_counter()
        out = _generate(model, prompt_ids, args.output_len)
        sync(args.device)
        elapsed = time.perf_counter() - start
    return elapsed, out.tolist()


_HF_MODELS: dict[tuple[str, str, str], object] = {}  # one load per process and model


def hf_one_at_a_time(
    model_path: str, dtype: str, device: str, prompts: list[list[int]], output_len: int
) -> dict:
    """HF transformers on `prompts` one at a time (it has no prefix cache and no continuous
    batching): the mean TTFT (the prompt's forward, to its first token's logits) and the output
    tokens per second of greedy `generate` at batch 1 over all of them."""
    key = (model_path, str(dtype), device)
    if key not in _HF_MODELS:
        _HF_MODELS.clear()
        _HF_MODELS[key] = load_hf(model_path, dtype, device)
    model = _HF_MODELS[key]
    ttfts, seconds = [], 0.0
    with torch.inference_mode():
        _generate(model, [prompts[0][:8]], 2)  # warm-up
        for p in prompts:
            ids = torch.tensor([p], device=model.device)
            sync(device)
            start = time.perf_counter()
            model(ids, logits_to_keep=1)
            sync(device)
            ttfts.append(time.perf_counter() - start)
            start = time.perf_counter()
            _generate(model, [p], output_len)
            sync(device)
            seconds += time.perf_counter() - start
    return {
        "prompts": len(prompts),
        "ttft_mean_s": sum(ttfts) / len(ttfts),
        "output_tok_s": len(prompts) * output_len / seconds,
    }


# ---- decode: step time at a fixed batch -----------------------------------------------------


def _allow_recompiles() -> None:
    """Each batch size is one more compiled graph of HF's static-cache decode; dynamo's default
    limit (8) would silently fall back to eager after that."""
    import torch._dynamo

    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(64, getattr(torch._dynamo.config, name)))


class _StepClock:
    """A `generate` streamer that only stamps the clock: `put` comes once with the prompt and
    once per new token, after the token reached the host (`generate` copies it there, which
    waits for the step), so the gaps after the second stamp are whole decode steps."""

    def __init__(self):
        self.stamps: list[float] = []

    def put(self, value) -> None:
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass

    def decode_steps(self) -> list[float]:
        """Seconds of each decode step (the first gap is the prompt's prefill)."""
        return [b - a for a, b in zip(self.stamps[1:-1], self.stamps[2:], strict=True)]


def hf_decode_seconds(
    model, runs: dict[str, list[list[int]]], output_len: int, static: bool
) -> dict:
    """Seconds of `generate` for run "t1" (1 new token: prefill only) and run "tn" (1 + output_len
    tokens), after a warm-up on the "warmup" prompts with the tn shape (for `static` that
    warm-up compiles the decode graph, and sizes the static cache that later calls reuse); and
    "steps": the tn run's output_len decode steps, each timed on its own (`_StepClock`)."""
    kw = {"cache_implementation": "static"} if static else {}
    if static:
        _allow_recompiles()
    _generate(model, runs["warmup"], 1 + output_len, **kw)
    out: dict = {}
    clock = _StepClock()
    for name, new_tokens in (("t1", 1), ("tn", 1 + output_len)):
        sync(model.device)
        start = time.perf_counter()
        _generate(
            model, runs[name], new_tokens, **kw, **({"streamer": clock} if name == "tn" else {})
        )
        sync(model.device)
        out[name] = time.perf_counter() - start
    out["steps"] = clock.decode_steps()
    if len(out["steps"]) != output_len:
        raise RuntimeError(f"HF streamed {len(out['steps'])} decode steps, not {output_len}")
    return out


# ---- offline: many requests of their own lengths ---------------------------------------------


def hf_static_batches_seconds(
    model, prompts: list[list[int]], output_lens: list[int], batch: int
) -> float:
    """`generate` on consecutive batches of up to `batch` requests in submission order, each
    left-padded and run to its longest requested output (the extra tokens of shorter requests
    are HF's padding cost, not counted as output)."""
    _generate(model, prompts[: min(2, len(prompts))], 2)  # warm-up
    sync(model.device)
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        _generate(model, prompts[i : i + batch], max(output_lens[i : i + batch]))
    sync(model.device)
    return time.perf_counter() - start


def hf_continuous_seconds(model, prompts: list[list[int]], output_lens: list[int]) -> float:
    """transformers' continuous batching (the manager behind `generate_batch`), every request
    with its own max_new_tokens and no EOS; timed from the first submission to the last result,
    after the manager's own warm-up (CUDA graph capture) in the context manager's entry."""
    transformers = _import_transformers()
    from transformers.generation.continuous_batching.utils import WorkloadHints

    gen = transformers.GenerationConfig(
        max_new_tokens=max(output_lens), do_sample=False, eos_token_id=None, pad_token_id=0
    )
    hints = WorkloadHints(
        max_prompt_length=max(map(len, prompts)),
        max_generated_length=max(output_lens),
        num_requests=len(prompts),
    )
    cb_config = None
    if model.device.type != "cuda":  # its memory-sized cache would fill the host's RAM
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        cb_config = ContinuousBatchingConfig(num_blocks=64, max_batch_tokens=1024)
    cm = model.continuous_batching_context_manager(
        generation_config=gen,
        continuous_batching_config=cb_config,
        block=True,
        timeout=30,
        workload_hints=hints,
    )
    with cm as manager:
        sync(model.device)
        start = time.perf_counter()
        wanted = {
            manager.add_request(list(p), max_new_tokens=n, eos_token_id=-1): n
            for p, n in zip(prompts, output_lens, strict=True)
        }
        results = {}
        while len(results) < len(wanted):
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("HF continuous batching stopped before every result")
                continue
            if result.is_finished():
                results[result.request_id] = result
        sync(model.device)
        elapsed = time.perf_counter() - start
    for rid, n in wanted.items():
        got = results[rid]
        if got.error is not None or len(got.generated_tokens) != n:
            raise RuntimeError(
                f"HF continuous batching request {rid}: {len(got.generated_tokens)} of {n} "
                f"tokens, error {got.error!r}"
            )
    return elapsed


# ---- the weight-sync workload's trainer (runtime/bench/weight_sync.py) ----------------------


def scale_weights(model, factor: float) -> None:
    """Every parameter times `factor`, in place: a stand-in for a training step."""
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(factor)


def greedy_ids(model, prompt: list[int], n: int) -> list[int]:
    """`n` greedy token ids after `prompt` (EOS as the model's generation config says)."""
    ids = torch.tensor([prompt], device=model.device)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(prompt) :].tolist()


def save_checkpoint(model, path: str) -> None:
    """The trainer's model as a Hugging Face directory taipan's `update_weights(path=...)`
    reads: safetensors and config, plus the byte-level tokenizer every `random:` shape uses."""
    from taipan.ops.random_model import random_tokenizer

    model.save_pretrained(path)
    with open(f"{path}/tokenizer.json", "w") as f:
        f.write(random_tokenizer().to_wire()["tokenizer_json"])
