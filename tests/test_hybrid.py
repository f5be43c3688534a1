"""Hybrid models: kvray as a hybrid-allocator (``SupportsHMA``) connector.

vLLM's real ``Scheduler`` and ``KVCacheManager`` with a two-group ``KVCacheConfig`` (full
attention + sliding window, the layers of both groups sharing their paged tensors as vLLM lays
them out), kvray's scheduler and worker sides on CPU tensors, real Ray. A fake "model" writes,
for every computed token, a value derived from (token, position, layer) into its slot in every
layer of every group, so every loaded block is checked against what was stored, group by group.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pytest

pytest.importorskip("vllm")

import torch

from kvray.testing.engines import BLOCK_SIZE, build_tiny_llama, scheduler_vllm_config

pytestmark = [pytest.mark.vllm]

KV_HEADS, HEAD_DIM = 2, 32
#: Layers 0, 2 full attention (group 0); 1, 3 sliding window (group 1). vLLM's hybrid layout:
#: one tensor per pair of layers, shared by one layer of each group.
FULL_LAYERS = ["model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn"]
SWA_LAYERS = ["model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn"]
LAYER_INDEX = {n: int(n.split(".")[2]) for n in FULL_LAYERS + SWA_LAYERS}
WINDOW = 80  # tokens: a hit needs the last cdiv(80, 32) = 3 blocks of the window group
WINDOW_BLOCKS = -(-WINDOW // BLOCK_SIZE)
EOS = 2


def expected_value(token: int, pos: int, layer: int) -> float:
    return float(token * 2048 + pos) + layer / 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_llama(
        tmp_path_factory.mktemp("hybrid-model"), layers=4, kv_heads=KV_HEADS, head_dim=HEAD_DIM
    )


@dataclass
class Hybrid:
    """One engine: a Scheduler with its scheduler-role connector, one worker-role connector,
    and a record of every load and store its metadata named."""

    scheduler: Any
    worker: Any
    kv: dict[str, torch.Tensor]
    loads: list[Any] = field(default_factory=list)
    stores: list[Any] = field(default_factory=list)
    checked_blocks: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    async_loads: list[Any] = field(default_factory=list)

    @property
    def sconn(self) -> Any:
        return self.scheduler.connector.scheduler

    def add(
        self,
        req_id: str,
        prompt: list[int],
        max_tokens: int = 3,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> Any:
        from vllm import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.request import Request

        init_none_hash(sha256)
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        if kv_transfer_params is not None:  # as vLLM's OpenAI server passes them
            sp.extra_args = {"kv_transfer_params": kv_transfer_params}
        sp.update_from_generation_config({}, EOS)
        req = Request(
            request_id=req_id,
            prompt_token_ids=list(prompt),
            sampling_params=sp,
            pooling_params=None,
            block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
        )
        self.scheduler.add_request(req)
        return req

    def step(self, after_start: Callable[[Any], None] | None = None) -> Any:
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        so = self.scheduler.schedule()
        meta = so.kv_connector_metadata
        self.loads.extend(meta.loads.values())
        self.stores.extend(meta.stores.values())
        w = self.worker
        w.handle_preemptions(meta)
        w.bind_connector_metadata(meta)
        w.start_load_kv(None)
        self._check_loads([s for s in meta.loads.values() if not s.is_async])  # in place now
        self.async_loads.extend(s for s in meta.loads.values() if s.is_async)
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
        done = set(res.finished_recving) - set(res.failed_recving)
        self._check_loads([s for s in self.async_loads if s.req_id in done])
        self.async_loads = [s for s in self.async_loads if s.req_id not in done]
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

    def first_scheduled(self, req_id: str, steps: int = 50) -> int:
        """Step until ``req_id`` is first scheduled (a hybrid model's loads are async: its
        first steps wait for them); the tokens scheduled then."""
        for _ in range(steps):
            n = self.step().num_scheduled_tokens.get(req_id, 0)
            if n:
                return n
            time.sleep(0.005)
        raise AssertionError(f"{req_id} was not scheduled in {steps} steps")

    def _forward(self, req: Any, start: int, end: int) -> None:
        groups = self.scheduler.kv_cache_manager.get_block_ids(req.request_id)
        toks = req.all_token_ids
        for layers, blocks in ((FULL_LAYERS, groups[0]), (SWA_LAYERS, groups[1])):
            for name in layers:
                self.worker.wait_for_layer_load(name)
                t = self.kv[name]
                for pos in range(start, end):
                    b = blocks[pos // BLOCK_SIZE]
                    assert b != 0, "a computed token's block is never vLLM's null block"
                    t[b, :, pos % BLOCK_SIZE, :] = expected_value(toks[pos], pos, LAYER_INDEX[name])

    def _check_loads(self, specs: list[Any]) -> None:
        """Every block a load filled holds, in every layer of its group, the values the engine
        that stored it computed for those tokens at those positions."""
        for spec in specs:
            req = self.scheduler.requests[spec.req_id]
            index = {bytes(h): i for i, h in enumerate(req.block_hashes)}
            layers = FULL_LAYERS if spec.group == 0 else SWA_LAYERS
            for block_id, h in zip(spec.block_ids, spec.block_hashes, strict=True):
                i = index[bytes(h)]
                toks = req.all_token_ids[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]
                for name in layers:
                    want = torch.tensor(
                        [
                            expected_value(t, i * BLOCK_SIZE + k, LAYER_INDEX[name])
                            for k, t in enumerate(toks)
                        ]
                    ).view(1, BLOCK_SIZE, 1)
                    got = self.kv[name][block_id]
                    assert torch.equal(got, want.expand_as(got)), (spec.group, i, name)
                self.checked_blocks[spec.group] += 1

    def run(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while self.scheduler.has_requests() or self.sconn.num_pending_jobs():
            assert time.monotonic() < deadline, f"not drained: {self.sconn._jobs}"
            if not self.step().total_num_scheduled_tokens:
                time.sleep(0.005)
            self.worker.worker.flush()
        self.sconn.store.sync()

    def stored(self, req_id: str, group: int) -> list[bytes]:
        return [
            h
            for s in self.stores
            if s.req_id == req_id and s.group == group
            for h in s.block_hashes
        ]

    def loaded(self, req_id: str, group: int) -> list[bytes]:
        return [
            h for s in self.loads if s.req_id == req_id and s.group == group for h in s.block_hashes
        ]


H = TypeVar("H", bound=Hybrid)


def hybrid_config(model_dir: str, namespace: str, **extra: Any) -> tuple[Any, Any]:
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    vllm_config = scheduler_vllm_config(model_dir, namespace, max_num_batched_tokens=1024, **extra)
    spec = {
        "block_size": BLOCK_SIZE,
        "num_kv_heads": KV_HEADS,
        "head_size": HEAD_DIM,
        "dtype": torch.float32,
    }
    kv_cache_config = KVCacheConfig(
        num_blocks=96,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(FULL_LAYERS, FullAttentionSpec(**spec)),
            KVCacheGroupSpec(SWA_LAYERS, SlidingWindowSpec(sliding_window=WINDOW, **spec)),
        ],
    )
    vllm_config.cache_config.num_gpu_blocks = 96
    return vllm_config, kv_cache_config


def start_engine(
    cls: type[H], vllm_config: Any, kv_cache_config: Any, kv: dict[str, torch.Tensor]
) -> H:
    """vLLM's Scheduler with its scheduler-role connector, and a worker-role connector
    registered on ``kv``, as an engine of class ``cls``."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    from kvray.connector import KVRayConnector

    scheduler = Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK_SIZE,
        log_stats=True,
    )
    worker = KVRayConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
    worker.register_kv_caches(kv)
    return cls(scheduler=scheduler, worker=worker, kv=kv)


