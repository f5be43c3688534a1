"""Worker side of the kvray connector (one instance per TP rank, in vLLM's worker process).

Saves: inside ``wait_for_save`` each planned block is gathered (all layers of this rank's shard)
into a staging buffer, and the buffer is handed to ``store.put``, which copies it into Ray from a
background thread. So neither the forward pass nor ``wait_for_save`` waits on Ray, and once
``wait_for_save`` returns no save reads vLLM's paged blocks any more (on a GPU the gather's
device-to-host copy is synchronised first). A staging budget (``staging_bytes``) bounds the
memory of puts in flight; beyond it a save is dropped and counted, never queued.

Loads: ``sync`` loads complete inside ``start_load_kv`` (vLLM calls it before the forward when
the step has one); ``layerwise`` loads (CPU caches) start there and copy one layer at a time on a
thread while the forward runs, each attention layer waiting in ``wait_for_layer_load`` for its
own; ``async`` loads run on a thread and report through ``finished_recving``.
Blocks are scattered while their checksums are verified (see ``_scatter_verified``). The block
ids of missing, lost or corrupt blocks (from the first bad one on) go to
``get_block_ids_with_load_errors`` in the same step, so vLLM recomputes them: a corrupt block may
have been written, but vLLM drops that step's output for the request and overwrites the block.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from kvray.client import Fetched, checksum
from kvray.config import KVRayConfig
from kvray.connector.keys import EngineKeySpace
from kvray.connector.metadata import (
    JobId,
    KVRayConnectorMetadata,
    KVRayWorkerMetadata,
    LoadSpec,
    ReqId,
    StoreSpec,
    TransferCounters,
)
from kvray.kernels import BlockMover, StagingPool, StagingPoolExhausted, describe_kv_caches
from kvray.keys import make_keys

logger = logging.getLogger(__name__)

#: While async loads are in flight and none has finished, ``get_finished`` (called once per
#: engine step) waits up to this long for one. Without it an idle engine loop spins through
#: empty steps holding the GIL, and the loader thread (Python between its Ray calls, the
#: checksums, the copy hand-offs) runs only in the interpreter's 5 ms switch slices: loads took
#: 5-20x their sync time. Waiting on a condition releases the GIL to the loader.
ASYNC_LOAD_WAIT_S = 0.005


class _LayerProgress:
    """How far a step's layer-by-layer loads are (the forward pass waits on ``cv``)."""

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.layers_done = 0
        self.finished = False
        self.future: Future[None] | None = None


