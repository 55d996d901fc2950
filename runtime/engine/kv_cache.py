"""KVCacheManager: a fixed pool of KV blocks, ref counts, block tables and a prefix cache.

No torch here: this is bookkeeping over block ids; the model runner owns the tensors.

- Free blocks sit in an ordered dict used as an O(1) LRU queue: freed blocks go to the back,
  allocation takes from the front, and a free block that gets a prefix-cache hit is taken out
  of the middle in O(1).
- A full block is identified by a chained hash: sha256(parent hash, its token ids, extra keys),
  so equal hashes mean equal whole prefixes (collisions are cryptographically unlikely, and the
  token ids are compared too). A freed block keeps its hash until it is reused, so a later
  request with the same prefix picks it up again (LRU eviction of free cached blocks).
- At least the last prompt token is always computed: its logits are needed to sample.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from kubeinfer.runtime.engine.request import Request


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] = ()


@dataclass(slots=True)
class PrefixCacheStats:
    num_queried_tokens: int = 0
    num_hit_tokens: int = 0


def hash_block(parent: bytes | None, token_ids: Sequence[int], extra_keys: object = None) -> bytes:
    h = hashlib.sha256(parent or b"root")
    h.update(array("q", token_ids).tobytes())
    if extra_keys is not None:
        h.update(repr(extra_keys).encode())
    return h.digest()


@dataclass(slots=True)
class _RequestBlocks:
    block_ids: list[int] = field(default_factory=list)
    num_cached: int = 0  # its leading blocks already offered to the prefix cache


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1"
            )
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, int] = {}  # block hash -> block id
        self._requests: dict[str, _RequestBlocks] = {}
        self.prefix_stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (free cached blocks count as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        entry = self._requests.get(request_id)
        return entry.block_ids if entry else []

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Blocks of the longest cached prefix of `request` and how many tokens they hold."""
        if not self.enable_prefix_caching or request.request_id in self._requests:
            return [], 0
        # never the whole prompt: the last token is recomputed to get its logits
        num_full = (request.num_tokens - 1) // self.block_size
        self.prefix_stats.num_queried_tokens += len(request.prompt_token_ids)
        hashes = self._hashes(request, num_full)
        hits: list[int] = []
        for i, block_hash in enumerate(hashes[:num_full]):
            block_id = self._cached.get(block_hash)
            if block_id is None or self.blocks[block_id].token_ids != tuple(
                request.token_slice(i * self.block_size, (i + 1) * self.block_size)
            ):
                break
            hits.append(block_id)
        num_tokens = len(hits) * self.block_size
        self.prefix_stats.num_hit_tokens += min(num_tokens, len(request.prompt_token_ids))
        return hits, num_tokens

    def _hashes(self, request: Request, num_full: int) -> list[bytes]:
        """The request's chained full-block hashes, computed once per block and kept on it."""
        hashes = request.block_hashes
        bs = self.block_size
        for i in range(len(hashes), num_full):
            parent = hashes[-1] if hashes else None
            hashes.append(
                hash_block(parent, request.token_slice(i * bs, (i + 1) * bs), request.cache_salt)
            )
        return hashes

    def allocate(
        self, request: Request, num_new_tokens: int, computed: Sequence[int] = ()
    ) -> list[int] | None:
        """Room for `num_new_tokens` more tokens of `request`.

        On a request's first allocation, `computed` are its prefix-cache hits (from
        `get_computed_blocks`) and the new tokens come after them. Returns the newly taken block
        ids, or None, changing nothing, when the pool has too few free blocks.
        """
        entry = self._requests.get(request.request_id)
        if entry is not None:
            num_tokens = request.num_computed_tokens + num_new_tokens
            held = len(entry.block_ids)
            if num_tokens <= held * self.block_size:  # the common decode step: room already
                if self.enable_prefix_caching and num_tokens // self.block_size > entry.num_cached:
                    self._cache_full_blocks(request, entry, num_tokens)
                return []
            num_needed = self.num_blocks_for(num_tokens) - held
            if num_needed > len(self._free):
                return None
        else:
            num_tokens = len(computed) * self.block_size + num_new_tokens
            num_needed = max(self.num_blocks_for(num_tokens) - len(computed), 0)
            if num_needed > self._num_usable(computed):
                return None
            entry = self._requests[request.request_id] = _RequestBlocks()
            for block_id in computed:
                self._touch(block_id)
                entry.block_ids.append(block_id)
            entry.num_cached = len(computed)
        new_ids = [self._take_free() for _ in range(num_needed)]
        entry.block_ids.extend(new_ids)
        if self.enable_prefix_caching:
            self._cache_full_blocks(request, entry, num_tokens)
        return new_ids

    def free(self, request_id: str) -> None:
        """Release a request's blocks; the tail goes to the free queue first, so that shared
        prefixes (the head) stay cached longest."""
        entry = self._requests.pop(request_id, None)
        if entry is None:
            return
        for block_id in reversed(entry.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None

    def uncache_blocks(self, request_id: str, first: int) -> None:
        """Forget the prefix-cache hashes of a request's blocks from index `first` on.

        For a step that failed: `allocate` hashed its full blocks before the step computed them,
        so their KV was never written and no later request may reuse them."""
        entry = self._requests.get(request_id)
        if entry is None:
            return
        for block_id in entry.block_ids[first:]:
            self._uncache(self.blocks[block_id])
        entry.num_cached = min(entry.num_cached, first)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix held by no request."""
        for block_id in list(self._cached.values()):
            if self.blocks[block_id].ref_count == 0:
                self._uncache(self.blocks[block_id])

    # internals

    def _num_usable(self, computed: Sequence[int]) -> int:
        # computed prefix blocks that are free now leave the free queue when touched
        return len(self._free) - sum(1 for b in computed if self.blocks[b].ref_count == 0)

    def _touch(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _take_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        self._uncache(block)
        block.ref_count = 1
        return block_id

    def _uncache(self, block: Block) -> None:
        if block.block_hash is not None and self._cached.get(block.block_hash) == block.block_id:
            del self._cached[block.block_hash]
        block.block_hash, block.token_ids = None, ()

    def _cache_full_blocks(self, request: Request, entry: _RequestBlocks, num_tokens: int) -> None:
        """Hash the blocks that are full once `num_tokens` tokens are computed."""
        bs = self.block_size
        num_full = num_tokens // bs  # num_tokens never exceeds the request's known tokens
        hashes = self._hashes(request, num_full)
        for i in range(entry.num_cached, num_full):
            block_hash = hashes[i]
            block = self.blocks[entry.block_ids[i]]
            if block.block_hash is None and block_hash not in self._cached:
                block.block_hash = block_hash
                block.token_ids = tuple(request.token_slice(i * bs, (i + 1) * bs))
                self._cached[block_hash] = block.block_id
        entry.num_cached = max(entry.num_cached, num_full)
