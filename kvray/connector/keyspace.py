"""The key namespace of one engine, derived identically in the scheduler and every worker.

One key per block, not per TP shard: a block's key is the engine's prefix (a digest of
everything that decides the bytes of a shard: model, dtype, block size, hash algorithm,
layout...) plus the block's *grouping* ``G`` (the number of shards it is stored in), followed
by vLLM's block hash. Rank ``r`` stores its part as shard ``shard_of(r)`` of ``G`` under that
key; the index counts a block as present only when every shard is stored.

Reuse across TP sizes. On CPU caches a rank's share of a block is its KV heads one after the
other in every layer, so the stored shards are canonical head ranges (shard ``g`` of ``G``
holds heads ``[g*H/G, (g+1)*H/G)``, :mod:`kvray.kernels.heads`) whatever TP size computed
them: the fingerprint drops the TP size and an engine at TP ``T`` stores with
``G = min(T, H)`` and reads any grouping ``G'`` dividing ``H`` (its own first). Heads
replicated over ranks (GQA with fewer KV heads than ranks) are stored once, by the first rank of
each replica group (``writes``), and read by all of them. MLA is one shard for everyone. Other
layouts (GPU caches) keep the TP size in the fingerprint: no reuse across TP sizes there.

The scheduler has no KV tensors, so the layout part of the fingerprint comes from what both
processes share: the platform, vLLM's resolved ``kv_cache_layout``, the KV cache spec of the
(single) attention group, the model's KV head count and the number of layers. The worker checks
at ``register_kv_caches`` that its real tensors agree with that description (block bytes,
heads, heads contiguous per layer), so a layout the description does not capture is refused
instead of serving wrong bytes.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvray.config import KVRayConfig
from kvray.keys import MAX_GROUPING, LayoutFingerprint, block_hash_bytes, grouped_prefix
from kvray.meta.ids import key_ids

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheConfig

logger = logging.getLogger(__name__)

#: Bumped when the bytes kvray stores for a block change meaning.
FORMAT_VERSION = "kvray-v2"
_CRYPTO_HASHES = ("sha256", "sha256_cbor")


@dataclass(frozen=True)
class EngineKeySpace:
    """Per-engine facts needed to turn vLLM block hashes into kvray keys for every rank."""

    base: LayoutFingerprint
    #: Shards this engine stores a block in, its grouping ``G``: ``min(TP, KV heads)``
    #: (MLA: 1, all ranks read the one shard rank 0 writes).
    num_shards: int
    block_size: int
    #: Bytes one block occupies over all layers of one rank (the layout check of workers).
    block_nbytes: int
    num_layers: int
    #: CPU attention ISA (``vec``, ``amx``...): it changes the bytes of a CPU KV block.
    variant: str = ""
    tp_size: int = 1
    #: KV heads of the model (MLA: 1).
    total_heads: int = 1
    #: Stored shards are canonical head ranges: blocks of every grouping are readable.
    cross_tp: bool = False
    prefix: bytes = field(default=b"", init=False, repr=False, compare=False)
    #: Groupings a lookup tries, the engine's own first (just it without ``cross_tp``).
    groupings: tuple[int, ...] = field(default=(), init=False, repr=False, compare=False)
    _prefixes: dict[int, bytes] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        g, t, h = self.num_shards, self.tp_size, self.total_heads
        if not 1 <= g <= MAX_GROUPING or t < 1 or t % g or h < 1 or h % g:
            raise ValueError(f"EngineKeySpace: {g} shards do not fit TP size {t}, {h} KV heads")
        if self.block_nbytes % (self.num_layers * (h // g)):
            raise ValueError(f"EngineKeySpace: {self.block_nbytes} B do not split into heads")
        others = [d for d in range(1, min(h, MAX_GROUPING) + 1) if h % d == 0 and d != g]
        # Nearest groupings first; of two as near, the coarser (one stored shard to read).
        others.sort(key=lambda d: (abs(math.log2(d / g)), d))
        groupings = (g, *others) if self.cross_tp else (g,)
        base = self.base.prefix
        object.__setattr__(self, "groupings", groupings)
        object.__setattr__(self, "_prefixes", {d: grouped_prefix(base, d) for d in groupings})
        object.__setattr__(self, "prefix", self._prefixes[g])

    @property
    def heads_per_rank(self) -> int:
        return self.total_heads // self.num_shards

    @property
    def head_nbytes(self) -> int:
        """Bytes of one head of one layer of a block."""
        return self.block_nbytes // (self.num_layers * self.heads_per_rank)

    def shard_of(self, tp_rank: int) -> int:
        """The shard a rank stores (replicas of one head range share it)."""
        return tp_rank // (self.tp_size // self.num_shards)

    def writes(self, tp_rank: int) -> bool:
        """The first rank of each group holding the same heads writes them (MLA: rank 0)."""
        return tp_rank % (self.tp_size // self.num_shards) == 0

    def heads_of(self, tp_rank: int) -> tuple[int, int]:
        """The KV heads ``[a, b)`` of the model a rank holds."""
        a = self.shard_of(tp_rank) * self.heads_per_rank
        return a, a + self.heads_per_rank

    def prefix_for(self, grouping: int) -> bytes:
        """The key prefix of blocks stored in ``grouping`` shards (0: the engine's own)."""
        prefix = self._prefixes.get(grouping or self.num_shards)
        if prefix is None:
            raise ValueError(f"grouping {grouping} is not readable here ({self.groupings})")
        return prefix

    def block_keys(self, block_hashes: Sequence[object], grouping: int = 0) -> list[bytes]:
        """Keys of blocks stored in ``grouping`` shards (0: this engine's own grouping)."""
        prefix = self.prefix_for(grouping)
        return [prefix + block_hash_bytes(h) for h in block_hashes]

    def block_ids(self, block_hashes: Sequence[object], grouping: int = 0) -> np.ndarray:
        return key_ids(self.block_keys(block_hashes, grouping))


def key_space(
    *,
    model: str,
    kv_dtype: str,
    block_size: int,
    hash_algo: str,
    device: str,
    layout_tags: Sequence[str],
    total_heads: int,
    rank_heads: int,
    head_size: int,
    num_layers: int,
    page_nbytes: int,
    tp_size: int,
    mla: bool = False,
    variant: str = "",
    salt: str = "",
    tp_bound: bool = False,
) -> EngineKeySpace:
    """The key space of an engine described by plain values (``build_key_space`` reads them
    from vLLM's config). ``page_nbytes``: one layer of one block of one rank.

    Reuse across TP sizes needs CPU caches (heads contiguous per layer) whose per-rank head
    count is vLLM's (``max(1, H // T)``); anything else keeps the TP size in the fingerprint,
    and so does ``tp_bound`` (bytes that are no canonical head ranges: a Mamba state).
    """
    heads = 1 if mla else total_heads
    consistent = mla or (
        heads >= 1
        and rank_heads == max(1, heads // tp_size)
        and (heads % tp_size == 0 if tp_size <= heads else tp_size % heads == 0)
    )
    if not consistent:
        logger.warning(
            "kvray: %d KV heads per rank do not match %d model KV heads at TP=%d: every rank "
            "stores its own shard and keys keep the TP size (no reuse across TP sizes)",
            rank_heads,
            total_heads,
            tp_size,
        )
        heads = tp_size * rank_heads
    grouping = 1 if mla else min(tp_size, heads) if consistent else tp_size
    cross = (
        consistent
        and not mla
        and not tp_bound
        and device == "cpu"
        and page_nbytes % rank_heads == 0
    )
    if mla or cross:  # the bytes of a stored shard do not depend on the TP size
        shape = [f"H{heads}", f"P{page_nbytes // rank_heads}", "mla" if mla else "mha/heads"]
    else:  # per-rank facts: blocks are only shared at this TP size
        shape = [f"H{rank_heads}", f"P{page_nbytes}", "mha"]
    layout = "/".join(
        [device, *layout_tags, *shape[:1], f"D{head_size}", f"L{num_layers}", *shape[1:], variant]
    )
    base = LayoutFingerprint(
        model=model,
        kv_dtype=kv_dtype,
        block_size=block_size,
        hash_algo=hash_algo,
        layout=layout,
        tp_size=1 if (mla or cross) else tp_size,
        tp_rank=0,
        salt=salt,
    )
    return EngineKeySpace(
        base=base,
        num_shards=grouping,
        block_size=block_size,
        block_nbytes=page_nbytes * num_layers,
        num_layers=num_layers,
        variant=variant,
        tp_size=tp_size,
        total_heads=heads,
        cross_tp=cross,
    )


def build_key_space(
    config: KVRayConfig, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> EngineKeySpace:
    """Derive the namespace from vLLM's config; raises on layouts kvray cannot key safely."""
    from vllm.v1.kv_cache_interface import AttentionSpec

    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        raise NotImplementedError("kvray connector: pipeline parallelism is not supported yet")
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1 or not isinstance(groups[0].kv_cache_spec, AttentionSpec):
        raise NotImplementedError(
            "kvray connector: only models with one full-attention KV cache group are supported "
            f"(got {[type(g.kv_cache_spec).__name__ for g in groups]})"
        )
    return group_key_space(config, vllm_config, groups[0].kv_cache_spec, len(groups[0].layer_names))


def group_key_space(
    config: KVRayConfig,
    vllm_config: VllmConfig,
    spec: AttentionSpec,
    num_layers: int,
    extra_tags: Sequence[str] = (),
) -> EngineKeySpace:
    """The key space of the layers of one attention KV cache group (``extra_tags``: what else
    tells this group's blocks apart, for the groups of a hybrid model; none for one group)."""
    from vllm.platforms import current_platform

    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        raise NotImplementedError("kvray connector: pipeline parallelism is not supported yet")
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
        from kvray.kernels.detect import detect_cpu_attention_isa

        variant = detect_cpu_attention_isa(spec.dtype, cache.block_size, spec.head_size)
        if not variant:
            # ISA unknown (e.g. an fp8 cache, where it depends on the model dtype): key by the
            # host features vLLM picks it from, so AMX and non-AMX hosts never share blocks.
            variant = _cpu_features(str(model_cfg.dtype))
    model = config.model_id or model_cfg.model
    return key_space(
        model=f"{model}@{model_cfg.revision or ''}",
        kv_dtype=f"{spec.dtype}/{cache.cache_dtype}",
        block_size=cache.block_size,
        hash_algo=hash_algo,
        device=str(current_platform.device_type),
        layout_tags=[
            str(getattr(cache, "kv_cache_layout", None)),
            type(spec).__name__,
            *extra_tags,
        ],
        total_heads=1 if use_mla else int(model_cfg.get_total_num_kv_heads()),
        rank_heads=int(spec.num_kv_heads),
        head_size=int(spec.head_size),
        num_layers=num_layers,
        page_nbytes=int(spec.page_size_bytes),
        tp_size=tp_size,
        mla=use_mla,
        variant=variant,
        salt=f"{FORMAT_VERSION}|{config.cache_salt}",
    )


def state_page_nbytes(spec: Any) -> int:
    """Bytes of one block of one Mamba layer kvray moves: the state vLLM keeps in it (its
    ``[B, H, N, C]`` layer view without the block axis; the page's padding is not moved)."""
    try:
        from vllm.v1.kv_cache_interface import compute_layer_kv_cache_shape_bytes

        return math.prod(compute_layer_kv_cache_shape_bytes(spec, 1)[1:])
    except ImportError:  # a vLLM without per-layer views: the state's own bytes
        return int(spec.state_content_size_bytes)


def state_key_space(
    config: KVRayConfig,
    vllm_config: VllmConfig,
    spec: Any,
    num_layers: int,
    extra_tags: Sequence[str] = (),
) -> EngineKeySpace:
    """The key space of a Mamba group: every rank stores its own state under the TP size (no
    reuse across TP sizes), keyed by the state's shapes and dtypes."""
    from vllm.platforms import current_platform

    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        raise NotImplementedError("kvray connector: pipeline parallelism is not supported yet")
    cache = vllm_config.cache_config
    model_cfg = vllm_config.model_config
    tp_size = parallel.tensor_parallel_size
    page = state_page_nbytes(spec)
    shapes = ";".join(
        f"{'x'.join(map(str, sh))}:{dt}" for sh, dt in zip(spec.shapes, spec.dtypes, strict=True)
    )
    model = config.model_id or model_cfg.model
    return key_space(
        model=f"{model}@{model_cfg.revision or ''}",
        kv_dtype=f"state/{cache.mamba_ssm_cache_dtype}/{cache.mamba_cache_dtype}",
        block_size=cache.block_size,
        hash_algo=str(cache.prefix_caching_hash_algo),
        device=str(current_platform.device_type),
        layout_tags=[type(spec).__name__, str(spec.mamba_type), shapes, *extra_tags],
        total_heads=tp_size,
        rank_heads=1,
        head_size=page,
        num_layers=num_layers,
        page_nbytes=page,
        tp_size=tp_size,
        salt=f"{FORMAT_VERSION}|{config.cache_salt}",
        tp_bound=True,
    )


def _cpu_features(model_dtype: str) -> str:
    import torch

    amx = bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
    avx512 = bool(getattr(torch.cpu, "_is_avx512_supported", lambda: False)())
    return f"isa?/{model_dtype}/amx{int(amx)}/avx512{int(avx512)}"
