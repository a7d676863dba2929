"""The torch side of `taipan bench` (runtime/bench.py): Hugging Face transformers' `generate`
on the same token ids, and the measured hardware limit. Test/bench code, never the serving path.
"""

from __future__ import annotations

import os
import time

import torch


def hf_generate(
    args, model_path: str, prompt_ids: list[list[int]]
) -> tuple[float, list[list[int]]]:
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise RuntimeError("the HF side needs transformers: pip install -e '.[dev]'") from None
    dtype = getattr(torch, args.dtype)
    if model_path.endswith(".gguf"):
        d, f = os.path.split(model_path)
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    model = model.to(args.device).eval()
    width = max(len(p) for p in prompt_ids)
    # One static batch: every prompt is left-padded to the longest one and masked out with the
    # attention mask (HF derives position ids from the mask, so positions match ours).
    pad = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompt_ids], device=args.device)
    mask = torch.tensor(
        [[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids], device=args.device
    )
    # EOS as ours treats it (SamplingParams(ignore_eos=True)): never a stop, never masked, so an
    # EOS argmax is emitted and decoding goes on. `min_new_tokens` would mask the EOS logit
    # (MinNewTokensLengthLogitsProcessor) and pick another token. `generate` fills unset options
    # from `model.generation_config` (the checkpoint's eos_token_id lives there); with
    # eos_token_id None, transformers 5.23's `_get_stopping_criteria` adds no EosTokenCriteria,
    # `_get_logits_processor` no MinLength/MinNewTokens processor, and `_sample` never swaps in
    # pad for finished rows: the one stop left is MaxLengthCriteria at width + output_len.
    gen = model.generation_config
    gen.eos_token_id = gen.forced_eos_token_id = None
    gen.min_length = gen.min_new_tokens = None
    kw = dict(max_new_tokens=args.output_len, do_sample=False, pad_token_id=pad)
    with torch.inference_mode():
        model.generate(input_ids=ids[:2], attention_mask=mask[:2], **dict(kw, max_new_tokens=2))
        start = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, **kw)
        elapsed = time.perf_counter() - start
    if out.shape != (len(prompt_ids), width + args.output_len):
        raise RuntimeError(
            f"HF returned {tuple(out.shape)}, not {len(prompt_ids)} x {width}+{args.output_len}"
        )
    return elapsed, out[:, width:].tolist()


def hardware_limit(args, model_path: str, batch: int) -> dict:
    """Measured peak matmul rate and copy bandwidth, and the decode floor they imply."""
    from taipan.ops.loader import load_model

    dtype = getattr(torch, args.dtype)
    model, _, _ = load_model(model_path, dtype=dtype, device=args.device)
    params = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    n = 2048
    a = torch.randn(n, n, dtype=dtype, device=args.device)
    b = torch.randn(n, n, dtype=dtype, device=args.device)
    src = torch.randn(64 * 1024 * 1024 // 4, dtype=torch.float32, device=args.device)
    dst = torch.empty_like(src)  # preallocated: time the copy, not page faults

    def best(fn, reps=5):
        times = []
        for _ in range(reps):
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        return min(times)

    flops = 2 * n**3 / best(lambda: a @ b)
    bandwidth = 2 * src.numel() * 4 / best(lambda: dst.copy_(src))
    # One decode step of `batch` sequences: 2*params FLOPs per token, the weights read once.
    step = max(2 * params * batch / flops, weight_bytes / bandwidth)
    out = {
        "hw_matmul_gflop_s": flops / 1e9,
        "hw_copy_gb_s": bandwidth / 1e9,
        "hw_limit_output_tok_s": batch / step,
        "params": params,
    }
    if args.device.startswith("cuda"):
        out["gpu"] = torch.cuda.get_device_name(torch.device(args.device))
    return out
