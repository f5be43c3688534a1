"""Reading back a working set larger than RAM from the disk tier (issue 18), public API only.

One deployment as the issue found it: RAM 16 MiB, disk 256 MiB, 96 blocks of 1 MiB put in
8-block puts (8 MiB segments), so 80 blocks are on disk only. Whatever RAM holds (recent reads'
leases, a reader that never gives its leases back, other readers at once), every block reads
back with its bytes: promoted to RAM when an unleased segment can make room, else served from
its verified file. Nothing is broken here, so ``promote_failed`` stays 0. A second, smaller
deployment breaks things on purpose and checks that each failure names its cause.
"""

from __future__ import annotations

import os
import random
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray
from ray.cluster_utils import Cluster

import kvray
from kvray.client import checksum
from kvray.disk import fingerprint, segfile
from kvray.meta.messages import RAY_NAMESPACE, pool_name

MiB = 1 << 20
RAM = 16 * MiB
DISK = 256 * MiB
N = 96
PER_PUT = 8
SEED = 18


def _block(i: int, nbytes: int = MiB) -> np.ndarray:
    return np.random.default_rng([SEED, i]).integers(0, 256, nbytes, dtype=np.uint8)


def _wait_for(cond: Callable[[], bool], timeout: float, what: str, seen: Any = None) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            got = seen() if seen is not None else ""
            raise AssertionError(f"timed out after {timeout}s waiting for {what}: {got}")
        time.sleep(0.05)


def _my_pool(ns: str) -> Any:
    node = ray.get_runtime_context().get_node_id()
    return ray.get_actor(pool_name(ns, node), namespace=RAY_NAMESPACE)


def _stats(pool: Any) -> dict[str, Any]:
    return ray.get(pool.stats.remote(), timeout=30)


def _quiet(pool: Any, ram: int) -> dict[str, Any]:
    """Wait (bounded) until no lease is held and nothing is on its way to disk."""
    out: dict[str, Any] = {}

    def done() -> bool:
        out.update(_stats(pool))
        assert out["bytes"] <= ram, out
        return (
            out["active_leases"] == out["spilling_bytes"] == out["disk_pending_bytes"] == 0
            and out["read_from_disk_outstanding_bytes"] == 0
        )

    _wait_for(done, 30, "leases to come back and spills to land", lambda: out)
    return out


class _HungReader:
    """A client that reads zero-copy and never gives its leases back (as a reader that died
    holding them does, until they expire): it pins what it read in the pool's RAM."""

    def __init__(self, ns: str) -> None:
        self.store = kvray.connect(ns)
        self.store.sync()
        self.store.io.flush_releases = lambda: None  # type: ignore[method-assign]
        self.held: list[Any] = []

    def fetch(self, keys: list[bytes]) -> None:
        f = self.store.fetch(keys)
        assert f.keys == keys, f.reason
        self.held.append(f)

    def close(self) -> None:
        del self.store.io.flush_releases  # the real one: close() gives every lease back
        self.held.clear()
        self.store.close()


@dataclass
class Deployment:
    ns: str
    keys: list[bytes]
    sums: list[int]

    def check(self, got: list[np.ndarray], idx: list[int]) -> None:
        assert len(got) == len(idx)
        for g, i in zip(got, idx, strict=True):
            assert g.nbytes == MiB and checksum(g) == self.sums[i], f"bytes of block {i}"


