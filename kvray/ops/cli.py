"""The ``kvray`` command: start, stop, status, monitor, demo, serve.

Errors a user can hit (no cluster, auth, bad size, not started) print one line and exit 1;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from kvray.config import ConfigError, KVRayConfig, format_bytes
from kvray.errors import KVRayError

app = typer.Typer(
    name="kvray",
    help="kvray: a distributed KV cache for vLLM on Ray.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
# soft_wrap: an error stays one line when stderr is a pipe (rich would wrap at 80 columns).
err_console = Console(stderr=True, soft_wrap=True)

Address = Annotated[
    str | None,
    typer.Option(
        help="Ray cluster: auto, HOST:PORT or ray://HOST:PORT (default: RAY_ADDRESS/auto)"
    ),
]
Namespace = Annotated[str, typer.Option(help="kvray namespace (isolates deployments)")]


def _fail(message: str) -> None:
    err_console.print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(1)


def _run(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Call into kvray, turning the errors a user can cause into one clear line."""
    import ray

    try:
        return fn(*args, **kwargs)
    except (ConfigError, KVRayError) as e:
        _fail(str(e))
    except ray.exceptions.AuthenticationError as e:
        _fail(f"Ray refused the auth token: {e}")
    except ConnectionError as e:
        _fail(f"cannot reach the Ray cluster: {e}")


def _config(namespace: str, address: str | None, **fields: Any) -> KVRayConfig:
    try:
        return KVRayConfig.from_dict({"namespace": namespace, "address": address, **fields})
    except ConfigError as e:
        _fail(str(e))
        raise  # unreachable


@app.command()
def start(
    address: Address = None,
    capacity: Annotated[str, typer.Option(help="KV bytes per node, e.g. 8GiB")] = "1GiB",
    namespace: Namespace = "default",
    disk_dir: Annotated[
        str | None,
        typer.Option(help="disk tier: segment files under PATH/<namespace>/ on every node"),
    ] = None,
    disk_capacity: Annotated[
        str | None, typer.Option(help="disk tier bytes per node, e.g. 500GiB")
    ] = None,
    disk_admit_min_hits: Annotated[
        int, typer.Option(help="spill only blocks read at least N times")
    ] = 0,
) -> None:
    """Deploy kvray on a running Ray cluster (idempotent): an index and a pool per node."""
    import kvray
    from kvray.cluster import ensure_ray

    disk: dict[str, Any] = {"disk_admit_min_hits": disk_admit_min_hits}
    if disk_dir is not None:
        disk["disk_dir"] = os.path.abspath(os.path.expanduser(disk_dir))
    if disk_capacity is not None:
        disk["disk_capacity"] = disk_capacity
    cfg = _config(namespace, address, capacity=capacity, **disk)
    _run(ensure_ray, cfg.address)
    stats = _run(kvray.start, cfg)
    tier = ""
    if cfg.disk_dir is not None:
        tier = f", disk tier {format_bytes(cfg.disk_capacity)} per node in {cfg.disk_dir}"
    console.print(
        f"kvray started in namespace [bold]{namespace}[/]: {stats['pools']} pool(s), "
        f"{format_bytes(cfg.capacity)} per node{tier}"
    )


@app.command()
def stop(
    address: Address = None,
    namespace: Namespace = "default",
    purge: Annotated[
        bool, typer.Option("--purge", help="also delete the disk tier's files (kept otherwise)")
    ] = False,
) -> None:
    """Remove kvray (and the blocks it holds in RAM) from the cluster."""
    import kvray
    from kvray.cluster import ensure_ray

    _run(ensure_ray, address)
    removed = _run(kvray.stop, namespace, purge=purge)
    files = "; disk files deleted" if purge else ""
    console.print(
        f"kvray stopped in namespace [bold]{namespace}[/]: {removed} actor(s) removed{files}"
    )


@app.command()
def status(
    address: Address = None,
    namespace: Namespace = "default",
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
    watch: Annotated[
        bool, typer.Option("--watch", help="live view with loads/s and stores/s, until Ctrl-C")
    ] = False,
    interval: Annotated[float, typer.Option(help="seconds between --watch refreshes")] = 1.0,
) -> None:
    """Per-node blocks, bytes, hit rate, evictions, refused puts and lost blocks."""
    import kvray
    from kvray.cluster import ensure_ray

    if watch and as_json:
        _fail("--watch and --json cannot be combined")
    if watch and not 0.1 <= interval <= 3600:
        _fail(f"invalid --interval {interval!r}: expected 0.1 to 3600 seconds")
    cfg = _config(namespace, address)
    _run(ensure_ray, cfg.address)
    store = _run(kvray.connect, namespace, cfg)
    try:
        if watch:
            from kvray.ops.watch import watch as watch_view

            _run(watch_view, store, console, interval_s=interval)
            return
        stats = _run(store.stats)
    finally:
        store.close()
    if as_json:
        print(json.dumps(stats, indent=2, default=str))
        return
    console.print(_status_table(namespace, stats["nodes"]))
    idx = stats["index"]
    console.print(f"index: {idx['keys']:,} keys, {idx['pools']} live pool(s)")


