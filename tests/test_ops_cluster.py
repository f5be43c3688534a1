"""Operations: the ``ray up`` cluster file, and the ``kvray`` command on a ``ray start`` cluster.

The cluster test starts a real two-raylet cluster on this machine the way an operator would
(``ray start --head`` then ``ray start --address``, token auth on), drives the installed
``kvray`` console script against it in subprocesses, and tears it down by killing only the
processes it started (never ``ray stop``: other clusters may run on this machine). It stays
out of the session's ``ray_cluster``: its own temp dir, ports, token and environment.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"
CLUSTER_YAML = SCRIPTS / "cluster.yaml"
BIN = Path(sys.executable).parent
CAPACITY = 64 << 20

# ---------------------------------------------------------------------- cluster.yaml


def _commands(value: Any) -> str:
    """A list of shell commands (as ``ray up`` takes them) as one text."""
    assert isinstance(value, list) and value, f"expected a non-empty command list: {value!r}"
    assert all(isinstance(c, str) for c in value), value
    return "\n".join(value)


def test_cluster_yaml_parses_and_starts_ray_then_kvray() -> None:
    """scripts/cluster.yaml is valid YAML with the install and start commands ``ray up`` runs."""
    cfg = yaml.safe_load(CLUSTER_YAML.read_text())
    assert cfg["cluster_name"]
    assert cfg["provider"]["type"]
    assert cfg["available_node_types"][cfg["head_node_type"]]
    assert len(cfg["available_node_types"]) >= 2, "a head and at least one worker type"
    assert "~/.ray/auth_token" in cfg["file_mounts"], "the token reaches every node"

    setup = _commands(cfg["setup_commands"])
    assert re.search(r"pip install .*kvray", setup), setup

    head = _commands(cfg["head_start_ray_commands"])
    assert re.search(r"ray start .*--head", head), head
    assert "--metrics-export-port" in head
    kvray_start = re.search(r"kvray start .*--capacity", head)
    assert kvray_start, head
    assert head.index("ray start") < kvray_start.start(), "kvray starts after Ray"

    worker = _commands(cfg["worker_start_ray_commands"])
    assert re.search(r"ray start .*--address", worker), worker
    assert "kvray start" not in worker  # the index puts a pool on every node that joins
    for cmds in (head, worker):
        assert "RAY_AUTH_MODE=token" in cmds, "the example cluster runs with token auth"


def test_cluster_yaml_passes_ray_up_validation() -> None:
    """What ``ray up`` checks before launching: defaults merged, then Ray's JSON schema.

    Both the AWS example and the ``local`` provider variant sketched in its comments.
    """
    pytest.importorskip("jsonschema")
    from ray.autoscaler._private.util import prepare_config, validate_config

    text = CLUSTER_YAML.read_text()
    cfg = yaml.safe_load(text)
    validate_config(prepare_config(copy.deepcopy(cfg)))

    sketch = text.split("\n# provider:\n", 1)[1]
    local = yaml.safe_load("provider:\n" + "\n".join(ln[2:] for ln in sketch.splitlines()))
    assert local["provider"]["type"] == "local"
    dropped = ("provider", "auth", "available_node_types", "head_node_type", "max_workers")
    on_prem = {k: v for k, v in cfg.items() if k not in (*dropped, "head_setup_commands")}
    validate_config(prepare_config({**on_prem, **local}))


def test_ops_scripts_parse_and_serve_builds_the_vllm_command(tmp_path: Path) -> None:
    """The shell recipes parse; serve-vllm-gpu.sh runs kvray start then the documented vllm
    serve (checked with stand-ins for ``kvray`` and ``vllm`` on PATH: no GPU here)."""
    scripts = ("ray-start-head.sh", "ray-start-worker.sh", "serve-vllm-gpu.sh")
    for name in scripts:
        path = SCRIPTS / name
        assert os.access(path, os.X_OK), f"{name} is not executable"
        res = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert res.returncode == 0, f"{name}: {res.stderr}"

    log = tmp_path / "calls.jsonl"
    for tool in ("kvray", "vllm"):
        stub = tmp_path / tool
        stub.write_text(
            f"#!{sys.executable}\n"
            "import json, os, sys\n"
            f"with open({str(log)!r}, 'a') as f:\n"
            "    f.write(json.dumps({'argv': sys.argv, 'ray_address': os.environ.get("
            "'RAY_ADDRESS'), 'auth': os.environ.get('RAY_AUTH_MODE')}) + '\\n')\n"
        )
        stub.chmod(0o755)
    env = _base_env()
    env.update(
        PATH=f"{tmp_path}{os.pathsep}{env.get('PATH', '')}",
        MODEL="org/some-model",
        TP="4",
        KVRAY_NAMESPACE="prod-a",
        RAY_ADDRESS="10.0.0.10:6379",
    )
    res = subprocess.run(
        [str(SCRIPTS / "serve-vllm-gpu.sh"), "--max-model-len", "8192"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert res.returncode == 0, res.stderr
    kvray_call, vllm_call = (json.loads(line) for line in log.read_text().splitlines())
    started = [
        "start",
        "--address",
        "10.0.0.10:6379",
        "--capacity",
        "8GiB",
        "--namespace",
        "prod-a",
    ]
    assert kvray_call["argv"][1:] == started
    argv = vllm_call["argv"][1:]
    assert argv[:2] == ["serve", "org/some-model"]
    assert argv[argv.index("--distributed-executor-backend") + 1] == "ray"
    assert argv[argv.index("--tensor-parallel-size") + 1] == "4"
    assert argv[-2:] == ["--max-model-len", "8192"]
    kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert kv == {
        "kv_connector": "KVRayConnector",
        "kv_connector_module_path": "kvray.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"namespace": "prod-a"},
    }
    assert vllm_call["ray_address"] == "10.0.0.10:6379" and vllm_call["auth"] == "token"
    # Without MODEL: one clear line, nothing started.
    res = subprocess.run(
        [str(SCRIPTS / "serve-vllm-gpu.sh")],
        env={k: v for k, v in env.items() if k != "MODEL"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert res.returncode != 0 and "MODEL" in res.stderr


# ---------------------------------------------------------------------- a ray start cluster


def _free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on this machine now (held open together while picking)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _base_env() -> dict[str, str]:
    """This process' environment minus anything that points Ray at another cluster or token."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
    }
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    env.pop("KVRAY_LOG_LEVEL", None)
    return env


