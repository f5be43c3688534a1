"""Worker side of the kvray connector (one instance per TP rank, in vLLM's worker process).

A thin adapter from vLLM's worker hooks to one :class:`TransferHandler`: it describes the KV
caches once (``register_kv_caches``: layout, copy kernels, staging buffers, the check that the
caches match the key namespace), then hands each step's jobs over. Workers keep no view of the
index and run no feed: the scheduler's metadata says where each block to load lives.

Saves: inside ``wait_for_save`` each planned block is gathered (all layers of this rank's shard)
into staging rows and handed to ``put``, which copies them into Ray from a background thread; so
once ``wait_for_save`` returns no save reads vLLM's paged blocks any more. Loads: see
:mod:`kvray.connector.transfer` (``sync`` / ``layerwise`` / ``async``, one path, one error path).
"""

from __future__ import annotations

import logging

import torch

from kvray.config import KVRayConfig
from kvray.connector.grouped import GroupedTransfer
from kvray.connector.groups import CacheGroup
from kvray.connector.keyspace import EngineKeySpace
from kvray.connector.metadata import (
    KVRayConnectorMetadata,
    KVRayWorkerMetadata,
    ReqId,
    TransferCounters,
)
from kvray.connector.sides import TransferSide, TransferStore
from kvray.connector.transfer import TransferHandler
from kvray.kernels import BlockMover, StagingPool, describe_kv_caches
from kvray.kernels.heads import is_head_major

logger = logging.getLogger(__name__)


def state_bytes(t: torch.Tensor, name: str, ks: EngineKeySpace) -> torch.Tensor:
    """One Mamba layer's states as bytes ``[num_blocks, 1, state bytes]`` (the copy kernels'
    one-vector-per-block layout): vLLM views a layer's blocks as ``[B, H, N, C]`` whose
    ``H, N, C`` lie back to back, ``stride(0)`` bytes apart (its padded page)."""
    if not isinstance(t, torch.Tensor) or t.dim() < 2:
        raise RuntimeError(
            f"kvray connector: mamba layer {name}'s cache is a {type(t).__name__}, not a "
            "block-major tensor; refusing"
        )
    elem = t.element_size()
    page = ks.block_nbytes // ks.num_layers
    inner = t[0]
    if inner.numel() * elem != page or not inner.is_contiguous():
        raise RuntimeError(
            f"kvray connector: mamba layer {name}'s cache {list(t.shape)} (strides "
            f"{list(t.stride())}) does not hold its {page} B state per block in one piece; "
            "refusing"
        )
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(
        t.untyped_storage(),
        t.storage_offset() * elem,
        (t.shape[0], 1, page),
        (t.stride(0) * elem, page, 1),
    )


