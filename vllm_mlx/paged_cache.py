"""Paged KV cache accounting: blocks, the LRU free queue and the prefix-hash map.

Pure bookkeeping — no MLX, no arrays. The KV tensors live in a per-layer block pool elsewhere;
this module only decides which physical block holds which tokens of which request.

Invariants (checked by :meth:`PagedCacheManager.check_invariants`):

* Block 0 is the *null* block: never allocated, never freed, never hashed, in no table.
* Every other block is in exactly one of two places: the free queue (``ref_cnt == 0``) or the
  tables of the requests that use it (``ref_cnt > 0`` and ``ref_cnt`` equals the number of
  request tables containing it).
* ``cached_blocks`` maps each hash to the one block carrying that hash, and every block that
  carries a hash is in ``cached_blocks`` (a block whose content duplicates an already registered
  block simply stays unhashed).
* A hashed block with ``ref_cnt == 0`` is *cached-free*: reusable by a prefix hit (revived in
  O(1) from the middle of the free queue) until the queue's head reaches it and evicts it.
* With recurrent layers (``num_state_slots > 0``), every request holding blocks also holds one
  state slot (``state_slots.py``), taken with its first allocation and freed with its blocks.
* A prefix hit must be a prefix *every* layer group can resume from: with recurrent layers, it
  ends where a state checkpoint is kept (``state_checkpoints.py``; none when
  ``num_state_checkpoints == 0``, and then such a model gets no prefix hits). A checkpoint goes
  with the block carrying its hash when that block is evicted.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace

from vllm_mlx.state_checkpoints import StateCheckpoints
from vllm_mlx.state_slots import NULL_STATE_SLOT, StateSlots

__all__ = ["BlockTable", "CacheBlock", "CacheStats", "FreeBlockQueue", "PagedCacheManager"]


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


@dataclass
class CacheStats:
    """Counts of the block pool; ``num_blocks`` excludes the null block."""

    num_blocks: int
    block_size: int
    num_used_blocks: int = 0
    num_cached_free_blocks: int = 0
    num_free_blocks: int = 0
    num_cached_blocks: int = 0  # all hashed blocks, used or free
    usage: float = 0.0
    allocations: int = 0  # blocks taken from the free queue for new content
    frees: int = 0  # blocks returned to the free queue
    evictions: int = 0  # hashed blocks reclaimed for new content
    prefix_queries: int = 0  # tokens looked up in the prefix cache
    prefix_hits: int = 0  # of those, tokens found
    num_state_slots: int = 0  # recurrent-state slots (excluding the null slot); 0: no recurrent layers
    num_used_state_slots: int = 0
    num_state_checkpoints: int = 0  # checkpoint slots for recurrent prefix hits
    num_cached_state_checkpoints: int = 0  # of those, holding a state
    state_checkpoint_evictions: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def to_dict(self) -> dict:
        data = asdict(self)
        data["prefix_hit_rate"] = self.prefix_hit_rate
        return data


def _short_hash(block_hash: bytes | None) -> str | None:
    if block_hash is None:
        return None
    text = block_hash.hex() if isinstance(block_hash, (bytes, bytearray)) else str(block_hash)
    return text[:12]


class PagedCacheManager:
    """Owns every block, the free queue and the hash→block map; hands blocks to requests.

    Not thread-safe: the engine thread owns it; other threads read ``snapshot()`` output.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_caching: bool = True,
        num_state_slots: int = 0,
        num_state_checkpoints: int = 0,
    ) -> None:
        """``num_state_slots`` (the null slot included): recurrent-state slots, one per running
        request; 0 for a model without recurrent layers. ``num_state_checkpoints``: further state
        slots, numbered after those, that keep states at block boundaries for prefix hits."""
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks = [CacheBlock(block_id=i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.is_null = True
        # Ascending ids at start, so a fresh manager hands out 1, 2, 3, ...
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached_blocks: dict[bytes, CacheBlock] = {}
        self.req_to_blocks: dict[str, list[CacheBlock]] = {}
        self.num_cached_tokens: dict[str, int] = {}
        self._req_num_tokens: dict[str, int] = {}  # slots handed out per request
        self.state_slots = StateSlots(num_state_slots) if num_state_slots else None
        keeps_checkpoints = self.state_slots is not None and enable_caching and num_state_checkpoints > 0
        self.checkpoints = StateCheckpoints(num_state_slots, num_state_checkpoints) if keeps_checkpoints else None
        self._stats = CacheStats(
            num_blocks=num_blocks - 1,
            block_size=block_size,
            num_state_slots=max(0, num_state_slots - 1),
            num_state_checkpoints=num_state_checkpoints if keeps_checkpoints else 0,
        )

    # ---- queries -------------------------------------------------------------------------

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def get_num_free_blocks(self) -> int:
        """Blocks an allocation could take, cached-free ones included."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free_queue) / self.num_usable_blocks

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def get_block_table(self, request_id: str) -> BlockTable:
        return BlockTable(self.get_block_ids(request_id), self.block_size)

    def get_num_cached_tokens(self, request_id: str) -> int:
        return self.num_cached_tokens.get(request_id, 0)

    def get_state_slot(self, request_id: str) -> int:
        """The request's recurrent-state slot (the null slot when the model has no recurrent
        layers or the request holds no blocks)."""
        slot = self.state_slots.slot_of(request_id) if self.state_slots else None
        return NULL_STATE_SLOT if slot is None else slot

    def get_state_read_slot(self, request_id: str) -> int:
        """Where the request's next step reads its recurrent state: the checkpoint it resumes
        from until its first step is done (``finish_first_step``), then its own slot."""
        pinned = self.checkpoints.pinned_slot(request_id) if self.checkpoints else None
        return self.get_state_slot(request_id) if pinned is None else pinned

    @property
    def resumes_prefixes(self) -> bool:
        """Whether every layer group can resume a request from a cached prefix: recurrent
        layers only from state checkpoints."""
        return self.enable_caching and (self.state_slots is None or self.checkpoints is not None)

    def get_computed_blocks(self, request_id: str, block_hashes: list[bytes]) -> list[CacheBlock]:
        """Blocks for the longest prefix of ``block_hashes`` already cached; ref counts untouched.

        Hashes chain their parents, so the first miss ends the run. With recurrent layers the run
        is cut back to its last block whose hash has a state checkpoint. Capping the hit so that
        at least one token is still computed (to get logits) is the caller's business. Empty when
        some layer group cannot resume from a cached prefix (``resumes_prefixes``).
        """
        if not self.resumes_prefixes:
            return []
        hits = [self.cached_blocks[h] for h in block_hashes[: self.num_cached_blocks(block_hashes)]]
        if self.checkpoints is not None:
            while hits and hits[-1].block_hash not in self.checkpoints:
                hits.pop()
        return hits

    def num_cached_blocks(self, block_hashes: list[bytes]) -> int:
        """How many leading blocks of ``block_hashes`` are cached (whatever the layer groups)."""
        for i, block_hash in enumerate(block_hashes):
            if block_hash not in self.cached_blocks:
                return i
        return len(block_hashes)

    # ---- mutations -----------------------------------------------------------------------

    def allocate_slots(
        self,
        request_id: str,
        num_tokens_total: int,
        computed_blocks: list[CacheBlock] | None = None,
    ) -> list[int] | None:
        """Make the request's table cover ``num_tokens_total`` tokens; return the new block ids.

        On the request's first allocation, ``computed_blocks`` (from ``get_computed_blocks``)
        head its table: each gets ``ref_cnt += 1`` and leaves the free queue if it was
        cached-free, and the request takes a recurrent-state slot (models with recurrent layers)
        and pins the state checkpoint of the hit's last block (read by its first step).
        New blocks come from the free queue's head (evicting any hash they carry).
        All-or-nothing: returns ``None`` and changes nothing when the free queue is too short
        or no state slot is free.
        """
        table = self.req_to_blocks.get(request_id, [])
        computed = list(computed_blocks or ())
        if computed:
            self._check_computed(request_id, table, computed)
        num_have = len(table) + len(computed)
        num_new = max(0, self.num_blocks_needed(num_tokens_total) - num_have)
        num_revived = sum(1 for b in computed if b.ref_cnt == 0)
        if num_new + num_revived > len(self.free_queue):
            return None
        if self.state_slots is not None and request_id not in self.req_to_blocks:
            if self.state_slots.num_free == 0:
                return None
            self.state_slots.take(request_id)

        if computed and self.checkpoints is not None:
            self.checkpoints.pin(request_id, computed[-1].block_hash)
        self.req_to_blocks[request_id] = table
        if computed or request_id not in self.num_cached_tokens:
            self.num_cached_tokens[request_id] = len(computed) * self.block_size
        for block in computed:
            self._touch(block)
        table.extend(computed)
        new_blocks = [self._take_free_block() for _ in range(num_new)]
        table.extend(new_blocks)
        self._note_tokens(request_id, table, max(num_tokens_total, len(computed) * self.block_size))
        return [b.block_id for b in new_blocks]

    def cache_full_blocks(
        self,
        request_id: str,
        block_hashes: list[bytes],
        token_ids: list[int],
        num_full_blocks: int,
    ) -> None:
        """Register the request's first ``num_full_blocks`` blocks for prefix reuse.

        Already hashed blocks (hits, or registered by an earlier call) are skipped. If another
        block already holds a hash, that mapping stays and this block stays unhashed: its content
        is a duplicate, which costs memory but never correctness.
        """
        if not self.enable_caching:
            return
        table = self.req_to_blocks.get(request_id)
        if table is None:
            raise KeyError(f"unknown request {request_id!r}")
        if num_full_blocks > min(len(table), len(block_hashes)):
            raise ValueError(
                f"{num_full_blocks} full blocks, but the table has {len(table)} blocks "
                f"and {len(block_hashes)} hashes were given"
            )
        if len(token_ids) < num_full_blocks * self.block_size:
            raise ValueError(f"{len(token_ids)} token ids cannot fill {num_full_blocks} blocks")
        bs = self.block_size
        for i in range(num_full_blocks):
            block, block_hash = table[i], block_hashes[i]
            if block.block_hash is not None or block_hash in self.cached_blocks:
                continue
            block.block_hash = block_hash
            block.token_ids = tuple(token_ids[i * bs : (i + 1) * bs])
            block.num_tokens = bs
            self.cached_blocks[block_hash] = block

    def free(self, request_id: str) -> None:
        """Release the request's blocks; unknown ids are ignored (abort after finish is fine).

        Blocks reaching ``ref_cnt == 0`` go to the queue's tail in *reverse* table order, so a
        request's tail blocks are evicted before its head blocks: a block's hash chains all
        blocks before it, so the head (system prompt, shared instructions) is reused by many
        more later prompts than the tail is.
        """
        table = self.req_to_blocks.pop(request_id, None)
        self.num_cached_tokens.pop(request_id, None)
        self._req_num_tokens.pop(request_id, None)
        if self.state_slots is not None:
            self.state_slots.release(request_id)
        if self.checkpoints is not None:
            self.checkpoints.release(request_id)
        if table is None:
            return
        for block in reversed(table):
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} ref_cnt went negative"
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    block.clear_content()
                self.free_queue.append(block)
                self._stats.frees += 1

    def reset_prefix_cache(self) -> bool:
        """Forget the hashes of every free block (they become plain free, queue order kept).

        Blocks in use keep their hashes: requests still point at them and their content is
        still valid. Always succeeds and returns True.
        """
        for block_hash, block in list(self.cached_blocks.items()):
            if block.ref_cnt == 0:
                del self.cached_blocks[block_hash]
                block.clear_content()
        if self.checkpoints is not None:
            self.checkpoints.reset()
        return True

    # ---- recurrent-state checkpoints ---------------------------------------------------------

    def reserve_state_checkpoint(self, request_id: str) -> int | None:
        """A checkpoint slot that the request's next step writes its final state into (it must
        end on a block boundary), or None when no checkpoint can be kept."""
        if self.checkpoints is None or request_id not in self.req_to_blocks:
            return None
        return self.checkpoints.reserve(request_id)

    def publish_state_checkpoint(self, request_id: str, block_hash: bytes, moving: bool) -> None:
        """The reserved slot now holds the state after the block hashed ``block_hash``; see
        ``StateCheckpoints.publish`` for ``moving``."""
        self.checkpoints.publish(request_id, block_hash, moving)

    def finish_step(self, request_id: str, succeeded: bool) -> None:
        """The request's step is applied: the checkpoint it resumed from is no longer read,
        and a reserved checkpoint slot its failed step wrote is free again."""
        if self.checkpoints is not None:
            self.checkpoints.unpin(request_id)
            if not succeeded:
                self.checkpoints.cancel(request_id)

    def record_prefix_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Hook for the prefix cache layer to account a lookup (in tokens)."""
        self._stats.prefix_queries += num_query_tokens
        self._stats.prefix_hits += num_hit_tokens

    # ---- internals -----------------------------------------------------------------------

    def _check_computed(
        self, request_id: str, table: list[CacheBlock], computed: list[CacheBlock]
    ) -> None:
        # Validate before any mutation so a bad call cannot leave half-done state behind.
        if table:
            raise ValueError(f"request {request_id!r} already has blocks; hits only come first")
        if len({id(b) for b in computed}) != len(computed):
            raise ValueError("computed_blocks contains the same block twice")
        for block in computed:
            if block.block_hash is None or self.cached_blocks.get(block.block_hash) is not block:
                raise ValueError(f"block {block.block_id} is not a cached block")
        if self.checkpoints is not None and computed[-1].block_hash not in self.checkpoints:
            raise ValueError(f"no state checkpoint at the end of block {computed[-1].block_id}")

    def _touch(self, block: CacheBlock) -> None:
        if block.ref_cnt == 0:  # cached-free: revive it before eviction reaches it
            self.free_queue.remove(block)
        block.ref_cnt += 1

    def _take_free_block(self) -> CacheBlock:
        block = self.free_queue.popleft()
        if block.block_hash is not None:
            # Reusing a cached-free block for new content evicts its cached prefix (and the
            # state checkpoint at its end: no hit can reach it any more).
            del self.cached_blocks[block.block_hash]
            if self.checkpoints is not None:
                self.checkpoints.drop(block.block_hash)
            self._stats.evictions += 1
        block.clear_content()
        block.ref_cnt = 1
        self._stats.allocations += 1
        return block

    def _note_tokens(self, request_id: str, table: list[CacheBlock], num_tokens: int) -> None:
        # Only the blocks past the previous high-water mark change; hashed blocks are full.
        old = self._req_num_tokens.get(request_id, 0)
        new = min(max(old, num_tokens), len(table) * self.block_size)
        self._req_num_tokens[request_id] = new
        bs = self.block_size
        for i in range(old // bs, self.num_blocks_needed(new)):
            if table[i].block_hash is None:
                table[i].num_tokens = min(bs, new - i * bs)

    # ---- observation ---------------------------------------------------------------------

    def stats(self) -> CacheStats:
        num_free = len(self.free_queue)
        return replace(
            self._stats,
            num_used_blocks=self.num_usable_blocks - num_free,
            num_cached_free_blocks=sum(1 for b in self.cached_blocks.values() if b.ref_cnt == 0),
            num_free_blocks=num_free,
            num_cached_blocks=len(self.cached_blocks),
            usage=self.usage,
            num_used_state_slots=self.state_slots.num_used if self.state_slots else 0,
            num_cached_state_checkpoints=len(self.checkpoints) if self.checkpoints else 0,
            state_checkpoint_evictions=self.checkpoints.evictions if self.checkpoints else 0,
        )

    def snapshot(self) -> dict:
        """Plain-data view for stats endpoints and the inspector (one pass over the blocks)."""
        owners: dict[int, list[str]] = {}
        for request_id, table in self.req_to_blocks.items():
            for block in table:
                owners.setdefault(block.block_id, []).append(request_id)
        return {
            "block_size": self.block_size,
            "blocks": [self._block_view(b, owners.get(b.block_id, [])) for b in self.blocks],
            "requests": {rid: [b.block_id for b in t] for rid, t in self.req_to_blocks.items()},
            "free_queue": self.free_queue.block_ids(),  # eviction order, head first
            "state_slots": self.state_slots.owners() if self.state_slots else {},
            "state_checkpoints": self.checkpoints.snapshot() if self.checkpoints else None,
            "stats": self.stats().to_dict(),
        }

    @staticmethod
    def _block_view(block: CacheBlock, owners: list[str]) -> dict:
        if block.is_null:
            state = "null"
        elif block.ref_cnt > 0:
            state = "used"
        elif block.block_hash is not None:
            state = "cached"
        else:
            state = "free"
        return {
            "id": block.block_id,
            "state": state,
            "ref_cnt": block.ref_cnt,
            "owners": owners,
            "hash": _short_hash(block.block_hash),
            "num_tokens": block.num_tokens,
            "token_ids": list(block.token_ids) if block.token_ids is not None else None,
        }

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (see the module docstring)."""
        null = self.null_block
        _require(null.is_null and null.ref_cnt == 0, "null block was allocated")
        _require(null.block_hash is None and not null.in_free_queue, "null block hashed or queued")
        refs = self._count_table_refs()
        queued = {b.block_id for b in self.free_queue.check_links()}
        for block in self.free_queue:
            _require(block is self.blocks[block.block_id], f"foreign block {block.block_id} queued")
        _require(0 not in queued, "null block is in the free queue")
        for block in self.blocks[1:]:
            self._check_block(block, refs.get(block.block_id, 0), block.block_id in queued)
        for block_hash, block in self.cached_blocks.items():
            _require(block.block_hash == block_hash, f"stale map entry: {block.block_id}")
        hashed = {id(b) for b in self.blocks if b.block_hash is not None}
        _require(hashed == {id(b) for b in self.cached_blocks.values()}, "hashed block not in map")
        if self.state_slots is not None:
            self.state_slots.check_invariants(set(self.req_to_blocks))
        if self.checkpoints is not None:
            self.checkpoints.check_invariants(set(self.req_to_blocks))

    def _count_table_refs(self) -> dict[int, int]:
        refs: dict[int, int] = {}
        for request_id, table in self.req_to_blocks.items():
            ids = [b.block_id for b in table]
            _require(len(set(ids)) == len(ids), f"request {request_id!r} repeats a block: {ids}")
            for block in table:
                ok = block is self.blocks[block.block_id] and not block.is_null
                _require(ok, f"request {request_id!r} holds a foreign or null block")
                refs[block.block_id] = refs.get(block.block_id, 0) + 1
        return refs

    def _check_block(self, block: CacheBlock, num_refs: int, queued: bool) -> None:
        bid, ref_cnt = block.block_id, block.ref_cnt
        _require(ref_cnt >= 0, f"block {bid} has negative ref_cnt {ref_cnt}")
        _require(ref_cnt == num_refs, f"block {bid} ref_cnt {ref_cnt} != {num_refs} tables")
        _require((ref_cnt == 0) == queued, f"block {bid} ref_cnt {ref_cnt} but queued={queued}")
        _require(0 <= block.num_tokens <= self.block_size, f"block {bid} num_tokens out of range")
        full = block.num_tokens == self.block_size
        _require(block.block_hash is None or full, f"hashed block {bid} is not full")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)
