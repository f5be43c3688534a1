"""``kvray monitor``: Prometheus over the metrics endpoints of the Ray cluster kvray runs on.

Ray's dashboard writes a Prometheus config for its session,
``<session dir>/metrics/prometheus/prometheus.yml``, whose scrape targets come from
``<session dir>/prom_metrics_service_discovery.json``, a file the dashboard rewrites as nodes join
and leave. ``kvray monitor`` runs a ``prometheus`` binary (Debian's ``prometheus`` package, or
any other) on that config, so kvray's ``ray_kvray_*`` series (and Ray's own) land in Prometheus,
where its graph page, the Ray dashboard (via ``RAY_PROMETHEUS_HOST``) and Grafana can read them.

Where the config is not there (a head started without the dashboard, or a driver on another
machine than the head), ``monitor`` writes one itself, its targets taken from ``ray.nodes()``
and refreshed while it runs. ``scrape_interval_s`` overrides Ray's 10 s in a copy of the config.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kvray.config import ConfigError, check_number
from kvray.errors import KVRayError

RAY_CONFIG = Path("metrics", "prometheus", "prometheus.yml")
RAY_TARGETS = "prom_metrics_service_discovery.json"
RAY_SCRAPE_INTERVAL_S = 10.0
DEFAULT_PORT = 9090  # where Ray's dashboard looks for Prometheus unless RAY_PROMETHEUS_HOST says
GRAPH_SERIES = "ray_kvray_pool_bytes_used"


class MonitorError(KVRayError):
    """Prometheus cannot be started or stopped running."""


@dataclass(frozen=True)
class PrometheusSetup:
    """The config Prometheus runs on and where it came from."""

    config: Path
    source: str  # "ray": Ray's file as is; "ray-copy": Ray's with another interval; "kvray"
    targets: Path  # the file-discovery file the config reads
    scrape_interval_s: float
    owns_targets: bool  # True: kvray writes ``targets`` itself (from ray.nodes())


def _duration(seconds: float) -> str:
    """A Prometheus duration (``1500ms``)."""
    return f"{max(1, round(seconds * 1000))}ms"


def _check_interval(scrape_interval_s: float | None) -> None:
    if scrape_interval_s is not None:
        check_number(scrape_interval_s, "scrape_interval_s", low=0.1, high=3600, unit="seconds")


def _set_interval(cfg: dict[str, Any], seconds: float) -> None:
    glob = cfg.setdefault("global", {}) or {}
    cfg["global"] = glob
    glob["scrape_interval"] = glob["evaluation_interval"] = _duration(seconds)
    # Prometheus refuses a scrape timeout above the interval (its default timeout is 10 s).
    glob["scrape_timeout"] = _duration(min(seconds, 10.0))


def _ray_targets_file(cfg: Mapping[str, Any]) -> Path | None:
    """The first file-discovery file of Ray's ``ray`` job."""
    for job in cfg.get("scrape_configs") or []:
        for sd in job.get("file_sd_configs") or []:
            for f in sd.get("files") or []:
                return Path(f)
    return None


def plan_config(
    session_dir: Path | None, work_dir: Path, scrape_interval_s: float | None = None
) -> PrometheusSetup:
    """Choose the config: Ray's for this session when it is there, else kvray's own.

    ``work_dir`` receives any file written (a copy of Ray's config with another interval, or
    kvray's config and its targets file).
    """
    _check_interval(scrape_interval_s)
    ray_config = session_dir / RAY_CONFIG if session_dir is not None else None
    if ray_config is not None and ray_config.is_file():
        cfg = yaml.safe_load(ray_config.read_text()) or {}
        targets = _ray_targets_file(cfg)
        if targets is not None:
            if scrape_interval_s is None:
                return PrometheusSetup(ray_config, "ray", targets, RAY_SCRAPE_INTERVAL_S, False)
            _set_interval(cfg, scrape_interval_s)
            copy = work_dir / "prometheus.yml"
            copy.write_text(yaml.safe_dump(cfg, sort_keys=False))
            return PrometheusSetup(copy, "ray-copy", targets, scrape_interval_s, False)
    interval = scrape_interval_s or RAY_SCRAPE_INTERVAL_S
    targets = work_dir / "targets.json"
    cfg = {
        "scrape_configs": [
            {
                "job_name": "ray",
                "file_sd_configs": [{"files": [str(targets)], "refresh_interval": "10s"}],
            }
        ]
    }
    _set_interval(cfg, interval)
    own = work_dir / "prometheus.yml"
    own.write_text(yaml.safe_dump(cfg, sort_keys=False))
    write_targets(targets, [])
    return PrometheusSetup(own, "kvray", targets, interval, True)


