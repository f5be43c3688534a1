"""Real vLLM engines on the CPU, for the tests and the benchmarks.

A tiny random Llama is written to disk at test time (no download, seconds), prompts are given
as token ids (``skip_tokenizer_init``), and the model runs in float32 so that greedy token ids
are exactly reproducible whichever path (recompute, vLLM prefix hit, kvray hit) computed the KV.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

#: Tokens per KV block in every test (the CPU backend wants a multiple of 32).
BLOCK_SIZE = 32
VOCAB = 512


def build_tiny_llama(
    path: str | os.PathLike[str],
    *,
    hidden: int = 256,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 64,
    intermediate: int = 512,
    vocab: int = VOCAB,
    max_pos: int = 8192,
    dtype: str = "float32",
    seed: int = 0,
) -> str:
    """Write a random Llama checkpoint (config + safetensors) to ``path`` and return it.

    Idempotent: an existing checkpoint with the same config is reused.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(path)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype=dtype,
    )
    return _write_random_checkpoint(out, LlamaForCausalLM, cfg, seed, dtype)


def _write_random_checkpoint(out: Path, model_cls: Any, cfg: Any, seed: int, dtype: str) -> str:
    """Write a random ``model_cls(cfg)`` checkpoint to ``out`` (idempotent: a checkpoint of the
    same config there is reused) and return its path."""
    import torch

    marker = out / "kvray_model.json"
    want = json.dumps(cfg.to_dict(), sort_keys=True, default=str)
    if marker.exists() and marker.read_text() == want:
        return str(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = model_cls(cfg)
    # Larger-than-default init spreads the logits so greedy argmax ties are rare.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.05)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(out, safe_serialization=True)
    marker.write_text(want)
    return str(out)


def build_tiny_gemma3(
    path: str | os.PathLike[str],
    *,
    layers: int = 4,
    sliding_window: int = 128,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 64,
    vocab: int = VOCAB,
    seed: int = 0,
) -> str:
    """A random float32 Gemma-3 text model: sliding-window and full-attention layers
    alternating (vLLM's hybrid manager gives each kind its KV cache group). Idempotent."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    out = Path(path)
    cfg = Gemma3TextConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=8192,
        sliding_window=sliding_window,
        layer_types=[
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
        ],
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        torch_dtype="float32",
    )
    return _write_random_checkpoint(out, Gemma3ForCausalLM, cfg, seed, "float32")


def build_tiny_qwen3_next(
    path: str | os.PathLike[str],
    *,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 64,
    vocab: int = VOCAB,
    seed: int = 0,
) -> str:
    """A random bfloat16 Qwen3-Next: gated-delta-net (linear attention, a recurrent state per
    request) and full-attention layers alternating, 4 layers, dense MLPs on the first and
    third, 4 experts on the others. vLLM keeps the linear layers' state in a Mamba KV cache
    group; its CPU kernels for them need bfloat16. Idempotent."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    out = Path(path)
    cfg = Qwen3NextConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=4,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        layer_types=["linear_attention", "full_attention"] * 2,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        mlp_only_layers=[0, 2],
        num_experts=4,
        num_experts_per_tok=1,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    return _write_random_checkpoint(out, Qwen3NextForCausalLM, cfg, seed, "bfloat16")


def make_prompts(
    n: int, prefix_len: int, suffix_len: int, *, seed: int = 0, vocab: int = VOCAB
) -> list[list[int]]:
    """``n`` prompts sharing one random prefix of ``prefix_len`` tokens, then distinct suffixes."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(3, vocab) for _ in range(suffix_len)] for _ in range(n)]


def full_hit_tokens(prompt: Sequence[int]) -> int:
    """Tokens a complete kvray hit of ``prompt`` reports to vLLM: its whole blocks, and at
    least one token left to compute (a prompt that fills its last block: all but one)."""
    return min(len(prompt) // BLOCK_SIZE * BLOCK_SIZE, len(prompt) - 1)


def full_hit_blocks(prompt: Sequence[int]) -> int:
    """Blocks a complete kvray hit of ``prompt`` loads: every whole block of it."""
    return len(prompt) // BLOCK_SIZE


@contextlib.contextmanager
def in_process_engines() -> Iterator[None]:
    """vLLM engines built inside run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
    so a test can reach the scheduler's connector; the variable is restored after."""
    old = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = old


def block_hashes(prompt: Sequence[int]) -> list[bytes]:
    """vLLM's block hashes of a prompt's full blocks, as this process' engine computes them."""
    import vllm.v1.core.kv_cache_utils as kcu
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash

    if kcu.NONE_HASH is None:
        init_none_hash(sha256)
    parent, out = kcu.NONE_HASH, []
    for i in range(len(prompt) // BLOCK_SIZE):
        parent = hash_block_tokens(sha256, parent, prompt[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
        out.append(bytes(parent))
    return out


def kvray_transfer_config(namespace: str, **extra: Any) -> dict[str, Any]:
    """The ``kv_transfer_config`` a user passes to select kvray."""
    return {
        "kv_connector": "KVRayConnector",
        "kv_connector_module_path": "kvray.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"namespace": namespace, **extra},
    }


def scheduler_vllm_config(
    model_dir: str,
    namespace: str,
    *,
    max_num_batched_tokens: int = 512,
    events: bool = False,
    **extra: Any,
) -> Any:
    """A ``VllmConfig`` for vLLM's real ``Scheduler`` on the CPU with kvray selected (``extra``:
    its ``kv_connector_extra_config``; ``events``: KV cache events on, published nowhere)."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVEventsConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    return VllmConfig(
        model_config=ModelConfig(
            model=model_dir, dtype="float32", seed=0, skip_tokenizer_init=True
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=1024,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
            async_scheduling=False,
        ),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(**kvray_transfer_config(namespace, **extra)),
        device_config=DeviceConfig("cpu"),
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null")
        if events
        else None,
    )


def engine_kwargs(
    model: str,
    *,
    kv_transfer_config: dict[str, Any] | None = None,
    max_model_len: int = 2048,
    kv_cache_bytes: int = 64 << 20,
    tp: int = 1,
    **more: Any,
) -> dict[str, Any]:
    """Arguments for ``vllm.LLM`` that run on a 2-core CPU box in ~15 s."""
    kw: dict[str, Any] = dict(
        model=model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        block_size=BLOCK_SIZE,
        kv_cache_memory_bytes=kv_cache_bytes,
        max_model_len=max_model_len,
        max_num_seqs=8,
        max_num_batched_tokens=max(max_model_len, 2048),
        seed=0,
        tensor_parallel_size=tp,
    )
    if tp == 1:
        kw["distributed_executor_backend"] = "uni"
    if kv_transfer_config is not None:
        from vllm.config import KVTransferConfig

        kw["kv_transfer_config"] = KVTransferConfig(**kv_transfer_config)
    kw.update(more)
    return kw


def generate(llm: Any, prompts: Sequence[Sequence[int]], max_tokens: int = 8) -> list[Any]:
    """Greedy generation from token-id prompts; returns vLLM's RequestOutputs in order."""
    from vllm import SamplingParams, TokensPrompt

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate(
        [TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sp, use_tqdm=False
    )


def token_ids(outputs: Sequence[Any]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def cached_tokens(outputs: Sequence[Any]) -> list[int]:
    return [int(o.num_cached_tokens or 0) for o in outputs]


def close_llm(llm: Any) -> None:
    """Tear an in-process engine down so that another one can start in this process."""
    import gc

    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    try:
        from vllm.distributed.parallel_state import (
            destroy_distributed_environment,
            destroy_model_parallel,
        )

        destroy_model_parallel()
        destroy_distributed_environment()
    except Exception:
        pass
    gc.collect()


def scheduler_of(llm: Any) -> Any:
    """The vLLM scheduler of an in-process engine (None if not in-process)."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    return getattr(core, "scheduler", None)


def connector_of(llm: Any) -> Any:
    """The scheduler-role kvray connector of an in-process engine (None if not in-process)."""
    return getattr(scheduler_of(llm), "connector", None)


def finish_delayed_frees(llm: Any, max_steps: int = 8) -> None:
    """Step an engine until no finished request's blocks are held any more.

    A request that finishes with full blocks kvray has not stored yet keeps them
    (``delay_free``) until the engine's next step has copied them out; ``LLM.generate``
    returns before that step, so ``reset_prefix_cache()`` right after it may return False
    (LMCache's connector does the same). ``LLMEngine.step()`` runs that step."""
    for _ in range(max_steps):
        sched = scheduler_of(llm)
        if sched is None or not sched.has_requests():
            return
        llm.llm_engine.step()
    raise AssertionError(f"blocks still held after {max_steps} engine steps")


def worker_connector_of(llm: Any) -> Any:
    """The worker-role connector of an in-process, single-rank engine."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    return get_kv_transfer_group() if has_kv_transfer_group() else None


def _main(argv: Sequence[str] | None = None) -> None:
    """Run one engine in this (fresh) process: ``python -m kvray.testing.engines run ...``.

    Used by tests and the benchmark for "another process" engines, in vLLM's default
    multiprocess mode (EngineCore and workers in their own processes).
    """
    import argparse
    import time

    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", choices=["run"])
    ap.add_argument("--model", required=True)
    ap.add_argument("--namespace")
    ap.add_argument("--prompts", required=True, help="JSON file: list of token-id lists")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1, help="repeat after reset_prefix_cache")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--wait-s", type=float, default=0.0, help="wait for --prompts to appear")
    args = ap.parse_args(argv)
    from vllm import LLM

    ktc = kvray_transfer_config(args.namespace) if args.namespace else None
    kw = engine_kwargs(
        args.model, kv_transfer_config=ktc, tp=args.tp, max_model_len=args.max_model_len
    )
    kw.pop("distributed_executor_backend", None)
    llm = LLM(**kw)
    wait_for_file(Path(args.prompts), args.wait_s)
    prompts = json.loads(Path(args.prompts).read_text())
    rounds = []
    for r in range(args.rounds):
        if r:
            if args.namespace:
                wait_for_stored_blocks(args.namespace)
            finish_delayed_frees(llm)
            llm.reset_prefix_cache()
        t0 = time.perf_counter()
        outs = generate(llm, prompts, max_tokens=args.max_tokens)
        rounds.append(
            {
                "tokens": token_ids(outs),
                "cached": cached_tokens(outs),
                "seconds": time.perf_counter() - t0,
            }
        )
    Path(args.out).write_text(json.dumps({"rounds": rounds}))
    del llm


def wait_for_stored_blocks(namespace: str, timeout: float = 30.0) -> int:
    """Wait until the number of blocks kvray holds stops growing (saves in flight landed)."""
    import time

    import ray

    import kvray

    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), log_to_driver=False)
    store = kvray.connect(namespace)
    deadline = time.monotonic() + timeout
    last = -1
    while time.monotonic() < deadline:
        store.sync()
        n = int(store.stats()["totals"].get("blocks", 0))
        if n > 0 and n == last:
            break
        last = n
        time.sleep(0.5)
    store.close()
    return last


def wait_for_file(path: Path, wait_s: float) -> None:
    """Poll (every 50 ms, up to ``wait_s``) until ``path`` exists; exit the process if not."""
    import time

    deadline = time.monotonic() + wait_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"nothing in {path} within {wait_s:.0f} s")
        time.sleep(0.05)


class StagedProcess:
    """A fresh Python process started now and given its input later: it does its slow start
    (an engine's: it and its EngineCore and workers each import vLLM, ~20 s), then waits
    (:func:`wait_for_file`) for the JSON :meth:`run` writes, and writes its JSON output.
    Starting it early lets that start overlap other work."""

    def __init__(self, cmd: list[str], env: dict[str, str], infile: Path, outfile: Path) -> None:
        import subprocess

        self._infile, self._outfile = infile, outfile
        # Its output to a file, not a pipe: a pipe nobody reads until run() would stall the
        # process's start once its logs fill the pipe's buffer.
        self._log = outfile.with_suffix(".log")
        with open(self._log, "w") as log:
            self._proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)

    def run(self, payload: Any, timeout: float) -> Any:
        """Hand it ``payload`` (once) and return its output; kills it on a timeout."""
        import subprocess

        tmp = self._infile.with_suffix(".tmp")
        tmp.write_text(json.dumps(payload))
        tmp.replace(self._infile)  # whole or absent: the process polls for it
        try:
            self._proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        if self._proc.returncode != 0 or not self._outfile.exists():
            tail = self._log.read_text(errors="replace")[-6000:]
            raise RuntimeError(f"engine process failed ({self._proc.returncode}):\n{tail}")
        return json.loads(self._outfile.read_text())

    def kill(self) -> None:
        """Stop it if it still runs (a test that never called :meth:`run`)."""
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(timeout=30)


class EngineProcess(StagedProcess):
    """An engine in a fresh Python process (vLLM's default multiprocess mode), started now and
    given its prompts later: :meth:`run` writes them and waits for its rounds."""

    def run(self, prompts: Sequence[Sequence[int]], timeout: float = 300.0) -> list[dict[str, Any]]:
        return super().run([list(p) for p in prompts], timeout)["rounds"]


def start_engine_process(
    model: str,
    workdir: str | os.PathLike[str],
    *,
    namespace: str | None = None,
    tp: int = 1,
    rounds: int = 1,
    max_tokens: int = 8,
    env: dict[str, str] | None = None,
    wait_s: float = 600.0,
) -> EngineProcess:
    """Start an engine in a fresh Python process; it builds its engine, then waits (up to
    ``wait_s``) for :meth:`EngineProcess.run`'s prompts."""
    import sys
    import uuid

    wd = Path(workdir)
    tag = uuid.uuid4().hex[:8]
    pfile, ofile = wd / f"prompts-{tag}.json", wd / f"out-{tag}.json"
    cmd = [sys.executable, "-m", "kvray.testing.engines", "run", "--model", model]
    cmd += ["--prompts", str(pfile), "--out", str(ofile), "--tp", str(tp)]
    cmd += ["--rounds", str(rounds), "--max-tokens", str(max_tokens), "--wait-s", str(wait_s)]
    if namespace:
        cmd += ["--namespace", namespace]
    # (vLLM's CPU platform spawns its EngineCore and workers whatever the environment says:
    # each of them imports vLLM again.)
    full_env = {**os.environ, **(env or {})}
    full_env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    return EngineProcess(cmd, full_env, pfile, ofile)


if __name__ == "__main__":
    _main()


def engine_actor(**options: Any) -> Any:
    """A Ray actor class hosting one in-process kvray-enabled engine (pin it with resources)."""
    import ray

    @ray.remote(num_cpus=0, **options)
    class EngineActor:
        def __init__(self, model: str, namespace: str, extra: dict[str, Any] | None = None):
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            from vllm import LLM

            ktc = kvray_transfer_config(namespace, **(extra or {}))
            self.llm = LLM(**engine_kwargs(model, kv_transfer_config=ktc))

        def node_id(self) -> str:
            return ray.get_runtime_context().get_node_id()

        def generate(
            self, prompts: list[list[int]], max_tokens: int = 8, reset: bool = False
        ) -> dict[str, Any]:
            if reset:
                finish_delayed_frees(self.llm)
                self.llm.reset_prefix_cache()
            outs = generate(self.llm, prompts, max_tokens=max_tokens)
            return {"tokens": token_ids(outs), "cached": cached_tokens(outs)}

        def flush(self) -> dict[str, Any]:
            """Wait until this engine's saves are in kvray and visible; its counters."""
            finish_delayed_frees(self.llm)
            conn = worker_connector_of(self.llm)
            conn.worker.flush()
            sched = connector_of(self.llm)
            sched.store.sync()
            return {"hit_tokens": sched.scheduler.hit_tokens}

        def close(self) -> None:
            close_llm(self.llm)

    return EngineActor


#: A small chat template for the test tokenizer: one line per message, then the assistant cue.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_text_model(
    path: str | os.PathLike[str],
    *,
    vocab: int = 2048,
    sources: Sequence[str] | None = None,
    **model: Any,
) -> str:
    """A random float32 Llama with a real tokenizer next to it (text, chat and streaming work).

    No hub is reachable, so a byte-level BPE of ``vocab`` tokens is trained offline on local
    ``.py`` files (vLLM's and this repository's by default), wrapped in a
    ``PreTrainedTokenizerFast`` with ``<pad>``/``<s>``/``</s>`` (ids 0, 1, 2 as the model's
    config says) and :data:`CHAT_TEMPLATE`, and saved next to the model, whose vocabulary is
    the tokenizer's; ``model`` goes to :func:`build_tiny_llama` (sizes). Idempotent like it.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out = Path(path)
    build_tiny_llama(out, vocab=vocab, **model)
    if (out / "tokenizer.json").exists():
        return str(out)
    if sources is None:
        import vllm

        roots = [Path(vllm.__file__).parent / "entrypoints", Path(__file__).parent.parent]
        sources = sorted(str(p) for r in roots for p in r.rglob("*.py"))[:400]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(list(sources), trainer)
    if tok.get_vocab_size() != vocab:
        raise RuntimeError(f"trained {tok.get_vocab_size()} tokens, wanted {vocab}")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return str(out)
