"""The disk tier on real files (issue 12, part 1): no Ray cluster, numpy payloads, tmp_path."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from kvray.blocks import checksum
from kvray.config import ConfigError
from kvray.disk import DiskSegment, DiskTier, admit, segfile
from kvray.disk.payload import Payload, check_payload, meta_digest
from kvray.errors import BlockLostError, KVRayError
from kvray.meta.segment import SegmentMeta

MiB = 1 << 20
FORMS = ["array", "list", "views"]  # 2D array; scattered 1D arrays; 1D views of one buffer


def make_segment(
    rng: np.random.Generator, n: int, block_nbytes: int, form: str
) -> tuple[SegmentMeta, Payload]:
    """``n`` random blocks with random 44-byte keys, as ``form`` (variable sizes for lists)."""
    if form == "array":
        payload: Payload = np.frombuffer(rng.bytes(n * block_nbytes), np.uint8).reshape(
            n, block_nbytes
        )
    else:
        sizes = rng.integers(block_nbytes // 2, block_nbytes * 3 // 2, n).tolist()
        if form == "list":
            payload = [np.frombuffer(rng.bytes(s), np.uint8) for s in sizes]
        else:  # laid out as Ray lays out the arrays of one object: 64-byte aligned
            starts = [0]
            for size in sizes[:-1]:
                starts.append((starts[-1] + size + 63) // 64 * 64)
            flat = np.frombuffer(rng.bytes(starts[-1] + sizes[-1]), np.uint8)
            payload = [flat[a : a + size] for a, size in zip(starts, sizes, strict=True)]
    meta = SegmentMeta.from_keys(
        [rng.bytes(44) for _ in range(n)],
        rng.integers(0, 2**63, n, dtype=np.uint64),
        np.zeros(n, np.uint16),
        np.ones(n, np.uint16),
        [payload[i].nbytes for i in range(n)],
        [checksum(payload[i]) for i in range(n)],
    )
    return meta, payload


def keys_of(meta: SegmentMeta) -> list[bytes]:
    return meta.keys()


def files_bytes(tier: DiskTier) -> int:
    """Bytes of every file in the tier's directory (temporary ones included), read from disk."""
    return sum(
        os.path.getsize(os.path.join(tier.dir, f)) for f in os.listdir(tier.dir) if f != ".lock"
    )


def assert_same_blocks(got: Payload, want: Payload, n: int) -> None:
    assert len(got) == n
    for i in range(n):
        assert not got[i].flags.writeable
        np.testing.assert_array_equal(got[i], want[i])


class Recorder:
    """The owner's side of the callbacks: which segments are on disk now."""

    def __init__(self, tier: DiskTier, check_capacity: bool = True) -> None:
        self.tier = tier
        self.live: dict[int, DiskSegment] = {}
        self.over: list[int] = []
        self.lock = threading.Lock()
        self.check_capacity = check_capacity
        tier.events.on_spilled = self.spilled
        tier.events.on_evicted = self.evicted

    def spilled(self, seg: DiskSegment) -> None:
        with self.lock:
            self.live[seg.id] = seg
        on_disk = files_bytes(self.tier)
        if self.check_capacity and on_disk > self.tier.capacity:
            self.over.append(on_disk)

    def evicted(self, segs: list[DiskSegment]) -> None:
        with self.lock:
            for seg in segs:
                del self.live[seg.id]


def test_payload_helpers() -> None:
    """The checks around the pool's SegmentMeta that the tier adds (SegmentMeta is the pool's)."""
    rng = np.random.default_rng(1)
    meta, payload = make_segment(rng, 6, 1000, "list")
    sub = meta.take([4, 1])
    assert sub.keys() == [meta.key(4), meta.key(1)]
    assert meta_digest(meta) == meta_digest(meta.take(range(6)))
    assert meta_digest(meta) != meta_digest(sub)
    flipped = SegmentMeta(**{**meta.__dict__, "checksums": meta.checksums ^ np.uint64(1)})
    assert meta_digest(flipped) != meta_digest(meta)
    check_payload(meta, payload)
    with pytest.raises(ValueError, match="5 arrays for 6 blocks"):
        check_payload(meta, payload[:5])
    with pytest.raises(ValueError, match="block 2 has"):
        check_payload(meta, [*payload[:2], payload[2][:-1], *payload[3:]])
    with pytest.raises(TypeError, match="block 0 must be"):
        check_payload(meta, [payload[0].view(np.int8), *payload[1:]])
    meta2d, array = make_segment(rng, 3, 64, "array")
    check_payload(meta2d, array)
    with pytest.raises(TypeError, match="2D C-contiguous uint8"):
        check_payload(meta2d, array.T)
    with pytest.raises(ValueError, match="2 rows for 3 blocks"):
        check_payload(meta2d, array[:2])
    # One checksum (kvray.blocks.checksum, the client's): RAM and disk blocks verify alike.
    import kvray.client

    assert kvray.client.checksum is checksum


