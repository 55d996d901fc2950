"""`vllm:cache_config_info`: vLLM's info gauge, which endpoint pickers read the KV size from."""

from __future__ import annotations

from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from kubeinfer.runtime.engine.config import EngineConfig
from kubeinfer.runtime.engine.engine import Engine
from kubeinfer.runtime.server.metrics import RuntimeMetrics


def _info_samples(text: str) -> list[dict[str, str]]:
    return [
        dict(s.labels)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "vllm:cache_config_info" and s.value == 1.0
    ]


def test_cache_config_info_carries_the_pool_as_vllm_labels_it(
    tiny_models: dict[str, Path],
) -> None:
    engine = Engine(
        tiny_models["llama-gqa"],
        EngineConfig(num_kv_blocks=64, enable_prefix_caching=False),
        dtype="float32",
    )
    (labels,) = _info_samples(RuntimeMetrics("m", lambda: engine).render().decode())
    assert labels["block_size"] == "16" and labels["num_gpu_blocks"] == "64"
    assert labels["enable_prefix_caching"] == "False" and labels["cache_dtype"] == "auto"
    assert "model_name" not in labels  # vLLM's info gauge has no model label


def test_cache_config_info_waits_for_the_engine() -> None:
    assert _info_samples(RuntimeMetrics("m", lambda: None).render().decode()) == []
