"""The block pool: every block's metadata, the LRU free queue, the hash maps, a logical table.

No policy about requests: the coordinator (``core/kv/coordinator.py``) and its managers per kind
(``core/kv/managers.py``) decide which request's table holds which block; the pool only hands blocks
out, takes them back, and keeps the hashes of full blocks for prefix hits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

__all__ = ["BlockPool", "BlockTable", "CacheBlock", "FreeBlockQueue"]


@dataclass(slots=True, eq=False)  # identity equality: two blocks are never "the same" by value
class CacheBlock:
    """Metadata of one physical KV block."""

    block_id: int
    ref_cnt: int = 0
    # Set only while the block is full and registered in the manager's hash map.
    block_hash: bytes | None = None
    # Token slots handed out in this block (block_size once full).
    num_tokens: int = 0
    # Kept only for full hashed blocks, so observers can show what a cached block holds.
    token_ids: tuple[int, ...] | None = None
    group: int = 0  # the block group whose hash map holds it (meaningful while hashed)
    # Its KV was read from disk (the KV disk tier, a prefix file), not computed here; until evicted.
    from_disk: bool = False
    # Free-queue links; both None exactly when the block is not in the queue.
    prev_free: CacheBlock | None = field(default=None, repr=False)
    next_free: CacheBlock | None = field(default=None, repr=False)
    is_null: bool = False

    @property
    def in_free_queue(self) -> bool:
        return self.prev_free is not None

    @property
    def is_used(self) -> bool:
        return self.ref_cnt > 0

    @property
    def is_cached_free(self) -> bool:
        """Free, but still reusable by a prefix hit until evicted."""
        return self.ref_cnt == 0 and self.block_hash is not None

    def clear_content(self) -> None:
        """Forget the hash and the token bookkeeping (the KV data is simply overwritten later)."""
        self.block_hash = None
        self.token_ids = None
        self.num_tokens = 0
        self.group = 0
        self.from_disk = False


class FreeBlockQueue:
    """Doubly linked list of free blocks, threaded through the blocks' own links.

    Head = next to evict (least recently freed). A Python deque cannot remove from the middle in
    O(1), and a prefix hit must pull a cached-free block out of wherever it sits.
    """

    def __init__(self, blocks: list[CacheBlock] | None = None) -> None:
        self._head = CacheBlock(block_id=-1)  # sentinels: no None checks on the hot paths
        self._tail = CacheBlock(block_id=-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks or ():
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[CacheBlock]:
        node = self._head.next_free
        while node is not self._tail:
            assert node is not None
            yield node
            node = node.next_free

    def _link(self, block: CacheBlock, prev: CacheBlock, nxt: CacheBlock) -> None:
        if block.in_free_queue:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = block
        nxt.prev_free = block
        self._len += 1

    def append(self, block: CacheBlock) -> None:
        """Add at the tail: evicted last."""
        assert self._tail.prev_free is not None
        self._link(block, self._tail.prev_free, self._tail)

    def appendleft(self, block: CacheBlock) -> None:
        """Add at the head: evicted first."""
        assert self._head.next_free is not None
        self._link(block, self._head, self._head.next_free)

    def remove(self, block: CacheBlock) -> None:
        """Unlink ``block`` from wherever it is, in O(1)."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def popleft(self) -> CacheBlock:
        """Take the least recently freed block."""
        first = self._head.next_free
        if first is self._tail or first is None:
            raise IndexError("pop from an empty free block queue")
        self.remove(first)
        return first

    def block_ids(self) -> list[int]:
        return [b.block_id for b in self]

    def check_links(self) -> list[CacheBlock]:
        """Walk the queue checking back-links and length; return its blocks (for invariants)."""
        blocks: list[CacheBlock] = []
        prev = self._head
        for block in self:
            if block.prev_free is not prev or len(blocks) >= self._len:
                raise AssertionError(f"free queue links broken at block {block.block_id}")
            blocks.append(block)
            prev = block
        if self._tail.prev_free is not prev or len(blocks) != self._len:
            raise AssertionError(f"free queue holds {len(blocks)} blocks, counts {self._len}")
        return blocks


