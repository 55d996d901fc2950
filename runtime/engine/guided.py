"""Guided (constrained) decoding with xgrammar: outputs that match a schema, regex or grammar.

Two halves, on two sides of the engine step:

- `GrammarCompiler` (the engine's, used where requests are made: a server CPU thread, never
  the engine step) turns a `GuidedSpec` into a compiled grammar. Its tokenizer info is built
  once per model from our tokenizer's vocabulary (the byte-level BPE of SmolLM2, Llama 3 and
  Qwen is detected from tokenizer.json), its stop tokens are the model's EOS tokens, and the
  added special tokens and the padding rows of the logits can never be generated under a
  grammar. xgrammar keeps a bounded cache of compiled grammars, so the same schema compiles
  once. A spec xgrammar refuses is an `InvalidRequestError` naming the request field.
- `GrammarMatchers` (the model runner's, on the engine thread) keeps a matcher per constrained
  request, in step with its output tokens: `sync` (in `prepare`, so a failure is the request's
  alone) makes it on the request's first sampling step and feeds it the tokens accepted since,
  so after a preemption, which frees it, it is rebuilt by replaying the output. `mask_logits`
  fills one bitmask row per constrained request of the step and sets the logits of the
  disallowed tokens to -inf before sampling; a step without constrained requests costs one
  dict check. A request whose grammar has ended (its stop token accepted) may only repeat a
  stop token (only reachable with ignore_eos).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kubeinfer.runtime.engine.guided_spec import GuidedSpec
from kubeinfer.runtime.engine.request import Request
from kubeinfer.runtime.errors import InvalidRequestError

if TYPE_CHECKING:
    import xgrammar as xgr

    from kubeinfer.runtime.tokenizer import Tokenizer

CACHE_LIMIT_BYTES = 256 << 20
"""Compiled grammars kept for reuse (xgrammar evicts the least recently used past this)."""
_XGR_PREFIX = re.compile(r"^\[[^\]]*\]\s+\S+:\d+:\s*")  # "[07:25:53] /project/cpp/x.cc:83: "


def _xgrammar():  # noqa: ANN202 - the module; imported on first use (0.6 s), not at startup
    import xgrammar

    return xgrammar


class GrammarCompiler:
    """Compiles specs for one model; thread-safe (xgrammar compiles in native threads)."""

    def __init__(
        self, tokenizer: Tokenizer | None, vocab_size: int, stop_token_ids: Iterable[int]
    ) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        """Rows of the logits (may exceed the tokenizer's vocabulary: padding)."""
        self.stop_token_ids = sorted(stop_token_ids)
        self._compiler: xgr.GrammarCompiler | None = None
        self._lock = threading.Lock()

    def compile(self, spec: GuidedSpec) -> xgr.CompiledGrammar:
        """The compiled grammar of `spec`; InvalidRequestError naming `spec.param` if invalid."""
        compiler = self._get_compiler(spec.param)
        try:
            if spec.kind == "json":
                json.loads(spec.value)  # xgrammar's own message for bad JSON is a C++ trace
                return compiler.compile_json_schema(
                    spec.value, any_whitespace=False, strict_mode=True
                )
            if spec.kind == "regex":
                return compiler.compile_regex(spec.value)
            if spec.kind == "structural_tag":
                return compiler.compile_structural_tag(spec.value)
            if spec.kind == "choice":
                # JSON string literals are valid EBNF string literals (escapes included)
                alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choices)
                return compiler.compile_grammar(f"root ::= {alternatives}")
            return compiler.compile_grammar(spec.value)
        except Exception as e:  # noqa: BLE001 - RuntimeError mostly: all the spec's fault
            raise InvalidRequestError(f"{spec.param}: {_message(e)}", spec.param) from None

    def _get_compiler(self, param: str) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                if self._tokenizer is None:
                    raise InvalidRequestError(
                        f"{param}: this model has no tokenizer, so no guided decoding", param
                    )
                xgr = _xgrammar()
                info = tokenizer_info(self._tokenizer, self.vocab_size, self.stop_token_ids)
                self._compiler = xgr.GrammarCompiler(
                    info, max_threads=2, cache_enabled=True, cache_limit_bytes=CACHE_LIMIT_BYTES
                )
            return self._compiler


