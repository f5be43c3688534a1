"""Ray dashboard metrics of the pools and the index (``ray_kvray_*`` at each node's endpoint).

``ray.util.metrics`` objects are cheap to update but must be created inside the process that
records them, so each actor builds its own set. Tags carry the kvray namespace and node.

Counters are exported from 0 as soon as their owner exists (:func:`export_zero`), not from
their first event: a rate or an alert over a rare event (a lost block, a purge) then reads 0
instead of "no data", and every documented series can be checked at the endpoint
(tests/test_metrics.py).
"""

from __future__ import annotations

import contextlib
import threading

from ray.util import metrics


class _Disabled:
    """Stands in for a metrics set where Ray metrics cannot be recorded (unit tests)."""

    def __getattr__(self, name: str) -> object:
        return _noop


def _noop(*args: object, **kwargs: object) -> None:
    return None


#: Why a read of a block held on disk failed (``promote_failed_<cause>`` in a pool's stats).
PROMOTE_FAILURE_CAUSES = ("no_room", "corrupt", "io")


def export_zero(counter: metrics.Counter, tags: dict[str, str]) -> None:
    """Export ``counter`` at 0 for ``tags`` before its first event. ``Counter.inc`` refuses
    0; ``_record`` is what it calls. Best effort: without it the series starts at its first
    event, as Ray's counters do."""
    with contextlib.suppress(Exception):
        counter._record(0, tags=tags)


_LATENCY_BOUNDARIES = [0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0]


