"""kvray's Prometheus metrics as Ray exports them, and the docs and dashboard that name them.

Ray exports every ``ray.util.metrics`` figure with a ``ray_`` prefix at each node's Prometheus
endpoint (``http://<NodeManagerAddress>:<MetricsExportPort>/metrics``): the pools' and the
index's from the nodes their actors run on, a client's (this driver's) from the head. Counters
get a ``_total`` suffix there; histograms ``_bucket``/``_count``/``_sum``. Nothing here reads
kvray's source: the exported series are the truth the README table and the Grafana dashboard
are checked against.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families
from ray.cluster_utils import Cluster
from store_helpers import corrupt_in_plasma

import kvray
from kvray import stores
from kvray.meta.messages import RAY_NAMESPACE, pool_name
from kvray.testing.probe import metrics_urls

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DASHBOARD = ROOT / "scripts" / "grafana_kvray.json"

MiB = 1 << 20
BLOCK = 64 << 10
N_BLOCKS = 8
RAM = MiB  # the least a pool may have: 16 more blocks evict the first segment to disk
DISK = 64 * MiB
SCRAPE_TIMEOUT_S = 30.0
_SUFFIXES = ("_total", "_bucket", "_count", "_sum")


def _base(series: str) -> str:
    for suffix in _SUFFIXES:
        if series.endswith(suffix):
            return series[: -len(suffix)]
    return series


@dataclass
class Scrape:
    """One namespace's ``ray_kvray_*`` samples, summed over nodes, processes and other tags
    (histogram buckets keyed ``name{le}``), and each metric's type (``ray_kvray_x`` ->
    counter, gauge, histogram)."""

    values: dict[str, float] = field(default_factory=dict)
    types: dict[str, str] = field(default_factory=dict)

    def get(self, name: str) -> float:
        return self.values.get(name, 0.0)


def _scrape(urls: list[str], namespace: str) -> Scrape:
    out = Scrape()
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                text = resp.read().decode()
        except (urllib.error.URLError, OSError):
            continue  # an agent still starting: the next round tries again
        for family in text_string_to_metric_families(text):
            if not family.name.startswith("ray_kvray_"):
                continue
            for s in family.samples:
                if s.labels.get("namespace") != namespace:
                    continue
                out.types[_base(family.name)] = family.type
                key = f"{s.name}{{{s.labels['le']}}}" if "le" in s.labels else s.name
                out.values[key] = out.values.get(key, 0.0) + s.value
    return out


def _wait_scrape(
    urls: list[str], namespace: str, unmet: Callable[[Scrape], dict[str, Any]]
) -> Scrape:
    """Scrape until ``unmet`` (name -> what was seen, for what is not there yet) is empty."""
    deadline = time.monotonic() + SCRAPE_TIMEOUT_S
    while True:
        seen = _scrape(urls, namespace)
        missing = unmet(seen)
        if not missing:
            return seen
        if time.monotonic() > deadline:
            raise AssertionError(
                f"after {SCRAPE_TIMEOUT_S:.0f}s these figures of namespace {namespace} are "
                f"absent, wrong or not moved (as seen): {missing}; all seen: {seen.values}"
            )
        time.sleep(0.5)


def _exactly(want: dict[str, float]) -> Callable[[Scrape], dict[str, Any]]:
    return lambda seen: {k: seen.values.get(k) for k, v in want.items() if seen.values.get(k) != v}


def _wait_for(cond: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def _put_all(store: Any, keys: list[bytes], blocks: np.ndarray) -> None:
    """Put until the pool holds every block: a put that finds RAM leased (a read's lease on
    its way back) is refused, and the next one evicts."""
    deadline = time.monotonic() + SCRAPE_TIMEOUT_S
    while True:
        r = store.put(keys, blocks).result(timeout=60)
        if r.stored + r.duplicate == len(keys):
            return
        assert time.monotonic() < deadline, f"the pool keeps refusing: {r}"
        time.sleep(0.2)


def _route_one_request(namespace: str) -> None:
    """KVRayRouter's own code, outside Serve: one request with no prompt (reason no_prompt)."""
    from kvray.serving.router import KVRayRouter

    router = KVRayRouter.__new__(KVRayRouter)  # Serve's constructor wants a deployment
    router.initialize_state(namespace=namespace)
    try:
        picked = asyncio.run(router.choose_replicas(["replica-a", "replica-b"], None))
        assert len(picked) == 1 and sorted(picked[0]) == ["replica-a", "replica-b"]
        assert router.decisions == {"no_prompt": 1}
    finally:  # the warm-up thread connects the process's shared store: give it back
        _wait_for(lambda: router._store is not None, "the router's store")
        stores.release(router._store)


@pytest.fixture
def disk_ns(ray_cluster: Cluster, tmp_path: Path) -> Iterator[str]:
    """A namespace whose pools (one per node) have the least RAM and a disk tier."""
    ns = f"m{uuid.uuid4().hex[:10]}"
    kvray.start(
        namespace=ns,
        capacity=RAM,
        disk_dir=str(tmp_path),
        disk_capacity=DISK,
        health_check_interval_s=0.5,
    )
    try:
        yield ns
    finally:
        kvray.stop(ns, purge=True)


