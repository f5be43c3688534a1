"""Small segments the pool keeps in its own memory, not in the object store (issue 35, item 4).

A segment of at most :data:`~kvray.meta.messages.INLINE_BYTES` reaches its pool by value, inside
the put call. Putting the pool's copy into the object store then costs more than the call did
(``ray.put`` of 96 KiB: ~1.2 ms on top of a ~1.4 ms call here, measured), and most reads of
such a segment never touch that object: a read of at most ``INLINE_BYTES`` is answered by value
(:func:`kvray.actors.slices.inline`), a remote reader gets a fresh object of the blocks it asks
for (:func:`kvray.actors.slices.cut`), and the disk tier writes the bytes it is handed. So the
pool keeps such a segment as a :class:`HeapSegment`, and makes an object of it only when a read
needs one (a local read too large to answer by value, or a remote one asking nearly the whole
segment): :func:`objects_for` puts it then, once, and the segment keeps the object for the
readers after.

Bounded: the heap segments of one pool hold at most :data:`HEAP_BYTES` (a weak-reference
finalizer gives a segment's bytes back when the last reference to it goes); a segment that
does not fit goes to the object store as before. Heap segments count in ``used`` like any other,
so ``capacity`` bounds the two together; ``heap_bytes`` in a pool's stats says how much of it
is the pool's own memory (its RSS), not the object store's.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import ray

from kvray.meta.messages import LeaseReply

__all__ = ["HEAP_BYTES", "HeapBudget", "HeapSegment", "objects_for", "value"]

#: The most block bytes one pool keeps in its own memory.
HEAP_BYTES = 64 << 20


class HeapSegment:
    """A segment's blocks in the pool's memory (a 2D array or a list of arrays, owned)."""

    __slots__ = ("__weakref__", "nbytes", "payload")

    def __init__(self, payload: Any, nbytes: int) -> None:
        self.payload = payload
        self.nbytes = nbytes


class HeapBudget:
    """The bytes of a pool's live heap segments, at most ``limit`` (thread-safe)."""

    def __init__(self, limit: int = HEAP_BYTES) -> None:
        self.limit = int(limit)
        self._used = 0
        self._lock = threading.Lock()

    @property
    def used(self) -> int:
        return self._used

    def hold(self, payload: Any, nbytes: int) -> HeapSegment | None:
        """A heap segment of a copy of ``payload``, or None when it does not fit."""
        with self._lock:
            if self._used + nbytes > self.limit:
                return None
            self._used += nbytes
        try:
            own = (
                np.array(payload)
                if isinstance(payload, np.ndarray)
                else [np.array(a) for a in payload]
            )
        except BaseException:
            self._free(nbytes)
            raise
        seg = HeapSegment(own, nbytes)
        weakref.finalize(seg, self._free, nbytes)
        return seg

    def _free(self, nbytes: int) -> None:
        with self._lock:
            self._used -= nbytes


def value(obj: Any, timeout: float) -> Any:
    """A segment's blocks, whether the pool holds them as an object or in its heap."""
    if isinstance(obj, HeapSegment):
        return obj.payload
    return ray.get(obj, timeout=timeout)


def objects_for(
    reply: LeaseReply, keep: Callable[[int, HeapSegment, Any], None], deadline: float
) -> None:
    """Make every heap segment ``reply`` still names an object the reader can fetch (a
    ``ray.put`` of it); ``keep(seg_id, heap_segment, ref)`` lets the pool keep the object for
    later readers. A segment that cannot be put (the object store is full) is not served: its
    keys read as missing, with the reason, as a lost object's do."""
    for seg_id, obj in list(reply.segments.items()):
        if not isinstance(obj, HeapSegment):
            continue
        try:
            if time.monotonic() > deadline:
                raise TimeoutError("the read's time ran out")
            ref = ray.put(obj.payload)
        except Exception as e:
            for i in np.flatnonzero(reply.seg_ids == seg_id).tolist():
                reply.seg_ids[i] = 0
                reply.reasons[i] = f"no object for it ({type(e).__name__})"
            del reply.segments[seg_id]
            continue
        reply.segments[seg_id] = ref
        keep(seg_id, obj, ref)
