"""Replay a Mooncake-format trace through kvray on simulated nodes; offline baselines beside it.

The trace is JSONL, one request a line: ``timestamp`` (ms), ``input_length``,
``output_length``, ``hash_ids`` (prefix block hashes, 512 tokens a block; equal ids are
reusable blocks). Each request, on the engine of its node (an actor pinned to the node, one per
node, routed round robin or to the node whose pool holds the longest prefix by kvray's view):
looks up the longest cached prefix cluster-wide (``Store.lookup``), reads those blocks back
(``Store.get``; a block evicted since the lookup ends the hit there, as a connector loads the
prefix it can read) and checks every byte, then puts the rest into its node's pool and waits
for the put to be acknowledged. The engines work at once, in trace order, ``--window`` rounds
of requests at a time (``--serial``: one request at a time). Every block's bytes are a
function of its id, so a wrong byte anywhere is counted.

On the same request sequence, offline (plain Python): one global LRU of the same total capacity
(every block of a request accessed in order), Belady (evict the farthest next use, the offline
optimum), unbounded (every reusable block); and the pools' policy as a simulator
(:func:`kvray.meta.eviction.simulate`, one cache of the total capacity, and ``--nodes`` pools
of a share each as the replay runs them).

Run: ``python scripts/bench_trace.py --trace /work/shared/data/mooncake_synthetic_trace.jsonl``.
The last line is ``ratio kvray_over_lru_tight=... kvray_over_lru_roomy=...
kvray_over_belady_tight=... replay_req_per_s=...`` (the first and last capacities given; "kvray"
is the last of ``--policies``).
"""

from __future__ import annotations

import argparse
import heapq
import json
import statistics
import time
import uuid
from collections import OrderedDict
from typing import Any

import numpy as np

from kvray.meta.eviction import simulate
from kvray.meta.messages import INLINE_BYTES


def load_trace(path: str, limit: int = 0) -> list[list[int]]:
    out = []
    with open(path) as f:
        for line in f:
            if line.strip():
                out.append([int(x) for x in json.loads(line)["hash_ids"]])
                if limit and len(out) >= limit:
                    break
    return out


# ---------------------------------------------------------------------- offline baselines
def _prefix(req: list[int], held: Any) -> int:
    n = 0
    for x in req:
        if x not in held:
            break
        n += 1
    return n


def global_lru(reqs: list[list[int]], cap: int) -> float:
    """One LRU of ``cap`` blocks; every block of a request is accessed in order."""
    c: OrderedDict[int, None] = OrderedDict()
    hit = tot = 0
    for req in reqs:
        hit += _prefix(req, c)
        tot += len(req)
        for x in req:
            if x in c:
                c.move_to_end(x)
            else:
                c[x] = None
                if len(c) > cap:
                    c.popitem(last=False)
    return hit / tot


def belady(reqs: list[list[int]], cap: int) -> float:
    """Evict the block whose next use is farthest (ties: the later position in its request)."""
    inf = 1 << 60
    nxt: dict[int, int] = {}
    nextuse: list[list[int]] = [[] for _ in reqs]
    for i in range(len(reqs) - 1, -1, -1):
        nextuse[i] = [nxt.get(x, inf) for x in reqs[i]]
        for x in reqs[i]:
            nxt[x] = i
    c: dict[int, tuple[int, int]] = {}
    heap: list[tuple[int, int, int]] = []
    hit = tot = 0
    for i, req in enumerate(reqs):
        hit += _prefix(req, c)
        tot += len(req)
        for pos, (x, nu) in enumerate(zip(req, nextuse[i], strict=True)):
            c[x] = (nu, pos)
            heapq.heappush(heap, (-nu, -pos, x))
        while len(c) > cap:
            nu, pos, x = heapq.heappop(heap)
            if c.get(x) == (-nu, -pos):
                del c[x]
    return hit / tot


