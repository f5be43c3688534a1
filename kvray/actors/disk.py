"""The local-disk tier of a block pool: segments spilled to Arrow IPC files (issue 12).

Files live in ``<root>/<namespace>/<k>/``, ``<k>`` being the first slot ``0, 1, 2, ...`` whose
``.lock`` this process can ``flock`` exclusively (held for the tier's life): several pools on one
host (simulated Ray nodes) never share files, and the one pool of a machine finds its slot, and
its files, again after a restart or a reboot. One file per segment (``<id:016x>.arrow``, format
in :mod:`.segfile`), written by one background thread (:mod:`.diskwrite`) to ``<name>.tmp``,
fsynced and renamed, a group of queued segments at a time: a crash mid-write leaves only
temporary files, which :meth:`scan` deletes. Before writing, the writer evicts least recently
used files until the new ones fit, so the bytes of the slot's files never exceed ``capacity``.

Nothing here blocks a caller on the disk: :meth:`DiskTier.spill` queues (bounded by
``max_pending_bytes``) or refuses, counted. The owner learns what reached and what left the disk
through ``on_spilled`` / ``on_evicted``, called from the writer thread outside the tier's lock.
Invalid files found by :meth:`scan` or :meth:`read` are deleted (not moved aside: they would
take space outside ``capacity``), with a warning, and counted in ``disk_corrupt``.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvray.actors import segfile
from kvray.actors.diskslot import Slot, unlink
from kvray.actors.diskwrite import (
    GROUP_BYTES,
    GROUP_FILES,
    Job,
    SegmentFile,
    chunks,
    prepare,
    write_files,
)
from kvray.actors.payload import Payload, admit, block_checksum, check_payload
from kvray.actors.segment import SegmentMeta
from kvray.config import ConfigError, parse_bytes
from kvray.errors import BlockLostError, KVRayError

__all__ = ["DiskSegment", "DiskTier", "admit"]

logger = logging.getLogger(__name__)

#: Files whose metadata a scan asks the kernel for at once (bounds the page cache it fills).
_PREFETCH = 64
_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


@dataclass(frozen=True, eq=False)
class DiskSegment:
    """One segment file: its blocks, size on disk, and ``block_nbytes`` (0: variable sizes)."""

    id: int
    path: str
    meta: SegmentMeta = field(repr=False)
    file_bytes: int
    block_nbytes: int


@dataclass
class _Counters:
    spilled: int = 0
    spilled_bytes: int = 0
    scanned: int = 0
    evictions: int = 0
    removed: int = 0
    skipped: int = 0
    corrupt: int = 0
    write_errors: int = 0


class DiskTier:
    """Segment files of one pool on local disk, capacity-bounded and LRU-evicted."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        namespace: str,
        capacity: int | str,
        *,
        max_pending_bytes: int | str = 256 << 20,
        max_files: int = 16384,
        fingerprint: str = "",
    ) -> None:
        if not isinstance(namespace, str) or not _NAMESPACE_RE.match(namespace):
            raise ConfigError("namespace", namespace, "use 1-64 letters, digits, '_', '-' or '.'")
        self.capacity = parse_bytes(capacity, "disk_capacity")
        if self.capacity < (1 << 20):
            raise ConfigError("disk_capacity", capacity, "must be at least 1 MiB")
        self.max_pending_bytes = parse_bytes(max_pending_bytes, "max_pending_bytes")
        if self.max_pending_bytes <= 0:
            raise ConfigError("max_pending_bytes", max_pending_bytes, "must be > 0")
        if isinstance(max_files, bool) or not isinstance(max_files, int) or max_files < 1:
            raise ConfigError("max_files", max_files, "must be an int >= 1")
        if not isinstance(fingerprint, str):
            raise ConfigError("fingerprint", fingerprint, "expected a string")
        self.namespace = namespace
        self.fingerprint = fingerprint
        self.max_files = max_files
        self.base = os.path.join(os.fspath(root), namespace)
        self.on_spilled: Callable[[DiskSegment], None] | None = None
        self.on_evicted: Callable[[list[DiskSegment]], None] | None = None
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._files: OrderedDict[int, DiskSegment] = OrderedDict()  # LRU first
        self._used = 0  # bytes of files in _files
        self._reserved = 0  # bytes of the file being written
        self._blocks = 0
        self._queue: deque[Job] = deque()
        self._pending = 0  # payload bytes queued or being written
        self._generation = 0  # bumped by purge: a write that started before lands nowhere
        self._counters = _Counters()
        self._scanned = False
        self._closing = False
        self._writer: threading.Thread | None = None
        self._writer_done = False
        self._release_on_exit = False
        try:
            self._slot = Slot(self.base)
        except OSError as e:
            raise ConfigError("disk_dir", os.fspath(root), f"cannot use it: {e}") from None
        self.dir = self._slot.dir
        self._next_id = 1 + max((i for i, _ in self._slot.segments()), default=0)
        logger.info("kvray disk tier in %s: capacity %d bytes", self.dir, self.capacity)

    # ------------------------------------------------------------------ inventory
    def scan(self) -> list[DiskSegment]:
        """Validate the slot's files (no block bytes read) and return the survivors, LRU first.

        Temporary files of interrupted writes are deleted; invalid files are deleted with a
        warning and counted (``disk_corrupt``); when the files exceed ``capacity`` or
        ``max_files`` (e.g. a smaller capacity than last run), the oldest are evicted. Call it
        once before :meth:`start`; it does not call ``on_evicted``.
        """
        if self._writer is not None:
            raise KVRayError("DiskTier.scan: call it before start()")
        for name in self._slot.delete_temporary():
            logger.info("kvray disk tier: removed %s of an interrupted write", name)
        found: list[tuple[int, int, DiskSegment]] = []
        corrupt = 0
        listed = self._slot.segments()
        for i, (seg_id, path) in enumerate(listed):
            if i % _PREFETCH == 0:
                segfile.prefetch([p for _, p in listed[i : i + _PREFETCH]])
            try:
                st = os.stat(path)
                meta, block_nbytes = segfile.read_meta(path, self.namespace, self.fingerprint)
            except segfile.SegmentFileError as e:
                logger.warning("kvray disk tier: deleting invalid file %s: %s", path, e)
                unlink(path)
                corrupt += 1
                continue
            except OSError as e:  # unreadable now: a cache may lose it, capacity must hold
                logger.warning("kvray disk tier: deleting unreadable file %s: %s", path, e)
                unlink(path)
                continue
            seg = DiskSegment(seg_id, path, meta, st.st_size, block_nbytes)
            found.append((st.st_mtime_ns, seg.id, seg))
        found.sort(key=lambda t: (t[0], t[1]))
        with self._lock:
            self._files = OrderedDict((seg.id, seg) for _, _, seg in found)
            self._used = sum(seg.file_bytes for seg in self._files.values())
            self._blocks = sum(len(seg.meta) for seg in self._files.values())
            self._counters.scanned += self._blocks
            self._counters.corrupt += corrupt
            gone = self._evict_for(0, 0)
            self._scanned = True
            survivors = list(self._files.values())
        for seg in gone:
            unlink(seg.path)
        return survivors

    # ------------------------------------------------------------------ writes
    def start(self) -> None:
        """Start the writer thread (after :meth:`scan` or :meth:`purge`)."""
        with self._lock:
            if not self._scanned:
                raise KVRayError("DiskTier.start: call scan() (or purge()) first")
            if self._writer is not None or self._closing:
                raise KVRayError("DiskTier.start: already started or closed")
            self._writer = threading.Thread(target=self._run, name="kvray-disk-writer", daemon=True)
            self._writer.start()

    def spill(self, meta: SegmentMeta, payload: Payload, select: np.ndarray | None = None) -> bool:
        """Queue a segment (or the blocks ``select`` of it) for writing; never waits.

        Returns False, counting the blocks in ``disk_skipped``, when they would push the queued
        bytes past ``max_pending_bytes``, cannot fit in ``capacity`` at all, or the tier is
        closed (an empty ``select``, e.g. from :func:`admit`, is False and not counted). The
        payload's arrays are held (not copied) until written.
        """
        if self._writer is None:
            raise KVRayError("DiskTier.spill: call start() first")
        check_payload(meta, payload, "DiskTier.spill")
        if select is not None:
            select = np.asarray(select, dtype=np.int64)
            if select.ndim != 1:
                raise ValueError(f"DiskTier.spill: select must be 1D, got shape {select.shape}")
            if len(select) == 0:
                return False
            if select[0] < 0 or select[-1] >= len(meta) or np.any(np.diff(select) <= 0):
                raise ValueError(
                    f"DiskTier.spill: select must be increasing positions < {len(meta)}"
                )
        n = len(meta) if select is None else len(select)
        nbytes = meta.nbytes if select is None else int(meta.sizes[select].sum())
        with self._lock:
            if (
                self._closing
                or self._pending + nbytes > self.max_pending_bytes
                or nbytes + meta.meta_nbytes > self.capacity
            ):
                self._counters.skipped += n
                return False
            self._queue.append(Job(meta, payload, select, nbytes))
            self._pending += nbytes
            self._wake.notify()
        return True

    def _run(self) -> None:
        try:
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
                try:
                    self._write_group(jobs)
                except Exception:  # a bug: keep the writer alive (the blocks are not on disk)
                    logger.exception("kvray disk tier: writer failed on %d segment(s)", len(jobs))
                    with self._lock:
                        self._counters.write_errors += 1
                finally:
                    with self._lock:
                        self._pending -= group
        finally:
            with self._lock:
                self._writer_done = True
                if self._release_on_exit:
                    self._slot.release()

    def _write_group(self, jobs: list[Job]) -> None:
        """Build the files of a group of queued segments, then write them in chunks that fit."""
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
            self._write_chunk(chunk)

    def _write_chunk(self, chunk: list[SegmentFile]) -> None:
        """Evict room for the chunk, write it (:func:`write_files`), register what landed."""
        size = sum(f.size for f in chunk)
        with self._lock:
            generation = self._generation
            for f in chunk:
                f.seg_id = self._next_id
                self._next_id += 1
            gone = self._evict_for(size, len(chunk))
            self._reserved += size
        for seg in gone:
            unlink(seg.path)
        self._notify_evicted(gone)
        done, failed = write_files(self._slot, chunk)
        segs = [
            DiskSegment(f.seg_id, self._slot.path(f.seg_id), f.meta, f.size, f.block_nbytes)
            for f in done
        ]
        with self._lock:
            self._reserved -= size
            purged = generation != self._generation
            self._counters.skipped += sum(len(f.meta) for f, _ in failed)
            if not purged:  # after a purge, a failure is its deleting our temporary file
                self._counters.write_errors += len(failed)
            errors = self._counters.write_errors
            for seg in segs:
                if purged:
                    self._counters.skipped += len(seg.meta)
                    continue
                self._files[seg.id] = seg
                self._used += seg.file_bytes
                self._blocks += len(seg.meta)
                self._counters.spilled += len(seg.meta)
                self._counters.spilled_bytes += seg.meta.nbytes
        if failed and not purged and (errors <= 3 or errors % 100 < len(failed)):
            logger.warning("kvray disk tier: %d write(s) failed: %s", len(failed), failed[0][1])
        if purged:
            for seg in segs:
                unlink(seg.path)
            return
        callback = self.on_spilled
        for seg in segs:
            if callback is not None:
                try:
                    callback(seg)
                except Exception:
                    logger.exception("kvray disk tier: on_spilled failed")

    def _evict_for(self, size: int, files: int) -> list[DiskSegment]:
        """Drop LRU files from the index until ``size`` more bytes in ``files`` more files fit
        (under the lock; the caller deletes them and tells the owner)."""
        gone: list[DiskSegment] = []
        while self._files and (
            self._used + self._reserved + size > self.capacity
            or len(self._files) + files > self.max_files
        ):
            _, seg = self._files.popitem(last=False)
            self._used -= seg.file_bytes
            self._blocks -= len(seg.meta)
            self._counters.evictions += len(seg.meta)
            gone.append(seg)
        return gone

    def _notify_evicted(self, gone: list[DiskSegment]) -> None:
        callback = self.on_evicted
        if gone and callback is not None:
            try:
                callback(gone)
            except Exception:
                logger.exception("kvray disk tier: on_evicted failed")

    # ------------------------------------------------------------------ reads
    def read(self, seg: DiskSegment) -> Payload:
        """Memory-map a segment's blocks: ``payload[i]`` is block ``i``, read-only, zero-copy.

        Raises :class:`BlockLostError` (naming every key of the segment) when the file was
        evicted meanwhile, cannot be mapped, or is found corrupt (then it is deleted and
        counted). Block bytes are not checked here: call :meth:`verify`.
        """
        try:
            return segfile.map_payload(seg.path, seg.meta.sizes, seg.block_nbytes)
        except FileNotFoundError:
            raise BlockLostError(seg.meta.keys(), "evicted from the disk tier") from None
        except OSError as e:  # the disk or the process, not the file: keep it
            raise BlockLostError(seg.meta.keys(), f"disk read failed: {e}") from None
        except segfile.SegmentFileError as e:
            logger.warning("kvray disk tier: deleting corrupt file %s: %s", seg.path, e)
            with self._lock:
                self._counters.corrupt += 1
            self.remove(seg)
            raise BlockLostError(seg.meta.keys(), f"corrupt disk file: {e}") from None

    def verify(self, seg: DiskSegment, payload: Payload) -> list[int]:
        """Positions of blocks whose xxh3 differs from the checksum they were written with.

        A non-empty answer counts the file in ``disk_corrupt``; the caller drops those blocks
        (or the whole file with :meth:`remove`).
        """
        sums = seg.meta.checksums.tolist()
        bad = [i for i, s in enumerate(sums) if block_checksum(payload[i]) != s]
        if bad:
            logger.warning("kvray disk tier: %d corrupt block(s) in %s", len(bad), seg.path)
            with self._lock:
                self._counters.corrupt += 1
        return bad

    def touch(self, seg: DiskSegment) -> None:
        """Mark a file most recently used (in memory; a restart orders files by write time)."""
        with self._lock:
            if seg.id in self._files:
                self._files.move_to_end(seg.id)

    def remove(self, seg: DiskSegment) -> bool:
        """Delete a file (e.g. found corrupt); no callback. False if it was not held."""
        with self._lock:
            held = self._files.pop(seg.id, None)
            if held is not None:
                self._used -= held.file_bytes
                self._blocks -= len(held.meta)
                self._counters.removed += len(held.meta)
        unlink(seg.path)
        return held is not None

    def purge(self) -> int:
        """Delete every segment file of the namespace on this host: this slot's, queued
        writes, and those of slots no live tier holds. Returns the number of files deleted.
        No callbacks; the tier stays usable (empty) until closed."""
        with self._lock:
            if self._closing:
                raise KVRayError("DiskTier.purge: the tier is closed (purge before close)")
            self._generation += 1
            self._drop_queue()
            self._counters.removed += self._blocks
            self._files.clear()
            self._used = self._blocks = 0
            self._scanned = True
        deleted = self._slot.purge()
        logger.info("kvray disk tier: purged %d file(s) under %s", deleted, self.base)
        return deleted

    # ------------------------------------------------------------------ lifecycle and figures
    def close(self, timeout: float = 10.0, drain: bool = True) -> bool:
        """Stop the writer: finish queued writes for up to ``timeout`` s (``drain``), then drop
        the rest (counted in ``disk_skipped``). True when the writer stopped in time; if not,
        it finishes its one current write and releases the slot itself. Do not call it holding
        a lock the callbacks take: the writer could not finish."""
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout < 0:
            raise ValueError(f"DiskTier.close: timeout must be seconds >= 0, got {timeout!r}")
        with self._lock:
            self._closing = True
            if not drain:
                self._drop_queue()
            self._wake.notify_all()
        writer = self._writer
        if writer is not None:
            writer.join(timeout)
        with self._lock:
            self._drop_queue()
            if writer is None or self._writer_done:
                self._slot.release()
                return True
            self._release_on_exit = True
        logger.warning("kvray disk tier: writer still busy after %.1f s; left to finish", timeout)
        return False

    def _drop_queue(self) -> None:
        for job in self._queue:
            self._counters.skipped += job.blocks
            self._pending -= job.nbytes
        self._queue.clear()

    def stats(self) -> dict[str, int]:
        with self._lock:
            c = self._counters
            return {
                "disk_blocks": self._blocks,
                "disk_bytes": self._used,
                "disk_capacity": self.capacity,
                "disk_files": len(self._files),
                "spilled": c.spilled,
                "spilled_bytes": c.spilled_bytes,
                "disk_scanned": c.scanned,
                "disk_evictions": c.evictions,
                "disk_removed": c.removed,
                "disk_skipped": c.skipped,
                "disk_corrupt": c.corrupt,
                "disk_write_errors": c.write_errors,
                "disk_pending_bytes": self._pending,
            }
