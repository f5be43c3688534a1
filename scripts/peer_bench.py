"""``bench_e2e.py --peers``: kvray against LMCache (multiprocess mode), TTFT of a hit.

Same model, engines and timing as ``bench_e2e.py`` (a fresh in-process engine per read, each
measurement ``generate(max_tokens=1)`` after ``reset_prefix_cache()``, the forward's connector
stall timed around ``start_load_kv`` / ``wait_for_layer_load``), on a simulated 2-node Ray
cluster (``ray.cluster_utils.Cluster``: the head is node A, node B has the custom resource
``peer_node_b``). Contenders:

- recompute and vllm-prefix-hit (a plain engine), example-hit (vLLM's ExampleConnector);
- kvray-hit: kvray (``capacity`` 1 GiB a pool, ``load_mode="sync"``), stored by an engine on
  node A, read by a fresh engine on node A;
- lmcache-hit: LMCache 0.5.6's ``LMCacheMPConnector`` with its server on node A (``lmcache
  server ... --l1-size-gb 1 --supported-transfer-mode auto --shm-name <name>``: the CPU
  engine's engine-driven transfer over a POSIX SHM segment, LMCache's fastest CPU path);
- kvray-node-b / lmcache-node-b / lmcache-p2p-node-b: the prefix stored by an engine on node
  A, read by a fresh engine in a Ray actor on node B. kvray: node B's engine fetches from node
  A's pool (Ray's object transfer between the raylets). LMCache, its two documented ways:
  lmcache-node-b, the shared server: the engine connects to node A's server over TCP
  (``lmcache.mp.host``/``port``); that server has no SHM segment (``--shm-name ""``), so the KV
  travels pickled over ZMQ TCP, which is what an engine on another host gets (SHM needs a
  shared ``/dev/shm``). lmcache-p2p-node-b, P2P: ``lmcache coordinator`` plus one server per
  node (``--coordinator-url``, ``--p2p-advertise-url``, ``--p2p-transfer-engine nixl``, NIXL's
  UCX backend with ``UCX_TLS=tcp``); node B's engine reads through its own server (SHM), which
  finds the chunks at node A's server and pulls them.

Read engines run in ``--rounds`` interleaved rounds, each ``--repeats`` times per prompt;
medians pool all rounds (a node-B server or raylet may keep what it pulled, so later repeats
can be local: the first read of each prompt by node B's first engine is printed too). Before
every measured request vLLM's own cache is reset until ``reset_prefix_cache()`` succeeds.
Last line: ``ratio lmcache_over_kvray_ttft_2048=<x> lmcache_over_kvray_ttft_8192=<y>
lmcache_over_kvray_cross_node=<z>`` (z: node-B reads at the longest prompt, LMCache's faster
cross-node setup). A contender that fails prints its exact error and ``n/a`` in the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import peers

SCRIPTS = Path(__file__).resolve().parent
ROOT = SCRIPTS.parent
NODE_B = "peer_node_b"
BLOCK = 32
CAPACITY_GB = 1


def _engine_actor_cls() -> Any:
    import ray

    @ray.remote(num_cpus=0, resources={NODE_B: 1})
    class NodeBEngine:
        """One bench engine (``bench_e2e._engine_run``) inside a Ray actor on node B."""

        def run(self, argv: list[str]) -> dict[str, Any]:
            import bench_e2e

            args = bench_e2e.parser().parse_args(["_engine", *argv])
            return bench_e2e._engine_run(args)

        def node_id(self) -> str:
            return ray.get_runtime_context().get_node_id()

    return NodeBEngine


def _run_node_b(argv: list[str], pythonpath: str) -> dict[str, Any]:
    import ray

    env = {"PYTHONPATH": pythonpath, "LMCACHE_DISABLE_BANNER": "1", "LMCACHE_TRACK_USAGE": "false"}
    actor = _engine_actor_cls().options(runtime_env={"env_vars": env}).remote()
    try:
        return ray.get(actor.run.remote(argv), timeout=1200)
    finally:
        ray.kill(actor)


def run_peers(args: argparse.Namespace) -> None:
    import bench_e2e as b
    import ray

    import kvray
    from kvray.testing.cluster import simulated_cluster
    from kvray.testing.engines import build_tiny_llama

    t_start = time.perf_counter()
    lengths = [512, 2048] if args.quick else [512, 2048, 8192]
    repeats = 3 if args.quick else args.repeats
    rounds = 1 if args.quick else args.rounds
    shape = {**b.MODEL_SHAPE, "max_pos": max(lengths) + 256}
    model = build_tiny_llama(os.path.join(args.model_dir, f"model-{shape['max_pos']}"), **shape)
    work = Path(tempfile.mkdtemp(prefix="kvray-bench-peers-"))
    pfile = work / "prompts.json"
    pfile.write_text(json.dumps(b._prompts(lengths, repeats)))
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    node = {"num_cpus": 2, "object_store_memory": 3 << 29, "include_dashboard": False}
    cluster = simulated_cluster(node, [{**node, "resources": {NODE_B: 1}}])
    paths = [str(ROOT), str(ROOT / "tests"), str(SCRIPTS)]
    env = {**os.environ, "RAY_ADDRESS": cluster.address, "PYTHONPATH": os.pathsep.join(paths)}
    lm_path = os.pathsep.join([*paths, str(peers.engine_path())])
    lm_env = {**env, **peers.engine_env(), "PYTHONPATH": lm_path}
    base = ["--model", model, "--prompts", str(pfile), "--repeats", str(repeats)]
    samples: dict[str, dict[str, list[float]]] = {}
    stalls: dict[str, dict[str, list[float]]] = {}
    hits: dict[str, dict[str, int]] = {}
    errors: dict[str, str] = {}
    retries: dict[str, int] = {}
    firsts: dict[str, dict[str, float]] = {}

    def record(
        label: str, out: dict[str, Any], times_key: str = "times", first: bool = False
    ) -> None:
        for n, v in out[times_key].items():
            samples.setdefault(label, {}).setdefault(n, []).extend(v)
            if first:
                firsts.setdefault(label, {})[n] = round(v[0], 4)
        for n, v in out.get("stall", {}).items():
            stalls.setdefault(label, {}).setdefault(n, []).extend(v)
        for n, v in out.get("cached", {}).items():
            hits.setdefault(label, {})[n] = min(hits.get(label, {}).get(n, 1 << 30), *v)
        retries[label] = retries.get(label, 0) + out.get("reset_retries", 0)

    def attempt(label: str, fn: Any, *a: Any, **kw: Any) -> Any:
        """Run one contender's step; on failure keep its exact error, measure the others."""
        if label in errors:
            return None
        try:
            return fn(*a, **kw)
        except Exception as e:
            lines = [ln for ln in f"{type(e).__name__}: {e}".splitlines() if ln.strip()]
            causes = [ln for ln in lines if "Error" in ln or "Exception" in ln]
            errors[label] = " | ".join(dict.fromkeys([lines[0][:600], *causes[-2:]]))
            traceback.print_exc()
            return None

    ns = f"benchpeers{os.getpid()}"
    procs: dict[str, peers.LMCacheProcess] = {}
    tag = f"kvray-bench-{os.getpid()}"
    try:
        plain = b._run_engine([*base, "--phase", "plain"], work / "plain.json", env)
        record("recompute", plain, "recompute")
        record("vllm-prefix-hit", plain, "vllm-prefix-hit")
        ex_args = [*base, "--connector", "example", "--storage", str(work / "example")]
        b._run_engine([*ex_args, "--phase", "write"], work / "ex-w.json", env)
        kvray.start(namespace=ns, capacity=f"{CAPACITY_GB}GiB")
        kv_args = [*base, "--connector", "kvray", "--namespace", ns, "--load-mode", "sync"]
        b._run_engine([*kv_args, "--phase", "write"], work / "kv-w.json", env)

        def lm_args(srv: peers.LMCacheServer) -> list[str]:
            return [*base, "--connector", "lmcache", "--lmcache-port", str(srv.port)]

        def server(name: str, **kw: Any) -> peers.LMCacheServer:
            srv = peers.LMCacheServer(CAPACITY_GB, log=work / f"lmcache-{name}.log", **kw)
            procs[name] = srv
            return srv

        def start_lmcache(name: str, **kw: Any) -> list[str]:
            """A server on node A and an engine on node A storing the prompts in it."""
            read = lm_args(server(name, **kw))
            b._run_engine([*read, "--phase", "write"], work / f"lm-w-{name}.json", lm_env)
            return read

        def start_p2p(r: int) -> list[str]:
            """LMCache P2P: a coordinator, a server per node; node A's engine stores in its
            server; node B's engine reads through its own server (SHM), which finds the
            chunks at node A's server (coordinator) and pulls them over NIXL. Started for
            each round's read and stopped after it: idle, each P2P server keeps ~0.55 of a
            core busy (measured with ps), which would slow every other contender here."""
            coord = peers.LMCacheCoordinator(work / f"lmcache-coordinator-{r}.log")
            procs[f"coordinator-{r}"] = coord
            p2p = {"coordinator": coord.url}
            a = server(f"p2p-a-{r}", shm_name=f"{tag}-a{r}", p2p_port=peers.free_port(), **p2p)
            srv_b = server(f"p2p-b-{r}", shm_name=f"{tag}-b{r}", p2p_port=peers.free_port(), **p2p)
            b._run_engine([*lm_args(a), "--phase", "write"], work / f"lm-w-p2p{r}.json", lm_env)
            time.sleep(5)  # peer discovery: 1 s heartbeats to the coordinator
            return lm_args(srv_b)

        def stop_p2p(r: int) -> None:
            for name in (f"p2p-a-{r}", f"p2p-b-{r}", f"coordinator-{r}"):
                if name in procs:
                    procs[name].stop()

        lm_shm = attempt("lmcache-hit", start_lmcache, "shm", shm_name=tag)
        lm_tcp = attempt("lmcache-node-b", start_lmcache, "tcp", shm_name="")
        for r in range(rounds):
            ex = b._run_engine([*ex_args, "--phase", "read"], work / f"ex-r{r}.json", env)
            record("example-hit", ex)
            kv = b._run_engine([*kv_args, "--phase", "read"], work / f"kv-r{r}.json", env)
            record("kvray-hit", kv)
            if lm_shm:
                out = work / f"lm-r{r}.json"
                lm = attempt(
                    "lmcache-hit", b._run_engine, [*lm_shm, "--phase", "read"], out, lm_env
                )
                if lm:
                    record("lmcache-hit", lm)
            kv = _run_node_b([*kv_args, "--phase", "read"], env["PYTHONPATH"])
            record("kvray-node-b", kv, first=r == 0)
            if lm_tcp:
                label = "lmcache-node-b"
                lm = attempt(label, _run_node_b, [*lm_tcp, "--phase", "read"], lm_path)
                if lm:
                    record(label, lm, first=r == 0)
            label = "lmcache-p2p-node-b"
            lm_p2p = attempt(label, start_p2p, r)
            if lm_p2p:
                lm = attempt(label, _run_node_b, [*lm_p2p, "--phase", "read"], lm_path)
                if lm:
                    record(label, lm, first=r == 0)
            stop_p2p(r)
    finally:
        for proc in procs.values():
            proc.stop()
        kvray.stop(ns)
        ray.shutdown()
        cluster.shutdown()
    print("# first read of each prompt by node B's first engine (s):", json.dumps(firsts))
    print("# reset_prefix_cache() retries (a connector still held blocks):", json.dumps(retries))
    _report(samples, stalls, hits, errors, lengths, repeats, rounds, shape, procs, t_start)


