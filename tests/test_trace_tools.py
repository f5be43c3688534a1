"""The trace tools of issue 35: ``scripts/make_trace.py`` writes a Mooncake-format trace whose
ids are prefix hashes, and ``scripts/bench_trace.py``'s offline baselines and ceilings rank a
hand-made sequence as they must."""

from __future__ import annotations

import argparse

from scripts.bench_trace import belady, global_lru, lru_oracle, unbounded
from scripts.make_trace import generate


def _trace(seed: int) -> list[dict]:
    a = argparse.Namespace(
        seed=seed, requests=300, prompts=5, docs=20, doc_share=0.5, turns=3.0,
        session_gap_ms=400.0, think_ms=20_000.0,
    )  # fmt: skip
    return generate(a)


def test_generated_ids_are_prefix_hashes_and_the_last_block_is_new() -> None:
    reqs = _trace(1)
    assert reqs == _trace(1)  # deterministic per seed
    assert reqs != _trace(2)
    parent: dict[int, int] = {}  # block id -> the id before it (-1: a chain's first)
    seen: set[int] = set()
    reused = 0
    for r in reqs:
        ids = r["hash_ids"]
        assert r["input_length"] > 512 * (len(ids) - 1)
        assert ids[-1] not in seen  # the partial last block is new in every request
        for i, x in enumerate(ids):
            before = ids[i - 1] if i else -1
            assert parent.setdefault(x, before) == before  # one id, one prefix
            reused += x in seen
        seen.update(ids)
    assert reused > 0  # sessions' later turns and shared prompts reuse blocks
    ts = [r["timestamp"] for r in reqs]
    assert ts == sorted(ts)


def test_offline_baselines_and_ceilings_on_a_scan() -> None:
    chain = list(range(8))
    scan = [[1000 + i] for i in range(40)]
    reqs = [chain, *scan, chain]
    # LRU of 20 blocks loses the chain to the one-off scan; Belady and perfect admission keep
    # it (8 of the 56 references hit); perfect dead-block prediction too.
    assert global_lru(reqs, 20) == 0.0
    assert belady(reqs, 20) == 8 / 56
    assert lru_oracle(reqs, 20, dead=False) == 8 / 56
    assert lru_oracle(reqs, 20, dead=True) == 8 / 56
    assert unbounded(reqs) == 8 / 56
    # A chain A read for the last time: the dead-block oracle drops it, so the head of B
    # (read again later) survives the put of C; perfect admission alone keeps A and loses B.
    a, b, c = list(range(8)), list(range(50, 58)), [70, 71]
    reqs = [b, a, a, c, b, c]
    assert lru_oracle(reqs, 10, dead=True) == (8 + 2 + 2) / 36
    assert lru_oracle(reqs, 10, dead=False) == (8 + 2) / 36
    assert global_lru(reqs, 10) == (8 + 2) / 36
