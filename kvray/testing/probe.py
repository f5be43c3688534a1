"""What a Ray cluster's processes spend while a workload runs: CPU seconds by process role and
the GCS's RPCs by method (``scripts/bench_serve.py`` and the tests).

CPU: ``psutil`` CPU times (user + system) of every process descending from the calling
process (a simulated cluster's GCS, raylets, agents, Ray workers, vLLM's engine processes),
classified by the title Ray and vLLM give them. GCS RPCs: the per-method counters Ray exports
to Prometheus (an operator's view; updated every ``metrics_report_interval_ms``).
"""

from __future__ import annotations

import os
import re
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator

import psutil

#: (role, substrings of the process title or command line), first match wins.
ROLES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("gcs", ("gcs_server",)),
    ("raylet", ("/raylet",)),
    ("dashboard_agent", ("dashboard/agent.py", "DashboardAgent")),
    ("runtime_env_agent", ("runtime_env/agent",)),
    ("log_monitor", ("log_monitor.py",)),
    ("kvray_pool", ("ray::BlockPool",)),
    ("kvray_index", ("ray::IndexShard",)),
    ("kvray_control", ("ray::Reconciler",)),
    ("serve_proxy", ("ProxyActor",)),
    ("serve_controller", ("ServeController",)),
    ("ingress", ("OpenAiIngress", "LLMRouter")),
    ("engine_core", ("EngineCore",)),
    ("vllm_worker", ("VLLM::Worker", "VllmWorker")),
    ("llm_replica", ("LLMServer", "ServeReplica")),
    ("ray_idle_worker", ("ray::IDLE",)),
)


def role_of(title: str) -> str:
    for role, marks in ROLES:
        if any(m in title for m in marks):
            return role
    return "other"


def _title(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline()) or p.name()
    except (psutil.Error, OSError):
        return ""


def cpu_by_process(exclude: set[int] | None = None) -> dict[int, tuple[str, float]]:
    """pid -> (role, CPU seconds so far) for this process's descendants."""
    out: dict[int, tuple[str, float]] = {}
    skip = exclude or set()
    for p in psutil.Process(os.getpid()).children(recursive=True):
        if p.pid in skip:
            continue
        try:
            t = p.cpu_times()
            out[p.pid] = (role_of(_title(p)), t.user + t.system)
        except (psutil.Error, OSError):
            continue
    return out


def cpu_delta(
    before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]
) -> Counter[str]:
    """CPU seconds spent between two snapshots, by role (new processes count from 0)."""
    spent: Counter[str] = Counter()
    for pid, (role, cpu) in after.items():
        spent[role] += cpu - (before[pid][1] if pid in before else 0.0)
    return spent


_GCS_RPC = re.compile(
    r'^ray_grpc_server_req_process_time_ms_count\{[^}]*Component="gcs_server"[^}]*'
    r'Method="([^"]+)"[^}]*\}\s+([0-9.eE+]+)'
)


def metrics_lines(metrics_urls: list[str]) -> Iterator[str]:
    """Every line of every reachable Prometheus endpoint (one that does not answer is
    skipped: a node may be gone)."""
    for url in metrics_urls:
        try:
            text = urllib.request.urlopen(url, timeout=5).read().decode()
        except OSError:
            continue
        yield from text.splitlines()


def gcs_rpc_counts(metrics_urls: list[str]) -> Counter[str]:
    """The GCS's handled RPCs so far by method (``Service.Method``), as Ray exports them to
    Prometheus (``ray_grpc_server_req_process_time_ms_count``, component ``gcs_server``)
    at the head node's metrics endpoint: what an operator's dashboard shows."""
    counts: Counter[str] = Counter()
    for line in metrics_lines(metrics_urls):
        m = _GCS_RPC.match(line)
        if m is not None:
            counts[m.group(1).replace(".grpc_server.", ".")] += int(float(m.group(2)))
    return counts


def metrics_urls() -> list[str]:
    """Every live node's Prometheus endpoint (needs ``ray.init``)."""
    import ray

    from kvray.ops.monitor import node_targets

    return [f"http://{target}/metrics" for target in node_targets(ray.nodes())]


def gcs_rpc_snapshot(urls: list[str], report_interval_s: float = 1.0) -> Counter[str]:
    """Wait one metrics report interval and a bit (so what just happened is exported), read."""
    time.sleep(report_interval_s * 2.5)
    return gcs_rpc_counts(urls)


def _node(node_id: str) -> dict:
    import ray

    for n in ray.nodes():
        if n["NodeID"] == node_id and n["Alive"]:
            return n
    raise LookupError(f"node {node_id} is not alive")


def object_store_used(node_id: str) -> int:
    """Bytes of node ``node_id``'s object store in use (its raylet's own figure, what
    ``ray memory`` shows): primary copies and the copies pulled from other nodes, pinned or
    cached."""
    from ray._private.internal_api import node_stats

    n = _node(node_id)
    reply = node_stats(n["NodeManagerAddress"], n["NodeManagerPort"], include_memory_info=False)
    return int(reply.store_stats.object_store_bytes_used)


_RECEIVED = re.compile(r'^ray_object_manager_bytes\{[^}]*Type="Received"[^}]*\}\s+([0-9.eE+]+)')


def object_bytes_received(node_id: str) -> int:
    """Bytes node ``node_id``'s object manager has received from other nodes so far
    (``ray_object_manager_bytes{Type="Received"}`` at its Prometheus endpoint: an operator's
    view, updated every ``metrics_report_interval_ms``)."""
    n = _node(node_id)
    url = f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return sum(int(float(m.group(1))) for m in map(_RECEIVED.match, text.splitlines()) if m)
