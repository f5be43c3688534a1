"""Metrics of the server side: each block pool's and each index shard's (created inside the
actor that records them)."""

from __future__ import annotations

from ray.util import metrics

from kvray.metrics.common import (
    LATENCY_BOUNDARIES,
    PROMOTE_FAILURE_CAUSES,
    Disabled,
    export_zero,
)

__all__ = ["IndexMetrics", "PoolMetrics"]


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
            boundaries=LATENCY_BOUNDARIES,
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
        return Disabled()  # type: ignore[return-value]

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
        return Disabled()  # type: ignore[return-value]

    def size(self, keys: int, pools: int) -> None:
        self._keys.set(keys, tags=self._tags)
        self._pools.set(pools, tags=self._tags)

    def memory(self, nbytes: int, log_entries: int) -> None:
        self._bytes.set(nbytes, tags=self._tags)
        self._log.set(log_entries, tags=self._tags)

    def purged(self, n: int) -> None:
        if n:
            self._purged.inc(n, tags=self._tags)
