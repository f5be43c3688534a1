"""The metadata plane's structures without Ray: ids, the id table, holders, the local view."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvray.meta.holders import (
    MAX_POOLS,
    PLACEMENT_BASE,
    HolderTable,
    decode_slots,
    full_masks,
    split_positions,
)
from kvray.meta.ids import index_shard_of, key_ids, shard_ids
from kvray.meta.idtable import IdTable
from kvray.meta.messages import Changes, NodeInfo
from kvray.meta.view import LocalView


def test_ids_are_stable_never_reserved_and_split_evenly() -> None:
    keys = [bytes([i % 256]) * (1 + i % 50) for i in range(20_000)]
    ids = key_ids(keys)
    assert ids.dtype == np.uint64 and (ids >= 2).all()
    assert np.array_equal(ids, key_ids(keys))  # deterministic across calls (and processes)
    assert len(set(ids.tolist())) == len(set(keys))
    sid = shard_ids(ids, np.arange(ids.size) % 8)
    assert (sid >= 2).all() and not np.array_equal(sid, ids)
    assert not np.array_equal(shard_ids(ids, 0), shard_ids(ids, 1))
    counts = np.bincount(index_shard_of(key_ids([i.to_bytes(8, "big") for i in range(80_000)]), 5))
    assert counts.size == 5 and counts.min() > 15_000  # about 16k each


def test_id_table_matches_a_dict_under_random_batches() -> None:
    rng = np.random.default_rng(1)
    t = IdTable({"v": np.uint32})
    ref: dict[int, int] = {}
    for step in range(400):
        ids = np.unique(rng.integers(2, 4000, rng.integers(1, 500), dtype=np.uint64))
        if step % 3 == 2:
            existed = t.delete(ids)
            assert existed.tolist() == [i in ref for i in ids.tolist()]
            for i in ids.tolist():
                ref.pop(i, None)
        else:
            vals = rng.integers(0, 1 << 30, ids.size).astype(np.uint32)
            _, new = t.upsert(ids, v=vals)
            assert new.tolist() == [i not in ref for i in ids.tolist()]
            ref.update(zip(ids.tolist(), vals.tolist(), strict=True))
        probe = np.arange(2, 4000, dtype=np.uint64)
        found, vals = t.get(probe, "v")
        assert found.tolist() == [i in ref for i in probe.tolist()]
        assert vals[found].tolist() == [ref[i] for i in probe[found].tolist()]
        q = np.unique(rng.integers(2, 4000, 64, dtype=np.uint64))
        expect = next((n for n, i in enumerate(q.tolist()) if i not in ref), q.size)
        assert t.prefix_len(q) == expect
        assert len(t) == len(ref)
    ids, cols = t.items()
    assert dict(zip(ids.tolist(), cols["v"].tolist(), strict=True)) == ref


def test_id_table_grows_and_stays_compact() -> None:
    t = IdTable({"loc": np.uint16})
    ids = key_ids([i.to_bytes(4, "big") for i in range(300_000)])
    for a in range(0, ids.size, 50_000):
        t.upsert(ids[a : a + 50_000], loc=np.ones(50_000, dtype=np.uint16))
    assert len(t) == ids.size
    assert t.nbytes / len(t) <= 32, "a view must stay within 32 bytes a block"
    assert t.prefix_len(ids[:1000]) == 1000
    t.delete(ids[:299_990])
    assert len(t) == 10 and t.contains(ids[-10:]).all()
    with pytest.raises(ValueError, match="reserved"):
        t.upsert(np.array([1], dtype=np.uint64))


def test_holders_match_a_model_of_pools_and_shards() -> None:
    """Random adds, removes, purges and resyncs of shards held by 4 pools, against a model:
    a block is visible only with every shard held, at the pool holding it whole (the lowest)
    or at a placement naming one holder per shard."""
    rng = random.Random(1)
    h = HolderTable()
    model: dict[int, dict[int, set[int]]] = {}
    nsh: dict[int, int] = {}
    visible: dict[int, int] = {}
    split_seen = 0

    def expected(b: int) -> tuple[str, object] | None:
        holders = {s: sh for s, sh in model.get(b, {}).items() if sh}
        whole = [s for s, sh in holders.items() if len(sh) == nsh[b]]
        if whole:
            return "one", min(whole)
        union = set().union(*holders.values()) if holders else set()
        if len(union) == nsh[b]:
            order = sorted(holders)
            return "split", tuple(next(s for s in order if i in holders[s]) for i in range(nsh[b]))
        return None

    for _ in range(2500):
        slot = rng.randrange(4)
        ids = [rng.randrange(2, 60) for _ in range(rng.randrange(1, 12))]
        for b in ids:
            nsh.setdefault(b, 1 + b % 3)
        shards = [rng.randrange(nsh[b]) for b in ids]
        op = rng.random()
        if op < 0.55:
            for b, s in zip(ids, shards, strict=True):
                model.setdefault(b, {}).setdefault(slot, set()).add(s)
            d = h.add(
                slot, np.array(ids, np.uint64), np.array(shards), np.array([nsh[b] for b in ids])
            )
        elif op < 0.9:
            for b, s in zip(ids, shards, strict=True):
                model.get(b, {}).get(slot, set()).discard(s)
            d = h.remove(slot, np.array(ids, np.uint64), np.array(shards))
        elif op < 0.95:
            for held in model.values():
                held.pop(slot, None)
            d = h.purge(slot)
        else:
            keep = [
                (b, s)
                for b, held in model.items()
                for s in held.get(slot, ())
                if rng.random() < 0.7
            ]
            keep += [(b, rng.randrange(nsh[b])) for b in ids]
            for held in model.values():
                held.pop(slot, None)
            for b, s in keep:
                model.setdefault(b, {}).setdefault(slot, set()).add(s)
            d = h.replace(
                slot,
                np.array([b for b, _ in keep], np.uint64),
                np.array([s for _, s in keep]),
                np.array([nsh[b] for b, _ in keep]),
            )
        for i, code in zip(d.ids.tolist(), d.locs.tolist(), strict=True):
            if code:
                visible[i] = code
            else:
                visible.pop(i, None)
        for b in set(model) | set(visible):
            e = expected(b)
            got = visible.get(b)
            if e is None:
                assert got is None, b
            elif e[0] == "one":
                assert got == int(e[1]) + 1  # type: ignore[call-overload]
            else:
                assert got is not None and got >= PLACEMENT_BASE
                assert h.placements.tuples[got] == e[1]
                split_seen += 1
        ids_v, locs_v = h.visible()
        assert dict(zip(ids_v.tolist(), locs_v.tolist(), strict=True)) == visible
        assert len(h) == sum(1 for held in model.values() if any(held.values()))
    assert split_seen > 100, "split placements were exercised"


def test_full_masks_cover_64_shards() -> None:
    assert full_masks(np.array([1, 2, 8, 63, 64])).tolist() == [1, 3, 255, 2**63 - 1, 2**64 - 1]


def test_view_applies_records_snapshots_and_resolves_locations() -> None:
    v = LocalView(2)
    added: list[int] = []
    removed: list[int] = []
    v.listener = lambda a, r: (added.extend(a.tolist()), removed.extend(r.tolist()))
    ids = key_ids([b"k%d" % i for i in range(10)])
    nodes = {0: NodeInfo(0, "n0", "ns/pool/n0", 1), 3: NodeInfo(3, "n3", "ns/pool/n3", 1)}
    shard = index_shard_of(ids, 2)
    code = PLACEMENT_BASE + 7
    for s in (0, 1):
        mine = ids[shard == s]
        locs = np.full(mine.size, 1, dtype=np.uint16)
        locs[-1] = code
        v.apply(
            Changes(
                index_shard=s, epoch="e", seq=1, ids=mine, locs=locs, snapshot=True,
                placements={code: (3, 0)}, nodes=nodes,
            )
        )  # fmt: skip
    assert v.lookup(ids) == 10 and len(v) == 10
    assert sorted(added) == sorted(ids.tolist())
    slots = v.slot_of(ids, v.locs(ids), 1)
    split = [i for i in range(10) if v.locs(ids[i : i + 1])[0] == code]
    assert [slots[i] for i in split] == [0, 0]
    assert v.slot_of(ids[split], v.locs(ids[split]), 0).tolist() == [3, 3]
    assert all(slots[i] == 0 for i in range(10) if i not in split)
    # Records: a later record of an id wins; 0 removes.
    first = ids[shard == 0][0]
    v.apply(
        Changes(
            index_shard=0, epoch="e", seq=3, ids=np.array([first, first], dtype=np.uint64),
            locs=np.array([2, 0], dtype=np.uint16), nodes=nodes,
        )
    )  # fmt: skip
    assert not v.contains(np.array([first], dtype=np.uint64))[0]
    assert removed == [int(first)]
    # A shard that goes away is cleared; the other shard's blocks stay.
    v.clear_index_shard(1)
    assert len(v) == int((shard == 0).sum()) - 1
    assert v.seqs[1] == -1 and v.epochs[1] == ""
    assert MAX_POOLS < PLACEMENT_BASE


def test_location_codes_decode_in_one_place() -> None:
    """0: nowhere; 1..MAX_POOLS: one pool holds every shard; above: a placement tuple."""
    split = PLACEMENT_BASE + 2
    locs = np.array([0, 1, MAX_POOLS, PLACEMENT_BASE, split], dtype=np.uint16)
    assert split_positions(locs).tolist() == [3, 4]
    placements = [(5, 6), None]  # the second code is not known to the reader
    assert decode_slots(locs, 0, placements).tolist() == [-1, 0, MAX_POOLS - 1, 5, -1]
    assert decode_slots(locs, 1, placements).tolist() == [-1, 0, MAX_POOLS - 1, 6, -1]
    assert decode_slots(locs, 2, placements).tolist() == [-1, 0, MAX_POOLS - 1, -1, -1]
    assert decode_slots(np.zeros(0, dtype=np.int64), 0, []).tolist() == []
    with pytest.raises(ValueError, match="placement"):
        decode_slots(locs, 0, [])


def test_segment_meta_wire_round_trip_and_truncation() -> None:
    """What a put sends its pool in one argument: every field back equal; data cut short
    anywhere is a ValueError, never a segment with the wrong keys or sizes."""
    from kvray.meta.segment import SegmentMeta

    keys = [b"a" * 5, b"bc", b"d" * 40]
    meta = SegmentMeta.from_keys(
        keys,
        np.array([1, 2, 3], np.uint64),
        np.array([0, 1, 0], np.uint16),
        np.array([1, 2, 1], np.uint16),
        np.array([10, 20, 30], np.int64),
        np.array([7, 8, 2**63 + 5], np.uint64),
    )
    wire = meta.to_wire()
    back = SegmentMeta.from_wire(wire)
    assert back.keys() == keys
    for name in ("key_offsets", "ids", "shards", "nshards", "sizes", "checksums"):
        assert np.array_equal(getattr(back, name), getattr(meta, name)), name
        assert getattr(back, name).dtype == getattr(meta, name).dtype, name
    for cut in range(len(wire)):
        with pytest.raises(ValueError):
            SegmentMeta.from_wire(wire[:cut])


def test_lease_request_and_small_reply_wire_round_trip() -> None:
    """A read's request and a reply served by value as bytes (what the hot calls send):
    every key, id, flag, position, size, checksum, reason and block byte comes back equal;
    a reply naming objects is not encoded; data cut short is a ValueError."""
    from kvray.meta.messages import LeaseReply
    from kvray.meta.wire import (
        lease_request,
        parse_lease_request,
        reply_from_wire,
        reply_to_wire,
    )

    keys = [b"k" * 3, b"", b"key-three"]
    ids = np.array([5, 6, 2**64 - 1], np.uint64)
    for timeout in (None, 2.5):
        back = parse_lease_request(lease_request(keys, ids, 3, timeout, True, 4096))
        assert back[0] == keys and np.array_equal(back[1], ids)
        assert back[2:] == (3, timeout, True, 4096)
    rng = np.random.default_rng(0)
    equal = rng.integers(0, 255, (2, 64), dtype=np.uint8)
    ragged = [rng.integers(0, 255, 10, dtype=np.uint8), rng.integers(0, 255, 30, dtype=np.uint8)]
    reply = LeaseReply.empty(77, 5)
    reply.point(0, 4, 1, 64, 11)
    reply.point(1, 4, 0, 64, 12)
    reply.point(2, 9, 0, 10, 13)
    reply.point(4, 9, 1, 30, 14)
    reply.reasons[3] = "checksum mismatch"
    reply.inline = {4: equal, 9: ragged}
    data = reply_to_wire(reply)
    assert data is not None
    got = reply_from_wire(data)
    assert got.lease_id == 77 and got.reasons == {3: "checksum mismatch"} and not got.segments
    for name in ("seg_ids", "positions", "nbytes", "checksums"):
        assert np.array_equal(getattr(got, name), getattr(reply, name)), name
    assert np.array_equal(got.inline[4], equal)
    assert [a.tobytes() for a in got.inline[9]] == [a.tobytes() for a in ragged]
    for cut in range(len(data) - len(b"3\0checksum mismatch")):
        with pytest.raises(ValueError):
            reply_from_wire(data[:cut])
    reply.segments[4] = object()  # an ObjectRef in a real reply: Ray must carry it
    assert reply_to_wire(reply) is None


def test_id_table_find_one_agrees_with_find() -> None:
    """The scalar probe the policies use finds what the compiled batch probe finds, present
    ids, absent ones and ids behind tombstones alike."""
    from kvray.meta.idtable import IdTable

    rng = np.random.default_rng(5)
    ids = np.unique(rng.integers(2, 2**63, 3000, dtype=np.uint64))
    t = IdTable({"v": np.uint8})
    t.upsert(ids)
    t.delete(ids[::3])
    probe = np.concatenate((ids, rng.integers(2, 2**63, 500, dtype=np.uint64)))
    want = t.find(probe)
    assert [t.find_one(int(x)) for x in probe] == want.tolist()
    assert (want >= 0).sum() == ids.size - ids[::3].size
    # One at a time, through rebuilds and tombstones, as a dict would.
    model: dict[int, int] = {}
    one = IdTable({"v": np.int32})
    for i, x in enumerate(rng.integers(2, 400, 5000).tolist()):
        if i % 3 == 2:
            assert one.delete_one(x) == (model.pop(x, None) is not None)
        else:
            one.upsert_one(x, v=i)
            model[x] = i
    assert len(one) == len(model)
    got, vals = one.get(np.array(sorted(model), dtype=np.uint64), "v")
    assert got.all() and vals.tolist() == [model[x] for x in sorted(model)]
