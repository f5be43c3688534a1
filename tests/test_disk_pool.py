"""The pools' disk tier on the session's real Ray cluster, with real files (issue 12).

One deployment (RAM 16 MiB, disk 256 MiB, 1 MiB segments) takes 128 MiB from this driver, so
every block goes through the head node's pool: spilled as RAM evicts it, promoted when read,
found again after an actor restart and after ``stop``/``start``, and its files are checked when
they are truncated, flipped or foreign. Puts and reads wait for the spill queue between steps:
these tests check what survives when the disk keeps up (when it does not, RAM evicts without
spilling, counted in ``disk_skipped``: asserted to stay 0 here). Other deployments: admission
(``disk_admit_min_hits=1``), a real vLLM engine loading a prefix from disk after a warm
restart, and the CLI.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray
from ray.cluster_utils import Cluster
from typer.testing import CliRunner

import kvray
from kvray.blocks import checksum
from kvray.config import ConfigError, KVRayConfig
from kvray.disk import DiskTier, fingerprint, segfile
from kvray.meta.ids import key_ids
from kvray.meta.messages import RAY_NAMESPACE, index_name, pool_name
from kvray.meta.segment import SegmentMeta
from kvray.ops.cli import app
from kvray.testing.engines import in_process_engines

MiB = 1 << 20
BLOCK = 256 << 10
N_BLOCKS = 512  # 128 MiB
PER_PUT = 4  # one 1 MiB segment per put
RAM = 16 * MiB
DISK = 256 * MiB


def _wait_for(
    cond: Callable[[], bool], timeout: float, what: str, seen: Callable[[], object] = str
) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}: {seen()}")
        time.sleep(0.05)


def _my_pool(ns: str) -> Any:
    node = ray.get_runtime_context().get_node_id()
    return ray.get_actor(pool_name(ns, node), namespace=RAY_NAMESPACE)


def _settle(pool: Any, ram: int, disk: int) -> dict[str, Any]:
    """Wait until nothing is on its way to disk and no lease is held; check both tiers are
    within capacity."""
    while True:
        s = ray.get(pool.stats.remote(), timeout=30)
        assert s["bytes"] <= ram and s["disk_bytes"] <= disk, s
        if s["spilling_bytes"] == s["disk_pending_bytes"] == s["active_leases"] == 0:
            return s
        time.sleep(0.01)


def _slot_dir(disk_dir: Path, ns: str, node_id: str) -> Path:
    """The slot directory of a node's pool (its lock file names the node)."""
    for lock in (disk_dir / ns).glob("*/.lock"):
        if lock.read_text().splitlines()[1:2] == [node_id]:
            return lock.parent
    raise AssertionError(f"no slot of node {node_id} under {disk_dir / ns}")


def _files_bytes(slot: Path) -> int:
    return sum(p.stat().st_size for p in slot.iterdir() if p.name != ".lock")


@dataclass
class Deployment:
    ns: str
    disk_dir: Path
    keys: list[bytes]
    blocks: list[np.ndarray]
    config: dict[str, Any]

    def start(self) -> None:
        kvray.start(**self.config)

    def readable(self, store: kvray.Store, keys: list[bytes], pool: Any) -> None:
        """Every key reads back with its bytes, a few segments at a time: the leases go back
        at once (not within the second a client batches them over: 16 MiB of RAM fills with
        leased segments faster) and what the promotions evict reaches the disk."""
        want = dict(zip(self.keys, self.blocks, strict=True))
        for a in range(0, len(keys), 8):
            # The index converges within ticks after a restart (the view is eventually
            # consistent); every block must show up and read back with its bytes.
            _wait_visible(store, keys[a : a + 8], 30)
            try:
                got = store.get(keys[a : a + 8])
            except kvray.BlockLostError as e:  # say what the pool and the view saw
                s = ray.get(pool.stats.remote())
                view = (len(store.feed.view), store.lookup(keys[a : a + 8]))
                raise AssertionError(f"{e} (view {view}; pool {s})") from e
            for k, g in zip(keys[a : a + 8], got, strict=True):
                assert np.array_equal(g, want[k]), k
            store.io.flush_releases()
            _settle(pool, RAM, DISK)