class PoolMetrics:
    """Counters and gauges of one block pool."""

    def __init__(self, namespace: str, node_id: str) -> None:
        keys = ("namespace", "node_id")
        self._tags = {"namespace": namespace, "node_id": node_id}
        self._hits = metrics.Counter("kvray_pool_hits", "Blocks found by reads", tag_keys=keys)
        self._misses = metrics.Counter(
            "kvray_pool_misses", "Blocks asked for and not held", tag_keys=keys
        )
        self._stored_blocks = metrics.Counter(
            "kvray_pool_blocks_stored", "Blocks stored", tag_keys=keys
        )
        self._stored_bytes = metrics.Counter(
            "kvray_pool_bytes_stored", "Bytes stored", tag_keys=keys
        )
        self._served_bytes = metrics.Counter(
            "kvray_pool_bytes_loaded", "Bytes read by clients", tag_keys=keys
        )
        self._evictions = metrics.Counter(
            "kvray_pool_evictions", "Blocks evicted to make room", tag_keys=keys
        )
        self._refused = metrics.Counter(
            "kvray_pool_refused_puts", "Blocks refused for lack of room", tag_keys=keys
        )
        self._lost = metrics.Counter(
            "kvray_pool_lost_blocks", "Blocks found corrupt or lost", tag_keys=keys
        )
        self._used = metrics.Gauge("kvray_pool_bytes_used", "Bytes held", tag_keys=keys)
        self._capacity = metrics.Gauge(
            "kvray_pool_capacity_bytes", "Capacity of the pool", tag_keys=keys
        )
        self._store_latency = metrics.Histogram(
            "kvray_pool_store_latency_s",
            "Time for the pool to take ownership of one segment",
            boundaries=_LATENCY_BOUNDARIES,
            tag_keys=keys,
        )
        # The disk tier (issue 12): gauges set and counters advanced from its figures.
        self._disk_gauges = {
            "disk_blocks": metrics.Gauge(
                "kvray_pool_disk_blocks", "Blocks in the disk tier's files", tag_keys=keys
            ),
            "disk_bytes": metrics.Gauge(
                "kvray_pool_disk_bytes_used", "Bytes of the disk tier's files", tag_keys=keys
            ),
            "disk_capacity": metrics.Gauge(
                "kvray_pool_disk_capacity_bytes", "Capacity of the disk tier", tag_keys=keys
            ),
            "spilling_bytes": metrics.Gauge(
                "kvray_pool_spilling_bytes",
                "Bytes on their way to disk (object store, outside the RAM count)",
                tag_keys=keys,
            ),
        }
        self._disk_counters = {
            "spilled": metrics.Counter(
                "kvray_pool_blocks_spilled", "Blocks written to the disk tier", tag_keys=keys
            ),
            "promoted": metrics.Counter(
                "kvray_pool_blocks_promoted", "Blocks read back from disk to RAM", tag_keys=keys
            ),
            "disk_evictions": metrics.Counter(
                "kvray_pool_disk_evictions", "Blocks evicted from the disk tier", tag_keys=keys
            ),
            "disk_skipped": metrics.Counter(
                "kvray_pool_disk_skipped",
                "Blocks RAM evicted that could not go to disk (queue full, write failed)",
                tag_keys=keys,
            ),
            "disk_corrupt": metrics.Counter(
                "kvray_pool_disk_corrupt_files",
                "Disk files found truncated, corrupt or foreign (skipped)",
                tag_keys=keys,
            ),
            "read_from_disk": metrics.Counter(
                "kvray_pool_blocks_read_from_disk",
                "Blocks served straight from disk files (RAM was all leased)",
                tag_keys=keys,
            ),
        }
        # Reads of disk blocks that failed, by cause: no_room (RAM too small for the reads
        # in flight), corrupt, io (the disk).
        self._promote_failed = metrics.Counter(
            "kvray_pool_promote_failed",
            "Blocks asked for on disk and not served, by cause (no_room, corrupt, io)",
            tag_keys=(*keys, "cause"),
        )
        self._disk_exported = False
        for counter in (
            self._hits,
            self._misses,
            self._stored_blocks,
            self._stored_bytes,
            self._served_bytes,
            self._evictions,
            self._refused,
            self._lost,
        ):
            export_zero(counter, self._tags)

    @staticmethod
    def disabled() -> PoolMetrics:
        return _Disabled()  # type: ignore[return-value]

    def capacity(self, n: int) -> None:
        self._capacity.set(n, tags=self._tags)

    def used(self, n: int) -> None:
        self._used.set(n, tags=self._tags)

    def stored(self, blocks: int, nbytes: int, seconds: float, used: int) -> None:
        if blocks:
            self._stored_blocks.inc(blocks, tags=self._tags)
        if nbytes:
            self._stored_bytes.inc(nbytes, tags=self._tags)
        self._store_latency.observe(seconds, tags=self._tags)
        self._used.set(used, tags=self._tags)

    def looked_up(self, hits: int, misses: int) -> None:
        if hits:
            self._hits.inc(hits, tags=self._tags)
        if misses:
            self._misses.inc(misses, tags=self._tags)

    def served(self, nbytes: int) -> None:
        if nbytes:
            self._served_bytes.inc(nbytes, tags=self._tags)

    def evicted(self, n: int) -> None:
        if n:
            self._evictions.inc(n, tags=self._tags)

    def refused(self, n: int) -> None:
        if n:
            self._refused.inc(n, tags=self._tags)

    def lost(self, n: int) -> None:
        if n:
            self._lost.inc(n, tags=self._tags)

    def disk(self, figures: dict[str, int], last: dict[str, int]) -> None:
        """The disk tier's figures now, and the ones reported last time (counters advance by
        the difference). The first report exports the disk counters from 0 (a pool without a
        disk tier exports none)."""
        if not self._disk_exported:
            self._disk_exported = True
            for counter in self._disk_counters.values():
                export_zero(counter, self._tags)
            for cause in PROMOTE_FAILURE_CAUSES:
                export_zero(self._promote_failed, {**self._tags, "cause": cause})
        for name, gauge in self._disk_gauges.items():
            gauge.set(figures.get(name, 0), tags=self._tags)
        for name, counter in self._disk_counters.items():
            delta = figures.get(name, 0) - last.get(name, 0)
            if delta > 0:
                counter.inc(delta, tags=self._tags)
        for cause in PROMOTE_FAILURE_CAUSES:
            name = f"promote_failed_{cause}"
            delta = figures.get(name, 0) - last.get(name, 0)
            if delta > 0:
                self._promote_failed.inc(delta, tags={**self._tags, "cause": cause})


