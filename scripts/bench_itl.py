"""Where the inter-token latency goes (issue 32, item 4): kvray's per-step cost or replicas
sharing cores?

Under kvray's router the served ``kv-heavy`` deployment decoded at about twice the ITL of Ray
Serve LLM alone. Two explanations predict different things:

- **kvray's per-step cost** (the scheduler-side connector's metadata each step, the worker's
  saves of blocks that fill while decoding): then one engine decoding the same batch is slower
  with the connector than without it.
- **decodes spread over replicas that share the cores**: kvray's router spreads sessions over
  both replicas where Ray's prefix router keeps them together; two engines decoding at once on
  a 2-core box each run their own torch threads over the same cores. Then one engine is as fast
  with kvray as without, two concurrent engines on shared cores are slower per token, and two
  engines given one core each (``taskset`` and one torch thread) are not.

Each case runs fresh engine processes (in-process vLLM, the ``kv-heavy`` float32 Llama of
``bench_serve.py``), decoding ``--seqs`` requests of ``--isl`` distinct prompt tokens for
``--osl`` tokens; a step's time is (time to ``--osl`` tokens - time to 1 token) / (osl - 1), the
median of ``--repeats`` per engine, cases interleaved over ``--rounds``:

- ``one-off``: one engine, all the requests, no connector;
- ``one-kvray``: the same with kvray's connector (it stores what the prompts and the decode fill),
  with ``VLLM_CPU_NUM_OF_RESERVED_CPU`` as kvray's Serve backend sets it (every case has it);
- ``one-nobind`` (not run unless named in ``--cases``): one engine, every core in threads, no
  binding;
- ``two-shared``: two engines at once, half the requests each, each with the default threads
  over every core (what two replicas on one node do);
- ``two-nobind``: the same, each engine with its share of the cores in threads
  (``OMP_NUM_THREADS``) and no binding (``VLLM_CPU_OMP_THREADS_BIND=nobind``): the OS places them;
- ``two-pinned``: the same, each engine bound to a core of its own (``taskset`` and
  ``VLLM_CPU_OMP_THREADS_BIND=<core>``).

Last line: ``ratio kvray_step_over_off=<a> two_shared_step_over_one=<b>
two_nobind_step_over_one=<c> two_pinned_step_over_one=<d>``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

CASES = ("one-off", "one-kvray", "two-shared", "two-nobind", "two-pinned")


def _engine(a: argparse.Namespace) -> None:
    """One engine in this process: waits for its peers (``--barrier``), then measures."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams, TokensPrompt

    from kvray.testing.engines import VOCAB, engine_kwargs, kvray_transfer_config

    ktc = kvray_transfer_config(a.namespace) if a.namespace else None
    llm = LLM(
        **engine_kwargs(
            a.model,
            kv_transfer_config=ktc,
            max_model_len=a.isl + a.osl + 32,
            kv_cache_bytes=256 << 20,
        )
    )
    rng = random.Random(a.seed)

    def batch() -> list[Any]:
        return [
            TokensPrompt(prompt_token_ids=[rng.randrange(3, VOCAB) for _ in range(a.isl)])
            for _ in range(a.seqs)
        ]

    def timed(max_tokens: int) -> float:
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate(batch(), sp, use_tqdm=False)  # fresh prompts: no prefix reuse
        return time.perf_counter() - t0

    timed(4)  # warm-up
    if a.barrier:
        Path(a.barrier, f"ready-{a.seed}").touch()
        deadline = time.monotonic() + 300
        while len(list(Path(a.barrier).glob("ready-*"))) < a.peers:
            if time.monotonic() > deadline:
                raise SystemExit("bench_itl: peers never became ready")
            time.sleep(0.05)
    steps = []
    for _ in range(a.repeats):
        first = timed(1)
        full = timed(a.osl)
        steps.append((full - first) / (a.osl - 1))
    Path(a.out).write_text(json.dumps({"steps": steps}))
    sys.stdout.flush()
    os._exit(0)  # skip vLLM's and Ray's teardown in this throwaway process


