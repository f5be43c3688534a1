"""Reading a KV cache group's layout from its tensors (shape and strides, a hint where the
shape cannot tell): :func:`describe_kv_caches`; see :mod:`kvray.kernels.layout`."""

from __future__ import annotations

import itertools
import logging
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kvray.kernels.shape import AXES, SUPPORTED_DTYPES, KVCacheLayout, make_layout

logger = logging.getLogger(__name__)

__all__ = ["LayerView", "describe_kv_caches", "detect_cpu_attention_isa", "layer_view_of"]


@dataclass(frozen=True)
class LayerView:
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


def layer_view_of(t: torch.Tensor, hint: str | None) -> LayerView:
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
        return LayerView("mla", (b, 1, n, 1, d), (st[0], 0, st[1], 0, st[2]))
    if t.dim() == 4:
        b, h, n, c = shape
        head_pages = st[3] == 1 and st[2] == c and (h == 1 or st[1] >= n * c)
        if sem is None:
            # vLLM's CPU backend only runs head-major pages (LBHNC); anything else on the CPU
            # is a GPU-style cache (tests, offload buffers).
            sem = "cpu" if t.device.type == "cpu" and head_pages else "std"
        if sem == "mla":
            return LayerView("mla", (b, h, n, 1, c), (st[0], st[1], st[2], 0, st[3]))
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
            return LayerView("cpu_kv_interleaved", (b, h, n, 2, d), (st[0], st[1], d, n * d, 1))
        kind = "hnd" if (h == 1 or n == 1 or st[1] > st[2]) else "nhd"
        return LayerView(kind, (b, h, n, 2, d), (st[0], st[1], st[2], d * st[3], st[3]))
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
        return LayerView(f"{family}_{order}", (b, h, n, s, d), (sb, sh, sn, ss, sd))
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
    view = layer_view_of(first, layout_hint)
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


def _check_nested(view: LayerView, shape: torch.Size) -> None:
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
