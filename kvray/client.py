"""The client: ``kvray.connect()`` from any process connected to the cluster.

- ``put`` is non-blocking: a background thread checksums the blocks, ``ray.put``s them in
  segments and hands each to the pool on this node; the Future resolves when the pool owns them.
- ``lookup`` never calls an actor: a thread long-polls the index's change feed and keeps a local
  view (key -> holder nodes), so a 64-key prefix match costs microseconds.
- ``get`` leases the blocks from their holders (this node first), maps or pulls the segments,
  verifies checksums and returns the bytes, or raises :class:`BlockLostError` naming every key it
  could not serve. Every wait has a timeout.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray
import xxhash

from kvray.actors.deploy import ensure_ray, get_index
from kvray.actors.types import RAY_NAMESPACE, Changes, LeaseReply, NodeInfo, PutResult
from kvray.config import KVRayConfig
from kvray.errors import BlockLostError, StoreUnavailableError
from kvray.keys import check_keys
from kvray.metrics import ClientMetrics

logger = logging.getLogger(__name__)

__all__ = ["Fetched", "Store", "connect"]

#: Longest a finished read keeps its segments leased: the feed thread returns leases in
#: batches when the index's long poll answers (a change, or this timeout).
RELEASE_INTERVAL_S = 1.0
#: Finished leases a pool's batch may hold before it is sent without waiting for the feed.
MAX_RELEASE_BATCH = 256


def checksum(block: np.ndarray) -> int:
    """xxh3-64 of a block's bytes: ~25 GB/s, cheap next to moving the bytes."""
    return xxhash.xxh3_64_intdigest(memoryview(block).cast("B"))


def as_bytes_view(block: Any) -> np.ndarray:
    """A flat uint8 view of a numpy array or CPU torch tensor (no copy when contiguous)."""
    if isinstance(block, np.ndarray):
        arr = block
    elif hasattr(block, "numpy") and hasattr(block, "device"):
        if block.device.type != "cpu":
            raise TypeError(f"kvray blocks must be CPU arrays, got a tensor on {block.device}")
        t = block.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        import torch

        arr = t.reshape(-1).view(torch.uint8).numpy()
    else:
        raise TypeError(f"kvray blocks must be numpy arrays or torch tensors, not {type(block)}")
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    return arr.reshape(-1).view(np.uint8)


@dataclass(frozen=True, slots=True)
class _Read:
    """One block mapped from a pool's segment, with the checksum it was stored with."""

    array: np.ndarray
    checksum: int
    slot: int


@dataclass(frozen=True)
class Fetched:
    """What :meth:`Store.fetch` read: the blocks of ``keys`` (a prefix of the request), in
    order; ``reason`` says why the request's next key could not be read (``""``: all read)."""

    keys: list[bytes]
    reason: str
    reads: list[_Read] = field(repr=False)

    @property
    def arrays(self) -> list[np.ndarray]:
        """The blocks' bytes (read-only uint8 arrays), one per key."""
        return [r.array for r in self.reads]


class _View:
    """The local copy of the index: key -> holder slot(s), kept fresh by the feed thread."""

    def __init__(self) -> None:
        self.where: dict[bytes, int | tuple[int, ...]] = {}
        self.nodes: dict[int, NodeInfo] = {}
        self.epoch = ""
        self.seq = -1

    def apply(self, ch: Changes) -> None:
        # A snapshot is built aside and swapped in, so concurrent lookups never see it half full.
        where: dict[bytes, int | tuple[int, ...]] = {} if ch.snapshot else self.where
        for slot, added, removed in ch.records:
            for k in added:
                v = where.get(k)
                if v is None:
                    where[k] = slot
                elif isinstance(v, int):
                    if v != slot:
                        where[k] = (v, slot)
                elif slot not in v:
                    where[k] = (*v, slot)
            for k in removed:
                v = where.get(k)
                if v is None:
                    continue
                if isinstance(v, int):
                    if v == slot:
                        del where[k]
                else:
                    rest = tuple(s for s in v if s != slot)
                    where[k] = rest[0] if len(rest) == 1 else rest
        self.where = where
        self.nodes = ch.nodes
        self.epoch, self.seq = ch.epoch, ch.seq

    def holders(self, key: bytes) -> tuple[int, ...]:
        v = self.where.get(key)
        if v is None:
            return ()
        return (v,) if isinstance(v, int) else v


