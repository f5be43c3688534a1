"""End-to-end tests of the kvray connector on real vLLM (CPU, tiny float32 Llama).

One plain engine computes the reference token ids of every prompt set once; one in-process
kvray engine (its own namespace) serves the module. Engines in other processes (a subprocess in
vLLM's default multiprocess mode, Ray actors pinned to simulated nodes) share that namespace.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")

import kvray
from kvray.client import Fetched, checksum
from kvray.testing.engines import (
    BLOCK_SIZE,
    build_tiny_llama,
    cached_tokens,
    close_llm,
    connector_of,
    engine_actor,
    engine_kwargs,
    finish_delayed_frees,
    full_hit_tokens,
    generate,
    in_process_engines,
    kvray_transfer_config,
    make_prompts,
    start_engine_process,
    token_ids,
    worker_connector_of,
)

pytestmark = [pytest.mark.vllm]

PROMPTS = {
    "share": make_prompts(3, 200, 40, seed=1),
    "used": make_prompts(1, 230, 20, seed=2),
    "loss": make_prompts(2, 200, 30, seed=3),
    "xnode": make_prompts(2, 170, 50, seed=4),
}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def in_process() -> Iterator[None]:
    with in_process_engines():
        yield


@pytest.fixture(scope="module")
def reference(tiny_model: str, in_process: None) -> dict[str, list[list[int]]]:
    """Greedy token ids of every prompt set from an engine without any connector."""
    from vllm import LLM

    llm = LLM(**engine_kwargs(tiny_model))
    try:
        return {name: token_ids(generate(llm, ps)) for name, ps in PROMPTS.items()}
    finally:
        close_llm(llm)


@pytest.fixture(scope="module")
def kv_engine(
    tiny_model: str, reference: dict[str, Any], ray_cluster: Any
) -> Iterator[tuple[Any, str]]:
    """An in-process kvray engine in a namespace of its own (auto-started by the connector)."""
    from vllm import LLM

    ns = f"e2e{uuid.uuid4().hex[:8]}"
    # the tests store a prompt at its first computation and load it at its second ("auto"
    # would not store it by this tiny model's costs)
    ktc = kvray_transfer_config(ns, capacity="128MiB", get_timeout_s=10, store_seen_only=False)
    llm = LLM(**engine_kwargs(tiny_model, kv_transfer_config=ktc))
    try:
        yield llm, ns
    finally:
        close_llm(llm)
        kvray.stop(ns)


@pytest.fixture(scope="module")
def default_mode_engine(
    kv_engine: tuple[Any, str], tiny_model: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    """An engine in another process, vLLM's default multiprocess mode, in the module's
    namespace: started with the module's first test (its ~20 s start, three processes
    importing vLLM, overlaps the module's tests) and given its prompts in the last."""
    _, ns = kv_engine
    proc = start_engine_process(tiny_model, tmp_path_factory.mktemp("default-mode"), namespace=ns)
    try:
        yield proc
    finally:
        proc.kill()


def _settle(llm: Any) -> None:
    """Wait until the engine's saves are stored and its scheduler's view shows them."""
    finish_delayed_frees(llm)
    worker_connector_of(llm).worker.flush()
    connector_of(llm).store.sync()


def test_tokens_identical_and_prefix_loaded(
    kv_engine: tuple[Any, str], reference: dict[str, Any], default_mode_engine: Any
) -> None:
    # (default_mode_engine: started here, read by the module's last test.)
    llm, _ = kv_engine
    prompts = PROMPTS["share"]
    first = generate(llm, prompts)
    assert token_ids(first) == reference["share"]
    _settle(llm)

    sched = connector_of(llm).scheduler
    hits_before = sched.hit_tokens
    finish_delayed_frees(llm)
    llm.reset_prefix_cache()
    second = generate(llm, prompts)
    assert token_ids(second) == reference["share"]
    # The first request can only have its prefix from kvray (vLLM's cache was reset).
    assert cached_tokens(second)[0] == full_hit_tokens(prompts[0])
    assert sched.hit_tokens - hits_before >= full_hit_tokens(prompts[0])