class IndexMetrics:
    """Gauges of one index shard."""

    def __init__(self, namespace: str, shard: int = 0) -> None:
        keys = ("namespace", "shard")
        self._tags = {"namespace": namespace, "shard": str(shard)}
        self._keys = metrics.Gauge(
            "kvray_index_keys", "Blocks in the index (one entry per block)", tag_keys=keys
        )
        self._pools = metrics.Gauge("kvray_index_pools", "Live block pools", tag_keys=keys)
        self._bytes = metrics.Gauge(
            "kvray_index_bytes", "Memory of the index's tables and change log", tag_keys=keys
        )
        self._log = metrics.Gauge(
            "kvray_index_log_entries", "Entries in the index's change log", tag_keys=keys
        )
        self._purged = metrics.Counter(
            "kvray_index_purged_keys", "Index entries dropped with a dead pool", tag_keys=keys
        )
        export_zero(self._purged, self._tags)

    @staticmethod
    def disabled() -> IndexMetrics:
        return _Disabled()  # type: ignore[return-value]

    def size(self, keys: int, pools: int) -> None:
        self._keys.set(keys, tags=self._tags)
        self._pools.set(pools, tags=self._tags)

    def memory(self, nbytes: int, log_entries: int) -> None:
        self._bytes.set(nbytes, tags=self._tags)
        self._log.set(log_entries, tags=self._tags)

    def purged(self, n: int) -> None:
        if n:
            self._purged.inc(n, tags=self._tags)


class ClientMetrics:
    """Per-process figures of a client (a vLLM scheduler or worker, a driver).

    Created lazily, once per process, so that importing kvray never touches Ray's metrics.
    """

    _instance: ClientMetrics | None = None

    def __init__(self) -> None:
        keys = ("namespace",)
        self.lookups = metrics.Counter(
            "kvray_lookups", "Prefix lookups answered from the local view", tag_keys=keys
        )
        self.lookup_hits = metrics.Counter(
            "kvray_lookup_hit_blocks", "Blocks found by prefix lookups", tag_keys=keys
        )
        self.lookup_misses = metrics.Counter(
            "kvray_lookup_miss_blocks", "Blocks asked for by lookups and not found", tag_keys=keys
        )
        self.lookup_latency = metrics.Histogram(
            "kvray_lookup_latency_s",
            "Latency of a prefix lookup",
            boundaries=[1e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 1e-3, 1e-2],
            tag_keys=keys,
        )
        self.tokens_loaded = metrics.Counter(
            "kvray_tokens_loaded",
            "Prompt tokens loaded from kvray instead of computed",
            tag_keys=keys,
        )
        self.bytes_loaded = metrics.Counter(
            "kvray_bytes_loaded", "Bytes read from pools by this process", tag_keys=keys
        )
        self.bytes_stored = metrics.Counter(
            "kvray_bytes_stored", "Bytes handed to pools by this process", tag_keys=keys
        )
        self.load_latency = metrics.Histogram(
            "kvray_load_latency_s",
            "Latency of one get (lease, read, verify)",
            boundaries=_LATENCY_BOUNDARIES,
            tag_keys=keys,
        )
        self.store_latency = metrics.Histogram(
            "kvray_store_latency_s",
            "Latency of one put, from call to pool ownership",
            boundaries=_LATENCY_BOUNDARIES,
            tag_keys=keys,
        )
        self.view_blocks = metrics.Gauge(
            "kvray_view_blocks", "Visible blocks in this process's local view", tag_keys=keys
        )
        self.view_bytes = metrics.Gauge(
            "kvray_view_bytes", "Memory of this process's local view", tag_keys=keys
        )
        self.lost_blocks = metrics.Counter(
            "kvray_lost_blocks",
            "Blocks a get could not serve (evicted, dead node, corrupt)",
            tag_keys=keys,
        )

    @classmethod
    def get(cls) -> ClientMetrics:
        if cls._instance is None:
            cls._instance = ClientMetrics()
        return cls._instance

    def export_zero(self, namespace: str) -> None:
        """Export this process's counters of ``namespace`` from 0 (a new store client)."""
        tags = {"namespace": namespace}
        for counter in (
            self.lookups,
            self.lookup_hits,
            self.lookup_misses,
            self.tokens_loaded,
            self.bytes_loaded,
            self.bytes_stored,
            self.lost_blocks,
        ):
            export_zero(counter, tags)


