"""Reuse across TP sizes: a block stored by an engine at one TP size, loaded at another.

- Slicing and assembling KV heads (:mod:`kvray.kernels.heads`, the connector's copier) on
  random data, byte for byte against a slow reference, for every (stored grouping, reader TP
  size, rank) pair of 4 KV heads, and of 2 KV heads read at TP=4 (replicated heads).
- Key spaces: one prefix per grouping, no TP size in it on CPU caches; models, dtypes, block
  sizes, ISAs and GPU layouts never share keys.
- Real vLLM on CPU (float32 tiny Llamas): a TP=1 engine stores, a TP=2 engine loads (hits
  counted, tokens and KV as its own recompute), stores, reads its own two-shard blocks back
  after emptying vLLM's cache, and the TP=1 engine loads them; a model with one KV head at
  TP=2 stores each block once and both ranks read it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from ray_fixtures import started_namespace

from kvray.connector.paged import PagedCopier
from kvray.kernels import BlockMover, StagingPool, describe_kv_caches
from kvray.kernels.heads import HeadPart, head_parts, is_head_major, window
from kvray.keys import grouped_prefix
from kvray.testing.engines import (
    finish_delayed_frees,
    full_hit_blocks,
    full_hit_tokens,
    in_process_engines,
)

LAYERS, TOKENS, DIM = 3, 32, 4  # a head's page: 32 tokens x (K|V of 4 floats) = 1 KiB
HEAD_BYTES = TOKENS * 2 * DIM * 4


# ---------------------------------------------------------------------- slicing, assembling
def reader_heads(total: int, tp: int, rank: int) -> tuple[int, int]:
    """vLLM's head range of a rank: ``H/T`` heads, or one head replicated ``T/H`` times."""
    if tp <= total:
        per = total // tp
        return rank * per, (rank + 1) * per
    head = rank // (tp // total)
    return head, head + 1


def cases(total: int, tps: tuple[int, ...]) -> list[tuple[int, int, int, int]]:
    groupings = [g for g in range(1, total + 1) if total % g == 0]
    return [(total, g, t, r) for g in groupings for t in tps for r in range(t)]


CASES = cases(4, (1, 2, 4, 8)) + cases(2, (4,))


def cpu_caches(heads: int, num_blocks: int) -> dict[str, torch.Tensor]:
    """vLLM's CPU layout: per layer ``[num_blocks, heads, tokens, 2*dim]``, one allocation."""
    backing = torch.zeros(LAYERS, num_blocks, heads, TOKENS, 2 * DIM)
    return {f"layer.{i}": backing[i] for i in range(LAYERS)}


def stored(full: np.ndarray, grouping: int, *, back_to_back: bool) -> list[list[np.ndarray]]:
    """Slow reference of what a grouping stores: per shard, one uint8 array per block."""
    n, _, total, _ = full.shape
    per = total // grouping
    out = []
    for g in range(grouping):
        rows = np.ascontiguousarray(full[:, :, g * per : (g + 1) * per, :]).reshape(n, -1)
        if back_to_back:  # as blocks of one segment: two runs
            a, b = rows[:2].copy(), rows[2:].copy()
            out.append([*a, *b])
        else:
            out.append([np.array(r) for r in rows])
    return out


