"""A process that used kvray exits 0 every time: its stores are closed at exit, before Ray's
core worker goes (kvray.shutdown), so no kvray thread touches Ray while Ray shuts down.

Before: such a script exited 1 in 9 of 20 runs here ("The core worker has already been
shutdown ... The process will exit", or a feed thread starting a new Ray through Ray's
auto-init). The test runs the script N times against the session's cluster.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import ray

import kvray
from kvray import shutdown

ROOT = Path(__file__).resolve().parents[1]
RUNS = 3  # the 10 repeated sessions that shut Ray down themselves: test_exit_after_shutdown.py

SCRIPT = """
import sys

import numpy as np
import ray

import kvray

ray.init(address=sys.argv[1], log_to_driver=False)
kvray.start(namespace=sys.argv[2])
store = kvray.connect(sys.argv[2])
keys = [f"exit-{sys.argv[3]}-{i}".encode() for i in range(8)]
print("put", store.put(keys, [np.full(4096, i, dtype=np.uint8) for i in range(8)]).result(30))
store.sync()
print("lookup", store.lookup(keys))
got = store.get(keys)
print("get", all(int(a[0]) == i for i, a in enumerate(got)))
"""


@pytest.mark.slow
def test_a_script_that_used_kvray_exits_0_every_time(
    ray_cluster: object, kvray_ns: str, tmp_path: Path
) -> None:
    script = tmp_path / "use_kvray.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ["PYTHONPATH"]])}
    failed = []
    t0 = time.monotonic()
    for run in range(RUNS):
        res = subprocess.run(
            [sys.executable, str(script), os.environ["RAY_ADDRESS"], kvray_ns, str(run)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert "get True" in res.stdout, res.stdout + res.stderr[-3000:]
        if res.returncode != 0:
            failed.append((run, res.returncode, res.stderr[-1500:]))
    assert not failed, f"{len(failed)} of {RUNS} runs exited non-zero: {failed}"
    assert time.monotonic() - t0 < 120


def test_open_stores_are_closed_at_exit_closed_ones_forgotten(
    kvray_ns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shutdown, "_open", {})  # only this test's stores
    a, b = kvray.connect(kvray_ns), kvray.connect(kvray_ns)
    a.put([b"exit-hook"], [np.ones(16, dtype=np.uint8)]).result(30)
    a.close()
    assert id(a) not in shutdown._open and id(b) in shutdown._open
    shutdown.close_all()  # what the atexit hook does, before Ray's own hooks
    assert b.closed and id(b) not in shutdown._open
    assert b.feed is not None and not b.feed._thread.is_alive()  # type: ignore[union-attr]
    assert ray.is_initialized()
    with pytest.raises(kvray.StoreUnavailableError):
        b.put([b"late"], [np.ones(16, dtype=np.uint8)]).result(30)
