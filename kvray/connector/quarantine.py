"""Blocks that failed to load, kept from being offered as hits again for a while.

A block the index still lists but no pool can serve (evicted between lookup and load, a pool
lost) would otherwise make every request sharing it plan the same failing load again. The
scheduler asks :meth:`Quarantine.usable` how many leading blocks of a prefix it may offer.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence

__all__ = ["FAILED_BLOCK_QUARANTINE_S", "MAX_QUARANTINE", "Quarantine"]

#: A block that failed to load is not offered as a hit again for this long, so a block the
#: index still lists but no pool can serve cannot make a request retry its load forever.
FAILED_BLOCK_QUARANTINE_S = 30.0
#: Most block hashes kept in quarantine (the oldest go first beyond it).
MAX_QUARANTINE = 1 << 16


class Quarantine:
    """Block hash -> time until which it is not offered as a hit; at most ``limit`` hashes."""

    def __init__(self, seconds: float = FAILED_BLOCK_QUARANTINE_S, limit: int = MAX_QUARANTINE):
        self.seconds = seconds
        self.limit = limit
        self._until: dict[bytes, float] = {}

    def __len__(self) -> int:
        return len(self._until)

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._until)

    def usable(self, block_hashes: Sequence[bytes]) -> int:
        """Leading blocks none of which is quarantined (expired entries are dropped)."""
        n = len(block_hashes)
        q = self._until
        if q:
            now = time.monotonic()
            for i, h in enumerate(block_hashes):
                until = q.get(h)
                if until is not None:
                    if until > now:
                        n = i
                        break
                    del q[h]
        return n

    def add(self, hashes: Iterable[bytes]) -> None:
        hashes = list(hashes)
        until = time.monotonic() + self.seconds
        q = self._until
        if len(q) + len(hashes) > self.limit:  # drop expired entries, then the oldest
            now = time.monotonic()
            for h in [h for h, t in q.items() if t <= now]:
                del q[h]
            while q and len(q) + len(hashes) > self.limit:
                del q[next(iter(q))]
        q.update(dict.fromkeys(hashes, until))