@pytest.mark.parametrize(("total", "grouping", "tp", "rank"), CASES)
@pytest.mark.parametrize("mode", ["direct", "layerwise", "scattered", "tiny-staging"])
def test_heads_of_any_stored_grouping_land_byte_exact(
    total: int, grouping: int, tp: int, rank: int, mode: str
) -> None:
    rng = np.random.default_rng(total * 1000 + grouping * 100 + tp * 10 + rank)
    n, num_blocks = 5, 12
    full = rng.integers(0, 256, (n, LAYERS, total, HEAD_BYTES), dtype=np.uint8)
    a, b = reader_heads(total, tp, rank)
    heads = b - a
    kv = cpu_caches(heads, num_blocks)
    layout = describe_kv_caches(kv, block_size=TOKENS, layout_hint="CPU_ATTN:vec")
    assert is_head_major(layout.num_heads, layout.axes, layout.block_size_factor)
    mover = BlockMover(kv, layout)
    staging = StagingPool(layout.block_nbytes, 1 if mode == "tiny-staging" else 8)
    copier = PagedCopier(
        mover, staging, layout.block_nbytes, torch.device("cpu"), num_layers=LAYERS, heads=heads
    )
    shards = stored(full, grouping, back_to_back=mode != "scattered")
    parts = head_parts(total, (a, b), grouping)
    block_ids = [7, 2, 3, 4, 10]
    sources = [(shards[p.shard], p) for p in parts]
    seen: list[int] = []
    if mode == "layerwise":
        for layer in range(LAYERS):
            copier.scatter(block_ids, sources, layers=(layer, layer + 1))
    else:
        copier.scatter(block_ids, sources, seen.append)
        assert sorted(seen) == list(range(n)), "every block's hook runs once"

    out = torch.empty((n, layout.block_nbytes), dtype=torch.uint8)
    mover.gather(block_ids, out)
    want = np.ascontiguousarray(full[:, :, a:b, :]).reshape(n, -1)
    assert np.array_equal(out.numpy(), want)
    others = [i for i in range(num_blocks) if i not in block_ids]
    assert all(bool((kv[name][others] == 0).all()) for name in kv), "other blocks untouched"


@pytest.mark.parametrize("total", [1, 2, 4, 6, 8, 12])
def test_head_parts_cover_every_rank_exactly(total: int) -> None:
    divisors = [d for d in range(1, total + 1) if total % d == 0]
    for grouping in divisors:
        per = total // grouping
        for tp in [*divisors, 2 * total]:
            for rank in range(tp):
                a, b = reader_heads(total, tp, rank)
                parts = head_parts(total, (a, b), grouping)
                got = [p.shard * per + p.src_lo + k for p in parts for k in range(p.count)]
                assert got == list(range(a, b))
                assert [p.dst_lo for p in parts] == [p.dst_lo for p in parts if p.dst_lo >= 0]
                assert all(p.src_lo + p.count <= per and p.src_heads == per for p in parts)
                assert sum(p.count for p in parts) == b - a
    with pytest.raises(ValueError, match="does not split"):
        head_parts(6, (0, 1), 4)
    with pytest.raises(ValueError, match="outside"):
        head_parts(4, (2, 5), 2)


def test_bad_sizes_are_refused() -> None:
    part = HeadPart(0, 2, 1, 0, 1)
    with pytest.raises(ValueError, match="uint8 vector"):
        window(np.zeros(2 * LAYERS * HEAD_BYTES - 1, np.uint8), 1, part, LAYERS, HEAD_BYTES)
    kv = cpu_caches(1, 4)
    layout = describe_kv_caches(kv, block_size=TOKENS, layout_hint="CPU_ATTN:vec")
    mover = BlockMover(kv, layout)
    copier = PagedCopier(
        mover,
        StagingPool(layout.block_nbytes, 2),
        layout.block_nbytes,
        torch.device("cpu"),
        num_layers=LAYERS,
        heads=1,
    )
    short = [np.zeros(2 * LAYERS * HEAD_BYTES - 8, np.uint8)]
    with pytest.raises(ValueError, match="fetched block 0"):
        copier.scatter([1], [(short, part)])
    wrong = torch.zeros((1, LAYERS, 2 * HEAD_BYTES), dtype=torch.uint8)
    with pytest.raises(ValueError, match="contiguous layer parts"):
        mover.scatter([1], wrong)
    assert bool((kv["layer.0"] == 0).all())


