"""The worker side's store path (held by :class:`~kvray.connector.transfer.TransferHandler`).

A store job's blocks are gathered into staging rows (in pieces that fit the staging pool; while
its rows are held by puts in flight, into a buffer of the piece's own) and handed to the store's
``put_shard``, which copies them into Ray in the background (bytes in flight bounded by
``max_inflight_put_bytes``). The job completes when every piece is owned by a pool, or failed.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from kvray.connector.keyspace import EngineKeySpace
from kvray.connector.metadata import JobId, KVRayWorkerMetadata, ReqId, StoreSpec
from kvray.connector.paged import Mover, PagedCopier
from kvray.connector.sides import TransferStore
from kvray.kernels import StagingLease, StagingPool
from kvray.meta.ids import key_ids
from kvray.meta.messages import PutResult

logger = logging.getLogger(__name__)

__all__ = ["Outbox", "PutTracker", "StorePath"]


class Outbox:
    """What one rank reports to the scheduler, under one lock: job completions and counters
    (:class:`KVRayWorkerMetadata`) and the requests whose blocks no save reads any more. The
    transfer handler owns it; its store path and put tracker are handed it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.meta = KVRayWorkerMetadata()
        self.finished_sending: set[ReqId] = set()

    def mark(self, job_id: JobId, ok: bool) -> None:
        with self.lock:
            self.meta.mark(job_id, ok=ok)

    def sent(self, req_id: ReqId) -> None:
        with self.lock:
            self.finished_sending.add(req_id)

    def count_put(
        self, n: int, result: PutResult | None, block_nbytes: int, seconds: float = 0.0
    ) -> None:
        """One put of ``n`` blocks ended (``None``: it failed); it took ``seconds`` from the
        engine's process (the engine thread's gather and hand-off, the put threads' CPU)."""
        with self.lock:
            c = self.meta.counters
            if result is None:
                c.refused_blocks += n
                return
            c.stored_blocks += result.stored
            c.duplicate_blocks += result.duplicate
            c.refused_blocks += result.refused
            c.stored_bytes += result.stored * block_nbytes
            c.store_seconds += seconds
            c.store_timed_blocks += n

    def dropped(self, n: int) -> None:
        with self.lock:
            self.meta.counters.dropped_blocks += n