def make_engine(model_dir: str, namespace: str, **extra: Any) -> Hybrid:
    vllm_config, kv_cache_config = hybrid_config(model_dir, namespace, **extra)
    # vLLM's hybrid layout: one tensor per layer pair, shared by a layer of each group.
    backing = torch.zeros(2, 96, KV_HEADS, BLOCK_SIZE, 2 * HEAD_DIM)
    kv = {
        FULL_LAYERS[0]: backing[0],
        SWA_LAYERS[0]: backing[0],
        FULL_LAYERS[1]: backing[1],
        SWA_LAYERS[1]: backing[1],
    }
    e = start_engine(Hybrid, vllm_config, kv_cache_config, kv)
    assert not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
    assert len(e.scheduler.kv_cache_manager.kv_cache_config.kv_cache_groups) == 2
    return e


def block_hashes(tokens: list[int]) -> list[bytes]:
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    sp = SamplingParams(max_tokens=1)
    sp.update_from_generation_config({}, EOS)
    req = Request(
        "hashes", tokens, sp, None, block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256)
    )
    return [bytes(h) for h in req.block_hashes]


def prompt(n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(n)]


def engine_factory(
    make_engine: Callable[..., H], model_dir: str, namespace: str
) -> Iterator[Callable[..., H]]:
    """The body of an ``engines`` fixture: engines of one test share a key space
    (``cache_salt``) no other test's use, in the module's namespace; all are shut down after."""
    made: list[H] = []
    salt = uuid.uuid4().hex

    def make(**extra: Any) -> H:
        e = make_engine(model_dir, namespace, **{"cache_salt": salt, **extra})
        made.append(e)
        return e

    yield make
    for e in made:
        e.worker.shutdown()
        e.scheduler.connector.shutdown()


