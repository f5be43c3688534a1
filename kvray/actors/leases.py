"""A pool's read leases: which segments readers hold, until released or expired.

A leased segment is never evicted. A lease may also hold objects a read was served straight from
the disk tier's files (RAM had no unleased room, :mod:`.promote`): their bytes count against the
pool's bound on such reads until the lease goes. Leases come back at once from copying reads
(:meth:`kvray.Store.get`) and in batches from zero-copy ones (about once a second), and expire
after ``timeout_s`` should a reader die; expiry checks a queue in expiry order, so it costs
nothing while no lease is due.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["Held", "Leases"]


@dataclass(slots=True)
class Held:
    """What one lease holds: segments protected from eviction, objects read from disk."""

    seg_ids: list[int]
    direct_bytes: int = 0
    direct_refs: list[Any] = field(default_factory=list)


class Leases:
    """Lease id -> what it holds (not thread-safe: the pool holds its lock)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._ids = itertools.count(1)
        self._held: dict[int, Held] = {}
        self._order: deque[tuple[float, int]] = deque()  # (expires, lease id)
        self.expired = 0

    def __len__(self) -> int:
        return len(self._held)

    def next_id(self) -> int:
        return next(self._ids)

    def add(
        self, lease_id: int, seg_ids: list[int], direct_bytes: int = 0, direct_refs: Any = ()
    ) -> None:
        self._held[lease_id] = Held(seg_ids, direct_bytes, list(direct_refs))
        self._order.append((time.monotonic() + self.timeout_s, lease_id))

    def pop(self, lease_id: int) -> Held:
        """What a lease being released holds (nothing if unknown or already gone)."""
        return self._held.pop(lease_id, None) or Held([])

    def pop_expired(self) -> list[Held]:
        """What every lease past its deadline holds (each logged and counted)."""
        now = time.monotonic()
        order = self._order
        out = []
        while order and order[0][0] < now:
            _, lease_id = order.popleft()
            held = self._held.pop(lease_id, None)
            if held is not None:
                self.expired += 1
                logger.warning("kvray pool: lease %d expired without release", lease_id)
                out.append(held)
        if len(order) > 4 * len(self._held) + 1024:  # released leases: compact the queue
            self._order = deque(e for e in order if e[1] in self._held)
        return out
