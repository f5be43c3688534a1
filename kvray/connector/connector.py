"""``KVRayConnector``, the connector vLLM builds (``kv_connector_module_path: kvray.connector``
resolves it here, see :mod:`kvray.connector`).

A thin facade in the style of vLLM's ``OffloadingConnector``: the scheduler role delegates to
:class:`KVRayConnectorScheduler`, the worker role to :class:`KVRayConnectorWorker`. Every key of
``kv_connector_extra_config`` is validated by :class:`kvray.KVRayConfig` when the engine starts;
``kv_load_failure_policy`` must be ``"recompute"`` (vLLM's default ``"fail"`` is refused); inside
vLLM's ``MultiConnector`` that is the engine's top-level policy, the one vLLM acts on
(:mod:`kvray.connector.policy`).
This module imports vLLM; ``import kvray`` does not import it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvray.config import KVRayConfig
from kvray.connector.attach import close_store, open_store
from kvray.connector.groups import build_groups, deciding
from kvray.connector.keyspace import EngineKeySpace
from kvray.connector.manager import KVRayCacheManager
from kvray.connector.metadata import KVRayConnectorMetadata, KVRayWorkerMetadata
from kvray.connector.policy import require_recompute_policy
from kvray.connector.reporter import EngineReporter
from kvray.connector.scheduler import KVRayConnectorScheduler
from kvray.connector.worker import KVRayConnectorWorker
from kvray.errors import KVRayError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvray.client import Store

_T = TypeVar("_T")

__all__ = ["KVRayConnector"]

logger = logging.getLogger(__name__)


def _layout_hint(vllm_config: VllmConfig, key_space: EngineKeySpace) -> str | None:
    """The attention backend's name (plus the CPU ISA) for the kernels' layout detection.

    No try/except: with no model layers registered (connectors built in tests, or before the
    model loads) vLLM's ``get_current_attn_backends`` does not raise but selects the backend
    from the model config; any error is a real one and refuses the start.
    """
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

    backends = get_current_attn_backends(vllm_config)
    name: str | None = backends[0].get_name() if backends else None
    if name is None:
        from vllm.platforms import current_platform

        name = "CPU_ATTN" if current_platform.device_type == "cpu" else None
    if name and key_space.variant:
        return f"{name}:{key_space.variant}"
    return name


def _publish_key_space(config: KVRayConfig, ks: EngineKeySpace, vllm_config: VllmConfig) -> None:
    """Tell routers how to compute this engine's keys (:mod:`kvray.registry`)."""
    import os

    from kvray.cluster import local_node_id
    from kvray.registry import KeySpaceInfo, publish_key_space

    m = vllm_config.model_config
    info = KeySpaceInfo(
        m.model,
        ks.block_size,
        ks.base.hash_algo,
        [ks.prefix],
        node_id=local_node_id(),
        hash_seed=os.getenv("PYTHONHASHSEED"),
        served_model_names=[str(m.served_model_name or m.model)],
    )
    publish_key_space(config.namespace, info)


def _tp_rank(vllm_config: VllmConfig) -> int:
    """This worker's tensor-parallel rank, from vLLM's initialised parallel state.

    A single-rank engine is rank 0 without it (workers built in tests); at TP > 1 a guessed
    rank 0 would make every rank write rank 0's keys, so the start is refused.
    """
    from vllm.distributed.parallel_state import get_tp_group, model_parallel_is_initialized

    parallel = vllm_config.parallel_config
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    if model_parallel_is_initialized():
        group = get_tp_group()
        if group.world_size == tp:
            return int(group.rank_in_group)
        problem = f"vLLM's tensor-parallel group has {group.world_size} rank(s)"
    elif tp == 1 and pp == 1:
        return 0
    else:
        problem = "vLLM's tensor-parallel group is not initialised in this process"
    raise KVRayError(
        f"kvray connector: {problem} but tensor_parallel_size={tp}, pipeline_parallel_size="
        f"{pp}: this worker's rank is unknown, and guessing rank 0 would make every rank "
        "write rank 0's keys; create the worker-role connector after vLLM initialises its "
        "model-parallel groups"
    )