@contextlib.contextmanager
def losing(engine: Hybrid, group: int, keep: int) -> Iterator[None]:
    """Loads of ``group`` on ``engine`` read only their first ``keep`` blocks, as if the rest
    vanished between the lookup and the load (evicted, a dead pool)."""
    from kvray.blocks import Fetched

    prefix = engine.scheduler.connector.groups[group].key_space.prefix
    store = engine.worker.worker.handler.handlers[group].store
    real_fetch = store.fetch_from

    def lossy_fetch(keys: Any, *args: Any, **kw: Any) -> Fetched:
        real = real_fetch(keys, *args, **kw)
        if keys and bytes(keys[0]).startswith(prefix):
            return Fetched(real.keys[:keep], "evicted", real.reads[:keep], real.shard, real.pools)
        return real

    store.fetch_from = lossy_fetch
    try:
        yield
    finally:
        store.fetch_from = real_fetch


@pytest.fixture
def engines(model_dir: str, module_ns: str) -> Iterator[Callable[..., Hybrid]]:
    yield from engine_factory(make_engine, model_dir, module_ns)


def test_hybrid_is_a_supports_hma_connector_with_a_key_space_per_group(engines: Any) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma

    from kvray.connector import KVRayConnector

    assert supports_hma(KVRayConnector)
    e = engines()
    groups = e.scheduler.connector.groups
    assert [g.kind for g in groups] == ["full_attention", "sliding_window"]
    assert groups[1].window == WINDOW
    assert groups[0].key_space.prefix != groups[1].key_space.prefix
    assert e.scheduler.connector.key_space is groups[0].key_space  # it decides hits


def test_a_second_engine_loads_every_group_of_the_shared_prefix(engines: Any) -> None:
    a, b = engines(), engines()
    p = prompt(10 * BLOCK_SIZE + 5, seed=1)  # 10 full blocks
    a.add("a1", p)
    a.run()
    # Full attention stores every full block; the window group only the blocks a hit needs.
    assert len(a.stored("a1", 0)) == 10
    swa = a.stored("a1", 1)
    assert len(swa) == WINDOW_BLOCKS == 3
    assert swa == block_hashes(p)[7:10]

    b.add("b1", p)
    assert b.first_scheduled("b1") == 5  # a 10-block hit: vLLM computes only the last 5 tokens
    b.run()
    assert b.sconn.hit_tokens == 10 * BLOCK_SIZE
    assert len(b.loaded("b1", 0)) == 10
    assert b.loaded("b1", 1) == swa  # exactly the window's blocks, nothing else
    assert b.checked_blocks == {0: 10, 1: 3}
    c = b.worker.worker.counters()
    assert c.failed_blocks == 0


