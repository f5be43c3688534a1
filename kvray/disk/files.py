"""What a disk tier holds: :class:`DiskSegment` (one file), the scan that finds them at start
and :class:`FileIndex`, their LRU order and capacity accounting.

A scan validates every segment file of a slot without reading block bytes
(:func:`kvray.disk.segfile.read_meta`: footer, format version, namespace, fingerprint, metadata
digest), deletes what fails with a warning, and returns the survivors least recently written
first, the order a restarted tier evicts them in.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from dataclasses import dataclass, field

from kvray.disk import segfile
from kvray.disk.slot import Slot, unlink
from kvray.meta.segment import SegmentMeta

__all__ = ["Counters", "DiskSegment", "FileIndex", "scan_slot"]

logger = logging.getLogger(__name__)

#: Files whose metadata a scan asks the kernel for at once (bounds the page cache it fills).
_PREFETCH = 64


@dataclass(frozen=True, eq=False)
class DiskSegment:
    """One segment file: its blocks, size on disk, and ``block_nbytes`` (0: variable sizes).

    ``tag`` is what the owner passed to :meth:`~kvray.disk.DiskTier.spill` (0 for a file found
    by a scan): it names the owner's segment in ``on_spilled``."""

    id: int
    path: str
    meta: SegmentMeta = field(repr=False)
    file_bytes: int
    block_nbytes: int
    tag: int = 0


def scan_slot(slot: Slot, namespace: str, fingerprint: str) -> tuple[list[DiskSegment], int]:
    """(valid segment files, least recently written first; invalid files deleted).

    Temporary files of interrupted writes are deleted too. Files that cannot be read at all
    (an IO error, not a bad file) are deleted without counting: a cache may lose them, and
    capacity must hold.
    """
    for name in slot.delete_temporary():
        logger.info("kvray disk tier: removed %s of an interrupted write", name)
    found: list[tuple[int, int, DiskSegment]] = []
    corrupt = 0
    listed = slot.segments()
    for i, (seg_id, path) in enumerate(listed):
        if i % _PREFETCH == 0:
            segfile.prefetch([p for _, p in listed[i : i + _PREFETCH]])
        try:
            st = os.stat(path)
            meta, block_nbytes = segfile.read_meta(path, namespace, fingerprint)
        except segfile.SegmentFileError as e:
            logger.warning("kvray disk tier: deleting invalid file %s: %s", path, e)
            unlink(path)
            corrupt += 1
            continue
        except OSError as e:
            logger.warning("kvray disk tier: deleting unreadable file %s: %s", path, e)
            unlink(path)
            continue
        seg = DiskSegment(seg_id, path, meta, st.st_size, block_nbytes)
        found.append((st.st_mtime_ns, seg.id, seg))
    found.sort(key=lambda t: (t[0], t[1]))
    return [seg for _, _, seg in found], corrupt


class FileIndex:
    """The files of a tier, least recently used first, and what they add up to.

    Not thread-safe: the tier holds its lock. ``reserved`` is the size of files being written
    (counted against ``capacity`` before they exist)."""

    def __init__(self, capacity: int, max_files: int) -> None:
        self.capacity = capacity
        self.max_files = max_files
        self.files: OrderedDict[int, DiskSegment] = OrderedDict()
        self.used = 0  # bytes of the files held
        self.reserved = 0
        self.blocks = 0

    def __len__(self) -> int:
        return len(self.files)

    def add(self, seg: DiskSegment) -> None:
        self.files[seg.id] = seg
        self.used += seg.file_bytes
        self.blocks += len(seg.meta)

    def pop(self, seg_id: int) -> DiskSegment | None:
        seg = self.files.pop(seg_id, None)
        if seg is not None:
            self.used -= seg.file_bytes
            self.blocks -= len(seg.meta)
        return seg

    def touch(self, seg_id: int) -> None:
        if seg_id in self.files:
            self.files.move_to_end(seg_id)

    def clear(self) -> int:
        """Forget every file; returns the blocks they held."""
        blocks = self.blocks
        self.files.clear()
        self.used = self.blocks = 0
        return blocks

    def evict_for(self, size: int, files: int) -> list[DiskSegment]:
        """Drop least recently used files until ``size`` more bytes in ``files`` more files
        fit; returns them (the caller deletes them and tells the owner)."""
        gone: list[DiskSegment] = []
        while self.files and (
            self.used + self.reserved + size > self.capacity
            or len(self.files) + files > self.max_files
        ):
            _, seg = self.files.popitem(last=False)
            self.used -= seg.file_bytes
            self.blocks -= len(seg.meta)
            gone.append(seg)
        return gone


@dataclass
class Counters:
    """A tier's counters (blocks, unless named bytes or files)."""

    spilled: int = 0  # written to disk
    spilled_bytes: int = 0
    scanned: int = 0  # found valid by scans
    evictions: int = 0  # evicted to make room (LRU)
    removed: int = 0  # deleted by remove() or purge()
    skipped: int = 0  # refused or dropped on their way to disk
    corrupt: int = 0  # files found invalid (scan, read) or with corrupt blocks (verify)
    write_errors: int = 0  # files whose write failed

    def figures(self, files: FileIndex, pending: int) -> dict[str, int]:
        return {
            "disk_blocks": files.blocks,
            "disk_bytes": files.used,
            "disk_capacity": files.capacity,
            "disk_files": len(files),
            "spilled": self.spilled,
            "spilled_bytes": self.spilled_bytes,
            "disk_scanned": self.scanned,
            "disk_evictions": self.evictions,
            "disk_removed": self.removed,
            "disk_skipped": self.skipped,
            "disk_corrupt": self.corrupt,
            "disk_write_errors": self.write_errors,
            "disk_pending_bytes": pending,
        }