# ---------------------------------------------------------------------- key spaces
def space(tp: int, **kw: Any) -> Any:
    from kvray.connector.keyspace import key_space

    total = kw.pop("total_heads", 8)
    mla = kw.get("mla", False)
    rank_heads = kw.pop("rank_heads", 1 if mla else max(1, total // tp))
    args: dict[str, Any] = dict(
        model="m@",
        kv_dtype="torch.float32/auto",
        block_size=32,
        hash_algo="sha256",
        device="cpu",
        layout_tags=["None", "FullAttentionSpec"],
        total_heads=total,
        rank_heads=rank_heads,
        head_size=64,
        num_layers=2,
        page_nbytes=rank_heads * 32 * 128 * 4,
        tp_size=tp,
        variant="vec",
    )
    args.update(kw)
    return key_space(**args)


def test_cpu_keys_drop_the_tp_size_and_carry_the_grouping() -> None:
    h = [b"\x07" * 32, b"\x08" * 32]
    spaces = {tp: space(tp) for tp in (1, 2, 4, 8, 16)}
    bases = {ks.base.prefix for ks in spaces.values()}
    assert len(bases) == 1, "the TP size must not change the fingerprint of CPU layouts"
    (base,) = bases
    for tp, ks in spaces.items():
        assert ks.cross_tp and ks.num_shards == min(tp, 8)
        assert ks.prefix == grouped_prefix(base, ks.num_shards)
        assert ks.groupings[0] == ks.num_shards and sorted(ks.groupings) == [1, 2, 4, 8]
        # Every engine finds what any other stored, under the storer's grouping.
        for other in spaces.values():
            assert ks.block_keys(h, other.num_shards) == other.block_keys(h)
    assert len({ks.prefix for ks in spaces.values()}) == 4  # groupings 1, 2, 4, 8
    # Stored shards differ per grouping: one TP=1 entry never mixes with TP=2 shards.
    assert spaces[1].block_ids(h).tolist() != spaces[2].block_ids(h).tolist()
    with pytest.raises(ValueError, match="not readable"):
        space(1, total_heads=6, rank_heads=6).block_keys(h, 4)


def test_replicated_heads_are_written_once_and_mla_is_one_shard() -> None:
    gqa = space(8, total_heads=2)  # 4 ranks per KV head
    assert gqa.num_shards == 2 and gqa.heads_per_rank == 1
    assert [gqa.heads_of(r) for r in range(8)] == [(0, 1)] * 4 + [(1, 2)] * 4
    assert [gqa.writes(r) for r in range(8)] == [True, False, False, False] * 2
    assert [gqa.shard_of(r) for r in range(8)] == [0] * 4 + [1] * 4
    mla = {tp: space(tp, total_heads=1, mla=True) for tp in (1, 2, 4)}
    assert len({ks.prefix for ks in mla.values()}) == 1
    assert all(ks.num_shards == 1 and ks.groupings == (1,) for ks in mla.values())
    assert [mla[4].writes(r) for r in range(4)] == [True, False, False, False]
    assert mla[1].base.prefix != space(1, total_heads=1).base.prefix


def test_what_decides_the_bytes_never_shares_keys() -> None:
    """Model, dtype, block size, hash, ISA, cache layout, head size, salt: distinct prefixes
    (and keys: vLLM's block hashes of another block size differ anyway, so blocks are never
    converted between block sizes); GPU layouts keep the TP size (no reuse across it)."""
    ref = space(2).base.prefix
    variants = [
        space(2, model="other@"),
        space(2, kv_dtype="torch.bfloat16/auto"),
        space(2, block_size=64, page_nbytes=4 * 64 * 128 * 4),
        space(2, hash_algo="sha256_cbor"),
        space(2, variant="amx"),
        space(2, layout_tags=["HND", "FullAttentionSpec"]),
        space(2, head_size=128),
        space(2, salt="lora-a"),
        space(2, device="cuda"),
    ]
    prefixes = [ref, *(v.base.prefix for v in variants)]
    assert len(set(prefixes)) == len(prefixes)
    gpu = {tp: space(tp, device="cuda") for tp in (1, 2, 4)}
    assert len({ks.base.prefix for ks in gpu.values()}) == 3
    assert all(not ks.cross_tp and ks.groupings == (ks.num_shards,) for ks in gpu.values())


def test_real_vllm_configs_key_tp_sizes_alike_and_models_apart(tmp_path: Any) -> None:
    pytest.importorskip("vllm")
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, ParallelConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from kvray.config import KVRayConfig
    from kvray.connector.keyspace import build_key_space
    from kvray.testing.engines import BLOCK_SIZE, build_tiny_llama

    one = build_tiny_llama(tmp_path / "kv2", kv_heads=2)
    other = build_tiny_llama(tmp_path / "kv1", kv_heads=1)

    def ks(model: str, tp: int, dtype: str = "float32") -> Any:
        mc = ModelConfig(model=model, dtype=dtype, seed=0, skip_tokenizer_init=True)
        pc = ParallelConfig(tensor_parallel_size=tp)
        vc = VllmConfig(
            model_config=mc,
            cache_config=CacheConfig(block_size=BLOCK_SIZE),
            parallel_config=pc,
            device_config=DeviceConfig("cpu"),
        )
        spec = FullAttentionSpec(
            block_size=BLOCK_SIZE,
            num_kv_heads=mc.get_num_kv_heads(pc),
            head_size=64,
            dtype=getattr(torch, dtype),
        )
        layers = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
        kcc = KVCacheConfig(
            num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, spec)]
        )
        return build_key_space(KVRayConfig(), vc, kcc)

    tp1, tp2 = ks(one, 1), ks(one, 2)
    assert tp1.cross_tp and tp2.cross_tp and tp1.base.prefix == tp2.base.prefix
    assert (tp1.num_shards, tp2.num_shards) == (1, 2) and tp2.groupings == (2, 1)
    gqa1, gqa2 = ks(other, 1), ks(other, 2)
    assert gqa1.prefix == gqa2.prefix and gqa2.num_shards == 1
    assert [gqa2.writes(r) for r in range(2)] == [True, False]
    bf16 = ks(one, 1, "bfloat16")
    assert len({tp1.base.prefix, gqa1.base.prefix, bf16.base.prefix}) == 3


