"""Llama-family decoder models built from an HF `config.json`."""

from kubeinfer.runtime.models.attention import AttentionBackend, CausalAttention
from kubeinfer.runtime.models.config import ARCHITECTURES, ModelConfig
from kubeinfer.runtime.models.llama import CheckpointTarget, LlamaForCausalLM
from kubeinfer.runtime.models.parallel import SINGLE, TPGroup

__all__ = [
    "ARCHITECTURES",
    "AttentionBackend",
    "CausalAttention",
    "CheckpointTarget",
    "LlamaForCausalLM",
    "ModelConfig",
    "build_model",
]


def build_model(
    config: ModelConfig, max_positions: int | None = None, tp: TPGroup = SINGLE
) -> LlamaForCausalLM:
    """The model for `config` (every supported architecture is the one Llama-family class);
    with `tp`, that rank's shard of it."""
    return LlamaForCausalLM(config, max_positions, tp)
