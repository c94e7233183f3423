"""Saving a prompt's cached KV blocks to a prefix file and loading them into an engine's cache.

The file format and its checks are ``prefix_file.py``'s; this is the engine's side: which blocks
a prompt has cached, and how loaded ones enter the block pool. Both run between steps, on the
thread that steps the engine (``AsyncEngineCore.save_prefix`` and ``load_prefix`` hand them to it).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import mlx.core as mx

from vllm_mlx.core.kv.coordinator import TakenBlock
from vllm_mlx.engine.prefix_file import (
    PrefixFileError,
    PrefixHeader,
    checksum,
    parse_prefix_file,
    read_prefix_bytes,
    write_prefix_file,
)
from vllm_mlx.models.digest import model_digest

NO_CHECKPOINTS = (
    "this model has recurrent layers and keeps no state checkpoints (max_state_checkpoints 0): "
    "a prefix file could resume nothing"
)


@dataclass
class PrefixTransfer:
    """Saves and loads prefix files for one engine."""

    engine: Any
    """The ``EngineCore`` (not imported here: the engine imports this module)."""

    @cached_property
    def model_digest(self) -> str:
        """The digest a prefix file must carry to be loaded here (taken once: it reads the files)."""
        return model_digest(self.engine.model_path)

    def save(self, prompt: str | list[int], path: str | Path, cache_salt: str | None = None) -> int:
        """Write the cached full blocks of ``prompt``'s longest cached prefix to ``path``; return
        the number of tokens saved.

        Raises:
            ValueError: none of the prompt's blocks are cached (run the prompt first), the
                prompt has images (or, to a prefix LM, attends both ways: its blocks are its own), or
                the engine cannot use prefix files (see ``_check``).
        """
        self._check()
        prepared = self.engine.prepare_prompt(prompt)
        if prepared.mm_input is not None and prepared.mm_input.images:
            raise ValueError("prefix files hold text prompts only: this prompt has images")
        if prepared.mm_input is not None:  # a prefix LM's text prompt: one span, so no other prompt shares it
            raise ValueError("prefix files hold prompts whose blocks other prompts can share: this model's prompt "
                             "attends to itself both ways (a prefix LM), so its blocks are its own")
        blocks = self.engine.scheduler.kv.prefix_cache.lookup(prepared.token_ids, cache_salt)
        if not blocks:
            raise ValueError("none of this prompt's blocks are cached: generate from it first (cache_salt included)")
        kv, pool, size = self.engine.kv_cache, self.engine.runner.pool, self.engine.kv_cache.block_size
        arrays = pool.read_blocks([b.block_id for b in blocks])
        # ``lookup`` ends where every kind can resume: the windows' blocks and a state are there.
        hashes, groups = [b.block_hash for b in blocks], _window_starts(kv, len(blocks))
        for g, first in groups:
            window = kv.groups[g].hit_table(hashes)[first:]
            arrays.update({f"group{g}.{name}": a for name, a in pool.read_blocks([b.block_id for b in window]).items()})
        if kv.state is not None:
            arrays.update(self.engine.runner.state_pool.read_slot(kv.state.checkpoints.slot_of(hashes[-1])))
        mx.eval(list(arrays.values()))
        tokens = list(prepared.token_ids[: len(blocks) * size])
        header = PrefixHeader(self.model_digest, self.engine.weight_format, size, tokens, checksum(arrays),
                              groups, kv.state is not None)  # fmt: skip
        write_prefix_file(Path(path), header, arrays)
        return len(tokens)

    @property
    def max_file_bytes(self) -> int:
        """The largest prefix file this engine could use: every block of its pool in every block
        group, its recurrent state, and room for the header (the token ids as JSON)."""
        kv, engine = self.engine.kv_cache, self.engine
        tokens = kv.pool.num_blocks * kv.block_size
        state = engine.runner.state_pool.layout.bytes_per_request if engine.runner.state_pool is not None else 0
        return tokens * engine.kv_layout.bytes_per_token * len(kv.groups) + state + 24 * tokens + (1 << 20)

    def load(self, path: str | Path, cache_salt: str | None = None, data: bytes | None = None) -> int:
        """Put the blocks of the prefix file at ``path`` into the cache (those not cached already,
        as far as free blocks allow), under ``cache_salt``; return the tokens of the file's
        prompt that are cached now.

        Raises:
            PrefixFileError: the file is unreadable or damaged, or was saved by another model,
                weight format or block size; nothing of it is loaded.
            ValueError: the engine cannot use prefix files (see ``_check``).

        ``data``: the file's bytes, read beforehand off the engine thread (``read_prefix_bytes``
        with ``max_file_bytes``); None reads ``path`` here.
        """
        self._check()
        if data is None:
            data = read_prefix_bytes(path, self.max_file_bytes)
        header, arrays = parse_prefix_file(data, str(path), check=self._check_header)
        prefix_cache = self.engine.scheduler.kv.prefix_cache
        hashes = prefix_cache.block_hashes(header.token_ids, cache_salt)
        kv, n = self.engine.kv_cache, header.num_blocks
        positions = [(i, 0) for i in range(n)] + [(i, g) for g, first in header.groups for i in range(first, n)]
        checkpoint = header.has_state and hashes[-1] not in kv.state.checkpoints
        reserved = kv.reserve_import(hashes, positions, checkpoint=checkpoint)
        written = False
        try:
            if checkpoint and reserved.checkpoint_slot is None:
                return 0  # every checkpoint slot is pinned by a running request: nothing to resume from
            if reserved.taken:
                blocks = _blocks_of(arrays, reserved.taken, header)
                self.engine.runner.pool.write_blocks(reserved.block_ids, blocks)
            if checkpoint:
                state = {name: a for name, a in arrays.items() if name.startswith("state.")}
                self.engine.runner.state_pool.write_slot(reserved.checkpoint_slot, state)
            written = True
        except ValueError as exc:
            raise PrefixFileError(f"prefix file {path} does not fit this model's KV cache: {exc}") from None
        finally:
            kv.finish_import(reserved, hashes, header.token_ids, written)
        return prefix_cache.num_cached_tokens(header.token_ids, cache_salt)

    def _check(self) -> None:
        """Prefix files need the prefix cache, one process (no tensor or pipeline ranks) and,
        with recurrent layers, state checkpoints."""
        if self.engine.tp_group is not None:
            raise ValueError("prefix files are not supported with tensor or pipeline parallelism yet")
        if not self.engine.config.enable_prefix_caching:
            raise ValueError("prefix files need the prefix cache (enable_prefix_caching)")
        if not self.engine.kv_cache.resumes_prefixes:
            raise ValueError(NO_CHECKPOINTS)

    def _check_header(self, header: PrefixHeader) -> None:
        """The file fits this engine: its model, weights and block size, its vocabulary, its pool
        and block groups (checked before any array of the file is made)."""
        kv = self.engine.kv_cache
        vocab = self.engine.vocab_size
        if vocab and header.token_ids and max(header.token_ids) >= vocab:
            raise PrefixFileError(f"the prefix file holds token id {max(header.token_ids)}; the vocabulary has {vocab}")
        if header.num_blocks >= kv.pool.num_blocks:
            raise PrefixFileError(
                f"the prefix file holds {header.num_blocks} blocks; this engine's pool has {kv.pool.num_blocks - 1}"
            )
        mine = (self.model_digest, self.engine.weight_format, kv.block_size)
        theirs = (header.model_digest, header.weight_format, header.block_size)
        for what, ours, file in zip(("model (digest)", "weight format", "block size"), mine, theirs):
            if ours != file:
                raise PrefixFileError(f"the prefix file was saved with another {what}: {file!r}, this engine's {ours!r}")
        # The same model, weights and block size plan the same groups; a file that says otherwise is damaged.
        needed = _window_starts(kv, header.num_blocks)
        fits = [g for g, _ in header.groups] == [g for g, _ in needed] and all(
            first <= need for (_, first), (_, need) in zip(header.groups, needed)
        )
        if not fits or header.has_state != (kv.state is not None):
            raise PrefixFileError(
                f"the prefix file's block groups {header.groups} (state: {header.has_state}) do not fit this engine's "
                f"{needed} (state: {kv.state is not None})"
            )


def _window_starts(kv, num_blocks: int) -> tuple[tuple[int, int], ...]:
    """(block group, first block) of each group after the first: the blocks its window still
    reaches at the end of ``num_blocks`` blocks (what a prefix file carries of that group)."""
    end = num_blocks * kv.block_size
    return tuple((g, group.first_needed_block(end)) for g, group in enumerate(kv.groups[1:], start=1))


def _blocks_of(arrays: dict[str, mx.array], taken: list[TakenBlock], header: PrefixHeader) -> dict[str, mx.array]:
    """The pool's arrays (``keys.{i}``, ``values.{i}``) for the ``taken`` blocks, in that order:
    each from its group's tensors in the file (group 0's, or ``group{g}.`` ones from their first
    block on)."""
    size, firsts = header.block_size, dict(header.groups)
    names = [name for name in arrays if name.startswith(("keys.", "values."))]
    pieces: dict[str, list[mx.array]] = {name: [] for name in names}
    for t in taken:
        prefix, offset = ("", t.index) if t.group == 0 else (f"group{t.group}.", t.index - firsts[t.group])
        for name in names:
            pieces[name].append(arrays[prefix + name][:, offset * size : (offset + 1) * size])
    return {name: mx.concatenate(parts, axis=1) for name, parts in pieces.items()}
