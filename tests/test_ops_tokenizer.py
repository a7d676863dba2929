"""ops.tokenizer against Hugging Face transformers reading the same GGUF (the oracle).

transformers is imported only inside fixtures; the module under test must not import torch,
which a subprocess checks.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from taipan.models import resolve
from taipan.ops.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerError

# The default model as `make model` fetches it (runtime/models.py), wherever its cache is.
REPO = Path(__file__).resolve().parents[1]
MODEL_PATH = Path(resolve("smollm2")[1])
MODEL_DIR = MODEL_PATH.parent
GGUF_NAME = MODEL_PATH.name

TEXTS = [
    "Hello world",
    " leading space",
    "12345 + 678 = 99999",
    "x=3.14159e-10",
    "  multiple   spaces\n\n\ttabs",
    "héllo wörld — ünïcode",
    "日本語のテキスト",
    "emoji 😀🎉👍🏽 family 👨‍👩‍👧",
    "def f(x):\n    return x**2  # comment\n",
    "<|im_start|>user\nhi<|im_end|>\n",
    "text<|endoftext|>more",
    "<|im_start|><|im_end|>",
    "",
    " ",
    "\n",
    "I'm you're they'll WE'VE",
    "CamelCaseIdentifier_with_snake",
    "https://example.com/a?b=c&d=e",
    "Ωμέγα Привет مرحبا",
    "a\u00a0b\u200bc",
    "tab\tsep\tvals",
    "1,000,000.00 $ 2024-01-01",
    "<file_sep><filename>x.py",
    "   trailing   ",
    "\r\nwindows\r\n",
    "!!!???...",
    "ﬁ ligature ㎡",
    "<|im_start",
    "repeated aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "mixed 中文 and English 123abc",
    '{"json": [1, 2.5, null], "k": "v"}',
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
    ],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Translate 'chat' to 日本語 🐱"},
    ],
    [{"role": "user", "content": "  spaces \n and newlines\n\n"}],
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(MODEL_DIR / GGUF_NAME)


@pytest.fixture(scope="module")
def hf_tok(hf):
    """The session's transformers tokenizer on the same GGUF (tests/conftest.py `hf`)."""
    return hf[1]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_hf(tok, hf_tok, text):
    assert tok.encode(text) == hf_tok(text).input_ids


def test_special_tokens_are_single_ids(tok):
    assert tok.encode("<|im_start|>") == [1]
    assert tok.encode("a<|im_end|>b")[1] == 2
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2,)
    assert tok.vocab_size == 49152
    assert not tok.add_bos


_FRAGMENTS = st.sampled_from(["<|im_start|>", "<|im_end|>", "<|endoftext|>", " ", "\n", "12"])
_MIXED_TEXT = st.lists(st.one_of(st.text(max_size=12), _FRAGMENTS), max_size=6).map("".join)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(_MIXED_TEXT)
def test_encode_matches_hf_on_random_text(tok, hf_tok, text):
    assert tok.encode(text) == hf_tok(text).input_ids


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_chat_template_matches_hf(tok, hf_tok, conversation, add_generation_prompt):
    expected = hf_tok.apply_chat_template(
        conversation, add_generation_prompt=add_generation_prompt, tokenize=True
    )
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    ours = tok.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    assert ours == list(expected)


def test_chat_template_text(tok):
    text = tok.render_chat_template([{"role": "user", "content": "hi"}])
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_raise_exception_in_template_is_a_tokenizer_error(tok):
    wire = {**tok.to_wire(), "chat_template": "{{ raise_exception('no system role') }}"}
    strict = Tokenizer.from_wire(wire)
    with pytest.raises(TokenizerError, match="no system role"):
        strict.apply_chat_template([{"role": "system", "content": "x"}])


@pytest.mark.parametrize("text", TEXTS)
def test_decode_matches_hf_and_round_trips(tok, hf_tok, text):
    ids = hf_tok(text).input_ids
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == hf_tok.decode(
            ids, skip_special_tokens=skip
        )
    assert tok.decode(ids, skip_special_tokens=False) == text