def test_loaded_kv_is_used_and_lost_blocks_recomputed(
    kv_engine: tuple[Any, str], reference: dict[str, Any]
) -> None:
    import numpy as np

    llm, _ = kv_engine
    prompts = PROMPTS["used"]
    assert token_ids(generate(llm, prompts)) == reference["used"]
    _settle(llm)
    worker = worker_connector_of(llm).worker
    store = worker.store
    real_fetch = store.fetch_from
    rng = np.random.default_rng(0)

    def different_bytes(*args: Any, keep_checksums: bool, **kw: Any) -> Fetched:
        """Random float32 KV in every loaded block, with checksums that match it (changed
        stored bytes) or the stored ones (corruption the checksum must catch)."""
        real = real_fetch(*args, **kw)
        arrays = [
            rng.standard_normal(a.nbytes // 4).astype(np.float32).view(np.uint8)
            for a in real.arrays
        ]
        reads = [
            dataclasses.replace(r, array=a, checksum=r.checksum if keep_checksums else checksum(a))
            for r, a in zip(real.reads, arrays, strict=True)
        ]
        return Fetched(real.keys, real.reason, reads, real.shard, real.pools)

    def lossy_fetch(*args: Any, **kw: Any) -> Fetched:
        real = real_fetch(*args, **kw)
        return Fetched(real.keys[:2], "evicted", real.reads[:2], real.shard, real.pools)

    full = full_hit_tokens(prompts[0])
    try:
        store.fetch_from = lambda *a, **k: different_bytes(*a, keep_checksums=False, **k)
        finish_delayed_frees(llm)
        assert llm.reset_prefix_cache()
        loads_before = _loaded_blocks(llm)
        changed = generate(llm, prompts)
        assert cached_tokens(changed)[0] == full
        assert _loaded_blocks(llm) - loads_before == full // BLOCK_SIZE
        assert token_ids(changed) != reference["used"], "loaded KV did not affect the output"

        store.fetch_from = lossy_fetch
        failed_before = _failed_blocks(llm)
        finish_delayed_frees(llm)
        assert llm.reset_prefix_cache()
        recomputed = generate(llm, prompts)
        # Two blocks came from kvray; the lost ones were recomputed by vLLM. (vLLM keeps
        # num_cached_tokens at the planned hit, so the failure shows in kvray's counters.)
        assert token_ids(recomputed) == reference["used"]
        assert _failed_blocks(llm) > failed_before

        # Last (the pool drops what fails verification): random bytes under the stored
        # checksums. Every block fails verification after it was scattered, is reported to
        # vLLM and recomputed: identical tokens.
        store.fetch_from = lambda *a, **k: different_bytes(*a, keep_checksums=True, **k)
        failed_before, loads_before = _failed_blocks(llm), _loaded_blocks(llm)
        finish_delayed_frees(llm)
        assert llm.reset_prefix_cache()
        assert token_ids(generate(llm, prompts)) == reference["used"]
        # (Blocks that failed above are skipped for a while, so fewer are tried here.)
        assert _failed_blocks(llm) > failed_before
        assert _loaded_blocks(llm) == loads_before, "a block that failed its checksum counted"
    finally:
        store.fetch_from = real_fetch


@pytest.mark.slow
def test_node_loss_between_store_and_load(
    kv_engine: tuple[Any, str], reference: dict[str, Any], tiny_model: str, ray_cluster: Any
) -> None:
    """Blocks stored on an extra node, which then dies: the loader finishes, identical tokens."""
    import ray

    llm, ns = kv_engine
    prompts = PROMPTS["loss"]
    node = ray_cluster.add_node(
        num_cpus=2, object_store_memory=256 << 20, resources={"kvray_loss_node": 1}
    )
    ray_cluster.wait_for_nodes()
    try:
        kvray.start(namespace=ns)  # idempotent: makes sure the lost node has its pool
        actor = engine_actor(resources={"kvray_loss_node": 1}).remote(tiny_model, ns)
        out = ray.get(actor.generate.remote(prompts), timeout=300)
        assert out["tokens"] == reference["loss"]
        ray.get(actor.flush.remote(), timeout=60)
        connector_of(llm).store.sync()
        sched = connector_of(llm).scheduler
        # The loader's view shows the whole prefix as a kvray hit, held only by the lost node.
        hashes = _block_hashes(prompts[0])
        assert len(hashes) == full_hit_tokens(prompts[0]) // BLOCK_SIZE
        assert sched._find_hit(hashes)[0] == len(hashes)
    finally:
        ray_cluster.remove_node(node)
    # Node C is gone, possibly before the index noticed: every request still finishes, with
    # the tokens of a full recompute.
    sched = connector_of(llm).scheduler
    hits_before, failed_before = sched.hit_tokens, _failed_blocks(llm)
    finish_delayed_frees(llm)
    llm.reset_prefix_cache()
    after = generate(llm, prompts)
    assert token_ids(after) == reference["loss"]
    # Either the view had already dropped the lost node (no hit planned) or the load failed and
    # vLLM recomputed: never a successful load of blocks that no longer exist.
    assert sched.hit_tokens == hits_before or _failed_blocks(llm) > failed_before


def _loaded_blocks(llm: Any) -> int:
    return (
        worker_connector_of(llm).worker.counters().loaded_blocks
        + connector_of(llm).scheduler.counters.loaded_blocks
    )


def _failed_blocks(llm: Any) -> int:
    return (
        worker_connector_of(llm).worker.counters().failed_blocks
        + connector_of(llm).scheduler.counters.failed_blocks
    )


def _block_hashes(prompt: list[int]) -> list[bytes]:
    import vllm.v1.core.kv_cache_utils as kcu
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash

    if kcu.NONE_HASH is None:
        init_none_hash(sha256)
    parent = kcu.NONE_HASH
    out = []
    for i in range(len(prompt) // BLOCK_SIZE):
        parent = hash_block_tokens(sha256, parent, prompt[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
        out.append(bytes(parent))
    return out


@pytest.mark.slow
def test_cross_node_engine_loads_blocks_stored_on_other_node(
    kv_engine: tuple[Any, str], reference: dict[str, Any], tiny_model: str
) -> None:
    """An engine on node A stores a prefix; the module's engine, on another node, loads it."""
    import ray

    llm, ns = kv_engine
    prompts = PROMPTS["xnode"]
    a = engine_actor(resources={"node_a": 1}).remote(tiny_model, ns)
    try:
        out_a = ray.get(a.generate.remote(prompts), timeout=300)
        assert out_a["tokens"] == reference["xnode"]
        ray.get(a.flush.remote(), timeout=60)
        node_a = ray.get(a.node_id.remote())
        ray.get(a.close.remote(), timeout=60)
    finally:
        ray.kill(a)

    store = connector_of(llm).store
    store.sync()
    assert store.stats()["nodes"][node_a]["blocks"] > 0, "engine A's blocks should live on node A"
    assert ray.get_runtime_context().get_node_id() != node_a
    finish_delayed_frees(llm)
    llm.reset_prefix_cache()
    out_b = generate(llm, prompts)
    assert token_ids(out_b) == reference["xnode"]
    # Only A computed these prompts: the prefix can only have come from node A's pool.
    assert cached_tokens(out_b)[0] == full_hit_tokens(prompts[0])


def test_a_fresh_engine_in_another_process_loads_the_prefix(
    kv_engine: tuple[Any, str], reference: dict[str, Any], default_mode_engine: Any
) -> None:
    """A fresh engine in another process, vLLM's default multiprocess mode (EngineCore and
    worker processes of its own), loads what the module's engine stored."""
    llm, _ = kv_engine
    prompts = PROMPTS["share"]
    assert token_ids(generate(llm, prompts)) == reference["share"]  # stored (again, if run alone)
    _settle(llm)
    (other,) = default_mode_engine.run(prompts)
    assert other["tokens"] == reference["share"]
    assert other["cached"][0] == full_hit_tokens(prompts[0])
