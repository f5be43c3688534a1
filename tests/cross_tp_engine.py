"""One kvray engine at any TP size in a fresh process, for tests/test_cross_tp.py.

``python cross_tp_engine.py --model M --namespace NS --tp 2 --steps steps.json --out out.json``
runs an engine (EngineCore in this process, TP workers in vLLM's worker processes) through
*steps*: ``{"prompts": [[token ids]...], "salt": str | null, "reset": bool}`` (``salt`` is
vLLM's ``cache_salt``: other block hashes, so the engine computes the prompt itself; ``reset``
waits for every rank's saves so far, then empties vLLM's prefix cache, so the step's hits can
only come from kvray). Every rank's connector records, by block hash, the bytes of its share of
each block it loaded and each block it stored (:func:`install_recorder`), read back with
``collective_rpc``.

The output: per step the token ids and cached tokens; the scheduler's hit figures and transfer
counters; per rank its heads, whether it writes, its counters and the recorded blocks.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
from pathlib import Path
from typing import Any

from kvray.testing.engines import StagedProcess, wait_for_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def install_recorder(handler: Any) -> dict[str, dict[str, bytes]]:
    """Wrap a :class:`kvray.connector.transfer.TransferHandler` so that it keeps the bytes of
    this rank's share of every block it loads (after the load) and stores (what it gathers),
    by block hash (hex), and ``put``: hash -> b"shard/nshards" of each shard it hands to a
    pool. Observation only: the wrapped calls run unchanged."""
    import torch

    rec: dict[str, dict[str, bytes]] = {"loaded": {}, "stored": {}, "put": {}}
    prefix_len = len(handler.key_space.prefix)

    def read(block_ids: list[int]) -> list[bytes]:
        out = torch.empty((len(block_ids), handler.block_nbytes), dtype=torch.uint8)
        handler.mover.gather(block_ids, out)
        return [bytes(row.numpy()) for row in out]

    real_loads, real_store = handler.submit_loads, handler.stores.submit

    def submit_loads(meta: Any) -> None:
        real_loads(meta)
        handler.finish_layers()
        for spec in meta.loads.values():
            for h, data in zip(spec.block_hashes, read(spec.block_ids), strict=True):
                rec["loaded"][h.hex()] = data

    def submit_store(job_id: int, spec: Any) -> None:
        for h, data in zip(spec.block_hashes, read(spec.block_ids), strict=True):
            rec["stored"][h.hex()] = data
        real_store(job_id, spec)

    io = handler.store.io
    real_put = io.put

    def put(keys: list[bytes], ids: Any, shard: int, nshards: int, *rest: Any, **kw: Any) -> Any:
        for k in keys:
            rec["put"][k[prefix_len:].hex()] = f"{shard}/{nshards}".encode()
        return real_put(keys, ids, shard, nshards, *rest, **kw)

    io.put = put
    handler.submit_loads, handler.stores.submit = submit_loads, submit_store
    handler.recorded = rec
    return rec


def _handler() -> Any:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group().worker.handler


def rank_install(_worker: Any) -> None:
    """``collective_rpc`` target: record on this worker."""
    install_recorder(_handler())


def rank_flush(_worker: Any) -> None:
    """``collective_rpc`` target: wait until this rank's saves are in their pools."""
    _handler().flush()


def rank_report(_worker: Any) -> dict[str, Any]:
    """``collective_rpc`` target: wait for this rank's saves; its figures and records."""
    import dataclasses

    h = _handler()
    h.flush()
    ks = h.key_space
    return {
        "rank": h.tp_rank,
        "heads": list(ks.heads_of(h.tp_rank)),
        "writes": ks.writes(h.tp_rank),
        "counters": dataclasses.asdict(h.counters()),
        "recorded": getattr(h, "recorded", {}),
    }


def encode(records: dict[str, dict[str, bytes]]) -> dict[str, dict[str, str]]:
    return {k: {h: base64.b64encode(v).decode() for h, v in d.items()} for k, d in records.items()}


def engine_tier_of(
    connector: Any, namespace: str, prompts: list[list[int]], timeout: float = 20.0
) -> dict:
    """What kvray's index says this engine's own KV cache holds, read as a router reads it
    (a store of its own, with the engine tier): the replicas reporting under this engine's key
    (one per engine, whatever its TP size) and, per prompt, the leading blocks held (waiting,
    bounded, until every prompt's full blocks are there). Also the engine tier's rows in the
    scheduler's own view (none: the connector's store leaves it out)."""
    import time

    import kvray
    from kvray.meta.ids import engine_ids
    from kvray.testing.engines import block_hashes

    reporter = connector.engine_reporter
    own = connector.store.local_view()
    out: dict[str, Any] = {"scheduler_view_rows": len(own.engine) + len(own.replicas)}
    if reporter is None:
        return {**out, "key": None, "replicas": 0, "prefix": []}
    want = [len(block_hashes(p)) for p in prompts]
    store = kvray.connect(namespace)
    try:
        deadline = time.monotonic() + timeout
        while True:
            view = store.local_view()
            mine = [info for info in view.replicas.values() if info.key == reporter.key]
            held = [view.engine_prefix(engine_ids(block_hashes(p))) for p in prompts]
            prefix = [h.get(reporter.key, (0, 0.0))[0] for h in held]
            if (mine and prefix == want) or time.monotonic() > deadline:
                return {**out, "key": reporter.key, "replicas": len(mine), "prefix": prefix}
            time.sleep(0.05)
    finally:
        store.close()


