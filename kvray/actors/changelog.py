"""An index shard's change feed: a bounded, numbered log of location changes, and the event
long polls wait on (:class:`~kvray.actors.index.IndexShard` answers ``changes`` from it)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import deque

import numpy as np

from kvray.meta.holders import Diff

__all__ = ["MAX_LOG_ENTRIES", "MAX_REPLY_ENTRIES", "ChangeLog", "Records"]

#: Upper bound on entries kept in the change log; clients further behind get a snapshot.
MAX_LOG_ENTRIES = 1_000_000
#: Upper bound on entries in one feed answer (about 10 bytes each).
MAX_REPLY_ENTRIES = 1_000_000

_EMPTY_IDS = np.zeros(0, dtype=np.uint64)
_EMPTY_LOCS = np.zeros(0, dtype=np.uint16)

#: (ids, locs, engine ids, engine masks, the seq they reach)
Records = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]


class ChangeLog:
    """Records ``(ids, locs)`` of the CPU tier or ``(ids, masks)`` of the engine tier
    (:mod:`kvray.meta.engine_table`), numbered ``floor + 1 .. seq``; the oldest are dropped beyond
    ``MAX_LOG_ENTRIES`` entries (``floor`` counts them). Event-loop thread only."""

    def __init__(self) -> None:
        self.seq = 0
        #: seq of the newest CPU-tier record.
        self.cpu_seq = 0
        #: seq of the newest record dropped from the log.
        self.floor = 0
        self.entries = 0
        #: Calls of :meth:`notify` (wakes that answer every long poll).
        self.notices = 0
        #: (ids, locs, engine ids, engine masks); one of the pairs is empty.
        self._log: deque[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = deque()
        self._changed: asyncio.Event | None = None

    def event(self) -> asyncio.Event:
        """Set at the next change (or :meth:`notify`)."""
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def notify(self) -> None:
        """Wake every long poll (each answers, records or not: a pool's health changed, or
        the shard stops) and every barrier waiting for a change."""
        self.notices += 1
        self._wake()

    def _wake(self) -> None:
        self.event().set()
        self._changed = asyncio.Event()

    def record(self, diff: Diff) -> None:
        if len(diff):
            self._append((diff.ids, diff.locs, _EMPTY_IDS, _EMPTY_IDS))
            self.cpu_seq = self.seq

    def record_engine(self, ids: np.ndarray, masks: np.ndarray) -> None:
        if ids.size:
            self._append((_EMPTY_IDS, _EMPTY_LOCS, ids, masks))

    def _append(self, rec: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]) -> None:
        self.seq += 1
        self._log.append(rec)
        self.entries += _size(rec)
        while self.entries > MAX_LOG_ENTRIES and len(self._log) > 1:
            self.entries -= _size(self._log.popleft())
            self.floor += 1
        self._wake()

    def read(self, since: int) -> Records:
        """The records after ``since`` (``floor <= since <= seq``) as arrays (ids, locs,
        engine ids, engine masks), at most about ``MAX_REPLY_ENTRIES`` entries, and the seq
        they reach."""
        parts: list[list[np.ndarray]] = [[], [], [], []]
        n = 0
        seq = since
        for rec in itertools.islice(self._log, since - self.floor, None):
            for part, arr in zip(parts, rec, strict=True):
                if arr.size:
                    part.append(arr)
            seq += 1
            n += _size(rec)
            if n >= MAX_REPLY_ENTRIES:
                break
        empty = (_EMPTY_IDS, _EMPTY_LOCS, _EMPTY_IDS, _EMPTY_IDS)
        ids, locs, eids, emasks = (
            np.concatenate(p) if p else e for p, e in zip(parts, empty, strict=True)
        )
        return ids, locs, eids, emasks, seq

    async def poll(self, since: int, wait_s: float, *, engine: bool = True) -> Records | None:
        """A long poll's answer: the records after ``since`` (``floor <= since <= seq``) as
        soon as there is one or :meth:`notify` is called, else what there is after ``wait_s``.
        Without ``engine`` the engine tier's records are left out and waited past (the answer
        reaches their seq all the same): a subscriber that keeps no engine tier is not woken
        by the engines' cache churn. None: ``since`` fell behind the log while waiting (the
        caller answers a snapshot)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, wait_s)
        notices = self.notices
        while True:
            ids, locs, eids, emasks, seq = self.read(since)
            if not engine:
                eids, emasks = eids[:0], emasks[:0]
            left = deadline - loop.time()
            done = ids.size or eids.size or self.notices != notices
            if done or (left <= 0 and seq == self.seq):
                return ids, locs, eids, emasks, seq
            since = seq  # nothing for this poll up to seq
            if seq < self.seq:
                continue  # more than one read's worth
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.event().wait(), timeout=left)
            if since < self.floor:
                return None

    @property
    def nbytes(self) -> int:
        return sum(sum(int(a.nbytes) for a in rec) for rec in self._log)


def _size(rec: tuple[np.ndarray, ...]) -> int:
    return int(rec[0].size + rec[2].size)
