"""Config validation and key namespacing (no Ray needed)."""

from __future__ import annotations

import pytest

from kvray.blocks import check_keys
from kvray.config import (
    MIN_CAPACITY,
    ConfigError,
    KVRayConfig,
    check_namespace,
    check_number,
    format_bytes,
    parse_bytes,
)
from kvray.keys import MAX_GROUPING, PREFIX_BYTES, LayoutFingerprint, grouped_prefix, make_keys


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4GiB", 4 << 30),
        ("4 gib", 4 << 30),
        ("512MB", 512 * 10**6),
        ("1.5KiB", 1536),
        ("1048576", 1 << 20),
        (2048, 2048),
        ("1e6", 10**6),
    ],
)
def test_parse_bytes(text: object, expected: int) -> None:
    assert parse_bytes(text) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["4XB", "lots", "-1", -5, True, None, "GiB"])
def test_parse_bytes_rejects(bad: object) -> None:
    with pytest.raises(ConfigError, match="capacity"):
        parse_bytes(bad, "capacity")  # type: ignore[arg-type]


def test_namespace_and_least_sizes_have_one_rule() -> None:
    """The rules the config, the disk tier, the registry and the router all apply."""
    assert check_namespace("a.b-c_1") == "a.b-c_1"
    for bad in ("", "../up", "-x", "a/b", "x" * 65, 3, None):
        with pytest.raises(ConfigError, match="namespace"):
            check_namespace(bad)
    assert parse_bytes("1MiB", "disk_capacity", least=MIN_CAPACITY) == MIN_CAPACITY
    with pytest.raises(ConfigError, match=r"disk_capacity.*at least 1 MiB"):
        parse_bytes("512KiB", "disk_capacity", least=MIN_CAPACITY)
    with pytest.raises(ConfigError, match="at least 64 KiB"):
        parse_bytes(1000, "segment_bytes", least=64 << 10)
    with pytest.raises(ConfigError, match="at least 1 B"):
        parse_bytes(0, "max_pending_bytes", least=1)


def test_format_bytes() -> None:
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(3 << 30) == "3.0 GiB"


def test_defaults_are_valid_and_laptop_sized() -> None:
    cfg = KVRayConfig()
    assert cfg.capacity == 1 << 30
    assert cfg.namespace == "default"
    assert KVRayConfig.from_dict(cfg.to_dict()) == cfg


def test_from_dict_converts_cli_strings() -> None:
    cfg = KVRayConfig.from_dict(
        {"capacity": "2GiB", "verify_checksums": "false", "get_timeout_s": "2.5"}
    )
    assert cfg.capacity == 2 << 30
    assert cfg.verify_checksums is False
    assert cfg.get_timeout_s == 2.5
    assert KVRayConfig.from_dict({"load_bytes_per_s": "1GiB"}).load_bytes_per_s == 1 << 30


@pytest.mark.parametrize(
    ("values", "field", "value"),
    [
        ({"capacity": "4XB"}, "capacity", "4XB"),
        ({"capacity": 1024}, "capacity", 1024),
        ({"namespace": "bad name!"}, "namespace", "bad name!"),
        ({"namespace": ""}, "namespace", ""),
        ({"eviction_policy": "fifo"}, "eviction_policy", "fifo"),
        ({"get_timeout_s": 0}, "get_timeout_s", 0),
        ({"get_timeout_s": "soon"}, "get_timeout_s", "soon"),
        ({"verify_checksums": "maybe"}, "verify_checksums", "maybe"),
        ({"load_mode": "eager"}, "load_mode", "eager"),
        ({"segment_bytes": "1KiB"}, "segment_bytes", "1KiB"),
        ({"load_bytes_per_s": "64KiB"}, "load_bytes_per_s", "64KiB"),
        ({"capacitty": "1GiB"}, "capacitty", "1GiB"),
    ],
)
def test_bad_config_names_field_and_value(values: dict, field: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        KVRayConfig.from_dict(values)
    assert info.value.field_name == field
    assert field in str(info.value)
    assert repr(value) in str(info.value) or str(value) in str(info.value)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("capacity", "inf"),
        ("capacity", "-inf"),
        ("capacity", "1e400"),
        ("capacity", "nan"),
        ("capacity", float("inf")),
        ("capacity", float("nan")),
        ("capacity", "9" * 400 + "GiB"),
        ("capacity", "1" * 5000),
        ("capacity", 10**30),
        ("capacity", "2048TiB"),
        ("staging_bytes", -0.5),
        ("staging_bytes", "-1e3"),
        ("segment_bytes", "inf"),
        ("max_inflight_put_bytes", float("-inf")),
        ("get_timeout_s", float("nan")),
        ("get_timeout_s", float("inf")),
        ("put_timeout_s", -1),
        ("lease_timeout_s", "nan"),
    ],
    ids=lambda v: repr(v)[:24],
)
def test_non_finite_negative_and_absurd_values_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        KVRayConfig.from_dict({field: value})
    assert info.value.field_name == field
    assert f"invalid {field}=" in str(info.value)
    with pytest.raises(ConfigError) as direct:
        KVRayConfig(**{field: value})  # type: ignore[arg-type]
    assert direct.value.field_name == field


