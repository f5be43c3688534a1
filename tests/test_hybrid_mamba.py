"""Hybrid SSM models: kvray stores and loads the Mamba state vLLM keeps per block.

vLLM's real ``Scheduler`` and ``KVCacheManager`` with a full-attention group and a Mamba group in
vLLM's ``align`` cache mode (the mode in which vLLM keeps, in the group's block ``p``, the state
after exactly ``(p + 1) * block_size`` tokens); kvray's scheduler and worker sides on CPU
tensors laid out as vLLM 0.32 views a Mamba layer (``[B, 1, 1, state bytes]`` int8 in a padded
page), real Ray. A fake "model" writes, at the end of every chunk it computes, a state derived
from the whole prefix into the block vLLM gave that chunk's last token, and before computing a
chunk checks that the block holding the state it starts from (loaded, or computed here) is the
state of exactly the tokens before it: what a real Mamba layer would read.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm")

import torch
from test_hybrid import (
    Hybrid,
    block_hashes,
    engine_factory,
    expected_value,
    losing,
    prompt,
    start_engine,
)

from kvray.testing.engines import BLOCK_SIZE, build_tiny_llama, scheduler_vllm_config

pytestmark = [pytest.mark.vllm]

KV_HEADS, HEAD_DIM = 2, 32
FULL_LAYERS = ["model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn"]
MAMBA_LAYERS = ["model.layers.1.mixer", "model.layers.3.mixer"]
LAYER_INDEX = {n: int(n.split(".")[2]) for n in FULL_LAYERS + MAMBA_LAYERS}
#: The state of one Mamba layer: a conv state and an SSM state (float32), 256 bytes, in a
#: page vLLM pads to 384 bytes.
SHAPES = ((4, 8), (2, 16))
STATE_BYTES = sum(a * b * 4 for a, b in SHAPES)
PAGE = 384
NUM_BLOCKS = 96


def state_of(tokens: list[int], layer: int) -> torch.Tensor:
    """The (fake) state of a layer after ``tokens``: bytes that differ with every prefix."""
    seed = zlib.crc32(np.asarray(tokens, dtype=np.int64).tobytes()) ^ (layer * 0x9E3779B9)
    rng = np.random.default_rng(seed & 0xFFFFFFFF)
    return torch.from_numpy(rng.integers(-128, 128, STATE_BYTES, dtype=np.int8)).view(1, 1, -1)


class MambaEngine(Hybrid):
    """:class:`test_hybrid.Hybrid` with group 1 a Mamba group."""

    def _forward(self, req: Any, start: int, end: int) -> None:
        groups = self.scheduler.kv_cache_manager.get_block_ids(req.request_id)
        toks = req.all_token_ids
        for name in FULL_LAYERS:
            self.worker.wait_for_layer_load(name)
            t = self.kv[name]
            for pos in range(start, end):
                b = groups[0][pos // BLOCK_SIZE]
                t[b, :, pos % BLOCK_SIZE, :] = expected_value(toks[pos], pos, LAYER_INDEX[name])
        states = groups[1]
        for name in MAMBA_LAYERS:
            self.worker.wait_for_layer_load(name)
            t = self.kv[name]
            layer = LAYER_INDEX[name]
            if start > 0:  # the state this chunk starts from: loaded, or computed here
                src = states[-(-start // BLOCK_SIZE) - 1]
                assert src != 0, "the state a chunk starts from is never vLLM's null block"
                assert torch.equal(t[src], state_of(toks[:start], layer)), (req.request_id, start)
            dst = states[-(-end // BLOCK_SIZE) - 1]
            assert dst != 0
            t[dst] = state_of(toks[:end], layer)

    def _check_loads(self, specs: list[Any]) -> None:
        for spec in specs:
            req = self.scheduler.requests[spec.req_id]
            index = {bytes(h): i for i, h in enumerate(req.block_hashes)}
            for block_id, h in zip(spec.block_ids, spec.block_hashes, strict=True):
                i = index[bytes(h)]
                if spec.group == 0:
                    toks = req.all_token_ids[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]
                    for name in FULL_LAYERS:
                        want = torch.tensor(
                            [
                                expected_value(t, i * BLOCK_SIZE + k, LAYER_INDEX[name])
                                for k, t in enumerate(toks)
                            ]
                        ).view(1, BLOCK_SIZE, 1)
                        got = self.kv[name][block_id]
                        assert torch.equal(got, want.expand_as(got)), (0, i, name)
                else:
                    prefix = req.all_token_ids[: (i + 1) * BLOCK_SIZE]
                    for name in MAMBA_LAYERS:
                        got = self.kv[name][block_id]
                        assert torch.equal(got, state_of(prefix, LAYER_INDEX[name])), (1, i, name)
                self.checked_blocks[spec.group] += 1


def mamba_config(model_dir: str, namespace: str, mode: str = "align", **extra: Any) -> Any:
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )

    vllm_config = scheduler_vllm_config(model_dir, namespace, max_num_batched_tokens=1024, **extra)
    vllm_config.cache_config.mamba_cache_mode = mode
    vllm_config.cache_config.num_gpu_blocks = NUM_BLOCKS
    full = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.float32
    )
    mamba = MambaSpec(
        block_size=BLOCK_SIZE,
        shapes=SHAPES,
        dtypes=(torch.float32, torch.float32),
        page_size_padded=PAGE,
        mamba_cache_mode=mode,
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(FULL_LAYERS, full),
            KVCacheGroupSpec(MAMBA_LAYERS, mamba),
        ],
    )
    return vllm_config, kv_cache_config


def make_engine(model_dir: str, namespace: str, **extra: Any) -> MambaEngine:
    vllm_config, kv_cache_config = mamba_config(model_dir, namespace, **extra)
    attn = torch.zeros(2, NUM_BLOCKS, KV_HEADS, BLOCK_SIZE, 2 * HEAD_DIM)
    # vLLM 0.32's view of a Mamba layer: [B, H=1, N=1, state bytes] int8, one padded page apart.
    pages = torch.zeros(2, NUM_BLOCKS, PAGE, dtype=torch.int8)
    kv = {
        FULL_LAYERS[0]: attn[0],
        FULL_LAYERS[1]: attn[1],
        MAMBA_LAYERS[0]: pages[0, :, :STATE_BYTES].view(NUM_BLOCKS, 1, 1, STATE_BYTES),
        MAMBA_LAYERS[1]: pages[1, :, :STATE_BYTES].view(NUM_BLOCKS, 1, 1, STATE_BYTES),
    }
    assert kv[MAMBA_LAYERS[0]].stride(0) == PAGE
    e = start_engine(MambaEngine, vllm_config, kv_cache_config, kv)
    assert e.scheduler.need_mamba_block_aligned_split
    return e


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_llama(
        tmp_path_factory.mktemp("mamba-model"), layers=4, kv_heads=KV_HEADS, head_dim=HEAD_DIM
    )


@pytest.fixture
def engines(model_dir: str, module_ns: str) -> Iterator[Callable[..., MambaEngine]]:
    yield from engine_factory(make_engine, model_dir, module_ns)


def test_a_mamba_group_has_its_own_key_space_tied_to_the_tp_size(engines: Any) -> None:
    e = engines()
    full, state = e.scheduler.connector.groups
    assert (full.kind, state.kind) == ("full_attention", "mamba")
    assert full.key_space.prefix != state.key_space.prefix
    assert not state.key_space.cross_tp and state.key_space.block_nbytes == 2 * STATE_BYTES
    assert e.scheduler.connector.key_space is full.key_space  # full attention decides hits


def test_a_second_engine_loads_the_state_where_the_shared_prompt_stops(engines: Any) -> None:
    """vLLM materializes the state one token short of the prompt's end, block-aligned (where
    a request re-sending the prompt hits): kvray stores exactly that state, and another engine
    loads it with the full-attention blocks before it and computes only the rest."""
    a, b = engines(), engines()
    p = prompt(10 * BLOCK_SIZE + 5, seed=1)
    a.add("a1", p)
    a.run()
    assert len(a.stored("a1", 0)) == 10
    assert a.stored("a1", 1) == block_hashes(p)[9:10]  # the state after 10 blocks, only

    b.add("b1", p)
    assert b.first_scheduled("b1") == 5
    b.run()  # the forward checks the state it starts from
    assert b.sconn.hit_tokens == 10 * BLOCK_SIZE
    assert b.loaded("b1", 1) == block_hashes(p)[9:10]
    assert b.checked_blocks == {0: 10, 1: 1}
    assert b.worker.worker.counters().failed_blocks == 0


def test_a_prompt_filling_its_last_block_hits_at_the_block_before(engines: Any) -> None:
    """A state holds no token inside a block: where full attention could hit all but the
    prompt's last token, a Mamba model hits at the block boundary before it (where vLLM keeps
    the state for a re-sent prompt) and computes one block."""
    a, b = engines(), engines()
    p = prompt(6 * BLOCK_SIZE, seed=2)
    a.add("a1", p)
    a.run()
    assert a.stored("a1", 1) == block_hashes(p)[4:6]  # after 5 blocks (checkpoint) and after 6
    b.add("b1", p, max_tokens=2)
    assert b.first_scheduled("b1") == BLOCK_SIZE
    b.run()
    assert b.sconn.hit_tokens == 5 * BLOCK_SIZE
    assert b.checked_blocks == {0: 5, 1: 1}


def test_a_conversation_turn_loads_the_state_decode_reached(engines: Any) -> None:
    """The next turn of a conversation (prompt + answer + a new message) on another engine
    loads the state at the last block boundary the first turn's decode crossed: kvray stores
    each state decode materializes while vLLM still holds it (two steps)."""
    a, b = engines(), engines()
    p = prompt(3 * BLOCK_SIZE + 5, seed=3)
    a.add("a1", p, max_tokens=2 * BLOCK_SIZE)
    a.run()
    answer = [7] * (2 * BLOCK_SIZE)  # what the fake model samples
    history = p + answer
    # The prompt's checkpoint (after 3 blocks) and the boundaries decode crossed (4 and 5).
    assert a.stored("a1", 1) == block_hashes(history)[2:5]
    b.add("b1", history + prompt(BLOCK_SIZE + 9, seed=4))
    b.run()
    assert b.sconn.hit_tokens == 5 * BLOCK_SIZE
    assert b.checked_blocks == {0: 5, 1: 1}


def test_states_stored_per_request_are_the_ones_vllm_materializes(engines: Any) -> None:
    """However long the prompt (one prefill chunk), a request stores one state for it, not one
    per block: full attention stores every block."""
    a = engines()
    for i, n in enumerate((3, 9, 17, 25)):
        a.add(f"r{i}", prompt(n * BLOCK_SIZE + 3, seed=10 + i))
        a.run()
        assert len(a.stored(f"r{i}", 0)) == n
        assert len(a.stored(f"r{i}", 1)) == 1


def test_mamba_without_align_mode_is_refused_in_one_line(model_dir: str, module_ns: str) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvray.connector import KVRayConnector
    from kvray.connector.groups import UnsupportedGroupsError
    from kvray.errors import KVRayError

    vllm_config, kv_cache_config = mamba_config(model_dir, module_ns, mode="all")
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(UnsupportedGroupsError) as err:
            KVRayConnector(vllm_config, role, kv_cache_config)
        assert isinstance(err.value, KVRayError)
        assert str(err.value) == (
            "kvray connector: this model's KV cache groups are [full_attention, mamba]: vLLM "
            "keeps no block-aligned mamba state in mamba_cache_mode 'all' (run with "
            "--enable-prefix-caching --mamba-cache-mode align); run this model without kvray"
        )


def test_a_lost_state_is_reported_and_recomputed_never_served(engines: Any) -> None:
    """The state block vanishes between the lookup and the load (evicted, a dead pool): the
    load reports it to vLLM as failed and vLLM recomputes; every chunk still starts from the
    right state (the fake forward checks it), and the request finishes."""
    a, b = engines(), engines()
    p = prompt(4 * BLOCK_SIZE + 3, seed=5)
    a.add("a1", p)
    a.run()
    with losing(b, group=1, keep=0):
        b.add("b1", p, max_tokens=2)
        b.run()
    assert "b1" not in b.scheduler.requests  # finished
    assert b.worker.worker.counters().failed_blocks + b.sconn.counters.failed_blocks >= 1
    assert b.checked_blocks[1] == 0  # no state was ever served


def test_a_state_key_space_keeps_the_tp_size_and_every_rank_writes_its_state() -> None:
    """A rank's Mamba state is no canonical head range: keys carry the TP size (engines of
    other TP sizes never read it) and every rank stores its own part."""
    from kvray.connector.keyspace import key_space

    def space(tp: int) -> Any:
        return key_space(
            model="m@",
            kv_dtype="state/auto/auto",
            block_size=BLOCK_SIZE,
            hash_algo="sha256",
            device="cpu",
            layout_tags=["MambaSpec"],
            total_heads=tp,
            rank_heads=1,
            head_size=STATE_BYTES,
            num_layers=2,
            page_nbytes=STATE_BYTES,
            tp_size=tp,
            tp_bound=True,
        )

    spaces = {tp: space(tp) for tp in (1, 2, 4)}
    assert len({ks.base.prefix for ks in spaces.values()}) == 3
    for tp, ks in spaces.items():
        assert not ks.cross_tp and ks.num_shards == tp and ks.groupings == (tp,)
        assert all(ks.writes(r) and ks.shard_of(r) == r for r in range(tp))
        assert ks.block_nbytes == 2 * STATE_BYTES
