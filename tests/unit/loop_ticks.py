"""How free an event loop stayed while something ran on it: for tests of work moved off the loop."""

from __future__ import annotations

import asyncio
from typing import Awaitable, TypeVar

T = TypeVar("T")


async def with_loop_ticks(awaitable: Awaitable[T], period_s: float = 0.01) -> tuple[T, int]:
    """What `awaitable` returns, and how many times a task sleeping `period_s` woke while it ran."""
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(period_s)
            ticks += 1

    ticker = asyncio.create_task(tick())
    try:
        return await awaitable, ticks
    finally:
        ticker.cancel()
