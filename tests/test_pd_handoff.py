"""The P/D handoff on real vLLM (CPU, tiny float32 Llama): one in-process kvray engine plays
the prefill (``do_remote_decode``: it returns ``kv_transfer_params``) and, after its own prefix
cache is reset, the decode (it loads from what those params name). A plain engine without any
connector gives the reference tokens."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")

import kvray
from kvray.testing.engines import (
    BLOCK_SIZE,
    build_tiny_llama,
    close_llm,
    connector_of,
    engine_kwargs,
    full_hit_blocks,
    full_hit_tokens,
    generate,
    in_process_engines,
    kvray_transfer_config,
    make_prompts,
    token_ids,
)

pytestmark = [pytest.mark.vllm]

PROMPTS = make_prompts(4, 0, 7 * BLOCK_SIZE + 10, seed=21)
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory, ray_cluster: Any) -> Iterator[Any]:
    from vllm import LLM

    model = build_tiny_llama(tmp_path_factory.mktemp("pd-llama"))
    with in_process_engines():
        plain = LLM(**engine_kwargs(model))
        try:
            reference = token_ids(generate(plain, PROMPTS, MAX_TOKENS))
        finally:
            close_llm(plain)
        ns = f"pd{uuid.uuid4().hex[:8]}"
        llm = LLM(**engine_kwargs(model, kv_transfer_config=kvray_transfer_config(ns)))
        try:
            yield llm, reference
        finally:
            close_llm(llm)
            kvray.stop(ns)


def _run(llm: Any, prompt: list[int], max_tokens: int, params: dict[str, Any] | None) -> Any:
    from vllm import SamplingParams, TokensPrompt

    extra = {"kv_transfer_params": params} if params is not None else None
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, extra_args=extra)
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)
    return out


def _prefill(llm: Any, prompt: list[int]) -> dict[str, Any]:
    out = _run(llm, prompt, 1, {"do_remote_decode": True})
    assert out.kv_transfer_params is not None
    return dict(out.kv_transfer_params)


def _reset(llm: Any) -> None:
    """Empty the engine's own prefix cache (the prefill's blocks are held until stored)."""
    deadline = time.monotonic() + 60
    while not llm.reset_prefix_cache():
        assert time.monotonic() < deadline, "the prefill's blocks were never freed"
        time.sleep(0.05)
        _run(llm, [5, 6, 7], 1, None)  # engine steps report the stores


def _decode(llm: Any, prompt: list[int], params: dict[str, Any]) -> Any:
    """The decode, on an engine whose own prefix cache holds nothing of the prompt."""
    _reset(llm)
    return _run(llm, prompt, MAX_TOKENS, params)


@contextlib.contextmanager
def _feed_paused(llm: Any) -> Iterator[None]:
    """The scheduler's view gets no update while this is held (its feed waits on the lock)."""
    feed = connector_of(llm).store.feed
    with feed._cv:
        yield


def test_decode_loads_the_handoff_with_the_feed_paused(engines: Any) -> None:
    llm, reference = engines
    sched = connector_of(llm).scheduler
    prompt = PROMPTS[0]
    before = (sched.handoffs.offered_tokens, sched.counters.loaded_blocks)
    begun, computed = sched.handoffs.begun, sched.handoffs.computed_tokens
    timed, arrived = len(sched.handoffs.latencies_s), len(sched.handoffs.arrivals_s)
    with _feed_paused(llm):
        params = _prefill(llm, prompt)
        h = params["kvray"]
        assert h["n"] == len(prompt) // BLOCK_SIZE and h["pools"]
        out = _decode(llm, prompt, params)
        # The view never saw the prefill's blocks: only the params could name them.
        assert sched.manager.lookup([bytes(b) for b in _hashes(prompt)]) == 0
    assert list(out.outputs[0].token_ids) == reference[0]
    # The decode computed at most one block of the prompt itself.
    assert out.num_cached_tokens == full_hit_tokens(prompt)
    assert len(prompt) - out.num_cached_tokens <= BLOCK_SIZE
    assert sched.handoffs.offered_tokens - before[0] == full_hit_tokens(prompt)
    assert sched.counters.loaded_blocks - before[1] == full_hit_blocks(prompt)
    # The handoff's figures: one begun, the prompt's last partial block computed, one latency
    # and its first part (prefill finished -> the decode's scheduler saw the request).
    assert sched.handoffs.begun - begun == 1
    assert sched.handoffs.computed_tokens - computed == len(prompt) - full_hit_tokens(prompt)
    assert len(sched.handoffs.latencies_s) == timed + 1
    assert len(sched.handoffs.arrivals_s) == arrived + 1
    assert 0 <= sched.handoffs.arrivals_s[-1] <= sched.handoffs.latencies_s[-1]


