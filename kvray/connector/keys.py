"""The key namespace of one engine, derived identically in the scheduler and every worker.

One key per block, not per TP shard: a block's key is the engine's prefix (a digest of
everything that decides the bytes of a shard: model, dtype, block size, hash algorithm, layout,
TP size...) followed by vLLM's block hash, and rank ``r`` stores its part as shard
``shard_of(r)`` of ``num_shards`` under that key (MLA: one shard, written by rank 0, read by
every rank). The index counts a block as present only when every shard is stored.

The scheduler has no KV tensors, so the layout part of the fingerprint comes from what both
processes share: the platform, vLLM's resolved ``kv_cache_layout``, the KV cache spec of the
(single) attention group and the number of layers. The worker checks at
``register_kv_caches`` that its real tensors agree with that description (block bytes), so a
layout the description does not capture is refused instead of serving wrong bytes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvray.config import KVRayConfig
from kvray.keys import LayoutFingerprint, block_hash_bytes
from kvray.meta.ids import key_ids

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger(__name__)

#: Bumped when the bytes kvray stores for a block change meaning.
FORMAT_VERSION = "kvray-v1"
_CRYPTO_HASHES = ("sha256", "sha256_cbor")


@dataclass(frozen=True)
class EngineKeySpace:
    """Per-engine facts needed to turn vLLM block hashes into kvray keys for every rank."""

    base: LayoutFingerprint
    #: Shards of a block (TP size; MLA: 1, all ranks read the one shard rank 0 writes).
    num_shards: int
    block_size: int
    #: Bytes one block occupies over all layers of one rank (the layout check of workers).
    block_nbytes: int
    num_layers: int
    #: CPU attention ISA (``vec``, ``amx``...): it changes the bytes of a CPU KV block.
    variant: str = ""
    prefix: bytes = field(default=b"", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefix", self.base.prefix)

    def shard_of(self, tp_rank: int) -> int:
        """The shard a rank stores and reads."""
        return tp_rank % self.num_shards

    def writes(self, tp_rank: int) -> bool:
        """MLA: every rank holds the same latent KV; rank 0 alone writes it."""
        return tp_rank < self.num_shards

    def block_keys(self, block_hashes: Sequence[object]) -> list[bytes]:
        prefix = self.prefix
        return [prefix + block_hash_bytes(h) for h in block_hashes]

    def block_ids(self, block_hashes: Sequence[object]) -> np.ndarray:
        return key_ids(self.block_keys(block_hashes))


def build_key_space(
    config: KVRayConfig, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> EngineKeySpace:
    """Derive the namespace from vLLM's config; raises on layouts kvray cannot key safely."""
    from vllm.platforms import current_platform
    from vllm.v1.kv_cache_interface import AttentionSpec

    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        raise NotImplementedError("kvray connector: pipeline parallelism is not supported yet")
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1 or not isinstance(groups[0].kv_cache_spec, AttentionSpec):
        raise NotImplementedError(
            "kvray connector: only models with one full-attention KV cache group are supported "
            f"(got {[type(g.kv_cache_spec).__name__ for g in groups]})"
        )
    spec = groups[0].kv_cache_spec
    num_layers = len(groups[0].layer_names)
    cache = vllm_config.cache_config
    model_cfg = vllm_config.model_config
    use_mla = bool(getattr(model_cfg, "use_mla", False))
    tp_size = parallel.tensor_parallel_size
    hash_algo = str(cache.prefix_caching_hash_algo)
    if hash_algo not in _CRYPTO_HASHES and os.environ.get("PYTHONHASHSEED") is None:
        logger.warning(
            "kvray: prefix_caching_hash_algo=%s without PYTHONHASHSEED gives per-process block "
            "hashes: engines will not share KV. Use sha256 or set PYTHONHASHSEED everywhere.",
            hash_algo,
        )
    variant = ""
    if current_platform.device_type == "cpu":
        from kvray.kernels.layout import detect_cpu_attention_isa

        variant = detect_cpu_attention_isa(spec.dtype, cache.block_size, spec.head_size)
        if not variant:
            # ISA unknown (e.g. an fp8 cache, where it depends on the model dtype): key by the
            # host features vLLM picks it from, so AMX and non-AMX hosts never share blocks.
            variant = _cpu_features(str(model_cfg.dtype))
    layout = "/".join(
        str(x)
        for x in (
            current_platform.device_type,
            getattr(cache, "kv_cache_layout", None),
            type(spec).__name__,
            f"H{spec.num_kv_heads}",
            f"D{spec.head_size}",
            f"L{num_layers}",
            f"P{spec.page_size_bytes}",
            "mla" if use_mla else "mha",
            variant,
        )
    )
    model = config.model_id or model_cfg.model
    base = LayoutFingerprint(
        model=f"{model}@{model_cfg.revision or ''}",
        kv_dtype=f"{spec.dtype}/{cache.cache_dtype}",
        block_size=cache.block_size,
        hash_algo=hash_algo,
        layout=layout,
        tp_size=1 if use_mla else tp_size,
        tp_rank=0,
        salt=f"{FORMAT_VERSION}|{config.cache_salt}",
    )
    return EngineKeySpace(
        base=base,
        num_shards=1 if use_mla else tp_size,
        block_size=cache.block_size,
        block_nbytes=spec.page_size_bytes * num_layers,
        num_layers=num_layers,
        variant=variant,
    )


def _cpu_features(model_dtype: str) -> str:
    import torch

    amx = bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
    avx512 = bool(getattr(torch.cpu, "_is_avx512_supported", lambda: False)())
    return f"isa?/{model_dtype}/amx{int(amx)}/avx512{int(avx512)}"
