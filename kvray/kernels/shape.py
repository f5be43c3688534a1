"""The description of a KV cache group's layout (:class:`KVCacheLayout`) and its
constants; see :mod:`kvray.kernels.layout` for what the axes mean."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

__all__ = ["AXES", "LAYOUT_KINDS", "SUPPORTED_DTYPES", "KVCacheLayout", "make_layout"]


#: Canonical order of the per-layer axes (see the module docstring).
AXES = "FHNSD"

#: The layout kinds :func:`describe_kv_caches` can report.
LAYOUT_KINDS = (
    "cpu_kv_interleaved",  # vLLM CPU backend: [B, H, N, 2*D], per (block, head) K rows then V rows
    "hnd",  # vLLM >= 0.32 standardised [B, H, N, K|V] with H outside N (LBHNC, ...)
    "nhd",  # the same logical view with N outside H (LBNHC, flash-attention's default)
    "kv_first_nhd",  # [2, B, N, H, D], K/V dimension before the block dimension
    "kv_first_hnd",  # the same with a HND stride order
    "blocks_first_nhd",  # [B, 2, N, H, D] (FlashInfer style)
    "blocks_first_hnd",
    "mla",  # [B, N, D] (or the standardised [B, 1, N, D]): one latent vector per token
)

#: KV cache dtypes kvray moves (as bytes; fp8 caches are 1-byte dtypes).
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.uint8,
    torch.int8,
    *(
        getattr(torch, name)
        for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
        if hasattr(torch, name)
    ),
)

_VARIANT_RE = re.compile(r"[a-z0-9_]{1,16}")

_DTYPE_NAMES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.uint8: "u8",
    torch.int8: "i8",
}


def _dtype_name(dtype: torch.dtype) -> str:
    if dtype in _DTYPE_NAMES:
        return _DTYPE_NAMES[dtype]
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class KVCacheLayout:
    """What one kvray block of a KV cache group holds, and how its bytes are ordered.

    A kvray block is ``num_layers`` consecutive per-layer parts of ``layer_block_nbytes`` bytes
    each (in the order of the ``kv_caches`` mapping); a part holds the layer's axes in the order
    :attr:`axes` (outermost first), with the sizes ``block_size_factor`` (F), ``num_heads`` (H),
    ``kernel_block_size`` (N), ``num_kv_parts`` (S) and ``head_size`` (D).
    """

    kind: str
    dtype: torch.dtype
    num_layers: int
    #: KV blocks in the cache (the connector's block ids run over ``range(num_blocks)``).
    num_blocks: int
    #: Tokens per KV block (the scheduler's block size).
    block_size: int
    #: Tokens per block of the attention kernel (``block_size // block_size_factor``).
    kernel_block_size: int
    block_size_factor: int
    num_heads: int
    #: 2 (K and V) for multi-head attention, 1 for MLA's single latent vector.
    num_kv_parts: int
    #: Elements per head and part (MLA: the latent width, e.g. 576).
    head_size: int
    #: Physical order of the per-layer axes inside a block buffer (a permutation of ``AXES``).
    axes: str
    layer_block_nbytes: int
    block_nbytes: int
    fingerprint: str
    #: Qualifier of the byte format the shape cannot show (the CPU attention ISA), or "".
    variant: str = ""

    @property
    def elem_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def tokens_per_block(self) -> int:
        return self.block_size

    def axis_sizes(self) -> dict[str, int]:
        """Size of each per-layer axis, keyed by its letter in ``AXES``."""
        return {
            "F": self.block_size_factor,
            "H": self.num_heads,
            "N": self.kernel_block_size,
            "S": self.num_kv_parts,
            "D": self.head_size,
        }


def make_layout(
    *,
    kind: str,
    dtype: torch.dtype,
    num_layers: int,
    num_blocks: int,
    block_size: int,
    kernel_block_size: int,
    num_heads: int,
    num_kv_parts: int,
    head_size: int,
    axes: str,
    variant: str = "",
) -> KVCacheLayout:
    """Build a :class:`KVCacheLayout` from its sizes (derived fields computed here).

    Used by :func:`describe_kv_caches` and to describe a *peer's* layout for conversions
    without its tensors.
    """
    if kind not in LAYOUT_KINDS:
        raise ValueError(f"unknown layout kind {kind!r}; known: {', '.join(LAYOUT_KINDS)}")
    if variant and not _VARIANT_RE.fullmatch(variant):
        raise ValueError(f"layout variant must match {_VARIANT_RE.pattern}, got {variant!r}")
    if sorted(axes) != sorted(AXES):
        raise ValueError(f"axes must be a permutation of {AXES!r}, got {axes!r}")
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported KV cache dtype {dtype}")
    if block_size <= 0 or kernel_block_size <= 0 or block_size % kernel_block_size:
        raise ValueError(
            f"block_size {block_size} is not a positive multiple of the kernel block size "
            f"{kernel_block_size}"
        )
    for name, value in (
        ("num_layers", num_layers),
        ("num_heads", num_heads),
        ("num_kv_parts", num_kv_parts),
        ("head_size", head_size),
    ):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    factor = block_size // kernel_block_size
    elem = torch.empty((), dtype=dtype).element_size()
    layer_nbytes = factor * num_heads * kernel_block_size * num_kv_parts * head_size * elem
    qualified = f"{kind}.{variant}" if variant else kind
    fingerprint = (
        f"{qualified}-{_dtype_name(dtype)}-{axes}-L{num_layers}F{factor}H{num_heads}"
        f"N{kernel_block_size}S{num_kv_parts}D{head_size}"
    )
    return KVCacheLayout(
        kind=kind,
        dtype=dtype,
        num_layers=num_layers,
        num_blocks=num_blocks,
        block_size=block_size,
        kernel_block_size=kernel_block_size,
        block_size_factor=factor,
        num_heads=num_heads,
        num_kv_parts=num_kv_parts,
        head_size=head_size,
        axes=axes,
        layer_block_nbytes=layer_nbytes,
        block_nbytes=layer_nbytes * num_layers,
        fingerprint=fingerprint,
        variant=variant,
    )
