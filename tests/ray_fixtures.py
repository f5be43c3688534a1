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
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest
import ray
from ray.cluster_utils import Cluster

import kvray
from kvray.testing.cluster import simulated_cluster

__all__ = ["RELAY", "NamespaceRelay", "kvray_ns", "module_ns", "ray_cluster", "started_namespace"]


OBJECT_STORE_BYTES = 256 << 20


def _node_args(resources: dict[str, float], num_cpus: int) -> dict:
    return {
        "num_cpus": num_cpus,
        "object_store_memory": OBJECT_STORE_BYTES,
        "resources": resources,
        "include_dashboard": False,
        # No log monitor: it tails every worker's log file in the session's directory (one
        # directory for all the simulated nodes: ~1,000 files by the suite's end) to stream
        # them to drivers, and every driver here runs with log_to_driver=False (kvray's CLI,
        # the subprocess sessions, this process): ~60 CPU-s of a whole run for nothing.
        "include_log_monitor": False,
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
            # Ray refuses an object that has to go to disk (a spill, or a put larger than the
            # free store) once the disk is 95% full. CI's disk is shared: 252 GB with as
            # little as ~12 GB free at times, which is "95% full" while 12 GB is plenty for
            # the few 65 MiB objects that spill here (stop 42's CI failed so). Refuse only
            # when under ~0.25 GB is left.
            "local_fs_capacity_threshold": 0.999,
        },
        connect=False,
    )
    ray.init(address=cluster.address, namespace="kvray-tests", log_to_driver=False)
    old_addr = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = cluster.address
    global RELAY
    RELAY = NamespaceRelay()
    try:
        yield cluster
    finally:
        RELAY.close()
        RELAY = None
        ray.shutdown()
        cluster.shutdown()
        for name, old in (("RAY_ADDRESS", old_addr), ("RAY_PROMETHEUS_HOST", old_prom)):
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


#: What every test namespace is started with unless a test says otherwise.
NAMESPACE_FIELDS: dict[str, Any] = {"capacity": "64MiB", "health_check_interval_s": 0.5}


@contextlib.contextmanager
def started_namespace(prefix: str, **fields: Any) -> Iterator[str]:
    """A fresh kvray namespace (``prefix`` and 10 hex digits) started with ``fields`` (by
    default :data:`NAMESPACE_FIELDS`), stopped when the block ends."""
    ns = f"{prefix}{uuid.uuid4().hex[:10]}"
    kvray.start(namespace=ns, **{**NAMESPACE_FIELDS, **fields})
    try:
        yield ns
    finally:
        kvray.stop(ns)


def _alive_nodes() -> frozenset[str]:
    return frozenset(n["NodeID"] for n in ray.nodes() if n.get("Alive"))


class NamespaceRelay:
    """Fresh namespaces for ``kvray_ns``, started ahead of the tests and stopped behind them.

    Starting a namespace is five new actor processes (~2 s here, mostly waiting on process
    starts); stopping one ~1 s. Done in line, that was a quarter of the suite. The relay starts
    the namespaces of the next tests (up to ``AHEAD``, for tests that take ``kvray_ns`` and
    for each module's first ``module_ns``: ``pytest_runtest_protocol`` in conftest.py says how
    many) while the current one runs, and stops a test's namespace after it on a background
    thread. Every test still gets a namespace no other test touched, started with the same
    fields. One started before the cluster's nodes changed (a test removed or added one) is
    stopped and a new one started in line, so its pools match the nodes the test sees; tests
    that take no ``kvray_ns`` first wait for the stops behind them (some look at every actor
    in the cluster), and start only the next test's namespace, none if marked ``quiet``.
    """

    AHEAD = 2

    def __init__(self) -> None:
        self._threads = ThreadPoolExecutor(1 + self.AHEAD, thread_name_prefix="ns-relay")
        self._ahead: deque[Future[tuple[str, frozenset[str]]]] = deque()
        self._behind: list[Future[Any]] = []
        self.wanted_ahead = 0  # set by conftest.py's hook before each test

    @staticmethod
    def _start() -> tuple[str, frozenset[str]]:
        nodes = _alive_nodes()
        ns = f"t{uuid.uuid4().hex[:10]}"
        try:
            kvray.start(namespace=ns, **NAMESPACE_FIELDS)
        except BaseException:  # no half-started namespace stays behind: nobody knows its name
            with contextlib.suppress(Exception):
                kvray.stop(ns)
            raise
        return ns, nodes

    def _stop_when_started(self, fut: Future[tuple[str, frozenset[str]]]) -> None:
        """A start given up on (too slow) is stopped once it ends, not left running."""
        if fut.exception() is None:
            with contextlib.suppress(RuntimeError):  # the relay closed meanwhile
                self._threads.submit(kvray.stop, fut.result()[0])

    def take(self) -> str:
        while self._ahead:
            fut = self._ahead.popleft()
            try:
                ns, nodes = fut.result(timeout=120)
            except TimeoutError:
                fut.add_done_callback(self._stop_when_started)
                continue
            except Exception:  # started in line below; the test sees that error if any
                continue
            if nodes == _alive_nodes():
                return ns
            self.release(ns)
        return self._start()[0]

    def prefetch(self, n: int) -> None:
        """Have ``n`` namespaces (at most ``AHEAD``) started or starting ahead."""
        while len(self._ahead) < min(n, self.AHEAD):
            self._ahead.append(self._threads.submit(self._start))

    def release(self, ns: str) -> None:
        self._behind = [f for f in self._behind if not f.done()]
        self._behind.append(self._threads.submit(kvray.stop, ns))

    def settle(self) -> None:
        """Wait for the namespaces stopping behind (each bounded by ``kvray.stop``'s own)."""
        behind, self._behind = self._behind, []
        for f in behind:
            with contextlib.suppress(Exception):
                f.result(timeout=120)

    def close(self) -> None:
        while self._ahead:
            with contextlib.suppress(Exception):
                self.release(self._ahead.popleft().result(timeout=120)[0])
        self.settle()
        self._threads.shutdown(wait=True)


#: The session's relay (made by ``ray_cluster``; None outside a Ray session).
RELAY: NamespaceRelay | None = None


@pytest.fixture(scope="module")
def module_ns(ray_cluster: Cluster) -> Iterator[str]:
    """One kvray namespace for a whole module, for tests that touch only keys of their own
    (random ones) and count nothing namespace-wide; from the relay (:data:`NAMESPACE_FIELDS`),
    so it starts while the test before runs."""
    assert RELAY is not None
    ns = RELAY.take()
    RELAY.prefetch(RELAY.wanted_ahead)
    try:
        yield ns
    finally:
        RELAY.release(ns)


@pytest.fixture
def kvray_ns(ray_cluster: Cluster) -> Iterator[str]:
    """A fresh kvray namespace for one test (:data:`NAMESPACE_FIELDS`), no other test's:
    started ahead of it and stopped after it by :class:`NamespaceRelay`."""
    assert RELAY is not None
    ns = RELAY.take()
    RELAY.prefetch(RELAY.wanted_ahead)
    try:
        yield ns
    finally:
        RELAY.release(ns)
