"""Tensor parallelism on CPU (gloo, worker processes): the same greedy tokens as one rank, under
preemption, chunked prefill and prefix caching; each rank's shard holds exactly its slices; the
sizes a model cannot be split into are clear errors at start.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kubeinfer.runtime import LLM, SamplingParams
from kubeinfer.runtime.errors import ModelLoadError
from kubeinfer.runtime.loader import load_model
from kubeinfer.runtime.models import ModelConfig
from kubeinfer.runtime.models.parallel import TensorParallelError, TPGroup, TPLayout
from kubeinfer.runtime.testing import llama_config, write_random_checkpoint
from tests.runtime.test_engine_greedy import (
    random_prompts,
    shared_prefix_prompts,
    smollm2_prompts,
)

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
#: every scheduling regime at once: a pool small enough to preempt, 64-token prefill chunks,
#: prefix caching (the default) over prompts that share long prefixes
REGIMES = {"num_kv_blocks": 40, "max_num_batched_tokens": 64, "max_num_seqs": 8}


def _generate(
    model_dir: Path, prompts: list[list[int]], tp: int, **args: object
) -> list[list[int]]:
    """Greedy tokens of every prompt; asserts the run did preempt and chunk its prefills (the
    regimes under test) and hit the prefix cache, and leaked no block."""
    with LLM(model_dir, dtype="float32", tensor_parallel_size=tp, **args) as llm:
        outs = llm.generate(prompts, GREEDY)
        engine = llm.engine
        assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks, "KV blocks leaked"
        assert engine.scheduler.num_preemptions > 0, "no preemption: the regime is not tested"
        assert engine.stats.num_chunked_prefill_steps > 0, "no chunked prefill"
        assert engine.kv_cache.prefix_stats.num_hit_tokens > 0, "no prefix-cache hit"
    return [o.outputs[0].token_ids for o in outs]


def _assert_same(ours: list[list[int]], single: list[list[int]], what: str) -> None:
    for i, (a, b) in enumerate(zip(ours, single, strict=True)):
        assert a == b, f"{what}: prompt {i}: tensor-parallel {a} != one rank {b}"


def _prompts(vocab: int) -> list[list[int]]:
    base = random_prompts(vocab)[::3]  # 8 prompts, 1 to 257 tokens
    return base + shared_prefix_prompts(base)[:6]


@pytest.mark.parametrize(
    ("name", "tp"),
    [
        ("llama-gqa", 2),  # 4 heads, 2 KV heads: one KV head per rank
        ("qwen2", 2),  # q/k/v biases
        ("llama-linear-rope", 2),  # attention_bias: o_proj's bias on rank 0 only
        ("llama3-rope", 2),  # 1 KV head, replicated on both ranks
        ("llama-gqa", 4),  # 2 KV heads over 4 ranks: each replicated twice
    ],
)
def test_tp_matches_one_rank(tiny_models: dict[str, Path], name: str, tp: int) -> None:
    prompts = _prompts(384)
    single = _generate(tiny_models[name], prompts, 1, **REGIMES)
    _assert_same(_generate(tiny_models[name], prompts, tp, **REGIMES), single, f"{name} tp={tp}")


def test_smollm2_tp3_matches_one_rank(smollm2_dir: Path) -> None:
    """SmolLM2-135M has 9 heads and 3 KV heads: 3 ranks (2 does not divide it; see below)."""
    from kubeinfer.runtime.tokenizer import Tokenizer

    prompts = smollm2_prompts(Tokenizer.from_dir(smollm2_dir))[::4]
    prompts += shared_prefix_prompts(prompts)[:2]
    args = {"num_kv_blocks": 24, "max_num_batched_tokens": 96, "max_num_seqs": 4}
    single = _generate(smollm2_dir, prompts, 1, **args)
    _assert_same(_generate(smollm2_dir, prompts, 3, **args), single, "smollm2 tp=3")


def test_prompt_logprobs_and_sampling_match_one_rank(tiny_models: dict[str, Path]) -> None:
    """Prompt logprobs (the driver asks every rank for the same logits slices) and seeded
    sampling over the gathered logits."""
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=8, prompt_logprobs=2, logprobs=1)
    prompts = random_prompts(384)[5:9]
    outs = {}
    for tp in (1, 2):
        with LLM(
            tiny_models["qwen2"], dtype="float32", tensor_parallel_size=tp, num_kv_blocks=64
        ) as llm:
            outs[tp] = llm.generate(prompts, params)
    for a, b in zip(outs[1], outs[2], strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.prompt_logprobs is not None and b.prompt_logprobs is not None
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs)
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):
            assert x is not None and y is not None
            assert x.token_id == y.token_id
            assert abs(x.logprob - y.logprob) < 1e-4


# errors at start


def test_smollm2_does_not_split_over_two_ranks(smollm2_dir: Path) -> None:
    with pytest.raises(TensorParallelError, match="does not divide the model's 9 attention heads"):
        LLM(smollm2_dir, tensor_parallel_size=2)


@pytest.mark.parametrize(
    ("overrides", "tp", "match"),
    [
        ({"num_attention_heads": 4}, 3, "does not divide the model's 4 attention heads"),
        (
            {"num_attention_heads": 12, "num_key_value_heads": 4, "hidden_size": 192},
            6,
            "does not divide the model's 4 KV heads",
        ),  # fmt: skip
        ({"intermediate_size": 130}, 4, "intermediate_size 130"),
    ],
)
def test_sizes_that_do_not_split_are_refused(
    tmp_path: Path, overrides: dict[str, int], tp: int, match: str
) -> None:
    model_dir = write_random_checkpoint(tmp_path / "m", llama_config(**overrides))
    with pytest.raises(TensorParallelError, match=match):
        LLM(model_dir, tensor_parallel_size=tp)


def test_more_ranks_than_gpus_is_refused(tiny_models: dict[str, Path]) -> None:
    count = torch.cuda.device_count()
    with pytest.raises(TensorParallelError, match=f"needs {count + 2} GPUs.*has {count}"):
        LLM(tiny_models["llama-gqa"], device="cuda", tensor_parallel_size=count + 2)


def test_a_rank_that_cannot_load_fails_the_start_naming_it(tmp_path: Path) -> None:
    """The driver's own load fails the same way (one checkpoint): the error names the tensor,
    and no worker process is left behind."""
    import multiprocessing as mp

    config = llama_config()
    model_dir = write_random_checkpoint(tmp_path / "m", config)
    config["intermediate_size"] = 256  # the checkpoint's gate/up/down say 128
    (model_dir / "config.json").write_text(__import__("json").dumps(config))
    with pytest.raises(ModelLoadError, match="intermediate|shape"):
        LLM(model_dir, tensor_parallel_size=2)
    assert not [p for p in mp.active_children() if p.name.startswith("kubeinfer-tp-rank")]


# the shards


@pytest.mark.parametrize("case", ["biases", "odd-vocab"])
def test_rank_shards_put_together_are_the_checkpoint(
    tmp_path: Path, tiny_models: dict[str, Path], case: str
) -> None:
    """Each rank's slices (loaded without a process group: loading needs none), joined along
    the sharded dimension, are exactly the one-rank model's parameters. `biases`: q/k/v/o
    biases (o_proj's on rank 0 only); `odd-vocab`: 383 rows, the last shard padded."""
    if case == "biases":
        model_dir = tiny_models["llama-linear-rope"]
    else:
        model_dir = write_random_checkpoint(tmp_path / "m", llama_config(vocab_size=383))
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    full = dict(load_model(model_dir, dtype="float32").named_parameters())
    n = 2
    shards = [dict(load_model(model_dir, dtype="float32", tp=TPGroup(r, n)).named_parameters())
              for r in range(n)]  # fmt: skip
    mc = ModelConfig.from_dir(model_dir)
    q, kv = mc.num_attention_heads * mc.head_dim, mc.num_key_value_heads * mc.head_dim
    for name, p in full.items():
        parts = [s.get(name) for s in shards]
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            joined = torch.cat(parts)  # type: ignore[arg-type]
            assert torch.equal(joined[:vocab], p.data), name
            assert not joined[vocab:].any(), f"{name}: padding rows not zero"
        elif ".qkv_proj." in name:
            qs, ks, vs = zip(*(t.split([q // n, kv // n, kv // n]) for t in parts), strict=True)  # type: ignore[union-attr]
            assert torch.equal(torch.cat([*qs, *ks, *vs]), p.data), name
        elif ".gate_up_proj." in name:
            gates, ups = zip(*(t.chunk(2) for t in parts), strict=True)  # type: ignore[union-attr]
            assert torch.equal(torch.cat([*gates, *ups]), p.data), name
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            assert torch.equal(torch.cat(parts, dim=1), p.data), name  # type: ignore[arg-type]
        elif name.endswith(("o_proj.bias", "down_proj.bias")):
            assert torch.equal(parts[0], p.data) and parts[1] is None, name  # type: ignore[arg-type]
        else:  # norms: replicated
            assert all(torch.equal(t, p.data) for t in parts), name  # type: ignore[arg-type]


def test_layout_replicates_kv_heads_when_fewer_than_ranks() -> None:
    config = ModelConfig.from_dict(llama_config(num_attention_heads=8, num_key_value_heads=2,
                                                hidden_size=128))  # fmt: skip
    layouts = [TPLayout.of(config, TPGroup(r, 4)) for r in range(4)]
    assert [lay.kv_head_start for lay in layouts] == [0, 0, 1, 1]
    assert {lay.num_kv_heads for lay in layouts} == {1}
    assert [lay.head_start for lay in layouts] == [0, 2, 4, 6]


# a rank that hangs


@pytest.mark.parametrize("num_prompts", [1, 32])
def test_a_hung_rank_fails_the_step_after_the_timeout(
    tiny_models: dict[str, Path], num_prompts: int
) -> None:
    """A stopped worker (SIGSTOP: alive, silent) makes the driver's next collective time out
    after tp_timeout_s: the step raises a fatal RankFailure instead of hanging. 32 prompts of
    480 tokens: a step message past the pipe's buffer, which must not block the driver (a
    sender thread per worker writes it)."""
    import multiprocessing as mp
    import os
    import signal
    import time

    from kubeinfer.runtime.engine.isolation import is_fatal
    from kubeinfer.runtime.engine.tp_workers import RankFailure

    with LLM(tiny_models["llama-gqa"], dtype="float32", tensor_parallel_size=2,
             num_kv_blocks=1100, max_num_batched_tokens=16384, tp_timeout_s=3) as llm:  # fmt: skip
        assert llm.generate([[5, 6, 7]], GREEDY)[0].outputs[0].token_ids
        (worker,) = [p for p in mp.active_children() if p.name == "kubeinfer-tp-rank-1"]
        os.kill(worker.pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            prompts = [[5 + i] * (480 if num_prompts > 1 else 4) for i in range(num_prompts)]
            with pytest.raises(RankFailure) as failure:
                llm.generate(prompts, GREEDY)
            took = time.monotonic() - start
        finally:
            os.kill(worker.pid, signal.SIGKILL)
        assert is_fatal(failure.value)
        assert 2.5 < took < 30, took


@pytest.mark.parametrize(("size", "bound"), [("0", "greater than or equal to 1"),
                                             ("65", "less than or equal to 64")])  # fmt: skip
def test_serve_refuses_a_size_out_of_range(
    tiny_models: dict[str, Path], size: str, bound: str
) -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "kubeinfer", "serve", "--model", str(tiny_models["llama-gqa"]),
         "--port", "0", "--tensor-parallel-size", size],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode != 0
    assert "--tensor-parallel-size" in out.stderr and bound in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
