"""A bounded pool of reusable staging buffers for block transfers.

Allocating (and, on CUDA hosts, pinning) memory per transfer costs more than the copy itself, so
the hot path takes rows of one arena allocated up front. The pool is bounded: memory use is
fixed at construction, and a caller that cannot get rows waits up to a timeout and then gets
:class:`StagingPoolExhausted`, so a slow consumer applies back-pressure instead of growing memory.

Rows come back on every path: a lease is a context manager, and its rows return when the block
exits, exception or not (the transfers that use them are synchronous).
"""

from __future__ import annotations

import logging
import threading
import time
from types import TracebackType
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = ["StagingLease", "StagingPool", "StagingPoolExhausted"]


class StagingPoolExhausted(TimeoutError):
    """No rows became free within the timeout."""


class StagingLease:
    """``n`` rows of a :class:`StagingPool`; use as ``with pool.acquire(n) as buf:``.

    ``tensor`` (also what ``with`` yields) is a contiguous uint8 ``[n, block_nbytes]`` view of
    the arena. Do not keep references to it after the lease is released.
    """

    __slots__ = ("_pool", "_released", "n", "start", "tensor")

    def __init__(self, pool: StagingPool, start: int, n: int, tensor: torch.Tensor) -> None:
        self._pool = pool
        self.start = start
        self.n = n
        self.tensor = tensor
        self._released = False

    def release(self) -> None:
        """Give the rows back (idempotent)."""
        if self._released:
            return
        self._released = True
        self._pool._give_back(self.start, self.n)

    @property
    def released(self) -> bool:
        return self._released

    def __enter__(self) -> torch.Tensor:
        if self._released:
            raise RuntimeError("lease already released")
        return self.tensor

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"StagingLease(rows {self.start}..{self.start + self.n}, released={self._released})"


class StagingPool:
    """``max_blocks`` rows of ``block_nbytes`` bytes in one arena on ``device``.

    ``acquire(n)`` hands out ``n`` *contiguous* rows (first fit), so a lease is one
    ``[n, block_nbytes]`` tensor that a gather writes and ``ray.put`` reads in one piece.
    ``pin_memory`` (CPU arenas only): None pins when CUDA is available, so host<->GPU copies are
    asynchronous and the CUDA kernel can address the rows directly. Thread-safe.
    """

    def __init__(
        self,
        block_nbytes: int,
        max_blocks: int,
        device: str | torch.device = "cpu",
        *,
        pin_memory: bool | None = None,
        timeout_s: float = 5.0,
    ) -> None:
        if block_nbytes <= 0:
            raise ValueError(f"block_nbytes must be positive, got {block_nbytes}")
        if max_blocks <= 0:
            raise ValueError(f"max_blocks must be positive, got {max_blocks}")
        self.device = torch.device(device)
        if pin_memory is None:
            pin_memory = self.device.type == "cpu" and torch.cuda.is_available()
        if pin_memory and self.device.type != "cpu":
            raise ValueError(f"pin_memory applies to CPU staging pools, not {self.device}")
        if pin_memory and not torch.cuda.is_available():
            raise ValueError("pin_memory=True needs CUDA (this torch build has no GPU)")
        self.block_nbytes = block_nbytes
        self.max_blocks = max_blocks
        self.pinned = bool(pin_memory)
        self.timeout_s = timeout_s
        self._arena = torch.empty(
            (max_blocks, block_nbytes),
            dtype=torch.uint8,
            device=self.device,
            pin_memory=self.pinned,
        )
        self._cond = threading.Condition()
        #: Free row ranges ``(start, length)``, sorted by start, never adjacent (merged).
        self._free: list[tuple[int, int]] = [(0, max_blocks)]
        self._in_use = 0
        logger.debug(
            "staging pool: %d x %d B on %s (pinned=%s)",
            max_blocks,
            block_nbytes,
            self.device,
            self.pinned,
        )

    # -- introspection ---------------------------------------------------------------------
    @property
    def capacity_nbytes(self) -> int:
        return self.max_blocks * self.block_nbytes

    @property
    def free_blocks(self) -> int:
        """Rows free right now."""
        with self._cond:
            return sum(length for _, length in self._free)

    @property
    def in_use_blocks(self) -> int:
        """Rows of unreleased leases."""
        with self._cond:
            return self._in_use

    # -- acquire / release -----------------------------------------------------------------
    def acquire(self, n: int, *, timeout: float | None = None) -> StagingLease:
        """Lease ``n`` contiguous rows; waits up to ``timeout`` seconds (default: the pool's
        ``timeout_s``; 0 = do not wait) and then raises :class:`StagingPoolExhausted`.

        ``n`` larger than the pool raises ValueError at once (it could never succeed).
        """
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be a non-negative int, got {n!r}")
        if n > self.max_blocks:
            raise ValueError(f"cannot lease {n} rows from a pool of {self.max_blocks}")
        if n == 0:
            return StagingLease(self, 0, 0, self._arena[:0])
        wait_s = self.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + max(wait_s, 0.0)
        with self._cond:
            while True:
                start = self._take_locked(n)
                if start is not None:
                    self._in_use += n
                    return StagingLease(self, start, n, self._arena[start : start + n])
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise StagingPoolExhausted(
                        f"no {n} contiguous free rows in the staging pool after {wait_s:.3g} s "
                        f"({self._in_use} of {self.max_blocks} leased)"
                    )
                self._cond.wait(remaining)

    def _take_locked(self, n: int) -> int | None:
        for i, (start, length) in enumerate(self._free):
            if length >= n:
                if length == n:
                    del self._free[i]
                else:
                    self._free[i] = (start + n, length - n)
                return start
        return None

    def _put_locked(self, start: int, n: int) -> None:
        free = self._free
        i = 0
        while i < len(free) and free[i][0] < start:
            i += 1
        # Refuse a range that overlaps a free one: that would hand the same rows out twice.
        if i > 0 and free[i - 1][0] + free[i - 1][1] > start:
            raise RuntimeError(f"staging rows {start}..{start + n} released twice")
        if i < len(free) and start + n > free[i][0]:
            raise RuntimeError(f"staging rows {start}..{start + n} released twice")
        free.insert(i, (start, n))
        if i + 1 < len(free) and start + n == free[i + 1][0]:
            free[i] = (start, n + free[i + 1][1])
            del free[i + 1]
        if i > 0 and free[i - 1][0] + free[i - 1][1] == start:
            free[i - 1] = (free[i - 1][0], free[i - 1][1] + free[i][1])
            del free[i]

    def _give_back(self, start: int, n: int) -> None:
        if n == 0:
            return
        with self._cond:
            self._in_use -= n
            self._put_locked(start, n)
            self._cond.notify_all()

    def __repr__(self) -> str:
        return (
            f"StagingPool({self.max_blocks} x {self.block_nbytes} B on {self.device}, "
            f"pinned={self.pinned}, in use {self.in_use_blocks})"
        )

    def __getstate__(self) -> Any:
        raise TypeError("a StagingPool is process-local and cannot be pickled")
