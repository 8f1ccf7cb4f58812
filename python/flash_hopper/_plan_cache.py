"""The host paths' plan cache: one plan per call signature, bounded, shared between threads.

_fwd.py and _bwd.py keep their steps 1-3 (validate, choose the path, fill the parameters) per call
signature here: the key is tensor metadata and every scalar with its type. Only successful plans
are kept, so a bad call fails the same way every time; the oldest plan goes first when full.
"""

from __future__ import annotations

import threading
from typing import Any


class PlanCache:
    def __init__(self, capacity: int = 256) -> None:
        self._plans: dict[tuple, Any] = {}
        self._lock = threading.Lock()
        self._capacity = capacity

    def get(self, key: tuple | None) -> Any:
        """The plan of key, or None (no key, not cached, or an unhashable argument: validation
        says what is wrong with it)."""
        if key is None:
            return None
        try:
            return self._plans.get(key)
        except TypeError:
            return None

    def remember(self, key: tuple, plan: Any) -> None:
        with self._lock:
            if len(self._plans) >= self._capacity:
                del self._plans[next(iter(self._plans))]  # the oldest: dicts keep insertion order
            try:
                self._plans[key] = plan
            except TypeError:  # an unhashable argument that validation accepted: not cached
                pass

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)

    def signatures(self) -> list[tuple]:
        """The cached keys, oldest first (tests)."""
        with self._lock:
            return list(self._plans)
