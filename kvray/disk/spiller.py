"""The disk tier's writer (held by :class:`~kvray.disk.tier.DiskTier`) and the state both share.

:class:`TierBook` is the tier's bookkeeping under one lock: the file index, the spill queue and
its bytes, the counters. The tier and its :class:`SpillWriter` are each handed the same book;
the writer also gets the slot it writes in and the events to tell. Its thread takes groups of
queued segments, builds their files, evicts least recently used files until a chunk fits in
``capacity``, writes the chunk (:func:`~kvray.disk.writer.write_files`) and registers what
landed, telling the owner through ``on_spilled`` / ``on_evicted`` / ``on_dropped`` outside the
lock.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvray.disk.files import Counters, DiskSegment, FileIndex
from kvray.disk.slot import Slot, unlink
from kvray.disk.writer import (
    GROUP_BYTES,
    GROUP_FILES,
    Job,
    SegmentFile,
    chunks,
    prepare,
    write_files,
)

__all__ = ["SpillEvents", "SpillWriter", "TierBook"]

logger = logging.getLogger(__name__)


class TierBook:
    """A tier's files, queue and counters; every field is read and written under ``lock``."""

    def __init__(self, capacity: int, max_files: int, next_id: int) -> None:
        self.lock = threading.Lock()
        self.wake = threading.Condition(self.lock)  # a spill queued, or closing
        self.idle = threading.Condition(self.lock)  # pending went down (a group ended)
        self.files = FileIndex(capacity, max_files)
        self.queue: deque[Job] = deque()
        self.pending = 0  # payload bytes queued or being written
        self.generation = 0  # bumped by purge: a write that started before lands nowhere
        self.counters = Counters()
        self.closing = False
        self.next_id = next_id

    def evict_for(self, size: int, files: int) -> list[DiskSegment]:
        """Evict least recently used files until ``size`` bytes and ``files`` files fit."""
        gone = self.files.evict_for(size, files)
        self.counters.evictions += sum(len(seg.meta) for seg in gone)
        return gone

    def drop_queue(self) -> None:
        for job in self.queue:
            self.counters.skipped += job.blocks
            self.pending -= job.nbytes
        self.queue.clear()


@dataclass
class SpillEvents:
    """What the tier's owner is told, from the writer thread, outside the lock."""

    on_spilled: Callable[[DiskSegment], None] | None = None
    on_evicted: Callable[[list[DiskSegment]], None] | None = None
    on_dropped: Callable[[list[int]], None] | None = field(default=None)

    def spilled(self, segs: list[DiskSegment]) -> None:
        for seg in segs:
            _tell(self.on_spilled, seg, "on_spilled")

    def dropped(self, tags: list[int]) -> None:
        if tags:
            _tell(self.on_dropped, tags, "on_dropped")

    def evicted(self, gone: list[DiskSegment]) -> None:
        if gone:
            _tell(self.on_evicted, gone, "on_evicted")


def _tell(callback: Callable[[Any], None] | None, arg: object, what: str) -> None:
    """Call an owner's callback; a failing one is logged, never the writer's death."""
    if callback is None:
        return
    try:
        callback(arg)
    except Exception:
        logger.exception("kvray disk tier: %s failed", what)


@dataclass
class SpillWriter:
    """The writer loop of one tier: what it shares with the tier is the book it is handed; it
    writes in ``slot`` and tells ``events``."""

    book: TierBook
    slot: Slot
    events: SpillEvents
    namespace: str
    fingerprint: str
    capacity: int

    def run(self) -> None:
        """The thread's loop: until closing and the queue is empty."""
        book = self.book
        while True:
            with book.lock:
                while not book.queue and not book.closing:
                    book.wake.wait(1.0)
                if not book.queue:
                    return
                jobs = [book.queue.popleft()]
                group = jobs[0].nbytes
                while (
                    book.queue
                    and len(jobs) < GROUP_FILES
                    and group + book.queue[0].nbytes <= GROUP_BYTES
                ):
                    jobs.append(book.queue.popleft())
                    group += jobs[-1].nbytes
            landed: set[int] = set()
            try:
                self._write_group(jobs, landed)
            except Exception:  # a bug: keep the writer alive (the blocks are not on disk)
                logger.exception("kvray disk tier: writer failed on %d segment(s)", len(jobs))
                with book.lock:
                    book.counters.write_errors += 1
            finally:
                # The owner drops what did not land before the queue has room again, so
                # its copies of queued segments stay within max_pending_bytes.
                self.events.dropped([j.tag for j in jobs if id(j) not in landed])
                with book.lock:
                    book.pending -= group
                    book.idle.notify_all()

    def _write_group(self, jobs: list[Job], landed: set[int]) -> None:
        """Build the files of a group of queued segments, then write them in chunks that fit;
        adds the ``id`` of every job whose file landed to ``landed``."""
        book = self.book
        ready: list[SegmentFile] = []
        for job in jobs:
            try:
                ready.append(prepare(job, self.namespace, self.fingerprint))
            except Exception:  # a bug, not the disk: keep the writer alive, count it
                logger.exception("kvray disk tier: cannot build a segment file")
                with book.lock:
                    book.counters.write_errors += 1
                    book.counters.skipped += job.blocks
        too_big = sum(len(f.meta) for f in ready if f.size > self.capacity)
        if too_big:
            with book.lock:
                book.counters.skipped += too_big
        for chunk in chunks(ready, self.capacity):
            self._write_chunk(chunk, landed)

    def _write_chunk(self, chunk: list[SegmentFile], landed: set[int]) -> None:
        """Evict room for the chunk, write it (:func:`write_files`), register what landed."""
        book = self.book
        size = sum(f.size for f in chunk)
        with book.lock:
            generation = book.generation
            for f in chunk:
                f.seg_id = book.next_id
                book.next_id += 1
            gone = book.evict_for(size, len(chunk))
            book.files.reserved += size
        for seg in gone:
            unlink(seg.path)
        self.events.evicted(gone)
        done, failed = write_files(self.slot, chunk)
        segs = [
            DiskSegment(f.seg_id, self.slot.path(f.seg_id), f.meta, f.size, f.block_nbytes, f.tag)
            for f in done
        ]
        with book.lock:
            c = book.counters
            book.files.reserved -= size
            purged = generation != book.generation
            c.skipped += sum(len(f.meta) for f, _ in failed)
            if not purged:  # after a purge, a failure is its deleting our temporary file
                c.write_errors += len(failed)
            errors = c.write_errors
            for seg in segs:
                if purged:
                    c.skipped += len(seg.meta)
                    continue
                book.files.add(seg)
                c.spilled += len(seg.meta)
                c.spilled_bytes += seg.meta.nbytes
        if failed and not purged and (errors <= 3 or errors % 100 < len(failed)):
            logger.warning("kvray disk tier: %d write(s) failed: %s", len(failed), failed[0][1])
        if purged:
            for seg in segs:
                unlink(seg.path)
            return
        landed.update(f.job_id for f in done)
        self.events.spilled(segs)
