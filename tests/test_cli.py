"""The ``kvray`` command against the session's real cluster (in-process, via typer's runner)."""

from __future__ import annotations

import json
import uuid

import pytest
import ray
from ray.cluster_utils import Cluster
from typer.testing import CliRunner

import kvray
from kvray.ops.cli import app

runner = CliRunner()


def test_start_status_stop_round_trip(ray_cluster: Cluster) -> None:
    ns = f"cli{uuid.uuid4().hex[:6]}"
    started = runner.invoke(app, ["start", "--namespace", ns, "--capacity", "32MiB"])
    assert started.exit_code == 0, started.output
    assert f"namespace {ns}" in started.output
    status = runner.invoke(app, ["status", "--namespace", ns, "--json"])
    assert status.exit_code == 0, status.output
    stats = json.loads(status.stdout)
    alive = sum(1 for n in ray.nodes() if n["Alive"])
    assert stats["index"]["pools"] == alive
    assert len(stats["nodes"]) == alive
    assert all(s["capacity"] == 32 << 20 for s in stats["nodes"].values())
    table = runner.invoke(app, ["status", "--namespace", ns])
    assert table.exit_code == 0
    for node_id in stats["nodes"]:  # one row per node
        assert node_id[:12] in table.output
    assert f"{alive} live pool(s)" in table.output
    stopped = runner.invoke(app, ["stop", "--namespace", ns])
    assert stopped.exit_code == 0 and "removed" in stopped.output


def test_user_errors_are_one_clear_line(ray_cluster: Cluster) -> None:
    bad = runner.invoke(app, ["start", "--capacity", "lots"])
    assert bad.exit_code == 1
    assert "invalid capacity='lots'" in bad.output
    assert "Traceback" not in bad.output
    missing = runner.invoke(app, ["status", "--namespace", "never-started"])
    assert missing.exit_code == 1
    assert "not started in namespace 'never-started'" in missing.output
    assert "Traceback" not in missing.output
    assert len(missing.output.strip().splitlines()) <= 2


def test_non_finite_and_absurd_sizes_are_one_clear_line(ray_cluster: Cluster) -> None:
    ns = f"cli{uuid.uuid4().hex[:6]}"
    for capacity, reason in [
        ("inf", "expected a finite size"),
        ("1e400", "expected a finite size"),
        ("nan", "expected a finite size"),
        ("-1GiB", "expected a size such as"),
        ("-0.5", "must not be negative"),
        ("2048TiB", "must be at most 1 PiB"),
    ]:
        res = runner.invoke(app, ["start", "--namespace", ns, "--capacity", capacity])
        assert isinstance(res.exception, SystemExit), (capacity, res.exception)  # not a crash
        assert res.exit_code == 1, (capacity, res.output)
        assert "Traceback" not in res.output
        lines = res.output.strip().splitlines()
        assert len(lines) == 1, lines
        assert f"invalid capacity={capacity!r}: {reason}" in lines[0]
    with pytest.raises(kvray.NotStartedError):  # nothing was deployed
        kvray.connect(ns)
