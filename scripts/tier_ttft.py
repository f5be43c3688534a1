"""The vLLM part of ``bench_tier.py`` (issue 12): TTFT of a hit from RAM, from disk, and recompute.

On vLLM-CPU with ``bench_e2e.py``'s model and engine processes (one engine per process, in-process
vLLM, ``generate(max_tokens=1)`` on token-id prompts), at 2048 tokens:

- **recompute**: a plain engine, ``reset_prefix_cache()`` before every repeat;
- a kvray deployment with a disk tier: a writer engine stores the warm-up prompt and the
  measured one, then filler blocks put from this process, a few MiB at a time with the spill
  queue drained in between, push them out of RAM onto disk (``disk_admit_min_hits=0``: every
  evicted block spills; a writer faster than the disk would see RAM evict without spilling,
  as designed, which is not what this part measures). Then, in each round, the pool
  actor is killed and restarts warm (RAM empty, the files registered again), our files' pages
  are dropped from the page cache (``posix_fadvise(DONTNEED)``, no root needed), and a fresh
  reader engine loads: the warm-up prompt first (a disk hit that warms the read path, not
  counted), then the measured prompt: **disk hit** (promoted to RAM by the load), then again
  after ``reset_prefix_cache()``: **RAM hits**.

Every median pools all rounds; the ratio is of medians measured in this run.
"""

from __future__ import annotations

import glob
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import bench_e2e  # the engine processes and the model (a sibling: this script's folder)
import ray

from kvray.testing.cluster import join_or_start
from kvray.testing.pools import drop_pages, settle

ROOT = Path(__file__).resolve().parents[1]

TOKENS = 2048
WARM_TOKENS = 512


def _push_to_disk(ns: str, pool: Any, ram: int) -> None:
    """Put filler blocks until every block the engine stored is on disk only."""
    import numpy as np

    import kvray

    engine_blocks = settle(pool)["stored"]
    store = kvray.connect(ns, subscribe=False)
    rng = np.random.default_rng(0)
    step = 8 << 20
    try:
        for i in range(4 * ram // step):
            s = settle(pool)
            if s["disk_only_blocks"] >= engine_blocks:
                break
            keys = [f"{ns}-filler-{i}-{j}".encode() for j in range(8)]
            store.put(keys, rng.integers(0, 256, (8, step // 8), dtype=np.uint8)).result(60)
    finally:
        store.close()
    s = settle(pool)
    if s["disk_skipped"] or s["disk_only_blocks"] < engine_blocks:
        raise RuntimeError(f"bench_tier: the engine's blocks did not all reach the disk: {s}")


def _restart_warm(ns: str, pool: Any) -> dict[str, Any]:
    """Kill the pool actor (Ray restarts it: RAM empty, the files scanned and registered) and
    wait until the index has its inventory again."""
    from kvray.meta.messages import RAY_NAMESPACE, index_name

    index = ray.get_actor(index_name(ns), namespace=RAY_NAMESPACE)
    resyncs = ray.get(index.stats.remote(), timeout=30)["resyncs"]
    ray.kill(pool, no_restart=False)
    deadline = time.monotonic() + 120
    while True:
        try:
            if ray.get(index.stats.remote(), timeout=30)["resyncs"] > resyncs:
                s = ray.get(pool.stats.remote(), timeout=30)
                if s["blocks"] == 0:
                    return s
        except ray.exceptions.RayError:
            pass  # the pool is restarting
        if time.monotonic() > deadline:
            raise RuntimeError("bench_tier: the pool did not come back")
        time.sleep(0.2)


def ttft_figures(work: Path, rounds: int, repeats: int) -> dict[str, Any]:
    """TTFT medians (seconds) of recompute, disk hit and RAM hit at 2048 tokens, and facts."""
    import random

    import kvray
    from kvray.cluster import local_node_id
    from kvray.meta.messages import RAY_NAMESPACE, pool_name
    from kvray.testing.engines import build_tiny_llama

    shape = bench_e2e.MODEL_SHAPE
    model = build_tiny_llama(os.path.join(tempfile.gettempdir(), "kvray-bench", "model"), **shape)
    rng = random.Random(99)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, shape["vocab"]) for _ in range(n)]

    warm, measured = prompt(WARM_TOKENS), prompt(TOKENS)
    kv_per_token = shape["layers"] * shape["kv_heads"] * shape["head_dim"] * 2 * 2  # K+V, bf16
    # Room for both prompts when promoted, and a spill queue (a quarter of it) above a segment.
    ram = 2 * (WARM_TOKENS + TOKENS) * kv_per_token
    files = {
        "write": {"warm": warm, str(TOKENS): measured},
        "read": {"warm": warm, str(TOKENS): measured},
        "plain": {str(TOKENS): measured},
    }
    for name, prompts in files.items():
        (work / f"{name}.json").write_text(json.dumps(prompts))

    address = ray.get_runtime_context().gcs_address
    env = {
        **os.environ,
        "RAY_ADDRESS": address,
        "PYTHONPATH": str(ROOT),
    }

    def engine(name: str, phase: str, out: str, *more: str, n: int = repeats) -> dict[str, Any]:
        args = ["--model", model, "--prompts", str(work / f"{name}.json"), "--repeats", str(n)]
        return bench_e2e._run_engine([*args, "--phase", phase, *more], work / out, env)

    plain = engine("plain", "plain", "plain.json", n=max(repeats, 3))
    recompute = plain["recompute"][str(TOKENS)]

    ns = f"tier{os.getpid()}"
    disk_dir = work / "disk"
    kvray.start(
        namespace=ns,
        capacity=ram,
        disk_dir=str(disk_dir),
        disk_capacity="2GiB",
        health_check_interval_s=0.5,
    )
    kv = ["--connector", "kvray", "--namespace", ns, "--load-mode", "sync"]
    disk_hits: list[float] = []
    ram_hits: list[float] = []
    cached: list[int] = []
    promoted = 0
    try:
        pool = ray.get_actor(pool_name(ns, local_node_id()), namespace=RAY_NAMESPACE)
        engine("write", "write", "write.json", *kv, n=1)
        _push_to_disk(ns, pool, ram)
        for r in range(rounds):
            s = _restart_warm(ns, pool)
            paths = glob.glob(str(disk_dir / ns / "**" / "*.arrow"), recursive=True)
            drop_pages(paths)
            out = engine("read", "read", f"read{r}.json", *kv, n=repeats)
            times = out["times"][str(TOKENS)]
            disk_hits.append(times[0])
            ram_hits.extend(times[1:])
            cached.extend(out["cached"][str(TOKENS)])
            promoted = ray.get(pool.stats.remote(), timeout=30)["promoted"]
    finally:
        kvray.stop(ns, purge=True)
    expected = (TOKENS - 1) // bench_e2e.BLOCK * bench_e2e.BLOCK
    if min(cached) < expected:
        raise RuntimeError(f"bench_tier: a hit loaded {min(cached)} of {expected} tokens")
    return {
        "recompute": statistics.median(recompute),
        "disk_hit": statistics.median(disk_hits),
        "ram_hit": statistics.median(ram_hits),
        "rounds": rounds,
        "ram_bytes": ram,
        "disk_files": len(paths),
        "disk_blocks_at_restart": s["disk_only_blocks"],
        "promoted_last_round": promoted,
        "cached_tokens": min(cached),
    }


def ensure_ray() -> None:
    """Join RAY_ADDRESS, or start a local Ray sized like ``bench_e2e.py``'s."""
    join_or_start(2 << 30)