def decode(records: dict[str, dict[str, str]]) -> dict[str, dict[str, bytes]]:
    return {k: {h: base64.b64decode(v) for h, v in d.items()} for k, d in records.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--namespace", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--steps", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--wait-s", type=float, default=0.0, help="wait for --steps to appear")
    args = ap.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the scheduler's connector is here
    from vllm import LLM, SamplingParams, TokensPrompt

    from kvray.testing.engines import (
        connector_of,
        engine_kwargs,
        finish_delayed_frees,
        kvray_transfer_config,
    )

    # what one TP size computes once the other loads (stored at its first sighting)
    ktc = kvray_transfer_config(args.namespace, store_seen_only=False)
    kw = engine_kwargs(args.model, kv_transfer_config=ktc, tp=args.tp)
    if args.tp > 1:
        kw["distributed_executor_backend"] = "mp"
    llm = LLM(**kw)
    import cross_tp_engine as me  # by name, so that the workers import it (not __main__)

    llm.collective_rpc(me.rank_install)
    sched = connector_of(llm)
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    steps = []
    wait_for_file(Path(args.steps), args.wait_s)  # built; the test says when to go
    plan = json.loads(Path(args.steps).read_text())
    sched.store.sync()  # what the test stored while this engine was being built is in its view
    for step in plan:
        if step.get("reset"):  # the saves so far stored and seen, then vLLM's cache emptied
            finish_delayed_frees(llm)
            llm.collective_rpc(me.rank_flush)
            sched.store.sync()
            if not llm.reset_prefix_cache():
                raise RuntimeError("vLLM kept blocks through reset_prefix_cache")
        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in step["prompts"]]
        if step.get("salt"):
            for p in prompts:
                p["cache_salt"] = step["salt"]
        outs = llm.generate(prompts, sp, use_tqdm=False)
        steps.append(
            {
                "tokens": [list(o.outputs[0].token_ids) for o in outs],
                "cached": [int(o.num_cached_tokens or 0) for o in outs],
            }
        )
    ranks = llm.collective_rpc(me.rank_report)
    sched.store.sync()
    s = sched.scheduler
    last = plan[-1]
    engine_tier = engine_tier_of(sched, args.namespace, [] if last.get("salt") else last["prompts"])
    out = {
        "steps": steps,
        "hit_tokens": s.hit_tokens,
        "cross_tp_hit_tokens": s.cross_tp_hit_tokens,
        "loaded_blocks": s.counters.loaded_blocks,
        "failed_blocks": s.counters.failed_blocks,
        "engine_tier": engine_tier,
        "ranks": [{**r, "recorded": encode(r["recorded"])} for r in ranks],
    }
    Path(args.out).write_text(json.dumps(out))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip vLLM + Ray teardown in this throwaway process


class Started(StagedProcess):
    """The engine process, started (it builds its engine meanwhile) and waiting for its steps."""

    def run(self, steps: list[dict[str, Any]], timeout: float = 420.0) -> dict[str, Any]:
        """Give it its steps; its output, records decoded."""
        out = super().run(steps, timeout)
        for r in out["ranks"]:
            r["recorded"] = decode(r["recorded"])
        return out


def start(model: str, namespace: str, workdir: str | os.PathLike[str], *, tp: int = 1) -> Started:
    """Start the engine in a fresh process now (its start overlaps the caller's work); it runs
    the steps :meth:`Started.run` gives it."""
    import uuid

    wd = Path(workdir)
    tag = uuid.uuid4().hex[:8]
    sfile, ofile = wd / f"steps-{tag}.json", wd / f"out-{tag}.json"
    cmd = [sys.executable, os.path.abspath(__file__), "--model", model, "--namespace", namespace]
    cmd += ["--tp", str(tp), "--steps", str(sfile), "--out", str(ofile), "--wait-s", "600"]
    env = dict(os.environ)
    if tp == 2:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    return Started(cmd, env, sfile, ofile)


def run(
    model: str,
    namespace: str,
    steps: list[dict[str, Any]],
    workdir: str | os.PathLike[str],
    *,
    tp: int = 1,
    timeout: float = 420.0,
) -> dict[str, Any]:
    """Run the engine in a fresh process; its output, records decoded."""
    return start(model, namespace, workdir, tp=tp).run(steps, timeout=timeout)


if __name__ == "__main__":
    main()
