"""LLM: the offline API (contract) — `LLM(model_dir, ...).generate(prompts, params)`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kubeinfer.runtime.engine.config import EngineConfig
from kubeinfer.runtime.engine.engine import Engine
from kubeinfer.runtime.engine.outputs import RequestOutput
from kubeinfer.runtime.engine.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """`LLM(model_dir, dtype=..., device=..., **engine_args)`; engine_args are EngineConfig's
    fields (`num_kv_blocks`, `block_size`, `max_num_seqs`, `max_num_batched_tokens`,
    `enable_prefix_caching`, `tensor_parallel_size`, ...). With tensor_parallel_size > 1,
    `close()` (or a `with` block) stops the worker processes."""

    def __init__(
        self,
        model_dir: str | Path,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device = "cpu",
        **engine_args: Any,
    ) -> None:
        self.engine = Engine(model_dir, EngineConfig(**engine_args), dtype=dtype, device=device)

    def close(self) -> None:
        """Stop the tensor-parallel worker processes (with one rank there are none)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def tokenizer(self):  # noqa: ANN201
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; results in input order, each with
        `SamplingParams.n` outputs."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(
                    f"{len(params)} sampling params for {len(prompts)} prompts: "
                    "give one, or one per prompt"
                )
        groups: list[list[str]] = []  # per prompt: its sequences' request ids
        try:
            for prompt, p in zip(prompts, params, strict=True):
                group: list[str] = []
                groups.append(group)
                for request in self.engine.make_requests(prompt, p):
                    group.append(self.engine.add(request))
        except ValueError:
            for request_id in (i for group in groups for i in group):
                self.engine.abort(request_id)
            raise
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished:
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [_merged([done[i] for i in group]) for group in groups]


def _merged(outs: list[RequestOutput]) -> RequestOutput:
    """One prompt's n sequences as one RequestOutput (`outputs` in index order)."""
    if len(outs) == 1:
        return outs[0]
    first = outs[0]
    return dataclasses.replace(
        first,
        request_id=first.request_id.split("_", 1)[1],
        outputs=[o.outputs[0] for o in outs],
    )