@pytest.fixture(scope="module")
def dep(ray_cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    ns = f"rb{uuid.uuid4().hex[:8]}"
    kvray.start(
        namespace=ns,
        capacity=RAM,
        disk_dir=str(tmp_path_factory.mktemp("readback")),
        disk_capacity=DISK,
        health_check_interval_s=0.5,
    )
    keys = [f"{ns}-{i}".encode() for i in range(N)]
    sums = []
    store = kvray.connect(ns)
    try:
        for a in range(0, N, PER_PUT):
            blocks = np.stack([_block(i) for i in range(a, a + PER_PUT)])
            sums += [checksum(b) for b in blocks]
            r = store.put(keys[a : a + PER_PUT], blocks).result(60)
            assert (r.stored, r.refused) == (PER_PUT, 0)
        store.sync()
        s = _quiet(_my_pool(ns), RAM)
        assert (s["present_blocks"], s["disk_only_blocks"], s["spilled"]) == (N, N - 16, N - 16)
        assert s["disk_skipped"] == 0 and store.lookup(keys) == N
        store.close()
        yield Deployment(ns, keys, sums)
    finally:
        kvray.stop(ns, purge=True)


def _nothing_broken(pool: Any) -> dict[str, Any]:
    s = _quiet(pool, RAM)
    broken = ("promote_failed", "lost", "disk_lost", "disk_corrupt", "disk_skipped")
    assert {k: s[k] for k in broken} == dict.fromkeys(broken, 0), s
    assert s["present_blocks"] == N and s["leased_bytes"] == 0
    return s


def test_every_block_reads_back_one_get_at_a_time_twice(dep: Deployment) -> None:
    """The issue's loop: ``get`` of each key in turn, twice (5 s apart in the issue: not
    needed, nothing waits on a timer); every one reads back."""
    pool = _my_pool(dep.ns)
    hits = _stats(pool)["hits"]
    store = kvray.connect(dep.ns)
    try:
        for _ in range(2):
            for i, k in enumerate(dep.keys):
                dep.check(store.get([k]), [i])
        s = _nothing_broken(pool)
        assert s["hits"] - hits == 2 * N and s["misses"] == 0
        assert s["bytes"] <= RAM and s["promoted"] > 0
    finally:
        store.close()


def test_one_read_larger_than_ram(dep: Deployment) -> None:
    """One ``get`` of all 96 MiB through 16 MiB of RAM, and ``get_into`` of 40 MiB."""
    pool = _my_pool(dep.ns)
    store = kvray.connect(dep.ns)
    try:
        order = list(range(N))
        random.Random(1).shuffle(order)
        dep.check(store.get([dep.keys[i] for i in order]), order)
        out = [np.empty(MiB, np.uint8) for _ in range(40)]
        store.get_into(dep.keys[20:60], out)
        dep.check(out, list(range(20, 60)))
        _nothing_broken(pool)
    finally:
        store.close()


def test_reads_when_ram_is_all_leased_come_from_the_files(dep: Deployment) -> None:
    """A reader holds RAM's every segment and never lets go: the other blocks are served
    straight from their files (no promotion possible), all of them, and no RAM is taken."""
    pool = _my_pool(dep.ns)
    store = kvray.connect(dep.ns)
    hung = _HungReader(dep.ns)
    try:
        hung.fetch(dep.keys[0:8])
        hung.fetch(dep.keys[8:16])
        before = _stats(pool)
        assert before["leased_bytes"] == before["bytes"] == RAM
        for i in range(16, N):
            dep.check(store.get([dep.keys[i]]), [i])
        dep.check(store.get(dep.keys[16:]), list(range(16, N)))
        s = _stats(pool)
        assert s["read_from_disk"] - before["read_from_disk"] == 2 * (N - 16)
        assert s["promoted"] == before["promoted"] and s["promote_failed"] == 0
        assert s["bytes"] == RAM
    finally:
        hung.close()
        store.close()
    _nothing_broken(pool)


@ray.remote(num_cpus=0, resources={"node_a": 1})
def _remote_reader(ns: str, keys: list[bytes], rounds: int, seed: int) -> list[tuple[int, int]]:
    """Random batches of gets from another node: (index, checksum) of every block read."""
    rng = random.Random(seed)
    store = kvray.connect(ns)
    out = []
    try:
        for _ in range(rounds):
            idx = rng.sample(range(len(keys)), rng.randint(1, 12))
            for i, g in zip(idx, store.get([keys[i] for i in idx]), strict=True):
                out.append((i, checksum(g)))
    finally:
        store.close()
    return out


@pytest.mark.slow
def test_four_threads_and_a_task_on_another_node_read_ram_and_disk_at_once(
    dep: Deployment,
) -> None:
    """Four readers in this process (forward, backward, random batches, zero-copy fetches
    whose leases go back in batches) and a Ray task on node A, all at once: RAM and disk
    blocks interleave, RAM is often all leased; every block reads back with its bytes."""
    pool = _my_pool(dep.ns)
    store = kvray.connect(dep.ns)
    errors: list[BaseException] = []
    remote = _remote_reader.remote(dep.ns, dep.keys, 30, 7)

    def forward() -> None:
        for i in range(N):
            dep.check(store.get([dep.keys[i]]), [i])

    def backward() -> None:
        for i in reversed(range(N)):
            dep.check(store.get([dep.keys[i]]), [i])

    def batches() -> None:
        rng = random.Random(3)
        for _ in range(30):
            idx = rng.sample(range(N), rng.randint(1, 20))
            dep.check(store.get([dep.keys[i] for i in idx]), idx)

    def zero_copy() -> None:
        for a in range(0, N, 3):
            f = store.fetch(dep.keys[a : a + 3])
            assert f.keys == dep.keys[a : a + 3], f.reason
            assert store.verify(f) == len(f.keys)
            dep.check(f.arrays, list(range(a, a + len(f.keys))))

    def run(fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(f,)) for f in (forward, backward, batches)]
    threads.append(threading.Thread(target=run, args=(zero_copy,)))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    try:
        assert not any(t.is_alive() for t in threads), "a reader is stuck"
        assert not errors, errors
        read = ray.get(remote, timeout=300)
        assert read and all(c == dep.sums[i] for i, c in read)
        _nothing_broken(pool)
    finally:
        store.close()