class PutTracker:
    """Store jobs whose puts are in flight: a job completes (reported through the outbox) once
    every piece is owned by a pool, failed if any piece was refused or failed; a held request
    is reported sent once its puts are done."""

    def __init__(self, outbox: Outbox) -> None:
        self.outbox = outbox
        self._lock = threading.Lock()
        self._puts: dict[JobId, list[Future[PutResult]]] = {}
        self._put_reqs: dict[JobId, ReqId] = {}

    def track(
        self, job_id: JobId, spec: StoreSpec, futures: list[Future[PutResult]], ok: bool
    ) -> None:
        """The job completes when every piece is owned by a pool (or failed)."""
        if spec.finish and spec.hold:
            self._release_when_stored(spec.req_id, futures)
        elif spec.finish:  # the paged blocks are no longer read: vLLM may free them
            self.outbox.sent(spec.req_id)
        if not futures:
            self.outbox.mark(job_id, ok)
            return
        left = [len(futures)]
        failed = [not ok]

        def one_done(f: Future[PutResult]) -> None:
            try:
                bad = f.result().refused > 0
            except Exception:
                bad = True
            with self._lock:  # pieces finish on several put threads at once
                failed[0] = failed[0] or bad
                left[0] -= 1
                if left[0]:
                    return
                self._puts.pop(job_id, None)
                self._put_reqs.pop(job_id, None)
            self.outbox.mark(job_id, not failed[0])

        with self._lock:
            self._puts[job_id] = futures
            self._put_reqs[job_id] = spec.req_id
        for f in futures:
            f.add_done_callback(one_done)

    def _release_when_stored(self, req_id: ReqId, futures: list[Future[PutResult]]) -> None:
        """Report ``req_id`` sent once its puts in flight (``futures`` and those of its earlier
        jobs) are owned by a pool or failed: bounded by the puts' ``put_timeout_s``."""
        with self._lock:
            jobs = [j for j, r in self._put_reqs.items() if r == req_id]
            pending = [f for j in jobs for f in self._puts.get(j, [])]
        pending = [f for f in pending + futures if not f.done()]
        if not pending:
            self.outbox.sent(req_id)
            return
        left = [len(pending)]

        def one_done(_: Future[PutResult]) -> None:
            with self._lock:
                left[0] -= 1
                if left[0]:
                    return
            self.outbox.sent(req_id)

        for f in pending:
            f.add_done_callback(one_done)

    def flush(self, timeout: float = 30.0) -> None:
        """Wait for puts in flight (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            pending = [f for fs in self._puts.values() for f in fs]
        for fut in pending:
            try:
                fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:
                logger.debug("kvray: a put failed at flush", exc_info=True)


@dataclass
class StorePath:
    """Store jobs of one rank: gather its blocks into staging (in pieces that fit), put them,
    and hand the puts to the tracker, which reports them through the outbox."""

    key_space: EngineKeySpace
    store: TransferStore
    mover: Mover
    copier: PagedCopier
    staging: StagingPool
    shard: int
    is_writer: bool
    outbox: Outbox
    puts: PutTracker = field(init=False)

    def __post_init__(self) -> None:
        self.block_nbytes = self.key_space.block_nbytes
        self.puts = PutTracker(self.outbox)
        self._cpu_lock = threading.Lock()
        self._cpu_seen = self.store.put_cpu_seconds()

    def submit(self, job_id: JobId, spec: StoreSpec) -> None:
        """Gather the job's blocks into staging (in pieces that fit) and put them; a piece
        that fails is dropped (counted) and the job reported failed, so the scheduler plans
        those blocks again. Once this returns no save reads vLLM's blocks."""
        n = len(spec.block_ids)
        if not self.is_writer or not n:
            self.puts.track(job_id, spec, [], ok=True)
            return
        futures: list[Future[PutResult]] = []
        ok = True
        step = max(1, self.staging.max_blocks)
        for a in range(0, n, step):
            b = min(n, a + step)
            fut = self._put_piece(spec, a, b)
            if fut is None:
                ok = False
                self.outbox.dropped(n - a)
                break
            futures.append(fut)
        self.puts.track(job_id, spec, futures, ok=ok)

    def _put_piece(self, spec: StoreSpec, a: int, b: int) -> Future[PutResult] | None:
        t0 = time.perf_counter()
        lease = self.copier.lease(b - a)
        try:
            # Staging rows still held by puts in flight: a buffer of the piece's own, not a
            # dropped save (a request that finishes is never offered again). Bytes in flight
            # stay bounded: beyond max_inflight_put_bytes the put is refused, the job replanned.
            buf = (
                lease.tensor[: b - a]
                if lease is not None
                else torch.empty((b - a, self.block_nbytes), dtype=torch.uint8)
            )
            self.mover.gather(spec.block_ids[a:b], buf)
            keys = self.key_space.block_keys(spec.block_hashes[a:b])
            fut = self.store.put_shard(
                keys, key_ids(keys), self.shard, self.key_space.num_shards, buf.numpy()
            )
        except Exception:
            logger.exception("kvray: a save of %d blocks failed", b - a)
            if lease is not None:
                lease.release()
            return None
        # The engine thread's share of the store: its gather and the hand-off (a small put's
        # call is sent from here). The put threads' CPU is added as each piece ends.
        held = time.perf_counter() - t0
        fut.add_done_callback(lambda f: self._put_done(b - a, f, lease, held))
        return fut

    def _put_done(
        self, n: int, fut: Future[PutResult], lease: StagingLease | None, held: float
    ) -> None:
        if lease is not None:
            lease.release()  # the staging rows are reusable once Ray owns a copy
        try:
            result: PutResult | None = fut.result()
        except Exception as e:
            logger.warning("kvray: a put of %d blocks failed: %s", n, e)
            result = None
        with self._cpu_lock:  # the put threads' CPU since the last piece ended (in total, theirs)
            now = self.store.put_cpu_seconds()
            cpu, self._cpu_seen = max(0.0, now - self._cpu_seen), now
        self.outbox.count_put(n, result, self.block_nbytes, held + cpu)