def node_targets(nodes: Iterable[Mapping[str, Any]]) -> list[str]:
    """``host:port`` of the metrics endpoint of every alive node in ``ray.nodes()``."""
    out = []
    for n in nodes:
        port = n.get("MetricsExportPort")
        if n.get("Alive") and port:
            out.append(f"{n['NodeManagerAddress']}:{port}")
    return sorted(out)


def write_targets(path: Path, targets: list[str]) -> None:
    """Prometheus file discovery, written atomically (Prometheus may read it at any time)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps([{"labels": {"job": "ray"}, "targets": targets}]))
    os.replace(tmp, path)


def session_dir() -> Path | None:
    """The session dir of the Ray cluster this process is connected to (None on Ray Client).

    Never ``<temp dir>/session_latest``: that points at the latest cluster started on this
    machine, which need not be the one connected to.
    """
    import ray

    node = getattr(ray._private.worker, "_global_node", None)
    path = node.get_session_dir_path() if node is not None else None
    return Path(path) if path else None


def find_prometheus(explicit: str | None = None) -> str:
    """The ``prometheus`` binary: ``explicit``, else the one on PATH."""
    found = shutil.which(explicit or "prometheus")
    if found is None:
        where = f"at {explicit!r}" if explicit else "on PATH"
        raise MonitorError(
            f"no prometheus binary {where}: install it (Debian/Ubuntu: apt-get install "
            "prometheus) or pass --prometheus PATH"
        )
    return found


def port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def http_get(url: str, timeout_s: float = 5.0) -> tuple[int, bytes]:
    """Status and body of a GET; status 0 when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (urllib.error.URLError, OSError):
        return 0, b""


class Prometheus:
    """One ``prometheus`` child process: started on a setup, ready-checked, stopped."""

    def __init__(
        self, binary: str, setup: PrometheusSetup, host: str, port: int, data_dir: Path
    ) -> None:
        if not 1 <= port <= 65535:
            raise ConfigError("port", port, "expected 1 to 65535")
        self.binary = binary
        self.setup = setup
        self.host = host
        self.port = port
        self.data_dir = data_dir
        self.log_path = data_dir / "prometheus.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self, ready_timeout_s: float = 30.0) -> None:
        """Start and wait until Prometheus answers ``/-/ready``; MonitorError if it does not."""
        ready_timeout_s = check_number(
            ready_timeout_s, "ready_timeout_s", high=3600, low_open=True, unit="seconds"
        )
        if not port_free(self.host, self.port):
            raise MonitorError(
                f"port {self.port} on {self.host} is in use (another Prometheus?): pass --port"
            )
        cmd = [
            self.binary,
            f"--config.file={self.setup.config}",
            f"--storage.tsdb.path={self.data_dir / 'tsdb'}",
            f"--web.listen-address={self.host}:{self.port}",
        ]
        with open(self.log_path, "ab") as log:
            # Its own session: a Ctrl-C in the terminal reaches kvray monitor, which stops it.
            self._proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + ready_timeout_s
        while http_get(f"{self.url}/-/ready", timeout_s=2)[0] != 200:
            if self._proc.poll() is not None:
                raise MonitorError(
                    f"prometheus exited with {self._proc.returncode} at start:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise MonitorError(
                    f"prometheus not ready after {ready_timeout_s:.0f}s:\n{self.log_tail()}"
                )
            time.sleep(0.2)

    def exit_code(self) -> int | None:
        """None while it runs."""
        return self._proc.poll() if self._proc is not None else None

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s``."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout_s)

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def dashboard_sees_prometheus(dashboard_url: str) -> bool | None:
    """Whether Ray's dashboard reaches a Prometheus at its RAY_PROMETHEUS_HOST (None: no
    dashboard answers)."""
    base = dashboard_url if "://" in dashboard_url else f"http://{dashboard_url}"
    status, body = http_get(f"{base}/api/prometheus_health")
    if status == 0:
        return None
    try:
        return status == 200 and bool(json.loads(body).get("result"))
    except (ValueError, AttributeError):
        return False