class _Tally:
    """Plain counters bumped on hot paths and flushed to Ray metrics by the feed thread.

    A Ray metric update costs 2-3 us; a lookup must cost less than that, so hot paths only
    add to ints here (the GIL makes each ``+=`` safe enough for statistics).
    """

    def __init__(self, namespace: str) -> None:
        self.tags = {"namespace": namespace}
        self.lookups = 0
        self.hit_blocks = 0
        self.miss_blocks = 0
        self.latencies: list[float] = []
        self.bytes_loaded = 0
        self.bytes_stored = 0
        self.lost = 0
        self.tokens_loaded = 0
        self.load_latencies: list[float] = []
        self.store_latencies: list[float] = []

    def observe(self, name: str, seconds: float) -> None:
        """Keep a latency for the next flush (bounded, should the feed thread be stuck)."""
        values: list[float] = getattr(self, name)
        if len(values) < 10_000:
            values.append(seconds)

    def flush(self) -> None:
        m = ClientMetrics.get()
        t = self.tags
        for name, counter in (
            ("lookups", m.lookups),
            ("hit_blocks", m.lookup_hits),
            ("miss_blocks", m.lookup_misses),
            ("bytes_loaded", m.bytes_loaded),
            ("bytes_stored", m.bytes_stored),
            ("lost", m.lost_blocks),
            ("tokens_loaded", m.tokens_loaded),
        ):
            n = getattr(self, name)
            if n:
                setattr(self, name, getattr(self, name) - n)
                counter.inc(n, tags=t)
        for name, hist in (
            ("latencies", m.lookup_latency),
            ("load_latencies", m.load_latency),
            ("store_latencies", m.store_latency),
        ):
            values, fresh = getattr(self, name), []
            setattr(self, name, fresh)
            for v in values:
                hist.observe(v, tags=t)