# ---------------------------------------------------------------------- real vLLM engines
PREFIX_TOKENS, SUFFIX_TOKENS = 200, 30


def _prompts(seed: int) -> list[list[int]]:
    from kvray.testing.engines import make_prompts

    return make_prompts(2, PREFIX_TOKENS, SUFFIX_TOKENS, seed=seed)


def _hashes(prompt: list[int], salt: str | None = None) -> list[str]:
    """vLLM's block hashes of a prompt (hex), as every engine computes them."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from kvray.testing.engines import BLOCK_SIZE

    init_none_hash(sha256)
    req = Request(
        request_id="h",
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        cache_salt=salt,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
    )
    return [bytes(h).hex() for h in req.block_hashes[: full_hit_tokens(prompt) // BLOCK_SIZE]]


def _kv(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=np.float32)


def assert_kv_close(
    records: dict[str, dict[str, bytes]], prompt: list[int], salt: str, other: Any = None
) -> None:
    """The KV a rank loaded for ``prompt`` is close to what it computed itself for the same
    tokens (stored under ``salt``); far from ``other`` rank's own KV (heads matter)."""
    loaded, own = _hashes(prompt), _hashes(prompt, salt)
    assert loaded and all(h in records["loaded"] for h in loaded), "blocks were not loaded"
    assert all(h in records["stored"] for h in own), "the rank did not compute the prompt"
    for h, o in zip(loaded, own, strict=True):
        got, want = _kv(records["loaded"][h]), _kv(records["stored"][o])
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
        if other is not None:
            far = _kv(other["stored"][o])
            assert np.abs(got - far).max() > 0.05, "another rank's heads look alike"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    pytest.importorskip("vllm")
    from kvray.testing.engines import build_tiny_llama

    root = tmp_path_factory.mktemp("cross-tp-models")
    return {
        "kv2": build_tiny_llama(root / "kv2", kv_heads=2),  # one KV head per rank at TP=2
        "kv1": build_tiny_llama(root / "kv1", kv_heads=1, seed=1),  # fewer heads than ranks
    }


