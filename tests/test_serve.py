"""Serving on Ray Serve LLM: one real app (2 replicas, vLLM on CPU, kvray) for the module.

Requests go through the real ``openai`` client over Serve's HTTP proxy, or through a
``DeploymentHandle`` to the LLM deployment when a test must know (or pick) the replica: its
``choose_replica`` runs the deployment's real request router (``KVRayRouter``) in this process.

On this single-host test cluster, vLLM's EngineCore and worker processes (children of a Serve
replica, not Ray workers) join Ray as drivers attached to the head node, so their saves land in
the head node's pool whatever node the replica runs on; the routing tests therefore place their
blocks on a replica's node explicitly, from a task pinned there.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
import uuid
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import ray
from ray.cluster_utils import Cluster

pytest.importorskip("vllm")
pytest.importorskip("ray.serve.llm")

from ray_fixtures import free_port

import kvray
from kvray.registry import KeySpaceInfo, clear_key_spaces, key_spaces, publish_key_space
from kvray.serving.inflight import TTL_S as INFLIGHT_TTL_S
from kvray.testing.engines import BLOCK_SIZE, build_text_model

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

APP = "kvray-test"
MODEL = "tiny"
VOCAB = 2048
ENGINE_ARGS: dict[str, Any] = {
    "enforce_eager": True,
    "dtype": "float32",
    "block_size": BLOCK_SIZE,
    # 4,096 tokens (128 blocks) per engine: a few 1,500-token prompts evict what it held.
    "kv_cache_memory_bytes": 8 << 20,
    "max_model_len": 2048,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 2048,
    "seed": 0,
    "enable_prompt_tokens_details": True,
}


@dataclass
class Served:
    namespace: str
    model_path: str
    base_url: str
    handle: Any
    loop: asyncio.AbstractEventLoop

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 300) -> Any:
        return self.loop.run_until_complete(asyncio.wait_for(coro, timeout))

    def client(self, timeout: float = 120) -> Any:
        from openai import OpenAI

        return OpenAI(base_url=self.base_url, api_key="unused", timeout=timeout, max_retries=0)


@pytest.fixture(scope="module")
def served(ray_cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    from ray import serve

    from kvray.serving import build_app

    model = build_text_model(tmp_path_factory.mktemp("serve") / "model", vocab=VOCAB)
    ns = f"serve{uuid.uuid4().hex[:6]}"
    kvray.start(namespace=ns, capacity="64MiB", health_check_interval_s=0.5)
    port = free_port()
    loop = asyncio.new_event_loop()
    try:
        app = build_app(
            model,
            namespace=ns,
            replicas=2,
            served_model_name=MODEL,
            engine_args=ENGINE_ARGS,
            num_cpus=2,  # a whole simulated node each: the replicas land on two nodes
            # a prompt computed once is found in kvray by the next request (the tiny model's
            # costs would leave first sightings unstored under the default "auto")
            kvray_config={"store_seen_only": False},
        )
        # One proxy (the head's): the clients call 127.0.0.1; a proxy per simulated node is ~5 CPU-s
        # of startup for nothing.
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        serve.run(app, name=APP, route_prefix="/", blocking=False)
        _wait_running(APP, timeout=600)
        handle = serve.get_deployment_handle(f"LLMServer:{MODEL}", APP).options(
            stream=True, method_name="completions"
        )
        yield Served(ns, model, f"http://127.0.0.1:{port}/v1", handle, loop)
    finally:
        serve.shutdown()  # gives the CPUs back to later tests
        loop.close()
        kvray.stop(ns)
        clear_key_spaces(ns)


def _wait_running(app: str, timeout: float) -> None:
    from ray import serve
    from ray.serve.schema import ApplicationStatus

    deadline = time.monotonic() + timeout
    while True:
        status = serve.status().applications.get(app)
        if status is not None and status.status == ApplicationStatus.RUNNING:
            return
        if status is not None and status.status == ApplicationStatus.DEPLOY_FAILED:
            raise RuntimeError(f"app failed to deploy: {status.message}")
        assert time.monotonic() < deadline, f"app not running after {timeout} s: {status}"
        time.sleep(0.25)


def _token_prompt(n_tokens: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n_tokens)]


def _completion(prompt: Any, **kw: Any) -> Any:
    from ray.serve.llm.openai_api_models import CompletionRequest

    return CompletionRequest(model=MODEL, prompt=prompt, temperature=0.0, **kw)


async def _collect(gen: Any) -> Any:
    """The one response of a non-streaming call through the handle (or its error)."""
    out = [chunk async for chunk in gen]
    assert len(out) == 1, out
    return out[0]


def _hasher(ns: str) -> Any:
    from kvray.serving.routeview import KeySpaceCache

    hasher = KeySpaceCache(ns).hasher(MODEL)
    assert hasher is not None, "no engine published its key space"
    return hasher


def _held(store: kvray.Store, ns: str, tokens: list[int]) -> dict[str, int]:
    from kvray.serving.routeview import held_blocks_by_node

    hasher = _hasher(ns)
    keys = hasher.keys_per_shard(hasher.block_hashes(tokens))
    return held_blocks_by_node(store.prefix_by_node, keys)


def _wait_held(store: kvray.Store, ns: str, tokens: list[int], blocks: int) -> dict[str, int]:
    deadline = time.monotonic() + 30
    while True:
        store.sync()
        held = _held(store, ns, tokens)
        if max(held.values(), default=0) >= blocks:
            return held
        assert time.monotonic() < deadline, f"kvray never held {blocks} blocks: {held}"
        time.sleep(0.2)


# ---------------------------------------------------------------- the OpenAI API


def test_models_text_chat_batch_and_n(served: Served) -> None:
    client = served.client()
    assert [m.id for m in client.models.list().data] == [MODEL]
    text = client.completions.create(
        model=MODEL, prompt="def add(a, b):\n    return", max_tokens=6, temperature=0
    )
    assert text.object == "text_completion"
    assert len(text.choices) == 1 and text.choices[0].text
    assert text.usage.completion_tokens == 6
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "import os\nprint(os.getcwd())"}],
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content
    assert chat.usage.completion_tokens == 5
    prompts = ["class A:", "def f(x):", "for i in range(3):"]
    batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=3, temperature=0)
    assert sorted(c.index for c in batch.choices) == [0, 1, 2]
    assert all(c.text for c in batch.choices)
    two = client.completions.create(
        model=MODEL, prompt="x = 1", max_tokens=4, n=2, temperature=0.8, seed=1
    )
    assert sorted(c.index for c in two.choices) == [0, 1]
    ids = client.completions.create(
        model=MODEL, prompt=_token_prompt(40, seed=5), max_tokens=3, temperature=0
    )
    assert ids.usage.prompt_tokens == 40


def test_streaming_equals_the_non_streamed_text(served: Served) -> None:
    client = served.client()
    kw: dict[str, Any] = {
        "model": MODEL,
        "prompt": "def main():\n    args = parse()\n",
        "max_tokens": 12,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    whole = client.completions.create(**kw).choices[0].text
    chunks = [c.choices[0].text for c in client.completions.create(stream=True, **kw)]
    assert len(chunks) > 1
    assert "".join(chunks) == whole


def test_a_bad_request_gets_vllms_error_not_a_hang(served: Served) -> None:
    from openai import BadRequestError

    client = served.client(timeout=60)
    t0 = time.monotonic()
    with pytest.raises(BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=_token_prompt(3000, seed=9), max_tokens=4)
    assert "maximum context length" in str(info.value)
    assert time.monotonic() - t0 < 60


# ---------------------------------------------------------------- kvray across replicas


def test_prefix_computed_on_one_replica_is_loaded_from_kvray_by_the_other(
    served: Served,
) -> None:
    """Both requests are placed before any block is in kvray, on two different replicas (the
    router sends the second where it sent the first until that replica's queue is long, here
    of held selections); the second runs only once kvray holds the first's blocks."""
    from contextlib import AsyncExitStack

    prefix = _token_prompt(6 * BLOCK_SIZE, seed=11)
    first = prefix + _token_prompt(20, seed=12)
    second = prefix + _token_prompt(20, seed=13)
    store = kvray.connect(served.namespace)
    try:

        async def scenario() -> tuple[str, str, Any, Any]:
            h = served.handle
            req1, req2 = _completion(first, max_tokens=4), _completion(second, max_tokens=4)
            async with AsyncExitStack() as stack:
                sel1 = await stack.enter_async_context(h.choose_replica(req1, None))
                for _ in range(12):
                    sel2 = await stack.enter_async_context(h.choose_replica(req2, None))
                    if sel2.replica_id == sel1.replica_id:
                        continue
                    out1 = await _collect(h.dispatch(sel1, req1, None))
                    hits0 = store.stats()["totals"]["hits"]
                    await asyncio.to_thread(_wait_held, store, served.namespace, first, 6)
                    out2 = await _collect(h.dispatch(sel2, req2, None))
                    hits = store.stats()["totals"]["hits"] - hits0
                    return sel1.replica_id, sel2.replica_id, (out1, out2), hits
            raise AssertionError("the router never offered the second replica")

        r1, r2, (out1, out2), hits = served.run(scenario())
    finally:
        store.close()
    assert r1 != r2
    assert out1.usage.prompt_tokens_details.cached_tokens == 0
    # The second replica never saw the prefix: its 6 blocks came from kvray.
    assert out2.usage.prompt_tokens_details.cached_tokens >= 6 * BLOCK_SIZE
    assert hits >= 6


