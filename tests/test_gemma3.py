"""Gemma 3 beyond what it shares with the dense families (tests/test_ops_dense.py and
tests/test_e2e_dense.py run it as one of theirs: logits, chunked prefill, prefix caching, KV
pressure, weight updates, TP = 2), on tiny random models checked against transformers (fp32,
CPU):

- config.json as transformers reads it: the older keys (`sliding_window_pattern`, `rope_theta`
  with `rope_scaling`, `rope_local_base_freq`), and every setting we refuse, by its message;
- an update of every weight by Hugging Face name (as a trainer's buckets and IPC records name
  them, each either mapped by `state_updates` or written straight where `direct_view` allows)
  gives the model loaded from those weights: Gemma's (1 + w) norms take w unchanged;
- a GGUF written as llama.cpp's converter writes one (norm weights plus one, Q8_0 matrices, a
  sentencepiece vocabulary without merges, Gemma 3's chat template) loads as transformers loads
  it: logits, the tokenizer's ids and text, the rendered chat prompt;
- served end to end with a window shorter than the prompts.
GPU (marker `gpu`): head_dim 256 under CUDA graphs against transformers, fp32 and bf16.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from taipan.ops.loader import ModelLoadError, load_model
from taipan.ops.weight_transfer import TensorSpec
from taipan.ops.weight_updates import direct_view, state_updates
from taipan.rl import named_tensors
from tests.random_dense import STD, make_random_gemma3
from tests.test_e2e_dense import (
    CACHED,
    GREEDY,
    PROMPTS,
    SHARED,
    assert_equals_hf,
    engine_config,
    serve_and_check,
)
from tests.test_ops_dense import ours_and_hf_logits

transformers = pytest.importorskip("transformers")
ATOL = 1e-4
# Gemma 3's chat template (google/gemma-3-*-it's tokenizer_config.json).
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}\n{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n"
    "    {%- endif -%}\n    {%- set loop_messages = messages[1:] -%}\n{%- else -%}\n"
    '    {%- set first_user_prefix = "" -%}\n    {%- set loop_messages = messages -%}\n'
    "{%- endif -%}\n{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    '        {{ raise_exception("Conversation roles must alternate '
    'user/assistant/user/assistant/...") }}\n'
    "    {%- endif -%}\n    {%- if (message['role'] == 'assistant') -%}\n"
    '        {%- set role = "model" -%}\n    {%- else -%}\n'
    "        {%- set role = message['role'] -%}\n    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n            {%- endif -%}\n"
    "        {%- endfor -%}\n    {%- else -%}\n"
    '        {{ raise_exception("Invalid content type") }}\n    {%- endif -%}\n'
    "    {{ '<end_of_turn>\n' }}\n{%- endfor -%}\n{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\n'}}\n{%- endif -%}\n"
)
# The GPU test's model: a seed whose greedy steps (on the CPU) all lead by > 1e-3.
GPU_SEED = 0


def hf_model(path: str, device: str = "cpu", **kw):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw)
    return model.to(device).eval()


def _rewrite_config(path: str, drop: tuple[str, ...] = (), **fields) -> None:
    file = os.path.join(path, "config.json")
    hf = json.load(open(file)) | fields
    for key in drop:
        hf.pop(key, None)
    with open(file, "w") as f:
        json.dump(hf, f)


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory) -> str:
    return make_random_gemma3(str(tmp_path_factory.mktemp("gemma3")))


# ---- config.json ------------------------------------------------------------------------------


def test_older_config_keys_read_as_transformers_reads_them(tmp_path):
    """No layer_types: every `sliding_window_pattern`-th layer is global; no rope_parameters:
    rope_theta (with rope_scaling, the global layers') and rope_local_base_freq."""
    types = ["sliding_attention"] * 2 + ["full_attention"]
    path = make_random_gemma3(str(tmp_path / "old"), num_hidden_layers=3, layer_types=types)
    _rewrite_config(
        path,
        drop=("layer_types", "rope_parameters"),
        sliding_window_pattern=3,
        rope_theta=30000.0,
        rope_local_base_freq=5000.0,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    )
    model, config, _ = load_model(path)
    assert config.sliding_layers == (0, 1)
    assert (config.rope_theta, config.rope_local_theta, config.rope_scaling_factor) == (
        30000.0,
        5000.0,
        2.0,
    )
    hf = hf_model(path)
    assert hf.config.layer_types == ["sliding_attention", "sliding_attention", "full_attention"]
    for got, want in ours_and_hf_logits(model, config, hf):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


REFUSED = {
    "final-softcap": (dict(final_logit_softcapping=30.0), "final_logit_softcapping=30.0 is not"),
    "attn-softcap": (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping=50.0 is not"),
    "bidirectional": (dict(use_bidirectional_attention=True), "use_bidirectional_attention=True"),
    "activation": (dict(hidden_activation="gelu"), "hidden_activation 'gelu' is not supported"),
    "yarn": (
        dict(rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 4.0}}),
        "RoPE type 'yarn' of the global layers is not supported for Gemma 3",
    ),
    "local-linear": (
        dict(rope_parameters={"sliding_attention": {"rope_type": "linear", "factor": 2.0}}),
        "RoPE type 'linear' of the local layers is not supported",
    ),
    "layer-types": (dict(layer_types=["sliding_attention"]), "must name each of the 2 layers"),
    "vision": (
        dict(architectures=["Gemma3ForConditionalGeneration"], model_type="gemma3"),
        "Gemma3ForConditionalGeneration without a text_config",  # (its text model is served)
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unsupported_settings_are_refused(tmp_path, gemma_dir, case):
    import shutil

    path = shutil.copytree(gemma_dir, tmp_path / case)
    fields, message = REFUSED[case]
    _rewrite_config(str(path), **fields)
    with pytest.raises(ModelLoadError, match=message):
        load_model(path)


# ---- weight updates by Hugging Face name ------------------------------------------------------


def test_an_update_of_every_hf_tensor_gives_the_model_of_those_weights(tmp_path, gemma_dir):
    """Every tensor of a perturbed transformers model, by the names a trainer sends: a norm
    lands straight in its parameter (direct_view, as a large broadcast tensor would), the rest
    through state_updates (fused rows); the result equals the model loaded from the same
    weights saved to disk, bit for bit, and its logits equal transformers'."""
    hf = hf_model(gemma_dir)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(tmp_path / "after")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "after" / name).write_bytes(open(os.path.join(gemma_dir, name), "rb").read())
    expected, _, _ = load_model(tmp_path / "after")

    model, config, _ = load_model(gemma_dir)
    params = model.state_dict()
    straight = []
    with torch.no_grad():
        for name, tensor in named_tensors(hf):
            view = direct_view(TensorSpec.of(name, tensor), params, config)
            if view is not None:
                view.copy_(tensor)
                straight.append(name)
                continue
            for ours, rows, values in state_updates({name: tensor}, model, params):
                params[ours][rows].copy_(values)
    assert "model.layers.1.post_feedforward_layernorm.weight" in straight
    assert "model.layers.0.self_attn.q_norm.weight" in straight
    for name, t in expected.state_dict().items():
        assert torch.equal(params[name], t), name
    for got, want in ours_and_hf_logits(model, config, hf):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


# ---- GGUF -------------------------------------------------------------------------------------

# llama.cpp's token types
_NORMAL, _CONTROL, _USER_DEFINED, _BYTE = 1, 3, 4, 6
# A small sentencepiece vocabulary in Gemma's spelling: specials, the turn markers, user-defined
# newlines and blanks (stored as real spaces), the 256 byte-fallback tokens, then pieces.
_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
_PIECES = (
    ["\u2581", *"abcdefghijklmnopqrstuvwxyzTHW.,!?'"]
    + ["th", "he", "\u2581t", "\u2581th", "\u2581the", "in", "\u2581in", "er", "\u2581a"]
    + ["an", "\u2581an", "\u2581and", "lo", "llo", "\u2581he", "\u2581hello", "or", "\u2581w"]
)


def _vocabulary() -> tuple[list[str], list[int]]:
    tokens = _SPECIALS + ["\n", "\n\n", "  ", "   "] + [f"<0x{b:02X}>" for b in range(256)]
    types = [_CONTROL] * len(_SPECIALS) + [_USER_DEFINED] * 4 + [_BYTE] * 256
    return tokens + _PIECES, types + [_NORMAL] * len(_PIECES)


# Our parameter (Hugging Face's without `model.`) -> GGUF name, for the tiny model's tensors.
def _gguf_name(hf_name: str) -> str:
    from taipan.ops.gguf_file import _GEMMA3_NAMES

    ours = hf_name.removeprefix("model.")
    for gguf_name, name in _GEMMA3_NAMES.items():
        for n in range(8):
            if name.format(n=n) == ours:
                return gguf_name.format(n=n)
    raise KeyError(hf_name)


def write_gemma3_gguf(hf, path: str, tokens: list[str], types: list[int], window: int) -> str:
    """`hf`'s weights and config as llama.cpp's convert_hf_to_gguf.py writes a Gemma 3: norm
    weights plus one (F32), matrices in Q8_0, the vocabulary with scores but no merges."""
    import gguf

    c = hf.config
    w = gguf.GGUFWriter(path, "gemma3")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["full_attention"]["rope_theta"])
    w.add_sliding_window(window)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores([-1000.0 if t != _NORMAL else -float(i) for i, t in enumerate(types)])
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)
    w.add_chat_template(GEMMA3_CHAT_TEMPLATE)
    for name, tensor in hf.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied
        array = tensor.float().numpy()
        if name.endswith("norm.weight"):
            w.add_tensor(_gguf_name(name), array + 1.0)
        else:
            q8 = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(_gguf_name(name), q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> str:
    """Six layers (llama.cpp's pattern: five local, one global), head_dim 256 (transformers
    reads every Gemma 3 GGUF with query_pre_attn_scalar 256), a window of 8."""
    tokens, types = _vocabulary()
    torch.manual_seed(3)
    config = transformers.Gemma3TextConfig(
        vocab_size=len(tokens),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=6,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=256,
        max_position_embeddings=512,
        sliding_window=8,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 50000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
    )
    hf = transformers.Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, STD if p.dim() == 2 else 0.2)
    folder = tmp_path_factory.mktemp("gguf")
    return write_gemma3_gguf(hf, str(folder / "tiny-gemma3.gguf"), tokens, types, window=8)