def test_a_later_request_with_the_prefix_hits_kvray_on_either_side(engines: Any) -> None:
    """The handed-off blocks stay in kvray: once the engine's own cache is emptied, a later
    prefill (``do_remote_decode``) and a later plain (decode-side) request of the same prompt
    each load its full blocks from kvray through the view, hits counted by the scheduler and
    the workers, and the tokens are the reference's."""
    llm, reference = engines
    sched = connector_of(llm).scheduler
    prompt = PROMPTS[0]
    hashes = [bytes(b) for b in _hashes(prompt)]
    full = full_hit_tokens(prompt)
    _prefill(llm, prompt)
    _reset(llm)
    deadline = time.monotonic() + 30
    while sched.manager.lookup(hashes) * BLOCK_SIZE < full:  # the view catches up
        assert time.monotonic() < deadline, "the handed-off blocks never reached the view"
        time.sleep(0.05)
    for params in ({"do_remote_decode": True}, None):  # the prefill side, then the decode side
        hits, loaded, lookups = sched.hit_tokens, sched.counters.loaded_blocks, sched.lookups
        out = _run(llm, prompt, 1 if params else MAX_TOKENS, params)
        assert out.num_cached_tokens == full
        assert sched.hit_tokens - hits == full and sched.lookups > lookups
        _reset(llm)  # engine steps report the workers' loads
        assert sched.counters.loaded_blocks - loaded == full // BLOCK_SIZE
    assert list(out.outputs[0].token_ids) == reference[0]


def _hashes(prompt: list[int]) -> list[bytes]:
    from kvray.testing.engines import block_hashes

    return block_hashes(prompt)


def test_blocks_missing_at_load_time_are_recomputed(engines: Any) -> None:
    """The pool the params name is gone (or never held the blocks): the decode waits a bounded
    time, then recomputes; the tokens are the reference's."""
    llm, reference = engines
    sched = connector_of(llm).scheduler
    prompt = PROMPTS[1]
    params = _prefill(llm, prompt)
    lost = {**params, "kvray": {**params["kvray"], "pools": ["kvray-pool-gone"]}}
    failed = sched.counters.failed_blocks
    t0 = time.monotonic()
    out = _decode(llm, prompt, lost)
    assert time.monotonic() - t0 < 30
    assert list(out.outputs[0].token_ids) == reference[1]
    assert sched.counters.failed_blocks - failed == full_hit_blocks(prompt)
    # A pool that is alive but holds none of them (evicted): looked for, then recomputed.
    other = _prefill(llm, PROMPTS[2])
    pool = other["kvray"]["pools"][0]
    n = len(PROMPTS[3]) // BLOCK_SIZE
    fake = {
        "kvray": {
            **other["kvray"],
            "n": n,
            "last": _hashes(PROMPTS[3])[n - 1].hex(),
            "pools": [pool],
            "runs": [[n, [0]]],
        }
    }
    out = _decode(llm, PROMPTS[3], fake)
    assert list(out.outputs[0].token_ids) == reference[3]


def test_params_the_decode_cannot_read_are_ignored(engines: Any) -> None:
    llm, reference = engines
    sched = connector_of(llm).scheduler
    prompt = PROMPTS[2]
    params = _prefill(llm, prompt)
    bad = [
        {**params, "kvray": {**params["kvray"], "fp": "0" * 32}},  # another model or layout
        {**params, "kvray": {**params["kvray"], "last": "ab" * 32}},  # another prompt
        {**params, "kvray": {**params["kvray"], "runs": "garbage"}},
        {**params, "kvray": 42},
    ]
    for p in bad:
        rejected = sched.handoffs.rejected
        out = _decode(llm, prompt, p)
        assert list(out.outputs[0].token_ids) == reference[2]
        assert sched.handoffs.rejected == rejected + 1