class Store:
    """A connection to one kvray namespace. Thread-safe; cheap to keep for a process' life."""

    def __init__(self, config: KVRayConfig) -> None:
        self.config = config
        ensure_ray(config.address)
        self._index = get_index(config.namespace)
        self._node_id = ray.get_runtime_context().get_node_id()
        self._view = _View()
        self._cv = threading.Condition()
        self._pools: dict[str, Any] = {}
        self._closed = threading.Event()
        self._inflight = 0
        self._inflight_lock = threading.Lock()
        self._puts = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvray-put")
        self._release_lock = threading.Lock()
        self._releases: dict[int, list[tuple[int, int]]] = {}  # pool slot -> (lease, bytes)
        self._refused_client = 0
        self._feed_error: str | None = None
        self.tally = _Tally(config.namespace)
        self._poll(wait_s=0.0)  # the first snapshot, so lookups work right away
        self._feed = threading.Thread(target=self._feed_loop, name="kvray-feed", daemon=True)
        self._feed.start()

    # ------------------------------------------------------------------ feed
    def _poll(self, wait_s: float) -> None:
        ref = self._index.changes.remote(self._view.epoch, self._view.seq, wait_s)
        ch: Changes = ray.get(ref, timeout=wait_s + self.config.get_timeout_s)
        if ch.stopped:
            self._feed_error = "kvray was stopped in this namespace"
            self._closed.set()
            return
        with self._cv:
            self._view.apply(ch)
            self._cv.notify_all()

    def _feed_loop(self) -> None:
        backoff = 0.1
        while not self._closed.is_set():
            try:
                self._poll(wait_s=RELEASE_INTERVAL_S)
                self._flush_releases()
                self.tally.flush()
                backoff = 0.1
                self._feed_error = None
            except (SystemExit, KeyboardInterrupt):
                return  # the process (or its Ray worker) is shutting down
            except ray.exceptions.ActorDiedError:
                # Killed for good (kvray.stop): a restarting index raises Unavailable instead.
                self._feed_error = "the kvray index was stopped"
                logger.info("kvray: index of namespace %r is gone", self.config.namespace)
                return
            except Exception as e:
                if self._closed.is_set() or not ray.is_initialized():
                    return
                self._feed_error = f"{type(e).__name__}: {e}"
                logger.warning("kvray: index feed failed (%s); retrying", self._feed_error)
                self._closed.wait(backoff)
                backoff = min(backoff * 2, 2.0)

    def sync(self, timeout: float = 10.0) -> None:
        """Wait until the local view reflects every block any pool had stored when called."""
        epoch, seq = ray.get(self._index.barrier.remote(timeout), timeout=timeout + 5)
        deadline = time.monotonic() + timeout
        with self._cv:
            while not (self._view.epoch == epoch and self._view.seq >= seq):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StoreUnavailableError("kvray: local view did not catch up in time")
                self._cv.wait(left)

    # ------------------------------------------------------------------ lookups
    def lookup(self, keys: Sequence[bytes]) -> int:
        """Length of the longest prefix of ``keys`` held anywhere (local view, no actor call)."""
        t0 = time.perf_counter()
        where = self._view.where
        n = 0
        for k in keys:
            if k not in where:
                break
            n += 1
        tally = self.tally
        tally.lookups += 1
        tally.hit_blocks += n
        tally.miss_blocks += len(keys) - n
        latencies = tally.latencies
        if len(latencies) < 10_000:
            latencies.append(time.perf_counter() - t0)
        return n

    def contains(self, key: bytes) -> bool:
        return key in self._view.where

    def holder_nodes(self, key: bytes) -> list[str]:
        """Node ids whose pools hold ``key`` (local view), e.g. for prefix-aware routing."""
        nodes = self._view.nodes
        return [nodes[s].node_id for s in self._view.holders(key) if s in nodes]

    def prefix_by_node(self, keys: Sequence[bytes]) -> dict[str, int]:
        """Per alive node: how many leading ``keys`` its pool holds (local view, no actor
        call). Routers send a request to the node with the longest cached prefix."""
        view = self._view
        nodes = view.nodes
        out = {info.node_id: 0 for info in nodes.values()}
        holding = set(out)
        for k in keys:
            holding &= {nodes[s].node_id for s in view.holders(k) if s in nodes}
            if not holding:
                break
            for node_id in holding:
                out[node_id] += 1
        return out

    # ------------------------------------------------------------------ puts
    def put(self, keys: Sequence[bytes], blocks: Sequence[Any]) -> Future[PutResult]:
        """Store blocks under keys in the background; the Future resolves when the pool owns them.

        The caller must not modify the blocks' memory before the Future resolves. Blocks beyond
        ``max_inflight_put_bytes`` still in flight are refused (counted), never queued.
        """
        keys = check_keys(keys)
        if len(keys) != len(blocks):
            raise ValueError(f"put: {len(keys)} keys but {len(blocks)} blocks")
        arrays = [as_bytes_view(b) for b in blocks]
        fut: Future[PutResult] = Future()
        todo = [(k, a) for k, a in zip(keys, arrays, strict=True) if k not in self._view.where]
        dup = len(keys) - len(todo)
        nbytes = sum(a.nbytes for _, a in todo)
        if not todo:
            fut.set_result(PutResult(0, dup, 0))
            return fut
        with self._inflight_lock:
            if self._inflight + nbytes > self.config.max_inflight_put_bytes:
                self._refused_client += len(todo)
                fut.set_result(PutResult(0, dup, len(todo)))
                return fut
            self._inflight += nbytes
        return self._puts.submit(self._put_now, todo, dup, nbytes)

    def _put_now(self, todo: list[tuple[bytes, np.ndarray]], dup: int, nbytes: int) -> PutResult:
        t0 = time.perf_counter()
        try:
            pool = self._pool_for_put()
            pending = []
            for seg in self._segments(todo):
                seg_keys = [k for k, _ in seg]
                sizes = [a.nbytes for _, a in seg]
                sums = [checksum(a) for _, a in seg]
                ref = ray.put([a for _, a in seg])
                pending.append((seg_keys, pool.put_segment.remote(seg_keys, sizes, sums, [ref])))
            result = PutResult(0, dup, 0)
            for seg_keys, ref in pending:
                try:
                    r: PutResult = ray.get(ref, timeout=self.config.put_timeout_s)
                except Exception as e:
                    logger.warning("kvray put: segment of %d blocks failed: %s", len(seg_keys), e)
                    r = PutResult(0, 0, len(seg_keys))
                result = result + r
            self.tally.bytes_stored += nbytes
            self.tally.observe("store_latencies", time.perf_counter() - t0)
            return result
        finally:
            with self._inflight_lock:
                self._inflight -= nbytes

    def _segments(self, todo: list[tuple[bytes, np.ndarray]]) -> list[list[tuple[bytes, Any]]]:
        segs: list[list[tuple[bytes, Any]]] = [[]]
        size = 0
        for item in todo:
            if segs[-1] and size + item[1].nbytes > self.config.segment_bytes:
                segs.append([])
                size = 0
            segs[-1].append(item)
            size += item[1].nbytes
        return segs

    def _pool_for_put(self) -> Any:
        """This node's pool; another one only if this node has none (yet)."""
        nodes = self._view.nodes
        mine = [n for n in nodes.values() if n.node_id == self._node_id]
        info = mine[0] if mine else next(iter(nodes.values()), None)
        if info is None:
            raise StoreUnavailableError("kvray: no block pool is alive in this namespace")
        return self._pool(info)

    def _pool(self, info: NodeInfo) -> Any:
        handle = self._pools.get(info.pool_name)
        if handle is None:
            handle = ray.get_actor(info.pool_name, namespace=RAY_NAMESPACE)
            self._pools[info.pool_name] = handle
        return handle

    # ------------------------------------------------------------------ gets
    def get(self, keys: Sequence[bytes], timeout: float | None = None) -> list[np.ndarray]:
        """The blocks' bytes (read-only uint8 arrays), all or :class:`BlockLostError`."""
        keys = check_keys(keys)
        t0 = time.perf_counter()
        got, lost = self._read(keys, timeout)
        for k in self._corrupt(got.items()):
            lost[k] = "checksum mismatch"
        if lost:
            self.tally.lost += len(lost)
            reasons = sorted(set(lost.values()))
            raise BlockLostError([k for k in keys if k in lost], "; ".join(reasons))
        out = [got[k].array for k in keys]
        self.tally.bytes_loaded += sum(a.nbytes for a in out)
        self.tally.observe("load_latencies", time.perf_counter() - t0)
        return out

    def fetch(self, keys: Sequence[bytes], timeout: float | None = None) -> Fetched:
        """The longest readable prefix of ``keys``, *not yet verified*: call :meth:`verify`.

        Splitting :meth:`get` lets a caller checksum the bytes while it copies them (the
        connector hashes each block in its copy thread right after copying it, while the bytes
        are still in the CPU cache) and report the blocks that fail for recompute.
        """
        keys = check_keys(keys)
        t0 = time.perf_counter()
        where = self._view.where
        known = next((i for i, k in enumerate(keys) if k not in where), len(keys))
        got, lost = self._read(keys[:known], timeout)  # nothing past a key nobody holds
        if known < len(keys):
            lost[keys[known]] = "not in the index"
        n = next((i for i, k in enumerate(keys) if k not in got), len(keys))
        reads = [got[k] for k in keys[:n]]
        reason = "" if n == len(keys) else lost.get(keys[n], "not read")
        self.tally.lost += len(lost)
        fetched = Fetched(keys[:n], reason, reads)
        self.tally.observe("load_latencies", time.perf_counter() - t0)
        return fetched

    def verify(self, fetched: Fetched, sums: Sequence[int | None] | None = None) -> int:
        """How many leading blocks of ``fetched`` match their checksums; every mismatch is
        reported to its pool (never served again) and counted as lost.

        ``sums``: checksums (:func:`checksum`) the caller already took of the same arrays,
        e.g. while copying them; ``None`` entries are computed here."""
        bad = self._corrupt(zip(fetched.keys, fetched.reads, strict=True), sums)
        n = next((i for i, k in enumerate(fetched.keys) if k in bad), len(fetched.keys))
        self.tally.lost += len(bad)
        self.tally.bytes_loaded += sum(a.nbytes for a in fetched.arrays[:n])
        return n

    def _corrupt(
        self, reads: Iterable[tuple[bytes, _Read]], sums: Sequence[int | None] | None = None
    ) -> set[bytes]:
        """Keys whose bytes do not match their checksum (reported to their pools)."""
        if not self.config.verify_checksums:
            return set()
        corrupt: dict[int, list[bytes]] = {}
        for i, (k, r) in enumerate(reads):
            got = sums[i] if sums is not None else None
            if (checksum(r.array) if got is None else got) != r.checksum:
                corrupt.setdefault(r.slot, []).append(k)
        nodes = self._view.nodes
        for slot, ks in corrupt.items():
            logger.warning("kvray: %d block(s) from pool %d fail their checksum", len(ks), slot)
            if slot in nodes:
                with contextlib.suppress(Exception):
                    self._pool(nodes[slot]).report_lost.remote(ks, "checksum mismatch")
        return {k for ks in corrupt.values() for k in ks}

    def _read(
        self, keys: Sequence[bytes], timeout: float | None
    ) -> tuple[dict[bytes, _Read], dict[bytes, str]]:
        """Lease and map every key it can (each key tried on its holders, this node first);
        returns what was read and key -> why for the rest. Checksums are not checked here."""
        timeout = self.config.get_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        view = self._view
        got: dict[bytes, _Read] = {}
        lost: dict[bytes, str] = {}
        plans: dict[bytes, list[int]] = {}
        for k in keys:
            slots = [s for s in view.holders(k) if s in view.nodes]
            if len(slots) > 1:
                slots.sort(key=lambda s: view.nodes[s].node_id != self._node_id)
            if slots:
                plans[k] = slots
            else:
                lost[k] = "not in the index"
        attempt = 0
        while plans:
            by_slot: dict[int, list[bytes]] = {}
            for k, slots in plans.items():
                by_slot.setdefault(slots[attempt], []).append(k)
            failed = self._get_from(by_slot, got, deadline)
            retry: dict[bytes, list[int]] = {}
            for k, why in failed.items():
                if attempt + 1 < len(plans[k]):
                    retry[k] = plans[k]
                else:
                    lost[k] = why
            plans, attempt = retry, attempt + 1
        return got, lost

    def _get_from(
        self, by_slot: dict[int, list[bytes]], got: dict[bytes, _Read], deadline: float
    ) -> dict[bytes, str]:
        """Read blocks from their pools; returns key -> why for every key not read."""
        failed: dict[bytes, str] = {}
        nodes = self._view.nodes
        lease_refs = {}
        for slot, ks in by_slot.items():
            try:
                lease_refs[slot] = self._pool(nodes[slot]).lease.remote(ks)
            except Exception as e:
                failed.update(dict.fromkeys(ks, f"pool unavailable ({type(e).__name__})"))
        replies: dict[int, LeaseReply] = {}
        for slot, ref in lease_refs.items():
            try:
                replies[slot] = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except Exception as e:
                failed.update(dict.fromkeys(by_slot[slot], f"pool failed ({type(e).__name__})"))
        served: dict[int, int] = {}
        try:
            for slot, reply in replies.items():
                ks = by_slot[slot]
                found = np.flatnonzero(reply.seg_ids).tolist()
                if len(found) < len(ks):
                    missing = np.flatnonzero(reply.seg_ids == 0).tolist()
                    failed.update((ks[i], "evicted or never stored") for i in missing)
                seg_ids = list(reply.segments)
                try:
                    values = ray.get(
                        [reply.segments[s] for s in seg_ids],
                        timeout=max(0.0, deadline - time.monotonic()),
                    )
                except Exception as e:
                    failed.update((ks[i], f"object lost ({type(e).__name__})") for i in found)
                    continue
                segs = dict(zip(seg_ids, values, strict=True))
                seg_of, pos = reply.seg_ids.tolist(), reply.positions.tolist()
                sizes, sums = reply.nbytes.tolist(), reply.checksums.tolist()
                nbytes = 0
                wrong_size: list[bytes] = []
                for i in found:
                    arr = segs[seg_of[i]][pos[i]]
                    if arr.nbytes != sizes[i]:
                        wrong_size.append(ks[i])
                        failed[ks[i]] = "size mismatch"
                        continue
                    got[ks[i]] = _Read(arr, sums[i], slot)
                    nbytes += arr.nbytes
                served[slot] = nbytes
                if wrong_size:
                    with contextlib.suppress(Exception):
                        self._pool(nodes[slot]).report_lost.remote(wrong_size, "size mismatch")
        finally:
            # Mapped segments stay pinned while their arrays live: the leases are done. They
            # go back in batches from the feed thread (below), not one call per read: a
            # release sent now would wake the pool while the caller copies and vLLM computes,
            # and on a busy node that costs the load ~2 ms (measured).
            full = False
            with self._release_lock:
                for slot, reply in replies.items():
                    batch = self._releases.setdefault(slot, [])
                    batch.append((reply.lease_id, served.get(slot, 0)))
                    full = full or len(batch) >= MAX_RELEASE_BATCH
            if full:  # the feed thread is slow or gone: never let the batches grow unbounded
                with contextlib.suppress(RuntimeError):  # closed: close() flushes them
                    self._puts.submit(self._flush_releases)
        return failed

    def _flush_releases(self) -> None:
        """Send the finished leases, one call per pool (feed thread, and ``close``)."""
        with self._release_lock:
            batches, self._releases = self._releases, {}
        nodes = self._view.nodes
        for slot, batch in batches.items():
            if slot in nodes:
                with contextlib.suppress(Exception):  # else the leases expire on their own
                    self._pool(nodes[slot]).release_many.remote(batch)

    def get_into(self, keys: Sequence[bytes], out: Sequence[Any]) -> None:
        """Like :meth:`get`, copying each block into the caller's writable buffer."""
        blocks = self.get(keys)
        for src, dst in zip(blocks, out, strict=True):
            np.copyto(as_bytes_view(dst), src)

    # ------------------------------------------------------------------ figures
    def stats(self, timeout: float = 10.0) -> dict[str, Any]:
        """Cluster-wide and per-node figures (one call per pool and to the index)."""
        index_stats = ray.get(self._index.stats.remote(), timeout=timeout)
        per_node: dict[str, dict[str, Any]] = {}
        refs = {info.node_id: self._pool(info).stats.remote() for info in self._view.nodes.values()}
        for node_id, ref in refs.items():
            try:
                per_node[node_id] = ray.get(ref, timeout=timeout)
            except Exception as e:
                per_node[node_id] = {"error": f"{type(e).__name__}: {e}"}
        totals: dict[str, int] = {}
        for s in per_node.values():
            for k, v in s.items():
                if isinstance(v, int) and not isinstance(v, bool):
                    totals[k] = totals.get(k, 0) + v
        return {
            "namespace": self.config.namespace,
            "index": {k: v for k, v in index_stats.items() if k != "config"},
            "totals": totals,
            "nodes": per_node,
            "client": {
                "view_keys": len(self._view.where),
                "refused_inflight": self._refused_client,
            },
        }

    @property
    def closed(self) -> bool:
        """True once closed, or once kvray was stopped in the namespace."""
        return self._closed.is_set()

    def close(self) -> None:
        """Stop the feed thread and wait for puts in flight (so a process can exit cleanly)."""
        self._closed.set()
        self._puts.shutdown(wait=True)
        self._flush_releases()
        if self._feed.is_alive() and self._feed is not threading.current_thread():
            # The long poll returns within about a second; Ray must not shut down under it.
            self._feed.join(timeout=self.config.get_timeout_s + 2)

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(namespace: str = "default", config: KVRayConfig | None = None) -> Store:
    """Connect to a running kvray namespace (``kvray.start`` first)."""
    cfg = config or KVRayConfig(namespace=namespace)
    if config is not None and namespace != "default" and config.namespace != namespace:
        cfg = config.replace(namespace=namespace)
    return Store(cfg)
