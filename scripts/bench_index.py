"""Benchmark of kvray's metadata plane (issue 9): ingest, feed lag, snapshots, lookups, memory.

A 64-node cluster is simulated on this machine: 64 synthetic pools (slots 0..63) publish
batches straight into ``--shards`` real index shard actors at a sustained rate, ``--subscribers``
real subscriber processes (the client's feed and view) follow them, and the index grows to
``--blocks`` blocks. Measured in the same run against "today's design" (the dict-of-bytes view
and index kvray used before: one Python dict entry per key, one key per TP shard):

- ingest keys/s per index shard (time the shard spends applying, one core) and in total;
- feed lag p50/p99 (pool batch sent -> visible in every subscriber) at a sustained rate;
- snapshot time of a new subscriber at ``--blocks`` blocks;
- lookup p50/p99 of a 64-block prompt (keys -> ids -> prefix) at ``--blocks`` blocks;
- bytes per block in a view, in the index (with its change log), in a pool's metadata;
- end to end through the public API: tiny blocks put by one client -> visible in another's view,
  65,536 blocks a put as one 2D array, and (issue 21) 2,000 blocks a put as one 2D array and as
  a list of 1D arrays (the same bytes).

Last line: ``ratio ingest_keys_per_s=<x> view_bytes_per_block=<y> index_bytes_per_block=<z>
lookup_p99_us=<w> e2e_2d_keys_s=<a> e2e_list_keys_s=<b> list_over_2d=<b/a>`` (targets:
x >= 1,000,000; y <= 32; z <= 64; w <= 30; b/a >= 0.5). ``--e2e-only``: the end-to-end part
alone (its figures and a last line ``ratio e2e_2d_keys_s=... list_over_2d=...``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
import tracemalloc
from typing import Any

import numpy as np

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray

from kvray.actors.publisher import publish_interval
from kvray.meta.holders import HolderTable
from kvray.meta.ids import index_shard_of, key_ids
from kvray.meta.messages import (
    RAY_NAMESPACE,
    Inventory,
    NodeInfo,
    PoolStatus,
    ShardBatch,
    index_name,
)

NS = "benchidx"
POOLS = 64
#: Each synthetic pool publishes every TICK_S, as kvray's pools do on a 64-node cluster.
TICK_S = publish_interval(POOLS)


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


# ---------------------------------------------------------------------- in-process parts
def micro_ingest(n: int, tp: int, batch: int = 8192) -> tuple[float, float]:
    """(shard records/s of one HolderTable on one core, bytes per block)."""
    rng = np.random.default_rng(tp)
    blocks = rng.integers(2, 2**64, n // tp, dtype=np.uint64)
    h = HolderTable()
    nsh = np.full(batch, tp, dtype=np.uint16)
    t0 = time.process_time()
    for shard in range(tp):  # each TP rank's put arrives on its own
        sh = np.full(batch, shard, dtype=np.uint16)
        for a in range(0, blocks.size, batch):
            ids = blocks[a : a + batch]
            h.add(a // batch % POOLS, ids, sh[: ids.size], nsh[: ids.size], unique=True)
    dt = time.process_time() - t0
    return blocks.size * tp / dt, h.nbytes / max(1, len(h))


def dict_baseline(n: int) -> dict[str, float]:
    """Today's design, measured: a dict of 44-byte keys -> slot (view), plus per-node sets
    (index); memory by tracemalloc, 64-key prefix lookups."""
    tracemalloc.start()
    keys = [os.urandom(44) for _ in range(n)]  # the feed unpickles one bytes object a key
    view: dict[bytes, int] = {}
    t0 = time.process_time()
    for k in keys:
        view[k] = 3
    ingest = n / (time.process_time() - t0)
    view_bytes = tracemalloc.get_traced_memory()[0]
    node_keys: set[bytes] = set(keys)  # the index also kept a set of keys per node
    index_bytes = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del node_keys
    lat = []
    rng = np.random.default_rng(0)
    for _ in range(5000):
        q = [keys[i] for i in rng.integers(0, n, 64).tolist()]
        t = time.perf_counter()
        next((i for i, k in enumerate(q) if k not in view), len(q))
        lat.append(time.perf_counter() - t)
    return {
        "ingest": ingest,
        "view_b": view_bytes / n,
        "index_b": index_bytes / n,
        "p50": pct(lat, 0.5) * 1e6,
        "p99": pct(lat, 0.99) * 1e6,
    }


# ---------------------------------------------------------------------- cluster parts
@ray.remote(num_cpus=0)
class FakePools:
    """Answers the index shards' resync for all 64 synthetic pools: they start empty."""

    def inventory(self, shard: int, num_shards: int) -> Inventory:
        e = np.zeros(0, dtype=np.uint64)
        return Inventory(0, "bench", 0, e, e.astype(np.uint16), e.astype(np.uint16))

    def ping(self) -> tuple[int, str, tuple[int, ...]]:
        return 0, "bench", ()


