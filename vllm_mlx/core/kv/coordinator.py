"""The KV cache coordinator: one block pool, one manager per kind, one record per request.

Pure bookkeeping — no MLX, no arrays (vLLM v1's ``KVCacheCoordinator``). The KV tensors live in
a per-layer block pool elsewhere; this decides which physical block holds which tokens of which
request, over one ``BlockPool`` (``block_pool.py``) shared by every block group, and drives:

* one block manager per block group (``kv_managers.FullAttentionManager`` /
  ``SlidingWindowManager``; ``group_windows``: one window per group, group 0 keeps every block);
* a ``RecurrentStateManager`` for models with recurrent layers (``num_state_slots > 0``).

Invariants (checked by ``kv_observation.check_invariants``):

* Block 0 is the *null* block: never allocated, never freed, never hashed, in no table but a
  sliding-window group's, where blocks fell wholly out of the window.
* Every other block is in exactly one of two places: the free queue (``ref_cnt == 0``) or the
  tables of the requests that use it (``ref_cnt`` equals the number of tables containing it).
* Each group has its own hash map (``pool.cached[g]``); each hash maps to the one block carrying
  it, and every hashed block is in the map of its ``group`` (a block whose content duplicates an
  already registered block simply stays unhashed).
* Each request has one record (``records.RequestCache``) from its first lookup to its end, and
  nothing else keeps anything per request: its tables, hashes, state slot and checkpoints are
  all on it, so ending a request (``free``, then ``forget``) is its record going away.
* A request holding blocks holds one table per group (``RequestCache.tables``), all of the same
  length, and, with recurrent layers, one state slot (``RequestCache.state_slot``: taken with
  its first allocation, freed with its blocks).
* A prefix hit must be a prefix *every* kind can resume from: a sliding-window group needs only
  the blocks its window reaches at the hit point; recurrent layers need a state checkpoint kept
  there (none when ``num_state_checkpoints == 0``: then the model gets no prefix hits). A
  checkpoint goes with the block carrying its hash when that block is evicted.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_mlx.core.kv.block_pool import BlockPool, CacheBlock
from vllm_mlx.core.kv.managers import FullAttentionManager, RecurrentStateManager, block_group_manager
from vllm_mlx.core.kv.records import RequestCache, RequestRecords

__all__ = ["KVCacheCoordinator", "RequestCache"]


@dataclass(frozen=True)
class TakenBlock:
    """A free block taken to receive the KV of one position of a chain in one block group."""

    index: int
    """Its position in the chain (``block_hashes[index]`` is the hash it is published under)."""
    group: int
    block: CacheBlock
    """Blank, ref 1, in no hash map until ``finish_import``."""


@dataclass
class BlockImport:
    """Blocks reserved for KV read from disk (``KVCacheCoordinator.reserve_import``)."""

    held: list[CacheBlock]
    """Blocks of the chain cached already: held (ref + 1) until ``finish_import``."""
    taken: list[TakenBlock]
    """The blocks to fill, in the order the positions were asked for."""
    checkpoint_slot: int | None = None
    """A state-checkpoint slot to fill with the recurrent state after the chain's last block
    (when asked for and one could be had)."""

    @property
    def block_ids(self) -> list[int]:
        """The ids of the blocks to fill, in ``taken``'s order."""
        return [t.block.block_id for t in self.taken]


