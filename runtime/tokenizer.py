"""Tokenizer, chat template and incremental detokenizer for an HF model folder.

`tokenizers` reads `tokenizer.json`; special tokens and the chat template come from
`tokenizer_config.json` (or `chat_template.jinja`) and are rendered with jinja2 the way
transformers does (sandboxed, trim_blocks, lstrip_blocks). The engine never sees text: it gets
token ids from here, and its outputs go back through an `IncrementalDetokenizer`.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from kubeinfer.runtime.errors import ModelLoadError

# Decode a few tokens before the new ones so that merges (leading spaces, byte pieces) resolve.
_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class ChatTemplateError(ValueError):
    """The chat template could not be rendered for these messages."""


class Tokenizer:
    def __init__(
        self,
        tokenizer: HFTokenizer,
        special_tokens: dict[str, str],
        chat_template: str | None,
        eos_token_ids: Iterable[int],
    ) -> None:
        self._tok = tokenizer
        self.special_tokens = special_tokens
        self.chat_template = chat_template
        self.eos_token_ids = frozenset(eos_token_ids)
        self._template: jinja2.Template | None = None
        self._token_texts: dict[int, str] = {}  # at most the vocabulary

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{path}: no tokenizer.json in the model folder")
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on bad files
            raise ModelLoadError(f"{path}: not a valid tokenizer ({e})") from None
        config = _read_json(model_dir / "tokenizer_config.json")
        special = {
            key: _token_text(config[key])
            for key in ("bos_token", "eos_token", "unk_token", "pad_token")
            if config.get(key)
        }
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        jinja_file = model_dir / "chat_template.jinja"
        if jinja_file.is_file():
            template = jinja_file.read_text()
        eos_ids = set(_ids(_read_json(model_dir / "generation_config.json").get("eos_token_id")))
        eos_ids |= set(_ids(_read_json(model_dir / "config.json").get("eos_token_id")))
        if "eos_token" in special and (eos := tok.token_to_id(special["eos_token"])) is not None:
            eos_ids.add(eos)
        return cls(tok, special, template, eos_ids)

    @property
    def hf_tokenizer(self) -> HFTokenizer:
        """The `tokenizers` object (its vocabulary, for guided decoding's token table)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while it runs (encode holds it throughout: half a
        # second for a long body, during which the server's event loop could not answer)
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token decoded alone, special tokens included (how logprobs name tokens, as
        vLLM's do); a byte piece of a longer character comes out as U+FFFD."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._tok.decode([token_id], skip_special_tokens=False)
            self._token_texts[token_id] = text
        return text

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        """The prompt text for `messages` (encode it with `add_special_tokens=False`)."""
        if self.chat_template is None:
            raise ChatTemplateError("this model has no chat template; use completions instead")
        if self._template is None:
            self._template = _environment().from_string(self.chat_template)
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
                **extra,
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from None

    def encode_chat(self, messages: list[dict[str, Any]], **extra: Any) -> list[int]:
        return self.encode(self.apply_chat_template(messages, **extra), add_special_tokens=False)


class IncrementalDetokenizer:
    """Text deltas for tokens arriving one at a time; their concatenation is the decoded text.

    A character whose bytes span several tokens comes out whole, once its last token arrives:
    while the decoded tail ends in U+FFFD (an incomplete UTF-8 sequence) nothing is emitted.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self.token_ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self.token_ids)

    def push(self, token_ids: Sequence[int]) -> str:
        """Add new tokens; return the text that became final."""
        self.token_ids.extend(token_ids)
        decode = self._tokenizer.decode
        prefix = decode(self.token_ids[self._prefix_offset : self._read_offset], self._skip)
        text = decode(self.token_ids[self._prefix_offset :], self._skip)
        if len(text) <= len(prefix) or text.endswith(_REPLACEMENT):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        self._trim()
        return text[len(prefix) :]

    def flush(self) -> str:
        """At the end of a sequence: whatever is still held back (even an incomplete character)."""
        decode = self._tokenizer.decode
        prefix = decode(self.token_ids[self._prefix_offset : self._read_offset], self._skip)
        text = decode(self.token_ids[self._prefix_offset :], self._skip)
        self._prefix_offset = self._read_offset = len(self.token_ids)
        return text[len(prefix) :] if len(text) > len(prefix) else ""

    def _trim(self) -> None:
        # Keep only what later decodes need: memory stays O(1) over long generations.
        if self._prefix_offset > _CONTEXT_TOKENS:
            cut = self._prefix_offset
            del self.token_ids[:cut]
            self._prefix_offset -= cut
            self._read_offset -= cut


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, **_: Any) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent)

    def strftime_now(fmt: str) -> str:
        return dt.datetime.now().strftime(fmt)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: must be a JSON object")
    return data


def _token_text(value: Any) -> str:
    return value.get("content", "") if isinstance(value, dict) else str(value)


def _ids(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []
