"""A put its node cannot hold is refused and counted, not raised (stop 42's CI).

A writer's ``put`` copies each segment into its own node's object store (``ray.put``) before the
pool takes it. With that store full, Ray puts the object on disk instead; with the disk over
Ray's ``local_fs_capacity_threshold`` too, ``ray.put`` raises ``OutOfDiskError`` (or
``ObjectStoreFullError``), and ``Store.put``'s Future raised it to the caller. A cache refuses
what it cannot hold, as a pool does with a block larger than its capacity: the Future resolves
with the blocks refused, the store counts them (``stats()["refused_no_room"]``, the
``kvray_puts_refused_no_room`` counter), and the next put that fits is stored as usual.

The condition is made for real, in a Ray of its own (a subprocess): a small object store and a
``local_fs_capacity_threshold`` of 0, under which Ray treats every disk as full.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a Ray of its own, in a subprocess (~10 s)

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import json

import numpy as np
import ray

import kvray

ray.init(
    address="local",
    num_cpus=1,
    object_store_memory=80 << 20,
    include_dashboard=False,
    log_to_driver=False,
    _system_config={"local_fs_capacity_threshold": 0.0},  # every disk reads as full
)
kvray.start(namespace="noroom", capacity="32MiB")
store = kvray.connect("noroom")
out = {}
# 100 MiB: more than the whole object store, and Ray may not put it on disk.
try:
    r = store.put([b"big"], [np.full(100 << 20, 7, dtype=np.uint8)]).result(timeout=60)
    out["big"] = [r.stored, r.refused]
except Exception as e:
    out["big"] = repr(e)
# 1 MiB, past the inline limit: through the object store, where it fits.
small = np.arange(1 << 20, dtype=np.uint64).astype(np.uint8)
r = store.put([b"small"], [small]).result(timeout=60)
out["small"] = [r.stored, r.refused]
store.sync(timeout=30)
out["same_bytes"] = bool(np.array_equal(store.get([b"small"], timeout=30)[0], small))
stats = store.stats()
out["refused_no_room"] = stats["client"].get("refused_no_room")
out["pool_refused"] = stats["totals"]["refused"]
store.close()
kvray.stop("noroom")
ray.shutdown()
print("RESULT " + json.dumps(out))
"""


def test_a_put_its_node_has_no_room_for_is_refused_and_counted_not_raised() -> None:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT ") :])
    assert out["big"] == [0, 1], out  # refused, not raised
    assert out["small"] == [1, 0] and out["same_bytes"], out  # the next put is stored
    assert out["refused_no_room"] == 1, out
    assert out["pool_refused"] == 0, out  # refused by the writer: the pool never saw it