@pytest.fixture(scope="module")
def filled(ray_cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """128 MiB put through a 16 MiB RAM tier over a 256 MiB disk tier."""
    ns = f"dk{uuid.uuid4().hex[:8]}"
    disk_dir = tmp_path_factory.mktemp("disk")
    config = dict(
        namespace=ns,
        capacity=RAM,
        segment_bytes=MiB,
        disk_dir=str(disk_dir),
        disk_capacity=DISK,
        health_check_interval_s=0.5,
    )
    rng = np.random.default_rng(12)
    dep = Deployment(
        ns,
        disk_dir,
        [f"{ns}-{i}".encode() for i in range(N_BLOCKS)],
        [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(N_BLOCKS)],
        config,
    )
    dep.start()
    store = kvray.connect(ns)
    pool = _my_pool(ns)
    try:
        for a in range(0, N_BLOCKS, PER_PUT):
            r = store.put(dep.keys[a : a + PER_PUT], dep.blocks[a : a + PER_PUT]).result(60)
            assert (r.stored, r.refused) == (PER_PUT, 0)
            _settle(pool, RAM, DISK)
        store.close()
        yield dep
    finally:
        kvray.stop(ns, purge=True)


def test_128mib_through_16mib_of_ram_every_block_readable(filled: Deployment) -> None:
    dep = filled
    pool = _my_pool(dep.ns)
    s = _settle(pool, RAM, DISK)
    # Counts add up: every block stored is in RAM or on disk only; what left RAM went to disk.
    assert s["stored"] == N_BLOCKS and s["present_blocks"] == N_BLOCKS
    assert s["blocks"] + s["disk_only_blocks"] == N_BLOCKS
    assert s["blocks"] == RAM // BLOCK and s["bytes"] == RAM
    assert s["spilled"] == s["evictions"] == N_BLOCKS - s["blocks"] == s["disk_blocks"]
    assert s["disk_skipped"] == s["disk_not_admitted"] == s["disk_evictions"] == 0
    assert s["disk_capacity"] == DISK
    node = ray.get_runtime_context().get_node_id()
    slot = _slot_dir(dep.disk_dir, dep.ns, node)
    assert s["disk_bytes"] == _files_bytes(slot) <= DISK
    store = kvray.connect(dep.ns)
    try:
        store.sync()
        assert store.lookup(dep.keys) == N_BLOCKS
        dep.readable(store, dep.keys, pool)
        s = _settle(pool, RAM, DISK)
        # Read in put order, so the first promotions spill the blocks RAM held: every block
        # came back from disk, once.
        assert s["promoted"] == s["hits"] == N_BLOCKS
        assert s["present_blocks"] == N_BLOCKS and s["disk_blocks"] == N_BLOCKS
        assert s["disk_skipped"] == s["lost"] == s["disk_lost"] == 0
        totals = store.stats()["totals"]
        for key in ("disk_blocks", "disk_bytes", "spilled", "promoted", "disk_evictions"):
            assert totals[key] == s[key], key  # the other nodes' pools hold nothing
        assert totals["disk_capacity"] == DISK * len(store.stats()["nodes"])
    finally:
        store.close()


def _wait_visible(store: kvray.Store, keys: list[bytes], timeout: float = 60) -> None:
    _wait_for(lambda: store.lookup(keys) == len(keys), timeout, "lookups to see every block")


def test_a_restarted_pool_serves_its_disk_blocks_again(filled: Deployment) -> None:
    dep = filled
    pool = _my_pool(dep.ns)
    before = _settle(pool, RAM, DISK)
    assert before["disk_blocks"] == N_BLOCKS  # every block has a file (RAM's are promoted)
    _, incarnation, _ = ray.get(pool.ping.remote())
    index = ray.get_actor(index_name(dep.ns), namespace=RAY_NAMESPACE)
    resyncs = ray.get(index.stats.remote())["resyncs"]
    ray.kill(pool, no_restart=False)
    _wait_for(lambda: _incarnation(pool) not in ("", incarnation), 60, "the pool to restart")
    # The index drops the old incarnation's blocks, then rebuilds from the new one's
    # inventory; until then a view may still show the old entries.
    _wait_for(lambda: ray.get(index.stats.remote())["resyncs"] > resyncs, 60, "a resync")
    store = kvray.connect(dep.ns)
    try:
        _wait_visible(store, dep.keys)
        s = ray.get(pool.stats.remote())
        # Visible without a single put: the new incarnation found them in its files.
        assert s["stored"] == 0 and s["disk_scanned"] == s["present_blocks"] == N_BLOCKS
        assert s["blocks"] == 0 and s["disk_only_blocks"] == N_BLOCKS
        dep.readable(store, dep.keys, pool)
        assert ray.get(pool.stats.remote())["promoted"] == N_BLOCKS
    finally:
        store.close()


def _incarnation(pool: Any) -> str:
    try:
        return ray.get(pool.ping.remote(), timeout=5)[1]
    except Exception:
        return ""


def test_stop_then_start_with_the_same_disk_dir_serves_them_again(filled: Deployment) -> None:
    dep = filled
    kvray.stop(dep.ns)
    assert any(dep.disk_dir.glob(f"{dep.ns}/*/*.arrow"))  # plain stop keeps the files
    dep.start()
    store = kvray.connect(dep.ns)
    try:
        _wait_visible(store, dep.keys)
        pool = _my_pool(dep.ns)
        s = ray.get(pool.stats.remote())
        assert s["stored"] == 0 and s["present_blocks"] == N_BLOCKS
        dep.readable(store, dep.keys[::-1], pool)
    finally:
        store.close()


def _file_of(slot: Path, ns: str, key: bytes) -> tuple[Path, SegmentMeta]:
    for path in sorted(slot.glob("*.arrow")):
        meta, _ = segfile.read_meta(str(path), ns, fingerprint(ns))
        if key in set(meta.keys()):
            return path, meta
    raise AssertionError(f"no file holds {key!r}")


def _flip(path: Path, needle: bytes, at: int) -> None:
    """Flip one bit of the byte ``at`` bytes into the first occurrence of ``needle``."""
    data = bytearray(path.read_bytes())
    off = data.find(needle)
    assert off >= 0, f"{needle[:16]!r} not in {path}"
    data[off + at] ^= 0x10
    path.write_bytes(bytes(data))


def test_truncated_flipped_and_foreign_files_are_never_served(
    filled: Deployment, tmp_path: Path
) -> None:
    dep = filled
    node = ray.get_runtime_context().get_node_id()
    kvray.stop(dep.ns)
    slot = _slot_dir(dep.disk_dir, dep.ns, node)
    want = dict(zip(dep.keys, dep.blocks, strict=True))
    truncated, t_meta = _file_of(slot, dep.ns, dep.keys[10])
    key_flipped, k_meta = _file_of(slot, dep.ns, dep.keys[100])
    data_flipped, d_meta = _file_of(slot, dep.ns, dep.keys[200])
    assert len({truncated, key_flipped, data_flipped}) == 3
    os.truncate(truncated, truncated.stat().st_size // 2)
    _flip(key_flipped, dep.keys[100], 3)  # in the metadata: caught by the scan
    _flip(data_flipped, want[dep.keys[200]][:256].tobytes(), 1000)  # in a block: at read
    # A valid file of another namespace, holding blocks of its own, dropped in our slot.
    rng = np.random.default_rng(5)
    foreign_keys = [f"{dep.ns}-foreign-{i}".encode() for i in range(4)]
    payload = rng.integers(0, 256, (4, BLOCK), dtype=np.uint8)
    meta = SegmentMeta.from_keys(
        foreign_keys,
        key_ids(foreign_keys),
        np.zeros(4, np.uint16),
        np.ones(4, np.uint16),
        np.full(4, BLOCK),
        [checksum(payload[i]) for i in range(4)],
    )
    other = DiskTier(tmp_path, "other", 8 * MiB, fingerprint=fingerprint("other"))
    other.scan()
    other.start()
    assert other.spill(meta, payload)
    assert other.close(timeout=30)
    (src,) = Path(other.dir).glob("*.arrow")
    (slot / f"{0xFFFF:016x}.arrow").write_bytes(src.read_bytes())

    dep.start()
    store = kvray.connect(dep.ns)
    try:
        skipped = set(t_meta.keys()) | set(k_meta.keys())
        good = [k for k in dep.keys if k not in skipped]
        _wait_visible(store, good)
        for k in [*skipped, *foreign_keys]:
            assert not store.contains(k), k
            with pytest.raises(kvray.BlockLostError):
                store.get([k])
        pool = _my_pool(dep.ns)
        s = ray.get(pool.stats.remote())
        assert s["disk_corrupt"] == 3  # truncated, flipped metadata, another namespace
        assert s["present_blocks"] == N_BLOCKS - len(skipped)
        # The flipped block passes the scan (block bytes are not read) and fails at read.
        bad = dep.keys[200]
        assert store.contains(bad)
        with pytest.raises(kvray.BlockLostError):
            store.get([bad])
        _wait_for(lambda: not store.contains(bad), 10, "the corrupt block to leave lookups")
        rest = [k for k in list(d_meta.keys()) if k != bad]
        assert [g.tobytes() for g in store.get(rest)] == [want[k].tobytes() for k in rest]
        s = ray.get(pool.stats.remote())
        assert s["disk_lost"] == 1 and s["lost"] == 0 and s["disk_corrupt"] == 4
        assert not data_flipped.exists()  # the corrupt file is deleted
    finally:
        store.close()


def test_stop_purge_deletes_the_files(filled: Deployment) -> None:
    dep = filled
    assert any(dep.disk_dir.glob(f"{dep.ns}/*/*.arrow"))
    kvray.stop(dep.ns, purge=True)
    assert not list(dep.disk_dir.glob(f"{dep.ns}/*/*.arrow*"))
    dep.start()  # nothing comes back
    store = kvray.connect(dep.ns)
    try:
        store.sync()
        assert store.lookup(dep.keys) == 0
        assert store.stats()["totals"]["disk_blocks"] == 0
    finally:
        store.close()


# ---------------------------------------------------------------------- admission


def test_admit_min_hits_spills_only_read_blocks(ray_cluster: Cluster, tmp_path: Path) -> None:
    ns = f"da{uuid.uuid4().hex[:8]}"
    ram = 4 * MiB
    kvray.start(
        namespace=ns,
        capacity=ram,
        segment_bytes=MiB,
        disk_dir=str(tmp_path),
        disk_capacity=64 * MiB,
        disk_admit_min_hits=1,
        health_check_interval_s=0.5,
    )
    store = kvray.connect(ns)
    try:
        pool = _my_pool(ns)
        rng = np.random.default_rng(3)
        first = [f"{ns}-a{i}".encode() for i in range(16)]  # fills RAM
        blocks = [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(16)]
        for a in range(0, 16, PER_PUT):
            store.put(first[a : a + PER_PUT], blocks[a : a + PER_PUT]).result(60)
        store.sync()
        read = first[1::2]  # one in two, in every segment
        store.get(read)
        store.io.flush_releases()
        _settle(pool, ram, 64 * MiB)
        second = [f"{ns}-b{i}".encode() for i in range(16)]  # evicts the first 16
        for a in range(0, 16, PER_PUT):
            r = store.put(second[a : a + PER_PUT], blocks[a : a + PER_PUT]).result(60)
            assert r.stored == PER_PUT
            _settle(pool, ram, 64 * MiB)
        s = _settle(pool, ram, 64 * MiB)
        assert s["spilled"] == s["disk_blocks"] == 8
        assert s["disk_not_admitted"] == 8 and s["disk_skipped"] == 0
        _wait_for(lambda: not any(store.contains(k) for k in first[::2]), 10, "unread to go")
        assert all(store.contains(k) for k in read)
        # Files hold only the read blocks; they come back with their own bytes.
        want = dict(zip(first, blocks, strict=True))
        for k in read:  # one segment at a time: RAM is 4 segments
            assert store.get([k])[0].tobytes() == want[k].tobytes()
            store.io.flush_releases()
            _settle(pool, ram, 64 * MiB)
        assert ray.get(pool.stats.remote())["promoted"] == 8
    finally:
        store.close()
        kvray.stop(ns, purge=True)


# ---------------------------------------------------------------------- vLLM


@pytest.fixture
def in_process() -> Iterator[None]:
    with in_process_engines():
        yield


@pytest.mark.vllm
def test_vllm_loads_a_prefix_from_disk_after_a_warm_restart(
    ray_cluster: Cluster, in_process: None, tmp_path: Path
) -> None:
    """A real engine computes two prompts (its KV goes to kvray), the blocks are pushed out
    of RAM to disk, the pool restarts (RAM empty), and the same engine, its own cache reset,
    loads the prefix from the files: tokens identical to the recompute."""
    pytest.importorskip("vllm")
    from vllm import LLM

    from kvray.testing.engines import (
        BLOCK_SIZE,
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
    ns = f"dv{uuid.uuid4().hex[:8]}"
    disk = {"disk_dir": str(tmp_path / "disk"), "disk_capacity": "64MiB"}
    kvray.start(namespace=ns, capacity="1MiB", health_check_interval_s=0.5, **disk)
    ktc = kvray_transfer_config(ns, capacity="1MiB", get_timeout_s=10, **disk)
    llm = LLM(**engine_kwargs(model, kv_transfer_config=ktc))
    prompts = make_prompts(2, 200, 30, seed=7)
    full_hit = full_hit_tokens(prompts[0])
    try:
        recomputed = generate(llm, prompts)
        finish_delayed_frees(llm)
        worker_connector_of(llm).worker.flush()
        sched_store = connector_of(llm).store
        sched_store.sync()
        pool = _my_pool(ns)  # this process's node: where the engine's blocks went
        saved = ray.get(pool.stats.remote())["present_blocks"]
        assert saved >= 2 * (len(prompts[0]) // BLOCK_SIZE) - 200 // BLOCK_SIZE
        # 1 MiB of other blocks pushes the engine's out of RAM, onto disk.
        store = kvray.connect(ns)
        rng = np.random.default_rng(1)
        filler = [f"{ns}-filler-{i}".encode() for i in range(4)]
        store.put(filler, [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in filler]).result(60)
        store.close()
        s = _settle(pool, MiB, 64 * MiB)
        assert s["disk_only_blocks"] == saved and s["disk_skipped"] == 0

        index = ray.get_actor(index_name(ns), namespace=RAY_NAMESPACE)
        resyncs = ray.get(index.stats.remote())["resyncs"]
        ray.kill(pool, no_restart=False)  # RAM is gone; the files stay
        _wait_for(lambda: ray.get(index.stats.remote())["resyncs"] > resyncs, 60, "a resync")
        present = saved  # the filler was in RAM only: gone with the restart
        _wait_for(
            lambda: len(sched_store.feed.view) == present,
            60,
            "the engine's view",
            lambda: (len(sched_store.feed.view), present, ray.get(index.stats.remote())["keys"]),
        )
        s = ray.get(pool.stats.remote())
        assert (s["stored"], s["present_blocks"], s["blocks"]) == (0, present, 0)

        finish_delayed_frees(llm)
        assert llm.reset_prefix_cache()
        loaded = generate(llm, prompts)
        assert token_ids(loaded) == token_ids(recomputed)
        assert cached_tokens(loaded)[0] == full_hit
        assert ray.get(pool.stats.remote())["promoted"] >= full_hit // BLOCK_SIZE
    finally:
        close_llm(llm)
        kvray.stop(ns, purge=True)


# ---------------------------------------------------------------------- configuration, CLI


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"disk_dir": "relative/path", "disk_capacity": "1GiB"}, "disk_dir"),
        ({"disk_dir": "/tmp/x"}, "disk_capacity"),
        ({"disk_dir": "/tmp/x", "disk_capacity": "512KiB"}, "disk_capacity"),
        ({"disk_capacity": "1GiB"}, "disk_capacity"),
        ({"disk_dir": "/tmp/x", "disk_capacity": "lots"}, "disk_capacity"),
        (
            {"disk_dir": "/tmp/x", "disk_capacity": "1GiB", "disk_admit_min_hits": -1},
            "disk_admit_min_hits",
        ),
        (
            {"disk_dir": "/tmp/x", "disk_capacity": "1GiB", "disk_admit_min_hits": "often"},
            "disk_admit_min_hits",
        ),
        (
            {"disk_dir": "/tmp/x", "disk_capacity": "1GiB", "disk_admit_min_hits": True},
            "disk_admit_min_hits",
        ),
    ],
)
def test_disk_config_errors_name_the_field(values: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        KVRayConfig.from_dict(values)
    assert info.value.field_name == field


def test_disk_config_from_strings() -> None:
    cfg = KVRayConfig.from_dict(
        {"disk_dir": "/var/kv", "disk_capacity": "500GiB", "disk_admit_min_hits": "2"}
    )
    assert (cfg.disk_dir, cfg.disk_capacity, cfg.disk_admit_min_hits) == ("/var/kv", 500 << 30, 2)
    assert KVRayConfig().disk_dir is None


def test_cli_start_status_stop_purge(
    ray_cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvray.ops import cli

    # A wide terminal: rich reads COLUMNS once, when the CLI's console is made (at import,
    # maybe by an earlier test of this process), so the runner's env cannot set it.
    monkeypatch.setattr(cli.console, "width", 200)
    runner = CliRunner()
    ns = f"dc{uuid.uuid4().hex[:6]}"
    args = ["--namespace", ns, "--capacity", "8MiB", "--disk-dir", str(tmp_path)]
    started = runner.invoke(app, ["start", *args, "--disk-capacity", "32MiB"])
    try:
        assert started.exit_code == 0, started.output
        assert "disk tier 32.0 MiB per node" in " ".join(started.output.split())
        table = runner.invoke(app, ["status", "--namespace", ns])
        assert table.exit_code == 0, table.output
        assert "disk used / capacity" in table.output and "0 B / 32.0 MiB" in table.output
        bad = runner.invoke(app, ["start", "--namespace", ns, "--disk-dir", str(tmp_path)])
        assert bad.exit_code == 1 and "invalid disk_capacity=0" in bad.output
    finally:
        stopped = runner.invoke(app, ["stop", "--namespace", ns, "--purge"])
    assert stopped.exit_code == 0 and "disk files deleted" in stopped.output, stopped.output
