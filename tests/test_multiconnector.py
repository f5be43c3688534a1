"""kvray as a child of vLLM's ``MultiConnector``, next to vLLM's ``ExampleConnector`` (real vLLM
on the CPU, tiny float32 Llama, one kvray namespace for the module).

``MultiConnector`` hands each child a copy of the engine's config whose ``kv_transfer_config``
is built from the child's entry alone: it carries vLLM's default ``kv_load_failure_policy``
(``"fail"``) whatever the engine's is. vLLM acts on the engine's top-level policy, so that is
the one kvray checks: a MultiConnector engine with ``"recompute"`` at the top starts, one with
``"fail"`` there is refused with one clear message. End to end: both connectors save, either
loads (kvray first, ExampleConnector when kvray lost the blocks), and a kvray load that fails
while the other connector has nothing is recomputed, with the tokens of a recompute every time.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from ray_fixtures import started_namespace

pytest.importorskip("vllm")

import numpy as np
import torch

from kvray.config import ConfigError
from kvray.testing.engines import (
    BLOCK_SIZE,
    block_hashes,
    build_tiny_llama,
    cached_tokens,
    close_llm,
    connector_of,
    engine_kwargs,
    finish_delayed_frees,
    generate,
    in_process_engines,
    kvray_transfer_config,
    make_prompts,
    token_ids,
    worker_connector_of,
)

pytestmark = [pytest.mark.vllm]

NUM_LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 64

NESTED_POLICY_MESSAGE = (
    "kvray config: invalid kv_load_failure_policy='fail': kvray is a cache whose blocks can be "
    "evicted or lost with their node between lookup and load, and this policy fails the "
    'request instead of recomputing it; set "kv_load_failure_policy": "recompute" in '
    '--kv-transfer-config at the top level, next to "kv_connector": "MultiConnector" (vLLM '
    "acts on the engine's policy, not on the entries of the connectors inside MultiConnector)"
)


def _prompts(seed: int) -> list[list[int]]:
    """Two prompts of 240 tokens with nothing in common (no prefix hit of one on the other)."""
    return [make_prompts(1, 200, 40, seed=seed + i)[0] for i in range(2)]


#: Tokens a complete hit of a 240-token prompt covers in either connector: 7 whole blocks.
FULL_HIT = (240 - 1) // BLOCK_SIZE * BLOCK_SIZE


def multi_transfer_config(
    namespace: str,
    storage: str | os.PathLike[str],
    *,
    policy: str | None = "recompute",
    kvray_policy: str | None = None,
    **kvray_extra: Any,
) -> dict[str, Any]:
    """A ``MultiConnector`` of kvray then ExampleConnector; ``policy`` is the engine's (top
    level), ``kvray_policy`` the one written in kvray's own entry (None: not written)."""
    # both connectors hold a prompt after its first computation ("auto" would leave it
    # unstored by this tiny model's costs)
    kvray_extra.setdefault("store_seen_only", False)
    child = kvray_transfer_config(namespace, **kvray_extra)
    del child["kv_load_failure_policy"]
    if kvray_policy is not None:
        child["kv_load_failure_policy"] = kvray_policy
    example = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(storage)},
    }
    ktc: dict[str, Any] = {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"connectors": [child, example]},
    }
    if policy is not None:
        ktc["kv_load_failure_policy"] = policy
    return ktc


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_llama(
        tmp_path_factory.mktemp("multi-model"), layers=NUM_LAYERS, kv_heads=KV_HEADS
    )


@pytest.fixture(scope="module")
def wide_ns(ray_cluster: Any) -> Iterator[str]:
    with started_namespace("mc", capacity="128MiB") as ns:
        yield ns


@pytest.fixture(scope="module")
def in_process() -> Iterator[None]:
    with in_process_engines():
        yield


# ------------------------------------------------------------------ start-up


def _vllm_config(model: str, ktc: dict[str, Any]) -> Any:
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig

    return VllmConfig(
        model_config=ModelConfig(model=model, dtype="float32", seed=0, skip_tokenizer_init=True),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(**ktc),
        device_config=DeviceConfig("cpu"),
    )


def _kv_cache_config() -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    layers = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.float32
    )
    return KVCacheConfig(
        num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, spec)]
    )


