"""KVRayRouter's lookup cost and the engine tier's "event -> routable" lag, on a local Ray.

1. Routing overhead: for a 4,096-token token-id prompt and 16 replicas, the router's whole
   lookup (vLLM's block hashes, kvray keys, the view's CPU tiers per node, the engine tier per
   replica) plus the score of 16 candidates and its memory of what it routed where (every
   replica holding the whole prompt there: its slowest case), called from an asyncio loop
   through the router's own lookup thread (:class:`~kvray.serving.routeview.LookupLoop`), as
   Serve's loop would.
   Engines: 16 reporters, each holding ``--engine-blocks`` blocks plus part of the prompt.
2. Lag: an engine reports a new block (vLLM's ``BlockStored`` handed to the reporter, as the
   scheduler does every step) -> the block shows in this process's view (after the index
   shard, the change feed's long poll), while the other 15 engines churn ``--churn`` events/s
   each. Percentiles over ``--samples`` samples.
3. What the churn costs a process that does not route (a vLLM scheduler, whose connector opens
   its store with ``engine_view=False``) against one that keeps the engine tier: its feed's
   answers a second (each a long poll answered, an actor call, a wake-up) over 3 s of the
   churn, and its view's bytes.

Last lines: ``routing_overhead_ms p50=.. p99=..`` and ``event_to_routable_ms p50=.. p99=..``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import random
import threading
import time
import uuid

import numpy as np


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--replicas", type=int, default=16)
    ap.add_argument("--engine-blocks", type=int, default=20000)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--samples", type=int, default=300)
    ap.add_argument("--churn", type=int, default=200, help="events/s per other engine")
    args = ap.parse_args()

    import ray
    from vllm.distributed.kv_events import BlockStored

    import kvray
    from kvray.connector.reporter import EngineReporter
    from kvray.meta.ids import engine_ids
    from kvray.registry import KeySpaceInfo
    from kvray.serving.inflight import InFlight, Unsent
    from kvray.serving.prompts import BlockHasher
    from kvray.serving.routeview import LookupLoop, PromptTiers
    from kvray.serving.score import Candidate, Weights, pick

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    ns = f"br{uuid.uuid4().hex[:6]}"
    kvray.start(namespace=ns, capacity="256MiB")
    store = kvray.connect(ns)
    sched = kvray.connect(ns, engine_view=False)  # as a vLLM scheduler's connector opens it
    node = ray.get_runtime_context().get_node_id()
    hasher = BlockHasher(KeySpaceInfo("m", 32, "sha256", [b"bench-prefix"], node))
    rng = random.Random(0)
    tokens = [rng.randrange(3, 30000) for _ in range(args.tokens)]
    hashes = hasher.block_hashes(tokens)
    n = len(hashes)
    # CPU tier: half the prompt in this node's pool.
    (keys,) = hasher.keys_per_shard(hashes[: n // 2])
    store.put(keys, [np.zeros(256, np.uint8) for _ in keys]).result(timeout=60)
    # Engine tier: each replica holds filler blocks plus a share of the prompt's prefix.
    ints = [int.from_bytes(h, "big") & ((1 << 64) - 1) for h in hashes]
    reps = []
    for r in range(args.replicas):
        rep = EngineReporter(ns, store.num_index_shards, node, key=f"replica-{r}")
        filler = [rng.getrandbits(64) | 2 for _ in range(args.engine_blocks)]
        rep.observe(
            [BlockStored(filler + ints[: n * r // args.replicas], None, [], 32, None, "GPU", None)]
        )
        assert rep.flush()
        reps.append(rep)
    store.sync()
    deadline = time.monotonic() + 30
    while len(store.local_view().replicas) < args.replicas:
        assert time.monotonic() < deadline, "engines not in the view"
        time.sleep(0.05)
    view = store.local_view()
    print(
        f"view: {len(view.engine)} engine rows, {view.engine.nbytes / len(view.engine):.1f} B/row"
    )

    # ---------------------------------------------------------------- routing overhead
    loop_thread = LookupLoop("bench")
    w = Weights()
    names = [f"replica-{r}" for r in range(args.replicas)]
    inflight = InFlight(ttl_s=3600.0)
    unsent = Unsent()

    async def lookup() -> PromptTiers:
        return PromptTiers.of(store, hasher, tokens, None)

    async def route() -> float:
        t0 = time.perf_counter()
        tiers = await loop_thread.run(lookup())
        # As KVRayRouter.choose_replicas does on Serve's loop: what it sent where lately (the
        # same prompt every time: every replica soon holds all of it, the slowest case) and
        # the requests Serve has not counted yet.
        now = time.monotonic()
        routed = inflight.prefix(tiers.ids, now)
        cands = [
            Candidate(
                engine=max(tiers.engine.get(k, (0, 0.0))[0], routed.get(k, 0)),
                node_pool=tiers.by_node.get(node, 0),
                anywhere=tiers.anywhere,
                queue=rng.random() * 4 + unsent.pending(k, now),
            )
            for k in names
        ]
        order, _ = pick(names, tiers.total, cands, w)
        inflight.note(order[0], tiers.ids, now)
        unsent.chosen(order[0], now)
        ms = (time.perf_counter() - t0) * 1e3
        unsent.sent(order[0])  # Serve's part, after choose_replicas returns: not timed
        unsent.answered(order[0])
        return ms

    async def bench() -> list[float]:
        for _ in range(50):
            await route()
        return [await route() for _ in range(args.iters)]

    ms = asyncio.run(bench())
    tiers = PromptTiers.of(store, hasher, tokens, None)
    assert tiers.total == n and max(c for c, _ in tiers.engine.values()) >= n * 15 // 16 - 1

    # ---------------------------------------------------------------- event -> routable
    stop = threading.Event()

    def churn(rep: EngineReporter) -> None:
        r = random.Random(id(rep))
        while not stop.is_set():
            ids = [r.getrandbits(64) | 2 for _ in range(max(1, args.churn // 50))]
            rep.observe([BlockStored(ids, None, [], 32, None, "GPU", None)])
            time.sleep(0.02)

    for rep in reps[1:]:
        rep._thread.start()
        threading.Thread(target=churn, args=(rep,), daemon=True).start()
    probe = reps[0]
    probe._thread.start()
    lags: list[float] = []
    slot = next(s for s, i in view.replicas.items() if i.key == probe.key)
    bit = np.uint64(1) << np.uint64(slot)
    for i in range(args.samples):
        h = hashlib.sha256(f"lag/{i}".encode()).digest()
        bid = engine_ids([h])
        t0 = time.perf_counter()
        probe.observe(
            [
                BlockStored(
                    [int.from_bytes(h, "big") & ((1 << 64) - 1)], None, [], 32, None, "GPU", None
                )
            ]
        )
        while not (view.engine.masks(bid)[0] & bit):
            time.sleep(0.0002)
            assert time.perf_counter() - t0 < 10, "never routable"
        lags.append((time.perf_counter() - t0) * 1e3)
        time.sleep(rng.random() * 0.02)
    # ---------------------------------------------------------------- a scheduler's feed
    assert store.feed is not None and sched.feed is not None
    a0, b0, t0 = store.feed.answers, sched.feed.answers, time.monotonic()
    time.sleep(3.0)
    secs = time.monotonic() - t0
    with_rate = (store.feed.answers - a0) / secs
    without_rate = (sched.feed.answers - b0) / secs
    sv = sched.local_view()
    with_bytes, with_rows = view.nbytes, len(view.engine)
    without_bytes, without_rows = sv.nbytes, len(sv.engine)
    stop.set()
    for rep in reps:
        rep.close()
    sched.close()
    store.close()
    kvray.stop(ns)
    print(
        f"config tokens={args.tokens} blocks={n} replicas={args.replicas} "
        f"engine_blocks={args.engine_blocks} churn={args.churn}/s/engine"
    )
    print(
        f"feed answers/s with the engine tier {with_rate:.1f}, without {without_rate:.1f}; "
        f"view bytes with {with_bytes} ({with_rows} engine rows), without {without_bytes} "
        f"({without_rows})"
    )
    print(
        f"routing_overhead_ms p50={_pct(ms, 50):.3f} p99={_pct(ms, 99):.3f} "
        f"max={max(ms):.3f} (n={len(ms)})"
    )
    print(f"event_to_routable_ms p50={_pct(lags, 50):.2f} p99={_pct(lags, 99):.2f} (n={len(lags)})")


if __name__ == "__main__":
    main()
