"""Benchmark: request routers for vLLM + kvray on Ray Serve LLM, on a multi-turn chat workload.

Several conversations run at once; each turn resends the whole conversation (a growing shared
prefix), and there are more conversations than one replica's KV cache holds, so prefixes get
evicted from vLLM's own cache and come back from kvray or are recomputed. The same workload
(fresh conversations per run) goes to 2 replicas under each router: kvray's ``KVRayRouter``,
Ray's ``PrefixCacheAffinityRouter`` and Serve's default power of two choices. Reported per
router, medians of repeats: prefix hit rate (cached / prompt tokens), TTFT p50/p99 (time to
the first streamed content), throughput, requests per replica.

It starts its own local Ray cluster: a head and one more simulated node, one replica each.
On one host vLLM's EngineCore and worker processes join Ray attached to the head node, so both
replicas' saves land in the head node's pool (there, and only there, a load is node-local).

    python scripts/bench_serve.py [--quick]

Last line: ``ratio kvray_router_ttft_p50_over_prefix_router=<x> hit_rate=<y>`` (x < 1: kvray's
router is faster; y: kvray router's hit rate).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH")) if p
)

MODEL = "bench"
APP = "bench"
ROUTERS = ("kvray", "prefix", "pow2")
WORDS = [
    "def",
    "class",
    "return",
    "self",
    "import",
    "from",
    "yield",
    "async",
    "await",
    "lambda",
    "value",
    "index",
    "cache",
    "block",
    "token",
    "prefix",
    "node",
    "replica",
    "router",
    "engine",
    "tensor",
    "layer",
    "batch",
    "stream",
    "request",
    "key",
    "pool",
]


def _text(rng: random.Random, words: int) -> str:
    lines, line = [], []
    for _ in range(words):
        line.append(rng.choice(WORDS) + (str(rng.randrange(100)) if rng.random() < 0.3 else ""))
        if len(line) == 8:
            lines.append(" ".join(line))
            line = []
    return "\n".join([*lines, " ".join(line)])


def _conversation(
    client: Any, seed: int, turns: int, system_words: int, turn_words: int, max_tokens: int
) -> list[dict[str, float]]:
    rng = random.Random(seed)
    messages = [{"role": "system", "content": _text(rng, system_words)}]
    out = []
    for _ in range(turns):
        messages.append({"role": "user", "content": _text(rng, turn_words)})
        t0 = time.perf_counter()
        ttft = None
        reply, usage = [], None
        stream = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            if chunk.choices and chunk.choices[0].delta.content:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                reply.append(chunk.choices[0].delta.content)
        assert usage is not None and ttft is not None
        details = usage.prompt_tokens_details
        out.append(
            {
                "ttft": ttft,
                "prompt": usage.prompt_tokens,
                "cached": (details.cached_tokens or 0) if details else 0,
                "completion": usage.completion_tokens,
            }
        )
        messages.append({"role": "assistant", "content": "".join(reply)})
    return out


def _requests_per_replica() -> Counter[str]:
    """Serve's request counter of the LLM deployment, per replica, from every node."""
    import ray

    counts: Counter[str] = Counter()
    for node in ray.nodes():
        if not node.get("Alive") or not node.get("MetricsExportPort"):
            continue
        url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
        try:
            text = urllib.request.urlopen(url, timeout=5).read().decode()
        except OSError:
            continue
        for line in text.splitlines():
            if not line.startswith("ray_serve_deployment_request_counter_total{"):
                continue
            if f'deployment="LLMServer:{MODEL}"' not in line:
                continue
            labels = line[line.index("{") + 1 : line.index("}")]
            tags = dict(kv.split("=", 1) for kv in labels.split('",') if "=" in kv)
            counts[tags.get("replica", "?").strip('"')] += int(float(line.rsplit(" ", 1)[1]))
    return counts


