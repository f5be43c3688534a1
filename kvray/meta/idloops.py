"""Compiled loops of the id table (numba, cached on disk after the first compile).

Open addressing with linear probing over a power-of-two array of uint64 ids (``0`` empty,
``1`` deleted). The home slot of an id is the top bits of ``id * 0x9E3779B97F4A7C15``
(Fibonacci hashing), so even sequential ids spread out. Every loop releases the GIL.

Import this module only where a table is used (:mod:`kvray.meta.idtable` does so lazily):
numba costs about 0.2 s and 60 MB to import, and vLLM's workers never need it.
"""

from __future__ import annotations

import numpy as np


def _shield_llvmlite() -> None:
    """vLLM 0.32's CPU platform rebinds Triton kernels at worker start by scanning every module
    attribute that has a ``__dict__`` and calling ``vars(value).get(...)``. llvmlite's lazy
    library wrapper (``llvmlite.binding.ffi.lib``) answers *any* attribute, ``__dict__``
    included, with a function wrapper, so that scan crashes in any process that imported numba
    first (an in-process vLLM engine next to a kvray view). Dunder names are never LLVM
    functions: the wrapper now refuses them like a plain object would."""
    from llvmlite.binding import ffi

    wrapper = ffi._lib_wrapper
    if getattr(wrapper, "_kvray_shielded", False):
        return
    resolve = wrapper.__getattr__

    def __getattr__(self: object, name: str) -> object:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return resolve(self, name)

    wrapper.__getattr__ = __getattr__
    wrapper._kvray_shielded = True


_shield_llvmlite()

from numba import njit  # noqa: E402

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_EMPTY = np.uint64(0)
_TOMB = np.uint64(1)
_ONE = np.uint64(1)


@njit(cache=True, nogil=True)
def find(keys: np.ndarray, shift: np.uint64, ids: np.ndarray, out: np.ndarray) -> None:
    """``out[i]``: the slot of ``ids[i]``, or -1."""
    mask = np.uint64(keys.size - 1)
    for i in range(ids.size):
        x = ids[i]
        p = (x * _GOLDEN) >> shift
        out[i] = -1
        while True:
            k = keys[p]
            if k == x:
                out[i] = np.int64(p)
                break
            if k == _EMPTY:
                break
            p = (p + _ONE) & mask


@njit(cache=True, nogil=True)
def prefix_len(keys: np.ndarray, shift: np.uint64, ids: np.ndarray) -> int:
    """How many leading ``ids`` are present (stops at the first absent one)."""
    mask = np.uint64(keys.size - 1)
    for i in range(ids.size):
        x = ids[i]
        p = (x * _GOLDEN) >> shift
        while True:
            k = keys[p]
            if k == x:
                break
            if k == _EMPTY:
                return i
            p = (p + _ONE) & mask
    return ids.size


@njit(cache=True, nogil=True)
def claim(
    keys: np.ndarray, shift: np.uint64, ids: np.ndarray, slots: np.ndarray, new: np.ndarray
) -> int:
    """Slots of unique ``ids``: the existing one, else the first empty slot of the chain (its
    key is written). ``new[i]`` says which; returns how many were new. The caller made room."""
    mask = np.uint64(keys.size - 1)
    n_new = 0
    for i in range(ids.size):
        x = ids[i]
        p = (x * _GOLDEN) >> shift
        while True:
            k = keys[p]
            if k == x:
                slots[i] = np.int64(p)
                new[i] = False
                break
            if k == _EMPTY:
                keys[p] = x
                slots[i] = np.int64(p)
                new[i] = True
                n_new += 1
                break
            p = (p + _ONE) & mask
    return n_new


@njit(cache=True, nogil=True)
def live_slots(keys: np.ndarray) -> np.ndarray:
    """Slots holding an id (not empty, not deleted), in order."""
    n = 0
    for i in range(keys.size):
        if keys[i] > _TOMB:
            n += 1
    out = np.empty(n, dtype=np.int64)
    j = 0
    for i in range(keys.size):
        if keys[i] > _TOMB:
            out[j] = i
            j += 1
    return out
