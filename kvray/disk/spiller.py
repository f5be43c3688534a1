"""The disk tier's writer thread (part of :class:`~kvray.disk.tier.DiskTier`): it takes groups
of queued segments, builds their files, evicts least recently used files until a chunk fits in
``capacity``, writes the chunk (:func:`~kvray.disk.writer.write_files`) and registers what
landed, telling the owner through ``on_spilled`` / ``on_evicted`` / ``on_dropped`` outside the
tier's lock.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

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

__all__ = ["SpillWriter"]

logger = logging.getLogger(__name__)


class SpillWriter:
    """The writer loop, mixed into the tier, whose state it shares (under the tier's lock)."""

    namespace: str
    fingerprint: str
    capacity: int
    on_spilled: Callable[[DiskSegment], None] | None
    on_evicted: Callable[[list[DiskSegment]], None] | None
    on_dropped: Callable[[list[int]], None] | None
    _lock: threading.Lock
    _wake: threading.Condition
    _files: FileIndex
    _queue: deque[Job]
    _pending: int
    _generation: int
    _counters: Counters
    _closing: bool
    _next_id: int
    _slot: Slot

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closing:
                    self._wake.wait(1.0)
                if not self._queue:
                    return
                jobs = [self._queue.popleft()]
                group = jobs[0].nbytes
                while (
                    self._queue
                    and len(jobs) < GROUP_FILES
                    and group + self._queue[0].nbytes <= GROUP_BYTES
                ):
                    jobs.append(self._queue.popleft())
                    group += jobs[-1].nbytes
            landed: set[int] = set()
            try:
                self._write_group(jobs, landed)
            except Exception:  # a bug: keep the writer alive (the blocks are not on disk)
                logger.exception("kvray disk tier: writer failed on %d segment(s)", len(jobs))
                with self._lock:
                    self._counters.write_errors += 1
            finally:
                # The owner drops what did not land before the queue has room again, so
                # its copies of queued segments stay within max_pending_bytes.
                self._notify_dropped([j.tag for j in jobs if id(j) not in landed])
                with self._lock:
                    self._pending -= group

    def _write_group(self, jobs: list[Job], landed: set[int]) -> None:
        """Build the files of a group of queued segments, then write them in chunks that fit;
        adds the ``id`` of every job whose file landed to ``landed``."""
        ready: list[SegmentFile] = []
        for job in jobs:
            try:
                ready.append(prepare(job, self.namespace, self.fingerprint))
            except Exception:  # a bug, not the disk: keep the writer alive, count it
                logger.exception("kvray disk tier: cannot build a segment file")
                with self._lock:
                    self._counters.write_errors += 1
                    self._counters.skipped += job.blocks
        too_big = sum(len(f.meta) for f in ready if f.size > self.capacity)
        if too_big:
            with self._lock:
                self._counters.skipped += too_big
        for chunk in chunks(ready, self.capacity):
            self._write_chunk(chunk, landed)

    def _write_chunk(self, chunk: list[SegmentFile], landed: set[int]) -> None:
        """Evict room for the chunk, write it (:func:`write_files`), register what landed."""
        size = sum(f.size for f in chunk)
        with self._lock:
            generation = self._generation
            for f in chunk:
                f.seg_id = self._next_id
                self._next_id += 1
            gone = self._evict_for(size, len(chunk))
            self._files.reserved += size
        for seg in gone:
            unlink(seg.path)
        self._notify_evicted(gone)
        done, failed = write_files(self._slot, chunk)
        segs = [
            DiskSegment(f.seg_id, self._slot.path(f.seg_id), f.meta, f.size, f.block_nbytes, f.tag)
            for f in done
        ]
        with self._lock:
            self._files.reserved -= size
            purged = generation != self._generation
            self._counters.skipped += sum(len(f.meta) for f, _ in failed)
            if not purged:  # after a purge, a failure is its deleting our temporary file
                self._counters.write_errors += len(failed)
            errors = self._counters.write_errors
            for seg in segs:
                if purged:
                    self._counters.skipped += len(seg.meta)
                    continue
                self._files.add(seg)
                self._counters.spilled += len(seg.meta)
                self._counters.spilled_bytes += seg.meta.nbytes
        if failed and not purged and (errors <= 3 or errors % 100 < len(failed)):
            logger.warning("kvray disk tier: %d write(s) failed: %s", len(failed), failed[0][1])
        if purged:
            for seg in segs:
                unlink(seg.path)
            return
        landed.update(f.job_id for f in done)
        callback = self.on_spilled
        for seg in segs:
            if callback is not None:
                try:
                    callback(seg)
                except Exception:
                    logger.exception("kvray disk tier: on_spilled failed")

    def _evict_for(self, size: int, files: int) -> list[DiskSegment]:
        gone = self._files.evict_for(size, files)
        self._counters.evictions += sum(len(seg.meta) for seg in gone)
        return gone

    def _notify_dropped(self, tags: list[int]) -> None:
        callback = self.on_dropped
        if tags and callback is not None:
            try:
                callback(tags)
            except Exception:
                logger.exception("kvray disk tier: on_dropped failed")

    def _notify_evicted(self, gone: list[DiskSegment]) -> None:
        callback = self.on_evicted
        if gone and callback is not None:
            try:
                callback(gone)
            except Exception:
                logger.exception("kvray disk tier: on_evicted failed")
