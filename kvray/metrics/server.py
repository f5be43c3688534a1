"""Metrics of the server side: each block pool's and each index shard's (created inside the
actor that records them). Declared as tables (metric name and description by the name the
pool's figures use), so a figure is one line here and one ``inc``/``set`` by name."""

from __future__ import annotations

from ray.util import metrics

from kvray.metrics.common import (
    LATENCY_BOUNDARIES,
    PROMOTE_FAILURE_CAUSES,
    Disabled,
    declare,
    export_zero,
)

__all__ = ["IndexMetrics", "PoolMetrics"]

_POOL_COUNTERS = {
    "hits": ("kvray_pool_hits", "Blocks found by reads"),
    "misses": ("kvray_pool_misses", "Blocks asked for and not held"),
    "stored_blocks": ("kvray_pool_blocks_stored", "Blocks stored"),
    "stored_bytes": ("kvray_pool_bytes_stored", "Bytes stored"),
    "served_bytes": ("kvray_pool_bytes_loaded", "Bytes read by clients"),
    "evictions": ("kvray_pool_evictions", "Blocks evicted to make room"),
    "refused": ("kvray_pool_refused_puts", "Blocks refused for lack of room"),
    "lost": ("kvray_pool_lost_blocks", "Blocks found corrupt or lost"),
}
_POOL_GAUGES = {
    "used": ("kvray_pool_bytes_used", "Bytes held"),
    "capacity": ("kvray_pool_capacity_bytes", "Capacity of the pool"),
    "heap": (
        "kvray_pool_heap_bytes",
        "Bytes of small segments the pool holds in its own memory, not the object store "
        "(part of bytes_used)",
    ),
}
# The disk tier (issue 12): gauges set and counters advanced from its figures, by their names.
_DISK_GAUGES = {
    "disk_blocks": ("kvray_pool_disk_blocks", "Blocks in the disk tier's files"),
    "disk_bytes": ("kvray_pool_disk_bytes_used", "Bytes of the disk tier's files"),
    "disk_capacity": ("kvray_pool_disk_capacity_bytes", "Capacity of the disk tier"),
    "spilling_bytes": (
        "kvray_pool_spilling_bytes",
        "Bytes on their way to disk (object store, outside the RAM count)",
    ),
}
_DISK_COUNTERS = {
    "spilled": ("kvray_pool_blocks_spilled", "Blocks written to the disk tier"),
    "promoted": ("kvray_pool_blocks_promoted", "Blocks read back from disk to RAM"),
    "disk_evictions": ("kvray_pool_disk_evictions", "Blocks evicted from the disk tier"),
    "disk_skipped": (
        "kvray_pool_disk_skipped",
        "Blocks RAM evicted that could not go to disk (queue full, write failed)",
    ),
    "disk_corrupt": (
        "kvray_pool_disk_corrupt_files",
        "Disk files found truncated, corrupt or foreign (skipped)",
    ),
    "read_from_disk": (
        "kvray_pool_blocks_read_from_disk",
        "Blocks served straight from disk files (RAM was all leased)",
    ),
}
_INDEX_GAUGES = {
    "keys": ("kvray_index_keys", "Blocks in the index (one entry per block)"),
    "pools": ("kvray_index_pools", "Live block pools"),
    "bytes": ("kvray_index_bytes", "Memory of the index's tables and change log"),
    "log_entries": ("kvray_index_log_entries", "Entries in the index's change log"),
}


class PoolMetrics:
    """Counters and gauges of one block pool."""

    def __init__(self, namespace: str, node_id: str) -> None:
        keys = ("namespace", "node_id")
        self._tags = {"namespace": namespace, "node_id": node_id}
        self._counters = declare(metrics.Counter, _POOL_COUNTERS, keys)
        self._gauges = declare(metrics.Gauge, _POOL_GAUGES, keys)
        self._store_latency = metrics.Histogram(
            "kvray_pool_store_latency_s",
            "Time for the pool to take ownership of one segment",
            boundaries=LATENCY_BOUNDARIES,
            tag_keys=keys,
        )
        self._disk_gauges = declare(metrics.Gauge, _DISK_GAUGES, keys)
        self._disk_counters = declare(metrics.Counter, _DISK_COUNTERS, keys)
        # Reads of disk blocks that failed, by cause: no_room (RAM too small for the reads
        # in flight), corrupt, io (the disk).
        self._promote_failed = metrics.Counter(
            "kvray_pool_promote_failed",
            "Blocks asked for on disk and not served, by cause (no_room, corrupt, io)",
            tag_keys=(*keys, "cause"),
        )
        self._disk_exported = False
        for counter in self._counters.values():
            export_zero(counter, self._tags)

    @staticmethod
    def disabled() -> PoolMetrics:
        return Disabled()  # type: ignore[return-value]

    def _add(self, name: str, n: int) -> None:
        if n:
            self._counters[name].inc(n, tags=self._tags)

    def capacity(self, n: int) -> None:
        self._gauges["capacity"].set(n, tags=self._tags)

    def used(self, n: int) -> None:
        self._gauges["used"].set(n, tags=self._tags)

    def heap(self, n: int) -> None:
        self._gauges["heap"].set(n, tags=self._tags)

    def stored(self, blocks: int, nbytes: int, seconds: float, used: int) -> None:
        self._add("stored_blocks", blocks)
        self._add("stored_bytes", nbytes)
        self._store_latency.observe(seconds, tags=self._tags)
        self.used(used)

    def looked_up(self, hits: int, misses: int) -> None:
        self._add("hits", hits)
        self._add("misses", misses)

    def served(self, nbytes: int) -> None:
        self._add("served_bytes", nbytes)

    def evicted(self, n: int) -> None:
        self._add("evictions", n)

    def refused(self, n: int) -> None:
        self._add("refused", n)

    def lost(self, n: int) -> None:
        self._add("lost", n)

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
        self._gauges = declare(metrics.Gauge, _INDEX_GAUGES, keys)
        self._purged = metrics.Counter(
            "kvray_index_purged_keys", "Index entries dropped with a dead pool", tag_keys=keys
        )
        export_zero(self._purged, self._tags)

    @staticmethod
    def disabled() -> IndexMetrics:
        return Disabled()  # type: ignore[return-value]

    def _set(self, **figures: int) -> None:
        for name, value in figures.items():
            self._gauges[name].set(value, tags=self._tags)

    def size(self, keys: int, pools: int) -> None:
        self._set(keys=keys, pools=pools)

    def memory(self, nbytes: int, log_entries: int) -> None:
        self._set(bytes=nbytes, log_entries=log_entries)

    def purged(self, n: int) -> None:
        if n:
            self._purged.inc(n, tags=self._tags)
