"""``kvray demo``: the README's main job, on an embedded local Ray cluster.

It builds a small random Llama on the spot (no download), starts kvray, and runs two vLLM
engines, each in its own Ray actor process. Round 1 sends prompts with long prefixes to engine A
(cold: computed, then saved to kvray); round 2 sends prompts that share those prefixes to
engine B, which has never seen them: they load from kvray instead of being recomputed.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import statistics
import tempfile
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

import kvray
from kvray.config import format_bytes

NAMESPACE = "demo"
BLOCK_SIZE = 32
VOCAB = 1024


def build_random_llama(path: str, *, target_mb: int = 60, seed: int = 0) -> str:
    """Write a random float32 Llama of about ``target_mb`` MB (head size 64) to ``path``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden = 512
    per_layer = 4 * hidden * hidden + 3 * hidden * (3 * hidden)  # attention + MLP weights
    layers = max(2, min(32, (target_mb << 20) // 4 // per_layer))
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=int(layers),
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.05)
    model.save_pretrained(path, safe_serialization=True)
    return path


@ray.remote
class DemoEngine:
    """One vLLM engine (in-process mode) with kvray on, inside its own Ray actor process."""

    def __init__(self, model: str, engine_args: dict[str, Any], extra_config: dict[str, Any]):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM
        from vllm.config import KVTransferConfig

        self._llm = LLM(
            model=model,
            distributed_executor_backend="uni",
            kv_transfer_config=KVTransferConfig(
                kv_connector="KVRayConnector",
                kv_connector_module_path="kvray.connector",
                kv_role="kv_both",
                kv_load_failure_policy="recompute",
                kv_connector_extra_config=extra_config,
            ),
            **engine_args,
        )

    def ready(self) -> bool:
        """Answers once the engine is built (the constructor has run)."""
        return True

    def sync(self) -> None:
        """Wait until this engine's view of kvray shows what was stored before the call (what
        another engine just saved reaches it through the index's change feed, a little later)."""
        self._llm.llm_engine.engine_core.engine_core.scheduler.connector.store.sync()

    def close(self) -> None:
        """Shut the engine down cleanly: the connector finishes the saves still in flight."""
        self._llm.llm_engine.engine_core.shutdown()

    def generate(self, prompt_token_ids: list[int], sampling: dict[str, Any]) -> dict[str, Any]:
        from vllm import SamplingParams, TokensPrompt

        t0 = time.perf_counter()
        (out,) = self._llm.generate(
            [TokensPrompt(prompt_token_ids=list(prompt_token_ids))],
            SamplingParams(**sampling),
            use_tqdm=False,
        )
        seconds = time.perf_counter() - t0
        return {
            "token_ids": list(out.outputs[0].token_ids),
            "num_cached_tokens": int(out.num_cached_tokens or 0),
            "seconds": seconds,
        }


@dataclass
class _Round:
    ttfts: list[float]
    cached: list[int]
    tokens: list[list[int]]


def run(
    console: Console,
    *,
    model_mb: int = 60,
    prompt_tokens: int = 1024,
    prompts: int = 4,
    store_only: bool = False,
    keep_dir: bool = False,
) -> None:
    """Run the demo end to end; leaves no process behind (the embedded cluster is shut down)."""
    workdir = tempfile.mkdtemp(prefix="kvray-demo-")
    progress = Progress(
        SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console
    )
    try:
        with progress:
            step = progress.add_task("starting an embedded Ray cluster", total=None)
            ctx = ray.init(
                address="local",
                num_cpus=max(2, os.cpu_count() or 2),
                include_dashboard=True,
                log_to_driver=False,
                namespace="kvray-demo",
            )
            dashboard = ctx.dashboard_url or "(dashboard unavailable)"
            progress.update(step, description="starting kvray")
            kvray.start(namespace=NAMESPACE, capacity="1GiB")
            if store_only:
                progress.update(step, description="storing and loading blocks")
                rows = _store_demo()
            else:
                rows = _vllm_demo(progress, step, workdir, model_mb, prompt_tokens, prompts)
            store = kvray.connect(NAMESPACE)
            stats = store.stats()
            store.close()
            progress.update(step, description="done", completed=1, total=1)
        table = Table(title="kvray demo", show_header=False)
        for name, value in rows:
            table.add_row(name, value)
        totals = stats["totals"]
        asked = totals.get("hits", 0) + totals.get("misses", 0)
        table.add_row(
            "pool hit rate",
            f"{100 * totals.get('hits', 0) / asked:.0f}% of {asked} blocks" if asked else "-",
        )
        table.add_row("bytes stored in kvray", format_bytes(totals.get("bytes", 0)))
        table.add_row("Ray dashboard", f"http://{dashboard}" if ctx.dashboard_url else dashboard)
        console.print(table)
    finally:
        with contextlib.suppress(Exception):
            kvray.stop(NAMESPACE)
        ray.shutdown()
        if keep_dir:
            console.print(f"model kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def _store_demo() -> list[tuple[str, str]]:
    store = kvray.connect(NAMESPACE)
    keys = [uuid.uuid4().bytes for _ in range(64)]
    blocks = [np.random.default_rng(i).integers(0, 255, 1 << 20, dtype=np.uint8) for i in range(64)]
    t0 = time.perf_counter()
    res = store.put(keys, blocks).result(timeout=60)
    t_put = time.perf_counter() - t0
    store.sync()
    t0 = time.perf_counter()
    got = store.get(keys)
    t_get = time.perf_counter() - t0
    same = all(np.array_equal(a, b) for a, b in zip(got, blocks, strict=True))
    store.close()
    return [
        ("blocks stored", f"{res.stored} x 1 MiB in {1e3 * t_put:.0f} ms"),
        ("blocks loaded", f"{len(got)} in {1e3 * t_get:.0f} ms, bytes equal: {same}"),
        ("prefix lookup", f"{store.lookup(keys)} of {len(keys)} keys"),
    ]


def _vllm_demo(
    progress: Progress,
    step: Any,
    workdir: str,
    model_mb: int,
    prompt_tokens: int,
    n: int,
) -> list[tuple[str, str]]:
    progress.update(step, description=f"building a random ~{model_mb} MB Llama")
    model = build_random_llama(os.path.join(workdir, "model"), target_mb=model_mb)
    rng = random.Random(0)
    prefixes = [[rng.randrange(3, VOCAB) for _ in range(prompt_tokens)] for _ in range(n)]
    round1 = [p + [rng.randrange(3, VOCAB) for _ in range(16)] for p in prefixes]
    round2 = [p + [rng.randrange(3, VOCAB) for _ in range(16)] for p in prefixes]
    max_len = prompt_tokens + 64
    engine_args = {
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "dtype": "float32",
        "block_size": BLOCK_SIZE,
        "kv_cache_memory_bytes": 256 << 20,
        "max_model_len": max_len,
        "max_num_batched_tokens": max_len,
        "seed": 0,
    }
    extra = {"namespace": NAMESPACE}
    # Both engines start at once, each in a process of its own (their start-ups overlap), and
    # both are up before round 1 is timed: B sees nothing of A but what A stores in kvray.
    progress.update(step, description="starting vLLM engines A and B (a process each)")
    a, b = (DemoEngine.options(num_cpus=1).remote(model, engine_args, extra) for _ in "ab")  # type: ignore[attr-defined]
    ray.get([a.ready.remote(), b.ready.remote()], timeout=600)
    progress.update(step, description="round 1 on engine A: prefixes computed")
    r1 = _round(a, round1)
    ray.get(a.close.remote(), timeout=120)
    ray.kill(a)
    ray.get(b.sync.remote(), timeout=60)
    progress.update(step, description="round 2 on engine B: prefixes load from kvray")
    r2 = _round(b, round2)
    ray.get(b.close.remote(), timeout=120)
    ray.kill(b)
    cold = statistics.median(r1.ttfts)
    warm = statistics.median(r2.ttfts)
    return [
        ("model", f"random Llama, {model_mb} MB, float32, block size {BLOCK_SIZE}"),
        ("prompts", f"{n} per round, {prompt_tokens}-token prefixes"),
        ("TTFT cold (engine A, computed)", f"{1e3 * cold:.0f} ms (median)"),
        ("TTFT warm (engine B, kvray hit)", f"{1e3 * warm:.0f} ms (median)"),
        ("speed-up", f"{cold / warm:.1f}x"),
        (
            "tokens loaded from kvray (round 2)",
            f"{sum(r2.cached):,} of {n * (prompt_tokens + 16):,}",
        ),
    ]


def _of(part: int, whole: int) -> str:
    return f"{part:,} of {whole:,}"


def _round(engine: Any, prompts: list[list[int]]) -> _Round:
    """One prompt at a time with one output token: the engine's time is the TTFT."""
    sampling = {"temperature": 0.0, "max_tokens": 1}
    results = [ray.get(engine.generate.remote(p, sampling), timeout=600) for p in prompts]
    return _Round(
        [r["seconds"] for r in results],
        [r["num_cached_tokens"] for r in results],
        [r["token_ids"] for r in results],
    )
