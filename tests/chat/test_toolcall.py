"""The tool-call argument grammar: formatting, parsing, and their round trip."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diffgemma.chat.toolcall import QUOTE, format_call, format_value, parse_call, parse_value

KEYS = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,11}", fullmatch=True)
SCALARS = (
    st.text(max_size=20).filter(lambda s: QUOTE not in s)
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.booleans()
    | st.none()
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(KEYS, inner, max_size=5),
    max_leaves=25,
)


def test_format_matches_template_spelling() -> None:
    value = {"b": [1, 2.5, True, None], "A": "x", "c": {"z": False, "y": "q"}, "d": []}
    assert format_value(value) == '{A:<|"|>x<|"|>,b:[1,2.5,true,None],c:{y:<|"|>q<|"|>,z:false},d:[]}'
    assert format_value({"k": "v"}, escape_keys=True) == '{<|"|>k<|"|>:<|"|>v<|"|>}'
    assert format_value("") == '<|"|><|"|>'
    assert format_call("f", {"x": 1}) == "call:f{x:1}"


@settings(max_examples=300, deadline=None)
@given(VALUES)
def test_round_trip(value) -> None:
    text = format_value(value)
    assert parse_value(text) == value
    assert format_value(parse_value(text)) == text


@settings(max_examples=100, deadline=None)
@given(VALUES)
def test_round_trip_with_escaped_keys(value) -> None:
    assert parse_value(format_value(value, escape_keys=True)) == value


@settings(max_examples=100, deadline=None)
@given(KEYS, st.dictionaries(KEYS, VALUES, max_size=4))
def test_call_round_trip(name: str, arguments: dict) -> None:
    assert parse_call(format_call(name, arguments)) == (name, arguments)


def test_numbers_keep_their_type() -> None:
    assert parse_value("[1,1.0,-3,2e3,-0.5,1e-05]") == [1, 1.0, -3, 2000.0, -0.5, 1e-05]
    assert [type(v) for v in parse_value("[1,1.0]")] == [int, float]


def test_parser_accepts_json_constants_and_whitespace() -> None:
    assert parse_value('{ a : null , b : [ true , false ] , c : <|"|> s p <|"|> }') == {
        "a": None,
        "b": [True, False],
        "c": " s p ",
    }


def test_string_may_hold_structural_characters() -> None:
    s = 'a,b:{c}[d] "quoted" <|not a delimiter|>'
    assert parse_value(format_value({"k": s})) == {"k": s}


@pytest.mark.parametrize(
    "text",
    ['{a:<|"|>unterminated}', "{a:1", "{a 1}", "[1,,2]", "{a:1}}", "{a:maybe}", "", '{:<|"|>x<|"|>}'],
)
def test_malformed_values_raise(text: str) -> None:
    with pytest.raises(ValueError):
        parse_value(text)


@pytest.mark.parametrize("text", ["get_weather{}", "call:{a:1}", "call:f", "call:f{a:1", "call:f g{a:1}"])
def test_malformed_calls_raise(text: str) -> None:
    with pytest.raises(ValueError):
        parse_call(text)


def test_parse_call() -> None:
    assert parse_call('call:get_weather{city:<|"|>Paris<|"|>,days:3}') == (
        "get_weather",
        {"city": "Paris", "days": 3},
    )
