"""Where engines publish their key space, so that routers can compute the keys of a prompt.

A kvray key is ``key_prefix + block_hash``: the block hash is vLLM's (a router can compute it
from the prompt's token ids), the prefix depends on the engine's KV layout (only the engine
knows it). Every engine's scheduler publishes a :class:`KeySpaceInfo` record in Ray's internal
KV store when it starts; :func:`key_spaces` reads them back from any process on the cluster.

Records are keyed by namespace, model, layout and node, so that the engines of one model on one
node overwrite each other's record: the store holds at most (models x layouts x nodes) records
per namespace, never one per engine start.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field

from ray.experimental import internal_kv

from kvray.config import check_namespace
from kvray.errors import StoreUnavailableError

__all__ = ["KeySpaceInfo", "clear_key_spaces", "key_spaces", "publish_key_space"]

#: Ray internal-KV namespace of the records (kept apart from Ray's and Serve's own keys).
KV_NAMESPACE = "kvray"
_PREFIX = "keyspace/"


@dataclass(frozen=True)
class KeySpaceInfo:
    """What a router needs to turn a prompt into the kvray keys of one engine."""

    #: vLLM's model name or path (``model_config.model``).
    model: str
    #: vLLM's block size in tokens; keys exist for full blocks only.
    block_size: int
    #: vLLM's ``prefix_caching_hash_algo`` (``sha256``, ``sha256_cbor``, ...).
    hash_algo: str
    #: One key prefix per TP shard: a block is cached only if held under every prefix.
    key_prefixes: list[bytes]
    #: Ray node id of the process that published the record (where its saves land).
    node_id: str
    #: The names the model is served under (OpenAI ``model`` field), if known.
    served_model_names: list[str] = field(default_factory=list)
    #: ``PYTHONHASHSEED`` of the engine: vLLM derives the first block's parent hash from it.
    hash_seed: str | None = None
    published_at: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"KeySpaceInfo.model must be a non-empty string, got {self.model!r}")
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(f"KeySpaceInfo.block_size must be > 0, got {self.block_size!r}")
        if not self.key_prefixes or not all(isinstance(p, bytes) and p for p in self.key_prefixes):
            raise ValueError("KeySpaceInfo.key_prefixes must be a non-empty list of bytes")
        if not isinstance(self.node_id, str) or not self.node_id:
            raise ValueError(f"KeySpaceInfo.node_id must be a node id, got {self.node_id!r}")

    def serves(self, model: str) -> bool:
        """Whether a request naming ``model`` is served by this engine."""
        return model == self.model or model in self.served_model_names

    def layout_id(self) -> str:
        """Short digest of what makes two engines' keys identical."""
        text = "|".join(
            [self.hash_algo, str(self.block_size), *(p.hex() for p in self.key_prefixes)]
        )
        return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "model": self.model,
                "served_model_names": list(self.served_model_names),
                "block_size": self.block_size,
                "hash_algo": self.hash_algo,
                "key_prefixes": [p.hex() for p in self.key_prefixes],
                "node_id": self.node_id,
                "hash_seed": self.hash_seed,
                "published_at": self.published_at,
            }
        ).encode()

    @classmethod
    def from_json(cls, data: bytes) -> KeySpaceInfo:
        d = json.loads(data)
        return cls(
            model=d["model"],
            served_model_names=list(d.get("served_model_names") or []),
            block_size=int(d["block_size"]),
            hash_algo=str(d["hash_algo"]),
            key_prefixes=[bytes.fromhex(p) for p in d["key_prefixes"]],
            node_id=d["node_id"],
            hash_seed=d.get("hash_seed"),
            published_at=float(d["published_at"]),
        )


def _require_ray() -> None:
    if not internal_kv._internal_kv_initialized():
        raise StoreUnavailableError("kvray registry: Ray is not initialised in this process")


def _model_digest(model: str) -> str:
    return hashlib.blake2b(model.encode(), digest_size=8).hexdigest()


def publish_key_space(namespace: str, info: KeySpaceInfo) -> None:
    """Publish (or refresh) an engine's record in ``namespace``."""
    check_namespace(namespace)
    if not isinstance(info, KeySpaceInfo):
        raise TypeError(f"publish_key_space: expected a KeySpaceInfo, got {type(info).__name__}")
    _require_ray()
    key = f"{_PREFIX}{namespace}/{_model_digest(info.model)}/{info.layout_id()}/{info.node_id}"
    internal_kv._internal_kv_put(key.encode(), info.to_json(), namespace=KV_NAMESPACE)


def key_spaces(namespace: str, model: str | None = None) -> list[KeySpaceInfo]:
    """The records published in ``namespace`` (for ``model``: its path or a served name),
    newest first."""
    check_namespace(namespace)
    _require_ray()
    keys = internal_kv._internal_kv_list(f"{_PREFIX}{namespace}/", namespace=KV_NAMESPACE)
    out: list[KeySpaceInfo] = []
    for key in keys:
        data = internal_kv._internal_kv_get(key, namespace=KV_NAMESPACE)
        if data is None:  # deleted since listed
            continue
        try:
            info = KeySpaceInfo.from_json(data)
        except (ValueError, KeyError, TypeError):
            continue  # a record from an incompatible kvray version: not ours to read
        if model is None or info.serves(model):
            out.append(info)
    out.sort(key=lambda i: i.published_at, reverse=True)
    return out


def clear_key_spaces(namespace: str) -> int:
    """Remove every record of ``namespace`` (e.g. after ``kvray.stop``); how many."""
    check_namespace(namespace)
    _require_ray()
    keys = internal_kv._internal_kv_list(f"{_PREFIX}{namespace}/", namespace=KV_NAMESPACE)
    for key in keys:
        internal_kv._internal_kv_del(key, namespace=KV_NAMESPACE)
    return len(keys)