@dataclass
class RayStartCluster:
    """A head and one worker raylet started with ``ray start``, with token auth."""

    temp_dir: str
    address: str
    token: str
    metrics_ports: list[int]

    def env(self, **changes: str | None) -> dict[str, str]:
        """The environment of a process using this cluster; a ``None`` value removes a var."""
        env = _base_env()
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=self.token)
        # Keep a user's ~/.ray/auth_token out of the way (a missing token must stay missing).
        env["HOME"] = self.temp_dir
        for k, v in changes.items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
        return env


def _run(
    args: list[str], env: dict[str, str], timeout: float = 60.0
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args, env=env, capture_output=True, text=True, timeout=timeout, cwd=tempfile.gettempdir()
    )


def _own_processes(temp_dir: str) -> list[psutil.Process]:
    """Processes of this cluster: those naming its temp dir, and all their descendants.

    ``ray start`` daemonizes: GCS, raylets, dashboard, monitors and log monitors name the
    session directory under ``temp_dir`` on their command line; agents and workers are
    children of the raylets (their titles are rewritten to ``ray::...``).
    """
    me = os.getpid()
    mine = re.compile(re.escape(temp_dir) + r"(?![\w.-])")  # not /tmp/kvr-abc1 for /tmp/kvr-abc
    found: dict[int, psutil.Process] = {}
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            cmdline = " ".join(p.info["cmdline"] or [])
        except psutil.Error:
            continue
        if p.pid == me or not mine.search(cmdline):
            continue
        found[p.pid] = p
        try:
            for child in p.children(recursive=True):
                found[child.pid] = child
        except psutil.Error:
            pass
    return list(found.values())


def _kill(procs: list[psutil.Process], grace_s: float = 3.0) -> None:
    """SIGTERM, then SIGKILL whatever is left after ``grace_s``."""
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=grace_s)


