"""Benchmark: prefill/decode disaggregation with kvray as the KV transport (``build_app(pd="1:1")``,
``--pd P:D``) against the collocated kvray app with the same replica count, under a mixed load from
vLLM's ``bench serve`` (scripts/vllm_bench_serve.py): random prompts of mixed lengths (input
length +- ``--range-ratio``) arriving as a Poisson stream while earlier requests stream their
output, so long prefills land among decodes.

Each app runs on a simulated 2-node cluster (``ray.cluster_utils.Cluster``, one replica a
node, each node's vLLM on a core of its own with ``--bind``, as in bench_serve.py; P/D puts
the prefill replica on one node and the decode replica on the other). For each repeat, both
configurations take turns (order alternating), same seed within a repeat.

Measured per run, from vLLM's load generator: TTFT p50/p99, ITL p50/p99. From kvray's own
series at the nodes' metrics endpoints (P/D only; deltas over the run): the handoff time
(``kvray_handoff_latency_s``: the prefill's ``request_finished`` -> the decode engine's first
step over the request done, i.e. its first token sampled; p50 interpolated in its histogram
bucket, and the mean) and its first part (``kvray_handoff_arrival_s``: until the decode
engine's scheduler first sees the request: Ray Serve LLM's orchestrator hop and the decode's
step in progress; the rest is the load and the first step), the prompt tokens the decode
engine computed itself per handed-off request (``kvray_handoff_computed_tokens`` /
``kvray_handoffs``), and the load rate (bytes read from pools over the time of those gets,
``kvray_bytes_loaded`` / ``kvray_load_latency_s``), with what the target "handoff <= 50 ms +
the load time of a prompt's bytes at that rate" comes to.

    python scripts/bench_pd.py [--repeats 3] [--requests 16] [--rate 1.0] [--pd 1:2]

Last line: ``ratio pd_itl_p99_over_collocated=<x> handoff_ms_p50=<y>
decode_computed_tokens_per_request=<z>`` (medians over repeats).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_serve import (
    BLOCK_SIZE,
    KV_TOKENS,
    MODELS,
    ROOT,
    _load,
    _med,
    bench_engine_args,
    kv_bytes_per_token,
    start_cluster,
)

from kvray.testing.probe import metrics_lines

MODEL = "bench"
APP = "benchpd"
CONFIGS = ("collocated", "pd")
_SERIES = re.compile(r"^ray_(kvray_[a-z_]+)\{([^}]*)\}\s+([0-9.eE+-]+)$")


def _vllm_load(port: int, tokenizer: str, seed: int, a: argparse.Namespace, out: Path) -> list[str]:
    """vLLM's ``bench serve``: random prompts of mixed lengths, Poisson arrivals."""
    return [
        sys.executable, str(ROOT / "scripts" / "vllm_bench_serve.py"),
        "--base-url", f"http://127.0.0.1:{port}", "--model", MODEL, "--tokenizer", tokenizer,
        "--dataset-name", "random", "--num-prompts", str(a.requests),
        "--random-input-len", str(a.isl), "--random-output-len", str(a.osl),
        "--random-range-ratio", str(a.range_ratio), "--ignore-eos",
        "--request-rate", str(a.rate), "--max-concurrency", str(a.concurrency),
        "--seed", str(seed), "--percentile-metrics", "ttft,itl", "--metric-percentiles", "50,99",
        "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name,
    ]  # fmt: skip


