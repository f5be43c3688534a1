"""Gather / scatter without a custom kernel: the CPU path, and the CUDA path when CuPy is absent.

Speed comes from never touching a byte twice: the block buffer's byte order is the cache's
physical order (see :mod:`kvray.kernels.layout`), so data moves straight between the cache and
the buffer, all layers at once through one strided view when the layers share an allocation.

Strategies, measured on a 2-core CPU shared with other jobs (32 layers x 64 KiB pages, 64 random
blocks; fractions of one plain torch ``copy_`` of the same bytes, in the same run):

``threads`` (the CPU default from 1 MiB per call)
    numpy ``copyto`` of ~1 MiB pieces (runs of consecutive blocks, or a block's layer range)
    taken from a shared queue by ``torch.get_num_threads()`` threads (at most 8; the caller is
    one). numpy releases the GIL while it copies and nothing waits on a fixed split, so a busy
    core slows it down instead of stalling it: 0.65-1.0 on a quiet machine, 0.5-1.6 while other
    jobs run (the plain copy degrades too).
``loop``
    one strided torch ``copy_`` per run: 0.7-0.85 quiet, but every copy is an OpenMP parallel
    region with a static split, and with a core taken by another process each region waits for
    the descheduled thread: 0.05-0.4 under load. Used for small copies made of few runs.
``index``
    one ``index_select`` (gather) / ``index_copy_`` (scatter) over the all-layer view: gather
    0.78-0.87 quiet but 0.04 under load; CPU ``index_copy_`` copies element by element (0.15,
    about 2.4 GB/s). Used for small CPU copies of many short runs, and always on CUDA (torch
    engine), where each direction is one kernel.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from kvray.kernels.plan import CopyPlan

logger = logging.getLogger(__name__)

__all__ = ["RowsHook", "TorchMover", "block_runs"]

_STRATEGIES = ("auto", "loop", "index", "threads")

#: ``on_rows(pos, length)``: buffer rows ``pos:pos+length`` were just copied.
RowsHook = Callable[[int, int], None]

#: CPU copies of at least this many bytes go to the copy threads.
_MIN_THREADED_BYTES = 1 << 20
#: More threads than this do not add memory bandwidth, they only take cores from the model.
_MAX_COPY_THREADS = 8
#: Size of the pieces the copy threads take one at a time.
_PIECE_BYTES = 1 << 20

#: Below this many bytes per run a scatter loop's per-op overhead beats ``index_copy_``.
_MIN_SCATTER_RUN_BYTES = 4 << 10
#: A gather loops over runs when they average at least this many blocks.
_MIN_GATHER_RUN_BLOCKS = 8


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _forget_pool_after_fork() -> None:
    """A forked child has none of the parent's threads: start a fresh pool there."""
    global _pool, _pool_lock
    _pool = None
    _pool_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_after_fork)


