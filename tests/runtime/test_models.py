"""Our full-sequence logits equal transformers' (float32) for every supported architecture."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kubeinfer.runtime.loader import load_model
from kubeinfer.runtime.models import CausalAttention, LlamaForCausalLM

from .conftest import TINY_MODELS

REL_TOL = 1e-4


def our_logits(model: LlamaForCausalLM, prompts: list[list[int]]) -> list[torch.Tensor]:
    """One flat forward over all prompts laid end to end (no padding)."""
    lengths = [len(p) for p in prompts]
    input_ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(n) for n in lengths])
    sw = model.config.sliding_window
    attn = CausalAttention.for_lengths(lengths, model.attention_scale, sw)
    with torch.inference_mode():
        logits = model.compute_logits(model(input_ids, positions, attn))
    return list(logits.split(lengths))


def hf_logits(model_dir: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    """transformers' logits, each prompt run alone."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [ref(torch.tensor([p])).logits[0] for p in prompts]


def assert_close_rel(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    rel = ((ours - ref).norm() / ref.norm()).item()
    worst = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert rel < REL_TOL and worst < REL_TOL, f"{what}: relative error {rel:.2e}, max {worst:.2e}"


def random_prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("name", list(TINY_MODELS))
def test_tiny_model_logits_match_transformers(tiny_models: dict[str, Path], name: str) -> None:
    model = load_model(tiny_models[name], dtype="float32")
    # lengths cross the Mistral window (24) and the llama3 original context (64)
    prompts = random_prompts(model.config.vocab_size, [1, 7, 30, 97], seed=1)
    for i, (ours, ref) in enumerate(
        zip(our_logits(model, prompts), hf_logits(tiny_models[name], prompts), strict=True)
    ):
        assert_close_rel(ours, ref, f"{name} prompt {i} (length {len(prompts[i])})")


def test_tied_model_shares_one_embedding(tiny_models: dict[str, Path]) -> None:
    model = load_model(tiny_models["llama-tied"], dtype="float32")
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


SMOLLM2_PROMPTS = [
    "What is the capital of France?",
    "def fibonacci(n):",
    "The quick brown fox jumps over the lazy dog. Then",
    "Écris une phrase en français avec des accents: été, garçon, naïve — et un emoji 🚀.",
]


def test_smollm2_logits_match_transformers(smollm2_dir: Path) -> None:
    from kubeinfer.runtime.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(smollm2_dir)
    prompts = [tokenizer.encode(p) for p in SMOLLM2_PROMPTS]
    model = load_model(smollm2_dir, dtype="float32")
    for i, (ours, ref) in enumerate(
        zip(our_logits(model, prompts), hf_logits(smollm2_dir, prompts), strict=True)
    ):
        assert_close_rel(ours, ref, f"smollm2 prompt {i}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_runs_close_to_float32(
    tiny_models: dict[str, Path], dtype: torch.dtype
) -> None:
    prompts = random_prompts(384, [5, 19], seed=2)
    full = our_logits(load_model(tiny_models["llama-gqa"], dtype="float32"), prompts)
    half_model = load_model(tiny_models["llama-gqa"], dtype=dtype)
    assert half_model.lm_head.weight.dtype == dtype
    for ours, ref in zip(our_logits(half_model, prompts), full, strict=True):
        assert ours.dtype == dtype
        rel = ((ours.float() - ref).norm() / ref.norm()).item()
        assert rel < 3e-2, rel


def test_cpu_native_bfloat16_is_within_tolerance_of_float32(smollm2_dir: Path) -> None:
    """The CPU path in bfloat16 (C++ elementwise kernels, oneDNN-prepacked linears) against our
    float32 on SmolLM2. The tolerance, as for any bfloat16 engine: no further from float32 than
    the pure-torch bfloat16 path (which is 1-4 % relative L2 on these prompts, bfloat16's own
    rounding), and the same greedy token wherever float32's top two are more than one logit
    apart (closer calls may go either way in bfloat16)."""
    from kubeinfer.runtime.models.cpu_linear import pack_dtype, pack_linears
    from kubeinfer.runtime.models.ops import cpu_native_ops
    from kubeinfer.runtime.tokenizer import Tokenizer

    ops = cpu_native_ops()
    if ops is None or pack_dtype(torch.bfloat16) is None:  # float32 where no bfloat16 kernel
        pytest.skip("the C++ CPU kernels or oneDNN packing are not available here")
    tokenizer = Tokenizer.from_dir(smollm2_dir)
    prompts = [tokenizer.encode(p) for p in SMOLLM2_PROMPTS]
    full = our_logits(load_model(smollm2_dir, dtype="float32"), prompts)
    plain = our_logits(load_model(smollm2_dir, dtype="bfloat16"), prompts)
    model = load_model(smollm2_dir, dtype="bfloat16")
    model.use_kernels(ops)
    assert pack_linears(model) == 30 * 4 + 1  # every projection and the (tied) LM head
    checked = 0
    for ours, torch_bf16, ref in zip(our_logits(model, prompts), plain, full, strict=True):
        rel = ((ours.float() - ref).norm() / ref.norm()).item()
        rel_plain = ((torch_bf16.float() - ref).norm() / ref.norm()).item()
        assert rel < 6e-2 and rel <= 1.1 * rel_plain + 1e-3, (rel, rel_plain)
        top2 = ref.topk(2, dim=-1).values
        sure = (top2[:, 0] - top2[:, 1]) > 1.0
        assert bool((ours.float().argmax(-1)[sure] == ref.argmax(-1)[sure]).all())
        checked += int(sure.sum())
    assert checked > 20
