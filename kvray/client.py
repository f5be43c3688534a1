"""The client: ``kvray.connect()`` from any process connected to the cluster.

A :class:`Store` is a thin facade over two parts:

- :class:`~kvray.blockio.BlockIO`, the data path: ``put`` is non-blocking (a background thread
  checksums the blocks, ``ray.put``s them in segments and hands each to this node's pool; the
  Future resolves when the pool owns them); reads lease blocks from the pools that hold them.
- :class:`~kvray.feed.Subscriber`, the view: a thread long-polls the index shards and keeps a
  local copy (block id -> location), so ``lookup`` is a handful of array operations in the
  caller's process (microseconds, no actor call).

Keys given to the public API are single-shard blocks; the vLLM connector stores TP shards of one
block under one key through the same parts.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import numpy as np
import ray

from kvray import shutdown
from kvray.blockio import BlockIO
from kvray.blocks import (
    Blocks,
    Fetched,
    Read,
    as_blocks,
    as_bytes_view,
    check_keys,
    check_timeout,
    checksum,
    quick_keys,
    stacked,
)
from kvray.cluster import ensure_ray, get_control
from kvray.config import KVRayConfig
from kvray.errors import BlockLostError, InvalidArgumentError, StoreUnavailableError
from kvray.feed import Subscriber
from kvray.meta.ids import index_shard_of, key_ids
from kvray.meta.messages import RAY_NAMESPACE, PutResult, index_name
from kvray.metrics import ClientMetrics, ViewTally

if TYPE_CHECKING:
    from kvray.meta.view import LocalView

logger = logging.getLogger(__name__)

__all__ = ["Fetched", "Store", "checksum", "connect"]


class Store:
    """A connection to one kvray namespace. Thread-safe; cheap to keep for a process' life.

    ``subscribe=False`` gives a store without a view (no feed thread): it can put and read
    from given locations (:meth:`fetch_from`), not look up. ``engine_view=False``: the view
    leaves out the engine tier (what each engine's own cache holds: routers read it, lookups
    never do), so the feed carries none of the engines' churn.
    """

    def __init__(
        self, config: KVRayConfig, *, subscribe: bool = True, engine_view: bool = True
    ) -> None:
        self.config = config
        ensure_ray(config.address)
        control = get_control(config.namespace)
        try:
            self.num_index_shards, _ = ray.get(
                control.layout.remote(), timeout=config.get_timeout_s
            )
        except Exception as e:
            raise StoreUnavailableError(
                f"kvray: the reconciler of namespace {config.namespace!r} did not answer: {e}"
            ) from e
        self.tally = ViewTally(config.namespace)
        with contextlib.suppress(Exception):  # the figures start at 0, not at their first event
            ClientMetrics.get().export_zero(config.namespace)
        self.io = BlockIO(config, self.tally)
        self.feed: Subscriber | None = None
        self._index: list[Any] = []  # the index shards' handles (a store with a view)
        # Blocks a get asked the index about after a lost read, and read from another holder.
        self._seconds = [0, 0]
        self._seconds_lock = threading.Lock()
        if subscribe:
            try:
                self.subscribe(engine_view)
            except Exception:
                self.io.close()
                raise
        # Closed at exit before Ray shuts down, unless closed before (kvray.shutdown).
        shutdown.track(self)

    def subscribe(self, engine_view: bool = True) -> None:
        """Keep a view of the index from now on (with the engine tier if ``engine_view``;
        a store that keeps one already adds the engine tier when asked, never drops it)."""
        if self.feed is not None:
            if engine_view:
                self.feed.include_engine_tier()
            return
        cfg = self.config
        handles = [
            ray.get_actor(index_name(cfg.namespace, i), namespace=RAY_NAMESPACE)
            for i in range(self.num_index_shards)
        ]
        feed = Subscriber(cfg.namespace, handles, cfg.get_timeout_s, engine_view=engine_view)
        feed.start()
        self._index = handles
        self.feed = self.tally.feed = feed

    # ------------------------------------------------------------------ guards
    def _check_open(self, what: str) -> None:
        if self.closed:
            feed = self.feed
            why = feed.error if feed is not None and (feed.stopped or feed.dead) else "closed"
            raise StoreUnavailableError(f"kvray: {what} on a store that is {why}")

    def _view(self, what: str) -> LocalView:
        if self.feed is None:
            raise InvalidArgumentError(f"kvray: {what} needs a store opened with subscribe=True")
        return self.feed.view

    # ------------------------------------------------------------------ lookups
    def lookup(self, keys: Sequence[bytes]) -> int:
        """Length of the longest prefix of ``keys`` held anywhere (local view, no actor call)."""
        t0 = time.perf_counter()
        keys = check_keys(keys) if not isinstance(keys, list) else quick_keys(keys)
        view = self._view("lookup")
        n = view.lookup(key_ids(keys)) if keys else 0
        self.tally.looked_up(n, len(keys) - n, time.perf_counter() - t0)
        return n

    def contains(self, key: bytes) -> bool:
        return bool(self._view("contains").contains(key_ids(check_keys([key], "key")))[0])

    def holder_nodes(self, key: bytes) -> list[str]:
        """Node ids whose pools hold ``key`` (local view), e.g. for prefix-aware routing."""
        return [n for n, c in self.prefix_by_node([key]).items() if c]

    def prefix_by_node(self, keys: Sequence[bytes]) -> dict[str, int]:
        """Per alive node: how many leading ``keys`` its pool holds (local view, no actor
        call). Routers send a request to the node with the longest cached prefix."""
        keys = check_keys(keys)
        view = self._view("prefix_by_node")
        nodes = view.nodes
        out = {info.node_id: 0 for info in nodes.values()}
        if not keys:
            return out
        ids = key_ids(keys)
        slots = view.slot_of(ids, view.locs(ids), 0)
        for slot, info in nodes.items():
            held = slots == slot
            out[info.node_id] = int(held.size if held.all() else held.argmin())
        return out

    # ------------------------------------------------------------------ puts
    def put(self, keys: Sequence[bytes], blocks: Sequence[Any] | Any) -> Future[PutResult]:
        """Store blocks under keys in the background; the Future resolves when the pool owns
        them. ``blocks``: one array or tensor per key, or one 2D array whose rows are the
        blocks. The caller must not modify the blocks' memory before the Future resolves.
        Blocks beyond ``max_inflight_put_bytes`` in flight are refused (counted)."""
        self._check_open("put")
        keys = check_keys(keys)
        payload = as_blocks(stacked(blocks), len(keys))
        ids = key_ids(keys)
        todo = np.ones(len(keys), dtype=bool)
        if self.feed is not None and len(keys):
            todo = ~self.feed.view.contains(ids)
        dup = len(keys) - int(todo.sum())
        if not todo.any():
            fut: Future[PutResult] = Future()
            fut.set_result(PutResult(0, dup, 0))
            return fut
        if not todo.all():
            idx = np.flatnonzero(todo)
            keys = [keys[i] for i in idx.tolist()]
            ids = ids[idx]
            payload = payload[idx] if isinstance(payload, np.ndarray) else [payload[i] for i in idx]
        inner = self.io.put(keys, ids, 0, 1, payload)
        if not dup:
            return inner
        outer: Future[PutResult] = Future()

        def done(f: Future[PutResult]) -> None:
            try:
                outer.set_result(f.result() + PutResult(0, dup, 0))
            except Exception as e:
                outer.set_exception(e)

        inner.add_done_callback(done)
        return outer

    def put_shard(
        self, keys: list[bytes], ids: np.ndarray, shard: int, num_shards: int, blocks: Blocks
    ) -> Future[PutResult]:
        """:meth:`put` of shard ``shard`` of ``num_shards`` of each block, under the keys' ids
        (:func:`kvray.meta.ids.key_ids`), unchecked and without a view: the connector's
        workers store their TP shard of each block under the block's key."""
        return self.io.put(keys, ids, shard, num_shards, blocks)

    def put_cpu_seconds(self) -> float:
        """CPU seconds this process' put threads have spent on this store's puts so far: what
        the background half of a put takes from the writer's process."""
        return self.io.put_cpu_seconds()

    # ------------------------------------------------------------------ gets
    def get(self, keys: Sequence[bytes], timeout: float | None = None) -> list[np.ndarray]:
        """Copies of the blocks' bytes (uint8 arrays), all or :class:`BlockLostError`."""
        keys = check_keys(keys)
        timeout = check_timeout(timeout, self.config.get_timeout_s)
        self._check_open("get")
        t0 = time.perf_counter()
        ids = key_ids(keys)
        held: list[tuple[str, int, int]] = []  # copies need no lease: given back at once
        try:
            got, lost = self._read(keys, ids, timeout, held)
            bad = self._corrupt(keys, ids, got, 0, self.io_pools())
            for i in bad:
                lost[i] = "checksum mismatch"
            if lost:
                self.tally.add(lost=len(lost))
                reasons = sorted(set(lost.values()))
                raise BlockLostError([keys[i] for i in sorted(lost)], "; ".join(reasons))
            out = [got[i].array.copy() for i in range(len(keys))]
        finally:
            self.io.release(held)
        self.tally.add(bytes_loaded=sum(a.nbytes for a in out))
        self.tally.observe("load_latencies", time.perf_counter() - t0)
        return out

    def fetch(self, keys: Sequence[bytes], timeout: float | None = None) -> Fetched:
        """The longest readable prefix of ``keys``, *not yet verified*: call :meth:`verify`.

        Splitting :meth:`get` lets a caller checksum the bytes while it copies them (the
        connector hashes each block in its copy thread right after copying it, while the bytes
        are still in the CPU cache) and report the blocks that fail for recompute.
        """
        keys = check_keys(keys)
        timeout = check_timeout(timeout, self.config.get_timeout_s)
        self._check_open("fetch")
        ids = key_ids(keys)
        view = self._view("fetch")
        known = view.lookup(ids)  # nothing past a key nobody holds
        slots = view.slot_of(ids[:known], view.locs(ids[:known]), 0)
        fetched = self.fetch_from(keys[:known], ids[:known], 0, slots, view.pool_names(), timeout)
        if known < len(keys) and len(fetched.keys) == known:
            return Fetched(fetched.keys, "not in the index", fetched.reads, 0, fetched.pools)
        return fetched

    def fetch_from(
        self,
        keys: Sequence[bytes],
        ids: np.ndarray,
        shard: int,
        slots: Sequence[int] | np.ndarray,
        pools: dict[int, str],
        timeout: float,
    ) -> Fetched:
        """:meth:`fetch` of shard ``shard`` of blocks at known pool slots (no view needed):
        the connector's workers read where the scheduler's view said the blocks are."""
        t0 = time.perf_counter()
        got, lost = self.io.read(
            keys, ids, shard, np.asarray(slots).tolist(), pools, time.monotonic() + timeout
        )
        n = next((i for i in range(len(keys)) if i not in got), len(keys))
        reason = "" if n == len(keys) else lost.get(n, "not read")
        self.tally.add(lost=len(lost))
        self.tally.observe("load_latencies", time.perf_counter() - t0)
        return Fetched(list(keys[:n]), reason, [got[i] for i in range(n)], shard, pools)

    def verify(self, fetched: Fetched, sums: Sequence[int | None] | None = None) -> int:
        """How many leading blocks of ``fetched`` match their checksums; every mismatch is
        reported to its pool (never served again) and counted as lost.

        ``sums``: checksums (:func:`checksum`) the caller already took of the same arrays,
        e.g. while copying them; ``None`` entries are computed here."""
        keys = fetched.keys
        ids = key_ids(keys)
        got = dict(enumerate(fetched.reads))
        bad = self._corrupt(keys, ids, got, fetched.shard, fetched.pools, sums)
        n = min(bad) if bad else len(keys)
        self.tally.add(lost=len(bad))
        self.tally.add(bytes_loaded=sum(a.nbytes for a in fetched.arrays[:n]))
        return n

    @property
    def local_pool(self) -> str:
        """The pool this client's puts go to (its node's)."""
        return self.io.local_pool

    def io_pools(self) -> dict[int, str]:
        return self.feed.view.pool_names() if self.feed is not None else {}

    def _read(
        self,
        keys: list[bytes],
        ids: np.ndarray,
        timeout: float,
        hold: list[tuple[str, int, int]] | None = None,
    ) -> tuple[dict[int, Read], dict[int, str]]:
        view = self._view("get")
        slots = view.slot_of(ids, view.locs(ids), 0)
        pools = view.pool_names()
        deadline = time.monotonic() + timeout
        got, lost = self.io.read(keys, ids, 0, slots.tolist(), pools, deadline, hold)
        if lost:
            self._second_try(keys, ids, slots, pools, deadline, hold, got, lost)
        return got, lost

    def _second_try(
        self,
        keys: list[bytes],
        ids: np.ndarray,
        slots: np.ndarray,
        pools: dict[int, str],
        deadline: float,
        hold: list[tuple[str, int, int]] | None,
        got: dict[int, Read],
        lost: dict[int, str],
    ) -> None:
        """Read each lost block once more from another pool that holds it whole, as the index
        shards know now (the view names one holder a block, and can be a batch behind a pool
        that evicted its copy). Updates ``got`` and ``lost`` in place; counted as
        ``second_reads`` (asked) and ``second_hits`` (read there)."""
        idx = np.array(sorted(lost), dtype=np.int64)
        left = max(0.0, deadline - time.monotonic())
        owner = index_shard_of(ids[idx], self.num_index_shards)
        other = np.full(idx.size, -1, dtype=np.int64)
        refs = {}
        for o in np.unique(owner).tolist():
            mine = np.flatnonzero(owner == o)
            refs[o] = (mine, self._index[o].other_holders.remote(ids[idx[mine]], slots[idx[mine]]))
        for mine, ref in refs.values():
            try:
                other[mine] = ray.get(ref, timeout=left)
            except Exception as e:  # no second try for these: the first answer stands
                logger.debug("kvray get: index shard did not name other holders: %s", e)
        ok = np.flatnonzero((other >= 0) & np.isin(other, list(pools)))
        self.tally.add(second_reads=int(idx.size))
        with self._seconds_lock:
            self._seconds[0] += int(idx.size)
        if not ok.size:
            return
        again = idx[ok]
        got2, _ = self.io.read(
            [keys[i] for i in again.tolist()],
            ids[again],
            0,
            other[ok].tolist(),
            pools,
            deadline,
            hold,
        )
        for j, r in got2.items():
            i = int(again[j])
            got[i] = r
            lost.pop(i, None)
        self.tally.add(second_hits=len(got2))
        with self._seconds_lock:
            self._seconds[1] += len(got2)

    def _corrupt(
        self,
        keys: Sequence[bytes],
        ids: np.ndarray,
        got: dict[int, Read],
        shard: int,
        pools: dict[int, str],
        sums: Sequence[int | None] | None = None,
    ) -> set[int]:
        """Indices whose bytes do not match their checksum (reported to their pools)."""
        if not self.config.verify_checksums:
            return set()
        bad: dict[int, list[tuple[bytes, int]]] = {}
        out: set[int] = set()
        for i, r in got.items():
            s = sums[i] if sums is not None and i < len(sums) else None
            if (checksum(r.array) if s is None else s) != r.checksum:
                bad.setdefault(r.slot, []).append((keys[i], int(ids[i])))
                out.add(i)
        for slot, items in bad.items():
            logger.warning("kvray: %d block(s) from pool %d fail their checksum", len(items), slot)
        self.io.report_lost(pools, bad, shard, "checksum mismatch")
        return out

    def get_into(self, keys: Sequence[bytes], out: Sequence[Any]) -> None:
        """Like :meth:`get`, copying each block into the caller's writable buffer."""
        keys = check_keys(keys)
        if len(out) != len(keys):
            raise InvalidArgumentError(f"kvray: {len(keys)} keys but {len(out)} buffers")
        self._check_open("get_into")
        ids = key_ids(keys)
        held: list[tuple[str, int, int]] = []
        try:
            got, lost = self._read(keys, ids, self.config.get_timeout_s, held)
            bad = self._corrupt(keys, ids, got, 0, self.io_pools())
            lost.update(dict.fromkeys(bad, "checksum mismatch"))
            if lost:
                self.tally.add(lost=len(lost))
                raise BlockLostError(
                    [keys[i] for i in sorted(lost)], "; ".join(sorted(set(lost.values())))
                )
            for i, dst in enumerate(out):
                np.copyto(as_bytes_view(dst, f"out[{i}]"), got[i].array)
        finally:
            self.io.release(held)

    # ------------------------------------------------------------------ barrier, figures
    def local_view(self) -> LocalView:
        """The store's view of the index (a store opened with ``subscribe=True``): the
        connector's scheduler plans loads from it."""
        return self._view("local_view")

    def count(self, **figures: int) -> None:
        """Add to this process's figures by name (``hit_blocks``, ``miss_blocks``,
        ``tokens_loaded``, ...; see :class:`~kvray.metrics.ClientTally`); thread-safe."""
        self.tally.add(**figures)

    def sync(self, timeout: float = 10.0) -> None:
        """Wait until the local view reflects every block any pool had stored when called."""
        timeout = check_timeout(timeout, 10.0)
        if self.feed is None:
            raise InvalidArgumentError("kvray: sync needs a store opened with subscribe=True")
        self._check_open("sync")
        self.feed.sync(timeout)

    def stats(self, timeout: float = 10.0) -> dict[str, Any]:
        """Cluster-wide and per-node figures (one call per pool and per index shard)."""
        from kvray.stats import gather_stats

        timeout = check_timeout(timeout, 10.0)
        self._check_open("stats")
        view = self.feed.view if self.feed is not None else None
        mine = {
            "view_keys": len(view) if view is not None else 0,
            "view_bytes": view.nbytes if view is not None else 0,
            "refused_inflight": self.io.refused_inflight,
            "refused_no_room": self.io.refused_no_room,
            "thread_deaths": self.thread_deaths,
            "second_reads": self._seconds[0],
            "second_hits": self._seconds[1],
        }
        ns = self.config.namespace
        return gather_stats(ns, self.num_index_shards, self.io.handle, mine, timeout)

    @property
    def closed(self) -> bool:
        """True once closed, once kvray was stopped in the namespace, or once the feed thread
        died for good (its view is empty: lookups miss)."""
        return self.io.closed or (self.feed is not None and self.feed.closed)

    @property
    def thread_deaths(self) -> int:
        """Deaths of this store's background threads (each restarted or closing the store)."""
        return self.io.thread_deaths + (self.feed.thread_deaths if self.feed is not None else 0)

    def close(self) -> None:
        """Stop the feed, wait for puts in flight, return leases (a process can exit cleanly)."""
        if self.feed is not None:
            self.feed.close()
        self.io.close()
        shutdown.untrack(self)

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(
    namespace: str = "default",
    config: KVRayConfig | None = None,
    *,
    subscribe: bool = True,
    engine_view: bool = True,
) -> Store:
    """Connect to a running kvray namespace (``kvray.start`` first); see :class:`Store`."""
    cfg = config or KVRayConfig(namespace=namespace)
    if config is not None and namespace != "default" and config.namespace != namespace:
        cfg = config.replace(namespace=namespace)
    return Store(cfg, subscribe=subscribe, engine_view=engine_view)
