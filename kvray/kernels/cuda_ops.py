"""One-launch CUDA gather / scatter with a CuPy ``RawKernel`` (optional; imported lazily).

A torch fallback needs one op per layer (or a batched index op with extra passes); a KV save of
64 blocks x 32 layers is then dozens of launches on a stream the forward is waiting for. This
kernel moves every (block, layer, chunk) of a call in one launch: it reads a table of layer base
addresses (like vLLM's hf3fs ``gather_kv_caches``), the block ids and the chunk offsets of the
layout, and copies with the widest word (up to 16 bytes) that every address allows. Dtypes do not
matter: everything is bytes, so fp8 caches move exactly.

CuPy is optional: nothing here imports it until a :class:`CupyMover` is built, and
:func:`cupy_available` never raises.
"""

from __future__ import annotations

import logging
import math
from functools import cache
from typing import Any

import numpy as np
import torch

from kvray.kernels.plan import CopyPlan

logger = logging.getLogger(__name__)

__all__ = ["KERNEL_SOURCE", "CupyMover", "cupy_available", "kernel_source"]

#: Word types by width in bytes.
_WORD_TYPES = {
    16: "uint4",
    8: "unsigned long long",
    4: "unsigned int",
    2: "unsigned short",
    1: "unsigned char",
}

#: The kernel, with ``word_t`` and the function name filled in per word width.
#:
#: Work item ``task`` = (row * n_layers + layer) * n_chunks + chunk, one thread block per item
#: (grid-stride). The staging buffer is row-major ``[n_rows, n_layers, n_chunks, chunk]``, so the
#: item's buffer words start at ``task * chunk_words``; its cache bytes start at
#: ``layer_ptrs[layer] + block_ids[row] * kv_block_stride + chunk_offs[chunk]``. All arithmetic is
#: 64-bit: a KV cache is easily larger than 4 GiB.
KERNEL_SOURCE = r"""
typedef WORD_T word_t;

extern "C" __global__ void KERNEL_NAME(
    const long long* __restrict__ layer_ptrs,
    const long long* __restrict__ block_ids,
    const long long* __restrict__ chunk_offs,
    unsigned char* __restrict__ buf,
    const long long n_rows,
    const long long n_layers,
    const long long n_chunks,
    const long long chunk_words,
    const long long kv_block_stride,
    const int to_buffer)
{
    const long long n_tasks = n_rows * n_layers * n_chunks;
    for (long long task = blockIdx.x; task < n_tasks; task += gridDim.x) {
        const long long chunk = task % n_chunks;
        const long long rest = task / n_chunks;
        const long long layer = rest % n_layers;
        const long long row = rest / n_layers;
        unsigned char* cache_bytes = reinterpret_cast<unsigned char*>(layer_ptrs[layer])
            + block_ids[row] * kv_block_stride + chunk_offs[chunk];
        word_t* cache_words = reinterpret_cast<word_t*>(cache_bytes);
        word_t* buf_words = reinterpret_cast<word_t*>(buf) + task * chunk_words;
        if (to_buffer) {
            for (long long w = threadIdx.x; w < chunk_words; w += blockDim.x) {
                buf_words[w] = cache_words[w];
            }
        } else {
            for (long long w = threadIdx.x; w < chunk_words; w += blockDim.x) {
                cache_words[w] = buf_words[w];
            }
        }
    }
}
"""

_MAX_GRID = 65535 * 4
_MAX_THREADS = 256


def kernel_source(width: int) -> tuple[str, str]:
    """(source, function name) of the kernel copying ``width``-byte words."""
    name = f"kvray_move_w{width}"
    src = KERNEL_SOURCE.replace("WORD_T", _WORD_TYPES[width]).replace("KERNEL_NAME", name)
    return src, name


def cupy_available() -> bool:
    """True when CuPy imports and sees a CUDA device (never raises)."""
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount()) > 0
    except Exception as exc:  # ImportError, CUDARuntimeError, driver mismatches...
        logger.debug("CuPy unavailable: %s", exc)
        return False


@cache
def _kernel(width: int) -> Any:
    import cupy

    src, name = kernel_source(width)
    return cupy.RawKernel(src, name)