def _scrape(urls: list[str], ns: str) -> dict[str, float]:
    """kvray's series of namespace ``ns`` summed over the nodes (histogram buckets keyed
    ``name{le}``)."""
    out: dict[str, float] = {}
    for line in metrics_lines(urls):
        m = _SERIES.match(line)
        if m is None or f'namespace="{ns}"' not in m.group(2):
            continue
        name = m.group(1)
        le = re.search(r'le="([^"]+)"', m.group(2))
        key = f"{name}{{{le.group(1)}}}" if le else name
        out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def _bucket_p50(delta: dict[str, float], name: str) -> float:
    """The median of a histogram's new observations, interpolated linearly in its bucket."""
    buckets = sorted(
        (float(k[len(name) + 1 : -1]), v)
        for k, v in delta.items()
        if k.startswith(name + "{") and k[len(name) + 1 : -1] != "+Inf"
    )
    total = delta.get(f"{name}{{+Inf}}", 0.0)
    if total <= 0:
        return float("nan")
    lo, below = 0.0, 0.0
    for le, cum in buckets:
        if cum >= total / 2:
            inside = cum - below
            return lo + (le - lo) * ((total / 2 - below) / inside if inside else 1.0)
        lo, below = le, cum
    return lo


def _kvray_figures(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    handoffs = d.get("kvray_handoffs_total", 0.0)
    n_lat = d.get("kvray_handoff_latency_s_count", 0.0)
    load_s = d.get("kvray_load_latency_s_sum", 0.0)
    loaded = d.get("kvray_bytes_loaded_total", 0.0)
    return {
        "handoffs": handoffs,
        "handoff_ms_p50": 1000 * _bucket_p50(d, "kvray_handoff_latency_s_bucket"),
        "arrival_ms_p50": 1000 * _bucket_p50(d, "kvray_handoff_arrival_s_bucket"),
        "handoff_ms_mean": 1000 * d.get("kvray_handoff_latency_s_sum", 0.0) / n_lat
        if n_lat
        else float("nan"),
        "computed_per_req": d.get("kvray_handoff_computed_tokens_total", 0.0) / handoffs
        if handoffs
        else float("nan"),
        "load_mib_s": loaded / load_s / (1 << 20) if load_s else float("nan"),
        "loaded_kib_per_handoff": loaded / handoffs / 1024 if handoffs else float("nan"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=16, help="requests per run")
    ap.add_argument("--isl", type=int, default=1024, help="mean input length (tokens)")
    ap.add_argument("--range-ratio", type=float, default=0.9, help="input length +- this share")
    ap.add_argument("--osl", type=int, default=48)
    ap.add_argument("--rate", type=float, default=1.0, help="requests per second (Poisson)")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--model", default="gqa", choices=sorted(MODELS))
    ap.add_argument("--bind", default=True, action=argparse.BooleanOptionalAction,
                    help="each simulated node's vLLM workers on a core of their own")  # fmt: skip
    ap.add_argument("--pd", default="1:1", help="prefill:decode replicas (collocated: their sum)")
    a = ap.parse_args()
    from kvray.config import ConfigError
    from kvray.serving.pd import parse_pd

    try:
        a.replicas = sum(parse_pd(a.pd))
    except ConfigError as e:
        ap.error(str(e))
    shape = MODELS[a.model]
    engine_args = bench_engine_args(shape, KV_TOKENS)

    import ray
    from ray import serve

    import kvray
    from kvray.serving import build_app
    from kvray.testing.engines import build_text_model

    work = Path(tempfile.mkdtemp(prefix="kvray-bench-pd-"))
    model = build_text_model(work / "model", **shape)
    cluster, urls, port = start_cluster(a)
    results: dict[str, list[dict[str, Any]]] = {c: [] for c in CONFIGS}
    try:
        for r in range(a.repeats):
            for cfg in CONFIGS if r % 2 == 0 else CONFIGS[::-1]:
                ns = f"benchpd{r}{cfg}"
                kvray.start(namespace=ns, capacity="256MiB")
                common: dict[str, Any] = {
                    "namespace": ns, "served_model_name": MODEL, "engine_args": engine_args,
                    "num_cpus": 2, "ingress_options": {"ray_actor_options": {"num_cpus": 0}},
                }  # fmt: skip
                app = (
                    build_app(model, pd=a.pd, **common)
                    if cfg == "pd"
                    else build_app(model, replicas=a.replicas, **common)
                )
                t0 = time.perf_counter()
                serve.run(app, name=APP, route_prefix="/")
                print(f"# repeat {r} {cfg}: app up in {time.perf_counter() - t0:.0f} s", flush=True)
                warm = argparse.Namespace(**{**vars(a), "requests": 2, "isl": 200, "rate": 10.0})
                warm_out = work / f"warm{r}{cfg}.json"
                _load(_vllm_load(port, model, 10_000 + r, warm, warm_out), warm_out)
                time.sleep(2.5)  # the warm-up's figures exported before the first scrape
                before = _scrape(urls, ns)
                out = work / f"r{r}{cfg}.json"
                res = _load(_vllm_load(port, model, 1 + r, a, out), out)["result"]
                time.sleep(3.0)  # one metrics report interval and a bit
                row = {
                    "requests": res["completed"],
                    "ttft_p50": res["median_ttft_ms"],
                    "ttft_p99": res["p99_ttft_ms"],
                    "itl_p50": res["median_itl_ms"],
                    "itl_p99": res["p99_itl_ms"],
                    "tok_s": res["output_throughput"],
                    **_kvray_figures(before, _scrape(urls, ns)),
                }
                results[cfg].append(row)
                print(f"#   {cfg}: {json.dumps({k: round(v, 2) for k, v in row.items()})}")
                serve.delete(APP)
                kvray.stop(ns)
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(work, ignore_errors=True)

    print(
        f"\nbench_pd: vLLM bench serve, random prompts {a.isl} +- {a.range_ratio:.0%} tokens, "
        f"output {a.osl}, {a.requests} requests at {a.rate}/s (Poisson), concurrency "
        f"{a.concurrency}; {a.replicas} replicas (P/D {a.pd} or collocated) on a simulated "
        "2-node cluster, "
        f"bind={a.bind}, model {a.model}, block {BLOCK_SIZE} tokens = "
        f"{BLOCK_SIZE * kv_bytes_per_token(shape) // 1024} KiB; medians of {a.repeats}"
    )
    print(
        f"{'config':<11} {'TTFT p50':>9} {'p99':>7} {'ITL p50':>8} {'p99':>6} {'tok/s':>6} "
        f"{'handoff p50':>11} {'mean':>6} {'arrival p50':>11} {'computed/req':>12} "
        f"{'load MiB/s':>10} {'KiB/handoff':>11}"
    )
    for cfg, rows in results.items():
        print(
            f"{cfg:<11} {_med(rows, 'ttft_p50'):>7.0f}ms {_med(rows, 'ttft_p99'):>5.0f}ms "
            f"{_med(rows, 'itl_p50'):>6.1f}ms {_med(rows, 'itl_p99'):>4.0f}ms "
            f"{_med(rows, 'tok_s'):>6.1f} {_med(rows, 'handoff_ms_p50'):>9.1f}ms "
            f"{_med(rows, 'handoff_ms_mean'):>4.0f}ms {_med(rows, 'arrival_ms_p50'):>9.1f}ms "
            f"{_med(rows, 'computed_per_req'):>12.1f} "
            f"{_med(rows, 'load_mib_s'):>10.1f} {_med(rows, 'loaded_kib_per_handoff'):>11.0f}"
        )
    pd, co = results["pd"], results["collocated"]
    rate = _med(pd, "load_mib_s")
    kib = _med(pd, "loaded_kib_per_handoff")
    print(
        f"handoff target: 50 ms + {kib:.0f} KiB at {rate:.1f} MiB/s = "
        f"{50 + 1000 * kib / 1024 / rate:.1f} ms (measured p50 {_med(pd, 'handoff_ms_p50'):.1f} ms)"
    )
    print(
        f"ratio pd_itl_p99_over_collocated={_med(pd, 'itl_p99') / _med(co, 'itl_p99'):.3f} "
        f"handoff_ms_p50={_med(pd, 'handoff_ms_p50'):.1f} "
        f"decode_computed_tokens_per_request={_med(pd, 'computed_per_req'):.1f}"
    )


if __name__ == "__main__":
    main()
