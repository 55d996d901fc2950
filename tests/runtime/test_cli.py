"""`kubeinfer generate`: the offline demo answers a real question with the real model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from kubeinfer.runtime.greedy import greedy_tokens
from kubeinfer.runtime.loader import load_model


def test_generate_answers_the_capital_of_france(smollm2_dir: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kubeinfer",
            "generate",
            "--model",
            str(smollm2_dir),
            "--max-tokens",
            "24",
            "What is the capital of France?",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    assert "loading" in out.stderr  # the progress bar


def test_generate_reports_a_bad_model_dir(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kubeinfer", "generate", "--model", str(tmp_path), "hi"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1
    assert "config.json" in out.stderr and "Traceback" not in out.stderr


def test_greedy_matches_transformers_generate(tiny_models: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM

    model_dir = tiny_models["qwen2"]
    ours = load_model(model_dir, dtype="float32")
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = [5, 17, 99, 3, 250]
    expected = ref.generate(
        torch.tensor([prompt]),
        max_new_tokens=12,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )[0, len(prompt) :].tolist()
    assert list(greedy_tokens(ours, prompt, 12)) == expected