class KVCacheCoordinator:
    """Hands blocks (and state slots) to requests, over one pool and a manager per kind.

    Not thread-safe: the engine thread owns it; other threads read snapshots.
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
        self.pool = BlockPool(num_blocks, block_size, len(group_windows))
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.group_windows = tuple(group_windows)
        self.groups: list[FullAttentionManager] = [
            block_group_manager(self.pool, g, w) for g, w in enumerate(self.group_windows)
        ]
        self.requests = RequestRecords()
        """Every request's one record (``records.RequestCache``), by id: the requests holding
        blocks in the order they took their first blocks."""
        self.state: RecurrentStateManager | None = None
        if num_state_slots:
            self.state = RecurrentStateManager(num_state_slots, num_state_checkpoints, enable_caching, self.requests)
        self.pool.on_evict = self.state.drop_checkpoint if self.state else None
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found

    # ---- queries -------------------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        """Blocks an allocation could take, cached-free ones included."""
        return self.pool.get_num_free_blocks()

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def request_cache(self, request_id: str) -> RequestCache:
        """The request's record, made on first use (``forget`` ends it)."""
        return self.requests.record(request_id)

    def get_block_tables(self, request_id: str) -> list[list[int]]:
        """The request's table of every block group (block 0 where a block left the window)."""
        return [[b.block_id for b in table] for table in self._tables(request_id)]

    def token_capacity(self, max_step_tokens: int) -> int:
        """The longest sequence one request can hold alone while computing at most
        ``max_step_tokens`` tokens per step: every full-attention group holds all of its
        blocks, a sliding-window group only those its window and one step reach."""
        usable = self.pool.num_usable_blocks

        def blocks_held(num_blocks: int) -> int:
            return sum(group.blocks_held(num_blocks, max_step_tokens) for group in self.groups)

        low, high = 0, usable  # the most blocks per table that fit: bisect
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if blocks_held(mid) <= usable else (low, mid - 1)
        return low * self.block_size

    def blocks_for_first_chunk(self, num_tokens: int) -> int:
        """Blocks a request's first chunk of ``num_tokens`` tokens takes, over every group."""
        return len(self.groups) * self.num_blocks_needed(num_tokens)

    @property
    def resumes_prefixes(self) -> bool:
        """Whether every kind can resume a request from a cached prefix: recurrent layers only
        from state checkpoints."""
        return self.enable_caching and (self.state is None or self.state.checkpoints is not None)

    def get_computed_blocks(self, request_id: str, block_hashes: list[bytes]) -> list[CacheBlock]:
        """Blocks for the longest prefix of ``block_hashes`` already cached; ref counts untouched.

        Hashes chain their parents, so the first miss ends the run. The run is cut back to its
        last block that every kind can resume after (a sliding window's blocks, a state
        checkpoint). Capping the hit so that at least one token is still computed (to get
        logits) is the caller's business. Empty when some kind cannot resume a cached prefix.
        """
        if not self.resumes_prefixes:
            return []
        num_hit = self.num_cached_blocks(block_hashes)
        while num_hit and not self._resumable(block_hashes[:num_hit]):
            num_hit -= 1
        return [self.pool.cached[0][h] for h in block_hashes[:num_hit]]

    def num_cached_blocks(self, block_hashes: list[bytes]) -> int:
        """How many leading blocks of ``block_hashes`` are cached (whatever the other kinds)."""
        cached = self.pool.cached[0]
        for i, block_hash in enumerate(block_hashes):
            if block_hash not in cached:
                return i
        return len(block_hashes)

    # ---- mutations -----------------------------------------------------------------------

    def allocate_slots(
        self, request_id: str, num_tokens_total: int, computed_blocks: list[CacheBlock] | None = None
    ) -> list[int] | None:
        """Make the request's tables cover ``num_tokens_total`` tokens; return the new block ids.

        On the request's first allocation, ``computed_blocks`` (from ``get_computed_blocks``)
        head its tables: each gets ``ref_cnt += 1`` and leaves the free queue if it was
        cached-free, and the request takes a recurrent-state slot (models with recurrent layers)
        and pins the state checkpoint of the hit's last block (read by its first step).
        New blocks come from the free queue's head (evicting any hash they carry).
        All-or-nothing: returns ``None`` and changes nothing when the free queue is too short
        or no state slot is free.
        """
        record = self.requests.get(request_id)
        is_new = record is None or record.tables is None
        tables = [[] for _ in self.groups] if is_new else record.tables
        computed = list(computed_blocks or ())
        hit_tables = self._hit_tables(request_id, tables[0], computed)
        num_needed = self.num_blocks_needed(num_tokens_total)
        num_new = [max(0, num_needed - len(t) - len(h)) for t, h in zip(tables, hit_tables)]
        num_revived = sum(1 for hits in hit_tables for b in hits if b.ref_cnt == 0 and not b.is_null)
        if sum(num_new) + num_revived > self.pool.get_num_free_blocks():
            return None
        if self.state is not None and is_new and not self.state.has_free_slot():
            return None

        if is_new:  # holders stay in the order they took their first blocks
            record = self.requests.pop(request_id, None) or RequestCache(request_id)
            self.requests[request_id] = record
            if self.state is not None:  # on the record: its slot, the checkpoint its hit resumes from
                self.state.take_slot(request_id, computed[-1].block_hash if computed else None)
        record.tables = tables
        if computed or is_new:
            record.num_cached_tokens = len(computed) * self.block_size
        for table, hits in zip(tables, hit_tables):  # every hit leaves the free queue first,
            for block in hits:  # so that no group's new block evicts another group's hit
                if not block.is_null:
                    self.pool.touch(block)
            table.extend(hits)
        new_ids: list[int] = []
        for table, count in zip(tables, num_new):
            new_blocks = [self.pool.take() for _ in range(count)]
            table.extend(new_blocks)
            new_ids += [b.block_id for b in new_blocks]
        self._note_tokens(record, max(num_tokens_total, len(computed) * self.block_size))
        return new_ids

    def free_out_of_window(self, request_id: str, num_computed_tokens: int) -> int:
        """Give back the blocks of the request's sliding-window groups that no query from
        ``num_computed_tokens`` on can see (they become the null block in its tables); the
        number of blocks freed. A hashed one stays cached-free for later prefix hits."""
        tables = self._tables(request_id)
        return sum(group.remove_skipped_blocks(table, num_computed_tokens) for group, table in zip(self.groups, tables))

    def cache_full_blocks(
        self, request_id: str, block_hashes: list[bytes], token_ids: list[int], num_full_blocks: int
    ) -> None:
        """Register the request's first ``num_full_blocks`` blocks for prefix reuse, in every
        group (see ``FullAttentionManager.cache_blocks``)."""
        if not self.enable_caching:
            return
        tables = self._tables(request_id)
        if not tables:
            raise KeyError(f"unknown request {request_id!r}")
        if num_full_blocks > min(len(tables[0]), len(block_hashes)):
            raise ValueError(
                f"{num_full_blocks} full blocks, but the table has {len(tables[0])} blocks "
                f"and {len(block_hashes)} hashes were given"
            )
        if len(token_ids) < num_full_blocks * self.block_size:
            raise ValueError(f"{len(token_ids)} token ids cannot fill {num_full_blocks} blocks")
        for group, table in zip(self.groups, tables):
            group.cache_blocks(table, block_hashes, token_ids, num_full_blocks)

    # ---- blocks from elsewhere (the KV disk tier, prefix files) --------------------------------

    def reserve_import(
        self, block_hashes: list[bytes], positions: list[tuple[int, int]] | None = None, checkpoint: bool = False
    ) -> BlockImport:
        """Blocks to receive the KV of ``block_hashes`` (a chain, as a prompt's blocks) at
        ``positions``: (index in the chain, block group) pairs, by default every index in group
        0. The positions cached already are held (so that taking blocks cannot evict them), the
        rest get free blocks, in the order given, while the pool has them; with ``checkpoint``,
        a state-checkpoint slot for the state after the chain's last block too. The caller
        writes the taken blocks' KV (and the state), then calls ``finish_import`` whatever
        happens.

        Raises:
            ValueError: prefix caching is off, or the model has recurrent layers and the chain's
                last block has no checkpoint kept, none is asked for, or none can be kept (the
                blocks alone resume nothing).
        """
        if not self.enable_caching:
            raise ValueError("prefix caching is off: there is no cache to import blocks into")
        if self.state is not None:
            kept = bool(block_hashes) and self.state.has_checkpoint(block_hashes[-1])
            if self.state.checkpoints is None or not (checkpoint or kept):
                raise ValueError("imported blocks hold attention KV: this model has recurrent layers, "
                                 "whose state must come with them as a checkpoint")  # fmt: skip
        if positions is None:
            positions = [(i, 0) for i in range(len(block_hashes))]
        held: list[CacheBlock] = []
        missing: list[tuple[int, int]] = []
        for i, group in positions:  # hold every cached one first: no take below may evict it
            block = self.pool.cached[group].get(block_hashes[i])
            if block is None:
                missing.append((i, group))
            else:
                self.pool.touch(block)
                held.append(block)
        taken: list[TakenBlock] = []
        for i, group in missing[: self.pool.get_num_free_blocks()]:  # as many as there are free blocks
            taken.append(TakenBlock(i, group, self.pool.take()))
        slot = self.state.checkpoints.take_for_import() if checkpoint and self.state is not None else None
        return BlockImport(held, taken, slot)

    def finish_import(
        self, reserved: BlockImport, block_hashes: list[bytes], token_ids: list[int], succeeded: bool
    ) -> int:
        """Publish the taken blocks (their KV written: ``succeeded``) under their hashes in their
        groups, marked ``from_disk``, and the checkpoint slot under the chain's last hash; or
        give them back blank. Release everything held. Returns the blocks published."""
        size = self.block_size
        if succeeded:
            for t in reserved.taken:
                tokens = tuple(token_ids[t.index * size : (t.index + 1) * size])
                self.pool.cache_block(t.block, t.group, block_hashes[t.index], tokens)
                t.block.from_disk = True
        if reserved.checkpoint_slot is not None:  # kept only beside its block (evicted with it)
            checkpoints = self.state.checkpoints
            if succeeded and block_hashes[-1] in self.pool.cached[0]:
                checkpoints.publish_import(block_hashes[-1], reserved.checkpoint_slot)
            else:
                checkpoints.give_back(reserved.checkpoint_slot)
        for block in [t.block for t in reserved.taken] + reserved.held:
            self.pool.release(block)
        return len(reserved.taken) if succeeded else 0

    def free(self, request_id: str) -> None:
        """Release the request's blocks and state slot; unknown ids are ignored (abort after
        finish is fine). Its hashes stay until ``forget``.

        Blocks reaching ``ref_cnt == 0`` go to the queue's tail in *reverse* table order, so a
        request's tail blocks are evicted before its head blocks: a block's hash chains all
        blocks before it, so the head (system prompt, shared instructions) is reused by many
        more later prompts than the tail is.
        """
        record = self.requests.get(request_id)
        if self.state is not None:
            self.state.release(request_id)
        if record is None:
            return
        tables, record.tables = record.tables, None
        record.num_cached_tokens = record.num_tokens = 0
        self.requests.discard_if_empty(request_id)
        for position in reversed(range(len(tables[0]) if tables else 0)):  # tails first, across the groups
            for table in tables:
                if not table[position].is_null:
                    self.pool.release(table[position])

    def forget(self, request_id: str) -> None:
        """The request is over: drop its hashes (and its record, once it holds no blocks)."""
        record = self.requests.get(request_id)
        if record is not None:
            record.block_hashes, record.branch_point = [], None
            self.requests.discard_if_empty(request_id)

    def reset_prefix_cache(self) -> bool:
        """Forget the hashes of every free block (they become plain free, queue order kept),
        and the state checkpoints no request reads. Blocks in use keep their hashes: requests
        still point at them and their content is still valid. Always succeeds: True."""
        self.pool.reset_prefix_cache()
        if self.state is not None:
            self.state.reset()
        return True

    def record_prefix_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Hook for the prefix cache layer to account a lookup (in tokens)."""
        self.prefix_queries += num_query_tokens
        self.prefix_hits += num_hit_tokens

    # ---- internals -----------------------------------------------------------------------

    def _tables(self, request_id: str) -> list[list[CacheBlock]]:
        """The request's table of every group (group 0's first); empty when it holds none."""
        record = self.requests.get(request_id)
        return [] if record is None or record.tables is None else record.tables

    def _resumable(self, block_hashes: list[bytes]) -> bool:
        """Whether every kind can resume after ``block_hashes`` (group 0 holds them): the other
        groups hold the blocks their window reaches, and a state checkpoint is kept there."""
        if self.state is not None and not self.state.has_checkpoint(block_hashes[-1]):
            return False
        return all(group.hit_table(block_hashes) is not None for group in self.groups[1:])

    def _hit_tables(
        self, request_id: str, table: list[CacheBlock], computed: list[CacheBlock]
    ) -> list[list[CacheBlock]]:
        """Per group, the blocks a hit on ``computed`` (group 0's) puts at the head of the
        request's tables: the null block before a sliding window's reach."""
        if not computed:
            return [[] for _ in self.groups]
        self._check_computed(request_id, table, computed)
        hashes = [b.block_hash for b in computed]
        hit_tables = [computed]
        for group in self.groups[1:]:
            hits = group.hit_table(hashes)
            if hits is None:
                raise ValueError(f"block group {group.group} does not hold the hit's blocks")
            hit_tables.append(hits)
        return hit_tables

    def _check_computed(self, request_id: str, table: list[CacheBlock], computed: list[CacheBlock]) -> None:
        # Validate before any mutation so a bad call cannot leave half-done state behind.
        if table:
            raise ValueError(f"request {request_id!r} already has blocks; hits only come first")
        if len({id(b) for b in computed}) != len(computed):
            raise ValueError("computed_blocks contains the same block twice")
        for block in computed:
            if block.block_hash is None or self.pool.cached[0].get(block.block_hash) is not block:
                raise ValueError(f"block {block.block_id} is not a cached block")
        keeps_checkpoints = self.state is not None and self.state.checkpoints is not None
        if keeps_checkpoints and not self.state.has_checkpoint(computed[-1].block_hash):
            raise ValueError(f"no state checkpoint at the end of block {computed[-1].block_id}")

    def _note_tokens(self, record: RequestCache, num_tokens: int) -> None:
        # Only the blocks past the previous high-water mark change; hashed blocks are full.
        old, tables, bs = record.num_tokens, record.tables, self.block_size
        new = min(max(old, num_tokens), len(tables[0]) * bs)
        record.num_tokens = new
        for table in tables:
            for block_index in range(old // bs, self.num_blocks_needed(new)):
                block = table[block_index]
                if block.block_hash is None and not block.is_null:
                    block.num_tokens = min(bs, new - block_index * bs)