# ---------------------------------------------------------------------- failures, by cause


def _slot(disk_dir: Path, ns: str) -> Path:
    node = ray.get_runtime_context().get_node_id()
    for lock in (disk_dir / ns).glob("*/.lock"):
        if lock.read_text().splitlines()[1:2] == [node]:
            return lock.parent
    raise AssertionError(f"no slot of this node under {disk_dir / ns}")


def _file_of(slot: Path, ns: str, key: bytes) -> Path:
    for path in sorted(slot.glob("*.arrow")):
        meta, _ = segfile.read_meta(str(path), ns, fingerprint(ns))
        if key in set(meta.keys()):
            return path
    raise AssertionError(f"no file holds {key!r}")


def _flip_block(path: Path, block: np.ndarray) -> None:
    data = bytearray(path.read_bytes())
    off = data.find(block[:256].tobytes())
    assert off >= 0
    data[off + 100] ^= 0x01
    path.write_bytes(bytes(data))


def _scrape(ns: str) -> dict[str, float]:
    """``ray_kvray_pool_*`` samples of namespace ``ns`` over every node's endpoint, keyed
    ``<name without ray_kvray_pool_>/<cause label>``."""
    from prometheus_client.parser import text_string_to_metric_families

    from kvray.testing.probe import metrics_urls

    out: dict[str, float] = {}
    for url in metrics_urls():
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                text = resp.read().decode()
        except OSError:
            continue
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.labels.get("namespace") == ns and sample.name.startswith(
                    "ray_kvray_pool_"
                ):
                    key = (
                        f"{sample.name[len('ray_kvray_pool_') :]}/{sample.labels.get('cause', '')}"
                    )
                    out[key] = out.get(key, 0.0) + sample.value
    return out


