"""Package attributes resolved on first use (PEP 562), so that importing a package stays cheap:
``kvray`` needs no Ray until ``kvray.connect``, ``kvray.connector`` no vLLM until
``KVRayConnector``."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_attributes"]


def lazy_attributes(
    package: str, where: Mapping[str, str], scope: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package's ``__getattr__`` and ``__dir__``: ``where`` maps a public name to the module
    defining it; a name is imported on first access and kept in ``scope`` (its globals)."""

    def getattr_(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        scope[name] = value  # resolved once
        return value

    def dir_() -> list[str]:
        return sorted({*scope, *where})

    return getattr_, dir_
