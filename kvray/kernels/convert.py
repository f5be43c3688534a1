"""Receiving-side conversions: make a block stored by a peer with another block size or layout
usable here. Pure functions (inputs are never modified; outputs are new tensors).

Two levels:

* vLLM-style per-layer helpers on standardised block tensors, ``[num_blocks, H, N, C]`` (HND) or
  ``[num_blocks, N, H, C]`` (NHD): :func:`kv_postprocess_blksize_on_receive`,
  :func:`kv_postprocess_layout_on_receive` and both at once. Unlike vLLM's versions they work in
  both directions (bigger or smaller blocks).
* whole kvray block buffers between any two :class:`~kvray.kernels.layout.KVCacheLayout` of the
  same model shard: :func:`convert_blocks`, through the canonical per-block view
  ``[n, layers, heads, tokens, kv_parts, head_size]`` (:func:`to_canonical` /
  :func:`from_canonical`).

Data moves as same-width integers, so every conversion is bit-exact (NaN payloads and fp8
codes included).

vLLM CPU caches (kind ``cpu_kv_interleaved``) convert only when their ISA variant is known:
``vec`` / ``vec16`` store K transposed per (block, head) page, ``amx`` tiles both halves in a
format kvray does not decode (ValueError).
"""

from __future__ import annotations

import logging

import torch

from kvray.kernels.layout import KVCacheLayout

logger = logging.getLogger(__name__)

__all__ = [
    "convert_blocks",
    "from_canonical",
    "kv_postprocess_blksize_and_layout_on_receive",
    "kv_postprocess_blksize_on_receive",
    "kv_postprocess_layout_on_receive",
    "to_canonical",
]

_INT_BY_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_STD_LAYOUTS = ("HND", "NHD")


def _as_int(t: torch.Tensor) -> torch.Tensor:
    """Same bytes as a same-width integer tensor (exact permutes for every float dtype)."""
    return t.view(_INT_BY_SIZE[t.element_size()])


def _check_std_layout(name: str, value: str) -> str:
    v = value.upper()
    if v not in _STD_LAYOUTS:
        raise ValueError(f"{name} must be 'HND' or 'NHD', got {value!r}")
    return v


def kv_postprocess_blksize_on_receive(
    blocks: torch.Tensor,
    *,
    src_block_size: int,
    dst_block_size: int,
    layout: str = "HND",
) -> torch.Tensor:
    """Regroup the tokens of consecutive blocks into blocks of ``dst_block_size`` tokens.

    ``blocks`` is ``[num_blocks, H, src_block_size, C]`` (HND) or
    ``[num_blocks, src_block_size, H, C]`` (NHD); the result has the same layout with
    ``num_blocks * src_block_size / dst_block_size`` blocks. Token ``t`` of the concatenated
    sequence stays token ``t``. In HND each head's tokens are contiguous per block, so this is
    a real permutation (what vLLM's helper does for a bigger local block size); in NHD it is a
    reshape.
    """
    lay = _check_std_layout("layout", layout)
    if blocks.dim() != 4:
        raise ValueError(f"blocks must be 4-D [num_blocks, ., ., C], got {list(blocks.shape)}")
    if src_block_size <= 0 or dst_block_size <= 0:
        raise ValueError("block sizes must be positive")
    nb = blocks.shape[0]
    n_axis = 2 if lay == "HND" else 1
    if blocks.shape[n_axis] != src_block_size:
        raise ValueError(
            f"blocks {list(blocks.shape)} ({lay}) do not have {src_block_size} tokens per block"
        )
    total = nb * src_block_size
    if total % dst_block_size:
        raise ValueError(
            f"{nb} blocks of {src_block_size} tokens do not split into blocks of "
            f"{dst_block_size} tokens"
        )
    m = total // dst_block_size
    x = _as_int(blocks)
    if lay == "NHD":
        out = x.reshape(m, dst_block_size, *x.shape[2:]).clone()
    else:
        _, h, _, c = x.shape
        # [nb, H, Ns, C] -> [H, nb*Ns, C] (token-major per head) -> [m, H, Nd, C]
        seq = x.permute(1, 0, 2, 3).reshape(h, total, c)
        out = seq.reshape(h, m, dst_block_size, c).permute(1, 0, 2, 3).contiguous()
    return out.view(blocks.dtype)


