"""Helpers the store-level tests share: a bounded wait, and corruption in the object store."""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from typing import Any

import ray

from kvray.meta.ids import key_ids

__all__ = ["corrupt_in_plasma", "wait_for"]


def wait_for(cond: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll ``cond`` every 50 ms until it holds; the seconds it took, or AssertionError naming
    ``what`` after ``timeout`` s."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)
    return time.monotonic() - t0


def corrupt_in_plasma(pool: Any, key: bytes, shard: int = 0) -> int:
    """Zero 16 bytes of a stored block in the object store's shared memory (a bad DIMM, a stray
    write): the pool's own object, not a copy. The tests' blocks never hold a zero byte, so the
    block always changes. Returns the segment's id."""
    lease = ray.get(pool.lease.remote([key], key_ids([key]), shard))
    seg_id, pos = int(lease.seg_ids[0]), int(lease.positions[0])
    assert seg_id != 0, "the block to corrupt is not in this pool"
    segment = ray.get(lease.segments[seg_id])
    target = segment[pos]
    ctypes.memset(target.ctypes.data + 1000, 0, 16)
    del segment, target
    ray.get(pool.release.remote(lease.lease_id))
    return seg_id
