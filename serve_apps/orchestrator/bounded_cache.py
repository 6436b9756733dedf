"""A cache of values made on a miss, bounded by what its entries cost rather than by their number.

Why: the orchestrator keeps what its checks make from client-supplied text (the values a compression scan
found in a message, a tool pattern compiled as ECMAScript reads it), whose sizes range over orders of
magnitude; a bound on the number of entries held a few bytes or gigabytes alike.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Generic, Hashable, TypeVar

V = TypeVar("V")


class CostBoundedCache(Generic[V]):
    """Values by key, least recently used first out beyond `max_cost` in all (`cost` of each value; the last
    value made always stays). Thread-safe; a value is made outside the lock, so two threads missing the same
    key both make it and the first kept wins."""

    def __init__(self, max_cost: int, cost: Callable[[V], int]) -> None:
        self._max_cost = max_cost
        self._cost = cost
        self.total_cost = 0
        self._values: OrderedDict[Hashable, V] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable, make: Callable[[], V]) -> V:
        with self._lock:
            value = self._values.get(key)
            if value is not None:
                self._values.move_to_end(key)
                return value
        value = make()
        with self._lock:
            if key not in self._values:
                self._values[key] = value
                self.total_cost += self._cost(value)
            while self.total_cost > self._max_cost and len(self._values) > 1:
                _, dropped = self._values.popitem(last=False)
                self.total_cost -= self._cost(dropped)
        return value

    def __len__(self) -> int:
        return len(self._values)
