"""Numpy bookkeeping of the admission policies (``probation``, ``adaptive``, ``aged``), Ray-free.

:mod:`kvray.meta.eviction`'s admission policies rank a pool's segments in two queues (a FIFO
of entries never read, *probation*, and an LRU of the rest, *main*) and remember evicted
entries as *ghosts*. Kept in Python dicts and ordered dicts, that cost ~1.5 KB a segment with
its ghosts (~190 B a block at 8-block segments, measured), over issue 35's budget of 160 B a
block for the pools and the index together. Here it is numpy:

- :class:`EntryArena`: one row per entry in RAM (two intrusive doubly linked lists, the
  entry's bytes, first block id, last use), stable row numbers, and two id tables
  (:class:`~kvray.meta.idtable.IdTable`: entry id -> row, first block id -> row): ~45 bytes
  a row plus ~40 in the tables;
- :class:`GhostRing`: the ghosts, a ring of first block ids with where each was evicted from,
  its last use and bytes: 25 bytes a ghost.

Both track each item's last use as a sequence number, so an item's LRU stack distance (the
bytes of every tracked item used since) is two numpy comparisons and sums
(:meth:`EntryArena.since` + :meth:`GhostRing.since`). Not thread-safe (the pool's lock).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from kvray.meta.ids import TOMB
from kvray.meta.idtable import IdTable

__all__ = ["MAIN", "PROBATION", "EntryArena", "GhostRing"]

PROBATION, MAIN = 1, 2
_NONE = -1
_FIRST_ROWS = 64
#: Each array's value where nothing is stored (what growth fills the new part with).
_ROW_FILLS = (
    ("prev", _NONE),
    ("next", _NONE),
    ("seq", -1),
    ("queue", 0),
    ("nbytes", 0),
    ("key", 0),
    ("eid", 0),
)
_GHOST_FILLS = (("keys", 0), ("main", 0), ("seq", -1), ("nbytes", 0))


def _grown(a: np.ndarray, size: int, fill: int) -> np.ndarray:
    """``a`` extended to ``size`` elements, the new ones ``fill``."""
    out = np.full(size, fill, dtype=a.dtype)
    out[: a.size] = a
    return out


class EntryArena:
    """Entries in RAM, each in one of two queues (oldest first), in numpy rows."""

    def __init__(self) -> None:
        n = _FIRST_ROWS
        self.prev = np.full(n, _NONE, dtype=np.int32)
        self.next = np.full(n, _NONE, dtype=np.int32)
        self.queue = np.zeros(n, dtype=np.int8)  # 0: free
        self.nbytes = np.zeros(n, dtype=np.int64)
        self.key = np.zeros(n, dtype=np.uint64)
        self.eid = np.zeros(n, dtype=np.uint64)
        self.seq = np.full(n, -1, dtype=np.int64)  # last use (-1: free)
        self._free = np.arange(n - 1, -1, -1, dtype=np.int32)
        self._nfree = n
        self.head = [_NONE, _NONE, _NONE]  # per queue (index 0 unused)
        self.tail = [_NONE, _NONE, _NONE]
        self.count = [0, 0, 0]
        self.bytes = [0, 0, 0]
        self._rows = IdTable({"row": np.int32})  # entry id + 2 -> row
        self._by_key = IdTable({"row": np.int32})  # first block id -> row

    def __len__(self) -> int:
        return self.count[PROBATION] + self.count[MAIN]

    # ------------------------------------------------------------------ lookups
    def row(self, eid: int) -> int:
        found = self._rows.find_one(eid + 2)
        return int(self._rows.cols["row"][found]) if found >= 0 else _NONE

    def row_of_key(self, key: int) -> int:
        if key <= TOMB:
            return _NONE
        found = self._by_key.find_one(key)
        return int(self._by_key.cols["row"][found]) if found >= 0 else _NONE

    def oldest(self, queue: int, skip: set[int]) -> Iterator[int]:
        """Rows of ``queue`` oldest first, less the entries in ``skip``."""
        r = self.head[queue]
        while r != _NONE:
            nxt = int(self.next[r])
            if int(self.eid[r]) not in skip:
                yield r
            r = nxt

    # ------------------------------------------------------------------ changes
    def add(self, eid: int, nbytes: int, key: int, seq: int, queue: int) -> int:
        """A new entry at the tail of ``queue``; its row."""
        if not self._nfree:
            self._grow()
        self._nfree -= 1
        r = int(self._free[self._nfree])
        self.nbytes[r], self.key[r], self.eid[r], self.seq[r] = nbytes, key, eid, seq
        self._rows.upsert_one(eid + 2, row=r)
        if key > TOMB:
            self._by_key.upsert_one(key, row=r)
        self.append(r, queue)
        return r

    def free(self, r: int) -> None:
        """Drop row ``r`` (unlinked first)."""
        self.unlink(r)
        self._rows.delete_one(int(self.eid[r]) + 2)
        key = int(self.key[r])
        if key > TOMB and self.row_of_key(key) == r:
            self._by_key.delete_one(key)
        self.nbytes[r], self.key[r], self.eid[r], self.seq[r] = 0, 0, 0, -1
        self._free[self._nfree] = r
        self._nfree += 1

    def append(self, r: int, queue: int) -> None:
        """Row ``r`` (unlinked) at the tail of ``queue``."""
        t = self.tail[queue]
        self.prev[r], self.next[r] = t, _NONE
        if t == _NONE:
            self.head[queue] = r
        else:
            self.next[t] = r
        self.tail[queue] = r
        self._linked(r, queue)

    def push_front(self, r: int, queue: int) -> None:
        """Row ``r`` (unlinked) at the head of ``queue``: the oldest."""
        h = self.head[queue]
        self.prev[r], self.next[r] = _NONE, h
        if h == _NONE:
            self.tail[queue] = r
        else:
            self.prev[h] = r
        self.head[queue] = r
        self._linked(r, queue)

    def _linked(self, r: int, queue: int) -> None:
        self.queue[r] = queue
        self.count[queue] += 1
        self.bytes[queue] += int(self.nbytes[r])

    def unlink(self, r: int) -> None:
        q = int(self.queue[r])
        if not q:
            return
        p, n = int(self.prev[r]), int(self.next[r])
        if p == _NONE:
            self.head[q] = n
        else:
            self.next[p] = n
        if n == _NONE:
            self.tail[q] = p
        else:
            self.prev[n] = p
        self.prev[r] = self.next[r] = _NONE
        self.queue[r] = 0
        self.count[q] -= 1
        self.bytes[q] -= int(self.nbytes[r])

    def _grow(self) -> None:
        n = len(self.prev)
        for name, fill in _ROW_FILLS:
            setattr(self, name, _grown(getattr(self, name), 2 * n, fill))
        self._free = np.concatenate(
            [np.arange(2 * n - 1, n - 1, -1, dtype=np.int32), np.zeros(n, dtype=np.int32)]
        )
        self._nfree = n

    # ------------------------------------------------------------------ distances
    def since(self, seq: int) -> int:
        """Bytes of the entries used after ``seq``."""
        return int(self.nbytes[self.seq > seq].sum())

    @property
    def size(self) -> int:
        arrays = (self.prev, self.next, self.queue, self.nbytes, self.key, self.eid, self.seq)
        own = sum(a.nbytes for a in arrays) + self._free.nbytes
        return int(own + self._rows.nbytes + self._by_key.nbytes)


class GhostRing:
    """First block ids of entries evicted lately (one ghost a key), with the queue each left
    (``main``), its last use and its bytes: a ring of at most the ``limit`` its last growth
    allowed, the oldest overwritten first, searched with one numpy comparison."""

    def __init__(self) -> None:
        n = _FIRST_ROWS
        self.keys = np.zeros(n, dtype=np.uint64)
        self.main = np.zeros(n, dtype=np.bool_)
        self.seq = np.full(n, -1, dtype=np.int64)
        self.nbytes = np.zeros(n, dtype=np.int64)
        self.at = 0

    def add(self, key: int, main: bool, limit: int, seq: int = -1, nbytes: int = 0) -> None:
        self._clear(np.flatnonzero(self.keys == np.uint64(key)))  # one ghost a key
        if limit > len(self.keys):
            new = min(limit, 2 * len(self.keys))
            for name, fill in _GHOST_FILLS:
                setattr(self, name, _grown(getattr(self, name), new, fill))
        i = self.at % len(self.keys)
        self.keys[i], self.main[i], self.seq[i], self.nbytes[i] = key, main, seq, nbytes
        self.at = i + 1

    def pop(self, key: int) -> tuple[bool, int, int] | None:
        """``(main, last use, bytes)`` of the ghost of ``key``, forgetting it; None when
        there is none."""
        at = np.flatnonzero(self.keys == np.uint64(key))
        if not at.size:
            return None
        i = int(at[-1])
        out = (bool(self.main[i]), int(self.seq[i]), int(self.nbytes[i]))
        self._clear(at)
        return out

    def _clear(self, at: np.ndarray) -> None:
        if at.size:
            self.keys[at], self.seq[at], self.nbytes[at] = 0, -1, 0

    def since(self, seq: int) -> int:
        """Bytes of the ghosts whose entries were last used after ``seq``."""
        return int(self.nbytes[self.seq > seq].sum())

    def __len__(self) -> int:
        return int(np.count_nonzero(self.keys))

    @property
    def size(self) -> int:
        return int(self.keys.nbytes + self.main.nbytes + self.seq.nbytes + self.nbytes.nbytes)
