"""custom_id_for: stable, short, distinct; decode_key: back to typed values."""

from __future__ import annotations

import datetime as dt
import re
import subprocess
import sys
from decimal import Decimal

import pytest

from airflow_batch_provider.keys import (
    HASH_PREFIX,
    MAX_CUSTOM_ID,
    check_prefix,
    custom_id_for,
    decode_key,
    jsonable_key,
)


def test_short_safe_single_keys_stay_readable() -> None:
    assert custom_id_for([42]) == "42"
    assert custom_id_for([-7]) == "-7"
    assert custom_id_for(["ticket-001_b"]) == "ticket-001_b"
    assert custom_id_for([42], prefix="run1-") == "run1-42"


# Anthropic's rule, the strictest of every vendor's.
EVERY_VENDOR = re.compile(r"[a-zA-Z0-9_-]{1,64}")


@pytest.mark.parametrize(
    "values",
    [
        ["ticket-001.a:b_c"],  # '.' and ':' are not Anthropic's: the key is hashed, not kept
        ["a.b"],
        ["x:y"],
        ["has space"],
        [-(10**40)],
        [dt.date(2024, 2, 3)],
        ["ünï"],
        [7, "x.y"],
        ["x" * 64],
    ],
)
def test_every_custom_id_is_one_every_vendor_accepts(values: list[object]) -> None:
    assert EVERY_VENDOR.fullmatch(custom_id_for(values)), custom_id_for(values)
    assert EVERY_VENDOR.fullmatch(custom_id_for(values, prefix="run_7-")), custom_id_for(
        values, prefix="run_7-"
    )


@pytest.mark.parametrize("prefix", ["run.1-", "a:b", "x y"])
def test_a_prefix_every_vendor_would_not_accept_is_refused(prefix: str) -> None:
    with pytest.raises(ValueError, match="may only use letters, digits, _ and -"):
        check_prefix(prefix)


@pytest.mark.parametrize(
    "values",
    [
        ["has space"],
        ["émoji 😀"],
        ["1"],  # would collide with the integer 1
        [HASH_PREFIX + "abc"],  # would look like a hashed id
        ["x" * 65],
        [True],
        [1.5],
        [None],
        [b"\xff"],
        [dt.date(2024, 1, 1)],
        [1, "a"],
    ],
)
def test_everything_else_is_hashed_to_a_fixed_length(values: list[object]) -> None:
    cid = custom_id_for(values)
    assert cid.startswith(HASH_PREFIX)
    assert len(cid) == len(HASH_PREFIX) + 26 <= MAX_CUSTOM_ID


def test_distinct_keys_get_distinct_ids() -> None:
    keys = [[1], ["1"], [True], [1.0], [1.5], ["a", "b"], ["a,b"], [["a"], "b"], ["ab"], [None]]
    ids = [custom_id_for(k) for k in keys]
    assert len(set(ids)) == len(ids)
    many = {custom_id_for([i, f"s{i}"]) for i in range(20_000)}
    assert len(many) == 20_000


def test_equal_keys_get_equal_ids() -> None:
    assert custom_id_for([Decimal("1.50"), "x"]) == custom_id_for([Decimal("1.5"), "x"])
    assert custom_id_for([Decimal("3")]) == custom_id_for([3]) == "3"
    # Numerically equal keys are the same key whatever the driver returned.
    assert custom_id_for([Decimal("1.5")]) == custom_id_for([1.5])
    assert custom_id_for([{"b": 1, "a": 2}]) == custom_id_for([{"a": 2, "b": 1}])


def test_ids_are_stable_across_processes() -> None:
    """Python's own hash() is salted per process; custom_id_for must not depend on it."""
    code = (
        "import datetime as dt; from airflow_batch_provider.keys import custom_id_for; "
        "print(custom_id_for(['a b', dt.date(2024, 1, 2), 3]))"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout.strip()
        for _ in range(2)
    }
    assert outputs == {custom_id_for(["a b", dt.date(2024, 1, 2), 3])}


def test_long_prefix_falls_back_to_hash_within_64() -> None:
    prefix = "p" * (MAX_CUSTOM_ID - len(HASH_PREFIX) - 26)
    assert check_prefix(prefix) == prefix
    assert custom_id_for(["readable"], prefix=prefix) == prefix + "readable"
    cid = custom_id_for(["r" * 30], prefix=prefix)
    assert len(cid) == MAX_CUSTOM_ID and cid.startswith(prefix + HASH_PREFIX)
    with pytest.raises(ValueError, match="longer than"):
        check_prefix(prefix + "p")
    with pytest.raises(ValueError, match="letters, digits"):
        check_prefix("bad prefix")


def test_jsonable_and_decode_round_trip() -> None:
    values = [7, "x", dt.date(2024, 2, 3), dt.datetime(2024, 2, 3, 4, 5, 6), Decimal("2.50"), True, None]
    stored = jsonable_key(values)
    assert stored == [7, "x", "2024-02-03", "2024-02-03T04:05:06", "2.50", True, None]
    types = ["integer", "text", "date", "timestamp", "float", "boolean", "text"]
    assert decode_key(stored, types) == (
        7,
        "x",
        dt.date(2024, 2, 3),
        dt.datetime(2024, 2, 3, 4, 5, 6),
        Decimal("2.50"),
        True,
        None,
    )
    assert jsonable_key([b"\xff\x00"]) == ["base64:/wA="]


def test_huge_integer_keys_still_fit() -> None:
    huge = 10**60
    assert custom_id_for([huge]) == str(huge)
    cid = custom_id_for([huge], prefix="p" * 10)
    assert cid.startswith("p" * 10 + HASH_PREFIX) and len(cid) <= MAX_CUSTOM_ID
