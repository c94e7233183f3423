"""``TokenizePool``: long texts never take every tokenizer thread (a short prompt always has one)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from vllm_mlx.entrypoints.openai.tokenize_pool import LONG_TEXT_CHARS, TokenizePool


def test_long_texts_leave_a_thread_for_short_ones():
    async def scenario() -> None:
        pool = TokenizePool(threads=2)
        release = threading.Event()
        try:
            longs = [asyncio.ensure_future(pool.run(release.wait, chars=LONG_TEXT_CHARS)) for _ in range(3)]
            await asyncio.sleep(0)
            # Both threads would be blocked by long texts in a plain pool: this would time out.
            assert await asyncio.wait_for(pool.run(lambda: "short", chars=10), timeout=30) == "short"
            assert not any(task.done() for task in longs)
        finally:
            release.set()
        assert await asyncio.gather(*longs) == [True, True, True]
        pool.shutdown()

    asyncio.run(scenario())


def test_one_thread_is_shared_by_all():
    async def scenario() -> list[int]:
        pool = TokenizePool(threads=1)
        results = await asyncio.gather(*(pool.run(lambda i=i: i, chars=i * LONG_TEXT_CHARS) for i in range(3)))
        pool.shutdown()
        return results

    assert asyncio.run(scenario()) == [0, 1, 2]


def test_no_threads_is_refused():
    with pytest.raises(ValueError, match="tokenizer threads"):
        TokenizePool(threads=0)
