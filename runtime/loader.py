"""Chunked (streamed) weight loading: build the model on `meta`, then copy tensor by tensor.

The model is created on the meta device (no memory), given uninitialized storage on the
target device, and every checkpoint tensor is read alone with `safe_open`, cast and copied into
its parameter (or its slice of a fused q/k/v or gate/up parameter). Host memory beyond the
model's own storage stays near one tensor. A tensor-parallel rank reads only its slice of each
sharded tensor (rows through one `get_slice`; a column slice in bands of rows, each band through
its own `safe_open`, so that the mapped pages it touches stay near `SLICE_BAND_BYTES`): its
host memory stays near one slice, never the whole checkpoint. Every parameter must be written
exactly once; any problem raises `ModelLoadError` naming the file and the tensor, and no model
is returned.
"""

from __future__ import annotations

import json
import logging
import math
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open

from kubeinfer.runtime.errors import ModelLoadError
from kubeinfer.runtime.models import CheckpointTarget, LlamaForCausalLM, ModelConfig, build_model
from kubeinfer.runtime.models.parallel import SINGLE, TPGroup

logger = logging.getLogger(__name__)

ProgressCallback = Callable[[int, int], None]
"""Called as `on_progress(loaded_bytes, total_bytes)` after each tensor."""

SLICE_BAND_BYTES = 32 << 20
"""Most checkpoint bytes (whole rows) one mapping touches while a column slice is read."""
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ELEMENT_BYTES = {
    "F64": 8,
    "I64": 8,
    "U64": 8,
    "F32": 4,
    "I32": 4,
    "U32": 4,
    "F16": 2,
    "BF16": 2,
    "I16": 2,
    "U16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}


def resolve_dtype(
    dtype: str | torch.dtype, config: ModelConfig, device: torch.device
) -> torch.dtype:
    """`auto`: float32 on CPU; on GPUs the checkpoint's half type (float32 checkpoints -> bf16)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ModelLoadError(f"dtype {dtype} is not supported ({', '.join(DTYPES)})")
        return dtype
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        return torch.float16 if config.checkpoint_dtype == "float16" else torch.bfloat16
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype {dtype!r} is not supported (auto, {', '.join(DTYPES)})")
    return DTYPES[dtype]


def checkpoint_files(model_dir: Path) -> dict[Path, set[str] | None]:
    """Each safetensors file to read, with the tensors the index promises in it (None: no index)."""
    index = model_dir / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{index}: not a valid safetensors index ({e})") from None
        files: dict[Path, set[str] | None] = {}
        for tensor, file in weight_map.items():
            files.setdefault(model_dir / file, set()).add(tensor)  # type: ignore[union-attr]
        for path in files:
            if not path.is_file():
                raise ModelLoadError(f"{path}: shard listed in {INDEX_FILE} is missing")
        return dict(sorted(files.items()))
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return {single: None}
    found = sorted(model_dir.glob("*.safetensors"))
    if not found:
        raise ModelLoadError(f"{model_dir}: no {SINGLE_FILE}, {INDEX_FILE} or *.safetensors")
    return {p: None for p in found}


def data_bytes(path: Path) -> int:
    """Bytes of tensor data in a safetensors file: its size less the 8-byte length and header."""
    with path.open("rb") as f:
        head = f.read(8)
    if len(head) < 8:
        raise ModelLoadError(f"{path}: truncated safetensors file (no header)")
    (header_len,) = struct.unpack("<Q", head)
    return max(path.stat().st_size - 8 - header_len, 0)


@contextmanager
def _open(path: Path, tensor: str | None = None) -> Iterator[None]:
    """Turn any failure of the safetensors library into a ModelLoadError naming file/tensor."""
    try:
        yield
    except ModelLoadError:
        raise
    except Exception as e:  # safetensors raises its own SafetensorError, OSError, ...
        where = f"{path}" + (f", tensor {tensor!r}" if tensor else "")
        raise ModelLoadError(f"{where}: corrupt or truncated safetensors file ({e})") from None


def load_model(
    model_dir: str | Path,
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    max_positions: int | None = None,
    on_progress: ProgressCallback | None = None,
    tp: TPGroup = SINGLE,
) -> LlamaForCausalLM:
    """Build the model of `model_dir` on `device` and stream its weights in (with `tp`, this
    rank's shard of them)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"{model_dir}: model folder does not exist")
    config = ModelConfig.from_dir(model_dir)
    device = torch.device(device)
    torch_dtype = resolve_dtype(dtype, config, device)
    files = checkpoint_files(model_dir)

    with torch.device("meta"):
        model = build_model(config, max_positions, tp).to(torch_dtype)
    model.to_empty(device=device)
    if config.tie_word_embeddings:  # to_empty gives each module its own new tensor
        model.lm_head.weight = model.model.embed_tokens.weight
    _stream_weights(model, files, on_progress)
    model.materialize(device)
    model.eval().requires_grad_(False)
    logger.info("loaded %s (%s, %s)", model_dir, config.arch, torch_dtype)
    return model


def _stream_weights(
    model: LlamaForCausalLM,
    files: dict[Path, set[str] | None],
    on_progress: ProgressCallback | None,
) -> None:
    params = dict(model.named_parameters())
    expected = {(name, shard) for name in params for shard in _shards_of(name)}
    loaded: dict[tuple[str, str], str] = {}
    total = sum(data_bytes(p) for p in files)
    done = 0
    for path, promised in files.items():
        with _open(path), safe_open(str(path), framework="pt", device="cpu") as f:
            keys = list(f.keys())
            for name in keys:
                with _open(path, name):
                    tensor_slice = f.get_slice(name)
                    shape = list(tensor_slice.get_shape())
                    nbytes = math.prod(shape) * _ELEMENT_BYTES.get(tensor_slice.get_dtype(), 0)
                    target = model.checkpoint_target(name)
                    if target is not None:
                        key = (target.param_name, target.shard)
                        if target.param_name not in params:
                            raise ModelLoadError(f"{path}: unexpected tensor {name!r}")
                        if key in loaded:
                            raise ModelLoadError(
                                f"{path}: tensor {name!r} was already loaded from {loaded[key]}"
                            )
                        dst = params[target.param_name].data
                        if target.num_rows is not None:
                            dst = dst.narrow(0, target.row_offset, target.num_rows)
                        shape = _sliced_shape(path, name, shape, target)
                        if shape != list(dst.shape):
                            raise ModelLoadError(
                                f"{path}: tensor {name!r} has shape {shape}, "
                                f"the model expects {list(dst.shape)}"
                            )
                        if dst.numel() == 0:  # a vocabulary shard of padding only
                            loaded[key] = path.name
                            continue
                        tensor = _read_one(path, name, target, dst)
                        if not tensor.is_floating_point():
                            raise ModelLoadError(
                                f"{path}: tensor {name!r} has dtype {tensor.dtype}, "
                                "not floating point"
                            )
                        if tensor is not dst:
                            dst.copy_(tensor)
                        del tensor
                        loaded[key] = path.name
                done += nbytes
                if on_progress is not None:
                    on_progress(min(done, total), total)
            if promised is not None and (absent := promised - set(keys)):
                first = sorted(absent)[0]
                raise ModelLoadError(f"{path}: tensor {first!r} of {INDEX_FILE} is not in the file")
    if missing := expected - loaded.keys():
        names = sorted(_checkpoint_name(p, s) for p, s in missing)
        more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
        raise ModelLoadError(f"{path.parent}: checkpoint has no tensor {names[0]!r}{more}")
    if on_progress is not None:
        on_progress(total, total)


def _sliced_shape(path: Path, name: str, shape: list[int], target: CheckpointTarget) -> list[int]:
    """The shape of what `target` reads of a tensor of `shape`: the tensor's, or its slice."""
    if target.src_len is None:
        return shape
    dim = target.src_dim
    if len(shape) <= dim or (target.src_full is not None and shape[dim] != target.src_full):
        raise ModelLoadError(
            f"{path}: tensor {name!r} has shape {shape}, the model expects dimension {dim} "
            f"of {target.src_full} to split across tensor-parallel ranks"
        )
    return [*shape[:dim], target.src_len, *shape[dim + 1 :]]


def _read_one(path: Path, name: str, target: CheckpointTarget, dst: torch.Tensor) -> torch.Tensor:
    """One tensor (or this rank's slice of it), read through its own `safe_open`.

    safetensors maps the file and hands out views of the mapping; the pages a view touched stay
    resident until the file is closed. Opening per tensor bounds that to the tensor at hand
    instead of the whole shard. A column slice (`src_dim` 1) touches every row's pages, so it
    is read in bands of rows, each through its own `safe_open`, straight into `dst` (which is
    then returned).
    """
    if target.src_len is None:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return f.get_tensor(name)
    a, b = target.src_start, target.src_start + target.src_len
    if target.src_dim == 0:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return f.get_slice(name)[a:b]
    with safe_open(str(path), framework="pt", device="cpu") as f:
        tensor_slice = f.get_slice(name)
        num_rows, row_elements = tensor_slice.get_shape()[:2]
        element = _ELEMENT_BYTES.get(tensor_slice.get_dtype(), 4)
    band = max(1, SLICE_BAND_BYTES // max(1, row_elements * element))
    for lo in range(0, num_rows, band):
        hi = min(lo + band, num_rows)
        with safe_open(str(path), framework="pt", device="cpu") as f:
            part = f.get_slice(name)[lo:hi, a:b]
        if not part.is_floating_point():
            return part  # the caller names the dtype
        dst[lo:hi].copy_(part)
        del part
    return dst


def _shards_of(param_name: str) -> tuple[str, ...]:
    if ".qkv_proj." in param_name:
        return ("q", "k", "v")
    if ".gate_up_proj." in param_name:
        return ("gate", "up")
    return ("",)


def _checkpoint_name(param_name: str, shard: str) -> str:
    """The checkpoint's name for one part of a (possibly fused) parameter, for error messages."""
    if shard in ("q", "k", "v"):
        return param_name.replace(".qkv_proj.", f".{shard}_proj.")
    if shard in ("gate", "up"):
        return param_name.replace(".gate_up_proj.", f".{shard}_proj.")
    return param_name