class KVRayConnectorWorker:
    """Executes the scheduler's jobs for one TP rank and reports them back."""

    def __init__(
        self,
        config: KVRayConfig,
        key_space: EngineKeySpace,
        store: TransferStore,
        *,
        tp_rank: int,
        layout_hint: str | None = None,
        groups: tuple[CacheGroup, ...] = (),
    ) -> None:
        """``groups``: a hybrid model's KV cache groups (one handler each); none for one group."""
        self.config = config
        self.key_space = key_space
        self.store = store
        self.tp_rank = tp_rank
        self.layout_hint = layout_hint
        self.groups = groups if len(groups) > 1 else ()
        self.handler: TransferHandler | GroupedTransfer | None = None

    @property
    def _h(self) -> TransferSide:
        if self.handler is None:
            raise RuntimeError("kvray connector: register_kv_caches was not called")
        return self.handler

    # ---------------------------------------------------------------- setup
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if not kv_caches:  # no attention layer: nothing to save or load, every hook a no-op
            logger.info("kvray worker rank %d: no KV cache to register", self.tp_rank)
            return
        if not self.groups:
            self.handler = self._handler(kv_caches, self.key_space)
            return
        handlers: dict[int, TransferHandler] = {}
        for group in self.groups:
            caches = {n: kv_caches[n] for n in group.layer_names if n in kv_caches}
            if len(caches) != len(group.layer_names):
                raise RuntimeError(
                    f"kvray connector: KV cache group {group.index} ({group.kind}) has "
                    f"{len(group.layer_names)} layers, {len(caches)} registered; refusing"
                )
            if group.is_state:
                caches = {n: state_bytes(t, n, group.key_space) for n, t in caches.items()}
            handlers[group.index] = self._handler(caches, group.key_space, group.is_state)
        layers = {n: g.index for g in self.groups for n in g.layer_names}
        self.handler = GroupedTransfer(handlers, layers)

    def _handler(
        self, kv_caches: dict[str, torch.Tensor], ks: EngineKeySpace, state: bool = False
    ) -> TransferHandler:
        """The transfer handler of the layers of one KV cache group (all of them: one group;
        ``state``: Mamba layers as :func:`state_bytes` views)."""
        first = next(iter(kv_caches.values()))
        layout = (
            describe_kv_caches(kv_caches, block_size=1, layout_hint="mla")
            if state
            else describe_kv_caches(
                kv_caches, block_size=ks.block_size, layout_hint=self.layout_hint
            )
        )
        if layout.block_nbytes != ks.block_nbytes or (
            ks.variant and layout.variant and layout.variant != ks.variant
        ):
            raise RuntimeError(
                f"kvray connector: the KV caches ({layout.kind}:{layout.variant}, "
                f"{layout.block_nbytes} B/block) do not match the key namespace "
                f"({ks.base.layout}, {ks.block_nbytes} B/block); refusing to share them"
            )
        if ks.cross_tp and not (
            layout.num_heads == ks.heads_per_rank
            and is_head_major(layout.num_heads, layout.axes, layout.block_size_factor)
        ):
            raise RuntimeError(
                f"kvray connector: the KV caches ({layout.fingerprint}) do not hold this rank's "
                f"{ks.heads_per_rank} KV head(s) one after the other in each layer, as the key "
                "namespace (shared across TP sizes) requires; refusing to share them"
            )
        layerwise = self.config.load_mode == "layerwise" and first.device.type == "cpu"
        if self.config.load_mode == "layerwise" and not layerwise:
            logger.info("kvray: layer-by-layer loads are for CPU caches; loading whole blocks")
        max_blocks = max(1, self.config.staging_bytes // layout.block_nbytes)
        handler = TransferHandler(
            self.config,
            ks,
            self.store,
            BlockMover(kv_caches, layout),
            StagingPool(int(layout.block_nbytes), max_blocks, "cpu"),
            tp_rank=self.tp_rank,
            device=first.device,
            layerwise=layerwise,
            layer_index={name: i for i, name in enumerate(kv_caches)},
        )
        logger.info(
            "kvray worker rank %d (shard %d of %d, heads %s, %s, reads groupings %s): %d "
            "layers, %d B per block, layout %s, %d staging blocks",
            self.tp_rank,
            ks.shard_of(self.tp_rank),
            ks.num_shards,
            ks.heads_of(self.tp_rank),
            "writes" if ks.writes(self.tp_rank) else "reads only",
            ks.groupings,
            layout.num_layers,
            layout.block_nbytes,
            layout.fingerprint,
            max_blocks,
        )
        return handler

    # ---------------------------------------------------------------- steps
    # vLLM's profile and dummy runs take empty steps, before register_kv_caches too: each
    # hook is a no-op when there is nothing to do; work planned without caches is an error.
    def start_load_kv(self, meta: KVRayConnectorMetadata) -> None:
        if self.handler is not None or meta.loads:
            self._h.submit(meta.loads, meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.handler is not None:
            self.handler.wait(layer_name)

    def wait_for_save(self, meta: KVRayConnectorMetadata) -> None:
        if self.handler is None and not meta.stores:
            return
        h = self._h
        h.wait()  # this step's loads are in place before its stores read the blocks
        h.submit(meta.stores, meta)

    def handle_preemptions(self, meta: KVRayConnectorMetadata) -> None:
        """Nothing to fence: saves copy blocks out inside ``wait_for_save`` of their step."""

    def get_finished(self) -> tuple[set[ReqId], set[ReqId], set[ReqId]]:
        if self.handler is None:
            return set(), set(), set()
        return self.handler.get_finished()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.handler.load_errors() if self.handler is not None else set()

    def build_connector_worker_meta(self) -> KVRayWorkerMetadata | None:
        return self.handler.take_meta() if self.handler is not None else None

    # ---------------------------------------------------------------- tests, shutdown
    def counters(self) -> TransferCounters:
        return self._h.counters()

    @property
    def staging(self) -> StagingPool:
        if self.handler is None:
            raise RuntimeError("kvray connector: register_kv_caches was not called")
        return self.handler.staging

    def flush(self, timeout: float = 30.0) -> None:
        if self.handler is not None:
            self.handler.flush(timeout)

    def shutdown(self) -> None:
        if self.handler is not None:
            self.handler.shutdown()
