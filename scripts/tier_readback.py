"""The read-back part of ``bench_tier.py`` (issue 18): a working set 4x RAM read back from disk.

A kvray deployment (RAM ``ram``, a disk tier twice the working set) is given 4x RAM of 1 MiB
blocks, 8 to a put, the spill queue drained between puts, so three quarters of the blocks are
on disk only. Then, through the public API (``kvray.connect``, ``Store.get``), each phase with
the files' pages dropped from the page cache first (``posix_fadvise(DONTNEED)``):

- **sequential**: one reader gets every block in put order, one block per get (the loop of the
  issue), twice (the second pass reads what the first left on disk);
- **4 readers**: four threads at once, each getting every block once, one block per get, in
  orders of their own (forward, backward, from the middle out, random): RAM and disk reads
  interleave and RAM is often all leased, so blocks are also served straight from the files.

Per phase: blocks read of blocks asked (hits), GB/s (bytes ``get`` returned over the phase's
wall time), and what the pool did (promoted, read from files, failed by cause).
``disk_read_back_hit_rate`` is blocks read over blocks asked, all phases together (target 1.0).
"""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import ray

from kvray.testing.pools import arrow_files, drop_pages, settle

MiB = 1 << 20
BLOCK = MiB
PER_PUT = 8


def _pool_stats(pool: Any) -> dict[str, Any]:
    return ray.get(pool.stats.remote(), timeout=60)


def _orders(n: int) -> list[list[int]]:
    mid = n // 2  # n is even
    halves = zip(range(mid, n), range(mid - 1, -1, -1), strict=True)
    out_from_middle = [i for pair in halves for i in pair]
    shuffled = list(range(n))
    random.Random(18).shuffle(shuffled)
    return [list(range(n)), list(range(n - 1, -1, -1)), out_from_middle, shuffled]


def readback_figures(work: Path, ram: int) -> dict[str, Any]:
    """Hits and GB/s of each read-back phase, the pool's counters, and the overall hit rate."""
    import kvray
    from kvray.client import checksum
    from kvray.cluster import local_node_id
    from kvray.meta.messages import RAY_NAMESPACE, pool_name

    n = 4 * ram // BLOCK
    ns = f"readback{os.getpid()}"
    disk_dir = work / "disk"
    kvray.start(
        namespace=ns,
        capacity=ram,
        disk_dir=str(disk_dir),
        disk_capacity=2 * n * BLOCK,
        health_check_interval_s=0.5,
    )
    phases: dict[str, dict[str, Any]] = {}
    try:
        pool = ray.get_actor(pool_name(ns, local_node_id()), namespace=RAY_NAMESPACE)
        store = kvray.connect(ns)
        keys = [f"{ns}-{i}".encode() for i in range(n)]
        sums: list[int] = []
        rng = np.random.default_rng(18)
        for a in range(0, n, PER_PUT):
            blocks = rng.integers(0, 256, (min(PER_PUT, n - a), BLOCK), dtype=np.uint8)
            sums += [checksum(b) for b in blocks]
            store.put(keys[a : a + len(blocks)], blocks).result(120)
            settle(pool, reads=True)
        store.sync()
        s = settle(pool, reads=True)
        if s["disk_skipped"] or s["present_blocks"] != n:
            raise RuntimeError(f"bench_tier read-back: not every block was kept: {s}")
        facts = {"blocks": n, "disk_only_at_start": s["disk_only_blocks"]}

        def phase(name: str, orders: list[list[int]]) -> None:
            settle(pool, reads=True)
            drop_pages(arrow_files(disk_dir))
            before = _pool_stats(pool)
            tally = {"asked": 0, "read": 0, "bytes": 0, "wrong": 0}
            reasons: set[str] = set()
            lock = threading.Lock()

            def reader(order: list[int]) -> None:
                asked = read = nbytes = wrong = 0
                for i in order:
                    asked += 1
                    try:
                        (got,) = store.get([keys[i]])
                    except kvray.BlockLostError as e:
                        with lock:
                            reasons.add(e.reason)
                        continue
                    if checksum(got) != sums[i]:
                        wrong += 1
                        continue
                    read += 1
                    nbytes += got.nbytes
                with lock:
                    for k, v in (("asked", asked), ("read", read), ("bytes", nbytes)):
                        tally[k] += v
                    tally["wrong"] += wrong

            threads = [threading.Thread(target=reader, args=(o,)) for o in orders]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            seconds = time.perf_counter() - t0
            after = _pool_stats(pool)
            delta = {
                k: after[k] - before[k]
                for k in ("promoted", "read_from_disk", "promote_failed", "hits", "misses")
            }
            phases[name] = {**tally, "seconds": seconds, "reasons": sorted(reasons), **delta}
            print(f"# read-back {name}: {phases[name]}", flush=True)

        phase("sequential", [list(range(n))])
        phase("sequential again", [list(range(n))])
        phase("4 readers", _orders(n))
        store.close()
    finally:
        kvray.stop(ns, purge=True)
    asked = sum(p["asked"] for p in phases.values())
    read = sum(p["read"] for p in phases.values())
    return {"ram": ram, **facts, "phases": phases, "hit_rate": read / asked if asked else 0.0}


def rows(f: dict[str, Any]) -> list[tuple[str, str]]:
    """``bench_tier`` report rows of :func:`readback_figures`."""
    out = [
        (
            "read-back: RAM / working set",
            f"{f['ram'] / MiB:.0f} MiB / {f['blocks'] * BLOCK / MiB:.0f} MiB "
            f"({f['disk_only_at_start']} of {f['blocks']} blocks on disk only), 1 MiB gets",
        )
    ]
    for name, p in f["phases"].items():
        gbs = p["bytes"] / p["seconds"] / 1e9 if p["seconds"] else 0.0
        why = f"; failed: {'; '.join(p['reasons'])}" if p["reasons"] else ""
        out.append(
            (
                f"  {name}",
                f"{p['read']}/{p['asked']} hits, {gbs:.2f} GB/s (promoted {p['promoted']}, "
                f"from files {p['read_from_disk']}, promote_failed {p['promote_failed']}){why}",
            )
        )
    out.append(("  disk_read_back_hit_rate", f"{f['hit_rate']:.3f}"))
    return out