@pytest.mark.parametrize("load_mode", ["sync", "layerwise"])
def test_a_hybrid_engine_loads_async_whatever_load_mode_asks(engines: Any, load_mode: str) -> None:
    """vLLM takes a failed load of a model with several KV cache groups only as a failed async
    load (by request; block ids are only unique within a group): a hybrid engine's loads are
    async, so that a lost block is always recomputed."""
    e = engines(load_mode=load_mode)
    for conn in (e.scheduler.connector, e.worker):
        assert conn.config.load_mode == "async"
    assert e.worker.get_block_ids_with_load_errors() == set()


def test_num_computed_tokens_after_a_hybrid_hit(engines: Any) -> None:
    a, b = engines(), engines()
    p = prompt(6 * BLOCK_SIZE, seed=2)  # fills its last block: the hit leaves one token
    a.add("a1", p)
    a.run()
    b.add("b1", p, max_tokens=2)
    assert b.first_scheduled("b1") == 1
    assert b.scheduler.requests["b1"].num_computed_tokens == 6 * BLOCK_SIZE
    b.run()
    assert b.checked_blocks[0] == 6 and b.checked_blocks[1] == WINDOW_BLOCKS


def test_a_shared_prefix_is_anchored_where_requests_diverge(engines: Any) -> None:
    """A prefix shared by requests with different suffixes: the first engine stored its
    window before its own prompt's end only, so the second finds the full-attention prefix
    but no window before it (no hit), and stores the window where it diverged; a third engine
    then hits the whole shared prefix, in every group."""
    a, b, c = engines(), engines(), engines()
    shared = prompt(6 * BLOCK_SIZE, seed=3)
    a.add("a1", shared + prompt(3 * BLOCK_SIZE + 7, seed=4))
    a.run()
    b.add("b1", shared + prompt(2 * BLOCK_SIZE + 3, seed=5))
    b.run()
    assert b.sconn.hit_tokens == 0 and not b.loads
    # b1 stored its prompt's window and the window before the divergence point (block 6).
    assert len(b.stored("b1", 1)) <= 2 * WINDOW_BLOCKS
    c.add("c1", shared + prompt(4 * BLOCK_SIZE + 1, seed=6))
    assert c.first_scheduled("c1") == 4 * BLOCK_SIZE + 1
    assert c.sconn.hit_tokens == 6 * BLOCK_SIZE
    c.run()
    assert c.checked_blocks == {0: 6, 1: WINDOW_BLOCKS}


def test_a_handoff_to_a_hybrid_engine_is_refused_counted_and_looked_up_as_usual(
    engines: Any,
) -> None:
    """Hybrid engines take no P/D handoffs yet: a decode request carrying a prefill's handoff
    is counted as rejected (and logged), never half-loaded from it; its prefix is looked up
    like any other request's, so what kvray holds still loads, in every group."""
    from kvray.connector.handoff import HANDOFF_KEY

    a, b = engines(), engines()
    p = prompt(4 * BLOCK_SIZE + 5, seed=30)
    a.add("a1", p)
    a.run()
    b.add("b1", p, kv_transfer_params={HANDOFF_KEY: {"v": 1, "n": 4}})
    b.run()
    handoffs = b.sconn.handoffs
    assert (handoffs.rejected, handoffs.received) == (1, 0)
    assert b.sconn.hit_tokens == 4 * BLOCK_SIZE
    assert b.checked_blocks == {0: 4, 1: WINDOW_BLOCKS}
    b.add("b2", prompt(2 * BLOCK_SIZE, seed=31), kv_transfer_params={"other": 1})
    b.run()
    assert handoffs.rejected == 1  # params without a kvray handoff are not one


def test_window_group_stores_at_most_its_window_per_request(engines: Any) -> None:
    """Per request, the window group stores the window before its prompt's end and before
    its end (one window when the request ends within it), however long the prompt."""
    a = engines()
    for i, n in enumerate((3, 9, 17, 25)):
        a.add(f"r{i}", prompt(n * BLOCK_SIZE + 3, seed=10 + i))
        a.run()
        assert len(a.stored(f"r{i}", 0)) == n
        assert len(a.stored(f"r{i}", 1)) == min(n, WINDOW_BLOCKS)
    # A request decoding far past its prompt's window: two windows (prompt end, request end).
    a.add("long", prompt(8 * BLOCK_SIZE + 3, seed=20), max_tokens=4 * BLOCK_SIZE)
    a.run()
    swa = a.stored("long", 1)
    assert len(swa) <= 2 * WINDOW_BLOCKS and len(set(swa)) == len(swa)


