"""A pool's stream of changes to the index shards: coalesced, versioned, in order.

Every stored or dropped block shard is appended to the buffer of the index shard that owns its
id; a background thread sends each non-empty buffer every ``interval_s`` as one
:class:`ShardBatch` (fire-and-forget, one version number per shard stream). Coalescing keeps the
message rate an index shard sees bounded (pools x shards / interval) however many puts a pool
takes. Order: a batch's removals are applied before its additions, so a removal that follows a
pending addition first flushes that shard's buffer. ``flush()`` sends everything now (a ping for
a barrier, an inventory for a resync, so neither can miss a buffered change).

Sending happens under the pool's lock, so it never asks the GCS for a handle: the background
thread resolves the index shards' handles (one :class:`~kvray.handles.HandleCache`) outside any
lock, and drops one whose last update failed because the shard died (it is looked up again by
name on the next tick; a batch sent while no handle is known is skipped, and the shard resyncs
from the pool's inventory when it sees the gap in versions). The thread is supervised (restarted
should it raise; its deaths count in the pool's ``thread_deaths``) and stopped by the pool.

A pool whose policy has ghosts also sends the keys of the segments it evicted and added
(:mod:`kvray.meta.ghosts`); an index shard may answer an update with a :class:`GhostNotice`,
which the same thread reads once it has arrived (never waiting for it) and hands to the pool.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import ray
from ray import ObjectRef

from kvray.handles import HandleCache
from kvray.meta.ids import index_shard_of
from kvray.meta.messages import GhostNotice, ShardBatch, index_name
from kvray.threads import SupervisedThread

if TYPE_CHECKING:
    from kvray.actors.index import IndexShard

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


#: An idle publisher (nothing buffered) wakes this often to notice a dead shard's last update
#: and look up missing handles; a change wakes it at once.
IDLE_CHECK_S = 1.0
#: A buffer of this many entries is sent at once.
MAX_BUFFERED = 1 << 17


#: Sent updates whose answers (a :class:`GhostNotice` or None) are not read yet, at most.
MAX_PENDING_ANSWERS = 4096


class _Buffer:
    def __init__(self) -> None:
        self.add: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.rm: list[tuple[np.ndarray, np.ndarray]] = []
        self.ghosts: list[np.ndarray] = []
        self.heads: list[np.ndarray] = []
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
        self._names = [index_name(namespace, s) for s in range(num_shards)]
        self._handles: HandleCache[IndexShard] = HandleCache()
        self._last: list[ObjectRef[None] | None] = [
            None
        ] * num_shards  # the last update sent to each shard
        self._stop = threading.Event()
        self._dirty = threading.Event()  # something was buffered since the last flush
        self._interval_s = PUBLISH_INTERVAL_S
        self._thread = SupervisedThread(
            self._run,
            "kvray-publish",
            f"the index publisher of pool slot {slot} in {namespace!r}",
            stop=self._stop,
            restarts=5,
        )
        self.sent_batches = 0
        #: Updates sent, oldest first, whose answers are read by the thread (:meth:`_answers`).
        self._answers_pending: deque[ObjectRef[GhostNotice | None]] = deque(
            maxlen=MAX_PENDING_ANSWERS
        )
        #: Called (on the publisher's thread, no lock held) with each notice an index shard
        #: answers; the pool sets it.
        self.on_notice: Callable[[GhostNotice], None] | None = None
        self.notices = 0

    def start(self, interval_s: float = PUBLISH_INTERVAL_S) -> None:
        self._interval_s = interval_s
        self._resolve()
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> bool:
        """Stop the thread (what is still buffered is not sent); True once it has ended."""
        self._dirty.set()  # wake the thread now; stop() sets _stop, the thread's stop event
        return self._thread.stop(timeout)

    @property
    def thread_deaths(self) -> int:
        return self._thread.deaths

    def _run(self) -> None:
        """Sleep until a change is buffered (or ``IDLE_CHECK_S``), let ``interval_s`` of
        changes gather, send them: an idle pool's publisher wakes once a second, not 50 times."""
        while not self._stop.is_set():
            self._dirty.wait(IDLE_CHECK_S)
            if self._stop.wait(self._interval_s):
                return
            self._dirty.clear()
            self._check_sent()
            self._resolve()
            try:
                self.flush()
            except Exception:
                logger.exception("kvray pool: publishing to the index failed")
            self._answers()

    def _answers(self) -> None:
        """Hand the answers that arrived to ``on_notice`` (a failed update's error is
        :meth:`_check_sent`'s business; here it is only skipped)."""
        with self._lock:
            refs = list(self._answers_pending)
        if not refs:
            return
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        if not ready:
            return
        done = set(ready)
        with self._lock:
            left = [r for r in self._answers_pending if r not in done]
            self._answers_pending.clear()
            self._answers_pending.extend(left)
        for ref in ready:
            try:
                notice = ray.get(ref, timeout=0)
            except Exception:  # the shard died or restarted: it resyncs; no news to apply
                continue
            if notice is not None and self.on_notice is not None:
                self.notices += 1
                self.on_notice(notice)

    def _resolve(self) -> None:
        """Look up the shards with no handle (outside any lock; backoff in the cache)."""
        if not ray.is_initialized():  # a unit test's pool: nothing to send to
            return
        for name in self._names:
            self._handles.get(name)

    def _check_sent(self) -> None:
        """Drop the handle of a shard whose last update failed because it died."""
        with self._lock:
            last = [(s, ref) for s, ref in enumerate(self._last) if ref is not None]
        if not last:
            return
        ready, _ = ray.wait([ref for _, ref in last], num_returns=len(last), timeout=0)
        done = set(ready)
        for s, ref in last:
            if ref not in done:
                continue
            with self._lock:
                if self._last[s] is ref:
                    self._last[s] = None
            try:
                ray.get(ref, timeout=0)
            except Exception as e:
                self._handles.failed(self._names[s], e)

    # ------------------------------------------------------------------ changes
    def added(self, ids: np.ndarray, shards: np.ndarray, nshards: np.ndarray) -> None:
        if not ids.size:
            return
        with self._lock:
            for s, idx in self._split(ids):
                buf = self._buffers[s]
                buf.add.append((ids[idx], shards[idx], nshards[idx]))
                buf.size += int(idx.size)
                self._dirty.set()
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
                self._dirty.set()
                if buf.size >= MAX_BUFFERED:
                    self._send(s)

    def ghosts(self, evicted: np.ndarray, heads: np.ndarray) -> None:
        """Keys of segments the policy evicted, and of segments added (for the cluster's
        ghosts, :mod:`kvray.meta.ghosts`), each to the index shard owning its id."""
        with self._lock:
            for keys, attr in ((evicted, "ghosts"), (heads, "heads")):
                if not keys.size:
                    continue
                for s, idx in self._split(keys):
                    buf = self._buffers[s]
                    getattr(buf, attr).append(keys[idx])
                    buf.size += int(idx.size)
                    self._dirty.set()

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
            ghosts=np.concatenate(buf.ghosts) if buf.ghosts else _EMPTY,
            heads=np.concatenate(buf.heads) if buf.heads else _EMPTY,
        )
        self._versions[s] += 1
        self.sent_batches += 1
        index = self._handles.cached(self._names[s])  # no GCS call: we hold the pool's lock
        if index is not None:  # else that shard resyncs from the inventory when it (re)appears
            ref = index.update.remote(self._slot, self._incarnation, self._versions[s], batch)
            self._last[s] = ref
            if self.on_notice is not None:
                self._answers_pending.append(ref)


_EMPTY = np.zeros(0, dtype=np.uint64)
_EMPTY16 = np.zeros(0, dtype=np.uint16)
