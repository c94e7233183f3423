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

from vllm_mlx.engine.prefix_file import PrefixFileError, PrefixHeader, checksum, read_prefix_file, write_prefix_file
from vllm_mlx.models.digest import model_digest

NOT_COVERED = (
    "prefix files hold attention KV of one block group: this model has recurrent layers or "
    "sliding-window groups, which they do not cover yet"
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
                prompt has images, or the engine cannot use prefix files (see ``_check``).
        """
        self._check()
        prepared = self.engine.prepare_prompt(prompt)
        if prepared.mm_input is not None:
            raise ValueError("prefix files hold text prompts only: this prompt has images")
        blocks = self.engine.scheduler.kv.prefix_cache.lookup(prepared.token_ids, cache_salt)
        if not blocks:
            raise ValueError("none of this prompt's blocks are cached: generate from it first (cache_salt included)")
        size = self.engine.kv_cache.block_size
        arrays = self.engine.runner.pool.read_blocks([b.block_id for b in blocks])
        mx.eval(list(arrays.values()))
        tokens = list(prepared.token_ids[: len(blocks) * size])
        header = PrefixHeader(self.model_digest, self.engine.weight_format, size, tokens, checksum(arrays))
        write_prefix_file(Path(path), header, arrays)
        return len(tokens)

    def load(self, path: str | Path, cache_salt: str | None = None) -> int:
        """Put the blocks of the prefix file at ``path`` into the cache (those not cached already,
        as far as free blocks allow), under ``cache_salt``; return the tokens of the file's
        prompt that are cached now.

        Raises:
            PrefixFileError: the file is unreadable or damaged, or was saved by another model,
                weight format or block size; nothing of it is loaded.
            ValueError: the engine cannot use prefix files (see ``_check``).
        """
        self._check()
        header, arrays = read_prefix_file(Path(path))
        self._check_header(header)
        hashes = self.engine.scheduler.kv.prefix_cache.block_hashes(header.token_ids, cache_salt)
        kv = self.engine.kv_cache
        reserved = kv.reserve_import(hashes)
        written = False
        try:
            if reserved.taken:
                wanted = [t.index for t in reserved.taken]
                self.engine.runner.pool.write_blocks(reserved.block_ids, _blocks_of(arrays, wanted, header.block_size))
            written = True
        except ValueError as exc:
            raise PrefixFileError(f"prefix file {path} does not fit this model's KV cache: {exc}") from None
        finally:
            kv.finish_import(reserved, hashes, header.token_ids, written)
        return (len(reserved.held) + len(reserved.taken)) * header.block_size

    def _check(self) -> None:
        """Prefix files need the prefix cache, one process (no tensor or pipeline ranks) and a
        model whose cache is attention KV in one block group."""
        if self.engine.tp_group is not None:
            raise ValueError("prefix files are not supported with tensor or pipeline parallelism yet")
        if not self.engine.config.enable_prefix_caching:
            raise ValueError("prefix files need the prefix cache (enable_prefix_caching)")
        kv = self.engine.kv_cache
        if kv.state is not None or len(kv.groups) > 1:
            raise ValueError(NOT_COVERED)

    def _check_header(self, header: PrefixHeader) -> None:
        mine = (self.model_digest, self.engine.weight_format, self.engine.kv_cache.block_size)
        theirs = (header.model_digest, header.weight_format, header.block_size)
        for what, ours, file in zip(("model (digest)", "weight format", "block size"), mine, theirs):
            if ours != file:
                raise PrefixFileError(f"the prefix file was saved with another {what}: {file!r}, this engine's {ours!r}")


def _blocks_of(arrays: dict[str, mx.array], indices: list[int], block_size: int) -> dict[str, mx.array]:
    """The slots of blocks ``indices`` (of the file's chain) in each array, in that order."""
    slots = mx.array([i * block_size + j for i in indices for j in range(block_size)])
    return {name: array[:, slots] for name, array in arrays.items()}
