"""End-to-end TTFT benchmark: kvray vs recompute, vLLM's ExampleConnector and vLLM's own cache.

A mid-size random Llama (about 0.3B parameters, bf16, 16 layers, 8 KV heads of 64: 32 KiB of KV
per token) is built locally once. Every engine runs in its own Python process (in-process
vLLM inside it); each measurement is ``generate(max_tokens=1)`` on a token-id prompt, the median
of ``--repeats``:

- recompute: a plain engine, ``reset_prefix_cache()`` before every repeat;
- vllm-prefix-hit: the same engine, the prompt again without a reset;
- example-hit: ExampleConnector, a *fresh* engine in another process reading the files a
  first engine wrote (page cache warm), ``reset_prefix_cache()`` before every repeat;
- kvray-hit: the same with kvray (a fresh engine in another process loads what the first
  stored), for each ``load_mode``.

The read phases run in ``--rounds`` interleaved rounds (ExampleConnector, then each kvray mode,
again), each a fresh engine, so a slow minute on a shared machine hits every contender alike;
every median pools all rounds. Each read engine also reports its connector stall: the time the
forward pass spent inside ``start_load_kv`` and ``wait_for_layer_load`` (async loads stall in
neither: they cost an extra engine step instead).

The last line is ``ratio recompute_over_kvray=<x> example_over_kvray=<y>`` at 2048 tokens.

``--cross-tp`` runs only the reuse-across-TP-sizes part (issue 13): a TP=1 engine stores the
prompts; one TP=2 engine (``VLLM_CPU_OMP_THREADS_BIND=0|1``) then measures, interleaved per
repeat, a recompute at TP=2 (the prompt under a fresh ``cache_salt``: a miss, stored as 2
shards), a cross-TP hit (the unsalted prompt: each rank slices its heads out of the TP=1
block) and a same-TP hit (the salted prompt again: 2 shards, stored by itself). It also times
the scheduler's lookup (same-TP hit, cross-TP hit, miss) and, as the design check, the fetch of
one block stored as 1 shard vs as per-head shards and the pool metadata per stored shard. Its
last line is ``ratio cross_tp_hit_over_same_tp_hit=<x>`` at 2048 tokens (target <= 1.2).
``--peers`` runs only the comparison with LMCache (``scripts/peer_bench.py``, issue 21): TTFT
of a hit at 512 / 2048 / 8192 tokens, the same node and from a second simulated node; its last
line is ``ratio lmcache_over_kvray_ttft_2048=<x> lmcache_over_kvray_ttft_8192=<y>
lmcache_over_kvray_cross_node=<z>``.
Usage: ``python scripts/bench_e2e.py [--quick] [--cross-tp | --peers]`` (joins RAY_ADDRESS, or
starts a local Ray; ``--peers`` starts its own 2-node cluster).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

MODEL_SHAPE = dict(
    hidden=1024,
    layers=16,
    heads=16,
    kv_heads=8,
    head_dim=64,
    intermediate=4096,
    vocab=32000,
    max_pos=8192,
    dtype="bfloat16",
)
BLOCK = 32


def _prompts(lengths: list[int], repeats: int) -> dict[str, list[int]]:
    import random

    rng = random.Random(1234)
    return {str(n): [rng.randrange(3, MODEL_SHAPE["vocab"]) for _ in range(n)] for n in lengths}


# ---------------------------------------------------------------------------- engine process
def _llm(args: argparse.Namespace, longest: int, ktc: dict[str, Any] | None) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    return LLM(
        model=args.model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="bfloat16",
        block_size=BLOCK,
        kv_cache_memory_bytes=1 << 30,
        max_model_len=longest + 64,
        max_num_batched_tokens=longest + 64,
        max_num_seqs=4,
        distributed_executor_backend="uni" if args.tp == 1 else "mp",
        tensor_parallel_size=args.tp,
        seed=0,
        kv_transfer_config=KVTransferConfig(**ktc) if ktc else None,
    )


def _engine_main(args: argparse.Namespace) -> None:
    """One engine in this process; writes {mode: {length: [seconds...]}} and cached tokens."""
    result = _engine_run(args)
    Path(args.out).write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    # The results are written; skip interpreter teardown of vLLM + Ray in this throwaway
    # process (it occasionally exits non-zero there, which says nothing about the numbers).
    os._exit(0)


def _engine_run(args: argparse.Namespace) -> dict[str, Any]:
    """One in-process engine: the phase's measurements (also run inside a Ray actor)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import SamplingParams, TokensPrompt

    from kvray.testing.engines import kvray_transfer_config

    prompts: dict[str, list[int]] = json.loads(Path(args.prompts).read_text())
    ktc: dict[str, Any] | None = None
    if args.connector == "kvray":
        ktc = kvray_transfer_config(
            args.namespace, load_mode=args.load_mode, capacity="3GiB", staging_bytes="512MiB"
        )
    elif args.connector == "example":
        ktc = {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": args.storage},
        }
    elif args.connector == "lmcache":
        from peers import kv_transfer_config as lmcache_transfer_config

        ktc = lmcache_transfer_config(args.lmcache_port)
        if args.phase == "read":
            # A reader that does not store: with kv_both every finished request's blocks stay
            # held until a later step reports its save done, so reset_prefix_cache() never
            # succeeds between measurements (each step to free them leaves its own held).
            ktc["kv_role"] = "kv_consumer"
    longest = max(len(p) for p in prompts.values())
    guard = contextlib.nullcontext()
    if args.connector == "lmcache":
        from peers import in_process_engine_guard

        guard = in_process_engine_guard()
    with guard:
        llm = _llm(args, longest, ktc)
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def ttft(tokens: list[int], salt: str | None = None) -> tuple[float, int]:
        prompt = TokensPrompt(prompt_token_ids=tokens)
        if salt:
            prompt["cache_salt"] = salt
        t0 = time.perf_counter()
        (out,) = llm.generate([prompt], sp, use_tqdm=False)
        return time.perf_counter() - t0, int(out.num_cached_tokens or 0)

    retries = [0]

    def reset() -> None:
        """``reset_prefix_cache()`` until it succeeds, so a hit is never vLLM's own: it fails
        while a connector still holds a finished request's blocks (LMCache's save is reported
        done at a later engine step); one tiny step lets the connector free them."""
        for _ in range(100):
            if llm.reset_prefix_cache():
                return
            retries[0] += 1
            llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7])], sp, use_tqdm=False)
        raise RuntimeError("reset_prefix_cache() failed 100 times: blocks still held")

    ttft([5, 6, 7] * 40)  # warm-up: first-call costs are nobody's TTFT
    result: dict[str, Any] = {}
    if args.phase == "write":
        for tokens in prompts.values():
            ttft(tokens)
        if args.connector == "kvray":
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            get_kv_transfer_group().worker.flush()
    elif args.phase == "plain":
        rec: dict[str, list[float]] = {}
        hit: dict[str, list[float]] = {}
        for name, tokens in prompts.items():
            for _ in range(args.repeats):
                reset()
                rec.setdefault(name, []).append(ttft(tokens)[0])
                hit.setdefault(name, []).append(ttft(tokens)[0])
        result = {"recompute": rec, "vllm-prefix-hit": hit}
    elif args.phase == "cross":
        result = _cross_phase(llm, prompts, args.repeats, ttft)
    else:  # read: a fresh engine loading what another process stored
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        times: dict[str, list[float]] = {}
        cached: dict[str, list[int]] = {}
        stall: dict[str, list[float]] = {}
        stalled = [0.0]
        group = get_kv_transfer_group()
        for hook in ("start_load_kv", "wait_for_layer_load"):
            real = getattr(group, hook)

            def timed(*a: Any, _real: Any = real, **k: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return _real(*a, **k)
                finally:
                    stalled[0] += time.perf_counter() - t0

            setattr(group, hook, timed)
        for name, tokens in prompts.items():
            for _ in range(args.repeats):
                reset()
                stalled[0] = 0.0
                t, c = ttft(tokens)
                times.setdefault(name, []).append(t)
                cached.setdefault(name, []).append(c)
                stall.setdefault(name, []).append(stalled[0])
        result = {"times": times, "cached": cached, "stall": stall}
    result["reset_retries"] = retries[0]
    return result


def _flush_saves(_worker: Any) -> None:
    """``collective_rpc`` target: this rank's saves are in kvray."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    get_kv_transfer_group().worker.flush()


def _block_hashes(tokens: list[int], salt: str | None) -> list[bytes]:
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    req = Request(
        request_id="bench",
        prompt_token_ids=tokens,
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        cache_salt=salt,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )
    return [bytes(h) for h in req.block_hashes[: (len(tokens) - 1) // BLOCK]]


def _cross_phase(llm: Any, prompts: dict[str, list[int]], repeats: int, ttft: Any) -> dict:
    """TP=2: per repeat, recompute (a fresh salt), cross-TP hit, same-TP hit; then lookups."""
    from kvray.testing.engines import connector_of

    conn = connector_of(llm)
    times: dict[str, dict[str, list[float]]] = {}
    cached: dict[str, dict[str, list[int]]] = {}

    def measure(label: str, name: str, tokens: list[int], salt: str | None) -> None:
        llm.reset_prefix_cache()
        t, c = ttft(tokens, salt)
        times.setdefault(label, {}).setdefault(name, []).append(t)
        cached.setdefault(label, {}).setdefault(name, []).append(c)

    for r in range(repeats):
        for name, tokens in prompts.items():
            salt = f"bench-{os.getpid()}-{r}"
            measure("recompute-tp2", name, tokens, salt)
            llm.collective_rpc(_flush_saves)
            conn.store.sync()
            measure("cross-tp-hit", name, tokens, None)
            measure("same-tp-hit", name, tokens, salt)
    tokens = prompts[max(prompts, key=lambda k: len(prompts[k]))]
    manager = conn.manager
    lookups: dict[str, Any] = {}
    miss = [t + 1 for t in tokens]
    for label, hashes in (
        ("same-tp-hit", _block_hashes(tokens, f"bench-{os.getpid()}-0")),
        ("cross-tp-hit", _block_hashes(tokens, None)),
        ("miss", _block_hashes(miss, None)),
    ):
        found = manager.find(hashes)
        t0 = time.perf_counter()
        for _ in range(2000):
            manager.find(hashes)
        us = (time.perf_counter() - t0) / 2000 * 1e6
        lookups[label] = {"us": round(us, 1), "blocks": found[0], "grouping": found[1]}
    lookups["prompt_blocks"] = len(hashes)
    return {"times": times, "cached": cached, "lookups": lookups}


def _design_check(ns: str, blocks: int, block_nbytes: int, heads: int) -> dict[str, Any]:
    """One grouping per entry vs per-head shards: the fetch (lease + map) of ``blocks``
    stored as 1 shard vs as ``heads`` shards of a head each, and pool metadata per shard."""
    import numpy as np

    import kvray
    from kvray.meta.ids import key_ids

    store = kvray.connect(ns)
    rng = np.random.default_rng(0)
    rows = rng.integers(0, 256, (blocks, block_nbytes), dtype=np.uint8)

    def meta() -> tuple[int, int]:
        totals = store.stats()["totals"]
        return totals.get("meta_bytes", 0), totals.get("blocks", 0)

    m0, b0 = meta()
    one = [b"design-1-%d" % i for i in range(blocks)]
    store.io.put(one, key_ids(one), 0, 1, rows).result()
    m1, b1 = meta()
    per_head = [b"design-h-%d" % i for i in range(blocks)]
    part = block_nbytes // heads
    for s in range(heads):
        chunk = np.ascontiguousarray(rows[:, s * part : (s + 1) * part])
        store.io.put(per_head, key_ids(per_head), s, heads, chunk).result()
    m2, b2 = meta()
    store.sync()
    view = store.feed.view

    def fetch(keys: list[bytes], shards: int) -> float:
        ids = key_ids(keys)
        t0 = time.perf_counter()
        got = 0
        for s in range(shards):
            slots = view.slot_of(ids, view.locs(ids), s)
            got += len(store.fetch_from(keys, ids, s, slots, view.pool_names(), 30).keys)
        assert got == blocks * shards, "design check: blocks not readable"
        return time.perf_counter() - t0

    t1 = [fetch(one, 1) for _ in range(7)]
    th = [fetch(per_head, heads) for _ in range(7)]
    store.close()
    return {
        "fetch_ms_one_shard": round(statistics.median(t1) * 1e3, 2),
        "fetch_ms_per_head_shards": round(statistics.median(th) * 1e3, 2),
        "pool_meta_bytes_per_shard": round((m1 - m0) / max(1, b1 - b0), 1),
        "pool_meta_bytes_per_block_one_shard": round((m1 - m0) / blocks, 1),
        "pool_meta_bytes_per_block_per_head": round((m2 - m1) / blocks, 1),
        "shards_per_block_per_head": (b2 - b1) // blocks,
    }


def _cross_tp(args: argparse.Namespace, model: str, work: Path, env: dict[str, str]) -> None:
    """The reuse-across-TP-sizes part (``--cross-tp``); prints its table and ratio last."""
    import kvray

    t_start = time.perf_counter()
    lengths = [512, 2048] if args.quick else [512, 2048, 4096]
    repeats = 3 if args.quick else args.repeats
    pfile = work / "prompts.json"
    pfile.write_text(json.dumps(_prompts(lengths, repeats)))
    ns = f"benchxtp{os.getpid()}"
    kvray.start(namespace=ns, capacity="2GiB")
    base = ["--model", model, "--prompts", str(pfile), "--repeats", str(repeats)]
    kv_args = [*base, "--connector", "kvray", "--namespace", ns]
    try:
        _run_engine([*kv_args, "--phase", "write"], work / "xtp-w.json", env)  # TP=1 stores
        tp2_env = {**env, "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
        out = _run_engine([*kv_args, "--phase", "cross", "--tp", "2"], work / "xtp-r.json", tp2_env)
        kv_per_token = 2 * MODEL_SHAPE["layers"] * MODEL_SHAPE["kv_heads"] * 64 * 2
        design = _design_check(ns, 63, BLOCK * kv_per_token, MODEL_SHAPE["kv_heads"])
    finally:
        kvray.stop(ns)
    med = {k: {n: statistics.median(v) for n, v in d.items()} for k, d in out["times"].items()}
    hits = {k: {n: min(v) for n, v in d.items()} for k, d in out["cached"].items()}
    print(
        f"# TTFT seconds at TP=2 (VLLM_CPU_OMP_THREADS_BIND=0|1), median of {repeats}, "
        f"interleaved per repeat (model {MODEL_SHAPE}, block {BLOCK}); the TP=1 engine stored"
    )
    print(f"{'tokens':>8} " + " ".join(f"{k:>14}" for k in med))
    for n in map(str, lengths):
        print(f"{n:>8} " + " ".join(f"{med[k][n]:>14.4f}" for k in med))
    print("# cached tokens (min over repeats):", json.dumps(hits))
    print("# scheduler lookup, longest prompt (2000 calls):", json.dumps(out["lookups"]))
    print("# design check, 63 blocks of 1 MiB, 1 shard vs per-head shards:", json.dumps(design))
    print(f"# wall time {time.perf_counter() - t_start:.0f} s")
    for n in map(str, lengths):
        if n != "2048":
            ratio = med["cross-tp-hit"][n] / med["same-tp-hit"][n]
            print(f"# {n} tokens: cross_tp_hit_over_same_tp_hit={ratio:.3f}")
    x = med["cross-tp-hit"]["2048"] / med["same-tp-hit"]["2048"]
    print(f"ratio cross_tp_hit_over_same_tp_hit={x:.3f}")


def _run_engine(script_args: list[str], out: Path, env: dict[str, str]) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "_engine", "--out", str(out)]
    proc = subprocess.run(cmd + script_args, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"engine {script_args} failed:\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


# ---------------------------------------------------------------------------- driver
def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("cmd", nargs="?", default="bench", choices=["bench", "_engine"])
    ap.add_argument("--quick", action="store_true", help="512 and 2048 tokens, 3 repeats")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "kvray-bench"))
    ap.add_argument("--load-modes", default="sync,layerwise,async")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds of hit engines")
    ap.add_argument(
        "--cross-tp", action="store_true", help="only the reuse-across-TP-sizes part (TP=2)"
    )
    # engine-process arguments
    ap.add_argument("--out")
    ap.add_argument("--model")
    ap.add_argument("--prompts")
    ap.add_argument("--connector", choices=["none", "kvray", "example", "lmcache"], default="none")
    ap.add_argument("--phase", choices=["plain", "write", "read", "cross"], default="plain")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--namespace", default="bench")
    ap.add_argument("--load-mode", default="sync")
    ap.add_argument("--storage")
    ap.add_argument("--lmcache-port", type=int, default=0)
    ap.add_argument(
        "--peers", action="store_true", help="only the LMCache comparison (scripts/peer_bench.py)"
    )
    return ap


def main() -> None:
    args = parser().parse_args()
    if args.cmd == "_engine":
        _engine_main(args)
        return
    if args.peers:
        from peer_bench import run_peers

        run_peers(args)
        return

    t_start = time.perf_counter()
    lengths = [512, 2048] if args.quick else [512, 2048, 4096]
    repeats = 3 if args.quick else args.repeats
    from kvray.testing.engines import build_tiny_llama

    model = build_tiny_llama(os.path.join(args.model_dir, "model"), **MODEL_SHAPE)
    work = Path(tempfile.mkdtemp(prefix="kvray-bench-"))
    pfile = work / "prompts.json"
    pfile.write_text(json.dumps(_prompts(lengths, repeats)))

    import kvray
    from kvray.testing.cluster import join_or_start

    address = join_or_start(3 << 30)
    env = {**os.environ, "RAY_ADDRESS": address, "PYTHONPATH": str(ROOT)}
    if args.cross_tp:
        _cross_tp(args, model, work, env)
        return
    base = ["--model", model, "--prompts", str(pfile), "--repeats", str(repeats)]

    samples: dict[str, dict[str, list[float]]] = {}
    stalls: dict[str, dict[str, list[float]]] = {}
    hits: dict[str, dict[str, int]] = {}

    def record(label: str, out: dict[str, Any], times_key: str = "times") -> None:
        for n, v in out[times_key].items():
            samples.setdefault(label, {}).setdefault(n, []).extend(v)
        for n, v in out.get("stall", {}).items():
            stalls.setdefault(label, {}).setdefault(n, []).extend(v)
        for n, v in out.get("cached", {}).items():
            hits.setdefault(label, {})[n] = min(hits.get(label, {}).get(n, 1 << 30), *v)

    plain = _run_engine([*base, "--phase", "plain"], work / "plain.json", env)
    record("recompute", plain, "recompute")
    record("vllm-prefix-hit", plain, "vllm-prefix-hit")

    storage = work / "example"
    ex_args = [*base, "--connector", "example", "--storage", str(storage)]
    _run_engine([*ex_args, "--phase", "write"], work / "ex-w.json", env)
    modes = [m for m in args.load_modes.split(",") if m]
    ns = f"bench{os.getpid()}"
    kvray.start(namespace=ns, capacity="2GiB")
    kv_args = [*base, "--connector", "kvray", "--namespace", ns]
    try:
        # Keys do not depend on the load mode: one engine stores, every mode reads.
        _run_engine([*kv_args, "--phase", "write"], work / "kv-w.json", env)
        for r in range(args.rounds):
            ex = _run_engine([*ex_args, "--phase", "read"], work / f"ex-r{r}.json", env)
            record("example-hit", ex)
            for mode in modes:
                out = work / f"kv-r-{mode}{r}.json"
                kv = _run_engine([*kv_args, "--load-mode", mode, "--phase", "read"], out, env)
                record(f"kvray-hit-{mode}", kv)
    finally:
        kvray.stop(ns)
    results = {k: {n: statistics.median(v) for n, v in d.items()} for k, d in samples.items()}
    stall_med = {
        k: {n: round(statistics.median(v) * 1e3, 1) for n, v in d.items()}
        for k, d in stalls.items()
    }

    kv_labels = [k for k in results if k.startswith("kvray-hit-")]
    best = min(kv_labels, key=lambda k: results[k]["2048"])
    print(
        f"# TTFT seconds, median of {repeats} (hit paths: x {args.rounds} interleaved rounds)"
        f" (model {MODEL_SHAPE}, block {BLOCK})"
    )
    header = f"{'tokens':>8} " + " ".join(f"{k:>18}" for k in results)
    print(header)
    for n in map(str, lengths):
        print(f"{n:>8} " + " ".join(f"{results[k][n]:>18.4f}" for k in results))
    print("# cached tokens on hit paths (min over repeats):", json.dumps(hits))
    print("# connector stall in the forward pass, median ms:", json.dumps(stall_med))
    print(f"# fastest kvray load mode at 2048 tokens: {best.removeprefix('kvray-hit-')}")
    print(f"# wall time {time.perf_counter() - t_start:.0f} s")
    kv2048 = results[best]["2048"]
    x = results["recompute"]["2048"] / kv2048
    y = results["example-hit"]["2048"] / kv2048
    print(f"ratio recompute_over_kvray={x:.2f} example_over_kvray={y:.2f}")


if __name__ == "__main__":
    main()