def _cupy_stream(cupy: Any, stream: torch.cuda.Stream, device_index: int) -> Any:
    """CuPy's view of a torch CUDA stream, to launch on it.

    CuPy 14 deprecates ``ExternalStream`` for ``Stream.from_external`` (the CUDA stream protocol,
    ``__cuda_stream__``, which torch's streams implement in recent releases); CuPy 13 has only
    ``ExternalStream``. Either way the stream stays torch's: CuPy does not own or destroy it.
    """
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None and hasattr(stream, "__cuda_stream__"):
        return from_external(stream)
    return cupy.cuda.ExternalStream(stream.cuda_stream, device_index)


def launch_config(n_tasks: int, chunk_words: int) -> tuple[int, int]:
    """(grid, threads): one thread block per work item up to a cap (the kernel grid-strides),
    and at most 256 threads, fewer (whole warps) for small chunks."""
    threads = min(_MAX_THREADS, max(32, -(-chunk_words // 32) * 32))
    grid = max(1, min(n_tasks, _MAX_GRID))
    return grid, threads


def word_width(*values: int) -> int:
    """Widest word (16, 8, 4, 2 or 1 bytes) dividing every address / size in ``values``."""
    g = 0
    for v in values:
        g = math.gcd(g, int(v))
    for w in (16, 8, 4, 2):
        if g % w == 0:
            return w
    return 1


class CupyMover:
    """Launches the kernel for one :class:`CopyPlan` on a given CUDA stream.

    Ordering and lifetimes are the caller's (:class:`~kvray.kernels.mover.BlockMover`): this
    class only enqueues work. ``buf`` may be device memory or pinned host memory (mapped into
    the device's address space under UVA, so the kernel reads / writes it directly).
    """

    def __init__(self, plan: CopyPlan) -> None:
        if plan.device.type != "cuda":
            raise ValueError(f"CupyMover needs CUDA tensors, got {plan.device}")
        import cupy  # noqa: F401 -- fail early with ImportError when absent

        self.plan = plan
        self.device = plan.device
        ptrs = plan.layer_ptrs()
        self._layer_ptrs = torch.tensor(ptrs, dtype=torch.int64, device=self.device)
        self._chunk_offs = torch.tensor(plan.chunk_offsets, dtype=torch.int64, device=self.device)
        # Alignment every call shares; the buffer address is folded in per call.
        self._static_width = word_width(
            plan.chunk_nbytes, plan.kv_block_stride, *ptrs, *plan.chunk_offsets
        )
        self._n_layers = plan.layout.num_layers

    def launch(
        self,
        block_ids: torch.Tensor,
        buf: torch.Tensor,
        *,
        to_buffer: bool,
        stream: torch.cuda.Stream,
    ) -> None:
        """Enqueue one gather (``to_buffer``) or scatter of ``len(block_ids)`` blocks.

        ``block_ids`` is an int64 CUDA tensor; ``buf`` a contiguous uint8 tensor of at least
        ``len(block_ids)`` rows of ``block_nbytes``.
        """
        import cupy

        n = int(block_ids.numel())
        if n == 0:
            return
        plan = self.plan
        width = word_width(self._static_width, buf.data_ptr())
        chunk_words = plan.chunk_nbytes // width
        n_tasks = n * self._n_layers * plan.num_chunks
        grid, threads = launch_config(n_tasks, chunk_words)
        args = (
            np.uint64(self._layer_ptrs.data_ptr()),
            np.uint64(block_ids.data_ptr()),
            np.uint64(self._chunk_offs.data_ptr()),
            np.uint64(buf.data_ptr()),
            np.int64(n),
            np.int64(self._n_layers),
            np.int64(plan.num_chunks),
            np.int64(chunk_words),
            np.int64(plan.kv_block_stride),
            np.int32(1 if to_buffer else 0),
        )
        kernel = _kernel(width)
        device_index = self.device.index if self.device.index is not None else 0
        with cupy.cuda.Device(device_index), _cupy_stream(cupy, stream, device_index):
            kernel((grid,), (threads,), args)
