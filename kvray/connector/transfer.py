"""The worker side's one transfer handler (in the style of vLLM's ``OffloadingHandler``).

Jobs come from the scheduler by id; every load and every store goes through one path and one
error path whatever the load mode:

- a **load** fetches its blocks from the pools the metadata names (bounded by
  ``load_timeout_s``): the stored shards holding this rank's heads, in the grouping the load
  names (one shard at the same TP size; a window of one shard, or pieces of several, when an
  engine of another TP size stored them), scatters them into the paged cache (each block hashed
  by its copy thread right after copying it, while its bytes are in the CPU cache), verifies
  the checksums and records the result. ``sync`` runs it in the caller (``start_load_kv``),
  ``async`` on a loader thread, ``layerwise`` on a thread one layer at a time while the forward
  pass runs. Any failure, an exception included, records the job's blocks from the first bad one
  on as load errors: vLLM recomputes them; a load never crashes the engine and never waits past
  its deadline.
- a **store** gathers blocks into staging rows (in pieces that fit the staging pool; while its
  rows are held by puts in flight, into a buffer of the piece's own) and hands them to
  ``put_shard``, which copies them into Ray in the background (bytes in flight bounded by
  ``max_inflight_put_bytes``): :mod:`kvray.connector.saves`.

Completions are reported as ``{job_id: 1}`` per rank in :class:`KVRayWorkerMetadata`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace

import torch

from kvray.blocks import checksum
from kvray.config import KVRayConfig
from kvray.connector.keyspace import EngineKeySpace
from kvray.connector.loads import LoadJob
from kvray.connector.metadata import (
    JobId,
    KVRayConnectorMetadata,
    KVRayWorkerMetadata,
    LoadSpec,
    ReqId,
    TransferCounters,
)
from kvray.connector.paged import Mover, PagedCopier
from kvray.connector.saves import Outbox, StorePath
from kvray.connector.sides import TransferStore
from kvray.kernels import StagingPool
from kvray.kernels.heads import head_parts

logger = logging.getLogger(__name__)

#: While async loads are in flight and none has finished, ``get_finished`` (once per engine
#: step) waits up to this long for one: waiting on a condition releases the GIL to the loader
#: (an idle engine loop spinning through empty steps starved it: loads took 5-20x longer).
ASYNC_LOAD_WAIT_S = 0.005


class _Layers:
    """How far a step's layer-by-layer loads are (the forward pass waits on ``cv``)."""

    def __init__(self, deadline: float) -> None:
        self.cv = threading.Condition()
        self.layers_done = 0
        self.finished = False
        self.cancelled = False
        self.deadline = deadline
        self.future: Future[None] | None = None


