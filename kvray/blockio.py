"""The data path between a process and the block pools, with no view of the index.

- ``put``: blocks go to this node's pool, found by name (``<namespace>/pool/<node id>``), so
  writes never depend on the index being up. A background thread checksums each segment,
  ``ray.put``s it and hands the ref to the pool; the Future resolves when the pool owns it. A
  put of at most :data:`BY_VALUE_PUT_BYTES` goes by value instead, in pieces of at most
  ``INLINE_BYTES`` sent from the caller's thread (metadata and blocks as ``bytes``, see
  :mod:`kvray.meta.wire`), answered on the completion thread; the maintenance thread refuses
  one unanswered after ``put_timeout_s``.
- ``read``: blocks are leased from the pools the caller names (a view's location codes, or the
  locations a vLLM scheduler put in the connector metadata) and mapped zero-copy. The pool
  compares full keys, so a read never returns another key's bytes. A pool on another node
  serves a read of part of a segment from a fresh object of just those blocks
  (:mod:`kvray.actors.slices`): a remote read moves what it loads, not whole segments.
- ``verify``: xxh3 of what was read against what was stored; a mismatch is reported to its pool.
- Leases of zero-copy reads go back in batches, once a second, from a maintenance thread that
  also flushes the hot-path tallies to Ray metrics; a copying read (``Store.get``) gives its
  leases back as soon as it has copied (``hold`` and :meth:`BlockIO.release`), so a pool's RAM is
  never full of segments nobody reads any more. The thread is supervised: restarted should it
  raise, and past :data:`RESTARTS` in a row it closes the :class:`BlockIO` (puts are refused,
  leases expire on their own); deaths are counted (``thread_deaths``).
- Pool handles come from one :class:`~kvray.handles.HandleCache`: a handle whose actor died is
  dropped and looked up by name again at the next use.

Both :class:`kvray.Store` and the connector's worker side use it.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
from ray.exceptions import ObjectStoreFullError, OutOfDiskError

from kvray.blocks import Blocks, Read, checksums
from kvray.cluster import local_node_id
from kvray.config import KVRayConfig
from kvray.errors import InvalidArgumentError, StoreUnavailableError
from kvray.handles import HandleCache
from kvray.meta.messages import INLINE_BYTES, LeaseReply, PutResult, pool_name
from kvray.meta.segment import SegmentMeta, payload_bytes
from kvray.meta.wire import lease_request, reply_from_wire
from kvray.metrics import ClientTally
from kvray.threads import SupervisedThread

logger = logging.getLogger(__name__)

__all__ = ["BlockIO"]

#: Longest a finished read keeps its segments leased before the batch goes back.
RELEASE_INTERVAL_S = 1.0
#: Finished leases a pool's batch may hold before it is sent at once.
MAX_RELEASE_BATCH = 256
#: A put of at most this many bytes goes by value, in pieces of at most ``INLINE_BYTES``
#: sent at once from the caller's thread; a larger one through the object store from the put
#: threads. Measured on a 2-core node (4 KiB blocks, put until acknowledged): 27 blocks
#: 3.2 ms by value against 5.2 ms through the store, 48 blocks 3.6 against 5.3, 96 blocks
#: 6.7 against 5.7.
BY_VALUE_PUT_BYTES = 2 * INLINE_BYTES
#: Restarts in a row of the maintenance thread before the BlockIO closes.
RESTARTS = 3


@dataclass(eq=False)
class _SmallPut:
    """A small put awaiting its pool's answer (:meth:`BlockIO._put_small`)."""

    future: Future[PutResult]
    pool: str
    n: int
    nbytes: int
    t0: float  # time.perf_counter() at the put
    deadline: float
    ref: Any = None  # the call's ObjectRef, held until it is answered
    done: bool = False