def _report(
    samples: dict[str, dict[str, list[float]]],
    stalls: dict[str, dict[str, list[float]]],
    hits: dict[str, dict[str, int]],
    errors: dict[str, str],
    lengths: list[int],
    repeats: int,
    rounds: int,
    shape: dict[str, Any],
    procs: dict[str, peers.LMCacheProcess],
    t_start: float,
) -> None:
    med = {k: {n: statistics.median(v) for n, v in d.items()} for k, d in samples.items()}
    stall_med = {
        k: {n: round(statistics.median(v) * 1e3, 1) for n, v in d.items()}
        for k, d in stalls.items()
    }
    print(
        f"# TTFT seconds, median of {repeats} x {rounds} interleaved rounds (model {shape}, "
        f"block {BLOCK}); lmcache {peers.LMCACHE_VERSION} MP mode, L1 {CAPACITY_GB} GiB, chunk 256"
    )
    print(f"{'tokens':>8} " + " ".join(f"{k:>15}" for k in med))
    for n in map(str, lengths):
        print(f"{n:>8} " + " ".join(f"{med[k].get(n, float('nan')):>15.4f}" for k in med))
    best = {k: {n: round(min(v), 4) for n, v in d.items()} for k, d in samples.items()}
    print("# TTFT minimum over all samples (the quietest moment of a shared box):")
    print("# " + json.dumps(best))
    print("# cached tokens (min over repeats):", json.dumps(hits))
    print("# connector stall in the forward pass, median ms:", json.dumps(stall_med))
    for name, proc in procs.items():
        print(f"# lmcache {name}: {' '.join(proc.cmd)}")
    for label, err in errors.items():
        print(f"# {label} FAILED: {err}")
    print(f"# wall time {time.perf_counter() - t_start:.0f} s")

    def ratio(lm: str, kv: str, n: str) -> str:
        if lm in errors and lm not in med:
            return "n/a(lmcache failed)"
        if n not in med.get(lm, {}) or n not in med.get(kv, {}):
            return "n/a(not measured)"
        return f"{med[lm][n] / med[kv][n]:.2f}"

    def cross(n: str) -> str:
        """LMCache's faster cross-node setup that ran (shared server over TCP, or P2P)."""
        ran = [
            k
            for k in ("lmcache-node-b", "lmcache-p2p-node-b")
            if n in med.get(k, {}) and hits.get(k, {}).get(n, 0) > 0  # a miss is no setup
        ]
        best = min(ran, key=lambda k: med[k][n]) if ran else "lmcache-node-b"
        return ratio(best, "kvray-node-b", n)

    for n in map(str, lengths):
        print(
            f"# {n} tokens: lmcache_over_kvray_ttft={ratio('lmcache-hit', 'kvray-hit', n)} "
            f"cross_node shared-server={ratio('lmcache-node-b', 'kvray-node-b', n)} "
            f"p2p={ratio('lmcache-p2p-node-b', 'kvray-node-b', n)}"
        )
    longest = str(max(lengths))
    print(
        f"ratio lmcache_over_kvray_ttft_2048={ratio('lmcache-hit', 'kvray-hit', '2048')} "
        f"lmcache_over_kvray_ttft_8192={ratio('lmcache-hit', 'kvray-hit', '8192')} "
        f"lmcache_over_kvray_cross_node={cross(longest)}"
    )


if __name__ == "__main__":
    sys.exit("run: python scripts/bench_e2e.py --peers [--quick]")
