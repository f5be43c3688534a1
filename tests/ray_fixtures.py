"""The Ray fixtures: one real multi-node Ray cluster for the whole session, kvray namespaces.

The cluster is a ``ray.cluster_utils.Cluster`` on this machine: a head and two worker "nodes",
each a real raylet with its own object store, tagged with custom resources ``node_a`` /
``node_b`` so tests can pin tasks and actors to them. Loaded by ``conftest.py`` when Ray is
installed (the kernel tests run on machines without it).
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import ray
from ray.cluster_utils import Cluster

import kvray
from kvray.testing.cluster import simulated_cluster

__all__ = ["kvray_ns", "ray_cluster", "started_namespace"]


OBJECT_STORE_BYTES = 256 << 20


def _node_args(resources: dict[str, float], num_cpus: int) -> dict:
    return {
        "num_cpus": num_cpus,
        "object_store_memory": OBJECT_STORE_BYTES,
        "resources": resources,
        "include_dashboard": False,
    }


def free_port() -> int:
    """A free TCP port below the kernel's ephemeral range (so no outgoing socket takes it)."""
    for _ in range(200):
        port = random.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port in 20000-32000")


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[Cluster]:
    """Head + simulated nodes A and B; this process is connected; RAY_ADDRESS is exported.

    The head runs Ray's dashboard (tests/test_monitor.py opens it in a browser); it looks for
    Prometheus at RAY_PROMETHEUS_HOST, a port kept free for tests/test_monitor.py.
    """
    old_prom = os.environ.get("RAY_PROMETHEUS_HOST")
    os.environ["RAY_PROMETHEUS_HOST"] = f"http://127.0.0.1:{free_port()}"
    cluster = simulated_cluster(
        {
            **_node_args({"head": 1}, 2),
            "include_dashboard": True,
            "dashboard_host": "127.0.0.1",
            "dashboard_port": free_port(),
        },
        [_node_args({"node_a": 1}, 2), _node_args({"node_b": 1}, 2)],
        system_config={
            # Detect removed nodes within seconds (defaults take ~30 s).
            "health_check_initial_delay_ms": 0,
            "health_check_period_ms": 500,
            "health_check_failure_threshold": 4,
            # Push metrics to each node's Prometheus endpoint every second (default 10 s).
            "metrics_report_interval_ms": 1000,
        },
        connect=False,
    )
    ray.init(address=cluster.address, namespace="kvray-tests", log_to_driver=False)
    old_addr = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = cluster.address
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        for name, old in (("RAY_ADDRESS", old_addr), ("RAY_PROMETHEUS_HOST", old_prom)):
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


@contextlib.contextmanager
def started_namespace(prefix: str, **fields: Any) -> Iterator[str]:
    """A fresh kvray namespace (``prefix`` and 10 hex digits) started with ``fields`` (by
    default 64 MiB a pool and health checks every 0.5 s), stopped when the block ends."""
    ns = f"{prefix}{uuid.uuid4().hex[:10]}"
    kvray.start(namespace=ns, **{"capacity": "64MiB", "health_check_interval_s": 0.5, **fields})
    try:
        yield ns
    finally:
        kvray.stop(ns)


@pytest.fixture
def kvray_ns(ray_cluster: Cluster) -> Iterator[str]:
    """A fresh kvray namespace, started for one test and stopped after it."""
    with started_namespace("t") as ns:
        yield ns
