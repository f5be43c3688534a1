"""Eviction policies (issue 35): hand-made sequences where LRU and ``probation`` must differ,
capacity never exceeded, the pool's state and its disk admission agreeing with the policy, and
the policy end to end through the store API on a real Ray cluster."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from kvray.actors.poolstate import PoolState, Removed, Segment
from kvray.config import ConfigError, KVRayConfig
from kvray.disk import admit
from kvray.meta.eviction import POLICIES, LRUPolicy, ProbationPolicy, make_policy, simulate
from kvray.meta.ids import key_ids, shard_ids
from kvray.meta.segment import SegmentMeta, pack_keys


def _chain_then_scan(scan: int) -> list[list[int]]:
    """A chain of 8 blocks read twice, a scan of one-off requests, the chain again."""
    chain = list(range(8))
    ones = [[1000 + i] for i in range(scan)]
    return [chain, chain, *ones, chain]


@pytest.mark.parametrize("per_block", [False, True])
def test_a_scan_of_one_off_blocks_does_not_evict_a_reused_chain(per_block: bool) -> None:
    reqs = _chain_then_scan(scan=40)
    lru = simulate(reqs, 20, "lru", per_block=per_block)
    prob = simulate(reqs, 20, "probation", per_block=per_block)
    # The last request: LRU lost the chain to the scan, probation kept it.
    assert lru.hit_blocks == 8
    assert prob.hit_blocks == 16


def test_a_chains_tail_goes_before_its_head() -> None:
    for pol in (LRUPolicy(), ProbationPolicy(1000)):
        pol.insert(1, 10, 1, key=11)  # head
        pol.insert(2, 10, 1, key=12)  # tail (put later: the most recent)
        pol.touch([1, 2], [10, 10])  # a read of the prefix head -> tail
        first = next(pol.victims(lambda e: True))
        assert first == 2, pol.name
    # Per block: a chain read, then the pool fills; the tail's blocks go first.
    res = simulate([[1, 2, 3, 4], [1, 2, 3, 4], [9, 8]], 4, "lru", per_block=True)
    assert res.hit_blocks == 4


def test_capacity_is_never_exceeded() -> None:
    rng = np.random.default_rng(1)
    reqs = []
    for _ in range(400):
        root = int(rng.integers(0, 30)) * 1000
        reqs.append([root + i for i in range(int(rng.integers(1, 40)))])
    for name in POLICIES:
        for cap in (7, 50, 300):
            for per_block in (False, True):
                res = simulate(reqs, cap, name, per_block=per_block)
                assert res.max_used <= cap
                assert res.hit_blocks <= res.total_blocks
            pools = simulate(reqs, cap, name, nodes=3)  # each pool within its share
            assert pools.max_used <= cap // 3 and pools.hit_blocks <= pools.total_blocks
            home = simulate(reqs, cap, name, nodes=3, placement="home")
            assert home.max_used <= cap // 3 and home.hit_blocks <= home.total_blocks


def test_home_placement_keeps_a_chain_in_one_pool_and_concentrates_a_shared_head() -> None:
    """Pools with puts in the prefix's pool ("home"): a conversation that grows turn by turn
    keeps every block in one pool, so its next turn hits it whole wherever it runs; and when
    every request shares its first block (a system prompt, as in Mooncake's conversation
    trace), everything lands in one pool: the others stay empty and the cluster holds a
    pool's worth. Round robin ("own") spreads them."""
    turns = [list(range(1, 1 + 4 * t)) for t in range(1, 5)]  # 4, 8, 12, 16 blocks
    home = simulate(turns, 64, "lru", nodes=4, placement="home")
    assert home.hit_blocks == 4 + 8 + 12  # every turn hits the whole previous one
    # 8 conversations of 8 blocks after the shared one, each asked twice: 57 blocks, within
    # the 4 x 16 blocks round robin spreads them over; in one pool of 16, 2 of them fit.
    convs = [[0, *range(100 * k, 100 * k + 7)] for k in range(1, 9)]
    own = simulate(convs + convs, 64, "lru", nodes=4)
    one_pool = simulate(convs + convs, 64, "lru", nodes=4, placement="home")
    assert own.hit_blocks == 7 + 8 * 8  # the shared block, then every second ask whole
    assert one_pool.hit_blocks < own.hit_blocks / 2, one_pool
    with pytest.raises(ValueError, match="placement"):
        simulate(turns, 64, "lru", nodes=4, placement="nearest")


