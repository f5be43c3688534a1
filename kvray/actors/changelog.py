"""An index shard's change feed: a bounded, numbered log of location changes, and the event
long polls wait on (:class:`~kvray.actors.index.IndexShard` answers ``changes`` from it)."""

from __future__ import annotations

import asyncio
import itertools
from collections import deque

import numpy as np

from kvray.meta.holders import Diff

__all__ = ["MAX_LOG_ENTRIES", "MAX_REPLY_ENTRIES", "ChangeLog"]

#: Upper bound on entries kept in the change log; clients further behind get a snapshot.
MAX_LOG_ENTRIES = 1_000_000
#: Upper bound on entries in one feed answer (about 10 bytes each).
MAX_REPLY_ENTRIES = 1_000_000

_EMPTY_IDS = np.zeros(0, dtype=np.uint64)
_EMPTY_LOCS = np.zeros(0, dtype=np.uint16)


class ChangeLog:
    """Records ``(ids, locs)`` numbered ``floor + 1 .. seq``; the oldest are dropped beyond
    ``MAX_LOG_ENTRIES`` entries (``floor`` counts them). Event-loop thread only."""

    def __init__(self) -> None:
        self.seq = 0
        #: seq of the newest record dropped from the log.
        self.floor = 0
        self.entries = 0
        self._log: deque[tuple[np.ndarray, np.ndarray]] = deque()
        self._changed: asyncio.Event | None = None

    def event(self) -> asyncio.Event:
        """Set at the next change (or :meth:`notify`)."""
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def notify(self) -> None:
        """Wake every long poll and barrier waiting for a change."""
        self.event().set()
        self._changed = asyncio.Event()

    def record(self, diff: Diff) -> None:
        if not len(diff):
            return
        self.seq += 1
        self._log.append((diff.ids, diff.locs))
        self.entries += len(diff)
        while self.entries > MAX_LOG_ENTRIES and len(self._log) > 1:
            ids, _ = self._log.popleft()
            self.entries -= int(ids.size)
            self.floor += 1
        self.notify()

    def read(self, since: int) -> tuple[np.ndarray, np.ndarray, int]:
        """The records after ``since`` (``floor <= since <= seq``) as one pair of arrays, at
        most about ``MAX_REPLY_ENTRIES`` entries, and the seq they reach."""
        ids: list[np.ndarray] = []
        locs: list[np.ndarray] = []
        n = 0
        seq = since
        for rec_ids, rec_locs in itertools.islice(self._log, since - self.floor, None):
            ids.append(rec_ids)
            locs.append(rec_locs)
            seq += 1
            n += int(rec_ids.size)
            if n >= MAX_REPLY_ENTRIES:
                break
        if not ids:
            return _EMPTY_IDS, _EMPTY_LOCS, seq
        return np.concatenate(ids), np.concatenate(locs), seq

    @property
    def nbytes(self) -> int:
        return sum(int(i.nbytes + c.nbytes) for i, c in self._log)