def lru_oracle(reqs: list[list[int]], cap: int, dead: bool) -> float:
    """A ceiling for a predictor, not a policy: one LRU of ``cap`` blocks that never admits a
    block with no later use (perfect admission) and, with ``dead``, also drops a held block
    at its last use (perfect dead-block prediction). Each request's blocks are stored tail
    first, so a chain's head is the most recent."""
    last: dict[int, int] = {}
    for i, req in enumerate(reqs):
        for x in req:
            last[x] = i
    c: OrderedDict[int, None] = OrderedDict()
    hit = tot = 0
    for i, req in enumerate(reqs):
        hit += _prefix(req, c)
        tot += len(req)
        for x in reversed(req):
            if last[x] == i:  # no later use
                if dead:
                    c.pop(x, None)
                elif x in c:
                    c.move_to_end(x)
            elif x in c:
                c.move_to_end(x)
            else:
                c[x] = None
                if len(c) > cap:
                    c.popitem(last=False)
    return hit / tot


def unbounded(reqs: list[list[int]]) -> float:
    seen: set[int] = set()
    hit = tot = 0
    for req in reqs:
        hit += _prefix(req, seen)
        tot += len(req)
        seen.update(req)
    return hit / tot


# ---------------------------------------------------------------------- the replay
def block_bytes(ids: np.ndarray, nbytes: int) -> np.ndarray:
    """Rows of ``nbytes`` bytes, a function of each id (its first 8 bytes are the id)."""
    ids = np.asarray(ids, dtype=np.uint64)
    out = (np.arange(nbytes, dtype=np.uint64)[None, :] * 131 + ids[:, None] * 7919) % 251
    out = out.astype(np.uint8)
    out[:, :8] = ids.view(np.uint8).reshape(-1, 8)
    return out


def key_of(x: int) -> bytes:
    return b"trace/%d" % x


