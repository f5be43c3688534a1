"""``BlockMover``: the connector's one entry point for moving kvray blocks in and out of vLLM.

It validates every call (a wrong buffer or block id would silently corrupt the KV cache of
unrelated requests), picks the fastest engine for the device (torch on the CPU; the one-launch
CuPy kernel on CUDA, torch when CuPy is missing) and, on CUDA, orders transfers against the
compute stream:

* a gather runs on a side stream after the work already queued on the compute stream (the
  forward that wrote the blocks) and returns once it is done;
* a scatter waits for the compute stream too, and then makes the compute stream wait for the
  scatter, so attention enqueued afterwards reads the loaded blocks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from kvray.kernels.plan import CopyPlan, build_copy_plan
from kvray.kernels.shape import KVCacheLayout
from kvray.kernels.torch_ops import RowsHook, TorchMover

logger = logging.getLogger(__name__)

__all__ = ["BlockMover", "as_block_ids"]

BlockIds = Sequence[int] | np.ndarray | torch.Tensor


def as_block_ids(block_ids: Any, num_blocks: int, *, unique: bool) -> np.ndarray:
    """Block ids as a 1-D int64 array, checked against ``range(num_blocks)``.

    ``unique`` refuses repeated ids (a scatter with repeats has no defined result).
    """
    if isinstance(block_ids, torch.Tensor):
        if block_ids.dtype.is_floating_point or block_ids.dtype == torch.bool:
            raise ValueError(f"block ids must be integers, got a {block_ids.dtype} tensor")
        arr = block_ids.detach().to("cpu", torch.int64).numpy().reshape(-1)
    else:
        try:
            arr = np.asarray(block_ids)
        except Exception as exc:
            raise ValueError(f"block ids must be a sequence of ints: {exc}") from exc
        if arr.size == 0:
            arr = arr.astype(np.int64)
        if arr.ndim != 1:
            raise ValueError(f"block ids must be a flat sequence, got shape {arr.shape}")
        if arr.dtype.kind not in "iu":
            raise ValueError(f"block ids must be ints, got {arr.dtype} values")
        arr = arr.astype(np.int64, copy=False)
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= num_blocks:
            bad = lo if lo < 0 else hi
            raise ValueError(f"block id {bad} out of range [0, {num_blocks})")
        if unique and np.unique(arr).size != arr.size:
            raise ValueError("block ids of a scatter must be distinct")
    return np.ascontiguousarray(arr)


class BlockMover:
    """Gather (cache -> buffer) and scatter (buffer -> cache) of whole kvray blocks.

    ``kv_caches`` are the per-layer tensors of one KV cache group, in the same order as when
    ``layout`` was described. A buffer is a contiguous uint8 tensor ``[n, layout.block_nbytes]``
    (extra rows are ignored), on the cache's device or, for CUDA caches, on the host (pinned
    memory keeps the transfer asynchronous and lets the kernel access it directly).

    ``engine``: ``"auto"`` (CuPy kernel on CUDA when importable, else torch), ``"torch"`` or
    ``"cupy"`` (ImportError when CuPy is missing). ``torch_strategy`` (tests, benchmarks):
    ``"auto"``, ``"loop"``, ``"index"`` or ``"threads"`` (CPU only), see
    :class:`~kvray.kernels.torch_ops.TorchMover`.
    """

    def __init__(
        self,
        kv_caches: Mapping[str, torch.Tensor] | Sequence[torch.Tensor],
        layout: KVCacheLayout,
        *,
        engine: str = "auto",
        torch_strategy: str = "auto",
    ) -> None:
        if engine not in ("auto", "torch", "cupy"):
            raise ValueError(f"engine must be 'auto', 'torch' or 'cupy', got {engine!r}")
        self.layout = layout
        self.plan: CopyPlan = build_copy_plan(kv_caches, layout)
        self.device = self.plan.device
        self._torch = TorchMover(self.plan, torch_strategy)
        self._cupy: Any = None
        self._stream: torch.cuda.Stream | None = None
        if self.device.type == "cuda":
            self._stream = torch.cuda.Stream(device=self.device)
            if engine in ("auto", "cupy"):
                from kvray.kernels.cuda_ops import CupyMover, cupy_available

                if engine == "cupy" or cupy_available():
                    self._cupy = CupyMover(self.plan)
        elif engine == "cupy":
            raise ValueError("engine='cupy' needs CUDA KV caches")
        self.engine = "cupy" if self._cupy is not None else f"torch-{self.device.type}"
        logger.info(
            "BlockMover for %s on %s: engine %s, %d chunk(s)/layer-block, shared allocation: %s",
            layout.fingerprint,
            self.device,
            self.engine,
            self.plan.num_chunks,
            self.plan.layer_stride is not None,
        )

    # -- validation ------------------------------------------------------------------------
    def _check_buffer(self, buf: Any, n: int, name: str) -> torch.Tensor:
        nbytes = self.layout.block_nbytes
        if not isinstance(buf, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(buf).__name__}")
        if buf.dtype != torch.uint8:
            raise ValueError(f"{name} must be uint8, got {buf.dtype}")
        if buf.dim() == 3 and name == "src":
            return self._check_layer_view(buf, n)
        if buf.dim() != 2 or buf.shape[1] != nbytes:
            raise ValueError(f"{name} must be [n, block_nbytes={nbytes}], got {list(buf.shape)}")
        if buf.shape[0] < n:
            raise ValueError(f"{name} too small: {buf.shape[0]} rows for {n} blocks of {nbytes} B")
        if not buf.is_contiguous():
            raise ValueError(f"{name} must be contiguous (row-major [n, block_nbytes])")
        if buf.device != self.device and not (
            self.device.type == "cuda" and buf.device.type == "cpu"
        ):
            raise ValueError(f"{name} is on {buf.device}, the KV cache on {self.device}")
        return buf[:n]

    def _check_layer_view(self, src: torch.Tensor, n: int) -> torch.Tensor:
        """A scatter source given as ``[n, num_layers, layer_block_nbytes]`` with any row and
        layer strides (e.g. a head window of bigger stored blocks): CPU caches only."""
        shape = (self.layout.num_layers, self.layout.layer_block_nbytes)
        if tuple(src.shape[1:]) != shape or src.stride(2) != 1:
            raise ValueError(
                f"src must be [n, {shape[0]}, {shape[1]}] with contiguous layer parts, got "
                f"{list(src.shape)} with strides {src.stride()}"
            )
        if self.device.type != "cpu" or src.device.type != "cpu":
            raise ValueError("a strided [n, layers, bytes] source is for CPU caches")
        if src.shape[0] < n:
            raise ValueError(f"src too small: {src.shape[0]} rows for {n} blocks")
        return src[:n]

    # -- synchronous -----------------------------------------------------------------------
    def gather(self, block_ids: BlockIds, out: torch.Tensor) -> None:
        """Copy KV blocks ``block_ids`` (all layers) into ``out[i]``; returns when done."""
        ids = as_block_ids(block_ids, self.layout.num_blocks, unique=False)
        dst = self._check_buffer(out, len(ids), "out")
        if self.device.type == "cuda":
            self._cuda_transfer(ids, dst, to_buffer=True)()
            return
        self._torch.gather(ids, dst)

    def scatter(
        self,
        block_ids: BlockIds,
        src: torch.Tensor,
        on_rows: RowsHook | None = None,
        *,
        layers: tuple[int, int] | None = None,
    ) -> None:
        """Copy ``src[i]`` into KV block ``block_ids[i]`` (all layers); returns when done.

        ``src`` is ``[n, block_nbytes]`` (contiguous), or on the CPU a ``[n, num_layers,
        layer_block_nbytes]`` view with any row and layer strides (a head window of stored
        blocks, :func:`kvray.kernels.heads.window`), copied without an intermediate buffer.

        On CUDA the compute stream is also ordered after the scatter. ``on_rows(pos, length)``
        is called for every row of ``src`` once it is no longer needed in the CPU's cache for
        the copy: on the CPU by the copy thread right after copying those rows (a checksum of
        them then reads cached bytes), on CUDA for all rows while the device copies.

        ``layers=(lo, hi)``: copy only those layers of each block (CPU caches), so a load can
        run layer by layer ahead of the forward pass."""
        if layers is not None:
            lo, hi = layers
            if self.device.type != "cpu":
                raise ValueError("a scatter of a layer range is for CPU caches")
            if not 0 <= lo < hi <= self.layout.num_layers:
                raise ValueError(f"layers must be 0 <= lo < hi <= {self.layout.num_layers}")
        ids = as_block_ids(block_ids, self.layout.num_blocks, unique=True)
        srcv = self._check_buffer(src, len(ids), "src")
        if self.device.type == "cuda":
            wait = self._cuda_transfer(ids, srcv, to_buffer=False)
            try:
                if on_rows is not None:
                    on_rows(0, len(ids))
            finally:
                wait()
            return
        self._torch.scatter(ids, srcv, on_rows=on_rows, layers=layers)

    # -- CUDA ------------------------------------------------------------------------------
    def _cuda_transfer(
        self, ids: np.ndarray, buf: torch.Tensor, *, to_buffer: bool
    ) -> Callable[[], None]:
        """Enqueue a gather (``to_buffer``) or a scatter on the side stream; returns the
        function that waits for it, which keeps the tensors the transfer uses (ids,
        temporaries) alive until then, so the caching allocators cannot recycle them early."""
        assert self._stream is not None
        side = self._stream
        compute = torch.cuda.current_stream(self.device)
        keep: list[Any] = [buf]
        n = len(ids)
        # The side stream starts after everything already queued on the compute stream: a
        # gather must read what the forward wrote; a scatter must not overwrite blocks the
        # previous step's kernels may still read.
        side.wait_stream(compute)
        with torch.cuda.stream(side):
            if n:
                host_ids = torch.from_numpy(ids).pin_memory()
                dev_ids = host_ids.to(self.device, non_blocking=True)
                keep += [host_ids, dev_ids]
                direct = buf.device.type == "cuda" or (self._cupy is not None and buf.is_pinned())
                if buf.device.type == "cuda":
                    buf.record_stream(side)
                if direct:
                    self._launch(dev_ids, ids, buf, to_buffer=to_buffer)
                else:
                    # Host buffer the device cannot address (or torch engine): stage on device.
                    tmp = torch.empty(buf.shape, dtype=torch.uint8, device=self.device)
                    keep.append(tmp)
                    pinned = buf.is_pinned()
                    if not to_buffer:
                        tmp.copy_(buf, non_blocking=pinned)
                    self._launch(dev_ids, ids, tmp, to_buffer=to_buffer)
                    if to_buffer:
                        buf.copy_(tmp, non_blocking=pinned)
            event = torch.cuda.Event()
            event.record(side)
        if not to_buffer:
            # Attention queued after this call reads the scattered blocks.
            compute.wait_event(event)

        def wait() -> None:
            event.synchronize()
            keep.clear()

        return wait

    def _launch(
        self, dev_ids: torch.Tensor, host_ids: np.ndarray, buf: torch.Tensor, *, to_buffer: bool
    ) -> None:
        """Enqueue on the current (side) stream, with the kernel or with torch ops."""
        if self._cupy is not None:
            assert self._stream is not None
            self._cupy.launch(dev_ids, buf, to_buffer=to_buffer, stream=self._stream)
        elif to_buffer:
            self._torch.gather(host_ids, buf, dev_ids)
        else:
            self._torch.scatter(host_ids, buf, dev_ids)

    def __repr__(self) -> str:
        return f"BlockMover({self.layout.fingerprint}, device={self.device}, engine={self.engine})"