@pytest.mark.parametrize(
    "text",
    ["emoji 😀🎉👍🏽 family 👨‍👩‍👧", "日本語のテキスト and 中文", "ünïcödé — “quotes” ∑∫√ ok"],
)
def test_incremental_detokenizer_equals_full_decode(tok, text):
    ids = tok.encode(text) + [2]  # eos at the end is skipped, as in streaming
    rng = random.Random(0)
    for chunking in ("one", "random"):
        detok = IncrementalDetokenizer(tok, prompt_ids=tok.encode("Say:"))
        deltas, i = [], 0
        while i < len(ids):
            n = 1 if chunking == "one" else rng.randint(1, 3)
            deltas.append(detok.feed(ids[i : i + n]))
            i += n
        deltas.append(detok.flush())
        assert "".join(deltas) == tok.decode(ids) == text
        assert detok.text == text
        assert all("\ufffd" not in d for d in deltas)


def test_incremental_detokenizer_holds_back_partial_utf8(tok):
    ids = tok.encode("😀")
    assert len(ids) > 1, "emoji expected to span several byte tokens"
    detok = IncrementalDetokenizer(tok)
    assert [detok.feed([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.feed(ids[-1:]) == "😀"


def test_incremental_detokenizer_flushes_a_truncated_character(tok):
    ids = tok.encode("a😀")[:-1]  # stream stopped mid-character
    detok = IncrementalDetokenizer(tok)
    streamed = "".join(detok.feed([i]) for i in ids) + detok.flush()
    assert streamed == tok.decode(ids)


def test_wire_round_trip(tok):
    wire = tok.to_wire()
    assert json.loads(json.dumps(wire)) == wire  # only plain values
    rebuilt = Tokenizer.from_wire(wire)
    for text in TEXTS:
        assert rebuilt.encode(text) == tok.encode(text)
    for conversation in CONVERSATIONS:
        assert rebuilt.apply_chat_template(conversation) == tok.apply_chat_template(conversation)
    assert (rebuilt.bos_token_id, rebuilt.eos_token_ids) == (tok.bos_token_id, tok.eos_token_ids)
    assert rebuilt.vocab_size == tok.vocab_size


def test_from_hf_dir_matches_gguf_and_hf(tok, tmp_path):
    tok.save_json(tmp_path / "tokenizer.json")
    config = {
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "chat_template": tok.chat_template,
        "add_bos_token": False,
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    from_dir = Tokenizer.from_hf_dir(tmp_path)
    assert (from_dir.bos_token_id, from_dir.eos_token_ids) == (1, (2,))
    for text in TEXTS:
        assert from_dir.encode(text) == tok.encode(text)
    for conversation in CONVERSATIONS:
        assert from_dir.apply_chat_template(conversation) == tok.apply_chat_template(conversation)


def test_from_hf_dir_adds_bos_when_asked(tok, tmp_path):
    tok.save_json(tmp_path / "tokenizer.json")
    config = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    from_dir = Tokenizer.from_hf_dir(tmp_path)
    assert from_dir.add_bos and from_dir.encode("hi") == [1, *tok.encode("hi")]
    assert from_dir.eos_token_ids == (2, 0)
    with pytest.raises(TokenizerError, match="no chat template"):
        from_dir.apply_chat_template([{"role": "user", "content": "x"}])


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


def test_tokenizer_module_does_not_import_torch(tok):
    wire = json.dumps(tok.to_wire())
    code = (
        "import json, sys\n"
        "from ops.tokenizer import IncrementalDetokenizer, Tokenizer\n"
        "tok = Tokenizer.from_wire(json.loads(sys.stdin.read()))\n"
        "ids = tok.apply_chat_template([{'role': 'user', 'content': 'hi'}])\n"
        "IncrementalDetokenizer(tok).feed(ids)\n"
        "assert 'torch' not in sys.modules, 'ops.tokenizer imported torch'\n"
        "assert 'transformers' not in sys.modules\n"
        "print(len(ids))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        input=wire,
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) == len(tok.apply_chat_template([{"role": "user", "content": "hi"}]))
