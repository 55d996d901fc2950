"""rotary_embedding (Triton) against its reference, in place on views of a fused qkv row."""

from __future__ import annotations

import pytest
import torch

from kubeinfer.kernels import KernelInputError, rotary_embedding, rotary_embedding_reference
from tests.kernels.conftest import TOLERANCE, rel_err


def cos_sin_cache(max_positions: int, rot_dim: int, theta: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / theta ** (torch.arange(0, rot_dim, 2).float() / rot_dim)
    freqs = torch.outer(torch.arange(max_positions).float(), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # (max_positions, rot_dim)


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "rot_dim"),
    [(4, 4, 64, 64), (8, 2, 128, 128), (8, 1, 64, 64), (4, 2, 128, 64)],
)
def test_rotary_embedding_matches_reference(
    backend: tuple[torch.device, torch.dtype],
    heads: int,
    kv_heads: int,
    head_dim: int,
    rot_dim: int,
    is_neox: bool,
) -> None:
    device, dtype = backend
    g = torch.Generator().manual_seed(heads * head_dim)
    num_tokens = 7
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(device, dtype)
    positions = torch.tensor([0, 1, 15, 16, 17, 299, 4000], device=device)
    cache = cos_sin_cache(4096 + 1, rot_dim).to(device)

    def split(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = t[:, : heads * head_dim].view(num_tokens, heads, head_dim)
        k = t[:, heads * head_dim : (heads + kv_heads) * head_dim].view(-1, kv_heads, head_dim)
        return q, k, t[:, (heads + kv_heads) * head_dim :]

    want = qkv.clone()
    q_ref, k_ref, _ = split(want)
    rotary_embedding_reference(positions, q_ref, k_ref, cache, is_neox)
    q, k, v = split(qkv)
    v_before = v.clone()
    q_out, k_out = rotary_embedding(positions.int(), q, k, cache, is_neox)
    assert q_out is q and k_out is k
    assert rel_err(q, q_ref) < TOLERANCE[dtype] and rel_err(k, k_ref) < TOLERANCE[dtype]
    assert torch.equal(v, v_before)  # the rest of the qkv row is untouched
    if rot_dim < head_dim:  # the features past rot_dim pass through
        assert torch.equal(q[..., rot_dim:], q_ref[..., rot_dim:])


def test_rotary_reference_is_the_models_neox_formula() -> None:
    # the model's path: q * cat(cos, cos) + rotate_half(q) * cat(sin, sin)
    q, k = torch.randn(5, 4, 16), torch.randn(5, 2, 16)
    positions = torch.tensor([0, 3, 9, 10, 63])
    cache = cos_sin_cache(64, 16)
    cos, sin = cache[positions].chunk(2, dim=-1)
    cos, sin = torch.cat([cos, cos], -1)[:, None], torch.cat([sin, sin], -1)[:, None]

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([-x2, x1], dim=-1)

    want_q, want_k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    rotary_embedding_reference(positions, q, k, cache, is_neox=True)
    torch.testing.assert_close(q, want_q, rtol=0, atol=0)
    torch.testing.assert_close(k, want_k, rtol=0, atol=0)


def test_rotary_embedding_rejects_bad_inputs() -> None:
    q, k, cache = torch.randn(3, 4, 16), torch.randn(3, 2, 16), cos_sin_cache(8, 16)
    positions = torch.arange(3)
    for fn in (rotary_embedding, rotary_embedding_reference):
        with pytest.raises(KernelInputError, match="positions must have shape"):
            fn(torch.arange(4), q, k, cache, True)
        with pytest.raises(KernelInputError, match="q must have each token's"):
            fn(positions, q.transpose(1, 2).contiguous().transpose(1, 2), k, cache, True)
        with pytest.raises(KernelInputError, match="rot_dim"):
            fn(positions, q, k, cos_sin_cache(8, 32), True)
        with pytest.raises(KernelInputError, match="k is torch.float16"):
            fn(positions, q, k.half(), cache, True)
