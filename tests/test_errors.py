"""Every kvray exception survives pickling with its fields and crosses ``ray.get`` as itself."""

from __future__ import annotations

import inspect
import pickle
import uuid
from typing import Any

import pytest
import ray
from ray import cloudpickle

import kvray
import kvray.config
import kvray.errors
from kvray.config import ConfigError, KVRayConfig

#: A value for every constructor argument an exception may take, by name (a new exception
#: with an argument not listed here gets a string).
_SAMPLE_ARGS: dict[str, Any] = {
    "keys": [b"\x01" * 40, b"\x02" * 40, b"\x03" * 40, b"\x04" * 40, b"\x05" * 40],
    "reason": "not in the index",
    "field_name": "capacity",
    "value": "1x",
}


def _all_subclasses(cls: type) -> set[type]:
    out = {cls}
    for sub in cls.__subclasses__():
        out |= _all_subclasses(sub)
    return out


def _kvray_exceptions() -> list[type[BaseException]]:
    """Every exception class kvray defines: those in kvray.errors / kvray.config and every
    subclass of them, wherever it lives."""
    roots = {
        obj
        for mod in (kvray.errors, kvray.config)
        for obj in vars(mod).values()
        if isinstance(obj, type)
        and issubclass(obj, BaseException)
        and obj.__module__.startswith("kvray")
    }
    found: set[type] = set()
    for root in roots:
        found |= {c for c in _all_subclasses(root) if c.__module__.startswith("kvray")}
    return sorted(found, key=lambda c: c.__qualname__)


def _instance(cls: type[BaseException]) -> BaseException:
    params = [
        p
        for p in list(inspect.signature(cls.__init__).parameters.values())[1:]
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        and p.default is inspect.Parameter.empty
    ]
    return cls(*(_SAMPLE_ARGS.get(p.name, f"sample {p.name}") for p in params))


def test_the_known_exceptions_are_found() -> None:
    names = {c.__name__ for c in _kvray_exceptions()}
    assert {
        "KVRayError",
        "BlockLostError",
        "NotStartedError",
        "StoreUnavailableError",
        "ConfigError",
    } <= names


@pytest.mark.parametrize("cls", _kvray_exceptions(), ids=lambda c: c.__name__)
@pytest.mark.parametrize("dumps", [pickle.dumps, cloudpickle.dumps], ids=["pickle", "cloudpickle"])
def test_pickle_round_trip_keeps_class_message_and_fields(cls: type, dumps: Any) -> None:
    err = _instance(cls)
    back = pickle.loads(dumps(err))
    assert type(back) is cls
    assert str(back) == str(err)
    assert back.args == err.args
    assert vars(back) == vars(err)  # keys, reason, field_name, value...


def test_fields_of_the_structured_errors() -> None:
    keys = _SAMPLE_ARGS["keys"]
    lost = pickle.loads(pickle.dumps(kvray.BlockLostError(keys, "checksum mismatch")))
    assert lost.keys == keys and lost.reason == "checksum mismatch"
    assert "5 kvray block(s) lost (checksum mismatch)" in str(lost)
    bad = pickle.loads(pickle.dumps(ConfigError("capacity", "1x", "expected a size")))
    assert (bad.field_name, bad.value, bad.reason) == ("capacity", "1x", "expected a size")
    assert str(bad) == "kvray config: invalid capacity='1x': expected a size"


# ------------------------------------------------------------------ across ray.get


def _missing_keys(n: int = 3) -> list[bytes]:
    return [uuid.uuid4().bytes * 2 + bytes([i]) * 8 for i in range(n)]


def _get_missing(ns: str, keys: list[bytes]) -> None:
    store = kvray.connect(ns)
    try:
        store.get(keys, timeout=10)
    finally:
        store.close()


@ray.remote(num_cpus=0, max_retries=0)
def _get_in_task(ns: str, keys: list[bytes]) -> None:
    _get_missing(ns, keys)


@ray.remote(num_cpus=0)
class _Reader:
    def get(self, ns: str, keys: list[bytes]) -> None:
        _get_missing(ns, keys)


@ray.remote(num_cpus=0, max_retries=0)
def _bad_config_in_task() -> None:
    KVRayConfig(capacity="1x")


@ray.remote(num_cpus=0, max_retries=0)
def _connect_in_task(ns: str) -> None:
    kvray.connect(ns)


def _driver_reason(ns: str, keys: list[bytes]) -> str:
    with pytest.raises(kvray.BlockLostError) as info:
        _get_missing(ns, keys)
    return info.value.reason


def test_block_lost_in_a_task_is_caught_as_itself(kvray_ns: str) -> None:
    keys = _missing_keys()
    reason = _driver_reason(kvray_ns, keys)
    try:
        ray.get(_get_in_task.remote(kvray_ns, keys), timeout=120)
    except kvray.BlockLostError as e:
        assert e.keys == keys
        assert e.reason == reason
        assert isinstance(e, kvray.KVRayError)
    else:
        pytest.fail("the task did not raise")


def test_block_lost_in_an_actor_method_is_caught_as_itself(kvray_ns: str) -> None:
    keys = _missing_keys(6)
    reason = _driver_reason(kvray_ns, keys)
    reader = _Reader.remote()  # type: ignore[attr-defined]
    try:
        with pytest.raises(kvray.BlockLostError) as info:
            ray.get(reader.get.remote(kvray_ns, keys), timeout=120)
        assert info.value.keys == keys
        assert info.value.reason == reason
        # The actor survives a user error and raises it again, call after call.
        with pytest.raises(kvray.BlockLostError):
            ray.get(reader.get.remote(kvray_ns, keys[:1]), timeout=60)
    finally:
        ray.kill(reader)


def test_config_error_in_a_task_is_caught_as_itself(ray_cluster: Any) -> None:
    with pytest.raises(ConfigError) as info:
        ray.get(_bad_config_in_task.remote(), timeout=120)
    assert info.value.field_name == "capacity"
    assert info.value.value == "1x"
    assert "invalid capacity='1x'" in str(info.value)


def test_not_started_in_a_task_is_caught_as_itself(ray_cluster: Any) -> None:
    ns = f"nosuch{uuid.uuid4().hex[:6]}"
    with pytest.raises(kvray.NotStartedError, match=f"not started in namespace '{ns}'"):
        ray.get(_connect_in_task.remote(ns), timeout=120)