def kv_postprocess_layout_on_receive(
    blocks: torch.Tensor, *, src_layout: str, dst_layout: str
) -> torch.Tensor:
    """Convert ``[num_blocks, H, N, C]`` (HND) <-> ``[num_blocks, N, H, C]`` (NHD) blocks.

    Returns a new contiguous tensor (a copy even when the layouts are equal)."""
    src = _check_std_layout("src_layout", src_layout)
    dst = _check_std_layout("dst_layout", dst_layout)
    if blocks.dim() != 4:
        raise ValueError(f"blocks must be 4-D, got {list(blocks.shape)}")
    x = _as_int(blocks)
    out = x.clone() if src == dst else x.transpose(1, 2).contiguous()
    return out.view(blocks.dtype)


def kv_postprocess_blksize_and_layout_on_receive(
    blocks: torch.Tensor,
    *,
    src_block_size: int,
    dst_block_size: int,
    src_layout: str,
    dst_layout: str,
) -> torch.Tensor:
    """Both conversions: block size first (in the sender's layout), then the layout."""
    regrouped = kv_postprocess_blksize_on_receive(
        blocks, src_block_size=src_block_size, dst_block_size=dst_block_size, layout=src_layout
    )
    return kv_postprocess_layout_on_receive(regrouped, src_layout=src_layout, dst_layout=dst_layout)


# ----------------------------------------------------------------------------------------------
# Whole kvray blocks
# ----------------------------------------------------------------------------------------------

_CANON = "HFNSD"
#: CPU attention ISAs whose pages kvray can decode: K as [D, N], V as [N, D].
_CPU_K_TRANSPOSED = ("vec", "vec16")


def _check_decodable(layout: KVCacheLayout) -> None:
    if layout.kind != "cpu_kv_interleaved":
        return
    if layout.variant not in _CPU_K_TRANSPOSED:
        raise ValueError(
            f"cannot decode {layout.fingerprint}: vLLM CPU pages are ISA-specific and the ISA "
            f"{layout.variant or '(unknown)'} is not one of {', '.join(_CPU_K_TRANSPOSED)}"
        )
    if not layout.axes.endswith("ND"):
        raise ValueError(f"cannot decode {layout.fingerprint}: pages are not contiguous [N, D]")


def _swap_cpu_k(x: torch.Tensor, *, to_true: bool) -> torch.Tensor:
    """Fix the K half of CPU pages in ``x = [n, L, H, F, N, S, D]``.

    ``to_true``: ``x`` holds each K page's memory read as if it were [N, D]; return true K.
    Otherwise ``x`` holds true K; return K laid out so that its [N, D] reading is the page.
    """
    k, v = x[:, :, :, :, :, 0], x[:, :, :, :, :, 1]
    n_tok, dim = k.shape[-2], k.shape[-1]
    if to_true:
        # Memory order of the page == logical (N, D) order of k; reread it as [D, N].
        k = k.reshape(*k.shape[:-2], dim, n_tok).transpose(-1, -2)
    else:
        k = k.transpose(-1, -2).reshape(*k.shape[:-2], n_tok, dim)
    return torch.stack((k, v), dim=5)


def _check_buffer(buf: torch.Tensor, layout: KVCacheLayout) -> None:
    if buf.dtype != torch.uint8 or buf.dim() != 2 or buf.shape[1] != layout.block_nbytes:
        raise ValueError(
            f"expected a uint8 [n, {layout.block_nbytes}] block buffer for "
            f"{layout.fingerprint}, got {buf.dtype} {list(buf.shape)}"
        )