class Engine:
    """One node's engine: lookup, get (every byte checked), put and wait for it."""

    def __init__(
        self, namespace: str, nbytes: int, segment_bytes: int, second_read: bool = True
    ) -> None:
        import kvray

        # A put larger than the by-value limit goes in pieces this large (by value, when they
        # fit a call); each pool keeps them as segments of its own segment_bytes.
        cfg = kvray.KVRayConfig(namespace=namespace, segment_bytes=segment_bytes)
        self.store = kvray.connect(namespace, cfg)
        self.nbytes = nbytes
        if not second_read:  # before issue 35's second reads, for comparison in the same run
            self.store._second_try = lambda *args: None  # type: ignore[method-assign]

    def ready(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def run(self, reqs: list[list[int]]) -> dict[str, Any]:
        t = {"lookup": [], "get": [], "put": [], "put_submit": [], "total": []}
        hits = blocks = wrong = lost = 0
        hits_per_req: list[int] = []
        t_start = time.perf_counter()
        for req in reqs:
            t0 = time.perf_counter()
            keys = [key_of(x) for x in req]
            n = self.store.lookup(keys)
            t1 = time.perf_counter()
            got, n_read = self._read(keys[:n])
            lost += n - n_read
            n = n_read
            if n:
                want = block_bytes(np.array(req[:n], dtype=np.uint64), self.nbytes)
                pairs = zip(got, want, strict=True)
                wrong += int(sum(int(np.count_nonzero(g != w)) for g, w in pairs))
            t2 = time.perf_counter()
            rest = np.array(req[n:], dtype=np.uint64)
            if rest.size:
                fut = self.store.put(keys[n:], block_bytes(rest, self.nbytes))
                t3 = time.perf_counter()
                fut.result(timeout=60)
            else:
                t3 = t2
            t4 = time.perf_counter()
            hits += n
            blocks += len(req)
            hits_per_req.append(n)
            t["lookup"].append(t1 - t0)
            t["get"].append(t2 - t1)
            t["put_submit"].append(t3 - t2)
            t["put"].append(t4 - t2)
            t["total"].append(t4 - t0)
        wall = time.perf_counter() - t_start
        return {
            "hits": hits,
            "blocks": blocks,
            "wrong": wrong,
            "lost": lost,
            "wall": wall,
            "times": t,
            "hits_per_req": hits_per_req,
        }

    def _read(self, keys: list[bytes]) -> tuple[list[np.ndarray], int]:
        """The blocks of the longest prefix of ``keys`` that reads back (as a connector loads
        what it can and recomputes the rest): a block the view still showed but its pool had
        evicted meanwhile ends the hit there, not at 0."""
        from kvray.errors import BlockLostError

        while keys:
            try:
                return self.store.get(keys), len(keys)
            except BlockLostError as e:
                gone = set(e.keys)
                keys = keys[: next(i for i, k in enumerate(keys) if k in gone)]
        return [], 0

    def prefix(self, req: list[int]) -> int:
        return self.store.lookup([key_of(x) for x in req])

    def sync(self) -> None:
        self.store.sync(10.0)

    def stats(self) -> dict[str, Any]:
        return self.store.stats()


def replay(
    reqs: list[list[int]], a: argparse.Namespace, policy: str, cap_blocks: int
) -> dict[str, Any]:
    """Start a fresh namespace on the cluster, replay, return the figures."""
    import ray

    import kvray

    ns = f"trace-{uuid.uuid4().hex[:8]}"
    per_node = cap_blocks // a.nodes
    kvray.start(
        namespace=ns,
        capacity=per_node * a.block_bytes,
        eviction_policy=policy,
        segment_bytes=a.segment_blocks * a.block_bytes,
    )
    engine_cls = ray.remote(num_cpus=0)(Engine)
    engines = [
        engine_cls.options(resources={f"sim_node_{i}": 0.01}).remote(
            ns,
            a.block_bytes,
            max(INLINE_BYTES, a.segment_blocks * a.block_bytes),
            not a.no_second_read,
        )
        for i in range(a.nodes)
    ]
    node_ids = ray.get([e.ready.remote() for e in engines], timeout=120)
    router = kvray.connect(ns) if a.routing == "view" else None
    results: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    try:
        if a.concurrent and a.window <= 0:  # each engine its whole share, at its own pace
            shares: list[list[list[int]]] = [[] for _ in engines]
            for i, req in enumerate(reqs):
                shares[i % a.nodes].append(req)
            calls = [e.run.remote(s) for e, s in zip(engines, shares, strict=True)]
            results = ray.get(calls, timeout=3600)
        elif a.concurrent:
            # In trace order, ``window`` rounds at a time: the engines work at once, never
            # more than a window apart (unpaced, a faster engine runs hundreds of requests
            # ahead by the end, and a conversation's next turn can come before its last).
            step = a.nodes * a.window
            for start in range(0, len(reqs), step):
                shares = [reqs[start + i : start + step : a.nodes] for i in range(a.nodes)]
                calls = [e.run.remote(s) for e, s in zip(engines, shares, strict=True) if s]
                results.extend(ray.get(calls, timeout=600))
        else:
            for i, req in enumerate(reqs):
                node = i % a.nodes
                if router is not None:
                    by_node = router.prefix_by_node([key_of(x) for x in req])
                    best = max(by_node.values(), default=0)
                    if best > 0:
                        node = next(j for j, n in enumerate(node_ids) if by_node.get(n) == best)
                results.append(ray.get(engines[node].run.remote([req]), timeout=120))
        wall = time.perf_counter() - t0
        every = ray.get([e.stats.remote() for e in engines], timeout=60)
        stats = every[0]
        second = {
            k: sum(x["client"].get(k, 0) for x in every) for k in ("second_reads", "second_hits")
        }
    finally:
        if router is not None:
            router.close()
        for e in engines:
            ray.kill(e)
        kvray.stop(ns)
    times: dict[str, list[float]] = {}
    for r in results:
        for k, v in r["times"].items():
            times.setdefault(k, []).extend(v)
    hits = sum(r["hits"] for r in results)
    blocks = sum(r["blocks"] for r in results)
    return {
        "hit_rate": hits / blocks,
        "wrong": sum(r["wrong"] for r in results),
        "lost": sum(r["lost"] for r in results),
        "req_per_s": len(reqs) / wall,
        "ms": {k: 1000 * statistics.mean(v) for k, v in times.items()},
        "stats": stats,
        "second": second,
    }


def start_cluster(a: argparse.Namespace) -> Any:
    import ray
    from ray.cluster_utils import Cluster

    store = max(80 << 20, int(2.5 * (a.max_cap_blocks // a.nodes) * a.block_bytes))
    args = {"num_cpus": 1, "object_store_memory": store, "include_dashboard": False}
    cluster = Cluster(initialize_head=True, head_node_args={**args, "resources": {"sim_node_0": 1}})
    for i in range(1, a.nodes):
        cluster.add_node(**args, resources={f"sim_node_{i}": 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="kvray-bench", log_to_driver=False)
    return cluster


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--trace", default="/work/shared/data/mooncake_synthetic_trace.jsonl")
    p.add_argument("--requests", type=int, default=0, help="first N requests (0: all)")
    p.add_argument("--split", choices=("all", "first", "second"), default="all",
                   help="the whole trace or one half of it")  # fmt: skip
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--block-bytes", type=int, default=4096)
    p.add_argument("--capacities", default="5860,20000",
                   help="total capacities in blocks (tight, roomy)")  # fmt: skip
    p.add_argument("--policies", default="lru,aged")
    p.add_argument("--segment-blocks", type=int, default=8,
                   help="most blocks a segment (segment_bytes: this x block bytes)")  # fmt: skip
    p.add_argument("--routing", choices=("rr", "view"), default="rr")
    p.add_argument("--serial", dest="concurrent", action="store_false",
                   help="one engine at a time (default: the engines work at once)")  # fmt: skip
    p.add_argument(
        "--concurrent", dest="concurrent", action="store_true", help=argparse.SUPPRESS
    )  # the default; kept for old command lines
    p.add_argument("--window", type=int, default=8,
                   help="rounds of requests the engines work at once (0: unpaced)")  # fmt: skip
    p.set_defaults(concurrent=True)
    p.add_argument("--offline-only", action="store_true")
    p.add_argument("--no-second-read", action="store_true",
                   help="a lost read tries no other holder (as before)")  # fmt: skip
    p.add_argument("--home", action="store_true",
                   help="also simulate the pools with each put in its prefix's pool")  # fmt: skip
    p.add_argument("--own-ghosts", action="store_true",
                   help="also simulate the pools each with its own ghosts only")  # fmt: skip
    p.add_argument("--per-block", action="store_true",
                   help="also simulate each policy with one entry a block")  # fmt: skip
    p.add_argument("--ceilings", action="store_true",
                   help="also LRU with perfect admission / dead-block prediction")  # fmt: skip
    a = p.parse_args()
    reqs = load_trace(a.trace, a.requests)
    half = len(reqs) // 2
    reqs = {"all": reqs, "first": reqs[:half], "second": reqs[half:]}[a.split]
    caps = [int(c) for c in a.capacities.split(",")]
    policies = a.policies.split(",")
    a.max_cap_blocks = max(caps)
    nblocks = sum(len(r) for r in reqs)
    print(f"trace {a.trace} ({a.split}): {len(reqs)} requests, {nblocks} block references, "
          f"{len({x for r in reqs for x in r})} distinct; {a.nodes} nodes, "
          f"{a.block_bytes} B blocks, routing {a.routing}", flush=True)  # fmt: skip
    ub = unbounded(reqs)
    off: dict[int, dict[str, float]] = {}
    for cap in caps:
        row = {"unbounded": ub, "belady": belady(reqs, cap), "global_lru": global_lru(reqs, cap)}
        seg = a.segment_blocks
        for pol in policies:
            row[f"sim_{pol}"] = simulate(reqs, cap, pol, chunk=seg).hit_rate
            # As the replay runs the pools: the cluster's ghosts shared by the index shards.
            pools = simulate(reqs, cap, pol, nodes=a.nodes, shared_ghosts=True, chunk=seg)
            row[f"sim_{pol}_{a.nodes}pools"] = pools.hit_rate
            if a.own_ghosts:
                own = simulate(reqs, cap, pol, nodes=a.nodes, chunk=seg)
                row[f"sim_{pol}_{a.nodes}pools_own_ghosts"] = own.hit_rate
            if a.home:
                home = simulate(reqs, cap, pol, nodes=a.nodes, placement="home", chunk=seg)
                row[f"sim_{pol}_{a.nodes}pools_home"] = home.hit_rate
            if a.per_block:  # every block an entry: what the segment granularity costs
                row[f"sim_{pol}_blocks"] = simulate(reqs, cap, pol, per_block=True).hit_rate
        if a.ceilings:
            row["lru_oracle_admit"] = lru_oracle(reqs, cap, dead=False)
            row["lru_oracle_dead"] = lru_oracle(reqs, cap, dead=True)
        off[cap] = row
        print(f"offline  {cap:>6} blocks: " + "  ".join(f"{k} {v:.4f}" for k, v in row.items()),
              flush=True)  # fmt: skip
    ratio_pol = policies[-1]
    kv: dict[tuple[str, int], dict[str, Any]] = {}
    if not a.offline_only:
        cluster = start_cluster(a)
        try:
            for cap in caps:
                for pol in policies:
                    r = kv[pol, cap] = replay(reqs, a, pol, cap)
                    ms = r["ms"]
                    s = r["stats"].get("totals", {})  # summed over the pools
                    reasons = {k: v for k, v in s.items() if k.startswith("policy_")}
                    pools = [p for p in r["stats"].get("nodes", {}).values() if "error" not in p]
                    shards = [x for x in r["stats"]["index"]["shards"] if "error" not in x]
                    for k in ("multi_holder_blocks", "duplicate_segments"):  # copies at the end
                        reasons[f"index_{k}"] = sum(int(x.get(k, 0)) for x in shards)
                    # The pools' metadata (segments, id tables, the policy) a block of capacity.
                    reasons["pool_meta_bytes_per_block"] = round(s.get("meta_bytes", 0) / cap, 1)
                    for k in [k for k in reasons if k.endswith("_pct")]:  # a mean, not a sum
                        reasons[k] = round(reasons[k] / max(1, len(pools)))
                    print(
                        f"kvray    {cap:>6} blocks {pol:>9}: hit rate {r['hit_rate']:.4f} "
                        f"({r['hit_rate'] / off[cap]['global_lru']:.3f}x global LRU, "
                        f"{r['hit_rate'] / off[cap]['belady']:.3f}x Belady), "
                        f"{r['wrong']} wrong bytes, {r['lost']} lost "
                        f"(second reads {r['second']['second_reads']}, read there "
                        f"{r['second']['second_hits']}), "
                        f"{r['req_per_s']:.1f} req/s; per request ms: lookup {ms['lookup']:.2f} "
                        f"get {ms['get']:.2f} put {ms['put']:.2f} (submit "
                        f"{ms['put_submit']:.2f}) total {ms['total']:.2f}; evictions "
                        f"{s.get('evictions')} {reasons}",
                        flush=True,
                    )
        finally:
            import ray

            ray.shutdown()
            cluster.shutdown()
    tight, roomy = caps[0], caps[-1]

    def rate(cap: int) -> float:
        got = kv.get((ratio_pol, cap))
        return got["hit_rate"] if got else off[cap][f"sim_{ratio_pol}"]

    rps = kv[ratio_pol, tight]["req_per_s"] if (ratio_pol, tight) in kv else 0.0
    print(
        f"ratio kvray_over_lru_tight={rate(tight) / off[tight]['global_lru']:.3f} "
        f"kvray_over_lru_roomy={rate(roomy) / off[roomy]['global_lru']:.3f} "
        f"kvray_over_belady_tight={rate(tight) / off[tight]['belady']:.3f} "
        f"replay_req_per_s={rps:.1f}"
    )


if __name__ == "__main__":
    main()