def _dashboard_url() -> str | None:
    import ray

    try:
        return ray._private.worker.get_dashboard_url() or None
    except ray.exceptions.RaySystemError:  # this process is not connected to Ray
        return None


def run(
    say: Callable[[str], None],
    *,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    scrape_interval_s: float | None = None,
    data_dir: str | None = None,
    prometheus: str | None = None,
    refresh_s: float = 10.0,
    stop: threading.Event | None = None,
) -> int:
    """Run Prometheus for the connected cluster until Ctrl-C (KeyboardInterrupt), ``stop`` is
    set (the CLI's signal handlers set it: an exception raised into a Ray call in flight can be
    lost there) or Prometheus exits; returns the exit status for the command (0 when stopped)."""
    import ray

    refresh_s = check_number(refresh_s, "refresh_s", high=3600, low_open=True, unit="seconds")
    _check_interval(scrape_interval_s)
    binary = find_prometheus(prometheus)
    keep = data_dir is not None
    work = Path(data_dir) if keep else Path(tempfile.mkdtemp(prefix="kvray-prometheus-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        setup = plan_config(session_dir(), work, scrape_interval_s)
        if setup.owns_targets:
            write_targets(setup.targets, node_targets(ray.nodes()))
        prom = Prometheus(binary, setup, host, port, work)
        prom.start()
        try:
            _report(say, prom, keep)
            next_refresh = time.monotonic() + refresh_s
            stopping = stop or threading.Event()  # none given: Ctrl-C's KeyboardInterrupt
            while prom.exit_code() is None:
                if stopping.wait(0.5):
                    say("stopping Prometheus")
                    return 0
                if setup.owns_targets and time.monotonic() >= next_refresh:
                    write_targets(setup.targets, node_targets(ray.nodes()))
                    next_refresh = time.monotonic() + refresh_s
            say(f"prometheus exited with {prom.exit_code()}:\n{prom.log_tail()}")
            return 1
        except KeyboardInterrupt:
            say("stopping Prometheus")
            return 0
        finally:
            prom.stop()
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


def _report(say: Callable[[str], None], prom: Prometheus, keep: bool) -> None:
    s = prom.setup
    origin = {
        "ray": "Ray's config for this session",
        "ray-copy": "a copy of Ray's config for this session",
        "kvray": "kvray's own: this session has no Ray config (no dashboard, or not the head)",
    }[s.source]
    say(f"Prometheus (pid {prom.pid}) listens on {prom.url}")
    say(f"  config: {s.config} ({origin}), scraping every {s.scrape_interval_s:g}s")
    say(f"  targets: {s.targets}" + (" (from ray.nodes(), refreshed)" if s.owns_targets else ""))
    say(f"  data: {prom.data_dir}" + ("" if keep else " (removed on exit; --data-dir keeps it)"))
    say(f"  graph: {prom.url}/classic/graph?g0.expr={GRAPH_SERIES}&g0.tab=0&g0.range_input=15m")
    dash = _dashboard_url()
    seen = dashboard_sees_prometheus(dash) if dash else None
    hint = (
        f"start the Ray head with RAY_PROMETHEUS_HOST={prom.url} in its environment "
        f"(default http://localhost:{DEFAULT_PORT})"
    )
    if seen is None:
        say(f"Ray dashboard: none answers; for one to find this Prometheus, {hint}")
    elif seen:
        say(f"Ray dashboard (http://{dash}) reaches a Prometheus at its RAY_PROMETHEUS_HOST")
    else:
        say(f"Ray dashboard (http://{dash}) reaches no Prometheus: {hint}")
    say("Grafana (optional): import scripts/grafana_kvray.json over this Prometheus")
    say("Ctrl-C stops Prometheus.")