class TransferHandler:
    """Executes one TP rank's load and store jobs and reports them."""

    def __init__(
        self,
        config: KVRayConfig,
        key_space: EngineKeySpace,
        store: TransferStore,
        mover: Mover,
        staging: StagingPool,
        *,
        tp_rank: int,
        device: torch.device,
        layerwise: bool,
        layer_index: dict[str, int],
    ) -> None:
        self.config = config
        self.key_space = key_space
        self.store = store
        self.mover = mover
        self.staging = staging
        self.copier = PagedCopier(
            mover,
            staging,
            key_space.block_nbytes,
            device,
            num_layers=key_space.num_layers,
            heads=key_space.heads_per_rank,
        )
        self.tp_rank = tp_rank
        self.shard = key_space.shard_of(tp_rank)
        #: Grouping -> the stored shards (and head ranges) holding this rank's heads.
        self._parts = {
            g: head_parts(key_space.total_heads, key_space.heads_of(tp_rank), g)
            for g in key_space.groupings
        }
        self.is_writer = key_space.writes(tp_rank)
        self.block_nbytes = key_space.block_nbytes
        self.device = device
        self.layerwise = layerwise
        self.layer_index = layer_index
        #: What this rank reports; its lock also guards the handler's own sets below.
        self.outbox = Outbox()
        self.stores = StorePath(
            key_space,
            store,
            mover,
            self.copier,
            staging,
            shard=self.shard,
            is_writer=self.is_writer,
            outbox=self.outbox,
        )
        self._lock = self.outbox.lock
        self._load_cv = threading.Condition(self._lock)  # an async load finished
        self._async_inflight = 0
        self._finished_recving: set[ReqId] = set()
        self._failed_recving: set[ReqId] = set()
        self._load_errors: set[int] = set()
        self._loader: ThreadPoolExecutor | None = None
        self._layers: _Layers | None = None

    # ---------------------------------------------------------------- jobs
    def submit(self, job_ids: Iterable[JobId], meta: KVRayConnectorMetadata) -> None:
        """Start jobs of this step by id, each a load or a store of ``meta``: one entry for
        every job and every load mode. Loads start as the mode says (``sync``: run here,
        ``async``: on the loader thread, ``layerwise``: together on the loader, a layer at a
        time); stores are gathered now and put in the background."""
        self.finish_layers()  # defensive: the previous step's loads are complete
        ids = list(job_ids)
        unknown = [j for j in ids if j not in meta.loads and j not in meta.stores]
        if unknown:
            raise KeyError(f"kvray: jobs {unknown} are not in this step's metadata")
        loads = [j for j in ids if j in meta.loads]
        if loads:
            if len(loads) < len(meta.loads):
                meta = replace(meta, loads={j: meta.loads[j] for j in loads})
            self.submit_loads(meta)
        for j in ids:
            spec = meta.stores.get(j)
            if spec is not None:
                self.stores.submit(j, spec)

    def wait(self, layer_name: str | None = None) -> None:
        """Until this step's loads have filled ``layer_name`` (None: every layer, checksums
        included); bounded by the load deadline."""
        if layer_name is None:
            self.finish_layers()
        else:
            self.wait_for_layer(layer_name)

    # ---------------------------------------------------------------- loads
    def submit_loads(self, meta: KVRayConnectorMetadata) -> None:
        """Start (sync: run) the step's loads."""
        self.finish_layers()  # defensive: the previous step's loads are complete
        deadline = time.monotonic() + self.load_bound_s(
            s for s in meta.loads.values() if not s.is_async
        )
        layered: list[LoadJob] = []
        for job_id, spec in meta.loads.items():
            job = LoadJob.plan(self.key_space, self._parts, job_id, spec)
            if spec.is_async:
                self._submit_async(job)
            elif self.layerwise:
                layered.append(job)
            else:
                self._run(job, deadline)
        if layered:
            self._layers = _Layers(deadline)
            self._layers.future = self._executor().submit(self._run_layers, self._layers, layered)

    def load_bound_s(self, specs: Iterable[LoadSpec]) -> float:
        """How long loads of ``specs`` may take: ``load_timeout_s`` plus their bytes (this
        rank's) at ``load_bytes_per_s``."""
        nbytes = sum(len(s.block_hashes) for s in specs) * self.block_nbytes
        return self.config.load_timeout_s + nbytes / self.config.load_bytes_per_s

    def _executor(self) -> ThreadPoolExecutor:
        if self._loader is None:
            self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvray-load")
        return self._loader

    def _submit_async(self, job: LoadJob) -> None:
        with self._lock:
            self._async_inflight += 1
        try:
            self._executor().submit(self._run_async, job)
        except Exception as e:
            with self._lock:
                self._async_inflight -= 1
            self._record(job, f"could not start the load: {type(e).__name__}")
            with self._lock:
                self._failed_recving.add(job.spec.req_id)
                self._finished_recving.add(job.spec.req_id)

    def _run_async(self, job: LoadJob) -> None:
        wait = max(self.load_bound_s([job.spec]), job.spec.wait_s)  # a handoff waits for puts
        ok = self._run(job, time.monotonic() + wait)
        with self._lock:  # errors are published no later than the request's finished_recving
            if not ok:
                self._failed_recving.add(job.spec.req_id)
            self._finished_recving.add(job.spec.req_id)
            self._async_inflight -= 1
            self._load_cv.notify_all()

    def _run(self, job: LoadJob, deadline: float) -> bool:
        """Fetch, scatter (hashing as it copies), verify, record: the one load path."""
        try:
            self._fetch(job, deadline)
            n = job.readable
            if n:
                sources = job.sources()
                sums: list[list[int | None]] = [[None] * n for _ in sources]
                hook: Callable[[int], None] | None = None
                if self.config.verify_checksums:

                    def hook(i: int) -> None:
                        for p, (arrays, _) in enumerate(sources):
                            sums[p][i] = checksum(arrays[i])

                self.copier.scatter(job.spec.block_ids[:n], sources, hook)
                self._verify(job, sums)
        except Exception as e:  # nothing of this load is trusted: recompute it all
            logger.exception("kvray: load of %s failed", job.spec.req_id)
            job.done, job.why = 0, f"{type(e).__name__}: {e}"
        return self._record(job)

    def _fetch(self, job: LoadJob, deadline: float) -> None:
        job.fetch(self.store, deadline)

    def _verify(self, job: LoadJob, sums: list[list[int | None]] | None) -> None:
        job.verify(self.store, sums)

    def _run_layers(self, progress: _Layers, jobs: list[LoadJob]) -> None:
        """Fetch every load of the step, scatter them one layer at a time (the forward pass
        waits in ``wait_for_layer`` only for the layer it needs next), verify, record."""
        recorded: set[JobId] = set()
        try:
            for job in jobs:
                self._fetch(job, progress.deadline)
            copies = [(j.spec.block_ids[: j.readable], j.sources()) for j in jobs if j.readable]
            for layer in range(self.mover.layout.num_layers):
                if progress.cancelled:
                    raise TimeoutError("the forward pass stopped waiting for this load")
                for block_ids, sources in copies:
                    self.copier.scatter(block_ids, sources, layers=(layer, layer + 1))
                with progress.cv:
                    progress.layers_done = layer + 1
                    progress.cv.notify_all()
            for job in jobs:
                if job.readable:
                    self._verify(job, None)
                self._record(job)
                recorded.add(job.job_id)
        except Exception as e:  # nothing of this step's loads is trusted: recompute it all
            if not isinstance(e, TimeoutError):
                logger.exception("kvray: layer-by-layer load failed")
            for job in jobs:
                if job.job_id not in recorded:
                    job.done, job.why = 0, f"{type(e).__name__}: {e}"
                    self._record(job)
        finally:
            with progress.cv:
                progress.finished = True
                progress.cv.notify_all()

    def wait_for_layer(self, layer_name: str) -> None:
        """Block until this step's layer-by-layer loads have filled ``layer_name``, or until
        the load deadline: then the loads are cancelled (their blocks reported failed)."""
        progress = self._layers
        if progress is None:
            return
        index = self.layer_index.get(layer_name)
        with progress.cv:
            while not progress.finished and (index is None or progress.layers_done <= index):
                left = progress.deadline - time.monotonic()
                if left <= 0:
                    progress.cancelled = True
                    logger.warning("kvray: a layer-by-layer load missed its deadline")
                    return
                progress.cv.wait(left)

    def finish_layers(self) -> None:
        """Wait for this step's layer-by-layer loads, checksums included (their errors must
        reach vLLM with this step's output). Bounded: a cancelled load stops at the next
        layer, and a load past its deadline is cancelled here."""
        progress = self._layers
        if progress is None:
            return
        assert progress.future is not None
        with progress.cv:
            while not progress.finished:
                if time.monotonic() >= progress.deadline:
                    progress.cancelled = True
                progress.cv.wait(0.05)
        progress.future.result()
        self._layers = None

    def _record(self, job: LoadJob, why: str | None = None) -> bool:
        """Count a load whose first ``job.done`` blocks are in place; the rest are errors."""
        spec = job.spec
        bad = spec.block_ids[job.done :]
        if bad:
            logger.warning(
                "kvray: %d of %d blocks of %s not loaded (%s); vLLM recomputes them",
                len(bad),
                len(spec.block_ids),
                spec.req_id,
                why or job.why or "not found",
            )
        with self._lock:
            c = self.outbox.meta.counters
            c.loaded_blocks += job.done
            c.loaded_bytes += job.done * self.block_nbytes
            c.load_seconds += time.perf_counter() - job.t0
            c.failed_blocks += len(bad)
            self._load_errors.update(bad)
            self.outbox.meta.mark(job.job_id, ok=not bad)
        if job.done and self.tp_rank == 0:  # one rank counts tokens for the dashboard
            self.store.count(tokens_loaded=job.done * self.key_space.block_size)
        return not bad

    # ---------------------------------------------------------------- reports
    def get_finished(self) -> tuple[set[ReqId], set[ReqId], set[ReqId]]:
        self.finish_layers()
        with self._lock:
            if self._async_inflight > 0 and not self._finished_recving:
                self._load_cv.wait(ASYNC_LOAD_WAIT_S)
            sending, self.outbox.finished_sending = self.outbox.finished_sending, set()
            recving, self._finished_recving = self._finished_recving, set()
            failed, self._failed_recving = self._failed_recving, set()
        return sending, recving, failed

    def load_errors(self) -> set[int]:
        self.finish_layers()
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def take_meta(self) -> KVRayWorkerMetadata | None:
        self.finish_layers()
        with self._lock:
            if self.outbox.meta.is_empty():
                return None
            meta, self.outbox.meta = self.outbox.meta, KVRayWorkerMetadata()
        return meta

    def counters(self) -> TransferCounters:
        return self.outbox.meta.counters

    def flush(self, timeout: float = 30.0) -> None:
        """Wait for puts in flight (tests, shutdown)."""
        self.stores.puts.flush(timeout)

    def shutdown(self) -> None:
        self.finish_layers()
        self.flush(timeout=5.0)
        if self._loader is not None:
            self._loader.shutdown(wait=True)