def _hf_from_gguf(path: str):
    folder, name = os.path.split(path)
    return hf_model(folder, gguf_file=name)


def test_a_gguf_loads_as_transformers_loads_it(tiny_gguf):
    """Norms less the one llama.cpp added, Q/K rows as they are (no un-permute), llama.cpp's
    layer pattern and local RoPE base; <end_of_turn> ends generation as in llama.cpp."""
    model, config, tokenizer = load_model(tiny_gguf)
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert config.sliding_layers == (0, 1, 2, 3, 4) and config.sliding_window == 8
    assert (config.rope_theta, config.rope_local_theta, config.query_pre_attn_scalar) == (
        50000.0,
        10000.0,
        256.0,
    )
    assert config.eos_token_ids == (1, tokenizer.token_to_id("<end_of_turn>"))
    for got, want in ours_and_hf_logits(model, config, _hf_from_gguf(tiny_gguf)):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_the_gguf_tokenizer_and_chat_template_equal_transformers(tiny_gguf):
    """Merges rebuilt in vocabulary order, byte fallback, blanks and newlines as Gemma spells
    them, control tokens special; the chat template from the file rendered as transformers
    renders it."""
    _, _, ours = load_model(tiny_gguf)
    folder, name = os.path.split(tiny_gguf)
    hf = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    texts = [
        "hello the world, and the thing!",
        " the  an   in\n\nthe\tother Ünïcödé 😀",
        "<start_of_turn>user\nhi<end_of_turn>\n<mask><unk>",
        "",
    ]
    for text in texts:
        ids = hf(text).input_ids
        assert ours.encode(text) == ids, text
        assert ours.encode(text, add_special_tokens=False) == ids[1:], text
        for skip in (True, False):
            assert ours.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip), text
    chats = [
        [{"role": "user", "content": " Hello there \n"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": [{"type": "text", "text": "And?"}]},
        ],
    ]
    for chat in chats:
        text = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert ours.render_chat_template(chat) == text
        assert ours.apply_chat_template(chat) == hf(text, add_special_tokens=False).input_ids


# ---- served ---------------------------------------------------------------------------------


def test_a_window_shorter_than_the_prompts_served_equal_hf(tmp_path):
    """The local layer's window of 24 keys binds on every longer prompt (chunks of 32, cached
    prefixes, decode rows), the global layer sees everything; updates of Gemma's norms. The
    local layer's keys live in a pool of their own (rings of 5 blocks, the cached prompt's
    window saved and copied back at the hit); pauses and evictions with that pool are
    tests/test_local_kv.py's (this scenario's budget runs one ring at a time, so none here)."""
    path = make_random_gemma3(str(tmp_path / "windowed"), sliding_window=24)
    serve_and_check(path, "gemma3", blocks=8, pressure=False)


@pytest.mark.gpu
def test_gpu_head_dim_256_with_cuda_graphs_equals_hf(tmp_path):
    """head_dim 256 (the released models'), a local layer with a window of 24 (shorter than
    most prompts): under CUDA graphs, fp32 with TF32 off, greedy tokens and log-probs as
    transformers' on the same GPU (chunked prefill, prefix caching, a small pool); in bf16, the
    prompt log-probs err from transformers' fp32 no more than its own bf16 does (plus slack)."""
    from taipan import LLM, SamplingParams

    torch.backends.cuda.matmul.allow_tf32 = False
    path = make_random_gemma3(str(tmp_path / "g"), seed=GPU_SEED, head_dim=256, sliding_window=24)
    hf = hf_model(path, "cuda")
    with LLM(path, device="cuda", **engine_config(path)) as llm:
        done = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        first = llm.generate([SHARED], CACHED, use_tqdm=False)
        again = llm.generate([SHARED], CACHED, use_tqdm=False)
        stats = llm.stats().merged()
    assert stats.steps_graphed > 0  # decode steps ran as CUDA graphs
    assert again[0].num_cached_tokens >= 64
    assert_equals_hf(done + first + again, hf, atol=1e-3)

    one = SamplingParams(max_tokens=1, temperature=0.0, return_log_probs=True)
    with LLM(path, device="cuda", dtype="bfloat16", **engine_config(path)) as llm:
        done = llm.generate(PROMPTS, one, use_tqdm=False)
    hf16 = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    hf16 = hf16.cuda().eval()
    for d in done:
        ids = torch.tensor([d.prompt_token_ids], device="cuda")
        with torch.no_grad():
            ref, half = (_prompt_log_probs(m, ids) for m in (hf, hf16))
        ours = np.asarray(d.prompt_log_probs)
        ours_err, hf_err = np.abs(ours - ref).max(), np.abs(half - ref).max()
        assert ours_err <= 2 * hf_err + 0.05, (ours_err, hf_err)


def _prompt_log_probs(model, ids: torch.Tensor) -> np.ndarray:
    logits = model(ids).logits[0].float()
    lp = torch.log_softmax(logits, -1)[:-1].gather(1, ids[0, 1:, None])
    return lp[:, 0].cpu().numpy()