@pytest.mark.parametrize("form", FORMS)
def test_spill_128mib_through_64mib(tmp_path, form: str) -> None:
    """128 MiB through a 64 MiB tier: capacity holds after every write, surviving blocks read
    back equal (also after a restart), and every block is counted once."""
    rng = np.random.default_rng(2)
    tier = DiskTier(tmp_path, "ns", 64 * MiB, max_pending_bytes=160 * MiB)
    assert tier.scan() == []
    rec = Recorder(tier)
    tier.start()
    segments = [make_segment(rng, 16, 256 << 10, form) for _ in range(32)]
    by_key = {}
    total = 0
    for meta, payload in segments:
        assert tier.spill(meta, payload)
        total += meta.nbytes
        by_key.update({meta.key(i): payload[i] for i in range(len(meta))})
    assert total >= 128 * MiB * (0.99 if form == "array" else 0.9)
    assert tier.close(timeout=120)
    assert rec.over == []
    stats = tier.stats()
    assert stats["spilled"] == 32 * 16 and stats["disk_skipped"] == 0
    assert stats["spilled"] == stats["disk_blocks"] + stats["disk_evictions"]
    assert stats["disk_blocks"] == sum(len(s.meta) for s in rec.live.values())
    assert stats["disk_bytes"] == files_bytes(tier) <= 64 * MiB
    assert stats["disk_bytes"] > 48 * MiB  # LRU evicts only what it must
    assert 0 < len(rec.live) < 32 and stats["disk_pending_bytes"] == 0
    for seg in rec.live.values():
        got = tier.read(seg)
        assert tier.verify(seg, got) == []
        assert_same_blocks(got, [by_key[k] for k in keys_of(seg.meta)], len(seg.meta))
    # Restart: the same files, the same bytes, nothing else.
    again = DiskTier(tmp_path, "ns", 64 * MiB)
    assert again.dir == tier.dir
    found = again.scan()
    assert sorted(s.id for s in found) == sorted(rec.live)
    assert [s.id for s in found] == sorted(s.id for s in found)  # oldest first
    for seg in found:
        assert seg.meta.keys() == rec.live[seg.id].meta.keys()
        assert seg.block_nbytes == (256 << 10 if form == "array" else 0)
        got = again.read(seg)
        assert tier.verify(seg, got) == []
        assert_same_blocks(got, [by_key[k] for k in keys_of(seg.meta)], len(seg.meta))
    assert again.stats()["disk_scanned"] == stats["disk_blocks"]
    assert again.stats()["disk_bytes"] == stats["disk_bytes"]
    again.close()


