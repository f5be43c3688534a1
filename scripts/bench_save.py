"""The save path's CPU per stored byte, as an operator sees it (issue 17).

One simulated node, one pool. A writer process stores blocks the way the connector's workers do
(``Store.put_shard`` of a 2D uint8 array whose rows are the blocks, fresh keys every put, then
waits for the pool to own them), at the serving model's block size (``bench_serve.py``'s
``gqa`` model: 4 KiB of KV a token, 32 tokens a block = 128 KiB) and at 2 MiB, with 1, 8 and
64 blocks a put. For each it reports, per stored MiB:

- CPU seconds of the writer process (every thread: the put threads run there), of the pool
  actor's process and of the node's raylet and plasma store (``psutil``, user + system);
- the same bytes copied once by numpy (``memcpy``): the floor of one copy;
- wall time per put.

Medians of ``--repeats`` (each repeat stores ``--mib`` MiB per shape into fresh keys; the pool's
capacity holds every repeat, so no eviction is timed).
Last line: ``ratio save_cpu_over_memcpy_128k=<x> save_cpu_over_memcpy_2m=<y>
save_cpu_us_per_put_128k_1=<z>`` (x, y at 8 blocks a put; z: all processes' CPU per one-block
put, the fixed cost).
Run: ``.venv/bin/python scripts/bench_save.py [--repeats 5] [--mib 64]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import numpy as np
import psutil
import ray

import kvray
from kvray.meta.ids import key_ids
from kvray.testing.cluster import simulated_cluster

MiB = 1 << 20
KiB = 1 << 10
SHAPES = [(128 * KiB, 1), (128 * KiB, 8), (128 * KiB, 64), (2 * MiB, 1), (2 * MiB, 8)]


def cpu_s(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        t = p.cpu_times()
        total += t.user + t.system
    return total


def ray_procs(session_dir: str) -> list[psutil.Process]:
    """The node's raylet (which runs the plasma store) of this cluster."""
    out = []
    for p in psutil.process_iter(["name", "cmdline"]):
        cmd = " ".join(p.info.get("cmdline") or [])
        if "raylet" in (p.info.get("name") or "") and session_dir in cmd:
            out.append(p)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--mib", type=int, default=64, help="MiB stored per shape and repeat")
    args = ap.parse_args()
    per_repeat = args.mib * MiB
    store_mem = len(SHAPES) * args.repeats * per_repeat + 1024 * MiB
    cluster = simulated_cluster(
        {"num_cpus": 2, "object_store_memory": store_mem, "include_dashboard": False}
    )
    ns = f"save{uuid.uuid4().hex[:6]}"
    kvray.start(namespace=ns, capacity=store_mem - 512 * MiB)
    store = kvray.connect(ns, subscribe=False)
    me = psutil.Process()
    session = ray._private.worker._global_node.get_session_dir_path()
    raylets = ray_procs(session)
    pools = [
        c
        for r in raylets
        for c in r.children(recursive=True)
        if "BlockPool" in " ".join(c.cmdline())
    ]
    assert pools, "no pool actor found"
    rows = []
    results: dict[tuple[int, int], dict[str, float]] = {}
    try:
        for block, per_put in SHAPES:
            puts = max(1, per_repeat // (block * per_put))
            data = np.random.default_rng(0).integers(0, 255, (per_put, block), dtype=np.uint8)
            # The floor: one copy of the same bytes, from memory (not the cache) to memory.
            src_all = np.random.default_rng(1).integers(0, 255, puts * data.size, dtype=np.uint8)
            dst_all = np.empty_like(src_all)
            samples: dict[str, list[float]] = {k: [] for k in ("writer", "pool", "raylet", "wall")}
            memcpy: list[float] = []
            for _ in range(args.repeats + 1):  # the first is a warm-up
                c0 = time.process_time()
                np.copyto(dst_all, src_all)
                memcpy.append(time.process_time() - c0)
                w0, p0, r0 = me.cpu_times(), cpu_s(pools), cpu_s(raylets)
                t0 = time.perf_counter()
                futs = []
                for _ in range(puts):
                    keys = [uuid.uuid4().bytes for _ in range(per_put)]
                    futs.append(store.put_shard(keys, key_ids(keys), 0, 1, data))
                    if len(futs) >= 8:  # the connector's puts in flight are bounded too
                        assert futs.pop(0).result(timeout=120).stored == per_put
                for f in futs:
                    assert f.result(timeout=120).stored == per_put
                wall = time.perf_counter() - t0
                w1 = me.cpu_times()
                samples["writer"].append(w1.user + w1.system - w0.user - w0.system)
                samples["pool"].append(cpu_s(pools) - p0)
                samples["raylet"].append(cpu_s(raylets) - r0)
                samples["wall"].append(wall / puts)
            mib = puts * per_put * block / MiB
            med = {k: statistics.median(v[1:]) for k, v in samples.items()}
            med["memcpy"] = statistics.median(memcpy[1:])
            med["total"] = med["writer"] + med["pool"] + med["raylet"]
            med["mib"] = mib
            med["puts"] = puts
            results[(block, per_put)] = med
            rows.append(
                f"  {block // KiB:>5} KiB x {per_put:>2}/put  "
                f"ms CPU per MiB: writer {1e3 * med['writer'] / mib:6.2f}  "
                f"pool {1e3 * med['pool'] / mib:6.2f}  raylet {1e3 * med['raylet'] / mib:6.2f}  "
                f"total {1e3 * med['total'] / mib:6.2f}  memcpy {1e3 * med['memcpy'] / mib:5.2f}  "
                f"| CPU us/put {1e6 * med['total'] / puts:8.0f}  "
                f"wall ms/put {1e3 * med['wall']:6.2f}"
            )
    finally:
        store.close()
        ray.shutdown()
        cluster.shutdown()
    cores = os.cpu_count()
    print(f"kvray bench_save (median of {args.repeats}; {args.mib} MiB a shape; cores: {cores})")
    for r in rows:
        print(r)

    def over(block: int, per_put: int) -> float:
        m = results[(block, per_put)]
        return m["total"] / max(m["memcpy"], 1e-9)

    fixed = results[(128 * KiB, 1)]
    print(
        f"ratio save_cpu_over_memcpy_128k={over(128 * KiB, 8):.1f} "
        f"save_cpu_over_memcpy_2m={over(2 * MiB, 8):.1f} "
        f"save_cpu_us_per_put_128k_1={1e6 * fixed['total'] / fixed['puts']:.0f}"
    )


if __name__ == "__main__":
    main()