class InProcessEngine:
    """A TP=1 kvray engine in this process, recording what its rank loads and stores."""

    def __init__(self, model: str, namespace: str) -> None:
        from vllm import LLM

        from kvray.testing.engines import engine_kwargs, kvray_transfer_config, worker_connector_of

        # what one TP size computes once the other loads (stored at its first sighting)
        ktc = kvray_transfer_config(namespace, store_seen_only=False)
        self.llm = LLM(**engine_kwargs(model, kv_transfer_config=ktc))
        from cross_tp_engine import install_recorder

        self.worker = worker_connector_of(self.llm).worker
        self.records = install_recorder(self.worker.handler)

    @property
    def scheduler(self) -> Any:
        from kvray.testing.engines import connector_of

        return connector_of(self.llm).scheduler

    def generate(self, prompts: list[list[int]], salt: str | None = None) -> dict[str, Any]:
        from vllm import SamplingParams, TokensPrompt

        ps = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        for p in ps:
            if salt:
                p["cache_salt"] = salt
        sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        outs = self.llm.generate(ps, sp, use_tqdm=False)
        finish_delayed_frees(self.llm)
        self.worker.flush()
        self.scheduler.store.sync()
        return {
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "cached": [int(o.num_cached_tokens or 0) for o in outs],
        }

    def close(self) -> None:
        from kvray.testing.engines import close_llm

        close_llm(self.llm)


@pytest.fixture
def in_process() -> Iterator[None]:
    with in_process_engines():
        yield


@pytest.fixture
def namespace(ray_cluster: Any) -> Iterator[str]:
    with started_namespace("xtp", capacity="128MiB") as ns:
        yield ns


@pytest.mark.vllm
@pytest.mark.slow
def test_tp1_blocks_load_at_tp2_and_tp2_blocks_at_tp1(
    models: dict[str, str], namespace: str, in_process: None, tmp_path: Any
) -> None:
    import cross_tp_engine

    p1, p2 = _prompts(11), _prompts(12)
    started = cross_tp_engine.start(models["kv2"], namespace, tmp_path, tp=2)  # builds meanwhile
    a = InProcessEngine(models["kv2"], namespace)
    try:
        a1 = a.generate(p1)  # computed at TP=1, stored as 1 shard of 2 heads

        b = started.run(
            [
                {"prompts": p1},
                {"prompts": p1, "salt": "b"},
                {"prompts": p2},
                {"prompts": p2, "reset": True},
            ]
        )
        loaded, own, b2, b2_again = b["steps"]
        assert loaded["cached"] == [full_hit_tokens(p) for p in p1]
        assert own["cached"][0] == 0  # (the second prompt shares the first in vLLM's cache)
        assert loaded["tokens"] == own["tokens"] == a1["tokens"]
        assert b["cross_tp_hit_tokens"] >= full_hit_tokens(p1[0]) and b["failed_blocks"] == 0
        # TP=2 reads its own blocks back (vLLM's cache emptied): a hit needs both ranks' shards.
        assert b2_again["cached"][0] == full_hit_tokens(p2[0])
        assert b2_again["tokens"] == b2["tokens"]
        assert b["hit_tokens"] >= full_hit_tokens(p1[0]) + full_hit_tokens(p2[0])
        # The engine tier at TP=2: one engine, one reporter (its scheduler's), not one per rank;
        # what its cache holds of the last prompts reaches the index the router reads.
        tier = b["engine_tier"]
        assert tier["replicas"] == 1, tier
        assert tier["prefix"] == [full_hit_blocks(p) for p in p2], tier
        assert tier["scheduler_view_rows"] == 0, tier  # the scheduler's view keeps none of it
        r0, r1 = (r["recorded"] for r in b["ranks"])
        assert [r["heads"] for r in b["ranks"]] == [[0, 1], [1, 2]]
        assert all(r["writes"] for r in b["ranks"])
        p2_blocks = {h for prompt in p2 for h in _hashes(prompt)}
        assert {h: r0["put"][h] for h in p2_blocks} == dict.fromkeys(p2_blocks, b"0/2")
        assert {h: r1["put"][h] for h in p2_blocks} == dict.fromkeys(p2_blocks, b"1/2")
        for prompt in p1:  # each rank's head of A's block, as it computes it itself
            assert_kv_close(r0, prompt, "b", other=r1)
            assert_kv_close(r1, prompt, "b", other=r0)

        # Back: the TP=1 engine assembles B's two shards of every block of p2.
        a.scheduler.store.sync()
        before = a.scheduler.cross_tp_hit_tokens
        finish_delayed_frees(a.llm)
        assert a.llm.reset_prefix_cache()
        a2 = a.generate(p2)
        assert a2["cached"][0] == full_hit_tokens(p2[0])
        assert a.scheduler.cross_tp_hit_tokens - before >= full_hit_tokens(p2[0])
        assert a2["tokens"] == b2["tokens"] == a.generate(p2, salt="a")["tokens"]
        assert a.worker.counters().failed_blocks == 0
        for prompt in p2:
            assert_kv_close(a.records, prompt, "a")
    finally:
        a.close()
        started.kill()


