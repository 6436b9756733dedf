"""Recent routing decisions, shared between the router and the ingress of one process.

Why a module of its own: Ray Serve pickles the router's module by value, so a
process-wide object defined there would be copied, not shared. Imported from
here, the router and the HTTP ingress see the same log.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Optional

from router.types import Decision

MAX_DECISIONS = 4096


class DecisionLog:
    """Bounded map request id -> decision, read once by the ingress of the same process."""

    def __init__(self, capacity: int = MAX_DECISIONS) -> None:
        self._capacity = capacity
        self._items: OrderedDict[str, Decision] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, request_id: str, decision: Decision) -> None:
        with self._lock:
            self._items[request_id] = decision
            while len(self._items) > self._capacity:
                self._items.popitem(last=False)

    def pop(self, request_id: str) -> Optional[Decision]:
        with self._lock:
            return self._items.pop(request_id, None)


DECISIONS = DecisionLog()
