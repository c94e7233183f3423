"""The pieces of the block pool: a block's metadata, the LRU free queue, a logical block table.

Pure data structures, no policy: ``PagedCacheManager`` (``paged_cache.py``) decides who holds
which block.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

__all__ = ["BlockTable", "CacheBlock", "FreeBlockQueue"]


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
