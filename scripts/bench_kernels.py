#!/usr/bin/env python
"""Benchmark kvray's gather / scatter against a plain contiguous copy of the same bytes.

Shape (defaults): 32 layers, 8 KV heads, head size 128, bf16, block sizes 16 and 32, 64 blocks
moved per call out of a 512-block KV cache. On the CPU the cache is vLLM's CPU-backend layout
(``[num_blocks, H, block_size, 2*head_size]`` per layer, all layers views of one allocation, as
vLLM >= 0.32 allocates it); block ids are a random sample of the cache (the worst case: no
consecutive runs). Every number is the median of repeats, and the operations of one repeat run
back to back so that machine noise hits them alike: the ratios are what matters.

``gather`` / ``scatter`` are the default strategy (numpy copies in ``torch.get_num_threads()``
threads); the ``alt:`` rows are the torch strategies, for comparison.

On a GPU (when CUDA is present) it also measures the standardised NHD layout: gather / scatter
to device memory vs a device-to-device copy, to pinned host memory (the connector's staging
rows) vs a ``cudaMemcpyAsync`` of the same bytes (device-to-host, host-to-device: the physical
limit), each engine (the one-launch CuPy kernel, torch), and a per-layer torch loop.

The last line is ``ratio gather=<x> scatter=<y>``: fractions of the plain copy on the CPU, the
worse of the measured block sizes. With ``--gpu-only`` (``scripts/gpu_check.sh``) the CPU part is
skipped and the last line is ``ratio gather_over_d2h=<x> scatter_over_h2d=<y>
cupy_over_torch=<z>``: gather to pinned host over a plain D2H copy of the same bytes, scatter
from pinned host over a plain H2D copy (the default engine; 1.0 is the physical limit), and the
CuPy engine's time over the torch engine's for that gather + scatter (nan without CuPy); times
are medians of the repeats, ratios the worse of the block sizes. Needs torch and kvray.kernels
only (no Ray, no vLLM).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from kvray.kernels import BlockMover, StagingPool, describe_kv_caches


def _median_times(
    ops: dict[str, Callable[[], None]], repeats: int, sync: Callable[[], None]
) -> dict[str, float]:
    """Median seconds per op; ops run interleaved, after one warm-up round."""
    for fn in ops.values():
        fn()
    sync()
    times: dict[str, list[float]] = {name: [] for name in ops}
    for _ in range(repeats):
        for name, fn in ops.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _fill(t: torch.Tensor) -> None:
    """Touch every page with non-zero, non-constant bytes (cheap: 8-byte random words)."""
    flat = t.view(-1)
    usable = flat.numel() // 8 * 8
    flat[:usable].view(torch.int64).random_()


def _make_cache(
    device: str,
    layers: int,
    pool_blocks: int,
    heads: int,
    block_size: int,
    head_size: int,
    nhd: bool,
) -> dict[str, torch.Tensor]:
    """One allocation, per-layer views; HND ``[B, H, N, 2D]`` or NHD (as a permuted view)."""
    if nhd:
        raw = torch.empty(
            layers,
            pool_blocks,
            block_size,
            heads,
            2 * head_size,
            dtype=torch.bfloat16,
            device=device,
        )
        views = {f"layers.{i}": raw[i].permute(0, 2, 1, 3) for i in range(layers)}
    else:
        raw = torch.empty(
            layers,
            pool_blocks,
            heads,
            block_size,
            2 * head_size,
            dtype=torch.bfloat16,
            device=device,
        )
        views = {f"layers.{i}": raw[i] for i in range(layers)}
    _fill(raw.view(torch.uint8))
    return views


def bench_cpu(args: argparse.Namespace, block_size: int) -> list[tuple[str, float, float]]:
    """Rows (name, GB/s, fraction of the plain copy) for one block size on the CPU."""
    caches = _make_cache(
        "cpu", args.layers, args.pool_blocks, args.heads, block_size, args.head_size, nhd=False
    )
    layout = describe_kv_caches(caches, block_size=block_size, layout_hint="CPU_ATTN:bench")
    rng = np.random.default_rng(0)
    src_ids = rng.choice(args.pool_blocks, size=args.blocks, replace=False)
    dst_ids = rng.choice(
        np.setdiff1d(np.arange(args.pool_blocks), src_ids), size=args.blocks, replace=False
    )
    pool = StagingPool(layout.block_nbytes, args.blocks, "cpu")
    nbytes = args.blocks * layout.block_nbytes
    plain_src = torch.empty(nbytes, dtype=torch.uint8)
    plain_dst = torch.empty(nbytes, dtype=torch.uint8)
    _fill(plain_src)
    _fill(plain_dst)
    auto = BlockMover(caches, layout)
    loop = BlockMover(caches, layout, torch_strategy="loop")
    index = BlockMover(caches, layout, torch_strategy="index")
    with pool.acquire(args.blocks) as buf:
        ops: dict[str, Callable[[], None]] = {
            "plain copy": lambda: plain_dst.copy_(plain_src),
            "gather": lambda: auto.gather(src_ids, buf),
            "scatter": lambda: auto.scatter(dst_ids, buf),
        }
        if not args.quick:
            ops["  alt: gather, torch copy_ per block"] = lambda: loop.gather(src_ids, buf)
            ops["  alt: scatter, torch copy_ per block"] = lambda: loop.scatter(dst_ids, buf)
            ops["  alt: gather, one index_select"] = lambda: index.gather(src_ids, buf)
            ops["  alt: scatter, one index_copy_"] = lambda: index.scatter(dst_ids, buf)
        med = _median_times(ops, args.repeats, lambda: None)
        # Correctness spot check: what was scattered gathers back identically.
        check = torch.empty_like(buf)
        auto.gather(dst_ids, check)
        assert torch.equal(check, buf), "gather/scatter mismatch"
    base = med["plain copy"]
    return [(name, nbytes / t / 1e9, base / t) for name, t in med.items()]


def bench_gpu(
    args: argparse.Namespace, block_size: int
) -> tuple[list[tuple[str, float, float]], dict[str, float]]:
    """Rows for one block size on the GPU (NHD, flash-attention's default layout), and the
    ratios of the last line of ``--gpu-only``."""
    dev = "cuda"
    caches = _make_cache(
        dev, args.layers, args.pool_blocks, args.heads, block_size, args.head_size, nhd=True
    )
    layout = describe_kv_caches(caches, block_size=block_size, layout_hint="FLASH_ATTN")
    rng = np.random.default_rng(0)
    src_ids = rng.choice(args.pool_blocks, size=args.blocks, replace=False)
    dst_ids = rng.choice(
        np.setdiff1d(np.arange(args.pool_blocks), src_ids), size=args.blocks, replace=False
    )
    nbytes = args.blocks * layout.block_nbytes
    dev_buf = torch.empty(args.blocks, layout.block_nbytes, dtype=torch.uint8, device=dev)
    host_pool = StagingPool(layout.block_nbytes, args.blocks, "cpu", pin_memory=True)
    plain_src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    plain_dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    _fill(plain_src)
    host_plain = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    _fill(host_plain)
    host_plain_src = host_plain.clone().pin_memory()
    default_engine = BlockMover(caches, layout).engine
    movers = {"torch": BlockMover(caches, layout, engine="torch")}
    try:
        movers["cupy"] = BlockMover(caches, layout, engine="cupy")
    except ImportError as exc:
        print(f"# CuPy unavailable ({exc}); GPU rows use the torch engine only")
    per_layer_views = list(caches.values())
    ids_dev = torch.as_tensor(src_ids, device=dev)
    out3 = dev_buf.view(args.blocks, args.layers, -1)

    def per_layer_loop() -> None:
        # What a straightforward connector does: one gather + one copy per layer.
        for li, t in enumerate(per_layer_views):
            out3[:, li].copy_(t.index_select(0, ids_dev).reshape(args.blocks, -1).view(torch.uint8))

    rows: list[tuple[str, float, float]] = []
    with host_pool.acquire(args.blocks) as host_buf:
        ops: dict[str, Callable[[], None]] = {
            "plain D2D copy": lambda: plain_dst.copy_(plain_src),
            "plain D2H copy (pinned)": lambda: host_plain.copy_(plain_src, non_blocking=True),
            "plain H2D copy (pinned)": lambda: plain_dst.copy_(host_plain_src, non_blocking=True),
            "per-layer torch loop (to device)": per_layer_loop,
        }
        for name, mover in movers.items():
            ops[f"gather {name} (to device)"] = lambda m=mover: m.gather(src_ids, dev_buf)
            ops[f"scatter {name} (from device)"] = lambda m=mover: m.scatter(dst_ids, dev_buf)
            ops[f"gather {name} (to pinned host)"] = lambda m=mover: m.gather(src_ids, host_buf)
            ops[f"scatter {name} (from pinned host)"] = lambda m=mover: m.scatter(dst_ids, host_buf)
        med = _median_times(ops, args.repeats, torch.cuda.synchronize)
    d2d, d2h = med["plain D2D copy"], med["plain D2H copy (pinned)"]
    h2d = med["plain H2D copy (pinned)"]
    for name, t in med.items():
        if "H2D" in name or "from pinned host" in name:
            base = h2d
        elif "D2H" in name or "to pinned host" in name:
            base = d2h
        else:
            base = d2d
        rows.append((name, nbytes / t / 1e9, base / t))
    if "gather cupy (to device)" in med:
        speedup = med["per-layer torch loop (to device)"] / med["gather cupy (to device)"]
        rows.append(("cupy one launch vs per-layer loop (x faster)", float("nan"), speedup))
    engine = "cupy" if default_engine == "cupy" else "torch"
    host = {
        name: med[f"gather {name} (to pinned host)"] + med[f"scatter {name} (from pinned host)"]
        for name in movers
    }
    ratios = {
        "gather_over_d2h": med[f"gather {engine} (to pinned host)"] / d2h,
        "scatter_over_h2d": med[f"scatter {engine} (from pinned host)"] / h2d,
        "cupy_over_torch": host["cupy"] / host["torch"] if "cupy" in host else float("nan"),
    }
    return rows, ratios


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="a few-second run (smaller shapes)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--blocks", type=int, default=64, help="blocks moved per call")
    p.add_argument("--pool-blocks", type=int, default=512, help="blocks in the KV cache")
    p.add_argument("--block-sizes", type=int, nargs="+", default=[16, 32])
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--no-gpu", action="store_true", help="skip the GPU section")
    p.add_argument(
        "--gpu-only", action="store_true", help="skip the CPU section (last line: GPU ratios)"
    )
    args = p.parse_args()
    if args.quick:
        args.layers, args.pool_blocks, args.blocks, args.repeats = 8, 128, 32, 5
        args.block_sizes = [16]
    if args.gpu_only:
        gpu_main(args)
        return
    print(
        f"# kvray kernels: {args.layers} layers, {args.heads} KV heads, head size "
        f"{args.head_size}, bf16, {args.blocks} random of {args.pool_blocks} blocks per call, "
        f"median of {args.repeats}; torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print(f"{'device':6} {'bs':>3} {'operation':44} {'GB/s':>8} {'x plain':>8}")
    worst: dict[str, float] = {}
    for bs in args.block_sizes:
        rows = bench_cpu(args, bs)
        gc.collect()
        for name, gbs, ratio in rows:
            print(f"{'cpu':6} {bs:>3} {name:44} {gbs:8.2f} {ratio:8.2f}")
            if name in ("gather", "scatter"):
                worst[name] = min(worst.get(name, float("inf")), ratio)
    if torch.cuda.is_available() and not args.no_gpu:
        for bs in args.block_sizes:
            _print_gpu_rows(bs, bench_gpu(args, bs)[0])
    sizes = ", ".join(map(str, args.block_sizes))
    print(f"# ratio: CPU, fraction of the plain copy, worse of block sizes {sizes}")
    print(f"ratio gather={worst['gather']:.2f} scatter={worst['scatter']:.2f}")


def _print_gpu_rows(bs: int, rows: list[tuple[str, float, float]]) -> None:
    torch.cuda.empty_cache()
    for name, gbs, ratio in rows:
        print(f"{'cuda':6} {bs:>3} {name:44} {gbs:8.2f} {ratio:8.2f}")


def gpu_main(args: argparse.Namespace) -> None:
    """``--gpu-only``: the GPU table, then the ratios line (the worse of the block sizes)."""
    if not torch.cuda.is_available():
        print("# no CUDA device found: nothing to measure")
        return
    print(
        f"# kvray kernels on {torch.cuda.get_device_name()}: {args.layers} layers, "
        f"{args.heads} KV heads, head size {args.head_size}, bf16, {args.blocks} random of "
        f"{args.pool_blocks} blocks per call, median of {args.repeats}; torch "
        f"{torch.__version__} (CUDA {torch.version.cuda})"
    )
    print(f"{'device':6} {'bs':>3} {'operation':44} {'GB/s':>8} {'x plain':>8}")
    worst: dict[str, float] = {}
    for bs in args.block_sizes:
        rows, ratios = bench_gpu(args, bs)
        _print_gpu_rows(bs, rows)
        for k, v in ratios.items():
            worst[k] = max(worst.get(k, v), v)  # nan stays nan
    sizes = ", ".join(map(str, args.block_sizes))
    print(f"# ratio: GPU, time over a plain copy of the same bytes, worse of block sizes {sizes}")
    print(
        f"ratio gather_over_d2h={worst['gather_over_d2h']:.2f} "
        f"scatter_over_h2d={worst['scatter_over_h2d']:.2f} "
        f"cupy_over_torch={worst['cupy_over_torch']:.2f}"
    )


if __name__ == "__main__":
    main()
