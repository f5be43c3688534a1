"""kvray's Prometheus metrics, end to end, and the Grafana dashboard that plots them.

Ray exports every ``ray.util.metrics`` figure with a ``ray_`` prefix at each node's Prometheus
endpoint (``http://<NodeManagerAddress>:<MetricsExportPort>/metrics``): the pools' and the
index's from the nodes their actors run on, a client's (this driver's) from the head. Counters
get a ``_total`` suffix there; histograms ``_bucket``/``_count``/``_sum``.
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import ray
from prometheus_client.parser import text_string_to_metric_families
from ray.cluster_utils import Cluster

import kvray

ROOT = Path(__file__).resolve().parent.parent
METRICS_PY = ROOT / "kvray" / "metrics.py"
DASHBOARD = ROOT / "scripts" / "grafana_kvray.json"

BLOCK = 64 << 10
N_BLOCKS = 8
SCRAPE_TIMEOUT_S = 30.0


def _endpoints() -> list[str]:
    """The Prometheus endpoint of every alive node of the connected cluster."""
    urls = []
    for node in ray.nodes():
        if node.get("Alive") and node.get("MetricsExportPort"):
            urls.append(f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics")
    return urls


def _scrape(urls: list[str], namespace: str) -> dict[str, float]:
    """Sample name -> value summed over nodes and processes, for one kvray namespace.

    Histogram buckets are keyed ``name{le}`` so that each bucket keeps its own sum.
    """
    totals: dict[str, float] = {}
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
                key = f"{s.name}{{{s.labels['le']}}}" if "le" in s.labels else s.name
                totals[key] = totals.get(key, 0.0) + s.value
    return totals


def _unmet(seen: dict[str, float], want: dict[str, float]) -> dict[str, float | None]:
    """The expectations not met yet: name -> value seen (None if absent)."""
    return {name: seen.get(name) for name, value in want.items() if seen.get(name) != value}


def test_traffic_shows_in_every_kvray_metric_family(ray_cluster: Cluster, kvray_ns: str) -> None:
    """Put, look up and get blocks; every moved figure shows at the nodes' endpoints, exactly."""
    keys = [f"metrics-{kvray_ns}-{i}".encode() for i in range(N_BLOCKS)]
    rng = np.random.default_rng(3)
    blocks = [rng.integers(0, 255, BLOCK, dtype=np.uint8) for _ in range(N_BLOCKS)]
    store = kvray.connect(kvray_ns)
    try:
        result = store.put(keys, blocks).result(timeout=60)
        assert (result.stored, result.refused) == (N_BLOCKS, 0)
        store.sync()
        assert store.lookup(keys) == N_BLOCKS
        got = store.get(keys)
        assert [g.tobytes() for g in got] == [b.tobytes() for b in blocks]

        n_nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
        urls = _endpoints()
        assert len(urls) == n_nodes, f"not every node exports metrics: {ray.nodes()}"
        nbytes = float(N_BLOCKS * BLOCK)
        want: dict[str, float] = {
            # The pool that took the blocks: one segment of N_BLOCKS blocks.
            "ray_kvray_pool_blocks_stored_total": N_BLOCKS,
            "ray_kvray_pool_bytes_stored_total": nbytes,
            "ray_kvray_pool_bytes_used": nbytes,
            "ray_kvray_pool_hits_total": N_BLOCKS,
            "ray_kvray_pool_bytes_loaded_total": nbytes,
            "ray_kvray_pool_store_latency_s_count": 1,
            # Every pool (one per node) reports its capacity: 64 MiB in the kvray_ns fixture.
            "ray_kvray_pool_capacity_bytes": float(n_nodes * (64 << 20)),
            # The index.
            "ray_kvray_index_keys": N_BLOCKS,
            "ray_kvray_index_pools": n_nodes,
            # This driver's client tally (flushed by its feed thread about once a second).
            "ray_kvray_lookups_total": 1,
            "ray_kvray_lookup_hit_blocks_total": N_BLOCKS,
            "ray_kvray_lookup_latency_s_count": 1,
            "ray_kvray_bytes_stored_total": nbytes,
            "ray_kvray_store_latency_s_count": 1,
            "ray_kvray_bytes_loaded_total": nbytes,
            "ray_kvray_load_latency_s_count": 1,
            "ray_kvray_load_latency_s_bucket{+Inf}": 1,
        }
        deadline = time.monotonic() + SCRAPE_TIMEOUT_S
        while True:
            seen = _scrape(urls, kvray_ns)
            unmet = _unmet(seen, want)
            if not unmet:
                break
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"after {SCRAPE_TIMEOUT_S:.0f}s these figures of namespace {kvray_ns} are "
                    f"absent (None) or wrong: {unmet}; expected {want}; all seen: {seen}"
                )
            time.sleep(0.5)
        # A histogram: cumulative buckets, the one get in the last; its time in _sum.
        buckets = [v for k, v in seen.items() if k.startswith("ray_kvray_load_latency_s_bucket")]
        assert len(buckets) == 13 and set(buckets) <= {0.0, 1.0}, buckets
        assert seen["ray_kvray_load_latency_s_sum"] > 0
    finally:
        store.close()


# ---------------------------------------------------------------------- dashboard


def _metric_names() -> list[str]:
    """Every metric name kvray defines, read from kvray/metrics.py's source."""
    names = re.findall(r"""["'](kvray_[a-z0-9_]+)["']""", METRICS_PY.read_text())
    assert len(names) >= 20, f"parsed too few metric names from {METRICS_PY}: {names}"
    return sorted(set(names))


def _panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """All panels, including those nested in rows."""
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


_SUFFIXES = ("_total", "_bucket", "_count", "_sum")


def _base(series: str) -> str:
    for suffix in _SUFFIXES:
        if series.endswith(suffix):
            return series[: -len(suffix)]
    return series


def test_grafana_dashboard_plots_every_kvray_metric() -> None:
    """The dashboard JSON loads, uses the datasource variable and plots each defined metric."""
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["title"]
    templating = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert templating["datasource"]["type"] == "datasource"
    assert templating["datasource"]["query"] == "prometheus"

    exprs: list[str] = []
    ids: list[int] = []
    for panel in _panels(dashboard):
        ids.append(panel["id"])
        if panel.get("type") == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        exprs.extend(t["expr"] for t in panel["targets"])
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for e in exprs:  # a cheap PromQL sanity check: brackets balance
        depth = 0
        for ch in e:
            depth += {"(": 1, "{": 1, "[": 1, ")": -1, "}": -1, "]": -1}.get(ch, 0)
            assert depth >= 0, e
        assert depth == 0, e

    used = {_base(m) for e in exprs for m in re.findall(r"\bray_kvray_[a-z0-9_]+", e)}
    defined = {f"ray_{name}" for name in _metric_names()}
    assert defined - used == set(), f"metrics with no panel: {sorted(defined - used)}"
    assert used - defined == set(), f"panels plot unknown metrics: {sorted(used - defined)}"
    # Counters are exported with _total: a bare counter name would plot nothing.
    counters = set(re.findall(r"Counter\(\s*\"(kvray_[a-z0-9_]+)\"", METRICS_PY.read_text()))
    for e in exprs:
        for m in re.findall(r"\bray_kvray_[a-z0-9_]+", e):
            if m[len("ray_") :] in counters:
                raise AssertionError(f"counter {m} must be queried as {m}_total: {e}")
