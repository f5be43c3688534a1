"""From an OpenAI request to the kvray keys of its prompt's full blocks, exactly as vLLM keys them.

Token ids come from the request for token-id prompts, else from
:class:`~kvray.serving.tokenize.EngineTokenizer`, which renders text and chat requests with
vLLM's own renderer (chat template included), configured like the engine. Block hashes are
vLLM's: ``hash_block_tokens`` chained from the seed the engine derives its first parent hash
from, with the request's ``cache_salt`` in the first block, as vLLM's scheduler computes
``request.block_hashes``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvray.keys import make_keys
from kvray.registry import KeySpaceInfo

logger = logging.getLogger(__name__)

__all__ = ["BlockHasher", "PromptSource", "TokenizerLike", "prompt_of"]

#: Longest prompt prefix the router hashes (blocks): bounds its work per request.
MAX_ROUTED_BLOCKS = 4096
_CRYPTO_HASHES = ("sha256", "sha256_cbor")


class TokenizerLike(Protocol):
    """Renders a completion or chat request to its prompt token ids (``EngineTokenizer``)."""

    async def token_ids(self, request: Any) -> list[int] | None: ...


@dataclass(frozen=True)
class PromptSource:
    """What a request gives to route on: token ids, or the request for the tokenizer."""

    model: str | None
    token_ids: list[int] | None = None
    request: Any = None
    cache_salt: str | None = None


def prompt_of(request: Any) -> PromptSource | None:
    """The routable prompt of a completion or chat request (the first prompt of a batch);
    None for other requests (embeddings, prompt embeddings, empty prompts)."""
    model = getattr(request, "model", None)
    salt = getattr(request, "cache_salt", None) or None
    if getattr(request, "messages", None):
        return PromptSource(model, request=request, cache_salt=salt)
    prompt = getattr(request, "prompt", None)
    first = prompt[0] if isinstance(prompt, list) and prompt else prompt
    if isinstance(first, str) and first:
        return PromptSource(model, request=request, cache_salt=salt)
    if isinstance(first, list) and first:  # a batch of token-id prompts
        prompt = first
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return PromptSource(model, token_ids=list(prompt), cache_salt=salt)
    return None


async def token_ids_of(source: PromptSource, tokenizer: TokenizerLike | None) -> list[int] | None:
    """The prompt's token ids as the engine will see them; None when they cannot be known."""
    if source.token_ids is not None:
        return source.token_ids
    if tokenizer is None or source.request is None:
        return None
    return await tokenizer.token_ids(source.request)


class BlockHasher:
    """vLLM's chained block hashes, and kvray's keys, for one published key space."""

    def __init__(self, info: KeySpaceInfo) -> None:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import DEFAULT_NONE_HASH_SEED

        seed = info.hash_seed
        if seed is None:
            if info.hash_algo not in _CRYPTO_HASHES:
                raise ValueError(
                    f"kvray router: {info.hash_algo} block hashes are per process without "
                    "PYTHONHASHSEED; set it for the engines (and the router) or use sha256"
                )
            seed = DEFAULT_NONE_HASH_SEED
        self.info = info
        self._hash: Callable[[Any], bytes] = get_hash_fn_by_name(info.hash_algo)
        self._root = bytes(self._hash(seed))

    def block_hashes(self, tokens: Sequence[int], cache_salt: str | None = None) -> list[bytes]:
        """Hashes of the full blocks of ``tokens`` (at most :data:`MAX_ROUTED_BLOCKS`)."""
        from vllm.v1.core.kv_cache_utils import hash_block_tokens

        size = self.info.block_size
        n = min(len(tokens) // size, MAX_ROUTED_BLOCKS)
        out: list[bytes] = []
        parent = self._root
        for i in range(n):
            extra = (("cache_salt", cache_salt),) if (i == 0 and cache_salt) else None
            parent = bytes(
                hash_block_tokens(self._hash, parent, tokens[i * size : (i + 1) * size], extra)
            )
            out.append(parent)
        return out

    def keys_per_shard(self, hashes: Sequence[bytes]) -> list[list[bytes]]:
        """kvray keys of the blocks, one list per TP shard prefix."""
        return [make_keys(prefix, hashes) for prefix in self.info.key_prefixes]
