"""The KV cache groups of an engine, as kvray keys and stores them.

One group (every model vLLM runs without its hybrid manager): the group is the engine's one key
space, exactly as before hybrid support (same keys, same paths).

Several groups (vLLM's hybrid KV cache manager, kvray as a ``SupportsHMA`` connector): every
group has its own key space (its kind, window and layer names are in the fingerprint, so the
groups of one model never share a key), and its own kind of stores:

- **full attention**: every full block is stored and a hit loads every block of it, as for one
  group. The first full-attention group *decides* hits (its key space is the engine's: routers,
  the engine tier and handoffs use it; reuse across TP sizes as for one group).
- **sliding window** (``window`` tokens): a hit ending at token ``E`` needs the group's blocks
  from ``need_from(E)`` on (vLLM holds no others: it frees blocks that fell out of the window),
  so only the window before a point where a later hit can end is stored: before the end of the
  prompt, before the end of the request, and before where a lookup found the stored prefix to
  stop (where the next request sharing it will stop too).

- **state** (Mamba/SSM layers, vLLM's ``mamba_cache_mode="align"``): vLLM keeps, in the group's
  block ``p``, the layers' recurrent state after exactly ``(p + 1) * block_size`` tokens, but only
  at the block boundaries it materializes (the ends of prefill chunks, the prompt's checkpoint
  one token short of its end, each boundary decode crosses); the other blocks are null. A hit
  ending at token ``E`` (a block boundary: a state holds no earlier token) needs that one block,
  ``E / block_size - 1``. kvray stores every state block vLLM materializes, while vLLM holds it
  (the same states vLLM's own prefix cache keeps), in a key space tied to the TP size (a state
  is not split into canonical head ranges).

Other kinds (chunked local attention, Mamba without ``align`` mode, ...) are refused when the
engine starts, in one line naming the model's group kinds.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvray.config import KVRayConfig
from kvray.connector.keyspace import (
    EngineKeySpace,
    build_key_space,
    group_key_space,
    state_key_space,
)
from kvray.errors import KVRayError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = [
    "FULL",
    "SLIDING",
    "STATE",
    "CacheGroup",
    "UnsupportedGroupsError",
    "build_groups",
    "group_kind",
]

FULL = "full_attention"
SLIDING = "sliding_window"
STATE = "mamba"


class UnsupportedGroupsError(KVRayError, NotImplementedError):
    """The model's KV cache groups include a kind kvray cannot store."""


@dataclass(frozen=True)
class CacheGroup:
    """One KV cache group of the engine, with its key space."""

    #: vLLM's index of the group (its place in ``kv_cache_groups`` and in block id tuples).
    index: int
    kind: str
    key_space: EngineKeySpace
    layer_names: tuple[str, ...]
    #: Sliding window in tokens (0: full attention).
    window: int = 0

    @property
    def windowed(self) -> bool:
        """A hit needs only the group's last blocks before its end (sliding window, state)."""
        return self.kind in (SLIDING, STATE)

    @property
    def is_state(self) -> bool:
        return self.kind == STATE

    def can_end(self, end_tokens: int) -> bool:
        """Whether a hit may end at token ``end_tokens`` for this group (a state only at a
        block boundary: vLLM keeps no state for a token inside a block)."""
        return not self.is_state or end_tokens % self.key_space.block_size == 0

    def need_from(self, end_tokens: int) -> int:
        """The first block a hit ending at token ``end_tokens`` needs (vLLM keeps the blocks
        from there on: ``get_num_skipped_tokens`` of its ``SlidingWindowManager``, and of its
        ``MambaManager``: every token but the last)."""
        if self.is_state:
            return max(0, end_tokens - 1) // self.key_space.block_size
        if not self.windowed:
            return 0
        return max(0, end_tokens - self.window + 1) // self.key_space.block_size

    def window_blocks(self, end_block: int) -> range:
        """The blocks stored for a hit that ends at block ``end_block`` (whole blocks) or one
        token short of it (a prompt that fills its last block)."""
        bs = self.key_space.block_size
        return range(self.need_from(max(0, end_block * bs - 1)), end_block)


