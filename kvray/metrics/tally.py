"""Metrics of a client process (a vLLM scheduler or worker, a driver): Ray metrics created
once per process, fed from plain counters that hot paths bump (:class:`ClientTally`)."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from ray.util import metrics

from kvray.metrics.common import LATENCY_BOUNDARIES, declare, export_zero

if TYPE_CHECKING:
    from kvray.feed import Subscriber

__all__ = ["HANDOFF_BOUNDARIES", "ClientMetrics", "ClientTally", "HandoffMetrics", "ViewTally"]

#: Buckets (s) of ``kvray_handoff_latency_s``: fine below 100 ms, where a handoff should be.
HANDOFF_BOUNDARIES = [
    0.005,
    0.01,
    0.015,
    0.02,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    1.0,
    2.0,
    5.0,
]


#: The tally's counters (:class:`ClientTally`, by name) and the Ray counters they flush to.
_CLIENT_COUNTERS = {
    "lookups": ("kvray_lookups", "Prefix lookups answered from the local view"),
    "hit_blocks": ("kvray_lookup_hit_blocks", "Blocks found by prefix lookups"),
    "miss_blocks": ("kvray_lookup_miss_blocks", "Blocks asked for by lookups and not found"),
    "bytes_loaded": ("kvray_bytes_loaded", "Bytes read from pools by this process"),
    "bytes_stored": ("kvray_bytes_stored", "Bytes handed to pools by this process"),
    "lost": ("kvray_lost_blocks", "Blocks a get could not serve (evicted, dead node, corrupt)"),
    "second_reads": (
        "kvray_second_reads",
        "Blocks a get did not find where its view said and asked the index for another holder",
    ),
    "second_hits": (
        "kvray_second_hits",
        "Blocks a get read from another holder after its view's holder had lost them",
    ),
    "tokens_loaded": ("kvray_tokens_loaded", "Prompt tokens loaded from kvray instead of computed"),
    "loads_declined": (
        "kvray_loads_declined",
        "Hits the connector left to vLLM to compute: their load cost more than the recompute",
    ),
    "tokens_declined": (
        "kvray_tokens_declined",
        "Tokens of hits computed by vLLM instead of loaded (the load would cost more)",
    ),
    "saves_declined": (
        "kvray_saves_declined",
        "Requests whose blocks the connector did not store: a later hit would not be loaded",
    ),
    "unseen_skipped": (
        "kvray_unseen_blocks_skipped",
        "Blocks not stored because no earlier prompt on the engine had them (store_seen_only)",
    ),
    "refused_no_room": (
        "kvray_puts_refused_no_room",
        "Blocks a put refused: this node's object store and its disk had no room for them",
    ),
}
_CLIENT_GAUGES = {
    "view_blocks": ("kvray_view_blocks", "Visible blocks in this process's local view"),
    "view_bytes": ("kvray_view_bytes", "Memory of this process's local view"),
}
#: The tally's latency samples (by name) and the Ray histograms they flush to.
_CLIENT_HISTOGRAMS = {
    "latencies": (
        "kvray_lookup_latency_s",
        "Latency of a prefix lookup",
        [1e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 1e-3, 1e-2],
    ),
    "load_latencies": (
        "kvray_load_latency_s",
        "Latency of one get (lease, read, verify)",
        LATENCY_BOUNDARIES,
    ),
    "store_latencies": (
        "kvray_store_latency_s",
        "Latency of one put, from call to pool ownership",
        LATENCY_BOUNDARIES,
    ),
}


class ClientMetrics:
    """Per-process figures of a client (a vLLM scheduler or worker, a driver).

    Created lazily, once per process, so that importing kvray never touches Ray's metrics.
    """

    _instance: ClientMetrics | None = None

    def __init__(self) -> None:
        keys = ("namespace",)
        self.counters = declare(metrics.Counter, _CLIENT_COUNTERS, keys)
        self.gauges = declare(metrics.Gauge, _CLIENT_GAUGES, keys)
        self.histograms = {
            name: metrics.Histogram(metric, doc, boundaries=bounds, tag_keys=keys)
            for name, (metric, doc, bounds) in _CLIENT_HISTOGRAMS.items()
        }

    @classmethod
    def get(cls) -> ClientMetrics:
        if cls._instance is None:
            cls._instance = ClientMetrics()
        return cls._instance

    def export_zero(self, namespace: str) -> None:
        """Export this process's counters of ``namespace`` from 0 (a new store client)."""
        for counter in self.counters.values():
            export_zero(counter, {"namespace": namespace})