def tokenizer_info(
    tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int]
) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary: each id's token text, and how text maps to bytes.

    Added special tokens (`<|im_start|>`, `<|eot_id|>`) get empty text, which xgrammar treats
    as never part of any output: otherwise a JSON string could contain `<|im_start|>` read as
    its characters. Ids past the tokenizer's vocabulary (padding rows) are empty too."""
    xgr = _xgrammar()
    hf = tokenizer.hf_tokenizer
    encoded = [""] * vocab_size
    for token, i in hf.get_vocab(with_added_tokens=True).items():
        if i < vocab_size:
            encoded[i] = token
    for i, added in hf.get_added_tokens_decoder().items():
        if added.special and i < vocab_size:
            encoded[i] = ""
    metadata = xgr.TokenizerInfo._detect_metadata_from_hf(hf.to_str())
    return xgr.TokenizerInfo(
        encoded,
        vocab_type=metadata["vocab_type"],
        vocab_size=vocab_size,
        stop_token_ids=list(stop_token_ids) or None,
        add_prefix_space=metadata["add_prefix_space"],
    )


def _message(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return _XGR_PREFIX.sub("", lines[0] if lines else "")[:300] or type(error).__name__


@dataclass(slots=True)
class _Matcher:
    matcher: xgr.GrammarMatcher
    num_accepted: int = 0
    """Output tokens fed to `matcher` so far."""


class GrammarMatchers:
    """The runner's matchers, keyed by request id, and the step's token bitmask."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._matchers: dict[str, _Matcher] = {}
        self._bitmask: torch.Tensor | None = None  # (rows, ceil(vocab / 32)) int32, grown

    @property
    def num_matchers(self) -> int:
        return len(self._matchers)

    def sync(self, request: Request) -> None:
        """Make or advance `request`'s matcher to its output tokens (before it samples)."""
        if request.grammar is None:
            return
        m = self._matchers.get(request.request_id)
        if m is None:
            m = self._matchers[request.request_id] = _Matcher(
                _xgrammar().GrammarMatcher(request.grammar)
            )
        output = request.output_token_ids
        for token in output[m.num_accepted :]:
            if m.matcher.is_terminated():
                break
            if not m.matcher.accept_token(token):
                raise InvalidRequestError(f"token {token} does not match the request's grammar")
        m.num_accepted = len(output)

    def release(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def mask_logits(self, logits: torch.Tensor, requests: Sequence[Request]) -> None:
        """Set -inf in each constrained row of `logits` (S, V) where its grammar forbids the
        token; rows of unconstrained requests are not touched."""
        if not self._matchers:
            return
        rows = [i for i, r in enumerate(requests) if r.grammar is not None]
        if not rows:
            return
        bitmask = self._bitmask_rows(len(requests))
        for i in rows:
            matcher = self._matchers[requests[i].request_id].matcher
            if matcher.is_terminated():
                _allow_only(bitmask[i], matcher.stop_token_ids)
            else:
                matcher.fill_next_token_bitmask(bitmask, i)
        _xgrammar().apply_token_bitmask_inplace(
            logits, bitmask.to(logits.device, non_blocking=True), indices=rows
        )

    def _bitmask_rows(self, num_rows: int) -> torch.Tensor:
        if self._bitmask is None or self._bitmask.shape[0] < num_rows:
            self._bitmask = _xgrammar().allocate_token_bitmask(max(num_rows, 16), self.vocab_size)
        return self._bitmask[:num_rows]


def _allow_only(row: torch.Tensor, token_ids: Iterable[int]) -> None:
    row.zero_()
    for t in token_ids:
        # int32 words: bit 31 set is a negative number, so build the word in Python first
        word = int(row[t // 32]) & 0xFFFFFFFF | (1 << (t % 32))
        row[t // 32] = word - (1 << 32) if word >= 1 << 31 else word