class KVRayConnector(KVConnectorBase_V1, SupportsHMA):
    """Shares prefix KV blocks between vLLM instances anywhere on a Ray cluster.

    A ``SupportsHMA`` connector: with vLLM's hybrid KV cache manager each KV cache group is
    keyed and stored by its kind (:mod:`kvray.connector.groups`); kinds kvray cannot store are
    refused when the engine starts."""

    _cache_hit_source = (
        CacheHitSource.HOST
        if hasattr(CacheHitSource, "HOST")
        else (CacheHitSource.EXTERNAL_UNSPECIFIED)
    )

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        require_recompute_policy(self, vllm_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.config = KVRayConfig.from_dict(extra)
        self.groups = build_groups(self.config, vllm_config, kv_cache_config)
        #: The key space of the group that decides hits (the one group of most models).
        self.key_space: EngineKeySpace = deciding(self.groups).key_space
        hybrid = len(self.groups) > 1
        if hybrid and self.config.load_mode != "async":
            # vLLM takes no failed blocks (invalid_block_ids) from a connector of a model with
            # several KV cache groups, only failed async loads (failed_recving): a load of a
            # hybrid model that could fail in the step it runs in could not be recomputed.
            logger.info(
                "kvray connector: a hybrid model's loads are async (load_mode=%s asked): vLLM "
                "recomputes a failed load of several KV cache groups only for an async load",
                self.config.load_mode,
            )
            self.config = self.config.replace(load_mode="async")
        # Only the scheduler answers lookups: it alone subscribes to the index's feed.
        is_scheduler = role == KVConnectorRole.SCHEDULER
        # Checked before joining the cluster, so a refused start leaves nothing open.
        tp_rank, layout_hint = (
            (0, None)
            if is_scheduler
            else (_tp_rank(vllm_config), _layout_hint(vllm_config, self.key_space))
        )
        self.store: Store = open_store(self.config, subscribe=is_scheduler)
        parallel = vllm_config.parallel_config
        self.connector_scheduler: KVRayConnectorScheduler | None = None
        self.connector_worker: KVRayConnectorWorker | None = None
        self.manager: KVRayCacheManager | None = None
        self.engine_reporter: EngineReporter | None = None
        if is_scheduler:
            events = getattr(vllm_config, "kv_events_config", None)
            self.manager = KVRayCacheManager(
                self.key_space,
                self.store,
                events=bool(events is not None and events.enable_kv_cache_events),
            )
            main = deciding(self.groups).index
            self.connector_scheduler = KVRayConnectorScheduler(
                self.config,
                self.key_space,
                self.manager,
                world_size=parallel.tensor_parallel_size * parallel.pipeline_parallel_size,
                local_pool=self.store.local_pool,
                groups=self.groups if hybrid else (),
                managers={
                    g.index: KVRayCacheManager(g.key_space, self.store)
                    for g in self.groups
                    if hybrid and g.index != main
                },
            )
            _publish_key_space(self.config, self.key_space, vllm_config)
        else:
            self.connector_worker = KVRayConnectorWorker(
                self.config,
                self.key_space,
                self.store,
                tp_rank=tp_rank,
                layout_hint=layout_hint,
                groups=self.groups,
            )
        logger.info(
            "kvray connector (%s) in namespace %r, load_mode=%s",
            role.name,
            self.config.namespace,
            self.config.load_mode,
        )

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a dropped save is a future miss, never a correctness issue.
        return False

    @property
    def scheduler(self) -> KVRayConnectorScheduler:
        if self.connector_scheduler is None:
            raise RuntimeError("KVRayConnector: scheduler-side call on a worker-side connector")
        return self.connector_scheduler

    @property
    def worker(self) -> KVRayConnectorWorker:
        if self.connector_worker is None:
            raise RuntimeError("KVRayConnector: worker-side call on a scheduler-side connector")
        return self.connector_worker

    def _meta(self) -> KVRayConnectorMetadata:
        return _ours(self._get_connector_metadata(), KVRayConnectorMetadata)

    # ------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self.worker.handle_preemptions(_ours(kv_connector_metadata, KVRayConnectorMetadata))

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.connector_worker is not None:
            self.connector_worker.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return

    def wait_for_save(self) -> None:
        self.worker.wait_for_save(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving, _ = self.worker.get_finished()
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving, failed = self.worker.get_finished()
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving, failed_recving=failed
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVRayWorkerMetadata | None:
        if self.connector_worker is None:
            return None
        return self.connector_worker.build_connector_worker_meta()

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        """The scheduler's block pool: its KV events feed the engine tier (routing only)."""
        super().bind_gpu_block_pool(gpu_block_pool)
        if self.connector_scheduler is None or not self.config.engine_tier:
            return
        if self.engine_reporter is not None:
            return
        from kvray.cluster import local_node_id

        self.engine_reporter = EngineReporter(
            self.config.namespace, self.store.num_index_shards, local_node_id()
        )
        pricing = self.connector_scheduler.pricing
        self.engine_reporter.costs = lambda: pricing.published  # routers read them (issue 32)
        self.engine_reporter.install(gpu_block_pool)

    def shutdown(self) -> None:
        if self.engine_reporter is not None:
            self.engine_reporter.close()
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
        if self.connector_scheduler is not None:
            self.connector_scheduler.shutdown()
        if self.manager is not None:
            self.manager.close()
        try:
            close_store(self.store)
        except Exception:  # shutting down anyway; the store may already be gone with Ray
            logger.debug("kvray: closing the store failed", exc_info=True)

    # ------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler.update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self.scheduler.take_events()


def _ours(obj: object, cls: type[_T]) -> _T:
    """``obj`` as kvray's own metadata type, or a clear error (not an ``assert``: kept
    under ``python -O``)."""
    if not isinstance(obj, cls):
        raise TypeError(f"KVRayConnector: expected {cls.__name__}, got {type(obj).__name__}")
    return obj
