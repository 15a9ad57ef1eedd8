"""The streaming reply parser: reasoning/content/tool-call split, chunking invariance, no leaks, UTF-8."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diffgemma.chat.parser import (
    BadCall,
    Content,
    End,
    Reasoning,
    StreamParser,
    ToolCall,
    coalesce,
    parse_reply,
)
from diffgemma.chat.tokenizer import ChatTokenizer
from diffgemma.testing.tokenizer import build_tokenizer

TOK = ChatTokenizer(build_tokenizer(), stop_ids=[1, 106, 50])

REPLIES = {
    "thought_then_call": (
        "<|channel>thought\nI should call the tool. Zürich ☕\n<channel|>Let me check."
        '<|tool_call>call:get_weather{city:<|"|>Zürich<|"|>,days:3,opts:{fast:true,tags:[<|"|>a<|"|>]}}<tool_call|>'
        "<|tool_response>"
    ),
    "empty_thought_answer": "<|channel>thought\n<channel|>Paris is the capital of France. 🙂<turn|>",
    "malformed_call": 'Sure<|tool_call>call:broken{city:<|"|>x}<tool_call|> done<turn|>',
    "stray_specials": "<mask>Hel<pad>lo<|turn> wor<unused_60>ld<bos><|think|>!\n<turn|>",
    "two_calls": (
        '<|tool_call>call:a{x:1}<tool_call|><|tool_call>call:b{y:<|"|>日本<|"|>,z:None}<tool_call|><eos>'
    ),
}


def events_of(ids: list[int], chunks: list[list[int]] | None = None, thinking_open: bool = False) -> list:
    parser = StreamParser(TOK, thinking_open=thinking_open)
    events = []
    for chunk in chunks if chunks is not None else [ids]:
        events += parser.feed(chunk)
    return events + parser.finish("length")


def test_reasoning_content_and_tool_call_split() -> None:
    events = coalesce(events_of(TOK.encode(REPLIES["thought_then_call"])))
    assert events == [
        Reasoning("I should call the tool. Zürich ☕"),
        Content("Let me check."),
        ToolCall(
            "get_weather",
            {"city": "Zürich", "days": 3, "opts": {"fast": True, "tags": ["a"]}},
            'call:get_weather{city:<|"|>Zürich<|"|>,days:3,opts:{fast:true,tags:[<|"|>a<|"|>]}}',
        ),
        End("tool_calls"),
    ]
    assert events[2].arguments_json == '{"city": "Zürich", "days": 3, "opts": {"fast": true, "tags": ["a"]}}'


def test_plain_answer_after_empty_thought() -> None:
    events = coalesce(events_of(TOK.encode(REPLIES["empty_thought_answer"])))
    assert events == [Content("Paris is the capital of France. 🙂"), End("stop")]


def test_thinking_open_starts_in_reasoning() -> None:
    ids = TOK.encode("Think hard.\n\n<channel|>Answer: 4<turn|>")
    assert coalesce(events_of(ids, thinking_open=True)) == [
        Reasoning("Think hard."),
        Content("Answer: 4"),
        End("stop"),
    ]
    # Reasoning keeps inner newlines; only those right before <channel|> go.
    ids = TOK.encode("<|channel>thought\na\n\nb\n<channel|>c<turn|>")
    assert coalesce(events_of(ids)) == [Reasoning("a\n\nb"), Content("c"), End("stop")]


def test_malformed_call_is_a_bad_call_not_content() -> None:
    events = coalesce(events_of(TOK.encode(REPLIES["malformed_call"])))
    assert events == [Content("Sure"), BadCall('call:broken{city:<|"|>x}'), Content(" done"), End("stop")]


def test_special_tokens_never_leak() -> None:
    events = coalesce(events_of(TOK.encode(REPLIES["stray_specials"])))
    assert events == [Content("Hello world!\n"), End("stop")]
    for name, text in REPLIES.items():
        for event in events_of(TOK.encode(text)):
            if isinstance(event, Content | Reasoning):
                decoded = TOK.encode(event.text)
                assert not set(decoded) & TOK.special_ids, (name, event)


def test_several_calls_and_stop_reason() -> None:
    text, reasoning, calls = parse_reply(TOK, TOK.encode(REPLIES["two_calls"]))
    assert (text, reasoning) == ("", "")
    assert [(c.name, c.arguments) for c in calls] == [("a", {"x": 1}), ("b", {"y": "日本", "z": None})]
    assert events_of(TOK.encode(REPLIES["two_calls"]))[-1] == End("tool_calls")


def test_stop_token_ends_the_reply() -> None:
    parser = StreamParser(TOK)
    events = parser.feed(TOK.encode("Done.<turn|>more text"))
    assert coalesce(events) == [Content("Done."), End("stop")]
    assert parser.done and parser.feed(TOK.encode("again")) == [] and parser.finish("length") == []


def test_finish_flushes_truncated_reply() -> None:
    assert coalesce(events_of(TOK.encode("Partial answer"))) == [Content("Partial answer"), End("length")]
    truncated = TOK.encode('<|tool_call>call:f{a:<|"|>unfinished')
    assert coalesce(events_of(truncated)) == [BadCall('call:f{a:<|"|>unfinished'), End("length")]


def test_parse_reply() -> None:
    text, reasoning, calls = parse_reply(TOK, TOK.encode(REPLIES["thought_then_call"]))
    assert text == "Let me check."
    assert reasoning == "I should call the tool. Zürich ☕"
    assert [c.name for c in calls] == ["get_weather"]


def test_utf8_split_across_tokens_is_never_emitted_partially() -> None:
    text = "a🙂b日本€"
    ids = TOK.encode(text)
    assert len(ids) > len(text)  # some characters are split over several byte-level tokens
    parser = StreamParser(TOK)
    pieces = []
    for token_id in ids:
        for event in parser.feed([token_id]):
            assert "\ufffd" not in event.text
            pieces.append(event.text)
    pieces += [e.text for e in parser.finish("stop") if isinstance(e, Content)]
    assert "".join(pieces) == text
    assert "🙂" in pieces or any("🙂" in p for p in pieces)


def test_content_is_incremental() -> None:
    parser = StreamParser(TOK)
    ids = TOK.encode("The quick brown fox jumps over the lazy dog.")
    emitted = [parser.feed([i]) for i in ids]
    assert sum(1 for e in emitted if e) >= len(ids) - 1  # ASCII text streams out token by token


def _chunked(ids: list[int], cuts: list[int]) -> list[list[int]]:
    bounds = [0, *sorted(set(c % (len(ids) + 1) for c in cuts)), len(ids)]
    return [ids[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


@pytest.mark.parametrize("name", sorted(REPLIES))
@settings(max_examples=40, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=12), thinking_open=st.booleans())
def test_events_do_not_depend_on_chunking(name: str, cuts: list[int], thinking_open: bool) -> None:
    ids = TOK.encode(REPLIES[name] + "tail text after the end")
    one_by_one = events_of(ids, [[i] for i in ids], thinking_open)
    assert events_of(ids, _chunked(ids, cuts), thinking_open) == one_by_one
    assert events_of(ids, [ids], thinking_open) == one_by_one


PIECES = [
    *"ab €日🙂\n{}:,",
    '<|"|>',
    "<|channel>",
    "<channel|>",
    "<|tool_call>",
    "call:f{x:1}",
    "<tool_call|>",
    "<pad>",
]


@settings(max_examples=100, deadline=None)
@given(
    text=st.lists(st.sampled_from(PIECES), max_size=30).map("".join),
    cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=8),
)
def test_random_text_chunking_invariance(text: str, cuts: list[int]) -> None:
    ids = TOK.encode(text)
    one_by_one = events_of(ids, [[i] for i in ids])
    assert events_of(ids, _chunked(ids, cuts)) == one_by_one
    for event in one_by_one:
        if isinstance(event, Content | Reasoning):
            assert "\ufffd" not in event.text
