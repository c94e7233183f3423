"""Where the server tokenizes: worker threads off the event loop, shared by every client.

Hugging Face tokenizers release the GIL, so ``threads`` prompts tokenize at once. A long text
(``LONG_TEXT_CHARS`` or more) takes a thread for up to seconds: long texts may hold all the
threads but one, so a short prompt never queues behind them (a prompt too long for the context
never gets here: the serving refuses it from its length, ``token_bound``).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

LONG_TEXT_CHARS = 32_768
"""About 20 ms of tokenizing: texts this long share the threads all but one leaves them."""


class TokenizePool:
    def __init__(self, threads: int = 4) -> None:
        if threads < 1:
            raise ValueError(f"tokenizer threads must be >= 1, got {threads}")
        self.executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="vllm-mlx-tokenize")
        self.long_slots = asyncio.Semaphore(max(1, threads - 1))

    async def run(self, fn, *args, chars: int = 0):
        """``fn(*args)`` in a worker thread; ``chars``: how much text it tokenizes."""
        loop = asyncio.get_running_loop()
        if chars < LONG_TEXT_CHARS:
            return await loop.run_in_executor(self.executor, fn, *args)
        async with self.long_slots:
            return await loop.run_in_executor(self.executor, fn, *args)

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