def _flip(path: str, needle: bytes) -> None:
    """Flip one bit of the byte at the middle of ``needle``'s only occurrence in ``path``."""
    with open(path, "r+b") as f:
        data = f.read()
        pos = data.find(needle)
        assert pos >= 0 and data.find(needle, pos + 1) < 0
        f.seek(pos + len(needle) // 2)
        f.write(bytes([data[pos + len(needle) // 2] ^ 0x10]))


def _spill_and_close(tier: DiskTier, segments: list[tuple[SegmentMeta, Payload]]) -> Recorder:
    tier.scan()
    rec = Recorder(tier)
    tier.start()
    for meta, payload in segments:
        assert tier.spill(meta, payload)
    assert tier.close(timeout=60)
    return rec


def test_scan_skips_truncated_corrupt_and_foreign_files(tmp_path) -> None:
    rng = np.random.default_rng(3)
    segments = [make_segment(rng, 4, 64 << 10, "array") for _ in range(6)]
    rec = _spill_and_close(DiskTier(tmp_path / "d", "ns", 64 * MiB, fingerprint="fp"), segments)
    segs = sorted(rec.live.values(), key=lambda s: s.id)
    assert len(segs) == 6
    truncated, data_flip, meta_flip, good = segs[0], segs[1], segs[2], segs[3:]
    with open(truncated.path, "r+b") as f:
        f.truncate(truncated.file_bytes - 100)
    _flip(data_flip.path, segments[1][1][2][1000:1064].tobytes())
    _flip(meta_flip.path, segments[2][0].key(1))
    # Files from another namespace and another fingerprint, renamed into our slot.
    dir0 = os.path.dirname(segs[0].path)
    for i, (ns, fp) in enumerate([("other", "fp"), ("ns", "fp2")]):
        foreign = _spill_and_close(
            DiskTier(tmp_path / f"f{i}", ns, 8 * MiB, fingerprint=fp),
            [make_segment(rng, 2, 4096, "array")],
        )
        (seg,) = foreign.live.values()
        os.rename(seg.path, os.path.join(dir0, f"{100 + i:016x}.arrow"))
    # An interrupted write: half a valid file under its temporary name.
    with open(good[0].path, "rb") as f:
        half = f.read(good[0].file_bytes // 2)
    with open(os.path.join(dir0, f"{200:016x}.arrow.tmp"), "wb") as f:
        f.write(half)

    tier = DiskTier(tmp_path / "d", "ns", 64 * MiB, fingerprint="fp")
    found = {s.id: s for s in tier.scan()}
    # The flipped data byte passes the cheap scan; everything else bad is gone for good.
    assert sorted(found) == sorted([data_flip.id] + [s.id for s in good])
    assert tier.stats()["disk_corrupt"] == 4  # truncated, metadata flip, 2 foreign
    assert sorted(os.listdir(dir0)) == sorted(
        [".lock"] + [os.path.basename(s.path) for s in found.values()]
    )
    for seg in good:
        payload = tier.read(found[seg.id])
        assert tier.verify(found[seg.id], payload) == []
    payload = tier.read(found[data_flip.id])
    assert tier.verify(found[data_flip.id], payload) == [2]
    assert tier.stats()["disk_corrupt"] == 5
    assert tier.remove(found[data_flip.id])
    with pytest.raises(BlockLostError, match="evicted"):
        tier.read(found[data_flip.id])
    tier.close()


def test_read_of_a_file_corrupted_after_scan_is_lost_and_deleted(tmp_path) -> None:
    rng = np.random.default_rng(4)
    rec = _spill_and_close(DiskTier(tmp_path, "ns", 8 * MiB), [make_segment(rng, 2, 4096, "list")])
    tier = DiskTier(tmp_path, "ns", 8 * MiB)
    (seg,) = tier.scan()
    with open(seg.path, "r+b") as f:
        f.truncate(seg.file_bytes // 2)
    with pytest.raises(BlockLostError, match="corrupt") as err:
        tier.read(seg)
    assert err.value.keys == next(iter(rec.live.values())).meta.keys()
    assert not os.path.exists(seg.path)
    assert tier.stats()["disk_corrupt"] == 1 and tier.stats()["disk_files"] == 0
    tier.close()


_CRASHER = """
import sys, time, numpy as np
from kvray.disk import DiskTier
from kvray.meta.segment import SegmentMeta
tier = DiskTier(sys.argv[1], "ns", 256 << 20, max_pending_bytes=32 << 20)
tier.scan()
tier.events.on_spilled = lambda seg: print("spilled", seg.id, flush=True)
tier.start()
payload = np.frombuffer(np.random.default_rng(5).bytes(8 << 20), np.uint8).reshape(4, 2 << 20)
s = 0
while True:  # spill forever: the kill lands while a group is being written
    keys = [s.to_bytes(4, "little") + bytes([i]) * 40 for i in range(4)]
    meta = SegmentMeta.from_keys(keys, np.arange(4), [0] * 4, [1] * 4, [2 << 20] * 4, [0] * 4)
    if tier.spill(meta, payload):
        s += 1
    else:
        time.sleep(0.001)
"""


def test_killed_writer_leaves_only_complete_files(tmp_path) -> None:
    """SIGKILL a process in the middle of writing a group: its slot is free again, a scan returns
    only complete files (their checksums are zero, so only the layout is checked: every key and
    block reads back whole) and no temporary file survives."""
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_CRASHER), str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("spilled"), line
        slot = tmp_path / "ns" / "0"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # kill it while a temporary file is there
            if any(name.endswith(".tmp") for name in os.listdir(slot)):
                break
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    tier = DiskTier(tmp_path, "ns", 256 << 20)
    assert tier.dir.endswith(os.sep + "0")  # the dead process's slot
    found = tier.scan()
    assert found and tier.stats()["disk_corrupt"] == 0
    assert sum(s.file_bytes for s in found) <= 256 << 20
    assert not [f for f in os.listdir(tier.dir) if f.endswith(".tmp")]
    for seg in found:
        payload = tier.read(seg)
        assert payload.shape == (4, 2 << 20)
        assert seg.meta.key(3)[4:] == bytes([3]) * 40
    tier.close()


def test_slots_separate_live_tiers_and_survive_them(tmp_path) -> None:
    rng = np.random.default_rng(6)
    first = DiskTier(tmp_path, "ns", 8 * MiB)
    second = DiskTier(tmp_path, "ns", 8 * MiB)
    assert first.dir != second.dir
    assert {os.path.basename(first.dir), os.path.basename(second.dir)} == {"0", "1"}
    meta, payload = make_segment(rng, 3, 4096, "array")
    rec = _spill_and_close(first, [(meta, payload)])
    second.scan()
    assert second.stats()["disk_files"] == 0  # never sees the other slot's files
    third = DiskTier(tmp_path, "ns", 8 * MiB)
    assert third.dir == first.dir
    (seg,) = third.scan()
    assert seg.id in rec.live
    assert_same_blocks(third.read(seg), payload, 3)
    second.close()
    third.close()


def test_full_queue_refuses_without_blocking(tmp_path) -> None:
    rng = np.random.default_rng(7)
    tier = DiskTier(tmp_path, "ns", 256 * MiB, max_pending_bytes=6 * MiB)
    tier.scan()
    rec = Recorder(tier)
    tier.start()
    segments = [make_segment(rng, 16, 256 << 10, "array") for _ in range(8)]  # 4 MiB each
    accepted = [tier.spill(meta, payload) for meta, payload in segments]
    # The first is queued; the writer cannot have written 4 MiB and fsynced it before the
    # next call comes in, so that one finds 4 + 4 > 6 MiB pending and is refused at once.
    assert accepted[0] and not accepted[1]
    assert tier.stats()["disk_pending_bytes"] <= 6 * MiB
    big = make_segment(rng, 2, 8 * MiB, "array")
    small = DiskTier(tmp_path / "small", "ns", 8 * MiB)
    small.scan()
    small.start()
    assert not small.spill(*big)  # larger than the whole tier
    assert small.stats()["disk_skipped"] == 2
    small.close()
    assert tier.close(timeout=60)
    stats = tier.stats()
    assert stats["spilled"] == 16 * sum(accepted)
    assert stats["disk_skipped"] == 16 * (8 - sum(accepted))
    assert sorted(rec.live) == list(range(1, sum(accepted) + 1))


def test_close_drops_pending_writes_and_counts_them(tmp_path) -> None:
    rng = np.random.default_rng(8)
    tier = DiskTier(tmp_path, "ns", 256 * MiB, max_pending_bytes=256 * MiB)
    tier.scan()
    tier.start()
    big = make_segment(rng, 32, 2 * MiB, "array")
    segments = [make_segment(rng, 8, 1 * MiB, "array") for _ in range(6)]
    assert tier.spill(*big)
    deadline = time.monotonic() + 10
    while not any(n.endswith(".tmp") for n in os.listdir(tier.dir)):  # writing the 64 MiB
        assert time.monotonic() < deadline
    assert all(tier.spill(m, p) for m, p in segments)  # queued behind it
    assert tier.stats()["disk_pending_bytes"] == 64 * MiB + 6 * 8 * MiB
    tier.close(timeout=0, drain=False)
    assert tier.close(timeout=60)  # a second close waits for the current write
    stats = tier.stats()
    assert (stats["spilled"], stats["disk_skipped"]) == (32, 6 * 8)
    assert stats["disk_pending_bytes"] == 0
    assert not tier.spill(*segments[0])
    again = DiskTier(tmp_path, "ns", 256 * MiB)
    assert os.path.basename(again.dir) == "0"  # the slot was released
    assert sum(len(s.meta) for s in again.scan()) == stats["spilled"]
    again.close()


@pytest.mark.parametrize("form", FORMS)
def test_admission_spills_only_blocks_read_enough(tmp_path, form: str) -> None:
    rng = np.random.default_rng(9)
    tier = DiskTier(tmp_path, "ns", 64 * MiB)
    tier.scan()
    rec = Recorder(tier)
    tier.start()
    meta, payload = make_segment(rng, 8, 8192, form)
    hits = np.array([0, 1, 0, 3, 0, 0, 2, 0])
    assert admit(hits, 0) is None
    sel = admit(hits, 1)
    assert sel is not None and sel.tolist() == [1, 3, 6]
    assert admit(hits, 2).tolist() == [3, 6]  # type: ignore[union-attr]
    assert tier.spill(meta, payload, select=sel)
    assert not tier.spill(meta, payload, select=admit(np.zeros(8, np.int64), 1))  # none read
    with pytest.raises(ValueError, match="min_hits"):
        admit(hits, -1)
    assert tier.close(timeout=60)
    (seg,) = rec.live.values()
    assert seg.meta.keys() == [meta.key(i) for i in (1, 3, 6)]
    assert tier.stats()["spilled"] == 3
    assert_same_blocks(tier.read(seg), [payload[i] for i in (1, 3, 6)], 3)


def test_purge_deletes_every_file_of_the_namespace_but_live_slots(tmp_path) -> None:
    rng = np.random.default_rng(10)
    tiers = [DiskTier(tmp_path, "ns", 8 * MiB) for _ in range(3)]
    for t in tiers:
        t.scan()
        t.start()
        for _ in range(2):
            assert t.spill(*make_segment(rng, 2, 4096, "list"))
    assert tiers[1].close(timeout=60)  # its files stay, its slot is free
    tiers[2].close(timeout=60, drain=True)
    live = DiskTier(tmp_path, "ns", 8 * MiB)  # takes slot 1 back: stays untouched
    assert os.path.basename(live.dir) == "1"
    found = live.scan()
    assert len(found) == 2
    other = tiers[0]
    other.close(timeout=60)
    owner = DiskTier(tmp_path, "ns", 8 * MiB)  # slot 0
    owner.scan()
    owner.start()
    assert owner.spill(*make_segment(rng, 2, 4096, "array"))
    deleted = owner.purge()
    assert deleted >= 2 + 2  # slot 0 (2 or 3 files, one maybe mid-write) and free slot 2
    assert owner.stats()["disk_bytes"] == owner.stats()["disk_files"] == 0
    for k in ("0", "2"):
        assert os.listdir(tmp_path / "ns" / k) == [".lock"]
    assert len(os.listdir(live.dir)) == 3  # .lock and the live slot's two files
    owner.close(timeout=60)
    live.close()
    with pytest.raises(KVRayError, match="closed"):
        owner.purge()


def test_purge_waits_for_the_write_under_way_and_leaves_no_file(tmp_path, monkeypatch) -> None:
    """A segment mid-write when purge starts: purge returns only after the writer ended it
    (and deleted its file), so the slot holds no segment file when purge returns."""
    from kvray.disk import spiller

    writing, release = threading.Event(), threading.Event()
    real = spiller.write_files

    def slow_write(slot, files):  # type: ignore[no-untyped-def]
        writing.set()
        assert release.wait(30)
        return real(slot, files)

    monkeypatch.setattr(spiller, "write_files", slow_write)
    tier = DiskTier(tmp_path, "ns", 8 * MiB)
    tier.scan()
    tier.start()
    assert tier.spill(*make_segment(np.random.default_rng(11), 2, 4096, "array"))
    assert writing.wait(30)
    result: list[int] = []
    purger = threading.Thread(target=lambda: result.append(tier.purge()))
    purger.start()
    purger.join(0.3)
    assert purger.is_alive()  # it waits for the write under way
    release.set()
    purger.join(30)
    assert result == [0]  # the writer deleted its own file: nothing left for purge
    assert os.listdir(tier.dir) == [".lock"]
    assert tier.stats()["disk_files"] == 0 and tier.stats()["disk_skipped"] == 2
    with pytest.raises(ValueError, match="timeout"):
        tier.purge(timeout=-1)
    assert tier.close(timeout=60)


def test_arguments_are_checked(tmp_path) -> None:
    with pytest.raises(ConfigError, match="disk_capacity"):
        DiskTier(tmp_path, "ns", "512KiB")
    with pytest.raises(ConfigError, match="namespace"):
        DiskTier(tmp_path, "../up", "1GiB")
    with pytest.raises(ConfigError, match="max_pending_bytes"):
        DiskTier(tmp_path, "ns", "1GiB", max_pending_bytes=0)
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(ConfigError, match="disk_dir"):
        DiskTier(tmp_path / "file", "ns", "1GiB")
    tier = DiskTier(tmp_path, "ns", "1GiB")
    meta, payload = make_segment(np.random.default_rng(11), 2, 4096, "array")
    with pytest.raises(KVRayError, match="scan"):
        tier.start()
    with pytest.raises(KVRayError, match="start"):
        tier.spill(meta, payload)
    tier.scan()
    tier.start()
    with pytest.raises(TypeError, match="uint8"):
        tier.spill(meta, payload.view(np.int8))
    with pytest.raises(ValueError, match="rows"):
        tier.spill(meta, payload[:1])
    with pytest.raises(ValueError, match="select"):
        tier.spill(meta, payload, select=np.array([2]))
    with pytest.raises(ValueError, match="increasing"):
        tier.spill(meta, payload, select=np.array([1, 0]))
    with pytest.raises(ValueError, match="timeout"):
        tier.close(timeout=-1)
    assert tier.close()


def test_file_format_metadata(tmp_path) -> None:
    """The schema metadata the format promises, readable by any Arrow IPC reader."""
    import pyarrow as pa

    meta, payload = make_segment(np.random.default_rng(12), 3, 4096, "array")
    rec = _spill_and_close(DiskTier(tmp_path, "ns", 8 * MiB, fingerprint="fp"), [(meta, payload)])
    (seg,) = rec.live.values()
    with pa.memory_map(seg.path) as f:
        table = pa.ipc.open_file(f).read_all()
    md = {k.decode(): v.decode() for k, v in table.schema.metadata.items()}
    assert md["kvray.format"] == segfile.FORMAT and md["kvray.version"] == str(segfile.VERSION)
    assert (md["kvray.namespace"], md["kvray.fingerprint"]) == ("ns", "fp")
    assert (md["kvray.blocks"], md["kvray.block_nbytes"]) == ("3", "4096")
    assert table.column_names == ["key", "id", "shard", "nshards", "size", "checksum", "data"]
    assert table.column("key").to_pylist() == meta.keys()
    assert table.column("data").to_pylist()[2] == payload[2].tobytes()


def test_list_payload_of_one_buffer_is_written_as_one_span(tmp_path) -> None:
    """Blocks of one buffer with alignment gaps (a Ray object's layout) are written without a
    copy, gaps included, and read back as exactly the blocks."""
    import pyarrow as pa

    meta, payload = make_segment(np.random.default_rng(13), 5, 1000, "views")
    assert isinstance(payload, list)
    gaps = [
        payload[i + 1].ctypes.data - payload[i].ctypes.data - payload[i].nbytes for i in range(4)
    ]
    assert any(gaps) and max(gaps) <= segfile.MAX_GAP
    rec = _spill_and_close(DiskTier(tmp_path, "ns", 8 * MiB), [(meta, payload)])
    (seg,) = rec.live.values()
    with pa.memory_map(seg.path) as f:
        data = pa.ipc.open_file(f).read_all().column("data").to_pylist()
    span = payload[-1].ctypes.data + payload[-1].nbytes - payload[0].ctypes.data
    assert sum(len(d) for d in data) == span  # the gaps went to disk, no repacking
    tier = DiskTier(tmp_path, "ns", 8 * MiB)
    (seg,) = tier.scan()
    got = tier.read(seg)
    assert tier.verify(seg, got) == []
    assert_same_blocks(got, payload, 5)
    tier.close()


def test_a_group_larger_than_the_tier_is_written_in_chunks_that_fit(tmp_path) -> None:
    """Six 3 MiB segments queued at once into 8 MiB: the writer groups them but never holds
    more than 8 MiB of files (temporary ones included); the last two stay."""
    rng = np.random.default_rng(14)
    tier = DiskTier(tmp_path, "ns", 8 * MiB, max_pending_bytes=64 * MiB)
    tier.scan()
    rec = Recorder(tier)
    tier.start()
    segments = [make_segment(rng, 3, 1 * MiB, "array") for _ in range(6)]
    assert all(tier.spill(m, p) for m, p in segments)
    assert tier.close(timeout=60)
    assert rec.over == []
    assert sorted(rec.live) == [5, 6]
    stats = tier.stats()
    assert (stats["spilled"], stats["disk_evictions"], stats["disk_blocks"]) == (18, 12, 6)
    for seg in rec.live.values():
        assert_same_blocks(tier.read(seg), segments[seg.id - 1][1], 3)


def test_tags_come_back_with_what_landed_and_what_did_not(tmp_path) -> None:
    """The owner names its segments with ``tag``: ``on_spilled`` gives it back with the file,
    ``on_dropped`` when the file could not be written (here: its Arrow framing makes it larger
    than the whole tier, which ``spill`` cannot know before building it)."""
    rng = np.random.default_rng(11)
    tier = DiskTier(tmp_path, "ns", 1 * MiB)
    tier.scan()
    spilled: list[tuple[int, int]] = []
    dropped: list[int] = []
    tier.events.on_spilled = lambda seg: spilled.append((seg.tag, len(seg.meta)))
    tier.events.on_dropped = dropped.extend
    tier.start()
    ok_meta, ok_payload = make_segment(rng, 4, 4096, "array")
    assert tier.spill(ok_meta, ok_payload, tag=7)
    probe, _ = make_segment(rng, 1, 64, "array")
    size = MiB - probe.meta_nbytes - 8  # fits spill's estimate, not the file's framing
    meta, payload = make_segment(rng, 1, size, "array")
    assert tier.spill(meta, payload, tag=9)
    with pytest.raises(TypeError, match="tag"):
        tier.spill(ok_meta, ok_payload, tag="x")  # type: ignore[arg-type]
    assert tier.close(timeout=60)
    assert spilled == [(7, 4)]
    assert dropped == [9]
    assert tier.stats()["disk_skipped"] == 1


def test_an_owner_gets_its_own_slot_back(tmp_path) -> None:
    """Pools on one host name their tiers by node id: each finds its own files again, whatever
    order they restart in, and waits for a predecessor of the same owner that still holds the
    slot (an actor restart, a stop then start)."""
    rng = np.random.default_rng(12)
    a = DiskTier(tmp_path, "ns", 8 * MiB, owner="node-a")
    b = DiskTier(tmp_path, "ns", 8 * MiB, owner="node-b")
    assert (os.path.basename(a.dir), os.path.basename(b.dir)) == ("0", "1")
    rec = _spill_and_close(b, [make_segment(rng, 2, 4096, "array")])
    a.close()
    b_again = DiskTier(tmp_path, "ns", 8 * MiB, owner="node-b")  # slot 0 is free, 1 is b's
    assert b_again.dir == b.dir
    assert {s.id for s in b_again.scan()} == set(rec.live)
    stranger = DiskTier(tmp_path, "ns", 8 * MiB, owner="node-c")
    assert os.path.basename(stranger.dir) == "0"  # a new node (a reboot): the first free slot
    stranger.close()
    release = threading.Timer(0.5, b_again.close)
    release.start()
    t0 = time.monotonic()
    successor = DiskTier(tmp_path, "ns", 8 * MiB, owner="node-b")  # waits for b_again to go
    assert successor.dir == b.dir and time.monotonic() - t0 >= 0.4
    successor.close()
    with pytest.raises(ConfigError, match="owner"):
        DiskTier(tmp_path, "ns", 8 * MiB, owner="two\nlines")
