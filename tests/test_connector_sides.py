"""The connector's seams (kvray/connector/sides.py): the classes on each side conform to their
Protocol, names, parameters, defaults and annotations alike (no type checker runs here: this is
the check), and the sides reach the store only through the Protocols' public methods."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any

import pytest

from kvray.client import Store
from kvray.connector.manager import KVRayCacheManager
from kvray.connector.paged import Mover
from kvray.connector.sides import CacheManager, TransferSide, TransferStore, ViewStore
from kvray.connector.transfer import TransferHandler
from kvray.kernels import BlockMover

ROOT = Path(__file__).resolve().parents[1]

CONFORMING = [
    (Store, ViewStore),
    (Store, TransferStore),
    (KVRayCacheManager, CacheManager),
    (TransferHandler, TransferSide),
]


def _members(proto: type) -> list[str]:
    return sorted(n for n in vars(proto) if not n.startswith("_") and callable(getattr(proto, n)))


def _shape(fn: Any) -> list[tuple[str, Any, Any, Any]]:
    sig = inspect.signature(fn)
    params = [(p.name, p.kind, p.default, p.annotation) for p in sig.parameters.values()]
    return [*params, ("return", None, None, sig.return_annotation)]


@pytest.mark.parametrize(("cls", "proto"), CONFORMING, ids=lambda x: x.__name__)
def test_the_class_has_every_method_of_its_protocol_with_the_same_signature(
    cls: type, proto: type
) -> None:
    members = _members(proto)
    assert members, f"{proto.__name__} declares no methods"
    for name in members:
        assert hasattr(cls, name), f"{cls.__name__} lacks {proto.__name__}.{name}"
        assert _shape(getattr(cls, name)) == _shape(getattr(proto, name)), (
            f"{cls.__name__}.{name}{inspect.signature(getattr(cls, name))} differs from "
            f"{proto.__name__}.{name}{inspect.signature(getattr(proto, name))}"
        )


def test_the_mover_protocol_matches_block_mover() -> None:
    for name in ("gather", "scatter"):
        mine = inspect.signature(getattr(Mover, name)).parameters
        theirs = inspect.signature(getattr(BlockMover, name)).parameters
        assert [(p.name, p.kind, p.default) for p in mine.values()] == [
            (p.name, p.kind, p.default) for p in theirs.values()
        ], name


def test_a_protocol_check_can_fail() -> None:
    """The check above is not vacuous: a class missing a method or renaming a parameter fails."""

    class Partial:
        def lookup(self, keys: Any) -> int:
            return 0

    assert not isinstance(Partial(), ViewStore)
    assert _shape(Partial.lookup) != _shape(ViewStore.lookup)


#: Store attributes the connector must not reach past the facade for.
PRIVATE_PARTS = ("io", "feed", "tally")


def test_the_connector_uses_only_public_store_methods() -> None:
    """No module of the connector touches ``<x>.store.io`` / ``.feed`` / ``.tally``."""
    bad = []
    for path in sorted((ROOT / "kvray" / "connector").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in PRIVATE_PARTS
                and isinstance(node.value, ast.Attribute | ast.Name)
                and getattr(node.value, "attr", getattr(node.value, "id", "")) == "store"
            ):
                bad.append(f"{path.name}:{node.lineno} store.{node.attr}")
    assert not bad, bad