_DISK_COLUMNS = ("disk blocks", "disk used / capacity", "spilled", "promoted", "disk skipped")


def _status_table(namespace: str, nodes: dict[str, dict[str, Any]]) -> Table:
    """One row per node: RAM tier, then (when the pools have one) the disk tier."""
    disk = any("disk_capacity" in s for s in nodes.values())
    table = Table(title=f"kvray namespace {namespace}")
    cols = ["node", "blocks", "used / capacity", "hit rate", "evictions", "refused", "lost"]
    for col in cols + list(_DISK_COLUMNS if disk else ()):
        table.add_column(col, justify="left" if col == "node" else "right")
    for node_id, s in sorted(nodes.items()):
        if "error" in s:
            table.add_row(node_id[:12], "-", s["error"][:40], *["-"] * (len(table.columns) - 3))
            continue
        asked = s["hits"] + s["misses"]
        rate = f"{100 * s['hits'] / asked:.1f}%" if asked else "-"
        row = [
            node_id[:12],
            f"{s['blocks']:,}",
            f"{format_bytes(s['bytes'])} / {format_bytes(s['capacity'])}",
            rate,
            f"{s['evictions']:,}",
            f"{s['refused']:,}",
            f"{s['lost']:,}",
        ]
        if disk:
            row += [
                f"{s.get('disk_blocks', 0):,}",
                f"{format_bytes(s.get('disk_bytes', 0))} / "
                f"{format_bytes(s.get('disk_capacity', 0))}",
                f"{s.get('spilled', 0):,}",
                f"{s.get('promoted', 0):,}",
                f"{s.get('disk_skipped', 0):,}",
            ]
        table.add_row(*row)
    return table


@app.command()
def monitor(
    address: Address = None,
    port: Annotated[int, typer.Option(help="Prometheus port (where the dashboard looks)")] = 9090,
    host: Annotated[str, typer.Option(help="Prometheus bind address")] = "127.0.0.1",
    scrape_interval: Annotated[
        float | None, typer.Option(help="seconds between scrapes (default: Ray's config, 10)")
    ] = None,
    data_dir: Annotated[
        str | None, typer.Option(help="keep Prometheus's data here (default: a temp dir)")
    ] = None,
    prometheus: Annotated[
        str | None, typer.Option(help="prometheus binary (default: the one on PATH)")
    ] = None,
) -> None:
    """Run Prometheus on the config Ray writes for its session, until Ctrl-C."""
    import signal
    import threading

    from kvray.cluster import ensure_ray
    from kvray.ops import monitor as monitor_mod

    if scrape_interval is not None and not 0.1 <= scrape_interval <= 3600:
        _fail(f"invalid --scrape-interval {scrape_interval!r}: expected 0.1 to 3600 seconds")
    _run(ensure_ray, address)

    stop = threading.Event()

    def _interrupt(signum: int, frame: Any) -> None:
        stop.set()  # not an exception: one raised inside a Ray call in flight can be lost

    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops Prometheus too, as Ctrl-C does
    rc = _run(
        monitor_mod.run,
        lambda line: console.print(line, highlight=False, soft_wrap=True),
        host=host,
        port=port,
        scrape_interval_s=scrape_interval,
        data_dir=data_dir,
        prometheus=prometheus,
        stop=stop,
    )
    if rc:
        raise typer.Exit(rc)


@app.command()
def demo(
    model_mb: Annotated[int, typer.Option(help="size of the random model to build")] = 60,
    prompt_tokens: Annotated[int, typer.Option(help="shared prefix length in tokens")] = 1024,
    prompts: Annotated[int, typer.Option(help="prompts per round")] = 4,
    store_only: Annotated[bool, typer.Option(help="store demo without vLLM")] = False,
    keep_dir: Annotated[bool, typer.Option(help="keep the model directory")] = False,
) -> None:
    """The main job: a local Ray cluster, a small random model, vLLM with kvray, two rounds."""
    from kvray.ops import demo as demo_mod

    _run(
        demo_mod.run,
        console,
        model_mb=model_mb,
        prompt_tokens=prompt_tokens,
        prompts=prompts,
        store_only=store_only,
        keep_dir=keep_dir,
    )


