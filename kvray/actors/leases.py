"""A pool's read leases: which segments readers hold, until released or expired.

A leased segment is never evicted. Leases come back in batches (readers return them about once
a second) and expire after ``timeout_s`` should a reader die; expiry checks a queue in expiry
order, so it costs nothing while no lease is due.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque

logger = logging.getLogger(__name__)

__all__ = ["Leases"]


class Leases:
    """Lease id -> leased segment ids (not thread-safe: the pool holds its lock)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._ids = itertools.count(1)
        self._held: dict[int, list[int]] = {}
        self._order: deque[tuple[float, int]] = deque()  # (expires, lease id)
        self.expired = 0

    def __len__(self) -> int:
        return len(self._held)

    def next_id(self) -> int:
        return next(self._ids)

    def add(self, lease_id: int, seg_ids: list[int]) -> None:
        self._held[lease_id] = seg_ids
        self._order.append((time.monotonic() + self.timeout_s, lease_id))

    def pop(self, lease_id: int) -> list[int]:
        """The segments of a lease being released (empty if unknown or already gone)."""
        return self._held.pop(lease_id, [])

    def pop_expired(self) -> list[list[int]]:
        """The segments of every lease past its deadline (each logged and counted)."""
        now = time.monotonic()
        order = self._order
        out = []
        while order and order[0][0] < now:
            _, lease_id = order.popleft()
            segs = self._held.pop(lease_id, None)
            if segs is not None:
                self.expired += 1
                logger.warning("kvray pool: lease %d expired without release", lease_id)
                out.append(segs)
        if len(order) > 4 * len(self._held) + 1024:  # released leases: compact the queue
            self._order = deque(e for e in order if e[1] in self._held)
        return out