@dataclass
class BlockTable:
    """A request's logical→physical block map (append-only while the request lives)."""

    block_ids: list[int]
    block_size: int

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    @property
    def num_slots(self) -> int:
        return len(self.block_ids) * self.block_size

    def slot(self, position: int) -> int:
        """Physical slot of token ``position``: its block's first slot plus the in-block offset."""
        if not 0 <= position < self.num_slots:
            raise IndexError(f"position {position} outside the table's {self.num_slots} slots")
        block_idx, offset = divmod(position, self.block_size)
        return self.block_ids[block_idx] * self.block_size + offset

    def slots(self, start: int, end: int) -> list[int]:
        """Physical slots of positions ``start .. end-1``."""
        return [self.slot(pos) for pos in range(start, end)]


class BlockPool:
    """Every block of the cache, one free queue, and one hash map per block group.

    Block 0 is the *null* block (never handed out, never hashed, never queued). Every other
    block is either in the free queue (``ref_cnt == 0``) or held by tables (``ref_cnt > 0``).
    A hashed block is in the map of its ``group``; one with ``ref_cnt == 0`` is *cached-free*:
    a prefix hit revives it (``touch``) until the queue's head reaches it and evicts it
    (``take``, which calls ``on_evict`` with the evicted hash).
    """

    def __init__(self, num_blocks: int, block_size: int, num_groups: int = 1) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [CacheBlock(block_id=i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.is_null = True
        # Ascending ids at start, so a fresh pool hands out 1, 2, 3, ...
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached: list[dict[bytes, CacheBlock]] = [{} for _ in range(num_groups)]
        self.on_evict: Callable[[bytes], None] | None = None
        self.allocations = 0  # blocks taken from the free queue for new content
        self.frees = 0  # blocks returned to the free queue
        self.evictions = 0  # hashed blocks reclaimed for new content

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def get_num_free_blocks(self) -> int:
        """Blocks an allocation could take, cached-free ones included."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free_queue) / self.num_usable_blocks

    def take(self) -> CacheBlock:
        """A block for new content from the queue's head (``ref_cnt`` 1), evicting its hash."""
        block = self.free_queue.popleft()
        if block.block_hash is not None:
            # Reusing a cached-free block evicts its cached prefix (and what depends on it).
            del self.cached[block.group][block.block_hash]
            if self.on_evict is not None:
                self.on_evict(block.block_hash)
            self.evictions += 1
        block.clear_content()
        block.ref_cnt = 1
        self.allocations += 1
        return block

    def touch(self, block: CacheBlock) -> None:
        """One more table holds ``block`` (a prefix hit); a cached-free one leaves the queue."""
        if block.ref_cnt == 0:  # cached-free: revive it before eviction reaches it
            self.free_queue.remove(block)
        block.ref_cnt += 1

    def release(self, block: CacheBlock) -> None:
        """One table fewer holds ``block``; at 0 it goes to the queue's tail (keeping its hash)."""
        block.ref_cnt -= 1
        assert block.ref_cnt >= 0, f"block {block.block_id} ref_cnt went negative"
        if block.ref_cnt == 0:
            if block.block_hash is None:
                block.clear_content()
            self.free_queue.append(block)
            self.frees += 1

    def cache_block(self, block: CacheBlock, group: int, block_hash: bytes, token_ids: tuple[int, ...]) -> None:
        """Register the full ``block`` under ``block_hash`` in ``group``'s map."""
        block.block_hash, block.group = block_hash, group
        block.token_ids = token_ids
        block.num_tokens = self.block_size
        self.cached[group][block_hash] = block

    def reset_prefix_cache(self) -> None:
        """Forget the hashes of every free block (queue order kept); blocks in use keep theirs."""
        for cached in self.cached:
            for block_hash, block in list(cached.items()):
                if block.ref_cnt == 0:
                    del cached[block_hash]
                    block.clear_content()

    def num_cached_blocks(self, free_only: bool = False) -> int:
        """Hashed blocks (all groups); only the cached-free ones with ``free_only``."""
        return sum(1 for c in self.cached for b in c.values() if not free_only or b.ref_cnt == 0)