@pytest.mark.slow
@pytest.mark.quiet
def test_every_documented_metric_is_exported_with_its_value(disk_ns: str) -> None:
    """Drive a small workload; every kvray series shows at the nodes' endpoints with the value
    it must have; the README table and the dashboard name exactly the exported metrics."""
    ns = disk_ns
    rng = np.random.default_rng(3)
    keys = [f"metrics-{ns}-{i}".encode() for i in range(3 * N_BLOCKS)]
    blocks = [rng.integers(0, 255, BLOCK, dtype=np.uint8) for _ in keys]
    n_nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
    urls = metrics_urls()
    assert len(urls) == n_nodes, f"not every node exports metrics: {ray.nodes()}"
    store = kvray.connect(ns)
    try:
        # 1. One segment in, looked up (one key more than is held) and read: exact figures.
        first = keys[:N_BLOCKS]
        result = store.put(first, blocks[:N_BLOCKS]).result(timeout=60)
        assert (result.stored, result.refused) == (N_BLOCKS, 0)
        store.sync()
        assert store.lookup([*first, b"never-stored"]) == N_BLOCKS
        got = store.get(first)
        assert [g.tobytes() for g in got] == [b.tobytes() for b in blocks[:N_BLOCKS]]
        nbytes = float(N_BLOCKS * BLOCK)
        zero = [
            "pool_misses_total",
            "puts_refused_no_room_total",
            "pool_evictions_total",
            "pool_refused_puts_total",
            "pool_lost_blocks_total",
            "lost_blocks_total",
            "tokens_loaded_total",
            "index_purged_keys_total",
            "pool_blocks_spilled_total",
            "pool_blocks_promoted_total",
            "pool_blocks_read_from_disk_total",
            "pool_disk_evictions_total",
            "pool_disk_skipped_total",
            "pool_disk_corrupt_files_total",
            "pool_promote_failed_total",
            "pool_disk_blocks",
            "pool_disk_bytes_used",
            "pool_spilling_bytes",
            "pool_heap_bytes",  # a 512 KiB put goes through the object store
        ]
        want: dict[str, float] = {
            # The pool that took the blocks: one segment of N_BLOCKS blocks.
            "ray_kvray_pool_blocks_stored_total": N_BLOCKS,
            "ray_kvray_pool_bytes_stored_total": nbytes,
            "ray_kvray_pool_bytes_used": nbytes,
            "ray_kvray_pool_hits_total": N_BLOCKS,
            "ray_kvray_pool_bytes_loaded_total": nbytes,
            "ray_kvray_pool_store_latency_s_count": 1,
            # Every pool (one per node) reports its capacities.
            "ray_kvray_pool_capacity_bytes": float(n_nodes * RAM),
            "ray_kvray_pool_disk_capacity_bytes": float(n_nodes * DISK),
            # The index.
            "ray_kvray_index_keys": N_BLOCKS,
            "ray_kvray_index_pools": n_nodes,
            # This driver's client tally (flushed by its maintenance thread every second).
            "ray_kvray_lookups_total": 1,
            "ray_kvray_lookup_hit_blocks_total": N_BLOCKS,
            "ray_kvray_lookup_miss_blocks_total": 1,
            "ray_kvray_lookup_latency_s_count": 1,
            "ray_kvray_bytes_stored_total": nbytes,
            "ray_kvray_store_latency_s_count": 1,
            "ray_kvray_bytes_loaded_total": nbytes,
            "ray_kvray_load_latency_s_count": 1,
            "ray_kvray_load_latency_s_bucket{+Inf}": 1,
            "ray_kvray_view_blocks": N_BLOCKS,
            # Nothing rare happened yet: exported, at 0.
            **{f"ray_kvray_{name}": 0.0 for name in zero},
        }
        seen = _wait_scrape(urls, ns, _exactly(want))
        # A histogram: cumulative buckets, the one get in the last; its time in _sum.
        buckets = [v for k, v in seen.values.items() if k.startswith("ray_kvray_load_latency_s_b")]
        assert len(buckets) == 13 and set(buckets) <= {0.0, 1.0}, buckets
        assert seen.get("ray_kvray_load_latency_s_sum") > 0
        assert seen.get("ray_kvray_view_bytes") > 0
        assert seen.get("ray_kvray_index_bytes") > 0
        assert seen.get("ray_kvray_index_log_entries") >= 0

        # 2. The rare events: a corrupt block, eviction to disk and a read back, a routing.
        pool = ray.get_actor(
            pool_name(ns, ray.get_runtime_context().get_node_id()), namespace=RAY_NAMESPACE
        )
        corrupt_in_plasma(pool, first[0])
        with pytest.raises(kvray.BlockLostError, match="checksum"):
            store.get(first[:1])
        more = keys[N_BLOCKS:]  # 1 MiB: RAM holds it only once the first segment is on disk
        _put_all(store, more, np.stack(blocks[N_BLOCKS:]))

        def landed() -> bool:
            s = ray.get(pool.stats.remote(), timeout=30)
            return s["spilled"] > 0 and s["spilling_bytes"] == s["disk_pending_bytes"] == 0

        _wait_for(landed, "the first segment to land on disk")
        store.sync()
        rest = first[1:]
        assert [g.tobytes() for g in store.get(rest)] == [b.tobytes() for b in blocks[1:N_BLOCKS]]
        _route_one_request(ns)

        def unmoved(seen: Scrape) -> dict[str, Any]:
            exact = {
                "ray_kvray_lost_blocks_total": 1,
                "ray_kvray_pool_lost_blocks_total": 1,
                "ray_kvray_router_decisions_total": 1,
            }
            moved = [
                "pool_evictions_total",
                "pool_blocks_spilled_total",
                "pool_disk_blocks",
                "pool_disk_bytes_used",
            ]
            out: dict[str, Any] = _exactly(exact)(seen)
            out.update({n: seen.values.get(f"ray_kvray_{n}") for n in moved})
            for n in moved:
                if seen.get(f"ray_kvray_{n}") > 0:
                    del out[n]
            read_back = seen.get("ray_kvray_pool_blocks_promoted_total") + seen.get(
                "ray_kvray_pool_blocks_read_from_disk_total"
            )
            if read_back < len(rest):
                out["promoted + read_from_disk"] = read_back
            return out

        seen = _wait_scrape(urls, ns, unmoved)
    finally:
        store.close()

    # 3. The exported metrics, the README table and the dashboard agree.
    exported = {name[len("ray_") :]: kind for name, kind in seen.types.items()}
    documented = _documented()
    assert set(documented) == set(exported), (
        f"documented, not exported: {sorted(set(documented) - set(exported))}; "
        f"exported, not documented: {sorted(set(exported) - set(documented))}"
    )
    assert documented == exported, "the README's kind of each metric is its exported type"
    plotted = _plotted()
    assert set(plotted) == set(exported), (
        f"plotted, not exported: {sorted(set(plotted) - set(exported))}; "
        f"exported, not plotted: {sorted(set(exported) - set(plotted))}"
    )
    for name, series in plotted.items():  # a bare counter name would plot nothing
        allowed = {
            "counter": {"_total"},
            "histogram": {"_bucket", "_count", "_sum"},
            "gauge": {""},
        }[exported[name]]
        assert {s[len(name) :] for s in series} <= allowed, (name, series)