def _run(client: Any, seed: int, a: argparse.Namespace) -> dict[str, Any]:
    before = _requests_per_replica()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(a.conversations) as pool:
        futures = [
            pool.submit(
                _conversation,
                client,
                seed * 1000 + c,
                a.turns,
                a.system_words,
                a.turn_words,
                a.max_tokens,
            )
            for c in range(a.conversations)
        ]
        rows = [r for f in futures for r in f.result(timeout=1800)]
    wall = time.perf_counter() - t0
    time.sleep(2.5)  # one metrics report interval and a bit
    per_replica = _requests_per_replica() - before
    ttfts = sorted(r["ttft"] for r in rows)
    return {
        "hit_rate": sum(r["cached"] for r in rows) / sum(r["prompt"] for r in rows),
        "p50": statistics.median(ttfts),
        "p99": ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))],
        "tok_s": sum(r["completion"] for r in rows) / wall,
        "req_s": len(rows) / wall,
        "per_replica": sorted(per_replica.values(), reverse=True),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small model and workload, 1 repeat")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--conversations", type=int, default=None)
    ap.add_argument("--turns", type=int, default=None)
    ap.add_argument("--routers", default=",".join(ROUTERS))
    a = ap.parse_args()
    quick = a.quick
    a.repeats = a.repeats or (1 if quick else 3)
    a.conversations = a.conversations or (4 if quick else 8)
    a.turns = a.turns or (3 if quick else 4)
    a.system_words = 150 if quick else 300
    a.turn_words = 40 if quick else 80
    a.max_tokens = 8 if quick else 16
    routers = [r for r in a.routers.split(",") if r]
    size = {} if quick else {"hidden": 512, "layers": 6, "heads": 8, "kv_heads": 4}
    # KV per token: layers x kv_heads x head_dim x 2 (K, V) x 4 bytes (float32).
    per_token = (2 * 2 if quick else 6 * 4) * 64 * 2 * 4
    kv_tokens = 2048  # one or two conversations' worth: fewer than the conversations
    engine_args = {
        "enforce_eager": True,
        "dtype": "float32",
        "block_size": 32,
        "kv_cache_memory_bytes": (kv_tokens + 64) * per_token,
        "max_model_len": kv_tokens,
        "max_num_seqs": 8,
        "max_num_batched_tokens": kv_tokens,
        "seed": 0,
        "enable_prompt_tokens_details": True,
    }

    import ray
    from openai import OpenAI
    from ray import serve
    from ray.cluster_utils import Cluster
    from vllm_helpers import build_text_model

    import kvray
    from kvray.serve import build_app

    work = tempfile.mkdtemp(prefix="kvray-bench-serve-")
    model = build_text_model(Path(work) / "model", **size)
    node_args = {"num_cpus": 2, "object_store_memory": 512 << 20, "include_dashboard": False}
    cluster = Cluster(
        initialize_head=True,
        head_node_args={**node_args, "_system_config": {"metrics_report_interval_ms": 1000}},
    )
    cluster.add_node(**node_args)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    os.environ["RAY_ADDRESS"] = cluster.address
    ns = "benchserve"
    kvray.start(namespace=ns, capacity="256MiB")
    port = 18000 + random.randrange(1000)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=600)
    results: dict[str, list[dict[str, Any]]] = {}
    try:
        for i, router in enumerate(routers):
            app = build_app(
                model,
                namespace=ns,
                replicas=2,
                served_model_name=MODEL,
                engine_args=engine_args,
                router=router,
                num_cpus=2,
                ingress_options={"ray_actor_options": {"num_cpus": 0}},
            )
            t0 = time.perf_counter()
            serve.run(app, name=APP, route_prefix="/")
            print(f"# {router}: app up in {time.perf_counter() - t0:.0f} s", flush=True)
            # Untimed: one short turn per conversation slot on unrelated text, so that first-
            # request costs (the first app of the cluster pays more) are nobody's TTFT.
            with ThreadPoolExecutor(a.conversations) as warm:
                list(
                    warm.map(
                        lambda seed: _conversation(client, seed, 1, 20, 10, 2),
                        [-1 - 1000 * i - c for c in range(a.conversations)],
                    )
                )
            results[router] = [_run(client, 100 * i + r + 1, a) for r in range(a.repeats)]
            serve.delete(APP)
    finally:
        serve.shutdown()
        kvray.stop(ns)
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(work, ignore_errors=True)

    def med(router: str, key: str) -> float:
        return statistics.median(r[key] for r in results[router])

    print(
        f"\nbench_serve ({'quick' if quick else 'full'}): {a.conversations} conversations x "
        f"{a.turns} turns at once, 2 replicas, KV cache {kv_tokens} tokens per replica, "
        f"medians of {a.repeats} run(s); shared 2-core machine"
    )
    print(
        f"{'router':<8} {'hit rate':>9} {'TTFT p50':>10} {'TTFT p99':>10} "
        f"{'tok/s':>7} {'req/s':>6}  requests per replica"
    )
    for router in results:
        per = results[router][len(results[router]) // 2]["per_replica"]
        print(
            f"{router:<8} {med(router, 'hit_rate'):>9.1%} {1e3 * med(router, 'p50'):>8.0f}ms "
            f"{1e3 * med(router, 'p99'):>8.0f}ms {med(router, 'tok_s'):>7.1f} "
            f"{med(router, 'req_s'):>6.2f}  {per}"
        )
    if "kvray" in results and "prefix" in results:
        ratio = med("kvray", "p50") / med("prefix", "p50")
        print(
            f"ratio kvray_router_ttft_p50_over_prefix_router={ratio:.3f} "
            f"hit_rate={med('kvray', 'hit_rate'):.3f}"
        )


if __name__ == "__main__":
    main()
