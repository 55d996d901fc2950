"""Tiny random-weight models saved by transformers' own classes (`save_pretrained`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

TINY = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    eos_token_id=2,
    bos_token_id=1,
)

# name -> (transformers config class name, overrides)
TINY_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-gqa": ("LlamaConfig", {"tie_word_embeddings": False}),
    "llama-tied": ("LlamaConfig", {"tie_word_embeddings": True, "num_key_value_heads": 4}),
    "llama3-rope": (
        "LlamaConfig",
        {
            "num_key_value_heads": 1,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            "rope_theta": 500000.0,
        },
    ),
    "llama-linear-rope": (
        "LlamaConfig",
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "attention_bias": True},
    ),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": False}),
    "qwen3": ("Qwen3Config", {"head_dim": 32, "tie_word_embeddings": True}),
    "mistral": ("MistralConfig", {"sliding_window": 24, "head_dim": 16}),
}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Replace transformers' init (zero biases, unit norms) so every tensor matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g) * 0.08
            p.copy_(1 + noise if "norm" in name else noise)


def make_tiny_model(root: Path, name: str, seed: int = 0) -> Path:
    import transformers

    cls_name, overrides = TINY_MODELS[name]
    config = getattr(transformers, cls_name)(**{**TINY, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    out = root / name
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {name: make_tiny_model(root, name, seed=i) for i, name in enumerate(TINY_MODELS)}