def _multi_connector(vllm_config: Any, role: str) -> Any:
    """vLLM's MultiConnector, built as vLLM's scheduler and workers build it."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    return KVConnectorFactory.create_connector(
        vllm_config, KVConnectorRole[role], _kv_cache_config()
    )


@pytest.mark.parametrize("role", ["SCHEDULER", "WORKER"])
@pytest.mark.parametrize(
    ("policy", "kvray_policy"),
    [("recompute", None), ("recompute", "fail")],
    ids=["kvray-entry-default", "kvray-entry-fail"],
)
def test_a_child_of_a_recomputing_engine_starts(
    tiny_model: str,
    wide_ns: str,
    tmp_path: Path,
    role: str,
    policy: str,
    kvray_policy: str | None,
) -> None:
    from kvray.connector import KVRayConnector

    ktc = multi_transfer_config(
        wide_ns, tmp_path, policy=policy, kvray_policy=kvray_policy, auto_start=False
    )
    vllm_config = _vllm_config(tiny_model, ktc)
    multi = _multi_connector(vllm_config, role)
    try:
        kv, example = multi.sub_connectors
        assert isinstance(kv, KVRayConnector) and type(example).__name__ == "ExampleConnector"
        # The copy of the config vLLM hands kvray says "fail"; the engine's, which vLLM acts
        # on, says "recompute".
        assert kv._kv_transfer_config.kv_load_failure_policy == "fail"
        assert vllm_config.kv_transfer_config.kv_load_failure_policy == "recompute"
        assert kv.config.namespace == wide_ns
        assert (kv.connector_scheduler is not None) == (role == "SCHEDULER")
    finally:
        multi.shutdown()


@pytest.mark.parametrize("role", ["SCHEDULER", "WORKER"])
@pytest.mark.parametrize(
    ("policy", "kvray_policy"),
    [(None, None), ("fail", "recompute")],
    ids=["engine-default", "engine-fail-kvray-entry-recompute"],
)
def test_a_child_of_a_failing_engine_is_refused(
    tiny_model: str, tmp_path: Path, role: str, policy: str | None, kvray_policy: str | None
) -> None:
    # Refused before Ray is touched: a namespace nobody started.
    ns = f"never{uuid.uuid4().hex[:6]}"
    ktc = multi_transfer_config(
        ns, tmp_path, policy=policy, kvray_policy=kvray_policy, auto_start=False
    )
    vllm_config = _vllm_config(tiny_model, ktc)
    assert vllm_config.kv_transfer_config.kv_load_failure_policy == "fail"
    with pytest.raises(ConfigError) as info:
        _multi_connector(vllm_config, role).shutdown()  # shut down only after a regression
    assert str(info.value) == NESTED_POLICY_MESSAGE
    assert info.value.field_name == "kv_load_failure_policy"


def test_an_engine_with_the_fail_policy_at_the_top_refuses_to_start(
    tiny_model: str, wide_ns: str, in_process: None, tmp_path: Path
) -> None:
    """The real engine (built before the module's engine: one in-process engine at a time)."""
    from vllm import LLM
    from vllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
    )

    ktc = multi_transfer_config(wide_ns, tmp_path, policy="fail", kvray_policy="recompute")
    llm = None
    try:
        with pytest.raises(ConfigError, match=re.escape(NESTED_POLICY_MESSAGE)):
            llm = LLM(**engine_kwargs(tiny_model, kv_transfer_config=ktc))
            generate(llm, [[5] * 40], max_tokens=2)  # reached only by a regression
    finally:
        if llm is not None:
            close_llm(llm)
        destroy_model_parallel()
        destroy_distributed_environment()


# ------------------------------------------------------------------ end to end