@pytest.fixture
def ray_start_cluster() -> Iterator[RayStartCluster]:
    """Head + one worker on this machine, started with scripts/ray-start-{head,worker}.sh.

    The recipes run as shipped (``ray start --head`` + ``kvray start`` in namespace
    ``default``, then ``ray start --address``); extra ``ray start`` options keep this cluster
    off every default port and directory. Torn down by pid, never ``ray stop``.
    """
    for tool in ("ray", "kvray"):
        if not (BIN / tool).exists():
            pytest.skip(f"no {tool} console script next to {sys.executable} (pip install -e .)")
    # Unix socket paths (<temp-dir>/session_<date>_<pid>/sockets/plasma_store) must stay
    # under ~107 bytes: pytest's tmp_path is too long for that, so /tmp/kvr-XXXXXX it is.
    temp_dir = tempfile.mkdtemp(prefix="kvr-", dir="/tmp")
    (gcs, client, dash, *per_node) = _free_ports(3 + 2 * 6)
    head_ports, worker_ports = per_node[:6], per_node[6:]
    cluster = RayStartCluster(
        temp_dir=temp_dir,
        address=f"127.0.0.1:{gcs}",
        token=secrets.token_hex(32),
        metrics_ports=[head_ports[0], worker_ports[0]],
    )

    def node_args(ports: list[int]) -> list[str]:
        node_manager, object_manager, agent_http, agent_grpc, runtime_env = ports[1:]
        return [
            "--node-ip-address=127.0.0.1",
            f"--temp-dir={temp_dir}",
            "--num-cpus=1",
            f"--node-manager-port={node_manager}",
            f"--object-manager-port={object_manager}",
            f"--dashboard-agent-listen-port={agent_http}",
            f"--dashboard-agent-grpc-port={agent_grpc}",
            f"--runtime-env-agent-port={runtime_env}",
        ]

    env = cluster.env(
        RAY=str(BIN / "ray"),
        KVRAY=str(BIN / "kvray"),
        RAY_OBJECT_STORE_BYTES=str(128 << 20),
        KVRAY_CAPACITY="64MiB",
    )
    try:
        head = _run(
            [
                str(SCRIPTS / "ray-start-head.sh"),
                "--include-dashboard=false",
                f"--ray-client-server-port={client}",
                *node_args(head_ports),
            ],
            dict(
                env,
                RAY_PORT=str(gcs),
                RAY_DASHBOARD_PORT=str(dash),
                RAY_METRICS_EXPORT_PORT=str(head_ports[0]),
            ),
            timeout=120,
        )
        assert head.returncode == 0, f"ray-start-head.sh failed:\n{head.stdout}\n{head.stderr}"
        assert "kvray started in namespace default: 1 pool(s)" in head.stdout, head.stdout
        worker = _run(
            [
                str(SCRIPTS / "ray-start-worker.sh"),
                "--include-log-monitor=false",  # one log monitor per host (the head's)
                *node_args(worker_ports),
            ],
            dict(env, RAY_HEAD=cluster.address, RAY_METRICS_EXPORT_PORT=str(worker_ports[0])),
            timeout=120,
        )
        assert worker.returncode == 0, f"ray-start-worker.sh failed:\n{worker.stderr}"
        yield cluster
    finally:
        _kill(_own_processes(temp_dir))
        shutil.rmtree(temp_dir, ignore_errors=True)


_RAY_LOG_LINE = re.compile(r"^\[?\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d")


def _message(stderr: str) -> str:
    """kvray's own error text: stderr without Ray's log lines, rewrapped to one line."""
    lines = [ln for ln in stderr.splitlines() if ln.strip() and not _RAY_LOG_LINE.match(ln)]
    return " ".join(ln.strip() for ln in lines)


