"""Copies between blocks fetched from kvray and vLLM's paged KV cache, for one worker rank.

Fetched blocks are zero-copy views of Ray's object store; blocks of one segment usually lie back
to back there, so each such run is scattered straight from the store without an intermediate
copy. Anything else goes through staging rows (a bounded, reusable pool).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from kvray.kernels import StagingPool, StagingPoolExhausted

__all__ = ["Mover", "PagedCopier"]


class Mover(Protocol):
    """What the copier needs of :class:`kvray.kernels.BlockMover`."""

    layout: Any

    def gather(self, block_ids: list[int], out: torch.Tensor) -> Any: ...

    def scatter(self, block_ids: list[int], src: torch.Tensor, **kwargs: Any) -> Any: ...


class PagedCopier:
    """Scatter fetched blocks into the paged cache; lease staging rows for saves."""

    def __init__(
        self, mover: Mover, staging: StagingPool, block_nbytes: int, device: torch.device
    ) -> None:
        self.mover = mover
        self.staging = staging
        self.block_nbytes = block_nbytes
        self.device = device

    def scatter(
        self,
        block_ids: list[int],
        arrays: list[np.ndarray],
        on_block: Callable[[int], None] | None = None,
        layers: tuple[int, int] | None = None,
    ) -> None:
        """Copy fetched blocks into the paged cache, straight from Ray's buffers when it can.

        Blocks of one segment usually lie back to back in the object store: each such run is
        viewed as one ``[k, block_nbytes]`` array and scattered without an intermediate copy.
        Anything else goes through staging rows. ``on_block(i)`` is called once ``arrays[i]``
        has been copied (possibly from a copy thread).
        """
        nb = self.block_nbytes
        i = 0
        while i < len(arrays):
            j = i + 1
            base = arrays[i].ctypes.data
            while (
                j < len(arrays)
                and arrays[j].nbytes == nb
                and arrays[j].ctypes.data == base + (j - i) * nb
            ):
                j += 1
            if arrays[i].nbytes == nb and self.device.type == "cpu":
                run = np.lib.stride_tricks.as_strided(arrays[i], shape=(j - i, nb), strides=(nb, 1))
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)  # read-only: we only read it
                    src = torch.from_numpy(run)
                hook = None
                if on_block is not None:

                    def hook(pos: int, length: int, first: int = i) -> None:
                        for k in range(first + pos, first + pos + length):
                            on_block(k)

                self.mover.scatter(block_ids[i:j], src, on_rows=hook, layers=layers)
            else:
                lease = self.lease(j - i)
                buf = (
                    lease.tensor
                    if lease is not None
                    else torch.empty((j - i, nb), dtype=torch.uint8)
                )
                try:
                    view = buf.numpy()
                    for k in range(i, j):
                        view[k - i] = arrays[k]
                        if on_block is not None:
                            on_block(k)
                    self.mover.scatter(block_ids[i:j], buf, layers=layers)
                finally:
                    if lease is not None:
                        lease.release()
            i = j

    def lease(self, n: int) -> Any | None:
        """Staging rows for ``n`` blocks without waiting (None when the pool is full)."""
        if n > self.staging.max_blocks:
            return None
        try:
            return self.staging.acquire(n, timeout=0)
        except StagingPoolExhausted:
            return None