@ray.remote(num_cpus=0)
class Feeder:
    """Plays ``pools`` synthetic pools: each publishes its changes to every index shard."""

    def __init__(self, k: int, pools: list[int]) -> None:
        self.k = k
        self.pools = pools
        self.shards = [ray.get_actor(index_name(NS, i), namespace=RAY_NAMESPACE) for i in range(k)]
        self.versions = {(p, s): 0 for p in pools for s in range(k)}

    def _send(
        self, pool: int, ids: np.ndarray, shards: np.ndarray, nshards: int, unique: bool = True
    ) -> list[Any]:
        refs = []
        owner = index_shard_of(ids, self.k)
        for s in range(self.k):
            sel = owner == s if self.k > 1 else slice(None)
            part = ids[sel]
            if not part.size:
                continue
            self.versions[(pool, s)] += 1
            batch = ShardBatch(
                part,
                shards[sel],
                np.full(part.size, nshards, dtype=np.uint16),
                np.zeros(0, dtype=np.uint64),
                np.zeros(0, dtype=np.uint16),
                add_unique=unique,
            )
            refs.append(
                self.shards[s].update.remote(pool, "bench", self.versions[(pool, s)], batch)
            )
        return refs

    def publish(self, ids: np.ndarray) -> None:
        ray.get(self._send(self.pools[0], ids, np.zeros(ids.size, dtype=np.uint16), 1))

    def bulk(self, start: int, n: int, batch: int) -> float:
        """Publish ``n`` single-shard blocks in large batches, as fast as the shards take them."""
        t0 = time.perf_counter()
        rng = np.random.default_rng(start)
        inflight: list[Any] = []
        for i, a in enumerate(range(0, n, batch)):
            ids = rng.integers(2, 2**64, min(batch, n - a), dtype=np.uint64)
            zeros = np.zeros(ids.size, dtype=np.uint16)
            inflight += self._send(self.pools[i % len(self.pools)], ids, zeros, 1)
            if len(inflight) > 8 * self.k:
                ray.wait(inflight, num_returns=len(inflight) - 4 * self.k)
                inflight = inflight[-4 * self.k :]
        ray.get(inflight)
        return time.perf_counter() - t0

    def sustained(
        self, rate: float, seconds: float, tp: int, markers: list[int], seed: int
    ) -> tuple[dict[int, float], int]:
        """Each pool publishes every TICK_S one batch per index shard holding every shard of
        its new blocks (``tp`` ranks' puts, coalesced as a pool's publisher does). Returns
        {marker id: time it was sent}, shard records sent."""
        rng = np.random.default_rng(seed)
        per_tick = rate * TICK_S / max(1, len(self.pools))
        sent: dict[int, float] = {}
        todo = list(markers)
        records = 0
        t_end = time.time() + seconds
        next_tick = time.time()
        pending: list[Any] = []
        while time.time() < t_end:
            for p in self.pools:
                nblocks = max(1, int(per_tick // tp))
                ids = rng.integers(2, 2**64, nblocks, dtype=np.uint64)
                marker = todo.pop() if todo else None
                if marker is not None:
                    ids[0] = marker
                every = np.repeat(ids, tp)
                shards = np.tile(np.arange(tp, dtype=np.uint16), ids.size)
                pending += self._send(p, every, shards, tp, unique=False)
                records += every.size
                if marker is not None:
                    sent[marker] = time.time()
            next_tick += TICK_S
            if len(pending) > 4000:
                ray.wait(pending, num_returns=len(pending) - 1000, timeout=30)
                pending = pending[-1000:]
            time.sleep(max(0.0, next_tick - time.time()))
        ray.get(pending, timeout=120)
        return sent, records


@ray.remote(num_cpus=0)
class Sub:
    """A subscribing process: kvray's feed and view over every index shard."""

    def __init__(self, k: int, markers: np.ndarray) -> None:
        from kvray.feed import Subscriber

        handles = [ray.get_actor(index_name(NS, i), namespace=RAY_NAMESPACE) for i in range(k)]
        self.sub = Subscriber(NS, handles, 60.0)
        t0 = time.perf_counter()
        self.sub.start()
        self.snapshot_s = time.perf_counter() - t0
        self.markers = markers
        self.seen: dict[int, float] = {}
        self._watch = threading.Thread(target=self._watch_markers, daemon=True)
        self._watch.start()

    def _watch_markers(self) -> None:
        pending = self.markers
        while pending.size:
            hit = self.sub.view.contains(pending)
            if hit.any():
                now = time.time()
                for m in pending[hit].tolist():
                    self.seen[m] = now
                pending = pending[~hit]
            time.sleep(0.001)

    def info(self) -> dict[str, float]:
        v = self.sub.view
        return {
            "blocks": len(v),
            "bytes": v.nbytes,
            "snapshot_s": self.snapshot_s,
            "error": self.sub.error or "",
        }

    def seen_at(self) -> dict[int, float]:
        return dict(self.seen)

    def lookup_latency(self, keys: list[bytes], prompts: int) -> tuple[float, float]:
        """64-block prompt lookups as the scheduler does them: full keys -> ids -> prefix.
        ``keys`` were published as blocks; half the prompts hit every block, half stop at a
        random one."""
        view = self.sub.view
        deadline = time.time() + 60
        while view.lookup(key_ids(keys)) < len(keys):
            assert time.time() < deadline, (
                f"the prompt's blocks never became visible: {view.lookup(key_ids(keys))} of "
                f"{len(keys)}, feed error {self.sub.error}, seqs {view.seqs}"
            )
            time.sleep(0.01)
        rng = np.random.default_rng(1)
        for _ in range(1000):  # warm up
            view.lookup(key_ids(keys))
        lat = []
        for i in range(prompts):
            q = keys if i % 2 else [*keys[: rng.integers(1, 64)], os.urandom(44)]
            t = time.perf_counter()
            view.lookup(key_ids(q))
            lat.append(time.perf_counter() - t)
        return pct(lat, 0.5) * 1e6, pct(lat, 0.99) * 1e6

    def close(self) -> None:
        self.sub.close()


def cluster_phase(args: argparse.Namespace) -> dict[str, Any]:
    from kvray.actors.index import IndexShardActor
    from kvray.config import KVRayConfig

    k = args.shards
    cfg = KVRayConfig(namespace=NS)
    shards = [
        IndexShardActor.options(  # type: ignore[attr-defined]
            name=index_name(NS, i), namespace=RAY_NAMESPACE, max_concurrency=1000, num_cpus=0
        ).remote(cfg, i, k, run=True)
        for i in range(k)
    ]
    fake = FakePools.options(name="benchidx/fakepools", namespace=RAY_NAMESPACE).remote()
    ray.get(fake.ping.remote())
    statuses = {
        s: PoolStatus(
            NodeInfo(s, f"node{s:02d}", "benchidx/fakepools", 1 << 40), True, "bench", (0,) * k
        )
        for s in range(POOLS)
    }
    ray.get([sh.set_pools.remote(statuses) for sh in shards])
    deadline = time.time() + 60
    while any(ray.get(sh.stats.remote())["pools"] < POOLS for sh in shards):
        assert time.time() < deadline, "synthetic pools not adopted"
        time.sleep(0.2)
    feeders = [Feeder.remote(k, list(range(f, POOLS, 2))) for f in range(2)]
    out: dict[str, Any] = {}
    # 1. Bulk ingest to --blocks blocks (no subscribers yet).
    t0 = time.perf_counter()
    half = args.blocks // 2
    ray.get([f.bulk.remote(i * half, half, 65536) for i, f in enumerate(feeders)])
    wall = time.perf_counter() - t0
    st = ray.get([sh.stats.remote() for sh in shards])
    out["blocks"] = sum(s["blocks"] for s in st)
    out["ingest_shard"] = statistics.median(s["applied"] / s["busy_s"] for s in st)
    out["ingest_total_wall"] = args.blocks / wall
    out["index_b"] = sum(s["bytes"] for s in st) / out["blocks"]
    # 2. Subscribers join (each takes a snapshot of every shard).
    rates = args.rates
    per_rate = args.markers
    markers = key_ids([b"marker-%d" % i for i in range(per_rate * len(rates))])
    subs = [Sub.remote(k, markers) for _ in range(args.subscribers)]
    infos = ray.get([s.info.remote() for s in subs], timeout=600)
    out["snapshot_s"] = statistics.median(i["snapshot_s"] for i in infos)
    out["view_b"] = statistics.median(i["bytes"] / i["blocks"] for i in infos)
    # 3. Sustained rates with TP=8 blocks; lag of marker blocks to every subscriber.
    out["sustained"] = []
    for r, rate in enumerate(rates):
        mine = markers[r * per_rate : (r + 1) * per_rate]
        half = mine.size // 2
        parts = ray.get(
            [
                f.sustained.remote(
                    rate / 2, args.seconds, 8, mine[i * half : (i + 1) * half].tolist(), 100 + i
                )
                for i, f in enumerate(feeders)
            ],
            timeout=args.seconds + 300,
        )
        time.sleep(3)
        sent = {m: t for part, _ in parts for m, t in part.items()}
        lags = []
        for seen in ray.get([s.seen_at.remote() for s in subs]):
            lags += [seen[m] - t for m, t in sent.items() if m in seen]
        out["sustained"].append(
            {
                "offered": rate,
                "achieved": sum(n for _, n in parts) / args.seconds,
                "p50_ms": pct(lags, 0.5) * 1e3,
                "p99_ms": pct(lags, 0.99) * 1e3,
                "missing": len(sent) * len(subs) - len(lags),
            }
        )
    st2 = ray.get([sh.stats.remote() for sh in shards])
    out["resyncs"] = sum(s["resyncs"] for s in st2) - sum(s["resyncs"] for s in st)
    out["index_b_after"] = sum(s["bytes"] for s in st2) / sum(s["blocks"] for s in st2)
    # 4. Lookups in a subscriber holding every block (a prompt's 64 blocks published first).
    # Other subscribers leave; the one measured keeps its feed running, as a scheduler does.
    for sub in subs[1:]:
        ray.get(sub.close.remote())
    prompt = [os.urandom(44) for _ in range(64)]
    ray.get(feeders[0].publish.remote(key_ids(prompt)))
    p50, p99 = ray.get(subs[0].lookup_latency.remote(prompt, args.lookups), timeout=600)
    out["lookup_p50_us"], out["lookup_p99_us"] = p50, p99
    out["view_blocks"] = ray.get(subs[0].info.remote())["blocks"]
    ray.get(subs[0].close.remote())
    return out


def e2e_phase(n: int, per_put: int = 65536, shape: str = "2d") -> dict[str, float]:
    """Tiny blocks through the public API: put by one client, visible in another's view.
    ``per_put`` blocks a put, as one 2D array (``shape="2d"``) or a list of 1D arrays."""
    import kvray

    kvray.start(namespace="benche2e", capacity="700MiB")

    @ray.remote(num_cpus=0)
    class Watcher:
        def __init__(self) -> None:
            self.s = kvray.connect("benche2e")

        def wait(self, count: int, timeout: float) -> float:
            t0 = time.time()
            while len(self.s.feed.view) < count and time.time() - t0 < timeout:
                time.sleep(0.0005)
            return time.time()

    w = Watcher.remote()
    ray.get(w.wait.remote(0, 1))
    s = kvray.connect("benche2e")
    keys = [os.urandom(44) for _ in range(n)]
    blocks = np.random.default_rng(0).integers(0, 255, (n, 64), dtype=np.uint8)
    payload: Any = blocks if shape == "2d" else list(blocks)
    done = w.wait.remote(n, 300)
    t0 = time.time()
    futs = [s.put(keys[a : a + per_put], payload[a : a + per_put]) for a in range(0, n, per_put)]
    stored = sum(f.result(timeout=300).stored for f in futs)
    seen = ray.get(done, timeout=400)
    stats = s.stats()
    node = next(iter(stats["nodes"].values()))
    s.close()
    kvray.stop("benche2e")
    return {
        "e2e_keys_s": n / (seen - t0),
        "stored": stored,
        "pool_b": node["meta_bytes"] / max(1, node["blocks"]),
    }


def e2e_small_puts(n: int, repeats: int) -> dict[str, float]:
    """Medians of ``repeats`` end-to-end runs at 2,000 blocks a put, 2D and list, alternated."""
    rates: dict[str, list[float]] = {"2d": [], "list": []}
    for _ in range(repeats):
        for shape in rates:
            rates[shape].append(e2e_phase(n, 2000, shape)["e2e_keys_s"])
    return {shape: statistics.median(r) for shape, r in rates.items()}


def _init_ray() -> None:
    """A local Ray for the actor phases (4 CPUs, 2 GiB object store)."""
    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=2 << 30,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1M blocks, short phases")
    ap.add_argument("--blocks", type=int, default=10_000_000)
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--subscribers", type=int, default=8)
    ap.add_argument(
        "--rates",
        type=lambda v: [float(x) for x in v.split(",")],
        default=[50_000, 100_000, 200_000, 400_000],
        help="sustained shard records/s to offer, one phase each",
    )
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--markers", type=int, default=400)
    ap.add_argument("--lookups", type=int, default=20_000)
    ap.add_argument("--e2e-blocks", type=int, default=1_000_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--e2e-only", action="store_true", help="only the end-to-end part")
    args = ap.parse_args()
    if args.quick:
        args.blocks, args.seconds, args.e2e_blocks, args.repeats = 1_000_000, 6, 300_000, 1
        args.rates = [50_000, 200_000]
        args.lookups, args.markers = 5000, 100

    if args.e2e_only:
        _init_ray()
        try:
            small = e2e_small_puts(args.e2e_blocks, args.repeats)
        finally:
            ray.shutdown()
        print(
            f"end to end, 2,000 blocks a put: 2D {small['2d']:,.0f} keys/s, "
            f"list {small['list']:,.0f} keys/s"
        )
        print(
            f"ratio e2e_2d_keys_s={small['2d']:.0f} e2e_list_keys_s={small['list']:.0f} "
            f"list_over_2d={small['list'] / small['2d']:.2f}"
        )
        return
    print(
        f"kvray metadata plane, {POOLS} simulated pools, {args.shards} index shards, "
        f"{args.subscribers} subscribers, {args.blocks:,} blocks",
        flush=True,
    )
    tp1 = [micro_ingest(min(args.blocks, 4_000_000), 1) for _ in range(args.repeats)]
    tp8 = [micro_ingest(min(args.blocks, 4_000_000), 8) for _ in range(args.repeats)]
    base = dict_baseline(min(args.blocks, 1_000_000))
    _init_ray()
    try:
        cl = cluster_phase(args)
        e2e = [e2e_phase(args.e2e_blocks) for _ in range(args.repeats)]
        small = e2e_small_puts(args.e2e_blocks, args.repeats)
    finally:
        ray.shutdown()
    ingest_tp1 = statistics.median(r[0] for r in tp1)
    e2e_rate = statistics.median(e["e2e_keys_s"] for e in e2e)
    pool_b = statistics.median(e["pool_b"] for e in e2e)
    rows = [
        (
            "ingest, one index shard (in-process, TP=1 blocks)",
            f"{ingest_tp1:,.0f} keys/s",
            f"{base['ingest']:,.0f} (dict)",
            ">= 1,000,000",
        ),
        (
            "ingest, one index shard (in-process, TP=8 shards)",
            f"{statistics.median(r[0] for r in tp8):,.0f} keys/s",
            "",
            "",
        ),
        (
            "ingest, one index shard actor (CPU applying)",
            f"{cl['ingest_shard']:,.0f} keys/s",
            "",
            ">= 1,000,000",
        ),
        (
            f"ingest, all {args.shards} shards (wall, 2 cores shared)",
            f"{cl['ingest_total_wall']:,.0f} keys/s",
            "",
            "",
        ),
        (
            f"snapshot of a new subscriber ({cl['blocks']:,} blocks)",
            f"{cl['snapshot_s']:.2f} s",
            "",
            "",
        ),
        (
            f"lookup of a 64-block prompt ({cl['view_blocks']:,} blocks) p50",
            f"{cl['lookup_p50_us']:.1f} us",
            f"{base['p50']:.1f} (dict)",
            "",
        ),
        ("lookup p99", f"{cl['lookup_p99_us']:.1f} us", f"{base['p99']:.1f} (dict)", "<= 30"),
        ("bytes per block, view", f"{cl['view_b']:.1f}", f"{base['view_b']:.0f} (dict)", "<= 32"),
        (
            "bytes per block, index + change log",
            f"{max(cl['index_b'], cl['index_b_after']):.1f}",
            f"{base['index_b']:.0f} (dict)",
            "<= 64",
        ),
        ("bytes per block, pool metadata", f"{pool_b:.1f}", "", "<= 128"),
        (
            "end to end, public API put -> another view",
            f"{e2e_rate:,.0f} keys/s",
            "42,000 (issue 9, before)",
            ">= 300,000",
        ),
        (
            "end to end, 2,000 blocks a put, 2D array",
            f"{small['2d']:,.0f} keys/s",
            "",
            "",
        ),
        (
            "end to end, 2,000 blocks a put, list of arrays",
            f"{small['list']:,.0f} keys/s",
            "33,000 (issue 21, before)",
            ">= half the 2D figure",
        ),
    ]
    for ph in cl["sustained"]:
        rows.insert(
            4,
            (
                f"feed lag p50 / p99, {ph['offered']:,.0f} keys/s offered "
                f"({ph['achieved']:,.0f} sent)",
                f"{ph['p50_ms']:.0f} / {ph['p99_ms']:.0f} ms",
                "",
                f"missing {ph['missing']}, resyncs {cl['resyncs']}",
            ),
        )
    w0 = max(len(r[0]) for r in rows)
    print(f"\n{'measure':<{w0}}  {'kvray':>22}  {'before (dict design)':>24}  target")
    for name, val, old, target in rows:
        print(f"{name:<{w0}}  {val:>22}  {old:>24}  {target}")
    print(
        f"ratio ingest_keys_per_s={cl['ingest_shard']:.0f} view_bytes_per_block={cl['view_b']:.1f} "
        f"index_bytes_per_block={max(cl['index_b'], cl['index_b_after']):.1f} "
        f"lookup_p99_us={cl['lookup_p99_us']:.1f} e2e_2d_keys_s={small['2d']:.0f} "
        f"e2e_list_keys_s={small['list']:.0f} list_over_2d={small['list'] / small['2d']:.2f}"
    )


if __name__ == "__main__":
    main()