def _run_case(case: str, a: argparse.Namespace, ns: str, env: dict[str, str]) -> list[float]:
    """Start the case's engine processes at once; the median step of each."""
    work = Path(tempfile.mkdtemp(prefix="itl-"))
    n = 2 if case.startswith("two") else 1
    ncpu = os.cpu_count() or 1
    procs = []
    for k in range(n):
        out = work / f"out-{k}.json"
        cmd = [sys.executable, __file__, "_engine", "--model", a.model, "--out", str(out)]
        cmd += ["--isl", str(a.isl), "--osl", str(a.osl), "--repeats", str(a.repeats)]
        cmd += ["--seqs", str(a.seqs // n), "--seed", str(k), "--peers", str(n)]
        cmd += ["--barrier", str(work)]
        if case == "one-kvray":
            cmd += ["--namespace", ns]
        penv = dict(env)
        if case == "two-pinned":
            core = str(k % ncpu)
            cmd = ["taskset", "-c", core, *cmd]
            penv.update(VLLM_CPU_OMP_THREADS_BIND=core)
        elif case in ("two-nobind", "one-nobind"):
            penv.update(OMP_NUM_THREADS=str(max(1, ncpu // n)), VLLM_CPU_OMP_THREADS_BIND="nobind")
        procs.append((subprocess.Popen(cmd, env=penv, stderr=subprocess.PIPE, text=True), out))
    steps = []
    for p, out in procs:
        _, err = p.communicate(timeout=900)
        if p.returncode != 0 or not out.exists():
            raise RuntimeError(f"bench_itl: {case} engine failed ({p.returncode}):\n{err[-4000:]}")
        steps.append(statistics.median(json.loads(out.read_text())["steps"]))
    return steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("cmd", nargs="?", default="bench", choices=["bench", "_engine"])
    p.add_argument("--model", default="")
    p.add_argument("--preset", default="kv-heavy", help="a bench_serve.py model preset")
    p.add_argument("--isl", type=int, default=1500)
    p.add_argument("--osl", type=int, default=48)
    p.add_argument("--seqs", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--out", default="")
    p.add_argument("--namespace", default="")
    p.add_argument("--barrier", default="")
    p.add_argument("--peers", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    if a.cmd == "_engine":
        _engine(a)
        return
    from bench_serve import DTYPES, MODELS

    import kvray
    from kvray.serving.backend import RESERVED_CPU_ENV, cpu_reservation
    from kvray.testing.cluster import join_or_start
    from kvray.testing.engines import build_tiny_llama

    if a.preset in DTYPES:
        raise SystemExit(f"bench_itl: preset {a.preset} is not float32; use kv-heavy or gqa")
    if not a.model:
        a.model = build_tiny_llama(
            Path(tempfile.gettempdir()) / f"kvray-itl-{a.preset}", **MODELS[a.preset]
        )
    address = join_or_start(1 << 30)
    ns = f"itl{uuid.uuid4().hex[:6]}"
    kvray.start(namespace=ns, capacity="1GiB")
    env = {**os.environ, "RAY_ADDRESS": address}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    # What kvray's Serve backend sets (vLLM-CPU reserves a second core for any connector).
    env.setdefault(RESERVED_CPU_ENV, str(cpu_reservation({})))
    cases = a.cases.split(",")
    got: dict[str, list[float]] = {c: [] for c in cases}
    print(f"bench_itl: {a.preset}, {a.seqs} requests of {a.isl} tokens, {a.osl} decoded; "
          f"{os.cpu_count()} CPUs", flush=True)  # fmt: skip
    try:
        for r in range(a.rounds):
            for case in cases:
                steps = _run_case(case, a, ns, env)
                got[case].extend(steps)
                ms = ", ".join(f"{1000 * s:.1f}" for s in steps)
                print(f"round {r + 1} {case:>10}: step ms {ms}", flush=True)
    finally:
        with contextlib.suppress(Exception):
            kvray.stop(ns)
    med = {c: statistics.median(v) for c, v in got.items() if v}
    for c, v in med.items():
        print(f"median {c:>10}: {1000 * v:.2f} ms a step")

    def ratio(x: str, y: str) -> str:
        return f"{med[x] / med[y]:.3f}" if x in med and y in med else "nan"

    print(
        f"ratio kvray_step_over_off={ratio('one-kvray', 'one-off')} "
        f"two_shared_step_over_one={ratio('two-shared', 'one-off')} "
        f"two_nobind_step_over_one={ratio('two-nobind', 'one-off')} "
        f"two_pinned_step_over_one={ratio('two-pinned', 'one-off')}"
    )


if __name__ == "__main__":
    main()
