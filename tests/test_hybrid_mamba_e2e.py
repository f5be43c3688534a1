"""A tiny random Qwen3-Next (gated-delta-net linear attention and full attention alternating)
end to end on CPU, with vLLM's hybrid manager on and its Mamba prefix caching in ``align``
mode: vLLM gives the linear layers' recurrent state a Mamba KV cache group, kvray stores the
state vLLM materializes and loads it with the full-attention blocks before it, and greedy tokens
stay identical."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch

import kvray
from kvray.testing.engines import (
    build_tiny_qwen3_next,
    cached_tokens,
    close_llm,
    connector_of,
    engine_kwargs,
    finish_delayed_frees,
    generate,
    in_process_engines,
    kvray_transfer_config,
    make_prompts,
    scheduler_of,
    token_ids,
    worker_connector_of,
)

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

#: vLLM's CPU kernels of gated delta net run in bfloat16 with AVX512-BF16 or AMX.
BF16 = bool(getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()) or bool(
    getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
)

#: Three 400-token prompts sharing nothing: the first round computes each (the reference).
PROMPTS = [make_prompts(1, 400, 0, seed=s)[0] for s in (2, 3, 4)]


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if not BF16:
        pytest.skip("vLLM's CPU gated-delta-net kernels need AVX512-BF16 or AMX")
    with in_process_engines():
        yield build_tiny_qwen3_next(tmp_path_factory.mktemp("tiny-qwen3-next"))


def test_qwen3_next_state_loads_from_kvray_with_identical_tokens(
    qwen3_next: str, ray_cluster: Any
) -> None:
    from vllm import LLM

    ns = f"mamba{uuid.uuid4().hex[:8]}"
    ktc = kvray_transfer_config(ns, capacity="128MiB", get_timeout_s=10)
    kw = engine_kwargs(
        qwen3_next,
        kv_transfer_config=ktc,
        dtype="bfloat16",
        enable_prefix_caching=True,
        mamba_cache_mode="align",
    )
    llm = LLM(**kw)
    try:
        groups = scheduler_of(llm).kv_cache_config.kv_cache_groups
        kinds = [type(g.kv_cache_spec).__name__ for g in groups]
        assert sorted(kinds) == ["FullAttentionSpec", "MambaSpec"]
        block = groups[0].kv_cache_spec.block_size  # vLLM aligns the groups' pages: 160
        worker = worker_connector_of(llm).worker
        conn = connector_of(llm)
        rounds = []
        for r in range(2):  # computed (nothing is in kvray yet), then loaded from kvray
            if r:  # no state or KV left in the engine's memory: all of it must be loaded
                for handler in worker.handler.handlers.values():
                    for storage in handler.mover.plan.storages:
                        storage.zero_()
            out = []
            for p in PROMPTS:  # each alone: a bfloat16 batch of several computes other tokens
                finish_delayed_frees(llm)
                assert llm.reset_prefix_cache()
                out += generate(llm, [p])
            finish_delayed_frees(llm)
            worker.flush()
            conn.store.sync()
            rounds.append((out, conn.scheduler.counters.add(worker.counters())))
    finally:
        close_llm(llm)
        kvray.stop(ns)
    (computed, stored), (out, c) = rounds
    assert cached_tokens(computed) == [0] * len(PROMPTS)
    assert stored.stored_blocks > 0 and stored.loaded_blocks == 0
    assert token_ids(out) == token_ids(computed)
    # A hit ends on the last block boundary before a prompt's last token whose state vLLM
    # materialized (its prefill checkpoint): 320 of 400 tokens with 160-token blocks.
    hit = (len(PROMPTS[0]) - 1) // block * block
    assert cached_tokens(out) == [hit] * len(PROMPTS)
    blocks = hit // block
    assert c.loaded_blocks - stored.loaded_blocks == len(PROMPTS) * (blocks + 1)
    assert c.failed_blocks == 0