# ---------------------------------------------------------------------- docs and dashboard


def _documented() -> dict[str, str]:
    """The README's metrics table: name -> kind."""
    text = README.read_text()
    start = text.index("| metric | kind | what |")
    rows = text[start:].split("\n\n", 1)[0].splitlines()[2:]
    out: dict[str, str] = {}
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        for name in re.findall(r"`(kvray_[a-z0-9_]+)`", cells[0]):
            out[name] = cells[1]
    assert len(out) >= 20, f"parsed too few metrics from README's table: {out}"
    return out


def _panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """All panels, including those nested in rows."""
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def _exprs() -> list[str]:
    return [
        t["expr"]
        for p in _panels(json.loads(DASHBOARD.read_text()))
        if p.get("type") != "row"
        for t in p["targets"]
    ]


def _plotted() -> dict[str, set[str]]:
    """Metric name (``kvray_x``) -> the series the dashboard queries of it."""
    out: dict[str, set[str]] = {}
    for e in _exprs():
        for series in re.findall(r"\bray_(kvray_[a-z0-9_]+)", e):
            out.setdefault(_base(series), set()).add(series)
    return out


def test_grafana_dashboard_is_well_formed() -> None:
    """The dashboard JSON loads, uses the datasource variable, and its queries parse."""
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["title"]
    templating = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert templating["datasource"]["type"] == "datasource"
    assert templating["datasource"]["query"] == "prometheus"
    ids: list[int] = []
    for panel in _panels(dashboard):
        ids.append(panel["id"])
        if panel.get("type") == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], f"panel {panel['title']!r} has no query"
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for e in _exprs():  # a cheap PromQL sanity check: brackets balance
        depth = 0
        for ch in e:
            depth += {"(": 1, "{": 1, "[": 1, ")": -1, "}": -1, "]": -1}.get(ch, 0)
            assert depth >= 0, e
        assert depth == 0, e
    assert len(_plotted()) >= 20


def test_a_counter_that_cannot_start_at_zero_is_logged_once_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``export_zero`` uses a private Ray API: where it fails, the series starts at its first
    event, said once in the log and counted, not swallowed."""
    from kvray.metrics import common

    class Refusing:
        def _record(self, value: float, tags: dict[str, str]) -> None:
            raise AttributeError("no _record in this Ray")

    before = common.export_zero_failures
    with caplog.at_level("WARNING", logger="kvray.metrics.common"):
        common.export_zero(Refusing(), {"namespace": "x"})  # type: ignore[arg-type]
        common.export_zero(Refusing(), {"namespace": "y"})  # type: ignore[arg-type]
    assert common.export_zero_failures == before + 2
    said = [r for r in caplog.records if "start at their first event" in r.getMessage()]
    assert len(said) == (1 if before == 0 else 0)
    if said:
        assert "AttributeError: no _record in this Ray" in said[0].getMessage()