class ClientTally:
    """Plain counters bumped on hot paths and flushed to Ray metrics about once a second.

    A Ray metric update costs 2-3 us; a lookup must cost less than that, so hot paths only
    add to ints here, under one lock (``+=`` on an attribute is a read, an add and a write: two
    threads can interleave and lose an update whatever the GIL). Latency lists are bounded
    should the flushing thread be stuck.
    """

    MAX_SAMPLES = 10_000
    COUNTERS = tuple(_CLIENT_COUNTERS)

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
        self.second_reads = 0
        self.second_hits = 0
        self.tokens_loaded = 0
        self.loads_declined = 0
        self.tokens_declined = 0
        self.saves_declined = 0
        self.unseen_skipped = 0
        self.refused_no_room = 0
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
        for name, counter in m.counters.items():
            n = counts[name]
            if n > 0:
                counter.inc(n, tags=t)
            elif n < 0:  # taken back after the flush (manager.py moves misses to hits)
                self.add(**{name: n})
        for name, hist in m.histograms.items():
            for v in samples[name]:
                hist.observe(v, tags=t)
        if self.view_blocks >= 0:
            m.gauges["view_blocks"].set(self.view_blocks, tags=t)
            m.gauges["view_bytes"].set(self.view_bytes, tags=t)


class ViewTally(ClientTally):
    """A store's tally: each flush (about once a second, from the data path's maintenance
    thread) also reports the size of the store's view (``kvray_view_blocks`` / ``_bytes``)."""

    def __init__(self, namespace: str) -> None:
        super().__init__(namespace)
        self.feed: Subscriber | None = None

    def flush(self) -> None:
        feed = self.feed
        if feed is not None:
            view = feed.view
            self.view_blocks, self.view_bytes = len(view), view.nbytes
        super().flush()


class HandoffMetrics:
    """A decode engine's P/D handoffs (:class:`kvray.connector.handoff.HandoffPlanner`):
    created by the first handoff a process takes, so only decode engines export them."""

    _instances: dict[str, HandoffMetrics] = {}

    def __init__(self, namespace: str) -> None:
        keys = ("namespace",)
        self.tags = {"namespace": namespace}
        self.handoffs = metrics.Counter(
            "kvray_handoffs", "Handed-off requests a decode engine began computing", tag_keys=keys
        )
        self.computed_tokens = metrics.Counter(
            "kvray_handoff_computed_tokens",
            "Prompt tokens a decode engine computed itself for handed-off requests",
            tag_keys=keys,
        )
        self.latency = metrics.Histogram(
            "kvray_handoff_latency_s",
            "Prefill finished -> the decode engine's first step over the request done",
            boundaries=HANDOFF_BOUNDARIES,
            tag_keys=keys,
        )
        self.arrival = metrics.Histogram(
            "kvray_handoff_arrival_s",
            "Prefill finished -> the decode engine's scheduler first sees the request (the P/D "
            "orchestrator's hop and the decode's step in progress; the rest of "
            "kvray_handoff_latency_s is the load and the first step)",
            boundaries=HANDOFF_BOUNDARIES,
            tag_keys=keys,
        )

    @classmethod
    def get(cls, namespace: str) -> HandoffMetrics:
        m = cls._instances.get(namespace)
        if m is None:
            m = cls._instances[namespace] = HandoffMetrics(namespace)
        return m

    def began(self, computed_tokens: int) -> None:
        self.handoffs.inc(1, tags=self.tags)
        if computed_tokens > 0:
            self.computed_tokens.inc(computed_tokens, tags=self.tags)

    def observe(self, seconds: float) -> None:
        self.latency.observe(seconds, tags=self.tags)

    def arrived(self, seconds: float) -> None:
        self.arrival.observe(seconds, tags=self.tags)
