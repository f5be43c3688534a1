"""vLLM's own connector lifecycle, run through the real ``KVConnectorModelRunnerMixin`` against a
worker-role kvray connector (adapted from vLLM's ``tests/v1/kv_connector/unit``
``test_kv_connector_mixin_clears_metadata``).

vLLM's profile and dummy runs take an empty step (``kv_connector_no_forward``: bind metadata,
start loads, wait for saves, collect results, clear metadata) before any KV cache is
registered, and later ones between real steps: each hook must be a no-op then.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch

from kvray.connector.metadata import KVRayConnectorMetadata, LoadSpec, StoreSpec
from kvray.testing.engines import BLOCK_SIZE, build_tiny_llama

pytestmark = [pytest.mark.vllm]

NUM_LAYERS, KV_HEADS, HEAD_DIM, NUM_BLOCKS = 2, 2, 64, 16
HOOKS = (
    "bind_connector_metadata",
    "start_load_kv",
    "wait_for_save",
    "get_transfer_results",
    "get_block_ids_with_load_errors",
    "build_connector_worker_meta",
    "clear_connector_metadata",
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_llama(
        tmp_path_factory.mktemp("lifecycle-model"),
        layers=NUM_LAYERS,
        kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
    )


def _configs(model_dir: str, namespace: str) -> tuple[Any, Any]:
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    vllm_config = VllmConfig(
        model_config=ModelConfig(
            model=model_dir, dtype="float32", seed=0, skip_tokenizer_init=True
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=4,
            max_num_batched_tokens=256,
            max_model_len=512,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=BLOCK_SIZE),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVRayConnector",
            kv_connector_module_path="kvray.connector",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"namespace": namespace},
        ),
        device_config=DeviceConfig("cpu"),
    )
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.float32
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(layers, spec)],
    )
    return vllm_config, kv_cache_config


def _empty_step(metadata: KVRayConnectorMetadata) -> Any:
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    return SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens={},
        total_num_scheduled_tokens=0,
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        finished_req_ids=set(),
        free_encoder_mm_hashes=[],
        kv_connector_metadata=metadata,
    )


@pytest.fixture
def worker_connector(model_dir: str, kvray_ns: str) -> Iterator[tuple[Any, Any, dict[str, int]]]:
    """vLLM's global worker-role connector (built by vLLM's factory), each hook call counted."""
    from unittest.mock import MagicMock, patch

    from vllm.distributed.kv_transfer.kv_transfer_state import (
        ensure_kv_transfer_initialized,
        ensure_kv_transfer_shutdown,
        get_kv_transfer_group,
    )

    vllm_config, kv_cache_config = _configs(model_dir, kvray_ns)
    tp_group = MagicMock()  # vLLM syncs the engine id across its TP group first
    tp_group.broadcast_object.side_effect = lambda value, src=0: value
    with patch("vllm.distributed.parallel_state.get_tp_group", return_value=tp_group):
        ensure_kv_transfer_initialized(vllm_config, kv_cache_config)
    connector = get_kv_transfer_group()
    calls: dict[str, int] = {}
    for name in HOOKS:
        method = getattr(connector, name)

        def counted(*args: Any, _name: str = name, _method: Any = method, **kw: Any) -> Any:
            calls[_name] = calls.get(_name, 0) + 1
            return _method(*args, **kw)

        setattr(connector, name, counted)
    try:
        yield vllm_config, connector, calls
    finally:
        ensure_kv_transfer_shutdown()


def _no_forward(vllm_config: Any, metadata: KVRayConnectorMetadata) -> Any:
    from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

    return KVConnectorModelRunnerMixin.kv_connector_no_forward(_empty_step(metadata), vllm_config)


def test_kv_connector_mixin_clears_metadata(worker_connector: Any) -> None:
    vllm_config, connector, calls = worker_connector
    from kvray.connector import KVRayConnector

    assert isinstance(connector, KVRayConnector)
    # Before any KV cache is registered (vLLM's profile run): every hook is a no-op.
    out = _no_forward(vllm_config, KVRayConnectorMetadata())
    assert connector._connector_metadata is None
    assert calls == dict.fromkeys(HOOKS, 1)
    kv_out = out.kv_connector_output
    assert kv_out is None or not (
        kv_out.finished_sending or kv_out.finished_recving or kv_out.invalid_block_ids
    )
    # The same once the caches are registered (a dummy run between real steps).
    backing = torch.zeros(NUM_LAYERS, NUM_BLOCKS, KV_HEADS, BLOCK_SIZE, 2 * HEAD_DIM)
    layers = {f"model.layers.{i}.self_attn.attn": backing[i] for i in range(NUM_LAYERS)}
    connector.register_kv_caches(layers)
    _no_forward(vllm_config, KVRayConnectorMetadata())
    assert connector._connector_metadata is None
    assert calls == dict.fromkeys(HOOKS, 2)
    assert not bool(backing.any()), "an empty step wrote into the KV cache"


def test_work_before_register_kv_caches_is_an_error(worker_connector: Any) -> None:
    """Not an empty step: loads or saves planned for caches never registered are refused."""
    _vllm_config, connector, _calls = worker_connector
    worker = connector.connector_worker
    load = KVRayConnectorMetadata(loads={1: LoadSpec("r", [0], [b"k" * 16], [1])})
    with pytest.raises(RuntimeError, match="register_kv_caches"):
        worker.start_load_kv(load)
    save = KVRayConnectorMetadata(stores={1: StoreSpec("r", [0], [b"k" * 16])})
    with pytest.raises(RuntimeError, match="register_kv_caches"):
        worker.wait_for_save(save)
    worker.register_kv_caches({})  # nothing to register: still nothing to move
    assert worker.handler is None
