"""vLLM's real ``Scheduler`` driven with a scheduler-role kvray connector, plus a worker-role
connector on CPU tensors, in this process (the pattern of vLLM's tests/v1/kv_connector/unit).

A fake "model" writes, for every scheduled token, a value derived from (token id, position)
into its slot of the paged cache, so any block loaded from kvray can be checked byte for byte.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch

from kvray.client import Fetched
from kvray.testing.engines import BLOCK_SIZE, build_tiny_llama, scheduler_vllm_config

pytestmark = [pytest.mark.vllm]

NUM_LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 64
EOS = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_llama(
        tmp_path_factory.mktemp("sched-model"),
        layers=NUM_LAYERS,
        kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
    )


@dataclass
class Harness:
    """A Scheduler with its scheduler-role connector, and one worker-role connector."""

    scheduler: Any
    worker: Any
    kv: dict[str, torch.Tensor]
    ids: Iterator[int] = field(default_factory=lambda: iter(range(1, 10**6)))

    @property
    def sconn(self) -> Any:
        return self.scheduler.connector.scheduler

    def add(self, prompt: list[int], max_tokens: int = 4) -> Any:
        from vllm import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.request import Request

        init_none_hash(sha256)
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        sp.update_from_generation_config({}, EOS)
        req = Request(
            request_id=f"r{next(self.ids)}",
            prompt_token_ids=list(prompt),
            sampling_params=sp,
            pooling_params=None,
            block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
        )
        self.scheduler.add_request(req)
        return req

    def step(self, after_start: Callable[[Any], None] | None = None) -> Any:
        """One engine step: schedule, run the connector's worker hooks around a fake forward
        (``after_start(scheduler_output)`` runs between ``start_load_kv`` and the forward)."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        so = self.scheduler.schedule()
        meta = so.kv_connector_metadata
        w = self.worker
        w.handle_preemptions(meta)
        w.bind_connector_metadata(meta)
        w.start_load_kv(None)
        if after_start is not None:
            after_start(so)
        req_ids = list(so.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for req_id in req_ids:
            req = self.scheduler.requests[req_id]
            n = so.num_scheduled_tokens[req_id]
            end = req.num_computed_tokens  # already advanced by schedule()
            self._forward(req, end - n, end)
            sampled.append([7] if end >= req.num_tokens else [])
        w.wait_for_save()
        res = w.get_transfer_results(so.finished_req_ids)
        out = KVConnectorOutput(
            finished_sending=res.finished_sending or None,
            finished_recving=res.finished_recving or None,
            failed_recving=res.failed_recving,
            invalid_block_ids=w.get_block_ids_with_load_errors(),
            kv_connector_worker_meta=w.build_connector_worker_meta(),
        )
        w.clear_connector_metadata()
        mro = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=out,
        )
        self.scheduler.update_from_output(so, mro)
        return so

    def _forward(self, req: Any, start: int, end: int) -> None:
        blocks = self.scheduler.kv_cache_manager.get_block_ids(req.request_id)[0]
        toks = req.all_token_ids
        for name, t in self.kv.items():
            self.worker.wait_for_layer_load(name)  # as vLLM's attention layers do
            for pos in range(start, end):
                b, slot = blocks[pos // BLOCK_SIZE], pos % BLOCK_SIZE
                t[b, :, slot, :] = expected_value(toks[pos], pos)

    def run(self, timeout: float = 30.0) -> None:
        """Step until nothing is left: requests, delayed frees and connector jobs."""
        deadline = time.monotonic() + timeout
        while self.scheduler.has_requests() or self.sconn.num_pending_jobs():
            left = [(r, q.status) for r, q in self.scheduler.requests.items()]
            assert time.monotonic() < deadline, f"not drained: {left} jobs={self.sconn._jobs}"

            if not self.step().total_num_scheduled_tokens:
                time.sleep(0.005)  # waiting on a background load or put
            self.worker.worker.flush()

    def settle(self) -> None:
        """Saves reported back, the scheduler's view updated, vLLM's own cache emptied."""
        self.run()
        self.sconn.store.sync()
        assert self.scheduler.reset_prefix_cache()

    def block_matches(self, block_id: int, tokens: list[int], first_pos: int) -> bool:
        want = torch.tensor([expected_value(t, first_pos + i) for i, t in enumerate(tokens)]).view(
            1, BLOCK_SIZE, 1
        )
        return all(
            bool((t[block_id] == want.expand(KV_HEADS, BLOCK_SIZE, 2 * HEAD_DIM)).all())
            for t in self.kv.values()
        )


def expected_value(token: int, pos: int) -> float:
    return float(token * 10_000 + pos)


def assert_scheduler_empty(h: Harness) -> None:
    s = h.scheduler
    assert not s.requests and not s.running and len(s.waiting) == 0
    assert not s.finished_recving_kv_req_ids and not s.failed_recving_kv_req_ids
    pool = s.kv_cache_manager.block_pool
    assert pool.free_block_queue.num_free_blocks == pool.num_gpu_blocks - 1
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert h.sconn.num_tracked_requests() == 0
    assert h.sconn.num_pending_jobs() == 0


def make_harness(
    model_dir: str, namespace: str, num_blocks: int = 64, events: bool = False, **extra: Any
) -> Harness:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from kvray.connector import KVRayConnector

    vllm_config = scheduler_vllm_config(model_dir, namespace, events=events, **extra)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                layers,
                FullAttentionSpec(
                    block_size=BLOCK_SIZE,
                    num_kv_heads=KV_HEADS,
                    head_size=HEAD_DIM,
                    dtype=torch.float32,
                ),
            )
        ],
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    scheduler = Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK_SIZE,
        log_stats=True,
    )
    worker = KVRayConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
    # The CPU backend's layout: [num_blocks, kv_heads, block_size, 2 * head_dim], one allocation.
    backing = torch.zeros(NUM_LAYERS, num_blocks, KV_HEADS, BLOCK_SIZE, 2 * HEAD_DIM)
    kv = {name: backing[i] for i, name in enumerate(layers)}
    worker.register_kv_caches(kv)
    return Harness(scheduler=scheduler, worker=worker, kv=kv)


