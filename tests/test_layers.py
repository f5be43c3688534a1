"""Dependencies point one way: each layer, imported alone in a fresh interpreter, loads none of
what it must not need (no Ray or vLLM in the core and the kernels; no actor code on the client
side, which the server side builds on; no actor, disk tier or pyarrow in the connector's worker
side; the disk tier never imports the pools above it). Fast: every layer's interpreter starts
at once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

HEAVY = ("ray", "vllm", "pyarrow", "kvray.actors", "kvray.disk")
SERVER = (
    "kvray.actors.deploy",
    "kvray.actors.reconciler",
    "kvray.actors.pool",
    "kvray.actors.index",
    "kvray.actors.changelog",
    "kvray.disk",
)

#: module -> what importing it must not load (a name or any of its submodules).
LAYERS: dict[str, tuple[str, ...]] = {
    # The Ray-free core.
    "kvray": (*HEAVY, "torch", "kvray.client"),
    "kvray.config": (*HEAVY, "torch"),
    "kvray.errors": (*HEAVY, "torch"),
    "kvray.keys": (*HEAVY, "torch"),
    "kvray.blocks": (*HEAVY, "torch"),
    "kvray.shutdown": (*HEAVY, "torch"),
    "kvray.callers": (*HEAVY, "torch"),
    "kvray.meta": (*HEAVY, "torch"),
    "kvray.meta.view": (*HEAVY, "torch", "numba"),
    "kvray.meta.messages": (*HEAVY, "torch"),
    # GPU/CPU copy kernels: torch and numpy only.
    "kvray.kernels": (*HEAVY, "cupy", "kvray.client"),
    # The client side: Ray, never the server side (no actor code, no disk tier).
    "kvray.client": (*SERVER, "kvray.actors", "kvray.disk", "pyarrow", "vllm", "torch"),
    "kvray.cluster": (*SERVER, "kvray.actors", "kvray.disk", "kvray.client", "vllm", "torch"),
    "kvray.blockio": (*SERVER, "kvray.actors", "kvray.disk", "kvray.client", "vllm", "torch"),
    "kvray.feed": (*SERVER, "kvray.actors", "kvray.disk", "kvray.client", "vllm", "torch"),
    "kvray.stats": (*SERVER, "kvray.actors", "kvray.disk", "kvray.client", "vllm", "torch"),
    "kvray.meta.segment": (*HEAVY, "torch"),
    # The disk tier is below the pools: it never imports them.
    "kvray.disk": ("kvray.actors", "kvray.client", "vllm", "torch"),
    # The connector (in vLLM's processes): the worker side never imports server code.
    "kvray.connector.worker": (
        *SERVER,
        "kvray.actors",
        "pyarrow",
        "kvray.client",
        "kvray.blockio",
        "kvray.feed",
    ),
    # The connector's package and its seams (Protocols only): no vLLM, Ray or torch (the
    # connector vLLM builds lives in kvray.connector.connector), nothing of the client.
    "kvray.connector": ("vllm", "ray", "torch", "kvray.client", "kvray.connector.connector"),
    "kvray.connector.sides": (
        "vllm",
        "ray",
        "torch",
        *SERVER,
        "kvray.actors",
        "pyarrow",
        "kvray.client",
        "kvray.blockio",
        "kvray.feed",
    ),
}


def _load(module: str) -> subprocess.Popen[str]:
    code = (
        "import importlib, json, sys; "
        f"importlib.import_module({module!r}); "
        "print(json.dumps(sorted(sys.modules)))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.fixture(scope="module")
def loaded() -> dict[str, set[str]]:
    """Modules each layer loads, every interpreter started at once."""
    procs = {m: _load(m) for m in LAYERS}
    out: dict[str, set[str]] = {}
    for m, p in procs.items():
        stdout, stderr = p.communicate(timeout=180)
        assert p.returncode == 0, f"import {m} failed:\n{stderr[-3000:]}"
        out[m] = set(json.loads(stdout.strip().splitlines()[-1]))
    return out


@pytest.mark.parametrize("module", list(LAYERS))
def test_layer_loads_nothing_it_must_not(module: str, loaded: dict[str, set[str]]) -> None:
    mods = loaded[module]
    bad = sorted(
        name for name in mods if any(name == f or name.startswith(f + ".") for f in LAYERS[module])
    )
    assert not bad, f"import {module} loads {bad}"


def test_public_api_resolves_lazily() -> None:
    code = """
import sys
import kvray
assert "ray" not in sys.modules
assert issubclass(kvray.BlockLostError, kvray.KVRayError)
assert {"start", "stop", "connect", "Store", "PutResult"} <= set(dir(kvray))
try:
    kvray.no_such_name
except AttributeError:
    pass
else:
    raise AssertionError("kvray.no_such_name resolved")
from kvray import connect
from kvray.client import Store, connect as connect2
from kvray.actors.deploy import start
assert connect is connect2 and kvray.Store is Store and kvray.start is start
assert kvray.PutResult(1) + kvray.PutResult(0, 1) == kvray.PutResult(1, 1)
print("ok")
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-3000:]