def group_kind(spec: Any) -> str:
    """A group's kind as the refusal names it (``full_attention``, ``sliding_window(128)``,
    ``mamba``...)."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    t = type(spec)
    if t in (FullAttentionSpec, MLAAttentionSpec):
        return FULL
    if t is SlidingWindowSpec:
        return f"{SLIDING}({spec.sliding_window})"
    if isinstance(spec, MambaSpec):
        return "mamba"
    name = t.__name__.removesuffix("Spec")
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in name).lstrip("_")


def build_groups(
    config: KVRayConfig, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> tuple[CacheGroup, ...]:
    """The engine's groups; raises :class:`UnsupportedGroupsError` (one line) on kinds kvray
    cannot store."""
    from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec

    groups = kv_cache_config.kv_cache_groups
    if len(groups) == 1:
        ks = build_key_space(config, vllm_config, kv_cache_config)
        return (CacheGroup(0, FULL, ks, tuple(groups[0].layer_names)),)
    kinds = [group_kind(g.kv_cache_spec) for g in groups]
    block_size = vllm_config.cache_config.block_size
    supported = all(k in (FULL, STATE) or k.startswith(SLIDING) for k in kinds)
    sizes = {int(getattr(g.kv_cache_spec, "block_size", 0)) for g in groups}
    problem = ""
    if not supported:
        problem = "kvray stores full-attention, sliding-window and mamba (align mode) groups only"
    elif STATE in kinds and (why := _state_problem(groups)):
        problem = why
    elif FULL not in kinds:
        problem = "kvray needs a full-attention group to decide hits"
    elif sizes != {block_size}:
        problem = f"block sizes {sorted(sizes)} differ from the engine's {block_size}"
    if problem:
        raise UnsupportedGroupsError(
            f"kvray connector: this model's KV cache groups are [{', '.join(kinds)}]: {problem}; "
            "run this model without kvray"
        )
    out: list[CacheGroup] = []
    for i, (g, kind) in enumerate(zip(groups, kinds, strict=True)):
        spec = g.kv_cache_spec
        names = tuple(g.layer_names)
        digest = hashlib.blake2b("\n".join(names).encode(), digest_size=8).hexdigest()
        tags = [f"group:{kind}", f"layers:{digest}"]
        if isinstance(spec, MambaSpec):
            ks = state_key_space(config, vllm_config, spec, len(names), extra_tags=tags)
            out.append(CacheGroup(i, STATE, ks, names))
            continue
        window = 0
        if isinstance(spec, SlidingWindowSpec):
            window = int(spec.sliding_window) + int(getattr(spec, "extra_retained_tokens", 0))
        ks = group_key_space(config, vllm_config, spec, len(names), extra_tags=tags)
        out.append(CacheGroup(i, SLIDING if window else FULL, ks, names, window))
    return tuple(out)


def _state_problem(groups: Sequence[Any]) -> str:
    """Why kvray cannot store the model's Mamba groups ("" when it can): vLLM materializes
    block-aligned states only in ``align`` mode, and kvray keys them by whole blocks."""
    from vllm.v1.kv_cache_interface import MambaSpec

    for g in groups:
        spec = g.kv_cache_spec
        if not isinstance(spec, MambaSpec):
            continue
        if spec.mamba_cache_mode != "align":
            return (
                f"vLLM keeps no block-aligned mamba state in mamba_cache_mode "
                f"{spec.mamba_cache_mode!r} (run with --enable-prefix-caching "
                "--mamba-cache-mode align)"
            )
        if spec.num_speculative_blocks:
            return "kvray does not store mamba state with speculative decoding blocks"
        if getattr(spec, "tokens_per_state", -1) > 0:
            return "kvray does not store mamba state kept per token group inside a block"
    return ""


def deciding(groups: Sequence[CacheGroup]) -> CacheGroup:
    """The group whose hits decide a request's hit (the first full-attention group)."""
    return next(g for g in groups if not g.windowed)
