"""Llama-family decoder models built from an HF `config.json`."""

from kubeinfer.runtime.models.attention import AttentionBackend, CausalAttention
from kubeinfer.runtime.models.config import ARCHITECTURES, ModelConfig
from kubeinfer.runtime.models.llama import CheckpointTarget, LlamaForCausalLM

__all__ = [
    "ARCHITECTURES",
    "AttentionBackend",
    "CausalAttention",
    "CheckpointTarget",
    "LlamaForCausalLM",
    "ModelConfig",
    "build_model",
]


def build_model(config: ModelConfig, max_positions: int | None = None) -> LlamaForCausalLM:
    """The model for `config` (every supported architecture is the one Llama-family class)."""
    return LlamaForCausalLM(config, max_positions)