class ClientTally:
    """Plain counters bumped on hot paths and flushed to Ray metrics about once a second.

    A Ray metric update costs 2-3 us; a lookup must cost less than that, so hot paths only
    add to ints here, under one lock (``+=`` on an attribute is a read, an add and a write: two
    threads can interleave and lose an update whatever the GIL). Latency lists are bounded
    should the flushing thread be stuck.
    """

    MAX_SAMPLES = 10_000
    COUNTERS = (
        "lookups",
        "hit_blocks",
        "miss_blocks",
        "bytes_loaded",
        "bytes_stored",
        "lost",
        "tokens_loaded",
    )

    def __init__(self, namespace: str) -> None:
        self.tags = {"namespace": namespace}
        self._lock = threading.Lock()
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
        self.view_blocks = -1
        self.view_bytes = 0

    def add(self, **counts: int) -> None:
        """Add to counters by name (``tally.add(lost=3)``); thread-safe."""
        with self._lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)

    def looked_up(self, hits: int, misses: int, seconds: float) -> None:
        """One lookup (the hot path: one lock, no keyword dict)."""
        with self._lock:
            self.lookups += 1
            self.hit_blocks += hits
            self.miss_blocks += misses
            if len(self.latencies) < self.MAX_SAMPLES:
                self.latencies.append(seconds)

    def observe(self, name: str, seconds: float) -> None:
        with self._lock:
            values: list[float] = getattr(self, name)
            if len(values) < self.MAX_SAMPLES:
                values.append(seconds)

    def take(self) -> tuple[dict[str, int], dict[str, list[float]]]:
        """The counts and samples since the last take, zeroed (what :meth:`flush` sends)."""
        with self._lock:
            counts = {name: getattr(self, name) for name in self.COUNTERS}
            for name in self.COUNTERS:
                setattr(self, name, 0)
            samples = {
                "latencies": self.latencies,
                "load_latencies": self.load_latencies,
                "store_latencies": self.store_latencies,
            }
            self.latencies, self.load_latencies, self.store_latencies = [], [], []
        return counts, samples

    def flush(self) -> None:
        m = ClientMetrics.get()
        t = self.tags
        counts, samples = self.take()
        for name, counter in (
            ("lookups", m.lookups),
            ("hit_blocks", m.lookup_hits),
            ("miss_blocks", m.lookup_misses),
            ("bytes_loaded", m.bytes_loaded),
            ("bytes_stored", m.bytes_stored),
            ("lost", m.lost_blocks),
            ("tokens_loaded", m.tokens_loaded),
        ):
            n = counts[name]
            if n > 0:
                counter.inc(n, tags=t)
            elif n < 0:  # taken back after the flush (manager.py moves misses to hits)
                self.add(**{name: n})
        for name, hist in (
            ("latencies", m.lookup_latency),
            ("load_latencies", m.load_latency),
            ("store_latencies", m.store_latency),
        ):
            for v in samples[name]:
                hist.observe(v, tags=t)
        if self.view_blocks >= 0:
            m.view_blocks.set(self.view_blocks, tags=t)
            m.view_bytes.set(self.view_bytes, tags=t)
