"""Waiting on a block pool, and reading its disk tier cold (benchmarks of the disk tier)."""

from __future__ import annotations

import glob
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["arrow_files", "drop_pages", "settle"]


def settle(pool: Any, timeout: float = 120.0, *, reads: bool = False) -> dict[str, Any]:
    """Wait until the pool (an actor handle) has nothing in flight towards the disk, nor
    (``reads``) reads from it outstanding; returns its stats then. Raises after ``timeout``."""
    import ray

    deadline = time.monotonic() + timeout
    while True:
        s = ray.get(pool.stats.remote(), timeout=60)
        quiet = s["spilling_bytes"] == s["disk_pending_bytes"] == s["active_leases"] == 0
        if quiet and (not reads or s["read_from_disk_outstanding_bytes"] == 0):
            return s
        if time.monotonic() > deadline:
            raise RuntimeError(f"the pool did not settle in {timeout:.0f} s: {s}")
        time.sleep(0.05)


def arrow_files(disk_dir: str | os.PathLike[str]) -> list[str]:
    """Every segment file under a disk tier's root."""
    return glob.glob(str(Path(disk_dir) / "**" / "*.arrow"), recursive=True)


def drop_pages(paths: Iterable[str]) -> None:
    """Evict these files from the page cache, so the next read comes from the disk."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