def test_one_number_rule_for_every_number_kvray_is_given() -> None:
    """Seconds, weights and intervals share one check: a bool, a string, NaN or infinity is
    a ConfigError naming the field and the range, wherever the number is given."""
    from kvray.ops.monitor import _check_interval
    from kvray.serving.inflight import InFlight
    from kvray.serving.score import Weights

    assert check_number(3, "x") == 3.0 and isinstance(check_number(3, "x"), float)
    assert check_number(0, "x") == 0.0
    assert check_number(3600, "x", high=3600, low_open=True) == 3600.0
    for bad in (True, "1", None, float("nan"), float("inf"), -float("inf")):
        with pytest.raises(
            ConfigError, match=r"invalid x=.*expected a finite number in \[0, inf\)"
        ):
            check_number(bad, "x")
    with pytest.raises(ConfigError, match=r"expected a number in \(0, 3600\] seconds"):
        check_number(0, "x", high=3600, low_open=True, unit="seconds")
    with pytest.raises(ConfigError, match=r"expected a number in \[0.1, 3600\]"):
        check_number(3601, "x", low=0.1, high=3600)
    callers = {
        "get_timeout_s": lambda v: KVRayConfig(get_timeout_s=v),
        "weights.queue": lambda v: Weights.of({"queue": v}),
        "inflight_s": lambda v: InFlight(ttl_s=v),
        "scrape_interval_s": _check_interval,
    }
    for field, make in callers.items():
        for bad in (float("nan"), float("inf"), True, "1", -1):
            with pytest.raises(ConfigError) as info:
                make(bad)
            assert info.value.field_name == field, (field, bad)
            assert "expected a" in info.value.reason and "number in" in info.value.reason


def test_the_largest_size_is_accepted() -> None:
    assert KVRayConfig(capacity=1 << 50).capacity == 1 << 50
    assert KVRayConfig(capacity="1024TiB").capacity == 1 << 50
    with pytest.raises(ConfigError, match="at most 1 PiB"):
        parse_bytes((1 << 50) + 1, "capacity")


def test_replace_rejects_unknown_fields() -> None:
    cfg = KVRayConfig()
    assert cfg.replace(capacity="2GiB").capacity == 2 << 30
    with pytest.raises(ConfigError) as info:
        cfg.replace(capacty="2GiB")
    assert info.value.field_name == "capacty"
    assert "unknown key" in str(info.value)
    with pytest.raises(ConfigError, match="unknown key"):
        cfg.replace(_extra={})


def test_start_with_a_typo_names_the_unknown_key() -> None:
    import kvray

    # The address answers nothing: were the key accepted, start would fail fast on Ray, not
    # silently deploy somewhere.
    with pytest.raises(ConfigError) as info:
        kvray.start(namespace="typo-test", address="127.0.0.1:9", capacty="1GiB")
    assert info.value.field_name == "capacty"
    assert "unknown key" in str(info.value)
    base = KVRayConfig(namespace="typo-test", address="127.0.0.1:9")
    with pytest.raises(ConfigError, match="capacity='1x'"):
        kvray.start(base, capacity="1x")


def _fp(**changes: object) -> LayoutFingerprint:
    base = {
        "model": "m",
        "kv_dtype": "bfloat16",
        "block_size": 16,
        "hash_algo": "sha256",
        "layout": "NHD",
        "tp_size": 2,
        "tp_rank": 0,
    }
    base.update(changes)
    return LayoutFingerprint(**base)  # type: ignore[arg-type]


def test_every_fingerprint_field_changes_the_prefix() -> None:
    base = _fp()
    variants = [
        _fp(model="other"),
        _fp(kv_dtype="float16"),
        _fp(block_size=32),
        _fp(hash_algo="sha256_cbor"),
        _fp(layout="HND"),
        _fp(tp_size=4),
        _fp(tp_rank=1),
        _fp(salt="lora-a"),
    ]
    prefixes = {base.prefix, *(v.prefix for v in variants)}
    assert len(prefixes) == len(variants) + 1
    assert all(len(p) == PREFIX_BYTES for p in prefixes)


def test_prefix_is_stable_and_keys_concatenate() -> None:
    assert _fp().prefix == _fp().prefix  # deterministic across instances (and processes)
    h = [b"\x01" * 32, b"\x02" * 32]
    keys = _fp().keys(h)
    assert keys == make_keys(_fp().prefix, h)
    assert keys[0] == _fp().prefix + h[0]
    assert _fp().for_rank(1) == _fp(tp_rank=1)


def test_fingerprint_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="tp_rank"):
        _fp(tp_rank=2)
    with pytest.raises(ValueError, match="block_size"):
        _fp(block_size=0)


def test_grouped_prefixes_are_distinct_and_validated() -> None:
    """A block stored in G shards (head ranges) and the same block in G' shards are distinct
    entries: the grouping is part of the key prefix, right after the fingerprint's digest."""
    base = _fp(tp_size=1).prefix
    prefixes = [grouped_prefix(base, g) for g in range(1, MAX_GROUPING + 1)]
    assert len(set(prefixes)) == MAX_GROUPING
    assert all(p[:PREFIX_BYTES] == base and len(p) == PREFIX_BYTES + 1 for p in prefixes)
    # Another fingerprint never meets these, whatever its grouping.
    other = _fp(tp_size=1, model="other").prefix
    assert not {grouped_prefix(other, g) for g in (1, 2, 4)} & set(prefixes)
    for bad in (0, MAX_GROUPING + 1, -1):
        with pytest.raises(ValueError, match="grouping"):
            grouped_prefix(base, bad)
    with pytest.raises(TypeError, match="grouping"):
        grouped_prefix(base, True)


def test_check_keys() -> None:
    with pytest.raises(TypeError):
        check_keys(["not-bytes"])
    with pytest.raises(ValueError, match="unique"):
        check_keys([b"a", b"a"])
    with pytest.raises(TypeError, match="sequence of bytes keys"):
        check_keys(b"one key")
    assert check_keys((b"a", b"b")) == [b"a", b"b"]
