"""KVCacheManager without a model: allocation, ref counts, prefix hits, LRU eviction."""

from __future__ import annotations

import pytest

from kubeinfer.runtime.engine.kv_cache import KVCacheManager, hash_block
from kubeinfer.runtime.engine.request import Request
from kubeinfer.runtime.engine.sampling_params import SamplingParams


def req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(), cache_salt=salt)


def admit(kv: KVCacheManager, r: Request) -> int:
    """What the scheduler does for a waiting request; returns the prefix hit in tokens."""
    computed, n = kv.get_computed_blocks(r)
    assert kv.allocate(r, r.num_tokens - n, computed) is not None
    r.num_computed_tokens = r.num_tokens
    return n


def test_allocate_and_free_round_trip() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    r = req("a", list(range(10)))
    assert kv.allocate(r, 10) is not None
    assert len(kv.block_ids("a")) == 3 and kv.num_free_blocks == 5
    r.num_computed_tokens = 10
    assert kv.allocate(r, 2) == []  # 12 tokens still fit 3 blocks
    assert len(kv.allocate(r, 3)) == 1  # the 13th token needs a 4th
    kv.free("a")
    assert kv.num_free_blocks == 8 and kv.usage == 0.0


def test_allocate_returns_none_and_changes_nothing_when_full() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a, b = req("a", list(range(8))), req("b", list(range(100, 108)))
    assert kv.allocate(a, 8) is not None
    assert kv.allocate(b, 8) is None
    assert kv.num_free_blocks == 1 and kv.block_ids("b") == []


def test_prefix_hit_shares_blocks_and_keeps_last_token_uncomputed() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    admit(kv, req("a", list(range(12))))
    # the same 12 tokens: only 2 of 3 full blocks hit, so the last token is computed again
    b = req("b", list(range(12)))
    assert admit(kv, b) == 8
    assert kv.block_ids("b")[:2] == kv.block_ids("a")[:2]
    assert kv.blocks[kv.block_ids("a")[0]].ref_count == 2
    c = req("c", [*range(8), 99, 98, 97, 96, 95])
    assert admit(kv, c) == 8
    assert kv.prefix_stats.num_queried_tokens == 12 + 12 + 13
    assert kv.prefix_stats.num_hit_tokens == 16


def test_hashes_chain_over_the_whole_prefix() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    admit(kv, req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # same second block, different first block: no hit at all
    assert admit(kv, req("b", [0, 2, 3, 4, 5, 6, 7, 8, 9])) == 0
    assert hash_block(None, [1, 2]) != hash_block(None, [1, 2], "salt")


def test_cache_salt_isolates_tenants() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    admit(kv, req("a", list(range(9)), salt="team-a"))
    assert admit(kv, req("b", list(range(9)), salt="team-b")) == 0
    assert admit(kv, req("c", list(range(9)), salt="team-a")) == 8


def test_freed_cached_blocks_are_reused_then_evicted_lru() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    admit(kv, req("a", list(range(9))))  # 3 blocks, 2 full ones cached
    kv.free("a")
    assert kv.num_free_blocks == 4
    assert admit(kv, req("b", list(range(9)))) == 8  # picked up from the free queue
    kv.free("b")
    # a different request needing all 4 blocks evicts every cached one
    admit(kv, req("c", list(range(50, 66))))
    kv.free("c")
    assert admit(kv, req("d", list(range(9)))) == 0


def test_prefix_caching_off() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    admit(kv, req("a", list(range(9))))
    assert admit(kv, req("b", list(range(9)))) == 0


def test_hit_on_free_block_counts_against_free_space() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)
    admit(kv, req("a", list(range(9))))
    kv.free("a")
    b = req("b", list(range(9)))
    computed, n = kv.get_computed_blocks(b)
    assert n == 8
    # 2 free cached blocks get touched, 1 more is needed: exactly the pool
    assert kv.allocate(b, 1, computed) is not None and kv.num_free_blocks == 0


def test_bad_sizes() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheManager(num_blocks=0)


def test_uncache_blocks_forgets_the_hashes_from_a_block_on() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = req("a", list(range(13)))
    admit(kv, a)  # three full blocks hashed
    kv.uncache_blocks("a", 1)  # a failed step was to write blocks 1 and up
    kv.free("a")
    assert admit(kv, req("b", list(range(13)))) == 4  # block 0 still hits, block 1 no more
    kv.uncache_blocks("no-such-request", 0)  # a no-op
