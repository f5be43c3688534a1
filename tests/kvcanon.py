"""Test oracle: decode kvray block buffers into a canonical per-block view (and back).

``to_canonical(buf, layout)`` reads uint8 block buffers ``[n, layout.block_nbytes]`` as
``[n, num_layers, num_heads, block_size, num_kv_parts, head_size]`` of ``layout.dtype`` (part 0
is K, part 1 is V; MLA has one part); ``from_canonical`` is its inverse. Tests compare what the
movers gather with caches filled through known semantics (e.g. vLLM's CPU attention writes).
Data moves as same-width integers, so NaN payloads and fp8 codes compare exactly.

vLLM CPU caches (kind ``cpu_kv_interleaved``) decode only when their ISA variant is known:
``vec`` / ``vec16`` store K transposed per (block, head) page, ``amx`` tiles both halves in a
format this oracle does not decode (ValueError). Needs torch and kvray.kernels only.
"""

from __future__ import annotations

import torch

from kvray.kernels.layout import KVCacheLayout

__all__ = ["from_canonical", "to_canonical"]

_INT_BY_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_int(t: torch.Tensor) -> torch.Tensor:
    """Same bytes as a same-width integer tensor (exact permutes for every float dtype)."""
    return t.view(_INT_BY_SIZE[t.element_size()])


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
