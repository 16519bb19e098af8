"""The edge's hand-rolled JSON (router.routelog json_* helpers) matches json.dumps exactly."""

from __future__ import annotations

import enum
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.routelog import json_bool, json_float, json_int, json_str, json_str_list


def _dumps(x):
    return json.dumps(x, separators=(",", ":"), ensure_ascii=False)


class _StrEnum(str, enum.Enum):
    A = "a\"b"


@pytest.mark.parametrize("value", [None, "", "plain", "quote\"back\\slash", "ünïcødé ✓", "ctl\x00\x1f\n\t",
                                   "\ud800", _StrEnum.A, 3, 2.5, ["x"]])
def test_json_str_matches_dumps(value):
    assert json_str(value) == _dumps(value)


@pytest.mark.parametrize("value", [0, -1, 2**70, True, False, None, 1.5])
def test_json_int_matches_dumps(value):
    assert json_int(value) == _dumps(value)


@pytest.mark.parametrize("value", [True, False, None, 0, 1])
def test_json_bool_matches_dumps(value):
    assert json_bool(value) == _dumps(value)


@pytest.mark.parametrize("value", [0.0, -0.0, 1.5, 1e-7, 123456.789, 1e300, 3, float("inf"), float("nan")])
def test_json_float_matches_dumps(value):
    assert json_float(value) == _dumps(value)


@given(st.lists(st.text()))
def test_json_str_list_matches_dumps(values):
    assert json_str_list(values) == _dumps(values)
    assert json_str_list(tuple(values)) == _dumps(values)


@given(st.text())
def test_json_str_round_trips(value):
    assert json.loads(json_str(value)) == value