def _block_sizes(blocks: Blocks) -> np.ndarray:
    """Bytes of each block (int64), for a 2D array of rows or a list of arrays."""
    if isinstance(blocks, np.ndarray):
        return np.full(blocks.shape[0], blocks.shape[1], dtype=np.int64)
    return np.fromiter((x.nbytes for x in blocks), dtype=np.int64, count=len(blocks))


def _wire(
    keys: list[bytes], ids: np.ndarray, shard: int, nshards: int, sizes: np.ndarray, seg: Blocks
) -> bytes:
    """A segment's metadata as the pool's ``put_segment`` takes it."""
    n = len(keys)
    return SegmentMeta.from_keys(
        keys,
        ids,
        np.full(n, shard, dtype=np.uint16),
        np.full(n, nshards, dtype=np.uint16),
        sizes,
        checksums(seg),
    ).to_wire()


def _gather(futures: list[Future[PutResult]]) -> Future[PutResult]:
    """One Future of the sum of the pieces' results (each piece resolves, never raises)."""
    if len(futures) == 1:
        return futures[0]
    out: Future[PutResult] = Future()
    left = [len(futures)]
    lock = threading.Lock()

    def one(_: Future[PutResult]) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        total = PutResult()
        for f in futures:
            total = total + f.result()
        out.set_result(total)

    for f in futures:
        f.add_done_callback(one)
    return out


def _outcome(f: Future[Any]) -> tuple[PutResult | None, BaseException | None]:
    try:
        return f.result(), None
    except BaseException as e:
        return None, e


