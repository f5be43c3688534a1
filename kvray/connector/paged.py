"""Copies between blocks fetched from kvray and vLLM's paged KV cache, for one worker rank.

Fetched blocks are zero-copy views of Ray's object store; blocks of one segment usually lie back
to back there, so each such run is scattered straight from the store without an intermediate
copy. A rank whose heads are a window of bigger stored shards (stored at a smaller TP size)
scatters that window straight from the store too, as a strided view. A rank whose heads come
from several stored shards (stored at a larger TP size) assembles them into staging rows first
(per-layer strided copies), then scatters the rows.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import torch

from kvray.kernels import KVCacheLayout, StagingLease, StagingPool, StagingPoolExhausted
from kvray.kernels.heads import HeadPart, assemble, window
from kvray.kernels.torch_ops import RowsHook

__all__ = ["Mover", "PagedCopier", "Source"]

#: The fetched blocks of one stored shard and where its heads go in this rank's blocks.
Source = tuple[Sequence[np.ndarray], HeadPart]


class Mover(Protocol):
    """What the copier needs of :class:`kvray.kernels.BlockMover`."""

    layout: KVCacheLayout

    def gather(self, block_ids: list[int], out: torch.Tensor) -> None: ...

    def scatter(
        self,
        block_ids: list[int],
        src: torch.Tensor,
        on_rows: RowsHook | None = None,
        *,
        layers: tuple[int, int] | None = None,
    ) -> None: ...


class PagedCopier:
    """Scatter fetched blocks into the paged cache; lease staging rows for saves."""

    def __init__(
        self,
        mover: Mover,
        staging: StagingPool,
        block_nbytes: int,
        device: torch.device,
        *,
        num_layers: int = 1,
        heads: int = 1,
    ) -> None:
        self.mover = mover
        self.staging = staging
        self.block_nbytes = block_nbytes
        self.device = device
        self.num_layers = num_layers
        self.heads = heads
        self.head_nbytes = block_nbytes // (num_layers * heads)

    def scatter(
        self,
        block_ids: list[int],
        sources: Sequence[Source],
        on_block: Callable[[int], None] | None = None,
        layers: tuple[int, int] | None = None,
    ) -> None:
        """Copy fetched blocks into the paged cache: block ``i`` of this rank is made of the
        heads each source gives (every source holds at least ``len(block_ids)`` blocks).

        One source holding all of this rank's heads is copied straight from Ray's buffers,
        run by run of blocks lying back to back (a head window as a strided view); several
        sources go through staging rows. ``on_block(i)`` is called once block ``i`` of every
        source has been copied (possibly from a copy thread)."""
        n = len(block_ids)
        if not n:
            return
        if len(sources) == 1 and sources[0][1].count == self.heads and self.device.type == "cpu":
            arrays, part = sources[0]
            self._direct(block_ids, arrays[:n], part, on_block, layers)
        else:
            self._assembled(block_ids, sources, on_block, layers)

    def _direct(
        self,
        block_ids: list[int],
        arrays: Sequence[np.ndarray],
        part: HeadPart,
        on_block: Callable[[int], None] | None,
        layers: tuple[int, int] | None,
    ) -> None:
        whole = part.src_heads == self.heads
        sb = self.num_layers * part.src_heads * self.head_nbytes  # bytes of a stored block
        for k, a in enumerate(arrays):
            if a.dtype != np.uint8 or a.ndim != 1 or a.nbytes != sb:
                raise ValueError(f"fetched block {k} is {a.dtype}{list(a.shape)}, not {sb} B")
        i = 0
        while i < len(arrays):
            j = i + 1
            base = arrays[i].ctypes.data
            while (
                j < len(arrays)
                and arrays[j].nbytes == sb
                and arrays[j].ctypes.data == base + (j - i) * sb
            ):
                j += 1
            if whole:
                view = np.lib.stride_tricks.as_strided(arrays[i], (j - i, sb), (sb, 1))
            else:
                view = window(arrays[i], j - i, part, self.num_layers, self.head_nbytes)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # read-only: we only read it
                src = torch.from_numpy(view)
            hook = None
            if on_block is not None:

                def hook(pos: int, length: int, first: int = i) -> None:
                    for k in range(first + pos, first + pos + length):
                        on_block(k)

            self.mover.scatter(block_ids[i:j], src, on_rows=hook, layers=layers)
            i = j

    def _assembled(
        self,
        block_ids: list[int],
        sources: Sequence[Source],
        on_block: Callable[[int], None] | None,
        layers: tuple[int, int] | None,
    ) -> None:
        """Per-layer strided copies of every source into staging rows, then one scatter, in
        pieces that fit the staging pool (a full pool: a temporary buffer)."""
        n = len(block_ids)
        step = max(1, min(n, self.staging.max_blocks))
        for a in range(0, n, step):
            b = min(n, a + step)
            lease = self.lease(b - a)
            buf = (
                lease.tensor[: b - a]
                if lease is not None
                else torch.empty((b - a, self.block_nbytes), dtype=torch.uint8)
            )
            try:
                parts = [(arrays[a:b], part) for arrays, part in sources]
                assemble(buf.numpy(), parts, self.num_layers, self.head_nbytes, layers)
                if on_block is not None:
                    for k in range(a, b):
                        on_block(k)
                self.mover.scatter(block_ids[a:b], buf, layers=layers)
            finally:
                if lease is not None:
                    lease.release()

    def lease(self, n: int) -> StagingLease | None:
        """Staging rows for ``n`` blocks without waiting (None when the pool is full)."""
        if n > self.staging.max_blocks:
            return None
        try:
            return self.staging.acquire(n, timeout=0)
        except StagingPoolExhausted:
            return None
