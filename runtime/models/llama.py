"""The Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3) in plain torch.

Parameter names follow the HF checkpoints except for two fusions: `self_attn.qkv_proj` holds
q, k and v stacked along the output dimension, and `mlp.gate_up_proj` holds gate and up.
`checkpoint_target(name)` tells the loader where a checkpoint tensor goes, and under tensor
parallelism (parallel.py) which slice of it this rank holds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from kubeinfer.runtime.models.attention import AttentionBackend
from kubeinfer.runtime.models.config import ModelConfig
from kubeinfer.runtime.models.layers import MLP, RMSNorm, RotaryEmbedding
from kubeinfer.runtime.models.ops import TORCH_OPS, KernelOps
from kubeinfer.runtime.models.parallel import (
    SINGLE,
    TPGroup,
    TPLayout,
    VocabParallelEmbedding,
)

# Checkpoint tensors that carry nothing we need (rotary caches some exporters save).
IGNORED_TENSORS = re.compile(r".*(rotary_emb\.inv_freq|rotary_emb\.(cos|sin)_cached)$")
_STACKED = re.compile(r"^(.*)\.(self_attn\.(q|k|v)_proj|mlp\.(gate|up)_proj)\.(weight|bias)$")
_ROW_PARALLEL = re.compile(r"^(.*)\.(?:self_attn\.o_proj|mlp\.down_proj)\.(weight|bias)$")


@dataclass(frozen=True, slots=True)
class CheckpointTarget:
    """Rows `[row_offset, row_offset + num_rows)` of parameter `param_name` (all rows if None)
    take the checkpoint tensor, or with `src_len` set its slice `[src_start, src_start +
    src_len)` along `src_dim` (a tensor-parallel rank's part; the dimension must be `src_full`
    long in the checkpoint)."""

    param_name: str
    row_offset: int = 0
    num_rows: int | None = None
    shard: str = ""
    src_dim: int = 0
    src_start: int = 0
    src_len: int | None = None
    src_full: int | None = None


class Attention(nn.Module):
    """This rank's heads (all of them with one rank): q/k/v column-parallel, o_proj
    row-parallel with one all-reduce (its bias on rank 0 only)."""

    def __init__(self, config: ModelConfig, layer_idx: int, tp: TPGroup, layout: TPLayout) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.tp = tp
        self.num_heads = layout.num_heads
        self.num_kv_heads = layout.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias
        )
        self.o_proj = nn.Linear(
            self.q_size, config.hidden_size, bias=config.o_bias and tp.rank == 0
        )
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        rotary: RotaryEmbedding,
        attn: AttentionBackend,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # Qwen3: per-head RMSNorm
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(positions, q, k)
        o = attn.forward(self.layer_idx, q, k, v)  # (T, H, D)
        return self.tp.all_reduce(self.o_proj(o.reshape(num_tokens, self.q_size)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, tp: TPGroup, layout: TPLayout) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx, tp, layout)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, tp, layout)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: RotaryEmbedding,
        attn: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output, the residual stream before it), as vLLM passes them: the next
        norm adds the two in the same kernel (the same sums, in the same dtype, as x + f(x))."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(positions, h, rotary, attn)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class DecoderModel(nn.Module):
    def __init__(
        self, config: ModelConfig, max_positions: int, tp: TPGroup, layout: TPLayout
    ) -> None:
        super().__init__()
        self.embed_tokens: nn.Module
        if tp.size > 1:
            self.embed_tokens = VocabParallelEmbedding(layout, config.hidden_size, tp)
        else:
            # `_weight` skips the random init, which is slow even on the meta device.
            self.embed_tokens = nn.Embedding(
                config.vocab_size,
                config.hidden_size,
                _weight=torch.empty(config.vocab_size, config.hidden_size),
            )
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, tp, layout) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, max_positions, config.rope)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, self.rotary_emb, attn)
        if residual is None:  # no layers
            return self.norm(x)
        return self.norm(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    """`forward(input_ids (T,), positions (T,), attn) -> hidden (T, hidden)`;
    `compute_logits(hidden) -> (T, vocab)` so the engine projects only the tokens it samples.

    With `tp` of N > 1 ranks this is one rank's shard (parallel.py): every rank runs forward
    and compute_logits in lockstep; the logits come back on rank 0 (None on the others)."""

    def __init__(
        self, config: ModelConfig, max_positions: int | None = None, tp: TPGroup = SINGLE
    ) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.layout = TPLayout.of(config, tp)
        self.max_positions = max_positions or config.max_position_embeddings
        self.model = DecoderModel(config, self.max_positions, tp, self.layout)
        self.lm_head = nn.Linear(config.hidden_size, self.layout.vocab_rows, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.ops: KernelOps = TORCH_OPS

    @property
    def attention_scale(self) -> float:
        return float(self.config.head_dim**-0.5)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        return self.model(input_ids, positions, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        if self.tp.size == 1:
            return self.lm_head(hidden)
        logits = self.tp.gather_last_dim(self.lm_head(hidden))
        return None if logits is None else logits[:, : self.config.vocab_size]

    def use_kernels(self, ops: KernelOps) -> None:
        """Route every norm, rotary and activation through `ops` (Triton or torch)."""
        self.ops = ops
        for module in self.modules():
            if hasattr(module, "ops"):
                module.ops = ops

    def materialize(self, device: torch.device) -> None:
        """Compute the non-parameter state (the rotary cache) once weights have real storage,
        and zero a vocabulary shard's padding rows (past the vocabulary, never read)."""
        self.model.rotary_emb.materialize(device)
        real = self.layout.num_real_vocab_rows
        with torch.no_grad():
            self.lm_head.weight[real:].zero_()
            self.model.embed_tokens.weight[real:].zero_()

    def checkpoint_target(self, name: str) -> CheckpointTarget | None:
        """Where checkpoint tensor `name` goes (and which slice of it, on a tensor-parallel
        rank); None for a tensor to skip on purpose."""
        if IGNORED_TENSORS.match(name):
            return None
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None  # tied: embed_tokens is the one copy
        c, lay, tp = self.config, self.layout, self.tp
        m = _STACKED.match(name)
        if m is None:
            if tp.size == 1:
                return CheckpointTarget(name)
            if name in ("model.embed_tokens.weight", "lm_head.weight"):  # vocabulary rows
                real = lay.num_real_vocab_rows
                return CheckpointTarget(
                    name, 0, real, src_start=lay.vocab_start, src_len=real, src_full=c.vocab_size
                )
            row_parallel = _ROW_PARALLEL.match(name)
            if row_parallel is None:
                return CheckpointTarget(name)  # norms: replicated
            if row_parallel.group(2) == "bias":
                return CheckpointTarget(name) if tp.rank == 0 else None  # summed once
            if "self_attn" in name:
                size, full = lay.num_heads * c.head_dim, c.num_attention_heads * c.head_dim
                start = lay.head_start * c.head_dim
            else:
                size, full = lay.intermediate_size, c.intermediate_size
                start = lay.intermediate_start
            return CheckpointTarget(name, src_dim=1, src_start=start, src_len=size, src_full=full)
        prefix, _, qkv, gate_up, kind = m.groups()
        d = c.head_dim
        if qkv:
            q_size, kv_size = lay.num_heads * d, lay.num_kv_heads * d
            offset, rows, start, full = {
                "q": (0, q_size, lay.head_start * d, c.num_attention_heads * d),
                "k": (q_size, kv_size, lay.kv_head_start * d, c.num_key_value_heads * d),
                "v": (q_size + kv_size, kv_size, lay.kv_head_start * d, c.num_key_value_heads * d),
            }[qkv]
            param = f"{prefix}.self_attn.qkv_proj.{kind}"
        else:
            rows, start, full = lay.intermediate_size, lay.intermediate_start, c.intermediate_size
            offset = 0 if gate_up == "gate" else rows
            param = f"{prefix}.mlp.gate_up_proj.{kind}"
        shard = qkv or gate_up
        if tp.size == 1:
            return CheckpointTarget(param, offset, rows, shard)
        return CheckpointTarget(
            param, offset, rows, shard, src_start=start, src_len=rows, src_full=full
        )
