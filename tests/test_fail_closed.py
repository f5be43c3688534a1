"""The connector refuses to start on settings that would make kvray unsafe (real vLLM configs).

- ``kv_load_failure_policy`` other than ``"recompute"`` (vLLM's default is ``"fail"``: every
  eviction race or lost node would fail requests): refused in both roles and by a real engine.
- A worker whose tensor-parallel rank is unknown at TP > 1 (every rank would write rank 0's
  keys), or whose attention backend vLLM cannot select: refused instead of guessed.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch

from kvray.config import ConfigError
from kvray.errors import KVRayError
from kvray.testing.engines import (
    BLOCK_SIZE,
    build_tiny_llama,
    engine_kwargs,
    generate,
    in_process_engines,
    kvray_transfer_config,
)

pytestmark = [pytest.mark.vllm]

NUM_LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 64

POLICY_MESSAGE = (
    "kvray config: invalid kv_load_failure_policy='fail': kvray is a cache whose blocks can be "
    "evicted or lost with their node between lookup and load, and this policy fails the "
    'request instead of recomputing it; set "kv_load_failure_policy": "recompute" in '
    "--kv-transfer-config"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_llama(
        tmp_path_factory.mktemp("fail-closed-model"),
        layers=NUM_LAYERS,
        kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
    )


def _vllm_config(model_dir: str, namespace: str, *, tp: int = 1, **ktc: Any) -> Any:
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        VllmConfig,
    )

    transfer: dict[str, Any] = {
        "kv_connector": "KVRayConnector",
        "kv_connector_module_path": "kvray.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"namespace": namespace, "auto_start": False},
    }
    transfer.update(ktc)
    return VllmConfig(
        model_config=ModelConfig(
            model=model_dir, dtype="float32", seed=0, skip_tokenizer_init=True
        ),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
        kv_transfer_config=KVTransferConfig(**transfer),
        device_config=DeviceConfig("cpu"),
    )


def _kv_cache_config(num_blocks: int = 16) -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    layers = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.float32
    )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(layers, spec)],
    )


def _connector(vllm_config: Any, role: str) -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvray.connector import KVRayConnector

    return KVRayConnector(vllm_config, KVConnectorRole[role], _kv_cache_config())


@pytest.fixture
def connectors() -> Iterator[list[Any]]:
    """Connectors a test built; shut down after it (also those built by a regression)."""
    made: list[Any] = []
    yield made
    for conn in made:
        conn.shutdown()


# ------------------------------------------------------------------ kv_load_failure_policy


@pytest.mark.parametrize("role", ["SCHEDULER", "WORKER"])
@pytest.mark.parametrize("policy", [None, "fail"], ids=["vllm-default", "fail"])
def test_a_failing_load_policy_is_refused(
    model_dir: str, module_ns: str, connectors: list[Any], role: str, policy: str | None
) -> None:
    ktc = {} if policy is None else {"kv_load_failure_policy": policy}
    vllm_config = _vllm_config(model_dir, module_ns, **ktc)
    assert vllm_config.kv_transfer_config.kv_load_failure_policy == "fail"
    with pytest.raises(ConfigError) as info:
        connectors.append(_connector(vllm_config, role))
    assert str(info.value) == POLICY_MESSAGE
    assert info.value.field_name == "kv_load_failure_policy"


@pytest.mark.parametrize("role", ["SCHEDULER", "WORKER"])
def test_the_recompute_policy_is_accepted(
    model_dir: str, module_ns: str, connectors: list[Any], role: str
) -> None:
    vllm_config = _vllm_config(model_dir, module_ns, kv_load_failure_policy="recompute")
    conn = _connector(vllm_config, role)
    connectors.append(conn)
    assert conn.config.namespace == module_ns
    assert (conn.connector_scheduler is not None) == (role == "SCHEDULER")
    assert (conn.connector_worker is not None) == (role == "WORKER")


@pytest.fixture
def in_process() -> Iterator[None]:
    with in_process_engines():
        yield


def test_an_engine_with_the_fail_policy_refuses_to_start(
    model_dir: str, module_ns: str, in_process: None
) -> None:
    from vllm import LLM
    from vllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
    )

    ktc = {**kvray_transfer_config(module_ns), "kv_load_failure_policy": "fail"}
    llm = None
    try:
        with pytest.raises(ConfigError, match=re.escape(POLICY_MESSAGE)):
            llm = LLM(**engine_kwargs(model_dir, kv_transfer_config=ktc))
            generate(llm, [[5] * 40], max_tokens=2)  # reached only by a regression
    finally:
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
        del llm
        destroy_model_parallel()
        destroy_distributed_environment()


# ------------------------------------------------------------------ TP rank and layout


def test_a_tp2_worker_without_parallel_state_is_refused(
    model_dir: str, module_ns: str, connectors: list[Any]
) -> None:
    vllm_config = _vllm_config(model_dir, module_ns, tp=2, kv_load_failure_policy="recompute")
    with pytest.raises(KVRayError) as info:
        connectors.append(_connector(vllm_config, "WORKER"))
    message = str(info.value)
    assert "tensor_parallel_size=2" in message
    assert "guessing rank 0 would make every rank write rank 0's keys" in message
    # The scheduler needs no rank: it starts at TP=2.
    sched = _connector(vllm_config, "SCHEDULER")
    connectors.append(sched)
    assert sched.key_space.num_shards == 2


def test_a_tp1_worker_without_parallel_state_is_rank_0(
    model_dir: str, module_ns: str, connectors: list[Any]
) -> None:
    vllm_config = _vllm_config(model_dir, module_ns, kv_load_failure_policy="recompute")
    conn = _connector(vllm_config, "WORKER")
    connectors.append(conn)
    assert conn.worker.tp_rank == 0
    assert conn.key_space.shard_of(conn.worker.tp_rank) == 0
    assert conn.worker.store.feed is None, "a worker keeps no view of the index"
    # No layers registered: vLLM selects the backend from the model config, no guessing.
    assert conn.worker.layout_hint.startswith("CPU_ATTN")


def test_an_attention_backend_vllm_cannot_select_is_refused(
    model_dir: str, connectors: list[Any]
) -> None:
    # A cache dtype vLLM's attention selector rejects: the old code swallowed the error and
    # guessed the platform's default layout. (Refused before Ray is touched: no namespace.)
    ns = f"never{uuid.uuid4().hex[:6]}"
    vllm_config = _vllm_config(model_dir, ns, kv_load_failure_policy="recompute")
    vllm_config.cache_config.cache_dtype = "not-a-dtype"
    with pytest.raises(AssertionError, match="Invalid kv_cache_dtype: not-a-dtype"):
        connectors.append(_connector(vllm_config, "WORKER"))