def prompt(n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


@pytest.fixture
def harness_factory(model_dir: str, module_ns: str) -> Iterator[Any]:
    """Harnesses of one test: they share a key space (``cache_salt``) no other test's use, in
    the module's namespace."""
    made: list[Harness] = []
    salt = uuid.uuid4().hex

    def make(**kw: Any) -> Harness:
        h = make_harness(model_dir, module_ns, **{"cache_salt": salt, **kw})
        made.append(h)
        return h

    yield make
    for h in made:
        h.worker.shutdown()
        h.scheduler.connector.shutdown()


@pytest.mark.parametrize("load_mode", ["sync", "layerwise", "async"])
def test_load_lifecycle(harness_factory: Any, load_mode: str) -> None:
    h = harness_factory(load_mode=load_mode)
    p = prompt(3 * BLOCK_SIZE + 4, seed=1)
    h.add(p)
    h.settle()
    assert h.sconn.counters.stored_blocks == 3
    # Scheduler and worker in one process share a store client.
    assert h.sconn.store is h.worker.worker.store

    req = h.add(p)
    so = h.step()
    meta = so.kv_connector_metadata
    (load,) = meta.loads.values()
    assert load.is_async == (load_mode == "async")
    assert len(load.block_ids) == 3
    if load_mode == "async":
        # The request waits for its KV; it is scheduled only after finished_recving.
        assert req.request_id not in so.num_scheduled_tokens
        deadline = time.monotonic() + 20
        while not h.step().num_scheduled_tokens:
            assert time.monotonic() < deadline, "the async load never finished"
            time.sleep(0.01)
    for i, b in enumerate(load.block_ids):
        assert h.block_matches(b, p[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE], i * BLOCK_SIZE)
    assert h.sconn.hit_tokens == 3 * BLOCK_SIZE and req.num_computed_tokens >= 3 * BLOCK_SIZE
    h.run()
    assert h.sconn.counters.loaded_blocks == 3
    assert_scheduler_empty(h)


def test_layerwise_load_runs_ahead_of_the_forward(harness_factory: Any) -> None:
    """``wait_for_layer_load`` returns as soon as its layer is in place, while later layers
    are still being copied; the step's end waits for all of them."""
    h = harness_factory(load_mode="layerwise")
    p = prompt(3 * BLOCK_SIZE + 4, seed=12)
    h.add(p)
    h.settle()
    w = h.worker
    mover = w.worker.handler.mover
    real_scatter = mover.scatter
    gate, at_layer_1 = threading.Event(), threading.Event()

    def gated_scatter(*args: Any, layers: tuple[int, int] | None = None, **kw: Any) -> None:
        if layers == (1, 2):
            at_layer_1.set()
            assert gate.wait(30)
        real_scatter(*args, layers=layers, **kw)

    mover.scatter = gated_scatter
    first, second = list(h.kv)
    want = [expected_value(t, i) for i, t in enumerate(p[:BLOCK_SIZE])]

    def check(so: Any) -> None:
        (load,) = so.kv_connector_metadata.loads.values()
        block = load.block_ids[0]
        w.wait_for_layer_load(first)
        assert at_layer_1.wait(30)
        assert h.kv[first][block, 0, :, 0].tolist() == want, "layer 0 not there after its wait"
        assert h.kv[second][block, 0, :, 0].tolist() != want, "layer 1 written before its turn"
        gate.set()
        w.wait_for_layer_load(second)
        assert h.kv[second][block, 0, :, 0].tolist() == want

    try:
        h.add(p)
        h.step(after_start=check)
    finally:
        gate.set()
        mover.scatter = real_scatter
    assert at_layer_1.is_set()
    h.run()
    assert h.sconn.counters.loaded_blocks == 3 and h.sconn.counters.failed_blocks == 0
    assert_scheduler_empty(h)


def test_every_rank_reports_every_load_job(harness_factory: Any) -> None:
    """A load job completes when every rank reported it: a rank that loaded nothing (or any
    rank but 0) must report too, or the scheduler would track the job forever."""
    from kvray.connector.metadata import KVRayConnectorMetadata, LoadSpec

    h = harness_factory()
    w = h.worker.worker
    spec = LoadSpec(
        req_id="x", block_ids=[3, 4], block_hashes=[b"\x00" * 32, b"\x01" * 32], locs=[1, 0]
    )
    handler = w.handler
    try:
        for rank in (0, 1):
            handler.tp_rank = rank
            w.start_load_kv(KVRayConnectorMetadata(loads={77: spec}))
            meta = w.build_connector_worker_meta()
            assert meta is not None
            assert meta.completed_jobs == {77: 1} and meta.failed_jobs == {77: 1}
            assert w.get_block_ids_with_load_errors() == {3, 4}
    finally:
        handler.tp_rank = 0


def test_the_sides_are_their_protocols_and_submit_starts_only_the_jobs_named(
    harness_factory: Any,
) -> None:
    """The live objects conform to kvray/connector/sides.py; ``submit`` starts the jobs it is
    given by id (the step's other loads stay unstarted) and refuses an id not in the step."""
    from kvray.connector.metadata import KVRayConnectorMetadata, LoadSpec
    from kvray.connector.sides import CacheManager, TransferSide, TransferStore, ViewStore

    h = harness_factory()
    handler = h.worker.worker.handler
    assert isinstance(handler, TransferSide) and isinstance(handler.store, TransferStore)
    assert isinstance(h.sconn.manager, CacheManager) and isinstance(h.sconn.store, ViewStore)

    def spec(b: int) -> LoadSpec:
        return LoadSpec(req_id=f"r{b}", block_ids=[b], block_hashes=[bytes([b]) * 32], locs=[0])

    meta = KVRayConnectorMetadata(loads={5: spec(5), 6: spec(6)})
    handler.submit([6], meta)
    done = h.worker.worker.build_connector_worker_meta()
    assert done is not None and done.completed_jobs == {6: 1} and done.failed_jobs == {6: 1}
    assert handler.load_errors() == {6}
    with pytest.raises(KeyError, match="not in this step"):
        handler.submit([99], meta)


def test_full_prompt_hit_leaves_one_token(harness_factory: Any) -> None:
    h = harness_factory()
    p = prompt(4 * BLOCK_SIZE, seed=2)  # exactly 4 full blocks
    h.add(p)
    h.settle()
    req = h.add(p)
    n, is_async = h.sconn.get_num_new_matched_tokens(req, 0)
    # Every block is loaded, the last one too; vLLM recomputes the last token only.
    assert (n, is_async) == (4 * BLOCK_SIZE - 1, False)
    so = h.step()
    (load,) = so.kv_connector_metadata.loads.values()
    assert load.block_hashes == [bytes(b) for b in req.block_hashes[:4]]
    assert so.num_scheduled_tokens[req.request_id] == 1
    h.run()
    assert_scheduler_empty(h)


def test_preemption_during_save_keeps_stored_bytes(harness_factory: Any) -> None:
    """A request preempted right after the step that saved it: its blocks are reused by
    another request at once, and kvray still holds the first request's bytes."""
    h = harness_factory(num_blocks=12)
    p1, p2 = prompt(5 * BLOCK_SIZE + 1, seed=3), prompt(10 * BLOCK_SIZE, seed=4)
    r1 = h.add(p1, max_tokens=3)
    so = h.step()
    assert any(s.req_id == r1.request_id for s in so.kv_connector_metadata.stores.values())
    # Puts are still in flight; preempt r1 and let r2 take (and overwrite) its blocks.
    assert h.scheduler.reset_prefix_cache(reset_running_requests=True)
    h.add(p2, max_tokens=1)
    h.run()
    assert_scheduler_empty(h)

    import kvray

    store = h.sconn.store
    keys = h.sconn.key_space.block_keys(r1.block_hashes[:5])
    store.sync()  # the saves' index updates reach this view
    got = store.get(keys)
    for i, arr in enumerate(got):
        block = torch.frombuffer(bytearray(arr), dtype=torch.float32).view(
            NUM_LAYERS, KV_HEADS, BLOCK_SIZE, 2 * HEAD_DIM
        )
        want = torch.tensor(
            [expected_value(t, i * BLOCK_SIZE + j) for j, t in enumerate(p1[i * 32 : i * 32 + 32])]
        ).view(1, 1, BLOCK_SIZE, 1)
        assert bool((block == want).all()), f"block {i} of r1 was overwritten in kvray"
    assert isinstance(store, kvray.Store)


def test_abort_during_async_load(harness_factory: Any) -> None:
    h = harness_factory(load_mode="async")
    p = prompt(4 * BLOCK_SIZE + 3, seed=5)
    h.add(p)
    h.settle()
    gate = threading.Event()
    store = h.worker.worker.store
    real_fetch = store.fetch_from

    def slow_fetch(*args: Any, **kw: Any) -> Any:
        gate.wait(30)
        return real_fetch(*args, **kw)

    store.fetch_from = slow_fetch
    try:
        from vllm.v1.request import RequestStatus

        req = h.add(p)
        h.step()
        assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        h.scheduler.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
        h.step()
        # The blocks stay allocated while the load may still write them.
        assert req.request_id in h.scheduler.requests
        gate.set()
        h.run()
    finally:
        store.fetch_from = real_fetch
        gate.set()
    assert_scheduler_empty(h)


@pytest.mark.parametrize("load_mode", ["sync", "layerwise", "async"])
def test_load_failure_recomputes(harness_factory: Any, load_mode: str) -> None:
    h = harness_factory(load_mode=load_mode)
    p = prompt(4 * BLOCK_SIZE + 3, seed=6)
    h.add(p)
    h.settle()
    store = h.worker.worker.store
    real_fetch = store.fetch_from

    def lossy_fetch(*args: Any, **kw: Any) -> Fetched:
        real = real_fetch(*args, **kw)
        return Fetched(real.keys[:1], "evicted", real.reads[:1], real.shard, real.pools)

    store.fetch_from = lossy_fetch
    try:
        req = h.add(p, max_tokens=2)
        h.run()
    finally:
        store.fetch_from = real_fetch
    assert req.is_finished()
    assert h.sconn.counters.failed_blocks == 3
    # async: vLLM frees the request's blocks and looks up again: block 0 may load twice.
    assert h.sconn.counters.loaded_blocks >= 1
    assert_scheduler_empty(h)
    # The recomputed blocks hold the right values (the fake model wrote them again).
    blocks = [b for b in range(1, 64) if h.block_matches(b, p[32:64], 32)]
    assert blocks, "block 1 was not recomputed"


def test_decode_blocks_stored_at_finish_and_events(harness_factory: Any) -> None:
    """Blocks filled by decoding are stored too (the last one after the request finished,
    with its blocks kept until every rank reported the save), and announced as KV events
    once the change feed shows them; their removal from kvray is announced from the feed."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    h = harness_factory(events=True)
    p = prompt(2 * BLOCK_SIZE - 2, seed=7)
    req = h.add(p, max_tokens=4)  # 62 + 4 tokens: block 1 fills while decoding
    events: list[Any] = []
    real_take = h.scheduler.connector.take_events

    def recording_take() -> list[Any]:
        taken = list(real_take())
        events.extend(taken)
        return taken

    h.scheduler.connector.take_events = recording_take
    h.run()
    assert_scheduler_empty(h)
    h.sconn.store.sync()
    recording_take()
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    stored = [e for e in events if isinstance(e, BlockStored)]
    hashes = [bytes(x) for x in req.block_hashes]
    external = [maybe_convert_block_hash(h) for h in hashes]  # type: ignore[arg-type]
    assert [b for e in stored for b in e.block_hashes] == external[:2]
    assert all(e.medium == "CPU" and e.block_size == BLOCK_SIZE for e in stored)
    assert h.sconn._find_hit(hashes)[0] == 2
    # The pool drops block 1 (as after a checksum failure): the feed carries the removal.
    import ray

    from kvray.meta.messages import RAY_NAMESPACE, pool_name

    key = h.sconn.key_space.block_keys(hashes[1:2])
    me = ray.get_runtime_context().get_node_id()
    pool = ray.get_actor(pool_name(h.sconn.config.namespace, me), namespace=RAY_NAMESPACE)
    assert ray.get(pool.report_lost.remote(key, h.sconn.key_space.block_ids(hashes[1:2]), 0)) == 1
    h.sconn.store.sync()
    recording_take()
    removed = [b for e in events if isinstance(e, BlockRemoved) for b in e.block_hashes]
    assert removed == external[1:2]
    assert h.sconn.manager.sizes()["announced"] == 1


@pytest.mark.parametrize(("batch", "jobs"), [(1, [1, 1, 1, 1, 1]), (3, [1, 3, 1])])
def test_decode_blocks_stored_in_batches(harness_factory: Any, batch: int, jobs: list[int]) -> None:
    """Prompt blocks are stored as they fill; blocks filled while decoding wait until
    ``decode_store_blocks`` of them are full (each put costs the same fixed CPU whatever its
    size), the rest at finish. Every full block ends up stored either way."""
    h = harness_factory(decode_store_blocks=batch)
    planned: list[int] = []
    real_bind = h.worker.bind_connector_metadata

    def recording_bind(meta: Any) -> None:
        planned.extend(len(spec.block_ids) for spec in meta.stores.values())
        real_bind(meta)

    h.worker.bind_connector_metadata = recording_bind
    p = prompt(BLOCK_SIZE + 5, seed=11)
    req = h.add(p, max_tokens=4 * BLOCK_SIZE)  # 1 prompt block, 4 more filled decoding
    h.run()
    assert_scheduler_empty(h)
    assert planned == jobs
    h.sconn.store.sync()
    hashes = [bytes(x) for x in req.block_hashes]
    assert len(hashes) == 5
    assert h.sconn._find_hit(hashes)[0] == 5
    assert h.sconn.counters.stored_blocks == 5


def test_no_kv_events_unless_configured(harness_factory: Any) -> None:
    h = harness_factory()
    h.add(prompt(2 * BLOCK_SIZE + 1, seed=8))
    h.run()
    assert h.sconn.counters.stored_blocks == 2
    assert list(h.scheduler.connector.take_events()) == []
    assert h.sconn.manager.view.listener is None


def test_bad_extra_config_is_one_clear_error(model_dir: str, module_ns: str) -> None:
    from kvray.config import ConfigError

    with pytest.raises(ConfigError, match="load_mode"):
        make_harness(model_dir, module_ns, load_mode="eager")
    with pytest.raises(ConfigError, match="unknown key"):
        make_harness(model_dir, module_ns, nmespace_typo="x")


def test_unreachable_cluster_fails_fast(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    from kvray.config import KVRayConfig
    from kvray.connector import attach as cluster
    from kvray.errors import StoreUnavailableError

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailableError, match="no Ray cluster answers at"):
        cluster.join_cluster(KVRayConfig(address="127.0.0.1:1"))
    assert time.monotonic() - t0 < 10


def test_no_cluster_configured_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    from kvray.config import KVRayConfig
    from kvray.connector import attach as cluster
    from kvray.errors import StoreUnavailableError

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(StoreUnavailableError, match="RAY_ADDRESS"):
        cluster.join_cluster(KVRayConfig())
