"""The local-disk tier of a block pool: segments spilled to Arrow IPC files (issue 12).

Files live in ``<root>/<namespace>/<k>/``, slot ``<k>`` being a directory whose ``.lock`` this
process can ``flock`` exclusively (held for the tier's life; :mod:`.slot` says which): several
pools on one host (simulated Ray nodes) never share files, and a pool finds its slot, and its
files, again after a restart or a reboot. One file per segment (``<id:016x>.arrow``, format
in :mod:`.segfile`), written by one background thread (:mod:`.writer`) to ``<name>.tmp``,
fsynced and renamed, a group of queued segments at a time: a crash mid-write leaves only
temporary files, which :meth:`scan` deletes. Before writing, the writer evicts least recently
used files until the new ones fit, so the bytes of the slot's files never exceed ``capacity``.

Nothing here blocks a caller on the disk: :meth:`DiskTier.spill` queues (bounded by
``max_pending_bytes``) or refuses, counted. The owner learns what reached and what left the disk
through ``on_spilled`` / ``on_evicted``, and what did not make it through ``on_dropped``
(a write failed), all called from the writer thread outside the tier's lock.
Invalid files found by :meth:`scan` or :meth:`read` are deleted (not moved aside: they would
take space outside ``capacity``), with a warning, and counted in ``disk_corrupt``.
"""

from __future__ import annotations

import logging
import os

import numpy as np

from kvray.config import MIN_CAPACITY, ConfigError, check_namespace, parse_bytes
from kvray.disk import segfile
from kvray.disk.files import DiskSegment, scan_slot
from kvray.disk.payload import Payload, bad_blocks, check_payload, check_select
from kvray.disk.slot import Slot, unlink
from kvray.disk.spiller import SpillEvents, SpillWriter, TierBook
from kvray.disk.writer import Job
from kvray.errors import BlockLostError, KVRayError
from kvray.meta.segment import SegmentMeta
from kvray.threads import SupervisedThread

__all__ = ["DiskTier"]

