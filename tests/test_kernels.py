"""kvray.kernels on the CPU: layout detection, gather / scatter, staging pool.

Every cache is filled with random bytes (never zeros), every comparison is bit-exact, and every
scatter is checked against the whole backing storage, so a byte written outside the named blocks
(or a block not written) fails the test. References are written the slow, obvious way: element
by element from the layout's documented meaning, not with the code under test.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from kvcanon import from_canonical, to_canonical

from kvray.kernels import (
    BlockMover,
    KVCacheLayout,
    StagingPool,
    StagingPoolExhausted,
    describe_kv_caches,
    make_layout,
    torch_ops,
)
from kvray.kernels.cuda_ops import kernel_source, launch_config, word_width
from kvray.kernels.layout import CopyPlan, build_copy_plan
from kvray.kernels.torch_ops import block_runs

FP8 = torch.float8_e4m3fn
DTYPES = [torch.bfloat16, torch.float16, torch.float32, FP8]
INT_OF = {1: torch.uint8, 2: torch.int16, 4: torch.int32}

# Small model shard: 3 layers, 2 KV heads, 4 tokens per kernel block, head size 8.
L, H, N, D = 3, 2, 4, 8
NB = 8  # KV blocks


def bits(t: torch.Tensor) -> torch.Tensor:
    """Same bytes as integers, so NaN payloads compare exactly."""
    return t.contiguous().view(INT_OF[t.element_size()])


# ----------------------------------------------------------------------------------------------
# Test caches: every layout, several allocation styles
# ----------------------------------------------------------------------------------------------

# kind -> (physical per-layer shape with B = kernel blocks, block dim in the physical shape,
#          permutation from physical to the logical view vLLM hands out, hint)
KINDS: dict[str, tuple[Callable[[int], tuple[int, ...]], int, tuple[int, ...], str]] = {
    "cpu_kv_interleaved": (lambda b: (b, H, N, 2 * D), 0, (0, 1, 2, 3), "CPU_ATTN:vec"),
    "hnd": (lambda b: (b, H, N, 2 * D), 0, (0, 1, 2, 3), "FLASHINFER"),
    "nhd": (lambda b: (b, N, H, 2 * D), 0, (0, 2, 1, 3), "FLASH_ATTN"),
    "kv_first_nhd": (lambda b: (2, b, N, H, D), 1, (0, 1, 2, 3, 4), "FLASH_ATTN"),
    "kv_first_hnd": (lambda b: (2, b, H, N, D), 1, (0, 1, 3, 2, 4), "FLASH_ATTN"),
    "blocks_first_nhd": (lambda b: (b, 2, N, H, D), 0, (0, 1, 2, 3, 4), "FLASHINFER"),
    "blocks_first_hnd": (lambda b: (b, 2, H, N, D), 0, (0, 1, 3, 2, 4), "FLASHINFER"),
    "mla": (lambda b: (b, N, D), 0, (0, 1, 2), "FLASHMLA"),
    "mla4d": (lambda b: (b, 1, N, D), 0, (0, 1, 2, 3), "TRITON_MLA"),
}
ALLOCS = ["layer_major", "block_major", "separate", "uneven"]


@dataclass
class Caches:
    kind: str
    dtype: torch.dtype
    alloc: str
    factor: int
    raws: list[torch.Tensor]  # uint8 backing storage(s)
    layers: dict[str, torch.Tensor]
    hint: str

    @property
    def bdim(self) -> int:
        """Block dimension of the logical per-layer view."""
        return 1 if self.kind.startswith("kv_first") else 0

    @property
    def block_size(self) -> int:
        return N * self.factor

    def views(self, raws: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
        return _layer_views(self.kind, raws, dtype, self.alloc, NB * self.factor)

    def describe(self) -> KVCacheLayout:
        return describe_kv_caches(self.layers, block_size=self.block_size, layout_hint=self.hint)


def _layer_views(
    kind: str, raws: list[torch.Tensor], dtype: torch.dtype, alloc: str, nbk: int
) -> list[torch.Tensor]:
    shape_fn, bdim, perm, _ = KINDS[kind]
    phys = shape_fn(nbk)
    elems = int(np.prod(phys))
    out = []
    for layer in range(L):
        if alloc == "separate":
            t = raws[layer].view(dtype).view(phys)
        elif alloc == "layer_major":
            t = raws[0].view(dtype)[layer * elems : (layer + 1) * elems].view(phys)
        elif alloc == "uneven":  # one storage, irregular gaps between layers
            start = layer * elems + 16 * layer * (layer + 1)
            t = raws[0].view(dtype)[start : start + elems].view(phys)
        else:  # block_major: [B, L, rest...], every block holds all layers
            rest = tuple(s for i, s in enumerate(phys) if i != bdim)
            t = raws[0].view(dtype).view(nbk, L, *rest)[:, layer].movedim(0, bdim)
        out.append(t.permute(perm))
    return out


def make_caches(
    kind: str, dtype: torch.dtype, alloc: str = "layer_major", factor: int = 1
) -> Caches:
    nbk = NB * factor
    elem = torch.empty((), dtype=dtype).element_size()
    layer_bytes = int(np.prod(KINDS[kind][0](nbk))) * elem
    if alloc == "separate":
        sizes = [layer_bytes] * L
    elif alloc == "uneven":
        sizes = [L * layer_bytes + 16 * L * (L + 1) * elem]
    else:
        sizes = [L * layer_bytes]
    raws = [torch.empty(s, dtype=torch.uint8).random_() for s in sizes]
    views = _layer_views(kind, raws, dtype, alloc, nbk)
    layers = {f"model.layers.{i}.attn": v for i, v in enumerate(views)}
    return Caches(kind, dtype, alloc, factor, raws, layers, KINDS[kind][3])


def expected_after_scatter(c: Caches, src_ids: list[int], dst_ids: list[int]) -> list[torch.Tensor]:
    """The storages as they must look after copying KV blocks src_ids -> dst_ids (reference:
    index ops on the logical views of a copy, as integers)."""
    expected = [r.clone() for r in c.raws]
    itype = INT_OF[torch.empty((), dtype=c.dtype).element_size()]
    f = c.factor
    ksrc = torch.tensor([b * f + k for b in src_ids for k in range(f)])
    kdst = torch.tensor([b * f + k for b in dst_ids for k in range(f)])
    for orig, exp in zip(c.views(c.raws, itype), c.views(expected, itype), strict=True):
        exp.index_copy_(c.bdim, kdst, orig.index_select(c.bdim, ksrc))
    return expected


def ref_canonical(c: Caches, block_ids: list[int]) -> torch.Tensor:
    """[n, L, H, T, S, D] read element by element from the cache (K = part 0, V = part 1)."""
    s_parts = 1 if c.kind.startswith("mla") else 2
    heads = 1 if c.kind.startswith("mla") else H
    itype = INT_OF[torch.empty((), dtype=c.dtype).element_size()]
    layers = c.views(c.raws, itype)
    out = torch.empty(len(block_ids), L, heads, c.block_size, s_parts, D, dtype=itype)
    for i, b in enumerate(block_ids):
        for li, t in enumerate(layers):
            for tok in range(c.block_size):
                kb, pos = b * c.factor + tok // N, tok % N
                for h in range(heads):
                    for s in range(s_parts):
                        if c.kind == "cpu_kv_interleaved":
                            page = t[kb, h].reshape(-1)  # [N, 2D] page = [2, N*D]
                            if s == 0:  # K transposed: [D, N]
                                v = page[pos : N * D : N]
                            else:
                                v = page[N * D + pos * D : N * D + (pos + 1) * D]
                        elif c.kind in ("hnd", "nhd"):
                            v = t[kb, h, pos, s * D : (s + 1) * D]
                        elif c.kind.startswith("kv_first"):
                            v = t[s, kb, pos, h]
                        elif c.kind.startswith("blocks_first"):
                            v = t[kb, s, pos, h]
                        elif c.kind == "mla":
                            v = t[kb, pos]
                        else:  # mla4d
                            v = t[kb, 0, pos]
                        out[i, li, h, tok, s] = v
    return out


# ----------------------------------------------------------------------------------------------
# Layout detection
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("factor", [1, 2, 4])
def test_describe_every_layout(kind: str, factor: int) -> None:
    c = make_caches(kind, torch.bfloat16, factor=factor)
    lay = c.describe()
    assert lay.kind == ("mla" if kind == "mla4d" else kind)
    assert lay.num_layers == L
    assert lay.num_blocks == NB
    assert lay.block_size == N * factor
    assert lay.kernel_block_size == N
    assert lay.block_size_factor == factor
    assert lay.dtype == torch.bfloat16
    is_mla = kind.startswith("mla")
    assert (lay.num_heads, lay.num_kv_parts, lay.head_size) == ((1, 1, D) if is_mla else (H, 2, D))
    assert lay.layer_block_nbytes == factor * N * (D if is_mla else 2 * H * D) * 2
    assert lay.block_nbytes == L * lay.layer_block_nbytes
    assert lay.fingerprint.startswith(lay.kind)
    # Stable: the same description again, and from another instance of the same layout.
    assert make_caches(kind, torch.bfloat16, factor=factor).describe() == lay


def test_fingerprint_is_short_and_distinguishes_what_changes_bytes() -> None:
    base = make_caches("nhd", torch.bfloat16).describe()
    assert base.fingerprint == "nhd-bf16-FNHSD-L3F1H2N4S2D8"
    others = {
        make_caches("hnd", torch.bfloat16).describe().fingerprint,
        make_caches("nhd", torch.float16).describe().fingerprint,
        make_caches("nhd", torch.bfloat16, factor=2).describe().fingerprint,
        make_caches("cpu_kv_interleaved", torch.bfloat16).describe().fingerprint,
        base.fingerprint,
    }
    assert len(others) == 5
    cpu = make_caches("cpu_kv_interleaved", torch.bfloat16).describe()
    assert cpu.variant == "vec" and cpu.fingerprint.startswith("cpu_kv_interleaved.vec-")
    # The block-major allocation of the same layout is the same bytes per block.
    assert make_caches("nhd", torch.bfloat16, "block_major").describe() == base


def test_hint_disambiguates() -> None:
    c = make_caches("hnd", torch.float16)
    # A head-major 4-D cache on the CPU is read as vLLM's CPU backend without a hint ...
    assert describe_kv_caches(c.layers, block_size=N).kind == "cpu_kv_interleaved"
    # ... and as the standardised layout with a GPU backend's name or a kind.
    assert describe_kv_caches(c.layers, block_size=N, layout_hint="FLASH_ATTN").kind == "hnd"
    assert describe_kv_caches(c.layers, block_size=N, layout_hint="hnd").kind == "hnd"
    assert describe_kv_caches(c.layers, block_size=N, layout_hint="FLASHMLA").kind == "mla"
    # An NHD 4-D cache cannot be a CPU-backend cache: standardised without a hint.
    nhd = make_caches("nhd", torch.float16)
    assert describe_kv_caches(nhd.layers, block_size=N).kind == "nhd"
    with pytest.raises(ValueError, match="CPU KV cache"):
        describe_kv_caches(nhd.layers, block_size=N, layout_hint="CPU_ATTN")
    # [2, 2, ...]: two blocks, K/V first or blocks first; strides alone cannot tell.
    t = torch.empty(2, 2, N, H, D, dtype=torch.float16).random_()
    assert describe_kv_caches([t], block_size=N).kind == "kv_first_nhd"
    assert describe_kv_caches([t], block_size=N, layout_hint="blocks_first").kind == (
        "blocks_first_nhd"
    )


@pytest.mark.parametrize(
    "shape",
    [(16, 8), (2, 3, 4, 5, 6, 7), (4, 2, 4, 7), (3, 3, 4, 2, 8)],
    ids=["2d", "6d", "odd_last_dim", "5d_without_kv_dim"],
)
def test_unrecognised_shape_names_it(shape: tuple[int, ...]) -> None:
    t = torch.empty(shape, dtype=torch.bfloat16).random_()
    with pytest.raises(ValueError, match=r"\[" + ", ".join(map(str, shape)) + r"\]"):
        describe_kv_caches({"l0": t}, block_size=4, layout_hint="FLASH_ATTN")


def test_describe_rejects_bad_groups() -> None:
    a = torch.empty(8, H, N, 2 * D, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="empty"):
        describe_kv_caches({}, block_size=N)
    with pytest.raises(ValueError, match="share shape"):
        describe_kv_caches([a, torch.empty(4, H, N, 2 * D, dtype=torch.bfloat16)], block_size=N)
    with pytest.raises(ValueError, match="share shape"):
        describe_kv_caches([a, a.to(torch.float16)], block_size=N)
    with pytest.raises(ValueError, match="unsupported KV cache dtype"):
        describe_kv_caches([a.double()], block_size=N)
    with pytest.raises(ValueError, match="not a multiple of the kernel block size"):
        describe_kv_caches([a], block_size=N + 2)
    with pytest.raises(ValueError, match="do not split into KV blocks"):
        describe_kv_caches([a[:7]], block_size=2 * N)
    with pytest.raises(ValueError, match="block_size"):
        describe_kv_caches([a], block_size=0)
    overlapping = torch.empty(64, dtype=torch.bfloat16).as_strided((8, H, N, 2 * D), (1, 1, 1, 1))
    with pytest.raises(ValueError, match="overlap"):
        describe_kv_caches([overlapping], block_size=N, layout_hint="FLASH_ATTN")
    shared = torch.empty(8 * H * N * 2 * D, dtype=torch.bfloat16).view(8, H, N, 2 * D)
    with pytest.raises(ValueError, match="overlap"):
        BlockMover([shared, shared], describe_kv_caches([shared, shared], block_size=N))


def test_mover_refuses_caches_that_do_not_match_the_layout() -> None:
    c = make_caches("nhd", torch.bfloat16)
    other = make_caches("nhd", torch.bfloat16, factor=2)
    with pytest.raises(ValueError, match="do not match the layout"):
        BlockMover(c.layers, other.describe())


# ----------------------------------------------------------------------------------------------
# Gather / scatter
# ----------------------------------------------------------------------------------------------

ID_SETS = {
    # (gather ids, scatter ids): runs of consecutive ids (loop path) and scattered ids (index
    # path), both into a different set of blocks.
    "runs": ([4, 5, 6, 7], [0, 1, 2, 3]),
    "scattered": ([6, 1, 4, 2, 6], [0, 7, 3, 5, 2]),
}


def _roundtrip(c: Caches, ids: str, strategy: str = "auto") -> None:
    lay = c.describe()
    mover = BlockMover(c.layers, lay, torch_strategy=strategy)
    src_ids, dst_ids = ID_SETS[ids]
    n = len(src_ids)
    # Two extra poisoned rows: a gather must not write past the rows it was given.
    out = torch.full((n + 2, lay.block_nbytes), 0xA5, dtype=torch.uint8)
    mover.gather(src_ids, out[:n])
    assert bool((out[n:] == 0xA5).all())
    # The gathered bytes mean what the layout says they mean.
    assert torch.equal(bits(to_canonical(out[:n], lay)), ref_canonical(c, src_ids))
    expected = expected_after_scatter(c, src_ids, dst_ids)
    mover.scatter(dst_ids, out[:n])
    for raw, exp in zip(c.raws, expected, strict=True):
        assert torch.equal(raw, exp), "scatter wrote the wrong bytes or touched other blocks"
    # Gathering the destination gives back the same buffer.
    again = torch.empty_like(out[:n])
    mover.gather(dst_ids, again)
    assert torch.equal(again, out[:n])


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("factor", [1, 2, 4])
def test_roundtrip_layouts_dtypes_factors(kind: str, dtype: torch.dtype, factor: int) -> None:
    for ids in ID_SETS:
        _roundtrip(make_caches(kind, dtype, factor=factor), ids)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("alloc", ALLOCS)
@pytest.mark.parametrize("strategy", ["loop", "index", "threads"])
def test_roundtrip_allocations_and_strategies(kind: str, alloc: str, strategy: str) -> None:
    for ids in ID_SETS:
        _roundtrip(make_caches(kind, torch.bfloat16, alloc, factor=2), ids, strategy)


@pytest.mark.parametrize("alloc", ALLOCS)
def test_shared_allocations_move_all_layers_at_once(alloc: str) -> None:
    plan = build_copy_plan(
        make_caches("nhd", torch.bfloat16, alloc).layers,
        make_caches("nhd", torch.bfloat16, alloc).describe(),
    )
    if alloc in ("layer_major", "block_major"):
        assert plan.layer_stride is not None and plan.combined_view() is not None
    else:
        assert plan.layer_stride is None and plan.combined_view() is None
    if alloc == "block_major":
        # All layers of a block are one contiguous run: one chunk per layer, adjacent.
        assert plan.layer_stride == plan.chunk_nbytes == plan.layout.layer_block_nbytes


def test_block_runs() -> None:
    assert block_runs(np.array([7, 8, 9, 10, 11, 2, 30, 31])) == [(0, 7, 5), (5, 2, 1), (6, 30, 2)]
    assert block_runs(np.array([], dtype=np.int64)) == []


@pytest.mark.parametrize("piece_bytes", [1, 700, 5000])
@pytest.mark.parametrize("alloc", ["layer_major", "separate"])
def test_threads_cut_blocks_into_pieces(
    monkeypatch: pytest.MonkeyPatch, piece_bytes: int, alloc: str
) -> None:
    """Pieces smaller than a block split its layers; bigger ones hold several blocks."""
    monkeypatch.setattr(torch_ops, "_PIECE_BYTES", piece_bytes)
    _roundtrip(make_caches("kv_first_hnd", torch.float16, alloc, factor=2), "runs", "threads")
    _roundtrip(make_caches("nhd", torch.float32, alloc, factor=1), "scattered", "threads")


@pytest.mark.parametrize("piece_bytes", [1, 700, 1 << 20])
@pytest.mark.parametrize("strategy", ["loop", "index", "threads"])
def test_scatter_reports_every_row_once(
    monkeypatch: pytest.MonkeyPatch, piece_bytes: int, strategy: str
) -> None:
    """``on_rows`` (the connector checksums rows there) sees each source row exactly once,
    whichever thread copied it, and the scatter still writes the right bytes."""
    monkeypatch.setattr(torch_ops, "_PIECE_BYTES", piece_bytes)
    c = make_caches("kv_first_hnd", torch.float16, "separate", factor=2)
    lay = c.describe()
    mover = BlockMover(c.layers, lay, torch_strategy=strategy)
    mover._torch._threads = 3
    src_ids, dst_ids = ID_SETS["scattered"]
    buf = torch.empty(len(src_ids), lay.block_nbytes, dtype=torch.uint8)
    mover.gather(src_ids, buf)
    expected = expected_after_scatter(c, src_ids, dst_ids)
    seen: list[int] = []
    lock = threading.Lock()

    def on_rows(pos: int, length: int) -> None:
        with lock:
            seen.extend(range(pos, pos + length))

    mover.scatter(dst_ids, buf, on_rows=on_rows)
    assert sorted(seen) == list(range(len(dst_ids)))
    for raw, exp in zip(c.raws, expected, strict=True):
        assert torch.equal(raw, exp)


@pytest.mark.parametrize("alloc", ALLOCS)
@pytest.mark.parametrize("strategy", ["loop", "index", "threads"])
def test_scatter_layer_by_layer(alloc: str, strategy: str) -> None:
    """A load that runs ahead of the forward pass scatters a layer range at a time: each call
    writes only its layers, and all of them together write what one whole scatter does."""
    c = make_caches("cpu_kv_interleaved", torch.bfloat16, alloc, factor=2)
    lay = c.describe()
    mover = BlockMover(c.layers, lay, torch_strategy=strategy)
    src_ids, dst_ids = ID_SETS["scattered"]
    buf = torch.empty(len(src_ids), lay.block_nbytes, dtype=torch.uint8)
    mover.gather(src_ids, buf)
    expected = expected_after_scatter(c, src_ids, dst_ids)
    views = list(c.layers.values())
    before = [bits(v).clone() for v in views]
    mover.scatter(dst_ids, buf, layers=(1, 2))
    for i, (v, old) in enumerate(zip(views, before, strict=True)):
        assert torch.equal(bits(v), old) == (i != 1), f"layer {i}"
    for lo, hi in [(0, 1), (2, lay.num_layers)]:
        mover.scatter(dst_ids, buf, layers=(lo, hi))
    for raw, exp in zip(c.raws, expected, strict=True):
        assert torch.equal(raw, exp)
    for bad in [(0, 0), (1, lay.num_layers + 1), (-1, 1)]:
        with pytest.raises(ValueError, match="layers"):
            mover.scatter(dst_ids, buf, layers=bad)


def test_threads_with_fewer_layers_than_threads() -> None:
    t = torch.empty(NB, H, N, 2 * D, dtype=torch.bfloat16)
    t.view(torch.int16).random_()
    lay = describe_kv_caches([t], block_size=N, layout_hint="FLASH_ATTN")
    mover = BlockMover([t], lay, torch_strategy="threads")
    mover._torch._threads = 4  # more threads than layers: the work splits by block
    buf = torch.empty(5, lay.block_nbytes, dtype=torch.uint8)
    mover.gather([5, 1, 2, 6, 7], buf)
    expected = bits(t).clone()
    expected[[0, 3, 4, 2, 1]] = bits(t)[[5, 1, 2, 6, 7]]
    mover.scatter([0, 3, 4, 2, 1], buf)
    assert torch.equal(bits(t), expected)


def test_big_cpu_copies_use_the_copy_threads() -> None:
    c = make_caches("cpu_kv_interleaved", torch.float32, factor=4)
    lay = c.describe()
    mover = BlockMover(c.layers, lay)
    assert mover._torch._use_threads(NB) == (NB * lay.block_nbytes >= 1 << 20)
    assert mover._torch._use_threads(1 << 20)
    assert not mover._torch._use_threads(1)


def test_kv_first_block_is_two_chunks_per_layer() -> None:
    c = make_caches("kv_first_nhd", torch.float16, factor=2)
    plan = build_copy_plan(c.layers, c.describe())
    # K run and V run; the two kernel blocks of a KV block are adjacent within each.
    assert plan.num_chunks == 2
    assert plan.chunk_nbytes == 2 * N * H * D * 2


def test_empty_and_round_trip_on_cpu() -> None:
    c = make_caches("hnd", torch.bfloat16)
    lay = c.describe()
    mover = BlockMover(c.layers, lay)
    expected = expected_after_scatter(c, [3, 5], [1, 2])
    empty = torch.empty(0, lay.block_nbytes, dtype=torch.uint8)
    mover.gather([], empty)
    mover.scatter(np.array([], dtype=np.int64), empty)
    out = torch.empty(2, lay.block_nbytes, dtype=torch.uint8)
    mover.gather(torch.tensor([3, 5]), out)
    mover.scatter(np.array([1, 2]), out)
    assert all(torch.equal(a, b) for a, b in zip(c.raws, expected, strict=True))
    assert mover.engine == "torch-cpu"


def test_bad_input_raises_value_error() -> None:
    c = make_caches("nhd", torch.bfloat16)
    lay = c.describe()
    mover = BlockMover(c.layers, lay)
    good = torch.empty(2, lay.block_nbytes, dtype=torch.uint8)
    snapshot = [r.clone() for r in c.raws]
    cases: list[tuple[Callable[[], object], str]] = [
        (lambda: mover.gather([0, 1], good.view(torch.int16)), "uint8"),
        (lambda: mover.gather([0, 1], good.view(-1)), "block_nbytes"),
        (lambda: mover.gather([0, 1], good[:, :-1]), "block_nbytes"),
        (lambda: mover.gather([0, 1, 2], good), "too small"),
        (lambda: mover.scatter([0, 1, 2], good), "too small"),
        (lambda: mover.gather([0, NB], good), "out of range"),
        (lambda: mover.scatter([-1, 0], good), "out of range"),
        (lambda: mover.scatter([3, 3], good), "distinct"),
        (lambda: mover.gather([0.0, 1.0], good), "ints"),
        (lambda: mover.gather(torch.tensor([0.0, 1.0]), good), "integers"),
        (lambda: mover.gather([[0, 1]], good), "flat"),
        (lambda: mover.gather([0, 1], "buffer"), "torch.Tensor"),
        (
            lambda: mover.gather([0, 1], torch.empty(lay.block_nbytes, 2, dtype=torch.uint8).t()),
            "contiguous",
        ),
        (lambda: BlockMover(c.layers, lay, engine="cupy"), "CUDA"),
        (lambda: BlockMover(c.layers, lay, engine="gpu"), "engine"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()
    # Nothing was written by any failed call.
    assert all(torch.equal(a, b) for a, b in zip(c.raws, snapshot, strict=True))
    # Gathering a repeated id is fine (a read).
    mover.gather([2, 2], good)
    assert torch.equal(good[0], good[1])


def test_cpu_kernel_arithmetic_matches_torch() -> None:
    """Run the CUDA kernel's address arithmetic on the CPU (memmove on real addresses)."""
    for kind, alloc, factor in [
        ("cpu_kv_interleaved", "layer_major", 2),
        ("kv_first_hnd", "separate", 2),
        ("nhd", "block_major", 1),
        ("blocks_first_hnd", "uneven", 4),
        ("mla", "layer_major", 2),
    ]:
        c = make_caches(kind, torch.bfloat16, alloc, factor)
        lay = c.describe()
        plan = build_copy_plan(c.layers, lay)
        ids = np.array([5, 0, 6, 7, 2], dtype=np.int64)
        want = torch.empty(len(ids), lay.block_nbytes, dtype=torch.uint8)
        BlockMover(c.layers, lay).gather(ids, want)
        got = torch.full_like(want, 0x5A)
        _emulate_kernel(plan, ids, got, to_buffer=True)
        assert torch.equal(got, want), (kind, alloc)
        expected = expected_after_scatter(c, [5, 0, 6, 7, 2], [1, 3, 4, 0, 5])
        _emulate_kernel(plan, np.array([1, 3, 4, 0, 5]), got, to_buffer=False)
        assert all(torch.equal(a, b) for a, b in zip(c.raws, expected, strict=True)), kind