def _copy_pool() -> ThreadPoolExecutor:
    """The process's copy threads, shared by all movers; the calling thread is always one of
    the copiers, so the pool holds at most ``_MAX_COPY_THREADS - 1`` (started on demand)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(
                max_workers=_MAX_COPY_THREADS - 1, thread_name_prefix="kvray-copy"
            )
        return _pool


def block_runs(block_ids: np.ndarray) -> list[tuple[int, int, int]]:
    """Split block ids into runs of consecutive ids: ``(position, first_id, length)``."""
    n = len(block_ids)
    if n == 0:
        return []
    breaks = np.flatnonzero(np.diff(block_ids) != 1) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [n])))
    return list(zip(starts.tolist(), block_ids[starts].tolist(), lengths.tolist(), strict=True))


class TorchMover:
    """Moves kvray blocks between the caches described by ``plan`` and uint8 buffers on the
    same device (torch ops, or numpy in threads on the CPU). Inputs are validated by
    :class:`~kvray.kernels.mover.BlockMover`."""

    def __init__(self, plan: CopyPlan, strategy: str = "auto") -> None:
        if strategy not in _STRATEGIES:
            raise ValueError(f"strategy must be one of {_STRATEGIES}, got {strategy!r}")
        if strategy == "threads" and plan.device.type != "cpu":
            raise ValueError("strategy 'threads' is for CPU caches")
        self.plan = plan
        #: "auto", "loop", "index" or "threads" (see the module docstring).
        self.strategy = strategy
        layout = plan.layout
        self._combined = plan.combined_view()
        self._layer_views = (
            None
            if self._combined is not None
            else [plan.layer_view(i) for i in range(layout.num_layers)]
        )
        self._block_shape = (layout.num_layers, *plan.grid_sizes, plan.chunk_nbytes)
        self._on_cpu = plan.device.type == "cpu"
        self._threads = max(1, min(torch.get_num_threads(), _MAX_COPY_THREADS))
        self._combined_np = (
            self._combined.numpy() if self._on_cpu and self._combined is not None else None
        )
        self._layers_np = (
            [v.numpy() for v in self._layer_views]
            if self._on_cpu and self._layer_views is not None
            else None
        )

    # -- helpers ---------------------------------------------------------------------------
    def _buffer_view(self, buf: torch.Tensor, n: int) -> torch.Tensor:
        """``[n, layers, *grid, chunk]`` over a ``[n, block_nbytes]`` buffer or a strided
        ``[n, layers, layer_nbytes]`` source (its last axis contiguous: it splits in place)."""
        if buf.dim() == 3:
            return buf[:n].view(n, *self._block_shape)
        return buf.view(n, *self._block_shape)

    def _use_loop(self, runs: list[tuple[int, int, int]], n: int, *, gather: bool) -> bool:
        """A loop of per-run copies, or one batched index op (see the module docstring)."""
        if self.strategy != "auto":
            return self.strategy == "loop"
        if len(runs) <= 1:
            return True
        if not self._on_cpu:
            return False
        if gather:
            return n >= _MIN_GATHER_RUN_BLOCKS * len(runs)
        unit = (
            self.plan.layout.layer_block_nbytes
            if self._layer_views is not None
            else self.plan.layout.block_nbytes
        )
        return n * unit >= _MIN_SCATTER_RUN_BYTES * len(runs)

    def _use_threads(self, n: int, layers: int | None = None) -> bool:
        """numpy copies in threads: CPU, and enough bytes to pay for the thread hand-off
        (``n`` blocks, or ``layers`` layers of each)."""
        if self.strategy != "auto":
            return self.strategy == "threads"
        layout = self.plan.layout
        per_block = layout.block_nbytes if layers is None else layers * layout.layer_block_nbytes
        return self._on_cpu and n * per_block >= _MIN_THREADED_BYTES

    def _index(self, block_ids: np.ndarray, device_ids: torch.Tensor | None) -> torch.Tensor:
        if device_ids is not None:
            return device_ids
        idx = torch.from_numpy(block_ids)
        if not self._on_cpu:
            idx = idx.to(self.plan.device, non_blocking=True)
        return idx

    def _threaded(
        self,
        runs: list[tuple[int, int, int]],
        buf: torch.Tensor,
        n: int,
        *,
        to_buffer: bool,
        on_rows: RowsHook | None = None,
        layer_range: tuple[int, int] | None = None,
    ) -> None:
        """Copy with numpy in up to ``self._threads`` threads (the caller's thread is one).

        The work is cut into pieces of about ``_PIECE_BYTES`` (a few blocks, or part of a
        block's layers) that the threads take from a shared iterator: when another process
        holds a core, the threads that run take over its pieces instead of waiting for it (the
        static split of an OpenMP loop is what makes torch's copies collapse then). Returns
        only when every thread is done, exception or not.

        ``on_rows(pos, length)`` is called by the thread that copied buffer rows
        ``pos:pos+length`` (their first layers), right after the copy: a caller that must also
        read those rows (checksums) finds them in the CPU cache instead of reading them from
        memory a second time.
        """
        buf_np = self._buffer_view(buf, n).numpy()
        combined, layers = self._combined_np, self._layers_np
        layout = self.plan.layout
        threads = self._threads
        first_layer, end_layer = layer_range or (0, layout.num_layers)
        num_layers = end_layer - first_layer
        moved_nbytes = num_layers * layout.layer_block_nbytes  # per block
        per_piece = max(1, _PIECE_BYTES // moved_nbytes)
        # Split each block's layers when a block alone is bigger than a piece.
        parts = min(num_layers, max(1, moved_nbytes // _PIECE_BYTES))
        bounds = [
            (first_layer + k * num_layers // parts, first_layer + (k + 1) * num_layers // parts)
            for k in range(parts)
        ]
        pieces = [
            (pos + k, first + k, min(per_piece, length - k), lo, hi)
            for pos, first, length in runs
            for k in range(0, length, per_piece)
            for lo, hi in bounds
        ]

        def copy(dst: np.ndarray, src: np.ndarray) -> None:
            np.copyto(dst, src) if to_buffer else np.copyto(src, dst)

        todo = iter(pieces)

        def work() -> None:
            for pos, first, length, lo, hi in todo:
                b = buf_np[pos : pos + length]
                if combined is not None:
                    copy(b[:, lo:hi], combined[first : first + length, lo:hi])
                else:
                    assert layers is not None
                    for layer in range(lo, hi):
                        copy(b[:, layer], layers[layer][first : first + length])
                if on_rows is not None and lo == first_layer:
                    on_rows(pos, length)

        helpers = min(threads, len(pieces)) - 1
        futures: list[Future[None]] = []
        if helpers > 0:
            pool = _copy_pool()
            futures = [pool.submit(work) for _ in range(helpers)]
        try:
            work()
        finally:
            for fut in futures:
                fut.result()

    # -- public ----------------------------------------------------------------------------
    def gather(
        self, block_ids: np.ndarray, out: torch.Tensor, device_ids: torch.Tensor | None = None
    ) -> None:
        """``out[i] = block block_ids[i]`` (all layers); ``out`` is ``[n, block_nbytes]``.

        ``device_ids``: the same ids already on the cache's device (saves a copy on CUDA)."""
        n = len(block_ids)
        if n == 0:
            return
        dst = self._buffer_view(out, n)
        runs = block_runs(block_ids)
        if self._use_threads(n):
            self._threaded(runs, out, n, to_buffer=True)
            return
        loop = self._use_loop(runs, n, gather=True)
        if self._combined is not None:
            if loop:
                for pos, first, length in runs:
                    dst[pos : pos + length].copy_(self._combined[first : first + length])
            else:
                torch.index_select(self._combined, 0, self._index(block_ids, device_ids), out=dst)
            return
        assert self._layer_views is not None
        idx = None if loop else self._index(block_ids, device_ids)
        for layer, view in enumerate(self._layer_views):
            dst_l = dst[:, layer]
            if idx is None:
                for pos, first, length in runs:
                    dst_l[pos : pos + length].copy_(view[first : first + length])
            else:
                torch.index_select(view, 0, idx, out=dst_l)

    def scatter(
        self,
        block_ids: np.ndarray,
        src: torch.Tensor,
        device_ids: torch.Tensor | None = None,
        on_rows: RowsHook | None = None,
        layers: tuple[int, int] | None = None,
    ) -> None:
        """Block ``block_ids[i]`` ``= src[i]``; ids must be distinct.

        ``layers``: only layers ``[lo, hi)`` of each block (a layer-by-layer load), else all.
        ``on_rows(pos, length)``: see :meth:`_threaded`; without the copy threads it is called
        once for all rows, after the copy."""
        n = len(block_ids)
        if n == 0:
            return
        lo, hi = layers if layers is not None else (0, self.plan.layout.num_layers)
        srcv = self._buffer_view(src, n)
        runs = block_runs(block_ids)
        if self._use_threads(n, hi - lo):
            self._threaded(runs, src, n, to_buffer=False, on_rows=on_rows, layer_range=(lo, hi))
            return
        self._scatter_ops(block_ids, srcv, runs, device_ids, lo, hi)
        if on_rows is not None:
            on_rows(0, n)

    def _scatter_ops(
        self,
        block_ids: np.ndarray,
        srcv: torch.Tensor,
        runs: list[tuple[int, int, int]],
        device_ids: torch.Tensor | None,
        lo: int,
        hi: int,
    ) -> None:
        n = len(block_ids)
        loop = self._use_loop(runs, n, gather=False)
        if self._combined is not None:
            every = lo == 0 and hi == self.plan.layout.num_layers
            combined = self._combined if every else self._combined[:, lo:hi]
            src = srcv if every else srcv[:, lo:hi]
            if loop:
                for pos, first, length in runs:
                    combined[first : first + length].copy_(src[pos : pos + length])
            else:
                combined.index_copy_(0, self._index(block_ids, device_ids), src)
            return
        assert self._layer_views is not None
        idx = None if loop else self._index(block_ids, device_ids)
        for layer in range(lo, hi):
            view = self._layer_views[layer]
            src_l = srcv[:, layer]
            if idx is None:
                for pos, first, length in runs:
                    view[first : first + length].copy_(src_l[pos : pos + length])
            else:
                view.index_copy_(0, idx, src_l)