class BlockIO:
    """Puts to this node's pool and leased reads from any pool (thread-safe)."""

    def __init__(self, config: KVRayConfig, tally: ClientTally | None = None) -> None:
        self.config = config
        self.node_id = local_node_id()
        self.tally = tally or ClientTally(config.namespace)
        self._handles = HandleCache()
        self._closed = threading.Event()
        self._inflight = 0
        self._inflight_lock = threading.Lock()
        #: CPU seconds the put threads spent on puts (their copies into Ray, their calls).
        self._put_cpu_s = 0.0
        self.refused_inflight = 0
        self.refused_no_room = 0  # blocks whose segment this node's object store had no room for
        self._puts = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvray-put")
        self._small: dict[int, _SmallPut] = {}  # small puts awaiting their answer
        # Their answers, from Ray's completion callback (a thread of Ray's own, which must
        # never wait on a lock of ours or run a caller's callbacks) to the completion thread.
        self._answers: queue.SimpleQueue[
            tuple[_SmallPut, PutResult | None, BaseException | None] | None
        ] = queue.SimpleQueue()
        self._release_cv = threading.Condition()
        self._releases: dict[str, list[tuple[int, int]]] = {}  # pool name -> (lease, bytes)
        ns = config.namespace
        self._completer = self._owned(
            self._complete, "kvray-put-done", f"small puts of namespace {ns!r}"
        )
        self._maint = self._owned(self._maintain, "kvray-io", f"the data path of namespace {ns!r}")

    def _owned(self, target: Any, name: str, what: str) -> SupervisedThread:
        """A thread of this BlockIO: stopped by :meth:`close`, which its death calls."""
        return SupervisedThread(
            target,
            name,
            what,
            stop=self._closed,
            restarts=RESTARTS,
            on_death=lambda _: self.close(),
        ).start()

    # ------------------------------------------------------------------ pools
    def handle(self, name: str) -> Any:
        """The pool's handle (cached; may ask the GCS: never call it under a lock)."""
        h = self._handles.get(name)
        if h is None:
            raise StoreUnavailableError(f"kvray: pool {name} is not running")
        return h

    def failed(self, name: str, error: BaseException) -> None:
        """A call to pool ``name`` raised ``error``: forget its handle if the pool is gone."""
        self._handles.failed(name, error)

    @property
    def thread_deaths(self) -> int:
        return self._maint.deaths + self._completer.deaths

    @property
    def local_pool(self) -> str:
        return pool_name(self.config.namespace, self.node_id)

    # ------------------------------------------------------------------ puts
    def put(
        self,
        keys: list[bytes],
        ids: np.ndarray,
        shard: int,
        nshards: int,
        blocks: Blocks,
        pool: str | None = None,
    ) -> Future[PutResult]:
        """Store validated blocks in the background (this node's pool unless ``pool``)."""
        if self._closed.is_set():
            raise StoreUnavailableError("kvray: put on a closed store")
        sizes = [blocks.shape[1]] if isinstance(blocks, np.ndarray) else [b.nbytes for b in blocks]
        if 0 in sizes:  # the pool would refuse the whole segment
            raise InvalidArgumentError("kvray: a block is empty: a block has at least one byte")
        fut: Future[PutResult] = Future()
        nbytes = (
            int(blocks.nbytes) if isinstance(blocks, np.ndarray) else sum(b.nbytes for b in blocks)
        )
        with self._inflight_lock:
            if self._inflight + nbytes > self.config.max_inflight_put_bytes:
                self.refused_inflight += len(keys)
                fut.set_result(PutResult(0, 0, len(keys)))
                return fut
            self._inflight += nbytes
        pool = pool or self.local_pool
        if nbytes <= BY_VALUE_PUT_BYTES:
            pieces = self._by_value(blocks)
            if pieces is not None:
                # Tail first: the pool ranks a put's segments in the order they come, and a
                # chain's head should be the last to go (its tail is worth nothing without it).
                return _gather(
                    [
                        self._put_small(keys[a:b], ids[a:b], shard, nshards, blocks[a:b], n, pool)
                        for a, b, n in reversed(pieces)
                    ]
                )
        try:
            return self._puts.submit(self._put_now, keys, ids, shard, nshards, blocks, nbytes, pool)
        except RuntimeError:  # closed concurrently
            with self._inflight_lock:
                self._inflight -= nbytes
            raise StoreUnavailableError("kvray: put on a closed store") from None

    def put_cpu_seconds(self) -> float:
        """CPU seconds this process' put threads have spent on puts so far (a small put sent
        from the caller's thread is the caller's)."""
        with self._inflight_lock:
            return self._put_cpu_s

    def _put_now(
        self,
        keys: list[bytes],
        ids: np.ndarray,
        shard: int,
        nshards: int,
        blocks: Blocks,
        nbytes: int,
        pool: str,
    ) -> PutResult:
        t0 = time.perf_counter()
        cpu0 = time.thread_time()
        try:
            try:
                handle = self.handle(pool)
            except StoreUnavailableError as e:
                logger.warning("kvray put: %s; %d blocks refused", e, len(keys))
                return PutResult(0, 0, len(keys))
            pending = []
            no_room = 0  # blocks refused here: no room for their segment in the object store
            for a, b in reversed(self._segments(blocks)):  # tail first, as by value
                seg = blocks[a:b]
                sizes = _block_sizes(seg)
                # A small segment goes inside the call; a larger one through the object
                # store, which the pool maps zero-copy.
                seg_nbytes = int(sizes.sum())
                try:
                    payload = payload_bytes(seg) if seg_nbytes <= INLINE_BYTES else [ray.put(seg)]
                except (ObjectStoreFullError, OutOfDiskError) as e:
                    # No room in this node's object store, nor on its disk: a cache refuses
                    # what it cannot hold (counted), as a pool does; the next segment may fit.
                    self._refuse_no_room(b - a, seg_nbytes, e)
                    no_room += b - a
                    continue
                wire = _wire(keys[a:b], ids[a:b], shard, nshards, sizes, seg)
                pending.append((b - a, handle.put_segment.remote(wire, payload)))
            # This thread's CPU for the put (its copies into the object store and the calls;
            # the wait below takes none): what a store takes from the writer's process.
            cpu = time.thread_time() - cpu0
            with self._inflight_lock:
                self._put_cpu_s += cpu
            result = PutResult(0, 0, no_room)
            for n, ref in pending:
                try:
                    r: PutResult = ray.get(ref, timeout=self.config.put_timeout_s)
                except Exception as e:
                    self.failed(pool, e)
                    logger.warning("kvray put: segment of %d blocks failed: %s", n, e)
                    r = PutResult(0, 0, n)
                result = result + r
            self.tally.add(bytes_stored=nbytes)
            self.tally.observe("store_latencies", time.perf_counter() - t0)
            return result
        finally:
            with self._inflight_lock:
                self._inflight -= nbytes

    def _put_small(
        self,
        keys: list[bytes],
        ids: np.ndarray,
        shard: int,
        nshards: int,
        blocks: Blocks,
        nbytes: int,
        pool: str,
    ) -> Future[PutResult]:
        """A put of one segment small enough to go by value, sent from the caller's thread:
        no hop through the put threads (~0.5 ms a put, measured); the Future resolves from
        Ray's completion callback, or as refused by the maintenance thread once
        ``put_timeout_s`` has passed without an answer."""
        t0 = time.perf_counter()
        fut: Future[PutResult] = Future()
        pending = _SmallPut(fut, pool, len(keys), nbytes, t0, t0 + self.config.put_timeout_s)
        try:
            handle = self.handle(pool)
            wire = _wire(keys, ids, shard, nshards, _block_sizes(blocks), blocks)
            pending.ref = ref = handle.put_segment.remote(wire, payload_bytes(blocks))
        except Exception as e:
            self._small_done(pending, None, e)
            return fut
        with self._inflight_lock:
            self._small[id(pending)] = pending
        ref.future().add_done_callback(lambda f: self._answers.put((pending, *_outcome(f))))
        return fut

    def _complete(self) -> None:
        """Resolve small puts as their answers come (the completion thread)."""
        while True:
            try:
                item = self._answers.get(timeout=RELEASE_INTERVAL_S)
            except queue.Empty:
                with self._inflight_lock:
                    if self._closed.is_set() and not self._small:
                        return
                continue
            if item is None:
                return
            self._small_done(*item)

    def _small_done(
        self, p: _SmallPut, result: PutResult | None, error: BaseException | None
    ) -> None:
        """Resolve a small put once (its answer, an error, or its timeout)."""
        with self._inflight_lock:
            if p.done:
                return
            p.done, p.ref = True, None
            self._small.pop(id(p), None)
            self._inflight -= p.nbytes
        if result is None:
            if error is not None and not isinstance(error, StoreUnavailableError):
                self.failed(p.pool, error)
            logger.warning("kvray put: segment of %d blocks failed: %s", p.n, error)
            result = PutResult(0, 0, p.n)
        else:
            self.tally.add(bytes_stored=p.nbytes)
            self.tally.observe("store_latencies", time.perf_counter() - p.t0)
        p.future.set_result(result)

    def _expire_small(self) -> None:
        """Small puts past their deadline are refused (the maintenance thread's bound)."""
        now = time.perf_counter()
        with self._inflight_lock:
            late = [p for p in self._small.values() if now > p.deadline]
        for p in late:
            self._small_done(p, None, TimeoutError(f"no answer in {self.config.put_timeout_s} s"))

    def _expire_small_all(self) -> None:
        with self._inflight_lock:
            left = list(self._small.values())
        for p in left:
            self._small_done(p, None, StoreUnavailableError("kvray: the store closed"))

    def _refuse_no_room(self, n: int, nbytes: int, error: BaseException) -> None:
        self.tally.add(refused_no_room=n)
        with self._inflight_lock:
            self.refused_no_room += n
            first = self.refused_no_room == n
        (logger.warning if first else logger.debug)(
            "kvray put: %d blocks (%d bytes) refused: no room in this node's object store "
            "(%s); further refusals are counted in stats()['refused_no_room']",
            n,
            nbytes,
            type(error).__name__,
        )

    def _by_value(self, blocks: Blocks) -> list[tuple[int, int, int]] | None:
        """``(a, b, bytes)`` pieces of at most ``INLINE_BYTES`` each, to send by value; None
        when a block alone is larger."""
        # Not capped by segment_bytes: the pool cuts what it keeps by its own segment_bytes.
        limit = INLINE_BYTES
        out = []
        for a, b in self._segments(blocks, limit):
            n = int(_block_sizes(blocks[a:b]).sum())
            if n > limit:
                return None
            out.append((a, b, n))
        return out

    def _segments(self, blocks: Blocks, limit: int | None = None) -> list[tuple[int, int]]:
        """[a, b) ranges of at most ``limit`` (``segment_bytes``) each (at least one block)."""
        limit = limit or self.config.segment_bytes
        if isinstance(blocks, np.ndarray):
            per = max(1, limit // max(1, blocks.shape[1]))
            n = blocks.shape[0]
            return [(a, min(n, a + per)) for a in range(0, n, per)]
        out, start, size = [], 0, 0
        for i, b in enumerate(blocks):
            if i > start and size + b.nbytes > limit:
                out.append((start, i))
                start, size = i, 0
            size += b.nbytes
        out.append((start, len(blocks)))
        return out

    # ------------------------------------------------------------------ reads
    def read(
        self,
        keys: Sequence[bytes],
        ids: np.ndarray,
        shard: int,
        slots: Sequence[int],
        pools: dict[int, str],
        deadline: float,
        hold: list[tuple[str, int, int]] | None = None,
    ) -> tuple[dict[int, Read], dict[int, str]]:
        """Lease and map key ``i`` from pool slot ``slots[i]`` (``pools[slot]`` names it).
        Returns (i -> read, i -> why not). Checksums are not checked here. With ``hold``,
        the leases (pool, lease id, bytes) go there for the caller to :meth:`release` once
        it has copied; else they go back in the next batch."""
        got: dict[int, Read] = {}
        lost: dict[int, str] = {}
        by_slot: dict[int, list[int]] = {}
        for i, slot in enumerate(slots):
            if slot in pools:
                by_slot.setdefault(slot, []).append(i)
            else:
                lost[i] = "no live pool holds it"
        lease_refs = {}
        for slot, idx in by_slot.items():
            try:
                lease_refs[slot] = self.handle(pools[slot]).lease_wire.remote(
                    lease_request(
                        [keys[i] for i in idx],
                        ids[idx],
                        shard,
                        max(0.0, deadline - time.monotonic()),
                        pools[slot] != self.local_pool,
                        INLINE_BYTES,
                    )
                )
            except Exception as e:
                lost.update(dict.fromkeys(idx, f"pool unavailable ({type(e).__name__})"))
        replies: dict[int, LeaseReply] = {}
        for slot, ref in lease_refs.items():
            try:
                got_reply = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
                replies[slot] = (
                    reply_from_wire(got_reply) if isinstance(got_reply, bytes) else got_reply
                )
            except Exception as e:
                self.failed(pools[slot], e)
                lost.update(dict.fromkeys(by_slot[slot], f"pool failed ({type(e).__name__})"))
        served: dict[int, int] = {}
        try:
            for slot, reply in replies.items():
                served[slot] = self._map(
                    slot, pools[slot], by_slot[slot], reply, deadline, got, lost
                )
        finally:
            # Mapped segments stay pinned while their arrays live: the leases are done. They
            # go back in batches (a release sent now would wake the pool while the caller
            # copies and vLLM computes: ~2 ms a load on a busy node, measured).
            # A reply served wholly by value holds no lease (the pool counted its bytes).
            leased = {s: r for s, r in replies.items() if r.segments}
            if hold is not None:
                hold.extend((pools[s], r.lease_id, served.get(s, 0)) for s, r in leased.items())
            else:
                with self._release_cv:
                    for slot, reply in leased.items():
                        batch = self._releases.setdefault(pools[slot], [])
                        batch.append((reply.lease_id, served.get(slot, 0)))
                        if len(batch) >= MAX_RELEASE_BATCH:
                            self._release_cv.notify()
        return got, lost

    def _map(
        self,
        slot: int,
        name: str,
        idx: list[int],
        reply: LeaseReply,
        deadline: float,
        got: dict[int, Read],
        lost: dict[int, str],
    ) -> int:
        found = np.flatnonzero(reply.seg_ids).tolist()
        if len(found) < len(idx):
            for j in np.flatnonzero(reply.seg_ids == 0).tolist():
                lost[idx[j]] = reply.reasons.get(j, "evicted or never stored")
        seg_ids = list(reply.segments)
        try:
            refs = [reply.segments[s] for s in seg_ids]
            values = ray.get(refs, timeout=max(0.0, deadline - time.monotonic())) if refs else []
        except Exception as e:
            for j in found:
                if int(reply.seg_ids[j]) not in reply.inline:
                    lost[idx[j]] = f"object lost ({type(e).__name__})"
            seg_ids, values = [], []
        segs: dict[int, Any] = dict(zip(seg_ids, values, strict=True))
        segs.update(reply.inline)
        seg_of, pos = reply.seg_ids.tolist(), reply.positions.tolist()
        sizes, sums = reply.nbytes.tolist(), reply.checksums.tolist()
        nbytes = 0  # of leased objects: what the lease's release reports as served
        for j in found:
            if seg_of[j] not in segs:  # its object was lost
                continue
            arr = segs[seg_of[j]][pos[j]]
            if arr.nbytes != sizes[j]:
                lost[idx[j]] = "size mismatch"
                continue
            got[idx[j]] = Read(arr, sums[j], slot)
            if seg_of[j] not in reply.inline:
                nbytes += arr.nbytes
        return nbytes

    def report_lost(
        self, pools: dict[int, str], lost: dict[int, list[tuple[bytes, int]]], shard: int, why: str
    ) -> None:
        """Tell pools (slot -> [(key, id)]) never to serve these blocks again (fire-and-forget)."""
        for slot, items in lost.items():
            if slot in pools:
                with contextlib.suppress(Exception):
                    self.handle(pools[slot]).report_lost.remote(
                        [k for k, _ in items],
                        np.array([i for _, i in items], dtype=np.uint64),
                        shard,
                        why,
                    )

    # ------------------------------------------------------------------ background
    def _maintain(self) -> None:
        while not self._closed.is_set():
            with self._release_cv:
                self._release_cv.wait(RELEASE_INTERVAL_S)
            if not ray.is_initialized():  # shut down under us: a Ray call would start a new one
                return
            self.flush_releases()
            self._expire_small()
            with contextlib.suppress(Exception):
                self.tally.flush()

    def release(self, held: list[tuple[str, int, int]]) -> None:
        """Give back leases a caller held (:meth:`read` with ``hold``) now, one call per pool
        (fire-and-forget; should it fail, they expire)."""
        batches: dict[str, list[tuple[int, int]]] = {}
        for name, lease_id, nbytes in held:
            batches.setdefault(name, []).append((lease_id, nbytes))
        for name, batch in batches.items():
            with contextlib.suppress(Exception):
                self.handle(name).release_many.remote(batch)

    def flush_releases(self) -> None:
        """Send the finished leases, one call per pool."""
        with self._release_cv:
            batches, self._releases = self._releases, {}
        for name, batch in batches.items():
            with contextlib.suppress(Exception):  # else the leases expire on their own
                self.handle(name).release_many.remote(batch)

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def close(self) -> None:
        """Wait for puts in flight, return every lease, stop the maintenance thread."""
        self._closed.set()
        self._puts.shutdown(wait=True)
        with self._inflight_lock:
            small = [p.future for p in self._small.values()]
        wait(small, timeout=self.config.put_timeout_s)
        self._expire_small_all()
        self._answers.put(None)
        self._completer.join(timeout=5)
        self.flush_releases()
        with self._release_cv:
            self._release_cv.notify_all()
        self._maint.join(timeout=5)
        with contextlib.suppress(Exception):
            self.tally.flush()