def _emulate_kernel(plan: CopyPlan, ids: np.ndarray, buf: torch.Tensor, *, to_buffer: bool) -> None:
    """The CUDA kernel's loop, one work item at a time, on host addresses."""
    ptrs = plan.layer_ptrs()
    width = word_width(plan.chunk_nbytes, plan.kv_block_stride, *ptrs, *plan.chunk_offsets)
    chunk_words = plan.chunk_nbytes // width
    n_layers, n_chunks = plan.layout.num_layers, plan.num_chunks
    for task in range(len(ids) * n_layers * n_chunks):
        chunk = task % n_chunks
        rest = task // n_chunks
        layer = rest % n_layers
        row = rest // n_layers
        cache = ptrs[layer] + int(ids[row]) * plan.kv_block_stride + plan.chunk_offsets[chunk]
        stage = buf.data_ptr() + task * chunk_words * width
        src, dst = (cache, stage) if to_buffer else (stage, cache)
        ctypes.memmove(dst, src, chunk_words * width)


def test_kernel_helpers() -> None:
    src, name = kernel_source(16)
    assert name == "kvray_move_w16" and "typedef uint4 word_t;" in src and name in src
    assert "WORD_T" not in src and "KERNEL_NAME" not in src
    assert word_width(4096, 1 << 20, 48) == 16
    assert word_width(4096, 6) == 2
    assert word_width(3) == 1
    assert launch_config(4096, 4096) == (4096, 256)
    assert launch_config(10, 3) == (10, 32)
    grid, threads = launch_config(10**7, 100)
    assert grid < 10**7 and threads == 128