class KVRayConnectorWorker:
    """Executes the scheduler's jobs for one TP rank and reports them back."""

    def __init__(
        self,
        config: KVRayConfig,
        key_space: EngineKeySpace,
        store: Any,
        *,
        tp_rank: int,
        layout_hint: str | None = None,
    ) -> None:
        self.config = config
        self.key_space = key_space
        self.store = store
        self.tp_rank = tp_rank
        self.prefix = key_space.fingerprint(tp_rank).prefix
        # MLA: every rank holds the same latent KV; rank 0 alone writes the single shard.
        self.is_writer = key_space.num_shards > 1 or tp_rank == 0
        self.layout_hint = layout_hint
        self.mover: Any = None
        self.staging: StagingPool | None = None
        self.block_nbytes = 0
        self.device = torch.device("cpu")
        self._lock = threading.Lock()
        #: Signalled (under ``_lock``) when an async load finishes.
        self._load_cv = threading.Condition(self._lock)
        self._async_inflight = 0
        self._meta = KVRayWorkerMetadata()
        self._finished_sending: set[ReqId] = set()
        self._finished_recving: set[ReqId] = set()
        self._failed_recving: set[ReqId] = set()
        self._load_errors: set[int] = set()
        self._puts: dict[JobId, Future[Any]] = {}
        self._loader: ThreadPoolExecutor | None = None
        #: Sync loads run layer by layer ahead of the forward pass (``load_mode="layerwise"``,
        #: CPU caches); ``_layer_progress`` tracks the current step's.
        self._layerwise = False
        self._layer_index: dict[str, int] = {}
        self._layer_loader: ThreadPoolExecutor | None = None
        self._layer_progress: _LayerProgress | None = None

    # ---------------------------------------------------------------- setup
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        first = next(iter(kv_caches.values()))
        self.device = first.device
        layout = describe_kv_caches(
            kv_caches, block_size=self.key_space.block_size, layout_hint=self.layout_hint
        )
        ks = self.key_space
        if layout.block_nbytes != ks.block_nbytes or (
            ks.variant and layout.variant and layout.variant != ks.variant
        ):
            raise RuntimeError(
                f"kvray connector: the KV caches ({layout.kind}:{layout.variant}, "
                f"{layout.block_nbytes} B/block) do not match the key namespace "
                f"({ks.base.layout}, {ks.block_nbytes} B/block); refusing to share them"
            )
        self.block_nbytes = int(layout.block_nbytes)
        self.mover = BlockMover(kv_caches, layout)
        self._layer_index = {name: i for i, name in enumerate(kv_caches)}
        self._layerwise = self.config.load_mode == "layerwise" and self.device.type == "cpu"
        if self.config.load_mode == "layerwise" and not self._layerwise:
            logger.info("kvray: layer-by-layer loads are for CPU caches; loading whole blocks")
        max_blocks = max(1, self.config.staging_bytes // self.block_nbytes)
        self.staging = StagingPool(self.block_nbytes, max_blocks, "cpu")
        logger.info(
            "kvray worker rank %d: %d layers, %d B per block, layout %s, %d staging blocks",
            self.tp_rank,
            layout.num_layers,
            self.block_nbytes,
            layout.fingerprint,
            max_blocks,
        )

    def _lease(self, n: int) -> Any | None:
        """Staging rows for ``n`` blocks without waiting (None when the pool is full)."""
        assert self.staging is not None
        if n > self.staging.max_blocks:
            return None
        try:
            return self.staging.acquire(n, timeout=0)
        except StagingPoolExhausted:
            return None

    # ---------------------------------------------------------------- loads
    def start_load_kv(self, meta: KVRayConnectorMetadata) -> None:
        self._finish_layerwise()  # defensive: the previous step's loads are complete
        layerwise: list[tuple[JobId, LoadSpec]] = []
        for job_id, spec in meta.loads.items():
            if spec.is_async:
                if self._loader is None:
                    self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvray-load")
                with self._lock:
                    self._async_inflight += 1
                try:
                    self._loader.submit(self._load_async, job_id, spec)
                except Exception:
                    with self._lock:
                        self._async_inflight -= 1
                    raise
            elif self._layerwise:
                layerwise.append((job_id, spec))
            else:
                self._load(job_id, spec)
        if layerwise:
            if self._layer_loader is None:
                self._layer_loader = ThreadPoolExecutor(1, thread_name_prefix="kvray-layers")
            progress = _LayerProgress()
            progress.future = self._layer_loader.submit(self._load_layerwise, progress, layerwise)
            self._layer_progress = progress

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until this step's layer-by-layer loads have filled ``layer_name``."""
        progress = self._layer_progress
        if progress is None:
            return
        index = self._layer_index.get(layer_name)
        with progress.cv:
            while not progress.finished and (index is None or progress.layers_done <= index):
                progress.cv.wait()

    def _finish_layerwise(self) -> None:
        """Wait for this step's layer-by-layer loads, checksums included (their errors must
        reach vLLM with this step's output)."""
        progress = self._layer_progress
        if progress is None:
            return
        assert progress.future is not None
        progress.future.result()
        self._layer_progress = None

    def _load_layerwise(self, progress: _LayerProgress, jobs: list[tuple[JobId, LoadSpec]]) -> None:
        """Fetch every load of the step, scatter them one layer at a time (the forward pass
        waits in ``wait_for_layer_load`` only for the layer it needs next), then verify."""
        t0 = time.perf_counter()
        fetched: list[tuple[JobId, LoadSpec, Fetched | None, str]] = []
        recorded: set[JobId] = set()
        try:
            for job_id, spec in jobs:
                got, why = self._fetch(spec)
                fetched.append((job_id, spec, got, why))
            copies = [(spec, got.arrays) for _, spec, got, _ in fetched if got and got.keys]
            for layer in range(self.mover.layout.num_layers):
                for spec, arrays in copies:
                    n = len(arrays)
                    self._scatter(spec.block_ids[:n], arrays, layers=(layer, layer + 1))
                with progress.cv:
                    progress.layers_done = layer + 1
                    progress.cv.notify_all()
            for job_id, spec, got, why in fetched:
                n = 0
                if got is not None and got.keys:
                    n = self.store.verify(got)
                    if n < len(got.keys):
                        why = "checksum mismatch"
                self._record_load(job_id, spec, n, why, t0)
                recorded.add(job_id)
        except Exception as e:  # nothing of this step's loads is trusted: recompute it all
            logger.exception("kvray: layer-by-layer load failed")
            for job_id, spec in jobs:
                if job_id not in recorded:
                    self._record_load(job_id, spec, 0, f"{type(e).__name__}: {e}", t0)
        finally:
            with progress.cv:
                progress.finished = True
                progress.cv.notify_all()

    def _load_async(self, job_id: JobId, spec: LoadSpec) -> None:
        try:
            ok = self._load(job_id, spec)
        except Exception:  # never leave a request waiting forever
            logger.exception("kvray: async load of %s failed", spec.req_id)
            ok = False
            with self._lock:
                self._load_errors.update(spec.block_ids)
                self._meta.mark(job_id, ok=False)
        # Errors are published no later than the request's finished_recving (same lock).
        with self._lock:
            if not ok:
                self._failed_recving.add(spec.req_id)
            self._finished_recving.add(spec.req_id)
            self._async_inflight -= 1
            self._load_cv.notify_all()

    def _fetch(self, spec: LoadSpec) -> tuple[Fetched | None, str]:
        """The readable prefix of a load (unverified), or None and why."""
        keys = make_keys(self.prefix, spec.block_hashes)
        try:
            fetched = self.store.fetch(keys, timeout=self.config.get_timeout_s)
        except Exception as e:  # pool or cluster unavailable: recompute everything
            return None, f"{type(e).__name__}: {e}"
        return fetched, fetched.reason

    def _load(self, job_id: JobId, spec: LoadSpec) -> bool:
        t0 = time.perf_counter()
        fetched, why = self._fetch(spec)
        n = 0
        if fetched is not None and fetched.keys:
            n = self._scatter_verified(spec.block_ids[: len(fetched.keys)], fetched)
            if n < len(fetched.keys):
                why = "checksum mismatch"
        return self._record_load(job_id, spec, n, why, t0)

    def _record_load(self, job_id: JobId, spec: LoadSpec, n: int, why: str, t0: float) -> bool:
        """Count a load whose first ``n`` blocks are in place; the rest go to vLLM as errors."""
        bad = spec.block_ids[n:]
        if bad:
            logger.warning(
                "kvray: %d of %d blocks of %s not loaded (%s); vLLM recomputes them",
                len(bad),
                len(spec.block_ids),
                spec.req_id,
                why,
            )
        with self._lock:
            c = self._meta.counters
            c.loaded_blocks += n
            c.loaded_bytes += n * self.block_nbytes
            c.load_seconds += time.perf_counter() - t0
            c.failed_blocks += len(bad)
            if bad:
                self._load_errors.update(bad)
            self._meta.mark(job_id, ok=not bad)
        if n and self.tp_rank == 0:  # one rank counts tokens for the dashboard
            self.store.tally.tokens_loaded += n * self.key_space.block_size
        return not bad

    def _scatter_verified(self, block_ids: list[int], fetched: Fetched) -> int:
        """Scatter ``fetched`` into ``block_ids`` and verify its checksums; returns how many
        leading blocks verified.

        Each block is hashed by the copy thread right after copying it, while its bytes are
        still in the CPU cache: verifying then costs a fraction of reading 64 MiB again (a load
        is memory-bound). A block that fails verification has been written all the same; it
        and every block after it are reported to vLLM, which drops this step's output for the
        request and recomputes (overwrites) them.
        """
        arrays = fetched.arrays
        sums: list[int | None] = [None] * len(arrays)
        on_block: Callable[[int], None] | None = None
        if self.config.verify_checksums:

            def on_block(i: int) -> None:
                sums[i] = checksum(arrays[i])

        self._scatter(block_ids, arrays, on_block)
        return self.store.verify(fetched, sums)

    def _scatter(
        self,
        block_ids: list[int],
        arrays: list[np.ndarray],
        on_block: Callable[[int], None] | None = None,
        layers: tuple[int, int] | None = None,
    ) -> None:
        """Copy fetched blocks into the paged cache, straight from Ray's buffers when it can.

        Blocks of one segment usually lie back to back in the object store: each such run is
        viewed as one ``[k, block_nbytes]`` array and scattered without an intermediate copy.
        Anything else goes through staging rows. ``on_block(i)`` is called once ``arrays[i]``
        has been copied (possibly from a copy thread).
        """
        nb = self.block_nbytes
        i = 0
        while i < len(arrays):
            j = i + 1
            base = arrays[i].ctypes.data
            while (
                j < len(arrays)
                and arrays[j].nbytes == nb
                and arrays[j].ctypes.data == base + (j - i) * nb
            ):
                j += 1
            if arrays[i].nbytes == nb and self.device.type == "cpu":
                run = np.lib.stride_tricks.as_strided(arrays[i], shape=(j - i, nb), strides=(nb, 1))
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)  # read-only: we only read it
                    src = torch.from_numpy(run)
                hook = None
                if on_block is not None:

                    def hook(pos: int, length: int, first: int = i) -> None:
                        for k in range(first + pos, first + pos + length):
                            on_block(k)

                self.mover.scatter(block_ids[i:j], src, on_rows=hook, layers=layers)
            else:
                lease = self._lease(j - i)
                buf = (
                    lease.tensor
                    if lease is not None
                    else torch.empty((j - i, nb), dtype=torch.uint8)
                )
                try:
                    view = buf.numpy()
                    for k in range(i, j):
                        view[k - i] = arrays[k]
                        if on_block is not None:
                            on_block(k)
                    self.mover.scatter(block_ids[i:j], buf, layers=layers)
                finally:
                    if lease is not None:
                        lease.release()
            i = j

    # ---------------------------------------------------------------- saves
    def wait_for_save(self, meta: KVRayConnectorMetadata) -> None:
        self._finish_layerwise()
        for job_id, spec in meta.stores.items():
            self._save(job_id, spec)

    def _save(self, job_id: JobId, spec: StoreSpec) -> None:
        n = len(spec.block_ids)
        if not self.is_writer:
            self._done(job_id, spec, ok=True)
            return
        lease = self._lease(n)
        if lease is None:
            logger.warning("kvray: staging full, dropping a save of %d blocks", n)
            with self._lock:
                self._meta.counters.dropped_blocks += n
            self._done(job_id, spec, ok=False)
            return
        buf = lease.tensor
        try:
            self.mover.gather(spec.block_ids, buf)
        except Exception:
            logger.exception("kvray: gather for a save failed")
            lease.release()
            self._done(job_id, spec, ok=False)
            return
        if spec.finish:
            with self._lock:  # the paged blocks are no longer read: vLLM may free them
                self._finished_sending.add(spec.req_id)
        keys = make_keys(self.prefix, spec.block_hashes)
        rows = buf.numpy()
        try:
            fut = self.store.put(keys, [rows[i] for i in range(n)])
        except Exception:
            logger.exception("kvray: put failed")
            lease.release()
            self._done(job_id, spec, ok=False)
            return
        self._puts[job_id] = fut
        fut.add_done_callback(lambda f: self._put_done(job_id, n, f, lease))

    def _put_done(self, job_id: JobId, n: int, fut: Future[Any], lease: Any) -> None:
        lease.release()  # the staging rows are reusable once Ray owns a copy
        ok = False
        with self._lock:
            self._puts.pop(job_id, None)
            c = self._meta.counters
            try:
                r = fut.result()
                c.stored_blocks += r.stored
                c.duplicate_blocks += r.duplicate
                c.refused_blocks += r.refused
                c.stored_bytes += r.stored * self.block_nbytes
                ok = r.refused == 0
            except Exception as e:
                logger.warning("kvray: a put of %d blocks failed: %s", n, e)
                c.refused_blocks += n
            self._meta.mark(job_id, ok=ok)

    def _done(self, job_id: JobId, spec: StoreSpec, *, ok: bool) -> None:
        with self._lock:
            self._meta.mark(job_id, ok=ok)
            if spec.finish:
                self._finished_sending.add(spec.req_id)

    def handle_preemptions(self, meta: KVRayConnectorMetadata) -> None:
        """Nothing to fence: saves copy blocks out inside ``wait_for_save`` of their step."""

    # ---------------------------------------------------------------- reports
    def get_finished(self) -> tuple[set[ReqId], set[ReqId], set[ReqId]]:
        self._finish_layerwise()
        with self._lock:
            if self._async_inflight > 0 and not self._finished_recving:
                self._load_cv.wait(ASYNC_LOAD_WAIT_S)
            sending, self._finished_sending = self._finished_sending, set()
            recving, self._finished_recving = self._finished_recving, set()
            failed, self._failed_recving = self._failed_recving, set()
        return sending, recving, failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._finish_layerwise()
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def build_connector_worker_meta(self) -> KVRayWorkerMetadata | None:
        self._finish_layerwise()
        with self._lock:
            if self._meta.is_empty():
                return None
            meta, self._meta = self._meta, KVRayWorkerMetadata()
        return meta

    def counters(self) -> TransferCounters:
        return self._meta.counters

    def flush(self, timeout: float = 30.0) -> None:
        """Wait for puts in flight (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        for fut in list(self._puts.values()):
            with contextlib.suppress(Exception):
                fut.result(timeout=max(0.0, deadline - time.monotonic()))

    def shutdown(self) -> None:
        self._finish_layerwise()
        self.flush(timeout=5.0)
        for pool in (self._loader, self._layer_loader):
            if pool is not None:
                pool.shutdown(wait=True)
