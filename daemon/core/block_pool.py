"""The paged KV cache's physical blocks: who holds them, which are free, which are cached.

A block with `ref_cnt == 0` sits in the free queue. If it also holds a cached full
block (`block_hash` is set) it stays findable in the hash map until the free queue
hands it out again (lazy eviction), so a freed prefix is reused for free until the
memory is actually needed. No torch: this is bookkeeping over block ids.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence


class KVCacheBlock:
    """One physical block. The cache key fields are set only while it is a cached full block."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "parent_hash", "token_ids", "extra_keys",
                 "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        # The full key behind `block_hash`, compared on every hit: a hash match alone
        # could be a collision.
        self.parent_hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None
        self.extra_keys: tuple | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def set_key(self, block_hash: int, parent_hash: int | None, token_ids: tuple[int, ...],
                extra_keys: tuple | None) -> None:
        self.block_hash = block_hash
        self.parent_hash = parent_hash
        self.token_ids = token_ids
        self.extra_keys = extra_keys

    def clear_key(self) -> None:
        self.block_hash = None
        self.parent_hash = None
        self.token_ids = None
        self.extra_keys = None

    def key_matches(self, parent_hash: int | None, token_ids: tuple[int, ...],
                    extra_keys: tuple | None) -> bool:
        return (self.parent_hash == parent_hash and self.token_ids == token_ids
                and self.extra_keys == extra_keys)

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """Free blocks in LRU order: a doubly linked list threaded through the blocks.

    Blocks freed earlier are handed out earlier. Removing a block from the middle (a
    cached block that gets hit again) is O(1), and nothing is allocated per operation.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("no free blocks left")
        self._unlink(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, only {self.num_free_blocks} are free")
        blocks = []
        block = self._head.next_free
        for _ in range(n):
            blocks.append(block)
            next_block = block.next_free
            block.prev_free = block.next_free = None
            block = next_block
        self._head.next_free = block
        block.prev_free = self._head
        self.num_free_blocks -= n
        return blocks

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        self._unlink(block)

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            self.append(block)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        blocks = []
        block = self._head.next_free
        while block is not self._tail:
            blocks.append(block)
            block = block.next_free
        return blocks

    def _unlink(self, block: KVCacheBlock) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def check_integrity(self, max_len: int) -> None:
        """Links agree in both directions, no cycle, and the count is right."""
        count = 0
        prev = self._head
        block = self._head.next_free
        while block is not self._tail:
            assert block is not None, "free queue is broken (a next link is None)"
            assert block.prev_free is prev, f"block {block.block_id}: prev link disagrees"
            count += 1
            assert count <= max_len, "free queue has a cycle or holds foreign blocks"
            prev, block = block, block.next_free
        assert self._tail.prev_free is prev, "tail's prev link disagrees"
        assert count == self.num_free_blocks, f"free count {self.num_free_blocks} != {count} linked"


class BlockUsage:
    """How full a pool of blocks is, read from its free queue. The pool answers it, and so
    does the KV cache manager that owns the pool (the scheduler and the metrics ask the
    manager), from the same queue."""

    num_blocks: int
    free_block_queue: FreeBlockQueue

    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (free cached blocks count as free)."""
        return 1.0 - self.free_block_queue.num_free_blocks / self.num_blocks


class BlockPool(BlockUsage):
    """All blocks, the free queue, and the hash map of cached full blocks."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        # One block per hash: the first block cached under a hash keeps it.
        self.cached_block_map: dict[int, KVCacheBlock] = {}

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take `n` blocks from the head of the free queue, each with ref_cnt 1."""
        blocks = self.free_block_queue.popleft_n(n)
        for block in blocks:
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
        return blocks

    def uncache(self, block: KVCacheBlock) -> None:
        """Make a block unfindable by prefix lookups (its contents are not valid)."""
        self._evict(block)

    def _evict(self, block: KVCacheBlock) -> None:
        if self.cached_block_map.get(block.block_hash) is block:
            del self.cached_block_map[block.block_hash]
        block.clear_key()

    def get_cached_block(self, block_hash: int, parent_hash: int | None,
                         token_ids: tuple[int, ...], extra_keys: tuple | None) -> KVCacheBlock | None:
        """The cached block with exactly this key, or None."""
        block = self.cached_block_map.get(block_hash)
        if block is None or not block.key_matches(parent_hash, token_ids, extra_keys):
            return None
        return block

    def cache_block(self, block: KVCacheBlock, block_hash: int, parent_hash: int | None,
                    token_ids: tuple[int, ...], extra_keys: tuple | None) -> bool:
        """Make a full block findable. Returns False (and leaves the block uncached) if
        another block already holds this hash: identical content, or a collision."""
        if not self.enable_caching or block_hash in self.cached_block_map:
            return False
        assert block.block_hash is None, f"block {block.block_id} is already cached"
        block.set_key(block_hash, parent_hash, token_ids, extra_keys)
        self.cached_block_map[block_hash] = block
        return True

    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[int],
                          block_token_ids: Sequence[tuple[int, ...]], parent_hash: int | None,
                          first_extra_keys: tuple | None = None) -> None:
        """Cache consecutive full blocks of one sequence. `parent_hash` is the hash of the
        block before the first one (None at the sequence start); `first_extra_keys`
        belongs to the first block only."""
        extra_keys = first_extra_keys
        for block, block_hash, token_ids in zip(blocks, block_hashes, block_token_ids, strict=True):
            self.cache_block(block, block_hash, parent_hash, token_ids, extra_keys)
            parent_hash = block_hash
            extra_keys = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on blocks found in the cache (they may be sitting in the free queue)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks nobody holds join the free queue tail in this order."""
        for block in blocks:
            assert block.ref_cnt > 0, f"block {block.block_id} freed more often than taken"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block. Blocks held by requests stay held, just no longer findable."""
        for block in self.cached_block_map.values():
            block.clear_key()
        self.cached_block_map.clear()

    def check_integrity(self) -> None:
        """Assert the pool's invariants (O(num_blocks); for tests and debugging)."""
        queue = self.free_block_queue
        queue.check_integrity(self.num_blocks)
        free_ids = [b.block_id for b in queue.get_all_free_blocks()]
        assert len(free_ids) == len(set(free_ids)), "a block is in the free queue twice"
        free = set(free_ids)
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"block {block.block_id} has ref_cnt {block.ref_cnt}"
            in_queue = block.block_id in free
            if block.ref_cnt == 0:
                assert in_queue, f"block {block.block_id} has ref_cnt 0 but is not free"
            else:
                assert not in_queue, f"block {block.block_id} has ref_cnt {block.ref_cnt} but is free"
            if block.block_hash is not None:
                assert self.cached_block_map.get(block.block_hash) is block, \
                    f"block {block.block_id} carries hash {block.block_hash} but the map disagrees"
                assert block.token_ids is not None, f"cached block {block.block_id} has no token ids"
            else:
                assert block.token_ids is None and block.parent_hash is None and block.extra_keys is None, \
                    f"uncached block {block.block_id} keeps a stale key"
        for block_hash, block in self.cached_block_map.items():
            assert block.block_hash == block_hash, \
                f"map entry {block_hash} points at block {block.block_id} with hash {block.block_hash}"
            assert 0 <= block.block_id < self.num_blocks and self.blocks[block.block_id] is block
        assert self.num_free_blocks == len(free)
