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
* With block groups (``group_windows``: one entry per group, ``kv_spec.plan_block_groups``), a
  request holds one table per group over the same blocks; group 0 keeps every block and its
  table is ``req_to_blocks``. A sliding-window group's table holds the null block where its
  blocks fell wholly out of the window (``free_out_of_window``), and nowhere else. Each group has
  its own hash map (``cached[g]``; ``cached_blocks`` is group 0's); a hashed block is in the map
  of its ``group``.
* A prefix hit must be a prefix *every* layer group can resume from: a sliding-window group needs
  only the blocks its window reaches at the hit point. With recurrent layers, it
  ends where a state checkpoint is kept (``state_checkpoints.py``; none when
  ``num_state_checkpoints == 0``, and then such a model gets no prefix hits). A checkpoint goes
  with the block carrying its hash when that block is evicted.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from vllm_mlx.block_pool import BlockTable, CacheBlock, FreeBlockQueue
from vllm_mlx.state_checkpoints import StateCheckpoints
from vllm_mlx.state_slots import NULL_STATE_SLOT, StateSlots

__all__ = ["BlockTable", "CacheBlock", "CacheStats", "FreeBlockQueue", "PagedCacheManager"]


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
        group_windows: tuple[int | None, ...] = (None,),
    ) -> None:
        """``num_state_slots`` (the null slot included): recurrent-state slots, one per running
        request; 0 for a model without recurrent layers. ``num_state_checkpoints``: further state
        slots, numbered after those, that keep states at block boundaries for prefix hits.
        ``group_windows``: the sliding window of each block group (None: keeps every block; the
        first group must)."""
        if not group_windows or group_windows[0] is not None:
            raise ValueError(f"the first block group must keep every block, got windows {group_windows}")
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
        self.group_windows = tuple(group_windows)
        self.cached: list[dict[bytes, CacheBlock]] = [{} for _ in self.group_windows]
        self.cached_blocks = self.cached[0]
        self.req_to_blocks: dict[str, list[CacheBlock]] = {}
        self._other_tables: dict[str, list[list[CacheBlock]]] = {}  # groups 1.. (with block groups)
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

    def get_block_tables(self, request_id: str) -> list[list[int]]:
        """The request's table of every block group (block 0 where a block left the window)."""
        return [[b.block_id for b in table] for table in self._tables(request_id)]

    def token_capacity(self, max_step_tokens: int) -> int:
        """The longest sequence one request can hold alone while computing at most
        ``max_step_tokens`` tokens per step: every full-attention group holds all of its
        blocks, a sliding-window group only those its window and one step reach."""
        reach = [None if w is None else self.num_blocks_needed(w - 1 + max_step_tokens) + 1 for w in self.group_windows]

        def blocks_held(num_blocks: int) -> int:
            return sum(num_blocks if r is None else min(num_blocks, r) for r in reach)

        low, high = 0, self.num_usable_blocks  # the most blocks per table that fit: bisect
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if blocks_held(mid) <= self.num_usable_blocks else (low, mid - 1)
        return low * self.block_size

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
        num_hit = self.num_cached_blocks(block_hashes)
        while num_hit and not self._resumable(block_hashes, num_hit):
            num_hit -= 1
        return [self.cached_blocks[h] for h in block_hashes[:num_hit]]

    def _resumable(self, block_hashes: list[bytes], num_hit: int) -> bool:
        """Whether every group can resume after the first ``num_hit`` blocks (group 0 has them):
        the other groups hold the blocks their window reaches, and a state checkpoint is kept
        there (models with recurrent layers)."""
        if self.checkpoints is not None and block_hashes[num_hit - 1] not in self.checkpoints:
            return False
        for group in range(1, len(self.group_windows)):
            first = self._first_needed_block(group, num_hit * self.block_size)
            if any(h not in self.cached[group] for h in block_hashes[first:num_hit]):
                return False
        return True

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
        is_new = request_id not in self.req_to_blocks
        tables = [[] for _ in self.group_windows] if is_new else self._tables(request_id)
        computed = list(computed_blocks or ())
        hit_tables = self._hit_tables(request_id, tables[0], computed)
        num_needed = self.num_blocks_needed(num_tokens_total)
        num_new = [max(0, num_needed - len(t) - len(h)) for t, h in zip(tables, hit_tables)]
        num_revived = sum(1 for hits in hit_tables for b in hits if b.ref_cnt == 0 and not b.is_null)
        if sum(num_new) + num_revived > len(self.free_queue):
            return None
        if self.state_slots is not None and is_new:
            if self.state_slots.num_free == 0:
                return None
            self.state_slots.take(request_id)

        if computed and self.checkpoints is not None:
            self.checkpoints.pin(request_id, computed[-1].block_hash)
        self.req_to_blocks[request_id] = tables[0]
        if len(tables) > 1:
            self._other_tables[request_id] = tables[1:]
        if computed or request_id not in self.num_cached_tokens:
            self.num_cached_tokens[request_id] = len(computed) * self.block_size
        for table, hits in zip(tables, hit_tables):  # every hit leaves the free queue first,
            for block in hits:  # so that no group's new block evicts another group's hit
                if not block.is_null:
                    self._touch(block)
            table.extend(hits)
        new_ids: list[int] = []
        for table, count in zip(tables, num_new):
            new_blocks = [self._take_free_block() for _ in range(count)]
            table.extend(new_blocks)
            new_ids += [b.block_id for b in new_blocks]
        self._note_tokens(request_id, tables, max(num_tokens_total, len(computed) * self.block_size))
        return new_ids

    def free_out_of_window(self, request_id: str, num_computed_tokens: int) -> int:
        """Give back the blocks of the request's sliding-window groups that no query from
        ``num_computed_tokens`` on can see (they become the null block in its tables); the
        number of blocks freed. A hashed one stays cached-free for later prefix hits."""
        freed = 0
        for group, table in enumerate(self._tables(request_id)):
            # Null entries are a prefix: walk back from the first needed block to the last freed
            # one, so each step costs the blocks it frees, not the whole sequence.
            i = min(self._first_needed_block(group, num_computed_tokens), len(table)) - 1
            while i >= 0 and not table[i].is_null:
                self._release(table[i])
                table[i] = self.null_block
                freed += 1
                i -= 1
        return freed

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
        for group, group_table in enumerate(self._tables(request_id)):
            cached = self.cached[group]
            for i in range(num_full_blocks):
                block, block_hash = group_table[i], block_hashes[i]
                if block.is_null or block.block_hash is not None or block_hash in cached:
                    continue
                block.block_hash, block.group = block_hash, group
                block.token_ids = tuple(token_ids[i * bs : (i + 1) * bs])
                block.num_tokens = bs
                cached[block_hash] = block

    def free(self, request_id: str) -> None:
        """Release the request's blocks; unknown ids are ignored (abort after finish is fine).

        Blocks reaching ``ref_cnt == 0`` go to the queue's tail in *reverse* table order, so a
        request's tail blocks are evicted before its head blocks: a block's hash chains all
        blocks before it, so the head (system prompt, shared instructions) is reused by many
        more later prompts than the tail is.
        """
        tables = self._tables(request_id) if request_id in self.req_to_blocks else None
        self.req_to_blocks.pop(request_id, None)
        self._other_tables.pop(request_id, None)
        self.num_cached_tokens.pop(request_id, None)
        self._req_num_tokens.pop(request_id, None)
        if self.state_slots is not None:
            self.state_slots.release(request_id)
        if self.checkpoints is not None:
            self.checkpoints.release(request_id)
        if tables is None:
            return
        for position in reversed(range(len(tables[0]))):  # tails first, across the groups
            for table in tables:
                if not table[position].is_null:
                    self._release(table[position])

    def _release(self, block: CacheBlock) -> None:
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
        for cached in self.cached:
            for block_hash, block in list(cached.items()):
                if block.ref_cnt == 0:
                    del cached[block_hash]
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

    def _tables(self, request_id: str) -> list[list[CacheBlock]]:
        """The request's table of every group (group 0's first); empty when it holds none."""
        table = self.req_to_blocks.get(request_id)
        if table is None:
            return []
        return [table, *self._other_tables.get(request_id, ())]

    def _first_needed_block(self, group: int, num_computed_tokens: int) -> int:
        """The first block a query at position ``num_computed_tokens`` or later still sees in
        ``group`` (0 without a window)."""
        window = self.group_windows[group]
        return 0 if window is None else max(0, num_computed_tokens - window + 1) // self.block_size

    def _hit_tables(self, request_id: str, table: list[CacheBlock], computed: list[CacheBlock]) -> list[list[CacheBlock]]:
        """Per group, the blocks a hit on ``computed`` (group 0's) puts at the head of the
        request's tables: the null block before a sliding window's reach."""
        if not computed:
            return [[] for _ in self.group_windows]
        self._check_computed(request_id, table, computed)
        hashes = [b.block_hash for b in computed]
        hit_tables = [computed]
        for group in range(1, len(self.group_windows)):
            first = self._first_needed_block(group, len(computed) * self.block_size)
            blocks = [self.cached[group].get(h) for h in hashes[first:]]
            if any(b is None for b in blocks):
                raise ValueError(f"block group {group} does not hold the hit's blocks")
            hit_tables.append([self.null_block] * first + blocks)
        return hit_tables

    def _touch(self, block: CacheBlock) -> None:
        if block.ref_cnt == 0:  # cached-free: revive it before eviction reaches it
            self.free_queue.remove(block)
        block.ref_cnt += 1

    def _take_free_block(self) -> CacheBlock:
        block = self.free_queue.popleft()
        if block.block_hash is not None:
            # Reusing a cached-free block for new content evicts its cached prefix (and the
            # state checkpoint at its end: no hit can reach it any more).
            del self.cached[block.group][block.block_hash]
            if self.checkpoints is not None:
                self.checkpoints.drop(block.block_hash)
            self._stats.evictions += 1
        block.clear_content()
        block.ref_cnt = 1
        self._stats.allocations += 1
        return block

    def _note_tokens(self, request_id: str, tables: list[list[CacheBlock]], num_tokens: int) -> None:
        # Only the blocks past the previous high-water mark change; hashed blocks are full.
        old = self._req_num_tokens.get(request_id, 0)
        new = min(max(old, num_tokens), len(tables[0]) * self.block_size)
        self._req_num_tokens[request_id] = new
        bs = self.block_size
        for table in tables:
            for block_index in range(old // bs, self.num_blocks_needed(new)):
                block = table[block_index]
                if block.block_hash is None and not block.is_null:
                    block.num_tokens = min(bs, new - block_index * bs)

    # ---- observation ---------------------------------------------------------------------

    def stats(self) -> CacheStats:
        num_free = len(self.free_queue)
        return replace(
            self._stats,
            num_used_blocks=self.num_usable_blocks - num_free,
            num_cached_free_blocks=sum(1 for c in self.cached for b in c.values() if b.ref_cnt == 0),
            num_free_blocks=num_free,
            num_cached_blocks=sum(map(len, self.cached)),
            usage=self.usage,
            num_used_state_slots=self.state_slots.num_used if self.state_slots else 0,
            num_cached_state_checkpoints=len(self.checkpoints) if self.checkpoints else 0,
            state_checkpoint_evictions=self.checkpoints.evictions if self.checkpoints else 0,
        )

    def snapshot(self) -> dict:
        """Plain-data view for stats endpoints and the inspector (one pass over the blocks)."""
        owners: dict[int, list[str]] = {}
        held: dict[str, list[int]] = {}  # per request, the blocks of all its tables
        for request_id in self.req_to_blocks:
            held[request_id] = [b.block_id for t in self._tables(request_id) for b in t if not b.is_null]
            for block_id in held[request_id]:
                owners.setdefault(block_id, []).append(request_id)
        return {
            "block_size": self.block_size,
            "blocks": [self._block_view(b, owners.get(b.block_id, [])) for b in self.blocks],
            "requests": held,
            "tables": {rid: self.get_block_tables(rid) for rid in self.req_to_blocks},  # per group
            "block_groups": self.block_group_usage(),
            "free_queue": self.free_queue.block_ids(),  # eviction order, head first
            "state_slots": self.state_slots.owners() if self.state_slots else {},
            "state_checkpoints": self.checkpoints.snapshot() if self.checkpoints else None,
            "stats": self.stats().to_dict(),
        }

    def block_group_usage(self) -> list[dict]:
        """Per block group: its window and how many blocks its tables hold now."""
        return [{"window": w, "num_used_blocks": self._num_held(g)} for g, w in enumerate(self.group_windows)]

    def _num_held(self, group: int) -> int:
        """Distinct blocks the requests' tables of ``group`` hold."""
        tables = (self._tables(rid)[group] for rid in self.req_to_blocks)
        return len({b.block_id for table in tables for b in table if not b.is_null})

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
        for group, cached in enumerate(self.cached):
            for block_hash, block in cached.items():
                _require(block.block_hash == block_hash and block.group == group, f"stale map entry: {block.block_id}")
        hashed = {id(b) for b in self.blocks if b.block_hash is not None}
        _require(hashed == {id(b) for c in self.cached for b in c.values()}, "hashed block not in map")
        if self.state_slots is not None:
            self.state_slots.check_invariants(set(self.req_to_blocks))
        if self.checkpoints is not None:
            self.checkpoints.check_invariants(set(self.req_to_blocks))

    def _count_table_refs(self) -> dict[int, int]:
        refs: dict[int, int] = {}
        for request_id in self.req_to_blocks:
            tables = self._tables(request_id)
            _require(len(tables) == len(self.group_windows), f"request {request_id!r} lacks a group's table")
            _require(len({len(t) for t in tables}) == 1, f"request {request_id!r}'s tables differ in length")
            ids = [b.block_id for t in tables for b in t if not b.is_null]
            _require(len(set(ids)) == len(ids), f"request {request_id!r} repeats a block: {ids}")
            for group, table in enumerate(tables):
                self._check_table(request_id, group, table)
                for block in table:
                    refs[block.block_id] = refs.get(block.block_id, 0) + (not block.is_null)
        return refs

    def _check_table(self, request_id: str, group: int, table: list[CacheBlock]) -> None:
        """Own blocks only; null entries only in a sliding-window group, and only at its head."""
        for block in table:
            _require(block is self.blocks[block.block_id], f"request {request_id!r} holds a foreign block")
        num_null = sum(b.is_null for b in table)
        windowed = self.group_windows[group] is not None
        _require(num_null == 0 or windowed, f"request {request_id!r} has a null block in full group {group}")
        _require(all(b.is_null for b in table[:num_null]), f"request {request_id!r}: null block after a live one")

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
