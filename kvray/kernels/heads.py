"""KV heads across tensor-parallel sizes: which stored shards hold a rank's heads, and copies.

The canonical stored layout (CPU caches, whose pages are per (block, head)): a block stored with
*grouping* ``G`` is ``G`` shards, shard ``g`` holding KV heads ``[g*H/G, (g+1)*H/G)`` of every
layer, layer after layer: ``[layers][heads of the shard][head_nbytes]``. A rank of an engine
at any TP size holds a contiguous head range ``[a, b)`` (vLLM: ``H/T`` heads at ``T <= H``, one
head replicated ``T/H`` times at ``T > H``), so it reads:

- the one stored shard equal to its range (the same grouping: a plain copy);
- a head window of one stored shard (a coarser grouping): a strided view, no extra copy;
- pieces of several stored shards (a finer grouping): per-layer strided copies into rows.

Pure numpy; no vLLM, no Ray. The connector uses :func:`head_parts` for its load plans,
:func:`window` for the direct copy and :func:`assemble` for staging rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["HeadPart", "assemble", "head_parts", "is_head_major", "window"]


@dataclass(frozen=True)
class HeadPart:
    """Heads ``[src_lo, src_lo + count)`` of stored shard ``shard`` (``src_heads`` heads a
    layer) are heads ``[dst_lo, dst_lo + count)`` of the reader's block."""

    shard: int
    src_heads: int
    src_lo: int
    dst_lo: int
    count: int


def head_parts(total_heads: int, heads: tuple[int, int], grouping: int) -> list[HeadPart]:
    """The stored shards (grouping ``grouping`` of ``total_heads``) covering ``heads=(a, b)``."""
    a, b = heads
    if total_heads <= 0 or grouping <= 0 or total_heads % grouping:
        raise ValueError(
            f"grouping {grouping} does not split {total_heads} KV heads into equal shards"
        )
    if not 0 <= a < b <= total_heads:
        raise ValueError(f"head range [{a}, {b}) is outside 0..{total_heads}")
    per = total_heads // grouping
    parts = []
    for g in range(a // per, (b - 1) // per + 1):
        lo, hi = max(a, g * per), min(b, (g + 1) * per)
        parts.append(HeadPart(g, per, lo - g * per, lo - a, hi - lo))
    return parts


def is_head_major(num_heads: int, axes: str, block_size_factor: int) -> bool:
    """Whether a layer's share of a block is its heads one after the other (``[H][...]``)."""
    return block_size_factor == 1 and (num_heads == 1 or axes.lstrip("F").startswith("H"))


def window(
    run: np.ndarray,
    count: int,
    part: HeadPart,
    num_layers: int,
    head_nbytes: int,
) -> np.ndarray:
    """A strided ``[count, num_layers, part.count * head_nbytes]`` uint8 view of the heads of
    ``part`` in ``count`` stored blocks lying back to back from ``run`` (a block's array, the
    first of the run). No copy: the view reads the stored bytes in place."""
    src_layer = part.src_heads * head_nbytes
    src_block = src_layer * num_layers
    width = part.count * head_nbytes
    if run.dtype != np.uint8 or run.ndim != 1 or run.nbytes != src_block:
        raise ValueError(f"a stored block is a uint8 vector of {src_block} bytes, got {run.shape}")
    start = part.src_lo * head_nbytes
    if start + width > src_layer:
        raise ValueError(f"heads {part} are outside the stored shard")
    return np.lib.stride_tricks.as_strided(
        run[start:],
        shape=(count, num_layers, width),
        strides=(src_block, src_layer, 1),
        writeable=False,
    )


def assemble(
    out: np.ndarray,
    sources: Sequence[tuple[Sequence[np.ndarray], HeadPart]],
    num_layers: int,
    head_nbytes: int,
    layers: tuple[int, int] | None = None,
) -> None:
    """Fill rows ``out[i]`` (``[n, num_layers * heads * head_nbytes]``) with block ``i``'s
    heads taken from each source (the fetched blocks of one stored shard and where its heads
    go): one strided copy per (block, layer range, source). ``layers``: only that range."""
    n = out.shape[0]
    dst_layer = out.shape[1] // num_layers
    rows = out.reshape(n, num_layers, dst_layer)
    lo, hi = layers if layers is not None else (0, num_layers)
    for arrays, part in sources:
        if len(arrays) < n:
            raise ValueError(f"shard {part.shard} has {len(arrays)} blocks, {n} rows to fill")
        d0, width = part.dst_lo * head_nbytes, part.count * head_nbytes
        if d0 + width > dst_layer:
            raise ValueError(f"heads {part} do not fit rows of {dst_layer} bytes a layer")
        for i in range(n):
            src = window(arrays[i], 1, part, num_layers, head_nbytes)[0]
            np.copyto(rows[i, lo:hi, d0 : d0 + width], src[lo:hi])
