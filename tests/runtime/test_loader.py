"""The streamed loader: sharded checkpoints, progress, memory, and every bad-file case named."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kubeinfer.runtime.errors import ModelLoadError, UnsupportedModelError
from kubeinfer.runtime.loader import load_model
from kubeinfer.runtime.testing import (
    checkpoint_tensors,
    llama_config,
    write_checkpoint,
    write_random_checkpoint,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def sharded(tmp_path: Path) -> Path:
    return write_random_checkpoint(tmp_path / "sharded", num_shards=3)


def test_sharded_equals_single_file(tmp_path: Path) -> None:
    config = llama_config()
    tensors = checkpoint_tensors(config, seed=3)
    one = load_model(write_checkpoint(tmp_path / "one", config, tensors), dtype="float32")
    three = load_model(write_checkpoint(tmp_path / "three", config, tensors, 3), dtype="float32")
    a, b = one.state_dict(), three.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # the fused q/k/v rows hold q, then k, then v
    qkv = one.model.layers[1].self_attn.qkv_proj.weight
    q, k, v = (tensors[f"model.layers.1.self_attn.{x}_proj.weight"] for x in "qkv")
    assert torch.equal(qkv, torch.cat([q, k, v]))


def test_progress_is_monotonic_and_ends_at_total(sharded: Path) -> None:
    seen: list[tuple[int, int]] = []
    load_model(sharded, on_progress=lambda done, total: seen.append((done, total)))
    assert len(seen) > 3
    totals = {t for _, t in seen}
    assert len(totals) == 1
    (total,) = totals
    dones = [d for d, _ in seen]
    assert dones == sorted(dones) and dones[-1] == total
    assert total == sum(t.numel() * 4 for t in checkpoint_tensors(llama_config()).values())


def test_dtype_cast_on_load(sharded: Path) -> None:
    model = load_model(sharded, dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def _first_shard(model_dir: Path) -> Path:
    return sorted(model_dir.glob("model-*.safetensors"))[0]


def _rewrite(path: Path, edit) -> None:  # noqa: ANN001
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, str(path))


def test_missing_shard(sharded: Path) -> None:
    shard = _first_shard(sharded)
    shard.unlink()
    with pytest.raises(ModelLoadError, match=shard.name):
        load_model(sharded)


def test_missing_tensor(tmp_path: Path) -> None:
    config = llama_config()
    tensors = checkpoint_tensors(config)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    model_dir = write_checkpoint(tmp_path / "m", config, tensors)
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_model(model_dir)


def test_tensor_listed_in_index_but_absent_from_shard(sharded: Path) -> None:
    shard = _first_shard(sharded)
    _rewrite(shard, lambda t: t.pop("model.embed_tokens.weight"))
    with pytest.raises(ModelLoadError, match=r"model\.embed_tokens\.weight") as e:
        load_model(sharded)
    assert shard.name in str(e.value)


def test_shape_mismatch(sharded: Path) -> None:
    shard = _first_shard(sharded)
    name = "model.layers.0.mlp.up_proj.weight"

    def shrink(t: dict[str, torch.Tensor]) -> None:
        t[name] = t[name][:-1].clone()

    if name not in load_file(shard):
        shard = next(p for p in sharded.glob("model-*.safetensors") if name in load_file(p))
    _rewrite(shard, shrink)
    with pytest.raises(ModelLoadError, match="shape") as e:
        load_model(sharded)
    assert name in str(e.value) and shard.name in str(e.value)


def test_unexpected_tensor(tmp_path: Path) -> None:
    config = llama_config()
    tensors = checkpoint_tensors(config)
    tensors["model.layers.0.self_attn.bogus.weight"] = torch.zeros(3)
    model_dir = write_checkpoint(tmp_path / "m", config, tensors)
    with pytest.raises(
        ModelLoadError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.bogus"
    ):
        load_model(model_dir)


def test_rotary_inv_freq_is_ignored(tmp_path: Path) -> None:
    config = llama_config()
    tensors = checkpoint_tensors(config)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    load_model(write_checkpoint(tmp_path / "m", config, tensors))


def test_tensor_in_two_shards(tmp_path: Path) -> None:
    config = llama_config()
    tensors = checkpoint_tensors(config)
    model_dir = write_checkpoint(tmp_path / "m", config, tensors, num_shards=2)
    second = sorted(model_dir.glob("model-*.safetensors"))[1]
    _rewrite(
        second,
        lambda t: t.update({"model.embed_tokens.weight": tensors["model.embed_tokens.weight"]}),
    )
    with pytest.raises(ModelLoadError, match=r"model\.embed_tokens\.weight.*already loaded"):
        load_model(model_dir)


def test_truncated_file(sharded: Path) -> None:
    shard = _first_shard(sharded)
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=shard.name):
        load_model(sharded)


@pytest.mark.parametrize("garbage", [b"", b"\x01\x02", b"\xff" * 64])
def test_corrupt_file(tmp_path: Path, garbage: bytes) -> None:
    model_dir = write_random_checkpoint(tmp_path / "m")
    (model_dir / "model.safetensors").write_bytes(garbage)
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_model(model_dir)


def test_corrupt_header(tmp_path: Path) -> None:
    model_dir = write_random_checkpoint(tmp_path / "m")
    path = model_dir / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:24] = b"{not json at all"
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_model(model_dir)


def test_no_weights(tmp_path: Path) -> None:
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(llama_config()))
    with pytest.raises(ModelLoadError, match="no model.safetensors"):
        load_model(model_dir)


def test_missing_model_dir(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope")


@pytest.mark.parametrize(
    ("edit", "error", "pattern"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, UnsupportedModelError, "GPT2LMHeadModel"),
        ({"architectures": None, "model_type": "bert"}, UnsupportedModelError, "bert"),
        ({"num_hidden_layers": -2}, ModelLoadError, "num_hidden_layers"),
        ({"hidden_size": "64"}, ModelLoadError, "hidden_size"),
        ({"vocab_size": None}, ModelLoadError, "vocab_size"),
        ({"num_key_value_heads": 3}, ModelLoadError, "num_key_value_heads"),
        ({"hidden_act": "gelu"}, UnsupportedModelError, "hidden_act"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, UnsupportedModelError, "yarn"),
        ({"tie_word_embeddings": "yes"}, ModelLoadError, "tie_word_embeddings"),
        ({"rms_norm_eps": 0}, ModelLoadError, "rms_norm_eps"),
    ],
)
def test_bad_config(tmp_path: Path, edit: dict, error: type, pattern: str) -> None:
    config = {**llama_config(), **edit}
    model_dir = write_random_checkpoint(tmp_path / "m")
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(error, match=pattern) as e:
        load_model(model_dir)
    assert "config.json" in str(e.value)


@pytest.mark.parametrize("text", ["{", "[]", ""])
def test_unreadable_config(tmp_path: Path, text: str) -> None:
    model_dir = write_random_checkpoint(tmp_path / "m")
    (model_dir / "config.json").write_text(text)
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(model_dir)


@pytest.mark.slow
def test_peak_memory_stays_near_one_tensor(tmp_path: Path) -> None:
    """A ~300 MB sharded checkpoint: peak RSS over the model's own storage < largest + 64 MB.

    The model's parameters are the product of loading; what must stay small is everything
    else (a naive `load_file` + `load_state_dict` holds a second full copy).
    """
    sys.path.insert(0, str(REPO / "bench"))
    import loader as bench_loader  # bench/loader.py

    model_dir = tmp_path / "ckpt"
    bench_loader.make_checkpoint(model_dir, hidden=1024, layers=3, vocab=16000)
    r = bench_loader.measure("ours", model_dir)
    assert r["model_bytes"] > 280e6
    overhead = r["peak_bytes"] - r["baseline_bytes"] - r["model_bytes"]
    budget = r["largest_param_bytes"] + 64 * 2**20
    assert overhead < budget, f"overhead {overhead / 2**20:.0f} MiB > {budget / 2**20:.0f} MiB"


def test_tensor_parallel_rank_peak_memory_stays_near_one_slice(tmp_path: Path) -> None:
    """Rank 1 of 2 of the same ~300 MB checkpoint: it holds half the model, and its peak RSS
    over that stays under its largest slice + 64 MB; column slices (o_proj, down_proj) are
    read in bands of rows, so no whole tensor is ever mapped in at once."""
    sys.path.insert(0, str(REPO / "bench"))
    import loader as bench_loader  # bench/loader.py

    model_dir = tmp_path / "ckpt"
    bench_loader.make_checkpoint(model_dir, hidden=1024, layers=3, vocab=16000)
    full = bench_loader.measure("ours", model_dir)
    r = bench_loader.measure("ours-tp2", model_dir)
    assert abs(r["model_bytes"] / full["model_bytes"] - 0.5) < 0.02
    overhead = r["peak_bytes"] - r["baseline_bytes"] - r["model_bytes"]
    budget = r["largest_param_bytes"] + 64 * 2**20
    assert overhead < budget, f"overhead {overhead / 2**20:.0f} MiB > {budget / 2**20:.0f} MiB"