def _engine_args(pairs: list[str]) -> dict[str, Any]:
    """``key=value`` pairs; values are JSON when they parse (numbers, booleans), else strings."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            _fail(f"--engine-arg expects key=value, got {pair!r}")
        try:
            out[key.replace("-", "_")] = json.loads(value)
        except json.JSONDecodeError:
            out[key.replace("-", "_")] = value
    return out


@app.command()
def serve(
    model: Annotated[str, typer.Argument(help="model path or name for vLLM")],
    address: Address = None,
    namespace: Namespace = "default",
    replicas: Annotated[int, typer.Option(help="vLLM replicas (Ray Serve LLM deployment)")] = 2,
    served_model_name: Annotated[
        str | None, typer.Option(help="name clients send as 'model' (default: MODEL)")
    ] = None,
    capacity: Annotated[str, typer.Option(help="KV bytes per node, e.g. 8GiB")] = "1GiB",
    host: Annotated[str, typer.Option(help="HTTP bind address")] = "127.0.0.1",
    port: Annotated[
        int | None,
        typer.Option(help="HTTP port (default: the running Ray Serve's, else 8000)"),
    ] = None,
    num_cpus: Annotated[float, typer.Option(help="CPUs per replica")] = 1,
    num_gpus: Annotated[float, typer.Option(help="GPUs per replica (0 on CPU)")] = 0,
    router: Annotated[
        str | None,
        typer.Option(
            help="request router: kvray, prefix (Ray's) or pow2 (Serve's default); "
            "default kvray, or prefix with --kv-cache none"
        ),
    ] = None,
    kv_cache: Annotated[
        str,
        typer.Option(
            help="kvray (kvray's connector on every replica) or none: the same app without "
            "kvray, to measure what kvray gives"
        ),
    ] = "kvray",
    engine_arg: Annotated[
        list[str] | None,
        typer.Option(help="vLLM engine argument key=value (repeatable), e.g. max_model_len=4096"),
    ] = None,
    pd: Annotated[
        str | None,
        typer.Option(help="P:D: prefill/decode disaggregation, P prefill and D decode replicas"),
    ] = None,
    cpu_threads: Annotated[
        bool,
        typer.Option(
            help="CPU replicas: each engine its own share of unbound OpenMP threads (vLLM-CPU "
            "otherwise binds every replica of a node to the same cores), except on nodes that "
            "set VLLM_CPU_OMP_THREADS_BIND themselves; --no-cpu-threads keeps vLLM-CPU's "
            "binding everywhere"
        ),
    ] = True,
) -> None:
    """vLLM's OpenAI server on Ray Serve LLM, kvray on every replica, routed by kvray."""
    from kvray.cluster import ensure_ray

    cfg = _config(namespace, address, capacity=capacity)
    _run(ensure_ray, cfg.address)
    args = _engine_args(engine_arg or [])
    _run(
        _serve_until_interrupted,
        model,
        cfg,
        host,
        port,
        replicas=replicas,
        served_model_name=served_model_name,
        engine_args=args,
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        router=router,
        kv_cache=kv_cache,
        pd=pd,
        cpu_threads=cpu_threads,
    )


def _serve_until_interrupted(
    model: str, cfg: KVRayConfig, host: str, port: int | None, **app_args: Any
) -> None:
    """Start kvray and the app, print where it listens, block; Ctrl-C removes the app (and
    Ray Serve, when this started it: :mod:`kvray.serving.ingress`)."""
    import time
    from contextlib import ExitStack

    import kvray
    from kvray.serving import build_app
    from kvray.serving.ingress import serving

    if app_args.get("pd") is None:
        app_args.pop("pd", None)
    app_obj = build_app(model, namespace=cfg.namespace, **app_args)  # validates first
    with_kvray = app_args.get("kv_cache", "kvray") == "kvray"
    name = f"kvray-{cfg.namespace}"
    what = (
        f"{app_args['replicas']} replica(s)"
        if app_args.get("pd") is None
        else f"prefill:decode {app_args['pd']} replicas"
    )
    with ExitStack() as stack:
        with console.status(f"starting {what} (vLLM) on Ray Serve LLM"):
            # kvray starts once Serve listens where asked: a refusal leaves nothing started.
            prepare = (lambda: kvray.start(cfg)) if with_kvray else None
            ingress = stack.enter_context(serving(app_obj, name, host, port, prepare))
        if ingress.note:
            console.print(f"kvray serve: {ingress.note}", highlight=False)
        served = app_args.get("served_model_name") or model
        console.print(
            f"kvray serve: {what} of [bold]{served}[/] at {ingress.url} (OpenAI API; Ctrl-C stops)"
        )
        while True:
            time.sleep(3600)


def _fail_fast_on_refused_connections() -> None:
    """Ray retries joining a cluster ~20 times, 1 s apart, also when the token is wrong; a CLI
    should answer in seconds. (ray_constants is read at call time by ray.init.)"""
    try:
        from ray._private import ray_constants
    except ImportError:  # a Ray without it: keep Ray's own retries
        logging.getLogger(__name__).debug("kvray: ray._private.ray_constants not found")
        return
    if "RAY_NUM_REDIS_GET_RETRIES" not in os.environ:
        ray_constants.NUM_REDIS_GET_RETRIES = 3


def main() -> None:
    logging.basicConfig(
        level=os.environ.get("KVRAY_LOG_LEVEL", "WARNING"),
        format="%(levelname)s %(name)s: %(message)s",
    )
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    _fail_fast_on_refused_connections()
    try:
        app()
    except KeyboardInterrupt:
        err_console.print("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