def test_router_hashes_text_and_chat_like_the_engine(served: Served) -> None:
    """Keys the router derives from a text (and a chat) request are the keys the engine
    stored: the router's tokenizer renders and its hasher chains blocks exactly as vLLM."""
    from ray.serve.llm.openai_api_models import ChatCompletionRequest

    from kvray.serving.prompts import prompt_of, token_ids_of
    from kvray.serving.tokenize import EngineTokenizer

    client = served.client()
    text = "".join(f"value_{i} = compute({i}, cache=True)\n" for i in range(40))
    messages = [{"role": "system", "content": text}, {"role": "user", "content": "and then?"}]
    client.completions.create(model=MODEL, prompt=text, max_tokens=1)
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    engine = {**ENGINE_ARGS, "model": served.model_path, "served_model_name": [MODEL]}
    tokenizer = EngineTokenizer(engine)
    chat = ChatCompletionRequest(model=MODEL, messages=messages, max_tokens=1)
    store = kvray.connect(served.namespace)
    try:
        for request in (_completion(text, max_tokens=1), chat):
            source = prompt_of(request)
            assert source is not None
            tokens = served.run(token_ids_of(source, tokenizer))
            assert tokens is not None and len(tokens) >= 4 * BLOCK_SIZE
            _wait_held(store, served.namespace, tokens, len(tokens) // BLOCK_SIZE)
    finally:
        store.close()


@ray.remote(num_cpus=0)
def _seed_blocks(namespace: str, keys: list[list[bytes]]) -> str:
    """Store blocks under ``keys`` from this task's node (its pool)."""
    store = kvray.connect(namespace)
    try:
        for shard in keys:
            blocks = [np.zeros(4096, np.uint8) for _ in shard]
            assert store.put(shard, blocks).result(timeout=60).stored == len(shard)
    finally:
        store.close()
    return ray.get_runtime_context().get_node_id()


def _replica_nodes(served: Served) -> dict[str, str]:
    """replica id -> node id, from the router's own picks of cold prompts."""

    async def pick(i: int) -> tuple[str, str]:
        req = _completion(_token_prompt(8, seed=1000 + i), max_tokens=1)
        async with served.handle.choose_replica(req, None) as sel:
            return sel.replica_id, sel.node_id

    nodes: dict[str, str] = {}
    for i in range(40):
        rid, node = served.run(pick(i))
        nodes[rid] = node
        if len(nodes) == 2:
            return nodes
    raise AssertionError(f"found {len(nodes)} replica(s)")


def test_router_sends_a_prompt_to_the_replica_on_the_node_holding_its_prefix(
    served: Served,
) -> None:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = _replica_nodes(served)
    assert len(set(nodes.values())) == 2, "two CPUs each spread the replicas"
    hasher = _hasher(served.namespace)
    store = kvray.connect(served.namespace)
    try:
        for n, (rid, node) in enumerate(sorted(nodes.items()) * 2):
            prompt = _token_prompt(5 * BLOCK_SIZE + 7, seed=2000 + n)
            keys = hasher.keys_per_shard(hasher.block_hashes(prompt))
            pinned = NodeAffinitySchedulingStrategy(node_id=node, soft=False)
            assert (
                ray.get(
                    _seed_blocks.options(scheduling_strategy=pinned).remote(served.namespace, keys),
                    timeout=120,
                )
                == node
            )
            store.sync()
            assert _held(store, served.namespace, prompt)[node] == 5

            async def pick(p: list[int] = prompt) -> tuple[str, str]:
                async with served.handle.choose_replica(_completion(p, max_tokens=1), None) as s:
                    return s.replica_id, s.node_id

            assert served.run(pick()) == (rid, node)
            # Never piled on one replica: with enough requests held there, the rest go on.
            if n == 0:
                assert _spills_over(served, prompt, rid)
    finally:
        store.close()


def _spills_over(served: Served, prompt: list[int], preferred: str) -> bool:
    """Hold requests for ``prompt`` open until one goes to another replica than
    ``preferred``: True if that happens within the router's imbalance threshold (+ slack)."""

    async def hold() -> bool:
        from contextlib import AsyncExitStack

        async with AsyncExitStack() as stack:
            for _ in range(10):
                sel = await stack.enter_async_context(
                    served.handle.choose_replica(_completion(prompt, max_tokens=1), None)
                )
                if sel.replica_id != preferred:
                    return True
        return False

    return bool(served.run(hold()))


# ---------------------------------------------------------------- registry and backend


def test_key_space_registry_round_trip(ray_cluster: Cluster) -> None:
    ns = f"reg{uuid.uuid4().hex[:6]}"
    node = ray.get_runtime_context().get_node_id()
    info = KeySpaceInfo("m/path", 32, "sha256", [b"p0", b"p1"], node, served_model_names=["m"])
    publish_key_space(ns, info)
    publish_key_space(ns, KeySpaceInfo("m/path", 32, "sha256", [b"p0", b"p1"], node))  # same key
    publish_key_space(ns, KeySpaceInfo("other", 16, "sha256", [b"q"], node))
    try:
        assert len(key_spaces(ns)) == 2  # one record per model, layout and node
        (got,) = key_spaces(ns, "m/path")
        assert got.key_prefixes == [b"p0", b"p1"] and got.block_size == 32
        assert key_spaces(ns, "other")[0].block_size == 16
        assert key_spaces(ns, "nope") == []
        with pytest.raises(ValueError, match="key_prefixes"):
            KeySpaceInfo("m", 32, "sha256", [], node)
    finally:
        assert clear_key_spaces(ns) == 2
    assert key_spaces(ns) == []


def test_backend_is_registered_and_fills_in_the_connector(served: Served) -> None:
    """The app was built naming only ``KVRayConnector``: the backend added the rest (vLLM could
    not have loaded the connector otherwise), and every process resolves it by name."""
    from ray.llm._internal.serve.engines.vllm.kv_transfer.factory import (
        KVConnectorBackendFactory,
    )

    from kvray.serving.backend import KVRayConnectorBackend

    assert KVConnectorBackendFactory.get_backend_class("KVRayConnector") is KVRayConnectorBackend
    infos = key_spaces(served.namespace, MODEL)
    assert infos and all(i.model == served.model_path for i in infos)
    assert infos[0].block_size == BLOCK_SIZE and infos[0].hash_algo == "sha256"


def test_backend_setup_completes_a_user_config(ray_cluster: Cluster) -> None:
    from kvray.cluster import NODE_ENV
    from kvray.config import ConfigError
    from kvray.serving.app import build_llm_config
    from kvray.serving.backend import RESERVED_CPU_ENV, KVRayConnectorBackend

    # setup() names this node for the engine processes it will start; the pytest process must
    # not keep it, or every raylet a later test adds inherits it and writes to this node's pool.
    assert NODE_ENV not in os.environ
    reserved = os.environ.get(RESERVED_CPU_ENV)
    try:
        cfg = build_llm_config("/models/m", namespace="ns1", router="pow2")
        KVRayConnectorBackend(cfg).setup()
        assert os.environ[NODE_ENV] == ray.get_runtime_context().get_node_id()
        # vLLM-CPU's core reservation stays what it is without a connector: one per rank.
        assert os.environ[RESERVED_CPU_ENV] == (reserved or "1")
        ktc = cfg.engine_kwargs["kv_transfer_config"]
        assert ktc["kv_connector_module_path"] == "kvray.connector"
        assert ktc["kv_role"] == "kv_both" and ktc["kv_load_failure_policy"] == "recompute"
        extra = ktc["kv_connector_extra_config"]
        assert extra["namespace"] == "ns1"
        assert extra["address"] == ray.get_runtime_context().gcs_address
        bad = build_llm_config("/models/m", router="pow2")
        bad.engine_kwargs["kv_transfer_config"]["kv_connector_extra_config"]["capacty"] = "1GiB"
        os.environ.pop(NODE_ENV)
        with pytest.raises(ConfigError, match="capacty"):
            KVRayConnectorBackend(bad).setup()
        assert NODE_ENV not in os.environ  # a refused config changes nothing
    finally:
        os.environ.pop(NODE_ENV, None)
        if reserved is None:
            os.environ.pop(RESERVED_CPU_ENV, None)


def test_cli_serve_refuses_bad_arguments_in_one_line(ray_cluster: Cluster) -> None:
    from typer.testing import CliRunner

    from kvray.ops.cli import app

    runner = CliRunner()
    bad_router = runner.invoke(app, ["serve", "/models/m", "--router", "fastest"])
    assert bad_router.exit_code == 1
    assert "invalid router='fastest'" in bad_router.output
    assert "Traceback" not in bad_router.output
    bad_arg = runner.invoke(app, ["serve", "/models/m", "--engine-arg", "max_model_len"])
    assert bad_arg.exit_code == 1
    assert "--engine-arg expects key=value" in bad_arg.output
    reserved = runner.invoke(app, ["serve", "/models/m", "--engine-arg", "model=other"])
    assert reserved.exit_code == 1 and "set by build_app" in reserved.output


def test_kv_cache_none_builds_the_same_app_without_kvray() -> None:
    from kvray.config import ConfigError
    from kvray.serving.app import build_llm_config

    on = build_llm_config("/models/m", namespace="ns1", engine_args={"max_model_len": 512})
    off = build_llm_config("/models/m", kv_cache="none", engine_args={"max_model_len": 512})
    assert on.engine_kwargs["kv_transfer_config"]["kv_connector"] == "KVRayConnector"
    assert "kv_transfer_config" not in off.engine_kwargs
    assert off.engine_kwargs["max_model_len"] == on.engine_kwargs["max_model_len"] == 512
    # Without kvray the default router is Ray's prefix-affinity router; kvray's needs kvray.
    router = off.deployment_config["request_router_config"].request_router_class
    assert router.endswith("PrefixCacheAffinityRouter")
    with pytest.raises(ConfigError, match="kv_cache"):
        build_llm_config("/models/m", kv_cache="none", router="kvray")
    with pytest.raises(ConfigError, match="kv_cache"):
        build_llm_config("/models/m", kv_cache="lmcache")  # type: ignore[arg-type]


def test_cpu_replicas_get_their_own_unbound_threads_and_a_users_env_wins() -> None:
    from kvray.serving.app import BIND_ENV, THREADS_KWARG, build_llm_config

    def shares(cfg: Any) -> dict[str, str]:
        return dict(cfg.callback_config.callback_kwargs.get(THREADS_KWARG) or {})

    for kv_cache in ("kvray", "none"):  # the baseline without kvray gets the same
        cfg = build_llm_config("/models/m", kv_cache=kv_cache, num_cpus=4)  # type: ignore[arg-type]
        assert shares(cfg) == {BIND_ENV: "nobind", "OMP_NUM_THREADS": "3"}
        assert not (cfg.runtime_env or {}).get("env_vars")  # the node's binding must show
    tp2 = build_llm_config("/models/m", num_cpus=8, engine_args={"tensor_parallel_size": 2})
    assert shares(tp2)["OMP_NUM_THREADS"] == "3"  # 4 a rank, less one
    one = build_llm_config("/models/m", num_cpus=1)
    assert shares(one)["OMP_NUM_THREADS"] == "1"
    mine = build_llm_config(
        "/models/m",
        num_cpus=4,
        runtime_env={"env_vars": {BIND_ENV: "0-1", "X": "y"}, "pip": ["six"]},
    )
    assert mine.runtime_env["env_vars"] == {BIND_ENV: "0-1", "X": "y"}
    assert shares(mine) == {"OMP_NUM_THREADS": "3"}
    assert mine.runtime_env["pip"] == ["six"]
    gpu = build_llm_config("/models/m", num_cpus=4, num_gpus=1)
    assert not shares(gpu) and not (gpu.runtime_env or {}).get("env_vars")
    kept = build_llm_config("/models/m", num_cpus=4, cpu_threads=False)  # the nodes' binding
    assert not shares(kept) and not (kept.runtime_env or {}).get("env_vars")


def test_a_nodes_own_binding_wins_over_the_thread_shares() -> None:
    """The replica's callback sets the shares in its environment before the engine starts
    (the engine's processes inherit it), except where the node already binds: an operator's
    ``VLLM_CPU_OMP_THREADS_BIND=... ray start`` reaches the engine unchanged. Through the
    replica's runtime_env (before), the shares overrode it."""
    import asyncio

    from kvray.serving.app import BIND_ENV, build_llm_config
    from kvray.serving.nodeinit import SkipIdleNodeInit, apply_thread_shares

    shares = {BIND_ENV: "nobind", "OMP_NUM_THREADS": "3"}
    node = {BIND_ENV: "0-1|2-3", "OMP_NUM_THREADS": "1"}
    assert not apply_thread_shares(shares, node)
    assert node == {BIND_ENV: "0-1|2-3", "OMP_NUM_THREADS": "1"}
    plain = {"OMP_NUM_THREADS": "1"}  # what Ray sets in a worker with no CPUs of its own
    assert apply_thread_shares(shares, plain) and plain == shares
    user_bound = {BIND_ENV: "0-1"}  # the user's runtime_env bound: only the threads are ours
    assert apply_thread_shares({"OMP_NUM_THREADS": "3"}, user_bound)
    assert user_bound == {BIND_ENV: "0-1", "OMP_NUM_THREADS": "3"}

    # The callback as Ray Serve LLM runs it in a replica, on this process's environment.
    cfg = build_llm_config("/models/m", num_cpus=4)
    saved = {k: os.environ.get(k) for k in shares}
    try:
        os.environ[BIND_ENV] = "0-1|2-3"
        asyncio.run(
            SkipIdleNodeInit(cfg, **cfg.callback_config.callback_kwargs).on_before_node_init()
        )
        assert os.environ[BIND_ENV] == "0-1|2-3"
        del os.environ[BIND_ENV]
        asyncio.run(
            SkipIdleNodeInit(cfg, **cfg.callback_config.callback_kwargs).on_before_node_init()
        )
        assert {k: os.environ[k] for k in shares} == shares
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_node_init_is_skipped_only_where_it_would_fetch_nothing(tmp_path: Any) -> None:
    """Ray Serve LLM's per-replica node-initialization task only downloads from a cloud
    mirror: kvray's callback skips it for a local model or a plain model id, never for an
    ``s3://`` or ``gs://`` source (both apps, with and without kvray)."""
    import asyncio

    from kvray.serving.app import NODE_INIT_CALLBACK, build_llm_config
    from kvray.serving.nodeinit import SkipIdleNodeInit

    def runs_init(model: str, **kw: Any) -> bool:
        cfg = build_llm_config(model, **kw)
        assert cfg.callback_config.callback_class == NODE_INIT_CALLBACK
        callback = SkipIdleNodeInit(cfg)
        asyncio.run(callback.on_before_node_init())
        return callback.ctx.run_init_node

    assert not runs_init(str(tmp_path))
    assert not runs_init("meta-llama/Llama-3.2-1B", kv_cache="none")
    assert runs_init("s3://bucket/models/llama")
    assert runs_init("gs://bucket/models/llama", kv_cache="none")


def test_no_replica_ran_a_node_initialization_task(served: Served) -> None:
    """The served app's replicas (a local model) started without Ray's download task: the
    task listing of the whole cluster has none."""
    from ray.util.state import list_tasks

    ran = list_tasks(filters=[("name", "=", "initialize_remote_node")], timeout=30)
    assert ran == [], ran


def test_every_replicas_engine_runs_with_its_own_unbound_threads(served: Served) -> None:
    """What build_app sets reaches the processes that run the forward pass: every process
    under each replica (engine core, workers), read from /proc, not from the config."""
    import os

    import psutil
    import ray

    from kvray.serving.app import BIND_ENV

    replicas = [
        ray.get_actor(a["name"], namespace="serve")
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(f"SERVE_REPLICA::{APP}#LLMServer")
    ]
    assert len(replicas) == 2
    for replica in replicas:
        pid = ray.get(replica.__ray_call__.remote(lambda self: os.getpid()), timeout=30)
        engine = psutil.Process(pid).children(recursive=True)
        assert any("VLLM" in p.name() for p in engine), engine
        for proc in engine:
            env = proc.environ()
            assert env.get(BIND_ENV) == "nobind" and env.get("OMP_NUM_THREADS") == "1", proc


# ---------------------------------------------------------------- the engine tier and the score


def _uid(sel: Any) -> str:
    rid = sel.replica_id
    return str(getattr(rid, "unique_id", rid))


def _engine_held(store: kvray.Store, ns: str, tokens: list[int]) -> dict[str, int]:
    """Per replica (Serve's unique id): leading blocks of ``tokens`` in its engine cache."""
    from kvray.meta.ids import engine_ids

    held = store.local_view().engine_prefix(engine_ids(_hasher(ns).block_hashes(tokens)))
    return {key: n for key, (n, _) in held.items()}


def _wait_engine(store: kvray.Store, ns: str, tokens: list[int], cond: Any) -> dict[str, int]:
    deadline = time.monotonic() + 30
    while True:
        held = _engine_held(store, ns, tokens)
        if cond(held):
            return held
        assert time.monotonic() < deadline, f"engine tier never got there: {held}"
        time.sleep(0.05)


def _picks(served: Served, prompt: list[int], n: int) -> list[str]:
    async def pick() -> str:
        async with served.handle.choose_replica(_completion(prompt, max_tokens=1), None) as s:
            return _uid(s)

    return [served.run(pick()) for _ in range(n)]


def test_next_turn_follows_the_engine_cache_then_load_then_eviction(served: Served) -> None:
    """Turn 2 goes where turn 1's blocks sit in the engine; with that replica's queue long it
    goes elsewhere and the prefix loads from kvray (hits counted); once the engines evict it
    (other prompts fill their caches: vLLM's BlockRemoved events) and the router's memory of
    where it sent turn 2 has expired, turn 2 goes where kvray holds the prefix (its node's
    pool), as a prompt no engine holds."""
    ns = served.namespace
    turn1 = _token_prompt(6 * BLOCK_SIZE + 5, seed=3000)
    turn2 = turn1 + _token_prompt(2 * BLOCK_SIZE, seed=3001)
    client = served.client()
    store = kvray.connect(ns)
    try:
        client.completions.create(model=MODEL, prompt=turn1, max_tokens=4, temperature=0)
        held = _wait_engine(store, ns, turn1, lambda h: max(h.values(), default=0) >= 6)
        (holder,) = [k for k, c in held.items() if c >= 6]
        assert _picks(served, turn2, 6) == [holder] * 6
        _wait_held(store, ns, turn1, 6)  # the holder's connector saved turn 1 to kvray

        async def long_queue() -> tuple[str, Any, int]:
            """Requests held on the holder until one goes elsewhere: that one's replica, its
            response and the kvray hits it made."""
            from contextlib import AsyncExitStack

            async with AsyncExitStack() as stack:
                for _ in range(12):
                    req = _completion(turn2, max_tokens=2)
                    sel = await stack.enter_async_context(served.handle.choose_replica(req, None))
                    if _uid(sel) != holder:
                        hits0 = store.stats()["totals"]["hits"]
                        out = await _collect(served.handle.dispatch(sel, req, None))
                        return _uid(sel), out, store.stats()["totals"]["hits"] - hits0
            raise AssertionError("the holder's queue never sent the turn elsewhere")

        other, out, hits = served.run(long_queue())
        routed_at = time.monotonic()
        assert other != holder
        assert out.usage.prompt_tokens_details.cached_tokens >= 6 * BLOCK_SIZE
        assert hits >= 6  # loaded from kvray, not recomputed

        # Unrelated long prompts fill both engines' caches until vLLM evicts turn 1's blocks.
        deadline = time.monotonic() + 120
        for i in range(1000):
            if max(_engine_held(store, ns, turn1).values(), default=0) == 0:
                break
            assert time.monotonic() < deadline, "the engines never evicted turn 1"
            client.completions.create(
                model=MODEL, prompt=_token_prompt(1500, seed=4000 + i), max_tokens=1
            )
        # The router counts turn 2 as in the holder's engine for INFLIGHT_TTL_S after it last
        # sent it there (a queued request shares the prefix the one before computes).
        time.sleep(max(0.0, routed_at + INFLIGHT_TTL_S - time.monotonic()))
        held = _wait_held(store, ns, turn1, 6)
        on_pool_node = {
            str(getattr(rid, "unique_id", rid))
            for rid, node in _replica_nodes(served).items()
            if held.get(node, 0) >= 6
        }
        assert _picks(served, turn2, 1)[0] in on_pool_node, (held, holder)
    finally:
        store.close()


def test_a_burst_sharing_a_cold_prefix_goes_to_one_replica_and_computes_it_once(
    served: Served,
) -> None:
    """Three prompts sharing 6 blocks that no cache holds, routed back to back before any is
    scheduled: the router remembers where it sent the first, the others follow it (its queue
    is short), and that engine computes the shared prefix once (vLLM counts it as cached for
    the other two)."""
    from contextlib import AsyncExitStack

    prefix = _token_prompt(6 * BLOCK_SIZE, seed=3200)
    prompts = [prefix + _token_prompt(BLOCK_SIZE + 5, seed=3201 + i) for i in range(3)]

    async def burst() -> tuple[list[str], list[Any]]:
        async with AsyncExitStack() as stack:
            reqs = [_completion(p, max_tokens=1) for p in prompts]
            sels = [
                await stack.enter_async_context(served.handle.choose_replica(r, None)) for r in reqs
            ]
            calls = [served.handle.dispatch(s, r, None) for s, r in zip(sels, reqs, strict=True)]
            outs = await asyncio.gather(*(_collect(c) for c in calls))
            return [_uid(s) for s in sels], list(outs)

    uids, outs = served.run(burst())
    assert len(set(uids)) == 1, uids
    cached = sorted(o.usage.prompt_tokens_details.cached_tokens or 0 for o in outs)
    assert cached[0] == 0 and cached[1] >= 6 * BLOCK_SIZE, cached


def test_a_concurrent_burst_of_cold_prompts_spreads_over_the_replicas(served: Served) -> None:
    """Eight prompts no cache holds, routed at once: Serve counts each in its replica's queue
    only when the replica answers, after the router has ranked the others; the router adds
    its own decisions not counted yet, so the two replicas get four each (seeing both queues
    empty each time, it picked by chance: four each one time in four)."""
    from collections import Counter
    from contextlib import AsyncExitStack

    prompts = [_token_prompt(3 * BLOCK_SIZE + 5, seed=3300 + i) for i in range(8)]

    async def burst() -> list[str]:
        async with AsyncExitStack() as stack:
            reqs = [_completion(p, max_tokens=1) for p in prompts]
            sels = await asyncio.gather(
                *(stack.enter_async_context(served.handle.choose_replica(r, None)) for r in reqs)
            )
            return [_uid(s) for s in sels]  # not dispatched: the slots are released on exit

    uids = served.run(burst())
    assert sorted(Counter(uids).values()) == [4, 4], uids


def test_text_chat_and_token_prompts_are_scored_off_the_loop(served: Served) -> None:
    """The router's own lookup (its thread, its loop) finds each kind of prompt in the engine
    that served it, with the engine's own tokenization and hashing."""
    from ray.serve.llm.openai_api_models import ChatCompletionRequest

    from kvray.serving.prompts import prompt_of
    from kvray.serving.router import KVRayRouter

    text = "".join(f"total_{i} = add(total_{i - 1}, {i})\n" for i in range(1, 40))
    messages = [{"role": "system", "content": text}, {"role": "user", "content": "next?"}]
    tokens = _token_prompt(5 * BLOCK_SIZE + 3, seed=3100)
    client = served.client()
    client.completions.create(model=MODEL, prompt=text, max_tokens=1)
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    client.completions.create(model=MODEL, prompt=tokens, max_tokens=1)
    router = KVRayRouter.__new__(KVRayRouter)
    engine = {**ENGINE_ARGS, "model": served.model_path, "served_model_name": [MODEL]}
    router.initialize_state(namespace=served.namespace, engine_kwargs=engine)
    deadline = time.monotonic() + 120
    while router._tokenizer is None or router._store is None:
        assert time.monotonic() < deadline, "the router's warm-up never finished"
        time.sleep(0.2)
    chat = ChatCompletionRequest(model=MODEL, messages=messages, max_tokens=1)
    for request in (_completion(text, max_tokens=1), chat, _completion(tokens, max_tokens=1)):
        source = prompt_of(request)
        assert source is not None
        end = time.monotonic() + 30
        while True:
            tiers = served.run(router.prompt_tiers(source))
            assert not isinstance(tiers, str), tiers
            assert tiers.total >= 4
            if max(c for c, _ in tiers.engine.values()) == tiers.total == tiers.anywhere:
                break  # in the engine that served it, and in kvray (saved by its connector)
            assert time.monotonic() < end, f"{type(request).__name__} not in an engine: {tiers}"
            time.sleep(0.1)


#: GCS methods a per-request or per-step call from kvray would show up in (handle lookups,
#: subscriber polls, internal KV reads, task events of actor calls), and what the whole served
#: app may make of them per request. Measured here (12 requests after a warm-up): 0, 0.08,
#: 0.42 and 2.1 (task events go out once a second per process, so they follow the wall
#: time); the bounds are about 3x that. The subscriber storm issue 17 found made ~2,000
#: polls a request.
GCS_PER_REQUEST = {
    "ActorInfoGcsService.GetNamedActorInfo": 0.25,
    "ObservabilityPubSubService.GcsSubscriberPoll": 1.0,
    "InternalKVGcsService.InternalKVGet": 1.5,
    "TaskInfoGcsService.AddTaskEventData": 6.0,
}


@pytest.mark.quiet
def test_gcs_calls_per_request_stay_bounded(served: Served) -> None:
    """Requests through the app (each prompt twice: stored, then served from a cache) make no
    GCS call of their own: kvray's handles are resolved once and its threads do not poll the
    GCS; Ray's task events stay at their once-a-second batches."""
    from kvray.testing.probe import gcs_rpc_snapshot, metrics_urls

    urls = metrics_urls()
    client = served.client()
    prompts = [_token_prompt(5 * BLOCK_SIZE + 7, seed=5000 + i) for i in range(6)]
    for i in range(4):  # untimed: each engine resolves its handles once, at its first requests
        client.completions.create(
            model=MODEL, prompt=_token_prompt(40, seed=4900 + i), max_tokens=2
        )
    before = gcs_rpc_snapshot(urls)
    for p in prompts + prompts:
        client.completions.create(model=MODEL, prompt=p, max_tokens=4, temperature=0)
    after = gcs_rpc_snapshot(urls)
    n = 2 * len(prompts)
    per_request = {m: (after[m] - before[m]) / n for m in GCS_PER_REQUEST}
    print("GCS RPCs per request:", per_request, "all:", sum((after - before).values()) / n)
    assert all(per_request[m] <= bound for m, bound in GCS_PER_REQUEST.items()), per_request