logger = logging.getLogger(__name__)


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
        owner: str = "",
    ) -> None:
        check_namespace(namespace)
        self.capacity = parse_bytes(capacity, "disk_capacity", least=MIN_CAPACITY)
        self.max_pending_bytes = parse_bytes(max_pending_bytes, "max_pending_bytes", least=1)
        if isinstance(max_files, bool) or not isinstance(max_files, int) or max_files < 1:
            raise ConfigError("max_files", max_files, "must be an int >= 1")
        if not isinstance(fingerprint, str):
            raise ConfigError("fingerprint", fingerprint, "expected a string")
        if not isinstance(owner, str) or "\n" in owner:
            raise ConfigError("owner", owner, "expected a one-line string")
        self.namespace = namespace
        self.fingerprint = fingerprint
        self.max_files = max_files
        self.base = os.path.join(os.fspath(root), namespace)
        #: What the owner is told: set ``events.on_spilled`` / ``on_evicted`` / ``on_dropped``.
        self.events = SpillEvents()
        self._scanned = False
        self._writer: SupervisedThread | None = None
        self._writer_done = False
        self._release_on_exit = False
        try:
            self._slot = Slot(self.base, owner)
        except OSError as e:
            raise ConfigError("disk_dir", os.fspath(root), f"cannot use it: {e}") from None
        self.dir = self._slot.dir
        next_id = 1 + max((i for i, _ in self._slot.segments()), default=0)
        self._book = TierBook(self.capacity, max_files, next_id)
        self._lock = self._book.lock
        self._spiller = SpillWriter(
            self._book,
            self._slot,
            self.events,
            namespace=namespace,
            fingerprint=fingerprint,
            capacity=self.capacity,
        )
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
        found, corrupt = scan_slot(self._slot, self.namespace, self.fingerprint)
        with self._lock:
            self._book.files.clear()
            for seg in found:
                self._book.files.add(seg)
            self._book.counters.scanned += self._book.files.blocks
            self._book.counters.corrupt += corrupt
            gone = self._book.evict_for(0, 0)
            self._scanned = True
            survivors = list(self._book.files.files.values())
        for seg in gone:
            unlink(seg.path)
        return survivors

    # ------------------------------------------------------------------ writes
    def start(self) -> None:
        """Start the writer thread (after :meth:`scan` or :meth:`purge`)."""
        with self._lock:
            if not self._scanned:
                raise KVRayError("DiskTier.start: call scan() (or purge()) first")
            if self._writer is not None or self._book.closing:
                raise KVRayError("DiskTier.start: already started or closed")
            self._writer = SupervisedThread(
                self._spiller.run,
                "kvray-disk-writer",
                f"the disk tier in {self.dir}",
                on_death=self._writer_died,
                on_exit=self._writer_exit,
            ).start()

    def spill(
        self,
        meta: SegmentMeta,
        payload: Payload,
        select: np.ndarray | None = None,
        *,
        tag: int = 0,
    ) -> bool:
        """Queue a segment (or the blocks ``select`` of it) for writing; never waits.

        Returns False, counting the blocks in ``disk_skipped``, when they would push the queued
        bytes past ``max_pending_bytes``, cannot fit in ``capacity`` at all, or the tier is
        closed (an empty ``select``, e.g. from :func:`~kvray.disk.payload.admit`, is False and
        not counted). The payload's arrays are held (not copied) until written. ``tag`` comes
        back in the :class:`DiskSegment` given to ``on_spilled``, or in ``on_dropped`` when the
        write fails.
        """
        if self._writer is None:
            raise KVRayError("DiskTier.spill: call start() first")
        if isinstance(tag, bool) or not isinstance(tag, int):
            raise TypeError(f"DiskTier.spill: tag must be an int, got {tag!r}")
        check_payload(meta, payload, "DiskTier.spill")
        if select is not None:
            select = check_select(meta, select, "DiskTier.spill")
            if len(select) == 0:
                return False
        n = len(meta) if select is None else len(select)
        nbytes = meta.nbytes if select is None else int(meta.sizes[select].sum())
        with self._lock:
            if (
                self._book.closing
                or self._book.pending + nbytes > self.max_pending_bytes
                or nbytes + meta.meta_nbytes > self.capacity
            ):
                self._book.counters.skipped += n
                return False
            self._book.queue.append(Job(meta, payload, select, nbytes, tag))
            self._book.pending += nbytes
            self._book.wake.notify()
        return True

    def _writer_exit(self) -> None:
        with self._lock:
            self._writer_done = True
            if self._release_on_exit:
                self._slot.release()

    def _writer_died(self, _: BaseException) -> None:
        """The writer died for good: refuse spills from now on (``disk_skipped``) and give the
        queued segments back to the owner."""
        with self._lock:
            self._book.closing = True
            tags = [job.tag for job in self._book.queue]
            self._book.drop_queue()
        self.events.dropped(tags)

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
            raise BlockLostError(seg.meta.keys(), "disk file gone (evicted or deleted)") from None
        except OSError as e:  # the disk or the process, not the file: keep it
            raise BlockLostError(seg.meta.keys(), f"disk read failed: {e}") from None
        except segfile.SegmentFileError as e:
            logger.warning("kvray disk tier: deleting corrupt file %s: %s", seg.path, e)
            with self._lock:
                self._book.counters.corrupt += 1
            self.remove(seg)
            raise BlockLostError(seg.meta.keys(), f"corrupt disk file: {e}") from None

    def verify(
        self, seg: DiskSegment, payload: Payload, select: list[int] | None = None
    ) -> list[int]:
        """Positions of blocks (of ``select``, or all) whose xxh3 differs from the checksum
        they were written with. A non-empty answer counts the file in ``disk_corrupt``; the
        caller drops those blocks (or the whole file with :meth:`remove`)."""
        bad = bad_blocks(seg.meta, payload, select)
        if bad:
            logger.warning("kvray disk tier: %d corrupt block(s) in %s", len(bad), seg.path)
            with self._lock:
                self._book.counters.corrupt += 1
        return bad

    def touch(self, seg: DiskSegment) -> None:
        """Mark a file most recently used (in memory; a restart orders files by write time)."""
        with self._lock:
            self._book.files.touch(seg.id)

    def remove(self, seg: DiskSegment) -> bool:
        """Delete a file (e.g. found corrupt); no callback. False if it was not held."""
        with self._lock:
            held = self._book.files.pop(seg.id)
            if held is not None:
                self._book.counters.removed += len(held.meta)
        unlink(seg.path)
        return held is not None

    def purge(self, timeout: float = 30.0) -> int:
        """Delete every segment file of the namespace on this host: this slot's, queued
        writes, and those of slots no live tier holds. Returns the number of files deleted.
        A write already under way is waited for (up to ``timeout`` s), so none of this slot's
        files is left when it returns; one still writing after that deletes its own file when
        it ends. No callbacks; the tier stays usable (empty) until closed."""
        _check_wait("purge", timeout)
        with self._lock:
            if self._book.closing:
                raise KVRayError("DiskTier.purge: the tier is closed (purge before close)")
            self._book.generation += 1
            self._book.drop_queue()
            self._book.counters.removed += self._book.files.clear()
            self._scanned = True
            # What is still pending is the group being written: it sees the new generation
            # and deletes its files when it ends.
            if not self._book.idle.wait_for(lambda: self._book.pending == 0, timeout):
                logger.warning(
                    "kvray disk tier: a write still runs %.1f s into a purge; it deletes its "
                    "own files when it ends",
                    timeout,
                )
        deleted = self._slot.purge()
        logger.info("kvray disk tier: purged %d file(s) under %s", deleted, self.base)
        return deleted

    # ------------------------------------------------------------------ lifecycle and figures
    def close(self, timeout: float = 10.0, drain: bool = True) -> bool:
        """Stop the writer: finish queued writes for up to ``timeout`` s (``drain``), then drop
        the rest (counted in ``disk_skipped``). True when the writer stopped in time; if not,
        it finishes its one current write and releases the slot itself. Do not call it holding
        a lock the callbacks take: the writer could not finish."""
        _check_wait("close", timeout)
        with self._lock:
            self._book.closing = True
            if not drain:
                self._book.drop_queue()
            self._book.wake.notify_all()
        writer = self._writer
        if writer is not None:
            writer.stopping.set()  # a failure while draining ends it: nothing to restart
            writer.join(timeout)
        with self._lock:
            self._book.drop_queue()
            if writer is None or self._writer_done:
                self._slot.release()
                return True
            self._release_on_exit = True
        logger.warning("kvray disk tier: writer still busy after %.1f s; left to finish", timeout)
        return False

    @property
    def thread_deaths(self) -> int:
        return self._writer.deaths if self._writer is not None else 0

    def stats(self) -> dict[str, int]:
        """``disk_*`` figures, ``spilled`` and ``spilled_bytes`` (see :class:`Counters`)."""
        with self._lock:
            return self._book.counters.figures(self._book.files, self._book.pending)


def _check_wait(method: str, timeout: object) -> None:
    """A wait in seconds (0 included), or ValueError naming ``DiskTier.<method>``."""
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout < 0:
        raise ValueError(f"DiskTier.{method}: timeout must be seconds >= 0, got {timeout!r}")