def test_import_needs_neither_cupy_nor_vllm() -> None:
    code = (
        "import sys, kvray.kernels as k; "
        "assert 'cupy' not in sys.modules and 'vllm' not in sys.modules, sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ----------------------------------------------------------------------------------------------
# The canonical decoder the tests use as an oracle (tests/kvcanon.py)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_canonical_roundtrip_every_dtype(dtype: torch.dtype) -> None:
    for kind in KINDS:
        c = make_caches(kind, dtype, factor=2)
        lay = c.describe()
        buf = torch.empty(3, lay.block_nbytes, dtype=torch.uint8)
        BlockMover(c.layers, lay).gather([7, 0, 3], buf)
        canon = to_canonical(buf, lay)
        assert canon.dtype == dtype
        assert torch.equal(bits(canon), ref_canonical(c, [7, 0, 3]))
        assert torch.equal(from_canonical(canon, lay), buf)


def test_undecodable_cpu_pages_and_bad_variants_are_refused() -> None:
    amx = make_layout(
        kind="cpu_kv_interleaved",
        dtype=torch.bfloat16,
        num_layers=L,
        num_blocks=NB,
        block_size=N,
        kernel_block_size=N,
        num_heads=H,
        num_kv_parts=2,
        head_size=D,
        axes="FHSND",
        variant="amx",
    )
    with pytest.raises(ValueError, match="ISA"):
        to_canonical(torch.zeros(2, amx.block_nbytes, dtype=torch.uint8), amx)
    with pytest.raises(ValueError, match="variant"):
        make_layout(**{**_layout_kwargs(amx), "variant": "AMX!"})


def _layout_kwargs(lay: KVCacheLayout) -> dict[str, object]:
    return {
        "kind": lay.kind,
        "dtype": lay.dtype,
        "num_layers": lay.num_layers,
        "num_blocks": lay.num_blocks,
        "block_size": lay.block_size,
        "kernel_block_size": lay.kernel_block_size,
        "num_heads": lay.num_heads,
        "num_kv_parts": lay.num_kv_parts,
        "head_size": lay.head_size,
        "axes": lay.axes,
        "variant": lay.variant,
    }


# ----------------------------------------------------------------------------------------------
# Staging pool
# ----------------------------------------------------------------------------------------------


def _rows(t: torch.Tensor, pool: StagingPool) -> range:
    start = (t.data_ptr() - pool._arena.data_ptr()) // pool.block_nbytes
    return range(start, start + t.shape[0])


def test_staging_pool_never_hands_out_rows_twice() -> None:
    pool = StagingPool(block_nbytes=64, max_blocks=32, pin_memory=False)
    rng = np.random.default_rng(0)
    held: list = []
    owner = np.full(32, -1)
    for step in range(400):
        if held and (rng.random() < 0.45 or pool.free_blocks == 0):
            lease = held.pop(int(rng.integers(len(held))))
            owner[list(_rows(lease.tensor, pool))] = -1
            lease.release()
            lease.release()  # idempotent
            continue
        n = int(rng.integers(1, 9))
        try:
            lease = pool.acquire(n, timeout=0)
        except StagingPoolExhausted:
            continue
        rows = list(_rows(lease.tensor, pool))
        assert lease.tensor.shape == (n, 64) and lease.tensor.is_contiguous()
        assert (owner[rows] == -1).all(), "rows handed out twice"
        owner[rows] = step
        held.append(lease)
    assert pool.in_use_blocks == int((owner >= 0).sum())
    for lease in held:
        lease.release()
    assert pool.free_blocks == 32 and pool.in_use_blocks == 0
    assert pool.acquire(32, timeout=0).tensor.shape == (32, 64)


def test_staging_pool_is_bounded_and_context_managed() -> None:
    pool = StagingPool(block_nbytes=128, max_blocks=4, pin_memory=False, timeout_s=0.05)
    with pytest.raises(ValueError, match="pool of 4"):
        pool.acquire(5)
    with pytest.raises(ValueError, match="non-negative"):
        pool.acquire(-1)
    assert pool.acquire(0).tensor.shape == (0, 128)
    with pool.acquire(3) as buf:
        assert buf.shape == (3, 128) and buf.dtype == torch.uint8
        t0 = time.monotonic()
        with pytest.raises(StagingPoolExhausted):
            pool.acquire(2)
        assert time.monotonic() - t0 >= 0.04
    assert pool.free_blocks == 4
    # Rows return on an exception too.
    with pytest.raises(RuntimeError, match="boom"), pool.acquire(4):
        raise RuntimeError("boom")
    assert pool.free_blocks == 4
    # A waiting acquire gets the rows when another thread releases them.
    lease = pool.acquire(4)
    threading.Timer(0.05, lease.release).start()
    with pool.acquire(2, timeout=5) as buf:
        assert buf.shape == (2, 128)
    assert not torch.cuda.is_available() or pool.pinned is False


def test_staging_pool_pinning_rules() -> None:
    with pytest.raises(ValueError, match="positive"):
        StagingPool(0, 4)
    with pytest.raises(ValueError, match="positive"):
        StagingPool(16, 0)
    if not torch.cuda.is_available():
        assert StagingPool(16, 4).pinned is False
        with pytest.raises(ValueError, match="pin_memory"):
            StagingPool(16, 4, pin_memory=True)


def test_gather_into_staging_lease() -> None:
    c = make_caches("cpu_kv_interleaved", torch.bfloat16, factor=2)
    lay = c.describe()
    mover = BlockMover(c.layers, lay)
    pool = StagingPool(lay.block_nbytes, max_blocks=6, pin_memory=False)
    with pool.acquire(3) as buf:
        mover.gather([1, 2, 3], buf)
        expected = expected_after_scatter(c, [1, 2, 3], [5, 6, 7])
        mover.scatter([5, 6, 7], buf)
    assert all(torch.equal(a, b) for a, b in zip(c.raws, expected, strict=True))


# ----------------------------------------------------------------------------------------------
# Real vLLM tensors (skipped without vLLM)
# ----------------------------------------------------------------------------------------------


def _vllm_caches(
    spec: Any, layout: Any, num_layers: int, num_blocks: int, kernel_block_size: int | None
) -> tuple[torch.Tensor, Callable[[torch.Tensor], list[torch.Tensor]]]:
    from vllm.v1.kv_cache_interface import (
        KVCacheTensor,
        compute_layout_strides,
        create_kv_cache_views,
    )

    per_block = num_layers * spec.page_size_bytes
    fixed_block = per_block if layout.is_block_outermost else None
    layer_stride, block_stride, *_ = compute_layout_strides(
        spec, num_blocks, num_layers, layout, fixed_strides=(None, fixed_block, None, None, None)
    )
    raw = torch.empty(per_block * num_blocks, dtype=torch.int8).random_()
    tensor = KVCacheTensor(
        size=raw.numel(),
        layers=[f"layers.{i}.attn" for i in range(num_layers)],
        layer_stride=layer_stride,
        block_stride=block_stride,
    )

    def views(r: torch.Tensor) -> list[torch.Tensor]:
        return create_kv_cache_views(r, spec, num_blocks, layout, tensor, kernel_block_size)

    return raw, views


def test_real_vllm_views_every_layout() -> None:
    pytest.importorskip("vllm")
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout as VllmLayout

    mha = {"block_size": 32, "num_kv_heads": 2, "head_size": 32}
    specs = [
        (FullAttentionSpec(**mha, dtype=torch.bfloat16), "FLASH_ATTN"),
        (FullAttentionSpec(**mha, dtype=FP8), "FLASH_ATTN"),
        (
            MLAAttentionSpec(block_size=32, num_kv_heads=1, head_size=64, dtype=torch.bfloat16),
            "FLASHMLA",
        ),
    ]
    checked = 0
    for spec, hint in specs:
        for vl in VllmLayout:
            for kbs in (None, 16):
                try:
                    raw, views = _vllm_caches(spec, vl, 3, 6, kbs)
                    layers = views(raw)
                except (ValueError, AssertionError):
                    continue  # vLLM refuses kernel-block splitting for this layout
                lay = describe_kv_caches(layers, block_size=32, layout_hint=hint)
                assert lay.block_size_factor == (2 if kbs else 1)
                assert lay.block_nbytes == 3 * spec.page_size_bytes
                mover = BlockMover(layers, lay)
                buf = torch.empty(2, lay.block_nbytes, dtype=torch.uint8)
                mover.gather([4, 1], buf)
                expected = raw.clone()
                for orig, exp in zip(layers, views(expected), strict=True):
                    f = lay.block_size_factor
                    ksrc = torch.tensor([b * f + k for b in (4, 1) for k in range(f)])
                    kdst = torch.tensor([b * f + k for b in (0, 5) for k in range(f)])
                    itype = INT_OF[orig.element_size()]
                    exp.view(itype).index_copy_(0, kdst, orig.view(itype).index_select(0, ksrc))
                mover.scatter([0, 5], buf)
                assert torch.equal(raw, expected), (vl.name, kbs, lay.fingerprint)
                checked += 1
    assert checked >= 12


def test_real_vllm_cpu_backend_kv_semantics() -> None:
    pytest.importorskip("vllm")
    import vllm._custom_ops as ops

    from kvray.kernels.layout import detect_cpu_attention_isa

    assert detect_cpu_attention_isa(torch.bfloat16, 32, 64) != ""
    assert detect_cpu_attention_isa(FP8, 32, 64) == ""  # the model dtype is unknown for fp8
    nb, heads, n, d = 4, 2, 32, 64
    raw = torch.empty(2, nb, heads, n, 2 * d, dtype=torch.bfloat16)
    raw.view(torch.int16).random_()
    layers = {"l0": raw[0], "l1": raw[1]}
    tokens = 2 * n
    key = torch.randn(2, tokens, heads, d).to(torch.bfloat16)
    value = torch.randn(2, tokens, heads, d).to(torch.bfloat16)
    slots = torch.tensor([n * 1 + i for i in range(n)] + [n * 3 + i for i in range(n)])
    for li, t in enumerate(layers.values()):
        k_cache, v_cache = t.view(nb, heads, 2 * n, d).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key[li], value[li], k_cache, v_cache, slots, "vec")
    lay = describe_kv_caches(layers, block_size=n, layout_hint="CPU_ATTN:vec")
    assert lay.kind == "cpu_kv_interleaved" and lay.variant == "vec"
    buf = torch.empty(2, lay.block_nbytes, dtype=torch.uint8)
    BlockMover(layers, lay).gather([1, 3], buf)
    canon = to_canonical(buf, lay)  # [2 blocks, L, H, T, S, D]
    for li in range(2):
        for blk in range(2):
            toks = slice(blk * n, (blk + 1) * n)
            assert torch.equal(canon[blk, li, :, :, 0], key[li, toks].transpose(0, 1))
            assert torch.equal(canon[blk, li, :, :, 1], value[li, toks].transpose(0, 1))
