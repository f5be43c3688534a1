"""kvray.kernels on CUDA: the one-launch CuPy kernel, the torch fallback, stream ordering.

Skipped without CUDA (and the CuPy tests without CuPy). Same rules as the CPU tests: random
bytes, bit-exact comparisons, the whole backing storage checked after every scatter.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kvcanon import to_canonical

from kvray.kernels import BlockMover, StagingPool, describe_kv_caches

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

FP8 = torch.float8_e4m3fn
DTYPES = [torch.bfloat16, torch.float16, torch.float32, FP8]
INT_OF = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
L, H, N, D, NB = 4, 2, 16, 64, 16


def _engines() -> list[str]:
    engines = ["torch"]
    try:
        from kvray.kernels.cuda_ops import cupy_available

        if cupy_available():
            engines.append("cupy")
    except ImportError:
        pass
    return engines


ENGINES = _engines()
#: vLLM's GPU KV layouts, built synthetically (one allocation, per-layer views).
KINDS = ["nhd", "hnd", "kv_first_nhd", "kv_first_hnd", "blocks_first_nhd", "block_major_nhd", "mla"]


def _caches(
    kind: str, dtype: torch.dtype, factor: int
) -> tuple[torch.Tensor, list[torch.Tensor], str]:
    """(raw uint8 storage, per-layer views, hint) in one allocation on the GPU."""
    nbk = NB * factor
    elem = torch.empty((), dtype=dtype).element_size()
    if kind == "nhd":  # vLLM >= 0.32 flash-attention default (LBNHC)
        phys = (L, nbk, N, H, 2 * D)
    elif kind == "hnd":
        phys = (L, nbk, H, N, 2 * D)
    elif kind == "kv_first_nhd":  # flash-attention's per-layer [2, blocks, N, H, D]
        phys = (L, 2, nbk, N, H, D)
    elif kind == "kv_first_hnd":
        phys = (L, 2, nbk, H, N, D)
    elif kind == "blocks_first_nhd":  # FlashInfer's [blocks, 2, N, H, D]
        phys = (L, nbk, 2, N, H, D)
    elif kind == "block_major_nhd":  # BLNHC: every block holds all layers
        phys = (nbk, L, N, H, 2 * D)
    else:  # mla
        phys = (L, nbk, N, 576)
    numel = int(np.prod(phys))
    raw = torch.empty(numel * elem, dtype=torch.uint8, device="cuda")
    raw.random_()
    t = raw.view(dtype).view(phys)
    if kind == "nhd":
        layers, hint = [t[i].permute(0, 2, 1, 3) for i in range(L)], "FLASH_ATTN"
    elif kind == "hnd":
        layers, hint = [t[i] for i in range(L)], "FLASHINFER"
    elif kind == "kv_first_nhd":
        layers, hint = [t[i] for i in range(L)], "FLASH_ATTN"
    elif kind == "kv_first_hnd":
        layers, hint = [t[i].permute(0, 1, 3, 2, 4) for i in range(L)], "FLASH_ATTN"
    elif kind == "blocks_first_nhd":
        layers, hint = [t[i] for i in range(L)], "FLASHINFER"
    elif kind == "block_major_nhd":
        layers, hint = [t[:, i].permute(0, 2, 1, 3) for i in range(L)], "FLASH_ATTN"
    else:
        layers, hint = [t[i] for i in range(L)], "FLASHMLA"
    return raw, layers, hint


def _expected(
    raw: torch.Tensor,
    layers: list[torch.Tensor],
    factor: int,
    bdim: int,
    src: list[int],
    dst: list[int],
) -> torch.Tensor:
    """``raw`` as it must look after copying KV blocks src -> dst (index ops, as integers)."""
    expected = raw.clone()
    _apply(expected, layers, factor, bdim, src, dst)
    return expected


def _apply(
    expected: torch.Tensor,
    layers: list[torch.Tensor],
    factor: int,
    bdim: int,
    src: list[int],
    dst: list[int],
) -> None:
    """Copy KV blocks src -> dst of ``layers`` (views of the storage ``expected`` copies) into
    ``expected``, reading the layers themselves."""
    ksrc = torch.tensor([b * factor + k for b in src for k in range(factor)], device="cuda")
    kdst = torch.tensor([b * factor + k for b in dst for k in range(factor)], device="cuda")
    for t in layers:
        itype = INT_OF[t.element_size()]
        # Same place in the copy: raw starts the storage, so offsets and strides carry over.
        e = expected.view(itype).as_strided(t.shape, t.stride(), t.storage_offset())
        e.index_copy_(bdim, kdst, t.view(itype).index_select(bdim, ksrc))


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("factor", [1, 2])
@pytest.mark.parametrize("host", [False, True], ids=["device_buf", "pinned_host_buf"])
def test_roundtrip(engine: str, kind: str, dtype: torch.dtype, factor: int, host: bool) -> None:
    raw, layers, hint = _caches(kind, dtype, factor)
    lay = describe_kv_caches(layers, block_size=N * factor, layout_hint=hint)
    mover = BlockMover(layers, lay, engine=engine)
    assert mover.engine == ("cupy" if engine == "cupy" else "torch-cuda")
    src, dst = [9, 3, 4, 5, 14], [0, 7, 8, 1, 15]
    n = len(src)
    if host:
        out = torch.full((n + 1, lay.block_nbytes), 0xA5, dtype=torch.uint8, pin_memory=True)
    else:
        out = torch.full((n + 1, lay.block_nbytes), 0xA5, dtype=torch.uint8, device="cuda")
    mover.gather(src, out[:n])
    assert bool((out[n] == 0xA5).all())
    # Same bytes as the CPU path produces from a CPU copy of the cache.
    cpu_layers = [t.cpu() for t in layers]
    cpu_lay = describe_kv_caches(cpu_layers, block_size=N * factor, layout_hint=hint)
    cpu_out = torch.empty(n, cpu_lay.block_nbytes, dtype=torch.uint8)
    BlockMover(cpu_layers, cpu_lay).gather(src, cpu_out)
    assert cpu_lay.fingerprint == lay.fingerprint
    assert torch.equal(out[:n].cpu(), cpu_out)
    bdim = 1 if kind.startswith("kv_first") else 0  # the block axis of each layer's view
    expected = _expected(raw, layers, factor, bdim, src, dst)
    mover.scatter(dst, out[:n])
    torch.cuda.synchronize()
    assert torch.equal(raw, expected)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("kind", ["nhd", "hnd", "kv_first_nhd", "blocks_first_nhd", "mla"])
def test_two_kv_cache_groups_sharing_their_tensors(engine: str, kind: str) -> None:
    """vLLM's hybrid manager on a GPU (full attention + sliding window, issue 34): every KV cache
    tensor is shared by one layer of each group (each layer its own view of it) and both
    groups' block ids come from one block pool, so they never overlap. kvray moves each group
    with its own mover over that group's views (``kvray.connector.grouped``): every group's
    blocks read back as a CPU copy of the cache reads them, and scattering both groups'
    blocks changes exactly their destination blocks of the shared storage, nothing else."""
    raw, layers, hint = _caches(kind, torch.bfloat16, 1)
    full = layers[:2]  # layers 2 and 3 belong to no group: they must stay as they are
    window = [t.as_strided(t.shape, t.stride(), t.storage_offset()) for t in full]
    assert all(w.data_ptr() == f.data_ptr() for w, f in zip(window, full, strict=True))
    moves = {"full": (full, [1, 4, 6], [10, 11, 12]), "window": (window, [2, 9], [13, 14])}
    bdim = 1 if kind.startswith("kv_first") else 0
    expected = raw.clone()
    bufs = {}
    for name, (group, src, dst) in moves.items():
        lay = describe_kv_caches(group, block_size=N, layout_hint=hint)
        mover = BlockMover(group, lay, engine=engine)
        bufs[name] = torch.empty(len(src), lay.block_nbytes, dtype=torch.uint8, device="cuda")
        mover.gather(src, bufs[name])
        cpu_group = [t.cpu() for t in group]
        cpu_lay = describe_kv_caches(cpu_group, block_size=N, layout_hint=hint)
        cpu_out = torch.empty(len(src), cpu_lay.block_nbytes, dtype=torch.uint8)
        BlockMover(cpu_group, cpu_lay).gather(src, cpu_out)
        assert torch.equal(bufs[name].cpu(), cpu_out), name
        _apply(expected, group, 1, bdim, src, dst)
    for name, (group, _src, dst) in moves.items():
        lay = describe_kv_caches(group, block_size=N, layout_hint=hint)
        BlockMover(group, lay, engine=engine).scatter(dst, bufs[name])
    torch.cuda.synchronize()
    assert torch.equal(raw, expected)


@pytest.mark.parametrize("engine", ENGINES)
def test_ordering_against_the_compute_stream(engine: str) -> None:
    _raw, layers, hint = _caches("nhd", torch.bfloat16, 1)
    lay = describe_kv_caches(layers, block_size=N, layout_hint=hint)
    mover = BlockMover(layers, lay, engine=engine)
    compute = torch.cuda.Stream()
    out = torch.empty(2, lay.block_nbytes, dtype=torch.uint8, pin_memory=True)
    with torch.cuda.stream(compute):
        # The "forward" writes block 3 late: the gather must see the write.
        torch.cuda._sleep(50_000_000)
        for t in layers:
            t[3].fill_(1.5)
        mover.gather([3, 4], out)
    canon = to_canonical(out, lay)
    assert bool((canon[0] == 1.5).all())
    # A scatter orders the compute stream after it: a read queued right after sees new data.
    src = torch.empty(1, lay.block_nbytes, dtype=torch.uint8, device="cuda")
    src.view(torch.int16).fill_(int(torch.tensor(2.5, dtype=torch.bfloat16).view(torch.int16)))
    with torch.cuda.stream(compute):
        torch.cuda._sleep(50_000_000)
        mover.scatter([6], src)
        seen = layers[0][6].clone()  # queued on compute after the scatter
    compute.synchronize()
    assert bool((seen == 2.5).all())


def test_pinned_staging_pool() -> None:
    _raw, layers, hint = _caches("hnd", torch.float16, 2)
    lay = describe_kv_caches(layers, block_size=2 * N, layout_hint=hint)
    mover = BlockMover(layers, lay)
    pool = StagingPool(lay.block_nbytes, 4, "cpu")
    assert pool.pinned
    lease = pool.acquire(4)
    with lease as buf:
        assert buf.is_pinned()
        mover.gather([0, 1, 2, 3], buf)
    with pool.acquire(4, timeout=5) as buf2:
        assert buf2.data_ptr() == buf.data_ptr()


def test_unpinned_host_buffer_still_works() -> None:
    _raw, layers, hint = _caches("nhd", torch.bfloat16, 1)
    lay = describe_kv_caches(layers, block_size=N, layout_hint=hint)
    for engine in ENGINES:
        mover = BlockMover(layers, lay, engine=engine)
        out = torch.empty(3, lay.block_nbytes, dtype=torch.uint8)
        mover.gather([1, 2, 3], out)
        dev = torch.empty(3, lay.block_nbytes, dtype=torch.uint8, device="cuda")
        mover.gather([1, 2, 3], dev)
        assert torch.equal(out, dev.cpu())


def test_bad_input_on_cuda() -> None:
    _raw, layers, hint = _caches("nhd", torch.bfloat16, 1)
    lay = describe_kv_caches(layers, block_size=N, layout_hint=hint)
    mover = BlockMover(layers, lay)
    buf = torch.empty(2, lay.block_nbytes, dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError, match="out of range"):
        mover.gather([0, NB], buf)
    with pytest.raises(ValueError, match="too small"):
        mover.scatter([0, 1, 2], buf)
    with pytest.raises(ValueError, match="uint8"):
        mover.gather([0, 1], buf.view(torch.int16))
