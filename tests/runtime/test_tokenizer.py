"""Tokenizer, chat template and incremental detokenizer against transformers on SmolLM2."""

from __future__ import annotations

from pathlib import Path

import pytest

from kubeinfer.runtime.errors import ModelLoadError
from kubeinfer.runtime.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer

TEXTS = [
    "What is the capital of France?",
    "  leading spaces and\ttabs\nnew lines",
    "naïve café — déjà vu, Straße, Ærøskøbing",
    "日本語のテキストと中文文本",
    "emoji 🚀🔥👩‍👩‍👧 and flags 🇫🇷",
    "<|im_start|>user\nspecial tokens inside<|im_end|>",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "2+2?"},
    ],
]


@pytest.fixture(scope="module")
def ours(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(smollm2_dir)


@pytest.fixture(scope="module")
def hf(smollm2_dir: Path):  # noqa: ANN201
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(ours: Tokenizer, hf, text: str) -> None:  # noqa: ANN001
    ids = ours.encode(text)
    assert ids == hf.encode(text)
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    ours: Tokenizer,
    hf,
    messages: list,
    add_generation_prompt: bool,  # noqa: ANN001
) -> None:
    text = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    expected = hf.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert text == expected
    assert ours.encode_chat(messages, add_generation_prompt=add_generation_prompt) == hf.encode(
        expected, add_special_tokens=False
    )


def test_eos_and_special_tokens(ours: Tokenizer) -> None:
    assert ours.eos_token_ids == {2}
    assert ours.special_tokens["eos_token"] == "<|im_end|>"


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenizer_streams_the_decoded_text(ours: Tokenizer, text: str) -> None:
    prompt = ours.encode("Say:")
    ids = ours.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(ours, prompt)
    deltas = [detok.push([t]) for t in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == ours.decode(ids)
    assert all("\ufffd" not in d for d in deltas)


def test_multibyte_character_split_across_tokens_comes_out_whole(ours: Tokenizer) -> None:
    ids = ours.encode("🚀", add_special_tokens=False)
    assert len(ids) > 1, "the emoji must span several byte-level tokens for this test"
    detok = IncrementalDetokenizer(ours)
    deltas = [detok.push([t]) for t in ids]
    assert deltas[:-1] == [""] * (len(ids) - 1)
    assert deltas[-1] == "🚀"


def test_missing_tokenizer_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_model_without_chat_template(tmp_path: Path, smollm2_dir: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((smollm2_dir / "tokenizer.json").read_bytes())
    tok = Tokenizer.from_dir(tmp_path)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_raise_exception_is_a_clear_error(tmp_path: Path, smollm2_dir: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((smollm2_dir / "tokenizer.json").read_bytes())
    (tmp_path / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] != 'user' %}"
        "{{ raise_exception('first must be user') }}{% endif %}"
    )
    tok = Tokenizer.from_dir(tmp_path)
    with pytest.raises(ChatTemplateError, match="first must be user"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])