@pytest.mark.slow
def test_failed_disk_reads_name_their_cause(ray_cluster: Cluster, tmp_path: Path) -> None:
    """RAM 4 MiB of 1 MiB segments (4 blocks each). ``no_room``: a reader holds RAM and reads
    from files up to their bound; a read that cannot wait that out fails saying so, then
    succeeds once the leases come back. ``corrupt``: a flipped bit in a file, read through a
    promotion and straight from the file. ``io``: a file deleted behind the tier's back.
    Each error names its reason, each counter its cause; no bad byte is served."""
    ns = f"rc{uuid.uuid4().hex[:8]}"
    bs = 256 << 10
    kvray.start(
        namespace=ns,
        capacity=4 * MiB,
        segment_bytes=MiB,
        disk_dir=str(tmp_path),
        disk_capacity=64 * MiB,
        health_check_interval_s=0.5,
    )
    store = kvray.connect(ns)
    hung: _HungReader | None = None
    try:
        pool = _my_pool(ns)
        keys = [f"{ns}-{i}".encode() for i in range(64)]
        blocks = [_block(i, bs) for i in range(64)]
        for a in range(0, 64, 4):  # one at a time: the spill queue holds 1 MiB here
            assert store.put(keys[a : a + 4], blocks[a : a + 4]).result(60).stored == 4
            _quiet(pool, 4 * MiB)
        store.sync()
        s = _quiet(pool, 4 * MiB)
        assert s["present_blocks"] == 64 and s["disk_skipped"] == 0, s
        assert store.lookup(keys) == 64
        # seg[k]: the keys of segment k; 8 to 11 stay on disk only until broken below.
        seg = [keys[a : a + 4] for a in range(0, 64, 4)]

        def causes() -> tuple[int, int, int, int]:
            s = _stats(pool)
            return (
                s["promote_failed_no_room"],
                s["promote_failed_corrupt"],
                s["promote_failed_io"],
                s["promote_failed"],
            )

        # no_room: 4 segments leased in RAM, 4 more served from files and held (the bound).
        hung = _HungReader(ns)
        for k in range(8):
            hung.fetch(seg[k])
        assert _stats(pool)["read_from_disk_outstanding_bytes"] == 4 * MiB
        with pytest.raises(kvray.BlockLostError, match="no room in RAM") as info:
            store.get(seg[9][:1], timeout=1.0)
        assert info.value.keys == seg[9][:1]
        assert causes() == (1, 0, 0, 1)
        hung.close()
        hung = None
        _quiet(pool, 4 * MiB)
        assert store.get(seg[9][:1])[0].tobytes() == blocks[36].tobytes()

        # corrupt, through a promotion (RAM has room): the block goes, its neighbours stay.
        slot = _slot(tmp_path, ns)
        _flip_block(_file_of(slot, ns, keys[33]), blocks[33])
        with pytest.raises(kvray.BlockLostError, match="checksum mismatch on disk"):
            store.get([keys[33]])
        assert causes() == (1, 1, 0, 2)
        good = [32, 34, 35]
        assert [g.tobytes() for g in store.get([keys[i] for i in good])] == [
            blocks[i].tobytes() for i in good
        ]
        # corrupt, straight from the file (RAM all leased): the rest of the file still serves.
        hung = _HungReader(ns)
        for k in range(4):
            hung.fetch(seg[k])
        _flip_block(_file_of(slot, ns, keys[41]), blocks[41])
        with pytest.raises(kvray.BlockLostError, match="checksum mismatch on disk"):
            store.get([keys[41]])
        assert causes() == (1, 2, 0, 3)
        good = [40, 42, 43]
        assert [g.tobytes() for g in store.get([keys[i] for i in good])] == [
            blocks[i].tobytes() for i in good
        ]
        # io: the file is gone; all 4 of its blocks are dropped (published as removed).
        os.unlink(_file_of(slot, ns, keys[45]))
        with pytest.raises(kvray.BlockLostError, match="disk file gone"):
            store.get([keys[45]])
        assert causes() == (1, 2, 4, 7)
        _wait_for(lambda: store.lookup(keys[44:45]) == 0, 10, "the lost blocks to leave lookups")
        for i in (33, 41, 45):
            with pytest.raises(kvray.BlockLostError):
                store.get([keys[i]])
        s = _stats(pool)
        assert s["disk_lost"] == 6 and s["lost"] == 0
        # The same figures at the node's metrics endpoint, by cause (refreshed every 5 s).
        want = {"no_room": 1.0, "corrupt": 2.0, "io": 4.0}
        seen: dict[str, float] = {}

        def exported() -> bool:
            seen.clear()
            seen.update(_scrape(ns))
            return {c: seen.get(f"promote_failed_total/{c}") for c in want} == want and (
                seen.get("blocks_read_from_disk_total/", 0) > 0
            )

        _wait_for(exported, 60, "the metrics by cause", lambda: seen)
    finally:
        if hung is not None:
            hung.close()
        store.close()
        kvray.stop(ns, purge=True)


# ---------------------------------------------------------------------- vLLM


@ray.remote(num_cpus=0, resources={"head": 1})
class _LeasingEngine:
    """Another engine on this (head) node, in its own process, whose loads can keep their
    leases (``hold``): what the pool sees of an engine mid-load, held still."""

    def __init__(self, model: str, namespace: str, extra: dict[str, Any]) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM

        from kvray.testing.engines import engine_kwargs, kvray_transfer_config

        ktc = kvray_transfer_config(namespace, **extra)
        self.llm = LLM(**engine_kwargs(model, kv_transfer_config=ktc))

    def generate(self, prompts: list[list[int]], reset: bool = False) -> dict[str, Any]:
        from kvray.testing.engines import (
            cached_tokens,
            connector_of,
            finish_delayed_frees,
            generate,
            token_ids,
        )

        if reset:  # as for engine A: the view must hold what this engine stored first
            connector_of(self.llm).store.sync()
            finish_delayed_frees(self.llm)
            assert self.llm.reset_prefix_cache()
        outs = generate(self.llm, prompts)
        return {"tokens": token_ids(outs), "cached": cached_tokens(outs)}

    def flush(self) -> None:
        from kvray.testing.engines import finish_delayed_frees, worker_connector_of

        finish_delayed_frees(self.llm)
        worker_connector_of(self.llm).worker.flush()

    def hold(self, on: bool) -> None:
        from kvray.testing.engines import worker_connector_of

        io = worker_connector_of(self.llm).worker.store.io
        if on:
            io.flush_releases = lambda: None
        else:
            del io.flush_releases
            io.flush_releases()

    def close(self) -> None:
        from kvray.testing.engines import close_llm

        close_llm(self.llm)