def to_canonical(buf: torch.Tensor, layout: KVCacheLayout) -> torch.Tensor:
    """Decode block buffers into ``[n, num_layers, num_heads, block_size, num_kv_parts,
    head_size]`` of ``layout.dtype`` (a new tensor). Part 0 is K, part 1 is V (MLA: one part)."""
    _check_buffer(buf, layout)
    _check_decodable(layout)
    n = buf.shape[0]
    sizes = layout.axis_sizes()
    x = buf.contiguous().view(_INT_BY_SIZE[layout.elem_size])
    x = x.view(n, layout.num_layers, *(sizes[a] for a in layout.axes))
    x = x.permute(0, 1, *(2 + layout.axes.index(a) for a in _CANON))
    if layout.kind == "cpu_kv_interleaved":
        x = _swap_cpu_k(x, to_true=True)
    x = x.reshape(
        n,
        layout.num_layers,
        layout.num_heads,
        layout.block_size,
        layout.num_kv_parts,
        layout.head_size,
    )
    return x.contiguous().view(layout.dtype)


def from_canonical(canon: torch.Tensor, layout: KVCacheLayout) -> torch.Tensor:
    """Encode ``[n, num_layers, num_heads, block_size, num_kv_parts, head_size]`` into uint8
    block buffers ``[n, layout.block_nbytes]`` (a new tensor)."""
    expected = (
        layout.num_layers,
        layout.num_heads,
        layout.block_size,
        layout.num_kv_parts,
        layout.head_size,
    )
    if canon.dim() != 6 or tuple(canon.shape[1:]) != expected:
        raise ValueError(
            f"canonical blocks must be [n, {', '.join(map(str, expected))}], got "
            f"{list(canon.shape)}"
        )
    if canon.element_size() != layout.elem_size:
        raise ValueError(f"canonical dtype {canon.dtype} does not match {layout.dtype}")
    _check_decodable(layout)
    n = canon.shape[0]
    sizes = layout.axis_sizes()
    x = _as_int(canon.contiguous())
    x = x.reshape(n, layout.num_layers, *(sizes[a] for a in _CANON))
    if layout.kind == "cpu_kv_interleaved":
        x = _swap_cpu_k(x, to_true=False)
    x = x.permute(0, 1, *(2 + _CANON.index(a) for a in layout.axes))
    return x.contiguous().view(n, -1).view(torch.uint8)


def convert_blocks(buf: torch.Tensor, src: KVCacheLayout, dst: KVCacheLayout) -> torch.Tensor:
    """Convert block buffers stored under layout ``src`` into layout ``dst``.

    Both must describe the same model shard (layers, heads, head size, K/V parts, dtype); the
    layout kind, axis order and (kernel) block size may differ. With different block sizes the
    tokens of consecutive input blocks are regrouped: ``n * src.block_size`` must be a multiple
    of ``dst.block_size``. Returns a new uint8 ``[m, dst.block_nbytes]`` tensor.
    """
    for field in ("num_layers", "num_heads", "num_kv_parts", "head_size", "dtype"):
        a, b = getattr(src, field), getattr(dst, field)
        if a != b:
            raise ValueError(
                f"cannot convert {src.fingerprint} to {dst.fingerprint}: {field} {a} != {b}"
            )
    _check_buffer(buf, src)
    if src.fingerprint == dst.fingerprint:
        return buf.clone()
    canon = to_canonical(buf, src)
    n = canon.shape[0]
    if src.block_size != dst.block_size:
        total = n * src.block_size
        if total % dst.block_size:
            raise ValueError(
                f"{n} blocks of {src.block_size} tokens do not regroup into blocks of "
                f"{dst.block_size} tokens"
            )
        m = total // dst.block_size
        x = _as_int(canon)
        layers, heads, _, parts, dim = x.shape[1:]
        seq = x.permute(1, 2, 0, 3, 4, 5).reshape(layers, heads, total, parts, dim)
        x = seq.reshape(layers, heads, m, dst.block_size, parts, dim).permute(2, 0, 1, 3, 4, 5)
        canon = x.contiguous().view(src.dtype)
    return from_canonical(canon, dst)
