"""Reuse across TP sizes: a block stored by an engine at one TP size, loaded at another.

- Slicing and assembling KV heads (:mod:`kvray.kernels.heads`, the connector's copier) on
  random data, byte for byte against a slow reference, for every (stored grouping, reader TP
  size, rank) pair of 4 KV heads, and of 2 KV heads read at TP=4 (replicated heads).
- Key spaces: one prefix per grouping, no TP size in it on CPU caches; models, dtypes, block
  sizes, ISAs and GPU layouts never share keys.
- Real vLLM on CPU (float32 tiny Llamas): a TP=1 engine stores, a TP=2 engine loads (hits
  counted, tokens and KV as its own recompute), stores, and the TP=1 engine loads that; a model
  with one KV head at TP=2 stores each block once and both ranks read it.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from kvray.connector.paged import PagedCopier
from kvray.kernels import BlockMover, StagingPool, describe_kv_caches
from kvray.kernels.heads import HeadPart, head_parts, is_head_major, window
from kvray.keys import grouped_prefix

LAYERS, TOKENS, DIM = 3, 32, 4  # a head's page: 32 tokens x (K|V of 4 floats) = 1 KiB
HEAD_BYTES = TOKENS * 2 * DIM * 4


# ---------------------------------------------------------------------- slicing, assembling
def reader_heads(total: int, tp: int, rank: int) -> tuple[int, int]:
    """vLLM's head range of a rank: ``H/T`` heads, or one head replicated ``T/H`` times."""
    if tp <= total:
        per = total // tp
        return rank * per, (rank + 1) * per
    head = rank // (tp // total)
    return head, head + 1


def cases(total: int, tps: tuple[int, ...]) -> list[tuple[int, int, int, int]]:
    groupings = [g for g in range(1, total + 1) if total % g == 0]
    return [(total, g, t, r) for g in groupings for t in tps for r in range(t)]


CASES = cases(4, (1, 2, 4, 8)) + cases(2, (4,))


def cpu_caches(heads: int, num_blocks: int) -> dict[str, torch.Tensor]:
    """vLLM's CPU layout: per layer ``[num_blocks, heads, tokens, 2*dim]``, one allocation."""
    backing = torch.zeros(LAYERS, num_blocks, heads, TOKENS, 2 * DIM)
    return {f"layer.{i}": backing[i] for i in range(LAYERS)}


def stored(full: np.ndarray, grouping: int, *, back_to_back: bool) -> list[list[np.ndarray]]:
    """Slow reference of what a grouping stores: per shard, one uint8 array per block."""
    n, _, total, _ = full.shape
    per = total // grouping
    out = []
    for g in range(grouping):
        rows = np.ascontiguousarray(full[:, :, g * per : (g + 1) * per, :]).reshape(n, -1)
        if back_to_back:  # as blocks of one segment: two runs
            a, b = rows[:2].copy(), rows[2:].copy()
            out.append([*a, *b])
        else:
            out.append([np.array(r) for r in rows])
    return out


@pytest.mark.parametrize(("total", "grouping", "tp", "rank"), CASES)
@pytest.mark.parametrize("mode", ["direct", "layerwise", "scattered", "tiny-staging"])
def test_heads_of_any_stored_grouping_land_byte_exact(
    total: int, grouping: int, tp: int, rank: int, mode: str
) -> None:
    rng = np.random.default_rng(total * 1000 + grouping * 100 + tp * 10 + rank)
    n, num_blocks = 5, 12
    full = rng.integers(0, 256, (n, LAYERS, total, HEAD_BYTES), dtype=np.uint8)
    a, b = reader_heads(total, tp, rank)
    heads = b - a
    kv = cpu_caches(heads, num_blocks)
    layout = describe_kv_caches(kv, block_size=TOKENS, layout_hint="CPU_ATTN:vec")
    assert is_head_major(layout.num_heads, layout.axes, layout.block_size_factor)
    mover = BlockMover(kv, layout)
    staging = StagingPool(layout.block_nbytes, 1 if mode == "tiny-staging" else 8)
    copier = PagedCopier(
        mover, staging, layout.block_nbytes, torch.device("cpu"), num_layers=LAYERS, heads=heads
    )
    shards = stored(full, grouping, back_to_back=mode != "scattered")
    parts = head_parts(total, (a, b), grouping)
    block_ids = [7, 2, 3, 4, 10]
    sources = [(shards[p.shard], p) for p in parts]
    seen: list[int] = []
    if mode == "layerwise":
        for layer in range(LAYERS):
            copier.scatter(block_ids, sources, layers=(layer, layer + 1))
    else:
        copier.scatter(block_ids, sources, seen.append)
        assert sorted(seen) == list(range(n)), "every block's hook runs once"

    out = torch.empty((n, layout.block_nbytes), dtype=torch.uint8)
    mover.gather(block_ids, out)
    want = np.ascontiguousarray(full[:, :, a:b, :]).reshape(n, -1)
    assert np.array_equal(out.numpy(), want)
    others = [i for i in range(num_blocks) if i not in block_ids]
    assert all(bool((kv[name][others] == 0).all()) for name in kv), "other blocks untouched"


@pytest.mark.parametrize("total", [1, 2, 4, 6, 8, 12])
def test_head_parts_cover_every_rank_exactly(total: int) -> None:
    divisors = [d for d in range(1, total + 1) if total % d == 0]
    for grouping in divisors:
        per = total // grouping
        for tp in [*divisors, 2 * total]:
            for rank in range(tp):
                a, b = reader_heads(total, tp, rank)
                parts = head_parts(total, (a, b), grouping)
                got = [p.shard * per + p.src_lo + k for p in parts for k in range(p.count)]
                assert got == list(range(a, b))
                assert [p.dst_lo for p in parts] == [p.dst_lo for p in parts if p.dst_lo >= 0]
                assert all(p.src_lo + p.count <= per and p.src_heads == per for p in parts)
                assert sum(p.count for p in parts) == b - a
    with pytest.raises(ValueError, match="does not split"):
        head_parts(6, (0, 1), 4)
    with pytest.raises(ValueError, match="outside"):
        head_parts(4, (2, 5), 2)


def test_bad_sizes_are_refused() -> None:
    part = HeadPart(0, 2, 1, 0, 1)
    with pytest.raises(ValueError, match="uint8 vector"):
        window(np.zeros(2 * LAYERS * HEAD_BYTES - 1, np.uint8), 1, part, LAYERS, HEAD_BYTES)
    kv = cpu_caches(1, 4)
    layout = describe_kv_caches(kv, block_size=TOKENS, layout_hint="CPU_ATTN:vec")
    mover = BlockMover(kv, layout)
    copier = PagedCopier(
        mover, StagingPool(layout.block_nbytes, 2), layout.block_nbytes, torch.device("cpu"),
        num_layers=LAYERS, heads=1,
    )
    short = [np.zeros(2 * LAYERS * HEAD_BYTES - 8, np.uint8)]
    with pytest.raises(ValueError, match="fetched block 0"):
        copier.scatter([1], [(short, part)])
    wrong = torch.zeros((1, LAYERS, 2 * HEAD_BYTES), dtype=torch.uint8)
    with pytest.raises(ValueError, match="contiguous layer parts"):
        mover.scatter([1], wrong)
    assert bool((kv["layer.0"] == 0).all())
