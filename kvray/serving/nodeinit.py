"""Replica start without Ray Serve LLM's node-initialization task when it has nothing to fetch.

Before its engine starts, every Ray Serve LLM replica runs ``initialize_node``: one Ray task per
node of its placement group, in a fresh worker with the replica's ``runtime_env``, that
downloads the model from a cloud mirror. For a model without a mirror (a local directory or a
Hugging Face id that vLLM resolves itself) the task only creates torch's kernels directory and
returns the model id it was given; yet the fresh worker imports torch, transformers and Ray's LLM
modules first: 8.5 CPU-s a replica start on the 2-core box, waited for before the engine starts
(a process sampler over ``tests/test_serve.py``'s app setup). Ray Serve LLM's callback hook
(``CallbackCtx.run_init_node``) skips the task; :class:`SkipIdleNodeInit` does so exactly when
the task would fetch nothing, and does the one thing it would have done, on the replica's node
only (a placement group spanning nodes no longer creates that directory on the others).

The same hook gives a CPU replica's engine its thread shares (``build_llm_config``'s
``cpu_threads``): set in the replica's own environment before the engine's processes start,
which inherit them, unless the node's environment already sets ``VLLM_CPU_OMP_THREADS_BIND``:
an operator who bound the node's cores (``VLLM_CPU_OMP_THREADS_BIND=... ray start``) keeps
that binding. Set through the replica's ``runtime_env``, the shares overrode it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from typing import Any

from ray.llm._internal.common.callbacks.base import CallbackBase

from kvray.serving.app import BIND_ENV, THREADS_KWARG

logger = logging.getLogger(__name__)

__all__ = ["SkipIdleNodeInit", "apply_thread_shares", "fetches_nothing"]


def apply_thread_shares(shares: dict[str, str], environ: MutableMapping[str, str]) -> bool:
    """Put ``shares`` (``build_llm_config``'s thread settings) into ``environ`` unless they
    bind and ``environ`` already has a binding of its own (the node's); True if applied."""
    if not shares:
        return False
    if BIND_ENV in shares and BIND_ENV in environ:
        logger.info(
            "kvray: this node sets %s=%s; its engine keeps that binding, not kvray's shares %s",
            BIND_ENV,
            environ[BIND_ENV],
            shares,
        )
        return False
    environ.update(shares)
    return True


def fetches_nothing(engine_config: Any) -> bool:
    """True when Ray's node-initialization task would download nothing for this engine config:
    no cloud mirror and a model id that is not an ``s3://`` / ``gs://`` (or other remote) path
    (``ray.llm``'s ``download_model_files`` returns such an id unchanged)."""
    from ray.llm._internal.common.utils.cloud_utils import is_remote_path

    model_id = engine_config.actual_hf_model_id
    return engine_config.mirror_config is None and not is_remote_path(model_id)


class SkipIdleNodeInit(CallbackBase):
    """Ray Serve LLM callback: skip the node-initialization task when it would fetch nothing."""

    async def on_before_node_init(self) -> None:
        apply_thread_shares(dict(self.kwargs.get(THREADS_KWARG) or {}), os.environ)
        if not fetches_nothing(self.llm_config.get_engine_config()):
            return
        import torch

        # The task's only effect without a mirror (a workaround Ray keeps for torch hub).
        os.makedirs(os.path.join(torch.hub._get_torch_home(), "kernels"), exist_ok=True)
        self.ctx.run_init_node = False
        logger.info("kvray: model needs no download; skipping Ray's node-initialization task")