@dataclass
class MultiEngine:
    llm: Any
    ns: str
    storage: Path

    @property
    def kv(self) -> Any:
        """kvray's scheduler-role child."""
        return connector_of(self.llm).sub_connectors[0]

    @property
    def kv_worker(self) -> Any:
        """kvray's worker-role child (in-process, single rank)."""
        return worker_connector_of(self.llm).sub_connectors[0].worker

    def settle(self) -> None:
        """kvray's saves stored and visible to the scheduler."""
        finish_delayed_frees(self.llm)
        self.kv_worker.flush()
        self.kv.store.sync()

    def kvray_present(self, prompt: list[int]) -> int:
        """Leading blocks of ``prompt`` the scheduler sees in kvray."""
        hashes = block_hashes(prompt)[: FULL_HIT // BLOCK_SIZE]
        return int(self.kv.store.lookup(self.kv.key_space.block_keys(hashes)))

    def pool_hits(self) -> int:
        return int(self.kv.store.stats()["totals"]["hits"])

    def failed_blocks(self) -> int:
        return int(
            self.kv_worker.counters().failed_blocks + self.kv.scheduler.counters.failed_blocks
        )

    def example_folders(self) -> set[str]:
        return set(os.listdir(self.storage))

    def run(self, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
        """Generate with vLLM's own prefix cache emptied: what is not loaded is computed."""
        finish_delayed_frees(self.llm)
        assert self.llm.reset_prefix_cache()
        outs = generate(self.llm, prompts)
        return token_ids(outs), cached_tokens(outs)


@pytest.fixture(scope="module")
def engine(
    tiny_model: str, wide_ns: str, in_process: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[MultiEngine]:
    from vllm import LLM

    storage = tmp_path_factory.mktemp("example-connector")
    ktc = multi_transfer_config(wide_ns, storage, get_timeout_s=10)
    llm = LLM(**engine_kwargs(tiny_model, kv_transfer_config=ktc))
    try:
        yield MultiEngine(llm, wide_ns, storage)
    finally:
        close_llm(llm)


def _cold(engine: MultiEngine, prompts: list[list[int]]) -> tuple[list[list[int]], set[str]]:
    """A first run (nothing to load anywhere: computed), then both connectors' saves in place.
    Returns the tokens and ExampleConnector's new folders (one per prompt)."""
    before = engine.example_folders()
    tokens, cached = engine.run(prompts)
    assert cached == [0, 0], "not a cold run"
    engine.settle()
    assert [engine.kvray_present(p) for p in prompts] == [FULL_HIT // BLOCK_SIZE] * 2
    folders = engine.example_folders() - before
    assert len(folders) == len(prompts)
    for f in folders:
        files = sorted(os.listdir(engine.storage / f))
        assert files == [f"model.layers.{i}.self_attn.attn.safetensors" for i in range(NUM_LAYERS)]
    return tokens, folders


def _drop_from_kvray(keys: list[bytes], ids: np.ndarray, shard: int, pools: dict[int, str]) -> int:
    """Blocks gone from every pool that may hold them (as when evicted or lost)."""
    import ray

    from kvray.meta.messages import RAY_NAMESPACE

    dropped = 0
    for name in set(pools.values()):
        pool = ray.get_actor(name, namespace=RAY_NAMESPACE)
        dropped += ray.get(pool.report_lost.remote(keys, ids, shard, "test"), timeout=30)
    return dropped


def test_both_save_and_either_loads(engine: MultiEngine) -> None:
    from kvray.meta.ids import key_ids

    prompts = _prompts(seed=100)
    ref, _ = _cold(engine, prompts)

    # kvray is first in the list: it loads, and its pool counts the hits.
    hit_tokens, pool_hits = engine.kv.scheduler.hit_tokens, engine.pool_hits()
    tokens, cached = engine.run(prompts)
    assert tokens == ref
    assert cached == [FULL_HIT, FULL_HIT]
    assert engine.kv.scheduler.hit_tokens - hit_tokens == 2 * FULL_HIT
    assert engine.pool_hits() - pool_hits >= 2 * FULL_HIT // BLOCK_SIZE

    # kvray loses the blocks (and sees it): ExampleConnector's files are loaded instead.
    keys = [k for p in prompts for k in engine.kv.key_space.block_keys(block_hashes(p)[:7])]
    assert _drop_from_kvray(keys, key_ids(keys), 0, engine.kv.store.io_pools()) == len(keys)
    engine.kv.store.sync()
    assert [engine.kvray_present(p) for p in prompts] == [0, 0]
    hit_tokens = engine.kv.scheduler.hit_tokens
    tokens, cached = engine.run(prompts)
    assert tokens == ref
    assert cached == [FULL_HIT, FULL_HIT]  # only ExampleConnector had them
    assert engine.kv.scheduler.hit_tokens == hit_tokens


def test_a_kvray_loss_with_nothing_elsewhere_is_recomputed(engine: MultiEngine) -> None:
    """kvray plans a full hit, its blocks are gone when the worker reads them, and
    ExampleConnector has nothing: vLLM recomputes under the engine's policy (kvray's own entry
    never said "recompute"): the tokens of the cold run."""
    prompts = _prompts(seed=200)
    ref, folders = _cold(engine, prompts)
    for f in folders:
        shutil.rmtree(engine.storage / f)

    store = engine.kv_worker.store
    real_fetch = store.fetch_from
    dropped: list[int] = []

    def lost_then_fetched(
        keys: list[bytes], ids: np.ndarray, shard: int, slots: Any, pools: dict[int, str], t: float
    ) -> Any:
        dropped.append(_drop_from_kvray(list(keys), ids, shard, pools))
        return real_fetch(keys, ids, shard, slots, pools, t)

    hit_tokens, failed = engine.kv.scheduler.hit_tokens, engine.failed_blocks()
    store.fetch_from = lost_then_fetched
    try:
        tokens, _ = engine.run(prompts)
    finally:
        del store.fetch_from  # the class's method again
    assert sum(dropped) > 0, "kvray never loaded: not the failure path"
    assert engine.kv.scheduler.hit_tokens - hit_tokens == 2 * FULL_HIT  # planned from kvray
    assert engine.failed_blocks() - failed == 2 * FULL_HIT // BLOCK_SIZE
    assert tokens == ref
    assert folders <= engine.example_folders(), "ExampleConnector saved the recompute again"


# ------------------------------------------------------------------ Ray Serve LLM


def test_ray_serve_llm_multiconnector_backend_completes_the_deployment_config(
    tiny_model: str, wide_ns: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ray Serve LLM's MultiConnectorBackend sets kvray's backend up on a deep copy of the
    deployment's config; what kvray fills in must land in the config the engine is built from:
    vLLM can then load kvray by name alone, and the engine's top-level policy is "recompute"."""
    import ray

    from kvray.cluster import NODE_ENV
    from kvray.serving.app import build_llm_config
    from kvray.serving.backend import RESERVED_CPU_ENV, register_backend

    # setup() exports these for the engine processes; the pytest process must not keep them
    # (setenv first: monkeypatch restores only what it recorded, and delenv of an unset
    # variable records nothing).
    for name in (NODE_ENV, RESERVED_CPU_ENV):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    register_backend()
    ns = wide_ns
    user_ktc = {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "connectors": [
                {"kv_connector": "KVRayConnector", "kv_connector_extra_config": {"namespace": ns}},
                {
                    "kv_connector": "ExampleConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)},
                },
            ]
        },
    }
    cfg = build_llm_config(tiny_model, namespace=ns, router="pow2")
    cfg.engine_kwargs["kv_transfer_config"] = user_ktc
    cfg.setup_engine_backend()  # Ray's own path: factory -> MultiConnectorBackend.setup()

    ktc = cfg.engine_kwargs["kv_transfer_config"]
    assert ktc["kv_load_failure_policy"] == "recompute"
    kv_entry = ktc["kv_connector_extra_config"]["connectors"][0]
    assert kv_entry["kv_connector_module_path"] == "kvray.connector"
    assert kv_entry["kv_role"] == "kv_both"
    assert kv_entry["kv_connector_extra_config"] == {
        "namespace": ns,
        "address": ray.get_runtime_context().gcs_address,
    }
    assert os.environ[NODE_ENV] == ray.get_runtime_context().get_node_id()

    # vLLM builds the engine's MultiConnector from exactly that config.
    multi = _multi_connector(_vllm_config(tiny_model, ktc), "SCHEDULER")
    try:
        assert type(multi.sub_connectors[0]).__name__ == "KVRayConnector"
    finally:
        multi.shutdown()

    # An explicit "fail" at the top level stops the replica's setup with kvray's message.
    user_ktc["kv_load_failure_policy"] = "fail"
    cfg = build_llm_config(tiny_model, namespace=ns, router="pow2")
    cfg.engine_kwargs["kv_transfer_config"] = user_ktc
    with pytest.raises(ConfigError, match="kvray inside MultiConnectorBackend needs the engine"):
        cfg.setup_engine_backend()