@pytest.mark.vllm
def test_vllm_loads_a_prefix_from_disk_while_ram_is_leased_by_another_engine(
    ray_cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Engine A computes two prompts; engine B's longer prompt pushes A's blocks out of a
    1 MiB RAM tier onto disk, then B loads it back and keeps it leased (RAM all leased). A,
    its own cache reset, loads its prefix from the files: a full hit, tokens identical to the
    recompute, nothing failed."""
    pytest.importorskip("vllm")
    from vllm import LLM

    from kvray.testing.engines import (
        build_tiny_llama,
        cached_tokens,
        close_llm,
        connector_of,
        engine_kwargs,
        finish_delayed_frees,
        full_hit_tokens,
        generate,
        kvray_transfer_config,
        make_prompts,
        token_ids,
        worker_connector_of,
    )

    model = build_tiny_llama(tmp_path / "model")
    ns = f"rv{uuid.uuid4().hex[:8]}"
    disk = {"disk_dir": str(tmp_path / "disk"), "disk_capacity": "64MiB"}
    extra = {"capacity": "1MiB", "get_timeout_s": 10, **disk}
    kvray.start(namespace=ns, capacity="1MiB", health_check_interval_s=0.5, **disk)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # B starts in its own process now (its start-up overlaps A's); it stores nothing until asked.
    other = _LeasingEngine.remote(model, ns, extra)
    llm = None
    prompts = make_prompts(2, 200, 30, seed=7)  # 8 blocks of 64 KiB
    theirs = make_prompts(1, 480, 30, seed=8)  # 15 blocks: RAM is 16
    full_hit = full_hit_tokens(prompts[0])

    def counters() -> Any:
        return connector_of(llm).scheduler.counters.add(worker_connector_of(llm).worker.counters())

    try:
        llm = LLM(**engine_kwargs(model, kv_transfer_config=kvray_transfer_config(ns, **extra)))
        pool = _my_pool(ns)
        recomputed = generate(llm, prompts)
        finish_delayed_frees(llm)
        worker_connector_of(llm).worker.flush()
        first = ray.get(other.generate.remote(theirs), timeout=300)
        ray.get(other.flush.remote(), timeout=60)
        s = _quiet(pool, MiB)
        assert s["disk_only_blocks"] >= 8 and s["disk_skipped"] == 0, s
        ray.get(other.hold.remote(True), timeout=60)
        again = ray.get(other.generate.remote(theirs, reset=True), timeout=300)
        assert again["tokens"] == first["tokens"] and again["cached"][0] == 480
        before = _stats(pool)
        assert before["leased_bytes"] >= MiB - 64 * 1024, before  # no A segment fits

        connector_of(llm).store.sync()
        finish_delayed_frees(llm)
        assert llm.reset_prefix_cache()
        was = counters()
        loaded = generate(llm, prompts)
        assert token_ids(loaded) == token_ids(recomputed)
        assert cached_tokens(loaded)[0] == full_hit  # planned: says nothing of the load
        now = counters()  # what the worker loaded (a failed block is recomputed, counted)
        assert now.failed_blocks == was.failed_blocks
        assert now.loaded_blocks - was.loaded_blocks == was.stored_blocks == 8  # all of A's
        s = _stats(pool)
        assert s["read_from_disk"] > before["read_from_disk"]
        assert s["promote_failed"] == s["lost"] == s["disk_lost"] == 0
        assert s["bytes"] <= MiB
        ray.get(other.hold.remote(False), timeout=60)
    finally:
        ray.get(other.close.remote(), timeout=60)
        ray.kill(other)
        if llm is not None:
            close_llm(llm)
        kvray.stop(ns, purge=True)
