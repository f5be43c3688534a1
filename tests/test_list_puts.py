"""Blocks given to ``put`` as a list of arrays read back byte for byte (issue 21, part 3).

Lists of equal small numpy blocks are stacked into rows (one buffer to Ray); lists of any other
kind keep the list path. Both must store exactly the bytes given, whatever the dtype or shape of
each block.
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest

import kvray
from kvray.blocks import STACK_MAX_BYTES, stacked


def _keys(n: int) -> list[bytes]:
    salt = uuid.uuid4().hex.encode()
    return [salt + i.to_bytes(4, "big") for i in range(n)]


def _raw(block: np.ndarray) -> bytes:
    return np.ascontiguousarray(block).tobytes()


rng = np.random.default_rng(21)
CASES = {
    "equal 64-byte blocks": [rng.integers(0, 255, 64, dtype=np.uint8) for _ in range(2000)],
    "equal float32 2D blocks": [rng.standard_normal((4, 8), dtype=np.float32) for _ in range(50)],
    "equal non-contiguous blocks": [
        rng.integers(0, 255, (8, 16), dtype=np.uint8)[:, ::2] for _ in range(40)
    ],
    "sizes differ": [rng.integers(0, 255, 32 + i, dtype=np.uint8) for i in range(40)],
    "dtypes differ": [
        np.arange(8, dtype=np.uint8) if i % 2 else np.arange(8, dtype=np.int8) - 4
        for i in range(30)
    ],
    "blocks over the stacking size": [
        rng.integers(0, 255, STACK_MAX_BYTES + 1, dtype=np.uint8) for _ in range(3)
    ],
}


@pytest.mark.parametrize("case", list(CASES))
def test_list_put_reads_back_bytes_equal(module_ns: str, case: str) -> None:
    blocks = CASES[case]
    keys = _keys(len(blocks))
    store = kvray.connect(module_ns)
    result = store.put(keys, blocks).result(timeout=60)
    assert result.stored == len(blocks)
    store.sync()
    got = store.get(keys)
    assert [g.tobytes() for g in got] == [_raw(b) for b in blocks]
    # A second put of a list that is partly stored keeps the right blocks with their keys.
    more = _keys(3)
    mixed = [blocks[0], *blocks[:3]]
    result = store.put([keys[0], *more], mixed).result(timeout=60)
    assert (result.stored, result.duplicate) == (3, 1)
    store.sync()
    assert [g.tobytes() for g in store.get(more)] == [_raw(b) for b in blocks[:3]]
    store.close()


def test_stacking_only_takes_equal_small_numpy_blocks() -> None:
    small = [np.arange(16, dtype=np.uint8) + i for i in range(5)]
    rows = stacked(small)
    assert isinstance(rows, np.ndarray) and rows.shape == (5, 16)
    assert [r.tobytes() for r in rows] == [b.tobytes() for b in small]
    for blocks in (
        [np.zeros(4, np.uint8), np.zeros(5, np.uint8)],  # sizes differ
        [np.zeros(4, np.uint8), np.zeros(4, np.int8)],  # dtypes differ (stack would upcast)
        [np.zeros(4, np.uint8), np.zeros((2, 2), np.uint8)],  # shapes differ
        [np.zeros(STACK_MAX_BYTES + 1, np.uint8)] * 2,  # too big: a copy would cost
        [np.zeros(0, np.uint8)] * 2,  # empty: refused by the list path, with its index
        [np.zeros(4, np.uint8)],  # one block
    ):
        assert stacked(blocks) is blocks