def test_leased_entries_are_skipped_and_stats_say_why() -> None:
    pol = make_policy("probation", 100)
    for eid in (1, 2, 3):
        pol.insert(eid, 10, 1, key=eid)
    pol.touch([3], [10])  # read: to main
    order = []
    for eid in pol.victims(lambda e: e != 1):  # 1 is leased
        order.append(eid)
        pol.remove(eid, evicted=True)
    assert order == [2, 3]
    assert pol.stats()["evicted_unread"] == 1 and pol.stats()["evicted_read"] == 1
    # 2 comes back while its ghost is remembered: straight to main.
    pol.insert(2, 10, 1, key=2)
    assert pol.stats()["ghost_hits"] == 1
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_policy("fifo", 100)


def tight_reuse() -> list[list[int]]:
    """A 5-block chain read every 10 requests, 27 one-off blocks between: more than a 20-block
    cache, so LRU never hits it."""
    reqs: list[list[int]] = []
    k = 10**6
    for _ in range(60):
        reqs.append([1, 2, 3, 4, 5])
        for _ in range(9):
            reqs.append([k, k + 1, k + 2])
            k += 10
    return reqs


def roomy_reuse() -> list[list[int]]:
    """Every 2-block chain read once, 4 chains after its put: 16 blocks of traffic, within a
    20-block cache."""
    reqs: list[list[int]] = []
    for i in range(400):
        reqs.append([1000 * i, 1000 * i + 1])
        if i >= 4:
            reqs.append([1000 * (i - 4), 1000 * (i - 4) + 1])
    return reqs


def test_adaptive_keeps_the_doorkeeper_where_reuse_comes_back_beyond_the_capacity() -> None:
    """Tight: a 5-block chain read every 10 requests, 27 one-off blocks between (more than
    the 20-block cache). LRU never hits it; ``adaptive`` keeps it as ``probation`` does, and
    its share stays at its floor (each read of the chain is one LRU would have lost)."""
    reqs = tight_reuse()
    got = {n: simulate(reqs, 20, make_policy(n, 20)).hit_rate for n in POLICIES}
    assert got["lru"] == 0.0
    assert got["adaptive"] == got["probation"] > 0.15
    pol = make_policy("adaptive", 20)
    simulate(reqs, 20, pol)
    assert pol.stats()["lru_would_miss"] >= 50 and pol.stats()["probation_share_pct"] == 2


def test_adaptive_turns_to_recency_where_lru_would_have_hit() -> None:
    """Roomy: every 2-block chain is read once, 4 chains after its put (16 blocks of traffic
    in a 20-block cache). ``probation`` evicts each from its FIFO before that read and hits
    almost nothing; ``adaptive`` sees each such miss as one LRU would have hit (its ghost
    came back within the capacity), grows its FIFO and hits what LRU hits."""
    reqs = roomy_reuse()
    got = {n: simulate(reqs, 20, make_policy(n, 20)).hit_rate for n in POLICIES}
    assert got["probation"] < 0.05 and got["lru"] > 0.45
    assert got["adaptive"] >= 0.95 * got["lru"]
    pol = make_policy("adaptive", 20)
    simulate(reqs, 20, pol)
    stats = pol.stats()
    assert stats["lru_would_hit"] >= 1 and stats["probation_share_pct"] == 50
    # Bookkeeping is per entry and per ghost, ghosts bounded (at least 64 kept): 400 puts later
    assert pol.meta_nbytes() < 16 << 10


def test_config_names_the_policies() -> None:
    for name in POLICIES:  # the config accepts every policy there is
        assert KVRayConfig(eviction_policy=name).eviction_policy == name
    with pytest.raises(ConfigError, match="eviction_policy"):
        KVRayConfig(eviction_policy="arc")


# ---------------------------------------------------------------------- the pool's state
def _segment(tag: str, n: int, size: int = 100) -> tuple[SegmentMeta, np.ndarray]:
    keys = [f"{tag}/{i}".encode() for i in range(n)]
    blob, offsets = pack_keys(keys)
    ids = key_ids(keys)
    z = np.zeros(n, dtype=np.uint16)
    meta = SegmentMeta(blob, offsets, ids, z, z + 1, np.full(n, size), np.zeros(n, np.uint64))
    return meta, shard_ids(ids, z)


