"""Fast, exact copies between vLLM's paged per-layer KV caches and kvray's block buffers.

kvray stores one contiguous buffer per KV block: all layers of that block, for one TP shard
(vLLM measured one cross-layer buffer 4-5x faster to move than per-layer pieces). This package
moves those buffers in and out of vLLM's KV cache, on CPU and on GPU. Importing it needs torch
and numpy only: never vLLM, never CuPy (the CUDA kernel imports CuPy when first built).

API used by the connector
-------------------------
``describe_kv_caches(kv_caches, *, block_size, layout_hint=None) -> KVCacheLayout``
    Read the layout of one KV cache group from its tensors (shapes and strides). The result is
    a frozen dataclass: ``kind`` (one of ``LAYOUT_KINDS``: ``"cpu_kv_interleaved"``,
    ``"hnd"``, ``"nhd"``, ``"kv_first_nhd"``, ``"kv_first_hnd"``, ``"blocks_first_nhd"``,
    ``"blocks_first_hnd"``, ``"mla"``), ``dtype``, ``num_layers``, ``num_blocks`` (KV blocks),
    ``block_size``, ``kernel_block_size``, ``block_size_factor``, ``num_heads``,
    ``num_kv_parts``, ``head_size``, ``axes``, ``layer_block_nbytes``, ``block_nbytes``,
    ``variant`` and ``fingerprint`` (a short stable string for the key namespace, e.g.
    ``"cpu_kv_interleaved.vec-bf16-FHSND-L32F1H8N32S2D128"``). ``layout_hint`` (a kind or the
    attention backend name: ``"CPU_ATTN"``, ``"FLASH_ATTN"``, ``"FLASHMLA"``...) settles shapes
    several layouts share; pass it always (MLA caches look like one-head caches otherwise).
    For vLLM's CPU backend add the attention ISA, ``"CPU_ATTN:<isa>"`` (the ``isa`` attribute
    vLLM sets on its attention layers): its pages are ISA-specific (``vec``/``vec16`` store K
    transposed, ``amx`` tiles K and V), so the ISA is part of the fingerprint; without it kvray
    asks vLLM when vLLM is already imported. Unknown shapes raise ValueError naming them.

``BlockMover(kv_caches, layout, *, engine="auto")``
    ``gather(block_ids, out)`` copies KV blocks into ``out`` (uint8 ``[len(block_ids),
    layout.block_nbytes]``, e.g. a staging lease); ``scatter(block_ids, src)`` the reverse.
    Block ids are the connector's (KV block units); kernel-block expansion happens inside.
    Both return when the copy is done: on CUDA it runs on a side stream after the compute
    stream's queued work, and a scatter makes the compute stream wait for it. Bad input (dtype,
    shape, buffer too small, block id out of range, repeated ids in a scatter) raises
    ValueError before any byte moves. On the CPU, copies of 1 MiB or more run as numpy copies
    in up to ``torch.get_num_threads()`` (max 8) threads, which stays fast when other processes
    compete for the cores (torch's OpenMP copies collapse then); smaller ones are single torch
    ops.

``StagingPool(block_nbytes, max_blocks, device="cpu", *, pin_memory=None, timeout_s=5.0)``
    Bounded, reusable staging rows (pinned on CUDA hosts). ``with pool.acquire(n) as buf:``
    yields a uint8 ``[n, block_nbytes]`` tensor and returns the rows on exit, exception or
    not; ``acquire`` waits up to ``timeout`` (default ``timeout_s``) and then raises
    :class:`StagingPoolExhausted`.

Block buffer format
-------------------
``num_layers`` parts in ``kv_caches`` order, each the layer's bytes of the block in the cache's
physical order (``layout.axes``), so a gather is a pure memory copy and a scatter restores the
bytes exactly. Buffers are only meaningful with the same ``fingerprint``.
"""

from kvray.kernels.layout import (
    LAYOUT_KINDS,
    SUPPORTED_DTYPES,
    KVCacheLayout,
    describe_kv_caches,
    make_layout,
)
from kvray.kernels.mover import BlockMover
from kvray.kernels.staging import StagingLease, StagingPool, StagingPoolExhausted

__all__ = [
    "LAYOUT_KINDS",
    "SUPPORTED_DTYPES",
    "BlockMover",
    "KVCacheLayout",
    "StagingLease",
    "StagingPool",
    "StagingPoolExhausted",
    "describe_kv_caches",
    "make_layout",
]