@pytest.mark.vllm
@pytest.mark.slow
def test_fewer_kv_heads_than_ranks_store_once_read_by_all(
    models: dict[str, str], namespace: str, in_process: None, tmp_path: Any
) -> None:
    import cross_tp_engine

    import kvray

    p3, p4 = _prompts(13), _prompts(14)
    started = cross_tp_engine.start(models["kv1"], namespace, tmp_path, tp=2)  # builds meanwhile
    a = InProcessEngine(models["kv1"], namespace)
    try:
        a3 = a.generate(p3)  # TP=1: the one KV head, grouping 1 like TP=2
        b = started.run([{"prompts": p3}, {"prompts": p3, "salt": "b"}, {"prompts": p4}])
        loaded, own, b4 = b["steps"]
        assert loaded["cached"] == [full_hit_tokens(p) for p in p3]
        assert loaded["tokens"] == own["tokens"] == a3["tokens"]
        assert b["hit_tokens"] >= full_hit_tokens(p3[0]) and b["failed_blocks"] == 0
        ranks = b["ranks"]
        assert [r["heads"] for r in ranks] == [[0, 1], [0, 1]]
        assert [r["writes"] for r in ranks] == [True, False]
        r0, r1 = ranks[0]["recorded"], ranks[1]["recorded"]
        p4_blocks = {h for prompt in p4 for h in _hashes(prompt)}
        assert {h: r0["put"][h] for h in p4_blocks} == dict.fromkeys(p4_blocks, b"0/1")
        assert r1["put"] == {}, "rank 1 holds the same head as rank 0: it writes nothing"
        assert r1["stored"], "(rank 1 computed blocks it did not write)"
        for prompt in p3:
            assert_kv_close(r0, prompt, "b")
            assert_kv_close(r1, prompt, "b")
            assert all(r0["loaded"][h] == r1["loaded"][h] for h in _hashes(prompt))

        store = kvray.connect(namespace)
        store.sync()
        # One shard per stored block: every entry in the index is one stored shard.
        assert store.stats()["totals"]["blocks"] == len(store.feed.view)
        store.close()

        a.scheduler.store.sync()
        finish_delayed_frees(a.llm)
        assert a.llm.reset_prefix_cache()
        a4 = a.generate(p4)
        assert a4["cached"][0] == full_hit_tokens(p4[0])
        assert a4["tokens"] == b4["tokens"]
        assert a.worker.counters().failed_blocks == 0
    finally:
        a.close()
        started.kill()
