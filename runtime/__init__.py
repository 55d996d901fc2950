"""The kubeinfer runtime: models, loader, tokenizer, engine, and the OpenAI-compatible server.

`from kubeinfer.runtime import LLM, SamplingParams` is the offline API (imported lazily, so
that light modules such as `kubeinfer.runtime.errors` do not pull in torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kubeinfer.runtime.engine.llm import LLM
    from kubeinfer.runtime.engine.outputs import CompletionOutput, RequestOutput
    from kubeinfer.runtime.engine.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]

_WHERE = {
    "LLM": "kubeinfer.runtime.engine.llm",
    "SamplingParams": "kubeinfer.runtime.engine.sampling_params",
    "RequestOutput": "kubeinfer.runtime.engine.outputs",
    "CompletionOutput": "kubeinfer.runtime.engine.outputs",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'kubeinfer.runtime' has no attribute {name!r}")
