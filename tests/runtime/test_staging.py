"""HostStaging: the arena path (pinned on CUDA) gives the same tensors as a plain copy, grows
when a step needs more, keeps earlier views of the step valid, and is rewound per step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kubeinfer.runtime.engine.staging import ALIGN, HostStaging

CPU = torch.device("cpu")


def test_cpu_default_wraps_without_an_arena() -> None:
    staging = HostStaging(CPU)
    assert not staging.use_arena and staging.capacity == 0
    a = np.arange(5, dtype=np.int64)
    assert torch.equal(staging.put(a), torch.arange(5))


def test_arena_copies_values_dtypes_and_shapes() -> None:
    staging = HostStaging(CPU, use_arena=True, initial_bytes=4096)
    staging.begin_step()
    arrays = [
        np.arange(7, dtype=np.int64),
        np.arange(12, dtype=np.int32).reshape(3, 4),
        np.array([True, False, True]),
        np.zeros((0, 5), dtype=np.int32),
        np.arange(10, dtype=np.int32)[::2],  # not contiguous
    ]
    outs = [staging.put(a) for a in arrays]
    for a, out in zip(arrays, outs, strict=True):
        assert out.shape == a.shape and out.dtype == torch.from_numpy(a.copy()).dtype
        assert np.array_equal(out.numpy(), a)


def test_arena_grows_and_earlier_views_stay_valid() -> None:
    staging = HostStaging(CPU, use_arena=True, initial_bytes=256)
    staging.begin_step()
    first = staging.put(np.full(16, 7, dtype=np.int64))  # 128 bytes
    big = staging.put(np.arange(1000, dtype=np.int64))  # does not fit: a new arena
    assert staging.capacity >= 8000
    assert torch.equal(first, torch.full((16,), 7))
    assert torch.equal(big, torch.arange(1000))


def test_begin_step_rewinds_the_arena() -> None:
    staging = HostStaging(CPU, use_arena=True, initial_bytes=1024)
    for step in range(5):
        staging.begin_step()
        out = staging.put(np.full(100, step, dtype=np.int64))
        assert torch.equal(out, torch.full((100,), step))
    assert staging.capacity == 1024  # reused, never grown
    assert ALIGN % 8 == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_arena_is_pinned_and_copies() -> None:
    staging = HostStaging(torch.device("cuda"))
    assert staging.use_arena and staging._arena is not None and staging._arena.is_pinned()
    for step in range(3):
        staging.begin_step()
        out = staging.put(np.full(4096, step, dtype=np.int32))
        assert out.is_cuda and int(out.sum()) == 4096 * step