@pytest.mark.parametrize("policy", ["probation", "adaptive"])
def test_pool_state_and_disk_admission_agree_on_what_ram_evicts(policy: str) -> None:
    """With ``probation`` (and ``adaptive``, whose FIFO a scan of one-offs does not grow),
    RAM first evicts segments never read; the disk tier's admission
    (``disk_admit_min_hits=1``) spills exactly the evicted segments that were read."""
    st = PoolState(1000, policy)
    spilled: list[int] = []
    not_admitted: list[int] = []

    def on_evict(seg_id: int, seg: Segment, removed: Removed) -> bool:
        chosen = admit(seg.hits, 1)
        (spilled if chosen is not None and chosen.size else not_admitted).append(seg_id)
        return False

    st.on_evict = on_evict
    chain, chain_pids = _segment("chain", 4)
    chain_id, _ = st.add(chain, chain_pids, object(), None)  # type: ignore[arg-type]
    # A read of the chain (as BlockPool.lease does): its hits and the policy's touch.
    st.segments[chain_id].hits[:] += 1
    st.touch([chain_id], [400])
    ones = []
    for i in range(12):  # one-off puts of 100 bytes: more than the 600 bytes left
        meta, pids = _segment(f"one/{i}", 1)
        removed = Removed()
        st.make_room(100, removed)
        seg_id, _ = st.add(meta, pids, object(), None)  # type: ignore[arg-type]
        ones.append(seg_id)
        assert st.used <= st.capacity
    assert chain_id in st.segments and st.segments[chain_id].in_ram
    assert not spilled and set(not_admitted) <= set(ones) and not_admitted
    figures = st.figures()
    assert figures["policy_evicted_unread"] == len(not_admitted)
    assert figures["policy_evicted_read"] == 0
    # Now RAM must evict the read chain too: the disk tier admits it.
    st.make_room(1000, Removed())
    assert spilled == [chain_id]


# ---------------------------------------------------------------------- end to end
BLOCK = 64 << 10


@pytest.fixture(scope="module")
def namespaces(ray_cluster: object) -> Iterator[dict[str, str]]:
    import kvray

    out = {}
    for policy in POLICIES:
        ns = f"ev{uuid.uuid4().hex[:8]}"
        kvray.start(namespace=ns, capacity="1MiB", eviction_policy=policy)
        out[policy] = ns
    try:
        yield out
    finally:
        for ns in out.values():
            kvray.stop(ns)


@pytest.mark.parametrize("policy", POLICIES)
def test_store_api_probation_keeps_a_read_chain_through_a_scan(
    namespaces: dict[str, str], policy: str
) -> None:
    """Through ``kvray.connect``: a chain is put and read back, then 24 one-off blocks of
    64 KiB (1.5x the 1 MiB pool) are put; ``probation`` and ``adaptive`` (nothing in the scan
    comes back, so its FIFO stays small) still serve the chain with every byte right, ``lru``
    lost it; the pool never holds more than its capacity."""
    import kvray

    rng = np.random.default_rng(7)
    with kvray.connect(namespaces[policy]) as store:
        chain = [f"chain/{i}".encode() for i in range(4)]
        data = rng.integers(0, 256, size=(4, BLOCK), dtype=np.uint8)
        store.put(chain, data).result(timeout=30)
        store.sync()
        assert store.lookup(chain) == 4
        got = store.get(chain)
        assert all(np.array_equal(g, d) for g, d in zip(got, data, strict=True))
        for i in range(24):
            block = rng.integers(0, 256, size=(1, BLOCK), dtype=np.uint8)
            store.put([f"one/{i}".encode()], block).result(timeout=30)
        store.sync()
        pools = [p for p in store.stats()["nodes"].values() if "error" not in p]
        assert pools and all(p["bytes"] <= p["capacity"] for p in pools)
        held = store.lookup(chain)
        if policy in ("probation", "adaptive"):
            assert held == 4
            got = store.get(chain)
            assert all(np.array_equal(g, d) for g, d in zip(got, data, strict=True))
            assert sum(p["policy_evicted_unread"] for p in pools) > 0
        else:
            assert held < 4


def test_requests_together_do_not_see_each_others_puts() -> None:
    """``together``: a request repeating the one before it hits only when they ran in
    different groups (engines working at once miss what the other is putting)."""
    reqs = [[1, 2, 3], [1, 2, 3], [1, 2, 3], [1, 2, 3]]
    assert simulate(reqs, 100, "lru").hit_blocks == 9
    assert simulate(reqs, 100, "lru", together=2).hit_blocks == 6  # the 2nd of each pair
    assert simulate(reqs, 100, "lru", together=4).hit_blocks == 0