def _assert_one_clear_error(res: subprocess.CompletedProcess[str], *needles: str) -> str:
    """Exit code 1, no traceback, a single ``error:`` message mentioning every needle."""
    out = f"rc={res.returncode}\nstdout:\n{res.stdout}\nstderr:\n{res.stderr}"
    assert res.returncode == 1, out
    assert "Traceback" not in res.stderr + res.stdout, out
    msg = _message(res.stderr)
    assert msg.startswith("error:") and msg.count("error:") == 1, out
    # One message (a terminal may wrap it), not a dump of logs or a chained traceback.
    assert len(msg) < 1000, out
    low = msg.lower()
    for needle in needles:
        assert needle.lower() in low, f"{needle!r} not in the message: {msg}\n{out}"
    return msg


@pytest.mark.slow
def test_kvray_cli_on_a_ray_start_cluster_with_token_auth(
    ray_start_cluster: RayStartCluster,
) -> None:
    """kvray start/status/stop on a 2-raylet token-auth cluster; wrong token, no cluster."""
    c = ray_start_cluster
    kvray = str(BIN / "kvray")
    if not Path(kvray).exists():
        pytest.skip("the kvray console script is not installed (pip install -e .)")
    ns = "ops01"
    env = c.env()

    started = _run(
        [kvray, "start", "--address", c.address, "--capacity", "64MiB", "--namespace", ns], env
    )
    assert started.returncode == 0, started.stderr
    assert "2 pool(s)" in started.stdout, started.stdout

    status = _run([kvray, "status", "--address", c.address, "--namespace", ns, "--json"], env)
    assert status.returncode == 0, (
        f"kvray status --json exited {status.returncode} after printing:\n"
        f"{status.stdout[-400:]}\nstderr:\n{status.stderr}"
    )
    stats = json.loads(status.stdout)
    assert stats["namespace"] == ns
    assert stats["index"]["pools"] == 2, stats["index"]
    assert len(stats["nodes"]) == 2, stats["nodes"]
    for node_id, s in stats["nodes"].items():
        assert "error" not in s, (node_id, s)
        assert s["capacity"] == CAPACITY and s["blocks"] == 0, s
    assert stats["totals"]["capacity"] == 2 * CAPACITY
    # Each raylet serves Prometheus at its --metrics-export-port (what scrape configs list).
    for port in c.metrics_ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            assert resp.status == 200 and b"ray_" in resp.read()

    # A wrong token: Ray's GCS refuses it. Ray retries the connection about once a second,
    # NUM_REDIS_GET_RETRIES times (20 by default): 2 keeps this test fast.
    wrong = _run(
        [kvray, "status", "--address", c.address, "--namespace", ns],
        c.env(RAY_AUTH_TOKEN=secrets.token_hex(32), RAY_NUM_REDIS_GET_RETRIES="2"),
    )
    _assert_one_clear_error(wrong, "token")

    # Token auth on, no token anywhere (RAY_AUTH_TOKEN unset, HOME without .ray/auth_token).
    missing = _run(
        [kvray, "status", "--address", c.address, "--namespace", ns],
        c.env(RAY_AUTH_TOKEN=None, RAY_NUM_REDIS_GET_RETRIES="2"),
    )
    _assert_one_clear_error(missing, "token")

    # Nothing listens at the address: fails fast, naming it.
    (closed,) = _free_ports(1)
    t0 = time.monotonic()
    nothing = _run([kvray, "status", "--address", f"127.0.0.1:{closed}"], env)
    _assert_one_clear_error(nothing, str(closed))
    assert time.monotonic() - t0 < 20

    # The head script started namespace "default" before the worker joined: the index has
    # since put a pool on the worker too (what cluster.yaml and the recipes rely on).
    deadline = time.monotonic() + 30
    while True:
        res = _run([kvray, "status", "--address", c.address, "--json"], env)
        pools = json.loads(res.stdout)["index"]["pools"] if res.stdout.strip() else None
        if pools == 2:
            break
        assert time.monotonic() < deadline, f"pools in 'default': {pools}\n{res.stderr}"
        time.sleep(1)

    stopped = _run([kvray, "stop", "--address", c.address, "--namespace", ns], env)
    assert stopped.returncode == 0, stopped.stderr
    # The reconciler, one index shard and 2 pools.
    assert "4 actor(s) removed" in stopped.stdout, stopped.stdout
    gone = _run([kvray, "status", "--address", c.address, "--namespace", ns], env)
    _assert_one_clear_error(gone, "not started")
