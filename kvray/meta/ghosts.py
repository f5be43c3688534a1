"""Ghosts a whole cluster remembers (issue 35), Ray-free: which pool evicted what lately.

A pool's admission policy (``probation``, ``adaptive``, ``aged``: :mod:`kvray.meta.eviction`)
remembers the first block id (the *key*) of every segment it evicted, and a segment put again
while its ghost is remembered skips probation. But a segment comes back in the pool of
whichever node recomputes it, three times in four elsewhere on four nodes: there it finds no
ghost and is evicted again, and the pool that evicted it never learns that it came back. So
the index shard that owns a key's id keeps the cluster's ghosts of its id range: pools send
the keys their policy evicted and the keys of the segments they add (in their change
batches); a key added while it is a ghost is a *return*, told to the pool that added it
(promote the segment) and to the pool that evicted it (its policy's evidence,
:meth:`~kvray.meta.eviction.EvictionPolicy.ghost_returned`).

Bounded: at most ``per_entry`` ghosts per segment the cluster holds (segments added minus
evicted, as far as this structure saw them), at least ``floor``; the oldest is forgotten first.
An id table (:class:`~kvray.meta.idtable.IdTable`: the evicting slot and a sequence number)
plus a ring of 16 bytes a ghost: ~40 bytes a ghost, a few bytes a block at a pool's segment
sizes.
"""

from __future__ import annotations

import numpy as np

from kvray.meta.ids import TOMB
from kvray.meta.idtable import IdTable

__all__ = ["ClusterGhosts"]


class ClusterGhosts:
    """Keys evicted lately, with the pool (slot) that evicted each. Not thread-safe."""

    def __init__(self, *, per_entry: int = 4, floor: int = 64) -> None:
        self._table = IdTable({"slot": np.uint16, "seq": np.uint64})
        self._ring_keys = np.zeros(64, dtype=np.uint64)  # in eviction order, from _head
        self._ring_seqs = np.zeros(64, dtype=np.uint64)
        self._head = self._tail = 0  # ring positions (monotonic; index modulo its size)
        self._seq = 0
        self._per_entry = per_entry
        self._floor = floor
        self.live = 0  # segments added minus evicted: what the limit scales with
        self.returns = 0
        self.forgotten = 0

    def __len__(self) -> int:
        return len(self._table)

    def limit(self) -> int:
        return max(self._floor, self._per_entry * self.live)

    def evicted(self, slot: int, keys: np.ndarray | list[int]) -> None:
        """Pool ``slot``'s policy evicted the segments with these keys."""
        keys = np.asarray(keys, dtype=np.uint64)
        keys = keys[keys > TOMB]
        if not keys.size:
            return
        self.live = max(0, self.live - int(keys.size))
        keys = np.unique(keys)
        seqs = np.arange(self._seq + 1, self._seq + 1 + keys.size, dtype=np.uint64)
        self._seq += int(keys.size)
        self._table.upsert(keys, slot=slot, seq=seqs)
        self._push(keys, seqs)
        self._trim()

    def added(self, slot: int, keys: np.ndarray | list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Pool ``slot`` added segments with these keys: ``(evicting slots, keys)`` of those
        that were ghosts (forgotten now: they are back)."""
        keys = np.asarray(keys, dtype=np.uint64)
        self.live += int(keys.size)
        keys = np.unique(keys[keys > TOMB])
        slots = self._table.find(keys)
        hit = slots >= 0
        if not hit.any():
            return np.zeros(0, dtype=np.uint16), keys[:0]
        who = self._table.cols["slot"][slots[hit]].copy()
        self._table.delete_slots(slots[hit])
        self.returns += int(hit.sum())
        return who, keys[hit]

    def _push(self, keys: np.ndarray, seqs: np.ndarray) -> None:
        n = self._tail - self._head
        if n + keys.size > self._ring_keys.size:  # grow (rotated to start at 0)
            size = max(2 * self._ring_keys.size, n + int(keys.size))
            at = (self._head + np.arange(n)) % self._ring_keys.size
            rk, rs = np.zeros(size, dtype=np.uint64), np.zeros(size, dtype=np.uint64)
            rk[:n], rs[:n] = self._ring_keys[at], self._ring_seqs[at]
            self._ring_keys, self._ring_seqs = rk, rs
            self._head, self._tail = 0, n
        at = (self._tail + np.arange(keys.size)) % self._ring_keys.size
        self._ring_keys[at], self._ring_seqs[at] = keys, seqs
        self._tail += int(keys.size)

    def _trim(self) -> None:
        """Forget the oldest ghosts beyond the limit (ring entries whose key was evicted again
        later, or came back, are stale and only leave the ring)."""
        extra = len(self._table) - self.limit()
        while extra > 0 and self._head < self._tail:
            take = min(self._tail - self._head, extra)  # stale ones: another round
            at = (self._head + np.arange(take)) % self._ring_keys.size
            keys, seqs = self._ring_keys[at], self._ring_seqs[at]
            self._head += take
            slots = self._table.find(keys)
            cols = self._table.cols
            current = slots >= 0
            current[current] = cols["seq"][slots[current]] == seqs[current]
            gone = slots[current]
            self._table.delete_slots(np.unique(gone))
            self.forgotten += int(gone.size)
            extra -= int(gone.size)

    @property
    def nbytes(self) -> int:
        return int(self._table.nbytes + self._ring_keys.nbytes + self._ring_seqs.nbytes)
