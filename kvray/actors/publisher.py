"""A pool's stream of changes to the index shards: coalesced, versioned, in order.

Every stored or dropped block shard is appended to the buffer of the index shard that owns its
id; a background thread sends each non-empty buffer every ``interval_s`` as one
:class:`ShardBatch` (fire-and-forget, one version number per shard stream). Coalescing keeps the
message rate an index shard sees bounded (pools x shards / interval) however many puts a pool
takes. Order: a batch's removals are applied before its additions, so a removal that follows a
pending addition first flushes that shard's buffer. ``flush()`` sends everything now (a ping for
a barrier, an inventory for a resync, so neither can miss a buffered change).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np
import ray

from kvray.meta.ids import index_shard_of
from kvray.meta.messages import RAY_NAMESPACE, ShardBatch, index_name

logger = logging.getLogger(__name__)

__all__ = ["IndexPublisher"]

#: How often buffered changes go out (the visibility delay a put adds, at most) on a small
#: cluster; see :func:`publish_interval`.
PUBLISH_INTERVAL_S = 0.02
#: Messages a second one index shard should get from all pools together: a Python actor
#: spends a few hundred microseconds on each (Ray's call overhead, mostly), whatever its size.
SHARD_MESSAGES_PER_S = 500


def publish_interval(num_pools: int) -> float:
    """The flush interval that keeps an index shard near ``SHARD_MESSAGES_PER_S``: 20 ms up to
    10 nodes, 128 ms at 64 (every pool sends each shard at most one message per interval)."""
    return max(PUBLISH_INTERVAL_S, num_pools / SHARD_MESSAGES_PER_S)


#: A buffer of this many entries is sent at once.
MAX_BUFFERED = 1 << 17
#: Index shard handles are looked up again every this many intervals (about 5 s).
REFRESH_EVERY = 250


class _Buffer:
    def __init__(self) -> None:
        self.add: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.rm: list[tuple[np.ndarray, np.ndarray]] = []
        self.size = 0


class IndexPublisher:
    """Buffers and sends one pool's changes to every index shard."""

    def __init__(self, namespace: str, slot: int, incarnation: str, num_shards: int) -> None:
        self._ns = namespace
        self._slot = slot
        self._incarnation = incarnation
        self._k = num_shards
        self._lock = threading.Lock()
        self._buffers = [_Buffer() for _ in range(num_shards)]
        self._versions = [0] * num_shards
        self._handles: list[Any] = [None] * num_shards
        self._stop = threading.Event()
        self.sent_batches = 0

    def start(self, interval_s: float = PUBLISH_INTERVAL_S) -> None:
        def run() -> None:
            ticks = 0
            while not self._stop.wait(interval_s):
                ticks += 1
                if ticks % REFRESH_EVERY == 0:  # an index shard may have been recreated
                    with self._lock:
                        self._handles = [None] * self._k
                try:
                    self.flush()
                except Exception:
                    logger.exception("kvray pool: publishing to the index failed")

        threading.Thread(target=run, name="kvray-publish", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    # ------------------------------------------------------------------ changes
    def added(self, ids: np.ndarray, shards: np.ndarray, nshards: np.ndarray) -> None:
        if not ids.size:
            return
        with self._lock:
            for s, idx in self._split(ids):
                buf = self._buffers[s]
                buf.add.append((ids[idx], shards[idx], nshards[idx]))
                buf.size += int(idx.size)
                if buf.size >= MAX_BUFFERED:
                    self._send(s)

    def removed(self, ids: np.ndarray, shards: np.ndarray) -> None:
        if not ids.size:
            return
        with self._lock:
            for s, idx in self._split(ids):
                buf = self._buffers[s]
                if buf.add:  # removals apply before additions: keep add -> remove in order
                    self._send(s)
                    buf = self._buffers[s]
                buf.rm.append((ids[idx], shards[idx]))
                buf.size += int(idx.size)
                if buf.size >= MAX_BUFFERED:
                    self._send(s)

    def _split(self, ids: np.ndarray) -> list[tuple[int, np.ndarray]]:
        if self._k == 1:
            return [(0, np.arange(ids.size))]
        owner = index_shard_of(ids, self._k)
        return [(s, idx) for s in range(self._k) if (idx := np.flatnonzero(owner == s)).size]

    # ------------------------------------------------------------------ sending
    def flush(self) -> None:
        with self._lock:
            for s in range(self._k):
                if self._buffers[s].size:
                    self._send(s)

    def versions(self) -> tuple[int, ...]:
        """Versions sent so far per shard, after sending anything buffered."""
        self.flush()
        with self._lock:
            return tuple(self._versions)

    def _send(self, s: int) -> None:
        """Send shard ``s``'s buffer as one versioned batch (under the lock)."""
        buf = self._buffers[s]
        self._buffers[s] = _Buffer()
        add = buf.add
        rm = buf.rm
        a_ids = np.concatenate([a[0] for a in add]) if add else _EMPTY
        a_nsh = np.concatenate([a[2] for a in add]).astype(np.uint16) if add else _EMPTY16
        batch = ShardBatch(
            a_ids,
            np.concatenate([a[1] for a in add]).astype(np.uint16) if add else _EMPTY16,
            a_nsh,
            np.concatenate([r[0] for r in rm]) if rm else _EMPTY,
            np.concatenate([r[1] for r in rm]).astype(np.uint16) if rm else _EMPTY16,
            # A pool holds a block shard once, and a removal flushes pending additions, so
            # single-shard blocks never repeat in a batch's additions.
            add_unique=bool((a_nsh == 1).all()),
        )
        self._versions[s] += 1
        self.sent_batches += 1
        index = self._handle(s)
        if index is not None:
            index.update.remote(self._slot, self._incarnation, self._versions[s], batch)

    def _handle(self, shard: int) -> Any:
        if self._handles[shard] is None:
            try:
                self._handles[shard] = ray.get_actor(
                    index_name(self._ns, shard), namespace=RAY_NAMESPACE
                )
            except (ValueError, RuntimeError):
                return None  # that shard resyncs from the inventory when it (re)appears
        return self._handles[shard]


_EMPTY = np.zeros(0, dtype=np.uint64)
_EMPTY16 = np.zeros(0, dtype=np.uint16)
