"""What kubeinfer reads from an HF `config.json`, validated once, with errors that name the key.

One dataclass covers the Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3): they differ
only in a few switches (q/k/v bias, q/k RMSNorm, rope scaling, sliding window, tied embeddings).
Both config spellings are read: transformers 4 (`rope_theta` + `rope_scaling`) and
transformers 5 (`rope_parameters`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from kubeinfer.runtime.errors import ModelLoadError, UnsupportedModelError

ArchName = Literal["llama", "mistral", "qwen2", "qwen3"]

ARCHITECTURES: dict[str, ArchName] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
MODEL_TYPES: dict[str, ArchName] = {v: v for v in ARCHITECTURES.values()}
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ModelConfig:
    arch: ArchName
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    rope: RopeConfig
    sliding_window: int | None
    checkpoint_dtype: str | None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ModelLoadError(f"{path}: no config.json in the model folder") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"{path}: not a readable JSON config ({e})") from None
        if not isinstance(raw, dict):
            raise ModelLoadError(f"{path}: the config must be a JSON object")
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        get = _Getter(raw, source)
        arch = _arch(raw, source)
        num_heads = get.int("num_attention_heads")
        hidden = get.int("hidden_size")
        num_kv_heads = get.int("num_key_value_heads", num_heads)
        head_dim = raw.get("head_dim")
        if head_dim is None:
            if hidden % num_heads:
                raise ModelLoadError(
                    f"{source}: hidden_size {hidden} is not a multiple of "
                    f"num_attention_heads {num_heads} and no head_dim is given"
                )
            head_dim = hidden // num_heads
        else:
            head_dim = get.int("head_dim")
        if num_heads % num_kv_heads:
            raise ModelLoadError(
                f"{source}: num_attention_heads {num_heads} is not a multiple of "
                f"num_key_value_heads {num_kv_heads}"
            )
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"{source}: hidden_act {act!r} is not supported (silu)")
        attention_bias = get.bool("attention_bias", False)
        return cls(
            arch=arch,
            vocab_size=get.int("vocab_size"),
            hidden_size=hidden,
            intermediate_size=get.int("intermediate_size"),
            num_hidden_layers=get.int("num_hidden_layers"),
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=get.float("rms_norm_eps", 1e-6),
            max_position_embeddings=get.int("max_position_embeddings", 4096),
            tie_word_embeddings=get.bool("tie_word_embeddings", False),
            # Qwen2: q/k/v bias, none on o_proj. Llama's attention_bias covers all four.
            qkv_bias=True if arch == "qwen2" else attention_bias,
            o_bias=False if arch == "qwen2" else attention_bias,
            mlp_bias=get.bool("mlp_bias", False),
            qk_norm=arch == "qwen3",
            rope=_rope(raw, get, source),
            sliding_window=_sliding_window(raw, arch, get, source),
            checkpoint_dtype=raw.get("dtype") or raw.get("torch_dtype"),
            bos_token_id=raw.get("bos_token_id")
            if isinstance(raw.get("bos_token_id"), int)
            else None,
            eos_token_ids=_ids(raw.get("eos_token_id")),
        )


class _Getter:
    """Typed reads from the raw config; a wrong or missing value names its key."""

    def __init__(self, raw: dict[str, Any], source: str) -> None:
        self.raw, self.source = raw, source

    def _value(self, key: str, default: Any) -> Any:
        if key in self.raw and self.raw[key] is not None:
            return self.raw[key]
        if default is None:
            raise ModelLoadError(f"{self.source}: required key {key!r} is missing")
        return default

    def int(self, key: str, default: int | None = None) -> int:
        value = self._value(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ModelLoadError(f"{self.source}: {key} must be a positive integer, got {value!r}")
        return value

    def float(self, key: str, default: float | None = None) -> float:
        value = self._value(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ModelLoadError(f"{self.source}: {key} must be a positive number, got {value!r}")
        return float(value)

    def bool(self, key: str, default: bool) -> bool:
        value = self._value(key, default)
        if not isinstance(value, bool):
            raise ModelLoadError(f"{self.source}: {key} must be true or false, got {value!r}")
        return value


def _arch(raw: dict[str, Any], source: str) -> ArchName:
    archs = raw.get("architectures")
    if archs:
        if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in ARCHITECTURES:
            raise UnsupportedModelError(
                f"{source}: architectures {archs!r} is not supported; "
                f"kubeinfer serves {', '.join(ARCHITECTURES)}"
            )
        return ARCHITECTURES[archs[0]]
    model_type = raw.get("model_type")
    if model_type not in MODEL_TYPES:
        raise UnsupportedModelError(
            f"{source}: model_type {model_type!r} is not supported and no architectures "
            f"are given; kubeinfer serves {', '.join(ARCHITECTURES)}"
        )
    return MODEL_TYPES[model_type]


def _rope(raw: dict[str, Any], get: _Getter, source: str) -> RopeConfig:
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # per-layer-type form
        params = params["full_attention"]
    if params is None:
        params = dict(raw.get("rope_scaling") or {})
        params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    if not isinstance(params, dict):
        raise ModelLoadError(f"{source}: rope_parameters must be an object, got {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModelError(
            f"{source}: rope type {rope_type!r} is not supported ({', '.join(ROPE_TYPES)})"
        )
    sub = _Getter(params, f"{source}: rope")
    if raw.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError(f"{source}: partial_rotary_factor is not supported")
    return RopeConfig(
        theta=sub.float("rope_theta", 10000.0),
        rope_type=rope_type,
        factor=sub.float("factor", 1.0),
        low_freq_factor=sub.float("low_freq_factor", 1.0),
        high_freq_factor=sub.float("high_freq_factor", 4.0),
        original_max_position_embeddings=sub.int("original_max_position_embeddings", 8192),
    )


def _sliding_window(raw: dict[str, Any], arch: ArchName, get: _Getter, source: str) -> int | None:
    if arch in ("qwen2", "qwen3"):
        if raw.get("use_sliding_window"):
            raise UnsupportedModelError(f"{source}: use_sliding_window=true is not supported")
        return None
    if raw.get("sliding_window") is None:
        return None
    return get.int("sliding_window")


def _ids(value: Any) -> tuple[int, ...]:
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, list):
        return tuple(v for v in value if isinstance(v, int))
    return ()
