"""Copy plans: where the bytes of every kvray block live in a group's KV caches
(:func:`build_copy_plan`), as the movers need it."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvray.kernels.detect import describe_kv_caches, layer_view_of
from kvray.kernels.shape import KVCacheLayout

logger = logging.getLogger(__name__)

__all__ = ["CopyPlan", "build_copy_plan"]


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
    view = layer_view_of(first, layout.kind)
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