def test_mamba_groups_without_aligned_state_are_refused_in_one_line(
    model_dir: str, module_ns: str
) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )

    from kvray.connector import KVRayConnector
    from kvray.connector.groups import UnsupportedGroupsError
    from kvray.errors import KVRayError

    vllm_config, _ = hybrid_config(model_dir, module_ns)
    mamba = MambaSpec(
        block_size=BLOCK_SIZE, shapes=((4, 8), (2, 16)), dtypes=(torch.float32, torch.float32)
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=32,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                FULL_LAYERS,
                FullAttentionSpec(
                    block_size=BLOCK_SIZE,
                    num_kv_heads=KV_HEADS,
                    head_size=HEAD_DIM,
                    dtype=torch.float32,
                ),
            ),
            KVCacheGroupSpec(SWA_LAYERS, mamba),
        ],
    )
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(UnsupportedGroupsError) as err:
            KVRayConnector(vllm_config, role, kv_cache_config)
        assert isinstance(err.value, KVRayError)
        assert str(err.value) == (
            "kvray connector: this model's KV cache groups are [full_attention, mamba]: vLLM "
            "keeps no block-aligned mamba state in mamba_cache_mode 'none' (run with "
            "--enable-prefix-caching --mamba-cache-mode align); run this model without kvray"
        )


def test_a_router_keys_a_hybrid_prompt_by_the_group_that_decides_hits(
    engines: Any, module_ns: str
) -> None:
    """What a router computes for a hybrid engine's prompt, from the key space the engine
    published (``kvray.serving.prompts.BlockHasher``, the code ``KVRayRouter`` runs), are the
    keys of its full-attention group, the group that decides hits: the prompt's stored prefix
    shows on the engine's node through them. The window group keeps only the last blocks
    before the prompt's end, so keyed by it a router would see no prefix at all."""
    from kvray.keys import make_keys
    from kvray.registry import key_spaces
    from kvray.serving.prompts import BlockHasher

    a = engines()
    p = prompt(10 * BLOCK_SIZE + 5, seed=11)
    a.add("r1", p)
    a.run()
    full, window = (g.key_space for g in a.scheduler.connector.groups)
    (info,) = [i for i in key_spaces(module_ns) if i.key_prefixes == [full.prefix]]
    hasher = BlockHasher(info)
    hashes = hasher.block_hashes(p)
    assert hashes == block_hashes(p)[:10]  # vLLM's own block hashes, from the router's side
    (keys,) = hasher.keys_per_shard(hashes)
    store = a.scheduler.connector.store
    store.sync()
    assert store.prefix_by_node(keys)[info.node_id] == 10
    assert store.prefix_by_node(make_keys(window.prefix, hashes))[info.node_id] == 0
    assert store.lookup(make_keys(window.prefix, hashes[7:])) == WINDOW_BLOCKS  # stored, though


def test_a_lost_block_of_a_hybrid_hit_is_recomputed_not_an_engine_error(engines: Any) -> None:
    """A full-attention block vanishes between the lookup and the load. vLLM 0.32 refuses
    failed block ids from a connector of several KV cache groups (its scheduler raises), so
    kvray reports the request's async load as failed: vLLM recomputes it, and the retry is not
    offered the same hit again (it would fail the same way)."""
    a, b = engines(), engines()
    p = prompt(5 * BLOCK_SIZE + 3, seed=40)
    a.add("a1", p)
    a.run()
    with losing(b, group=0, keep=2):
        b.add("b1", p, max_tokens=2)
        b.run()
    assert "b1" not in b.scheduler.requests  # finished
    assert b.worker.worker.counters().failed_blocks + b.sconn.counters.failed_blocks >= 3
    assert len(b.sconn.quarantine) >= 5  # the failed load's blocks, not offered again
