"""Random-weight checkpoints in HF layout, for tests and benchmarks (nothing is downloaded).

`write_random_checkpoint` saves a config and safetensors shards (with an index when sharded)
directly with the safetensors library, so it needs neither transformers nor the model class.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file


def llama_config(**overrides: Any) -> dict[str, Any]:
    """A small Llama config.json as a dict."""
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "dtype": "float32",
    }
    config.update(overrides)
    return config


def checkpoint_tensors(config: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-named random tensors for a Llama config (norm weights near 1, the rest small)."""
    g = torch.Generator().manual_seed(seed)
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    nh, nkv = (
        config["num_attention_heads"],
        config.get("num_key_value_heads", config["num_attention_heads"]),
    )
    d = config.get("head_dim") or h // nh

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.05

    tensors = {"model.embed_tokens.weight": rand(v, h)}
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}"
        tensors[f"{p}.input_layernorm.weight"] = 1 + rand(h)
        tensors[f"{p}.post_attention_layernorm.weight"] = 1 + rand(h)
        tensors[f"{p}.self_attn.q_proj.weight"] = rand(nh * d, h)
        tensors[f"{p}.self_attn.k_proj.weight"] = rand(nkv * d, h)
        tensors[f"{p}.self_attn.v_proj.weight"] = rand(nkv * d, h)
        tensors[f"{p}.self_attn.o_proj.weight"] = rand(h, nh * d)
        tensors[f"{p}.mlp.gate_proj.weight"] = rand(i, h)
        tensors[f"{p}.mlp.up_proj.weight"] = rand(i, h)
        tensors[f"{p}.mlp.down_proj.weight"] = rand(h, i)
    tensors["model.norm.weight"] = 1 + rand(h)
    if not config.get("tie_word_embeddings"):
        tensors["lm_head.weight"] = rand(v, h)
    return tensors


def write_checkpoint(
    model_dir: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor], num_shards: int = 1
) -> Path:
    """Save `config.json` and the tensors, split into `num_shards` files with an index if > 1."""
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))
    if num_shards == 1:
        save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
        return model_dir
    names = list(tensors)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    shards: list[list[str]] = [[] for _ in range(num_shards)]
    acc = 0
    for name in names:  # fill shards in order, by bytes
        shards[min(acc * num_shards // max(total, 1), num_shards - 1)].append(name)
        acc += tensors[name].numel() * tensors[name].element_size()
    weight_map = {}
    for k, shard in enumerate(shards, start=1):
        file = f"model-{k:05d}-of-{num_shards:05d}.safetensors"
        save_file({n: tensors[n] for n in shard}, str(model_dir / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in shard})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return model_dir


def write_random_checkpoint(
    model_dir: Path, config: dict[str, Any] | None = None, num_shards: int = 1, seed: int = 0
) -> Path:
    config = config or llama_config()
    return write_checkpoint(model_dir, config, checkpoint_tensors(config, seed), num_shards)
