"""Benchmark of the disk tier (issue 12): spill throughput and warm-restart scan time.

Measured in one run, repeats interleaved (each repeat times every variant back to back, in
alternating order) and compared as ratios of medians (the shared disk has outliers):

- plain write: the same bytes written sequentially to one file with unbuffered ``write`` calls,
  one ``fsync`` at the end: the limit a spill chases.
- plain write, fsync per segment: the same, durable every segment (what a writer that fsyncs
  file by file gets).
- DiskTier spill: ``spill`` of every segment, timed until the last ``on_spilled`` (one Arrow
  IPC file per segment; the writer takes the queued segments as a group, writes them and starts
  their writeback, then fsyncs and renames each and fsyncs the directory once), for a 2D payload,
  a list of variable-size blocks in one buffer (a Ray object's layout) and scattered blocks.
- the same spill and plain write on tmpfs: the tier's own overhead, without the disk's noise.
- rolling log: the same record batches appended to an Arrow IPC stream rolled every 1 GiB,
  durable as often as the tier's writes (writeback started per segment, fsync per group): the
  alternative layout to one file per segment.
- restart: a new ``DiskTier`` and its ``scan`` over what the spill left, cold (our files'
  pages dropped with ``posix_fadvise(DONTNEED)``) and warm, in seconds per GiB on disk; plus
  cold and warm ``read`` + ``verify`` throughput.

- TTFT on vLLM-CPU at 2048 tokens (``scripts/tier_ttft.py``, ``bench_e2e.py``'s model and
  engine processes): recompute, a hit loaded from disk after a warm pool restart (RAM empty,
  the files' pages dropped), and a hit from RAM.
- read-back (``scripts/tier_readback.py``, issue 18): a working set 4x RAM (128 MiB of RAM;
  16 MiB with ``--quick``) read back through ``Store.get``, sequentially (twice) and by 4
  readers at once: hits and GB/s per phase.

Last line: ``ratio recompute_over_disk_hit=<x> spill_over_plain_write=<y> restart_s_per_gib=<z>
disk_read_back_hit_rate=<h>``; x the TTFT ratio of medians at 2048 tokens, y the worse of the
two payload forms a pool hands over (2D, or the arrays of one Ray object; a list of scattered
arrays costs one more copy and is shown apart), z the cold scan, h the blocks read back of the
blocks asked in the read-back phases. Targets x >= 5, y >= 0.7, h = 1.0. ``--no-vllm`` skips
the TTFT part (x is then ``nan``), ``--no-readback`` the read-back (h ``nan``),
``--readback-only`` all but the read-back (x, y, z ``nan``).
Run: ``PYTHONPATH=. .venv/bin/python scripts/bench_tier.py [--quick] [--dir PATH]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa

from kvray.blocks import checksum
from kvray.disk import DiskTier, segfile
from kvray.disk.payload import Payload
from kvray.disk.writer import GROUP_BYTES
from kvray.meta.segment import SegmentMeta

MiB = 1 << 20
GiB = 1 << 30
BLOCK = 2 * MiB
SEGMENT = 32 * MiB
LOG_ROLL = GiB

Segments = list[tuple[SegmentMeta, Payload]]


# ---------------------------------------------------------------------- environment
def filesystem_of(path: str) -> str:
    """The type of the filesystem holding ``path`` (longest mount point in /proc/mounts)."""
    best, fstype = "", "?"
    real = os.path.realpath(path)
    with open("/proc/mounts") as f:
        for line in f:
            _, mount, kind, *_ = line.split()
            if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) > len(
                best
            ):
                best, fstype = mount, kind
    return fstype


def drop_caches_writable() -> bool:
    """Whether ``echo 3 > /proc/sys/vm/drop_caches`` would be allowed (not done: it would
    slow every other process on a shared box; we drop only our own files' pages)."""
    return os.access("/proc/sys/vm/drop_caches", os.W_OK)


def drop_file_pages(paths: list[str]) -> None:
    """Evict the (clean, fsynced) page-cache pages of these files."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def settle() -> None:
    """Let writeback and the discards of deleted files finish before the next timing."""
    os.sync()
    time.sleep(1.0)


# ---------------------------------------------------------------------- data
def make_segments(total: int, form: str, seed: int) -> Segments:
    """``total`` bytes of random blocks in 32 MiB segments: ``array`` (2D, 2 MiB blocks),
    ``list`` (1.5-2.5 MiB blocks in one buffer, as the pool gets them from a Ray object) or
    ``scattered`` (the same sizes, separately allocated: the tier copies them once)."""
    rng = np.random.default_rng(seed)
    segments: Segments = []
    left = total
    while left > 0:
        if form == "array":
            n = max(1, min(SEGMENT, left) // BLOCK)
            payload: Payload = np.frombuffer(rng.bytes(n * BLOCK), np.uint8).reshape(n, BLOCK)
        else:
            sizes = [int(rng.integers(BLOCK * 3 // 4, BLOCK * 5 // 4))]
            while sum(sizes) < min(SEGMENT, left) - BLOCK:
                sizes.append(int(rng.integers(BLOCK * 3 // 4, BLOCK * 5 // 4)))
            if form == "scattered":
                payload = [np.frombuffer(rng.bytes(s), np.uint8) for s in sizes]
            else:  # "list": one buffer, blocks 64-byte aligned, as ray.get returns a segment
                starts = [0]
                for size in sizes[:-1]:
                    starts.append((starts[-1] + size + 63) // 64 * 64)
                flat = np.frombuffer(rng.bytes(starts[-1] + sizes[-1]), np.uint8)
                payload = [flat[a : a + z] for a, z in zip(starts, sizes, strict=True)]
        n = len(payload)
        meta = SegmentMeta.from_keys(
            [rng.bytes(44) for _ in range(n)],
            rng.integers(0, 2**63, n, dtype=np.uint64),
            np.zeros(n, np.uint16),
            np.ones(n, np.uint16),
            [payload[i].nbytes for i in range(n)],
            [checksum(payload[i]) for i in range(n)],
        )
        segments.append((meta, payload))
        left -= meta.nbytes
    return segments


def nbytes_of(segments: Segments) -> int:
    return sum(meta.nbytes for meta, _ in segments)


# ---------------------------------------------------------------------- spill figures
def plain_write(directory: str, segments: Segments, fsync_each: bool) -> float:
    """Seconds to write the blocks to one file and fsync it (per segment or at the end)."""
    path = os.path.join(directory, "plain.bin")
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for _, payload in segments:
            for i in range(len(payload)):
                os.write(fd, memoryview(payload[i]))
            if fsync_each:
                os.fsync(fd)
        os.fsync(fd)
    finally:
        os.close(fd)
    elapsed = time.perf_counter() - t0
    os.unlink(path)
    return elapsed


def tier_spill(root: str, segments: Segments) -> tuple[float, DiskTier]:
    """Seconds from the first ``spill`` to the last ``on_spilled``; the tier is left closed,
    its files in place (for the restart figures)."""
    total = nbytes_of(segments)
    tier = DiskTier(root, "bench", 2 * total + GiB, max_pending_bytes=total + MiB)
    tier.scan()
    done = threading.Event()
    count = [0]

    def spilled(seg: object) -> None:
        count[0] += 1
        if count[0] == len(segments):
            done.set()

    tier.events.on_spilled = spilled  # type: ignore[assignment]
    tier.start()
    t0 = time.perf_counter()
    for meta, payload in segments:
        if not tier.spill(meta, payload):
            raise RuntimeError("bench: the tier refused a segment")
    if not done.wait(600):
        raise RuntimeError(f"bench: only {count[0]} of {len(segments)} segments spilled")
    elapsed = time.perf_counter() - t0
    tier.close(60)
    return elapsed, tier


def rolling_log(directory: str, segments: Segments) -> float:
    """Seconds to append the same record batches to Arrow IPC streams rolled every 1 GiB, with
    the tier's durability: writeback started after each segment, fsync every ``GROUP_BYTES``."""
    batches = [segfile.build_batch(m, p, "bench", "")[1] for m, p in segments]
    schema = batches[0].schema.remove_metadata()
    start_writeback = segfile._START_WRITEBACK or (lambda fd: None)
    t0 = time.perf_counter()
    written, unsynced, part = LOG_ROLL, 0, 0
    sink = writer = None
    fd = -1
    for batch in batches:
        if written >= LOG_ROLL:
            if writer is not None:
                writer.close()
                sink.close()  # type: ignore[union-attr]
                os.fsync(fd)
                os.close(fd)
            part += 1
            path = os.path.join(directory, f"log{part:04d}.arrows")
            sink = pa.OSFile(path, "wb")
            writer = pa.ipc.new_stream(sink, schema)
            fd = os.open(path, os.O_RDONLY)
            written = unsynced = 0
        writer.write_batch(batch.replace_schema_metadata(None))  # type: ignore[union-attr]
        start_writeback(fd)
        written += batch.nbytes
        unsynced += batch.nbytes
        if unsynced >= GROUP_BYTES:
            os.fsync(fd)
            unsynced = 0
    writer.close()  # type: ignore[union-attr]
    sink.close()  # type: ignore[union-attr]
    os.fsync(fd)
    os.close(fd)
    elapsed = time.perf_counter() - t0
    for name in os.listdir(directory):
        if name.startswith("log"):
            os.unlink(os.path.join(directory, name))
    return elapsed


# ---------------------------------------------------------------------- restart figures
def restart_scan(root: str, cold: bool) -> tuple[float, int, int]:
    """Seconds for a new tier to take its slot and scan; returns (s, files, bytes on disk)."""
    probe = DiskTier(root, "bench", GiB)
    paths = [p for _, p in probe._slot.segments()]
    probe.close()
    if cold:
        drop_file_pages(paths)
    t0 = time.perf_counter()
    tier = DiskTier(root, "bench", 64 * GiB)
    found = tier.scan()
    elapsed = time.perf_counter() - t0
    tier.close()
    return elapsed, len(found), sum(s.file_bytes for s in found)


def read_verify(root: str, cold: bool) -> float:
    """Seconds to map and verify every block the tier holds (after a scan)."""
    tier = DiskTier(root, "bench", 64 * GiB)
    found = tier.scan()
    if cold:
        drop_file_pages([s.path for s in found])
    t0 = time.perf_counter()
    for seg in found:
        if tier.verify(seg, tier.read(seg)):
            raise RuntimeError(f"bench: corrupt blocks in {seg.path}")
    elapsed = time.perf_counter() - t0
    tier.close()
    return elapsed


# ---------------------------------------------------------------------- driver
FORMS = ("array", "list", "scattered")


def spill_and_restart_figures(directory: str, total: int, repeats: int) -> dict[str, float]:
    """Every spill and restart figure on ``directory``: medians over interleaved repeats,
    ratios of median rates (tier / plain one-fsync): on a shared disk either side has outliers
    of several times its median, which a ratio per repeat would carry into the result."""
    data = {form: make_segments(total, form, seed) for seed, form in enumerate(FORMS)}
    times: dict[str, list[float]] = {}

    def timed(name: str, fn: Callable[[], float]) -> float:
        settle()
        t = fn()
        times.setdefault(name, []).append(t)
        return t

    def tier_and_restart(form: str) -> None:
        root = os.path.join(directory, f"tier-{form}")
        timed(f"tier_{form}", lambda: tier_spill(root, data[form])[0])
        if form != "scattered":  # same files as "list"
            settle()
            for cold in (True, False):
                kind = f"{form}_{'cold' if cold else 'warm'}"
                s, _, on_disk = restart_scan(root, cold)
                times.setdefault(f"scan_{kind}", []).append(s / (on_disk / GiB))
                times.setdefault(f"read_{kind}", []).append(read_verify(root, cold))
        shutil.rmtree(root)

    variants: list[Callable[[], object]] = [
        lambda: timed("plain", lambda: plain_write(directory, data["array"], False)),
        lambda: timed("plain_each", lambda: plain_write(directory, data["array"], True)),
        lambda: timed("log", lambda: rolling_log(directory, data["array"])),
        *[lambda form=form: tier_and_restart(form) for form in FORMS],
    ]
    for r in range(repeats):
        for variant in variants if r % 2 == 0 else variants[::-1]:  # no order bias
            variant()
        last = {k: round(v[-1], 3) for k, v in times.items()}
        print(f"# repeat {r}: seconds (scan: s/GiB) {last}", flush=True)
    out = {k: statistics.median(v) for k, v in times.items()}
    plain_rate = nbytes_of(data["array"]) / out["plain"]
    for form in FORMS:  # at equal byte rates: the list forms hold other sizes
        out[f"ratio_{form}"] = nbytes_of(data[form]) / out[f"tier_{form}"] / plain_rate
    out.update({f"bytes_{f}": nbytes_of(data[f]) for f in FORMS})
    return out


def overhead_figures(total: int, repeats: int) -> dict[str, float]:
    """Spill vs plain write on tmpfs (no disk): the tier's own cost, free of disk noise."""
    if not os.path.isdir("/dev/shm") or filesystem_of("/dev/shm") != "tmpfs":
        return {}
    data = {form: make_segments(total, form, seed) for seed, form in enumerate(FORMS)}
    directory = tempfile.mkdtemp(prefix="kvray-bench-tier-", dir="/dev/shm")
    ratios: dict[str, list[float]] = {form: [] for form in FORMS}
    try:
        for _ in range(repeats):
            plain_rate = nbytes_of(data["array"]) / plain_write(directory, data["array"], False)
            for form in FORMS:
                root = os.path.join(directory, form)
                t = tier_spill(root, data[form])[0]
                ratios[form].append(nbytes_of(data[form]) / t / plain_rate)
                shutil.rmtree(root)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return {f"tmpfs_ratio_{f}": statistics.median(v) for f, v in ratios.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="256 MiB per variant, 3 repeats: a smoke test (on a shared virtual disk a 256 MiB "
        "write takes 0.2 s or 1.2 s at random, so its ratios mean little)",
    )
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir on /var/tmp)")
    ap.add_argument("--no-vllm", action="store_true", help="skip the TTFT part")
    ap.add_argument("--rounds", type=int, default=None, help="reader engines of the TTFT part")
    ap.add_argument("--no-readback", action="store_true", help="skip the read-back part")
    ap.add_argument("--readback-only", action="store_true", help="only the read-back part")
    args = ap.parse_args()
    repeats = args.repeats or (3 if args.quick else 7)
    total = 256 * MiB if args.quick else GiB
    parent = args.dir or ("/var/tmp" if os.path.isdir("/var/tmp") else tempfile.gettempdir())
    fstype = filesystem_of(parent)
    if fstype in ("tmpfs", "ramfs", "overlay"):
        sys.exit(f"bench_tier: {parent} is on {fstype}, not a disk: pass --dir on a real disk")
    directory = tempfile.mkdtemp(prefix="kvray-bench-tier-", dir=parent)
    back: dict = {}
    if not args.no_readback:
        import tier_readback
        import tier_ttft

        tier_ttft.ensure_ray()
        try:
            ram = (16 if args.quick else 128) * MiB
            back = tier_readback.readback_figures(Path(directory), ram)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        if args.readback_only:
            _print(["read-back only"], tier_readback.rows(back), back["hit_rate"])
            return
        directory = tempfile.mkdtemp(prefix="kvray-bench-tier-", dir=parent)
    try:
        f = spill_and_restart_figures(directory, total, repeats)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    f.update(overhead_figures(min(total, 512 * MiB), repeats))
    ttft: dict[str, float] = {}
    if not args.no_vllm:
        import tier_ttft

        tier_ttft.ensure_ray()
        work = tempfile.mkdtemp(prefix="kvray-bench-ttft-", dir=parent)
        try:
            rounds = args.rounds or (2 if args.quick else 5)
            ttft = tier_ttft.ttft_figures(Path(work), rounds, 3)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def rate(key: str, form: str = "array") -> str:
        return f"{f[f'bytes_{form}'] / f[key] / 1e9:.2f} GB/s"

    def pair(fmt: str, *keys: str) -> str:
        return " / ".join(fmt.format(f[k]) if k in f else "n/a" for k in keys)

    # y: the worse of the two forms a pool hands over (2D, or the arrays of one Ray object).
    y = min(f["ratio_array"], f["ratio_list"])
    z = f["scan_array_cold"]
    rows = [
        ("directory", f"{directory} ({fstype}, rotational={_rotational(parent)})"),
        ("page cache", f"drop_caches writable: {drop_caches_writable()}; cold = fadvise(DONTNEED)"),
        ("bytes per variant", f"{f['bytes_array'] / MiB:.0f} MiB, 32 MiB segments"),
        ("plain write, one fsync", rate("plain")),
        ("plain write, fsync per segment", rate("plain_each")),
        ("rolling log (IPC stream, same fsyncs)", rate("log")),
        ("DiskTier spill, 2D payload", rate("tier_array")),
        ("DiskTier spill, list of one buffer", rate("tier_list", "list")),
        ("DiskTier spill, scattered list", rate("tier_scattered", "scattered")),
        ("  ratio vs plain (2D/list/scattered)", pair("{:.2f}", *[f"ratio_{x}" for x in FORMS])),
        (
            "  same on tmpfs (the tier's overhead)",
            pair("{:.2f}", *[f"tmpfs_ratio_{x}" for x in FORMS]),
        ),
        ("  file per segment vs rolling log", f"{f['log'] / f['tier_array']:.2f}"),
        (
            "restart scan, cold (2D / list)",
            pair("{:.3f} s/GiB", "scan_array_cold", "scan_list_cold"),
        ),
        (
            "restart scan, warm (2D / list)",
            pair("{:.3f} s/GiB", "scan_array_warm", "scan_list_warm"),
        ),
        (
            "read + verify, cold / warm (2D)",
            f"{rate('read_array_cold')} / {rate('read_array_warm')}",
        ),
    ]
    x = float("nan")
    if ttft:
        x = ttft["recompute"] / ttft["disk_hit"]
        rows += [
            (
                "TTFT 2048 tokens: recompute / disk hit / RAM hit",
                f"{ttft['recompute'] * 1e3:.0f} / {ttft['disk_hit'] * 1e3:.0f} / "
                f"{ttft['ram_hit'] * 1e3:.0f} ms (disk: {ttft['rounds']} warm restarts)",
            ),
            ("  recompute over RAM hit", f"{ttft['recompute'] / ttft['ram_hit']:.1f}"),
            ("  disk hit over RAM hit", f"{ttft['disk_hit'] / ttft['ram_hit']:.2f}"),
            (
                "  disk-hit facts",
                f"RAM {ttft['ram_bytes'] / MiB:.0f} MiB, {ttft['disk_blocks_at_restart']} blocks "
                f"in {ttft['disk_files']} files at restart, {ttft['promoted_last_round']} "
                f"promoted in the last round, {ttft['cached_tokens']} tokens loaded",
            ),
        ]
    if back:
        rows += tier_readback.rows(back)
    _print([f"median of {repeats}"], rows, back["hit_rate"] if back else float("nan"), x, y, z)


def _print(
    what: list[str],
    rows: list[tuple[str, str]],
    h: float,
    x: float = float("nan"),
    y: float = float("nan"),
    z: float = float("nan"),
) -> None:
    width = max(len(r[0]) for r in rows)
    print(
        f"kvray bench_tier ({'; '.join(what)}; cores: {os.cpu_count()}; "
        f"load avg {os.getloadavg()[0]:.1f})"
    )
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    print(
        f"ratio recompute_over_disk_hit={x:.2f} spill_over_plain_write={y:.2f} "
        f"restart_s_per_gib={z:.3f} disk_read_back_hit_rate={h:.3f}"
    )
    sys.stdout.flush()


def _rotational(path: str) -> str:
    try:
        dev = os.stat(path).st_dev
        with open(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/queue/rotational") as f:
            return f.read().strip()
    except OSError:
        return "?"


if __name__ == "__main__":
    main()
