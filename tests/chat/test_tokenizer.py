"""The test tokenizer and ChatTokenizer: special ids, encode/decode round trips, stop ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diffgemma.chat.tokenizer import ChatTokenizer
from diffgemma.testing.tokenizer import SPECIAL_TOKENS, build_tokenizer, write_tokenizer_files

REAL_IDS = {
    "<pad>": 0,
    "<eos>": 1,
    "<bos>": 2,
    "<unk>": 3,
    "<mask>": 4,
    "<|tool>": 46,
    "<tool|>": 47,
    "<|tool_call>": 48,
    "<tool_call|>": 49,
    "<|tool_response>": 50,
    "<tool_response|>": 51,
    '<|"|>': 52,
    "<|think|>": 98,
    "<|channel>": 100,
    "<channel|>": 101,
    "<|turn>": 105,
    "<turn|>": 106,
}
CHAT = (
    "<bos><|turn>system\n<|think|>\nBe brief.<turn|>\n<|turn>user\nWeather in Zürich? 🙂<turn|>\n"
    '<|turn>model\n<|channel>thought\nCall the tool.\n<channel|><|tool_call>call:get_weather{city:<|"|>Zürich<|"|>}'
    '<tool_call|><|tool_response>response:get_weather{value:<|"|>Sunny<|"|>}<tool_response|>It\'s sunny.<turn|>\n'
)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tok")
    write_tokenizer_files(path, build_tokenizer())
    return path


@pytest.fixture(scope="module")
def tok(ckpt: Path) -> ChatTokenizer:
    return ChatTokenizer.from_dir(ckpt)


def test_special_tokens_sit_at_real_ids(tok: ChatTokenizer) -> None:
    for token, token_id in REAL_IDS.items():
        assert tok.token_to_id(token) == token_id, token
        assert tok.encode(token) == [token_id], token
        assert tok.decode([token_id]) == token
    assert {i: t for t, i in REAL_IDS.items()} == SPECIAL_TOKENS
    assert tok.token_to_id("\n") == 107 and tok.encode("\n") == [107]
    assert tok.token_to_id("<unused_53>") == 53
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (2, 1, 0)


def test_special_ids_are_the_control_tokens(tok: ChatTokenizer) -> None:
    assert tok.special_ids == set(range(107))
    assert 107 not in tok.special_ids
    assert tok.decode([105, 107, 106], skip_special=True) == "\n"


def test_vocab_and_determinism(tok: ChatTokenizer) -> None:
    assert tok.vocab_size == 1024
    assert build_tokenizer().to_str() == tok.tokenizer.to_str()
    smaller = build_tokenizer(vocab_size=600, corpus=["extra words for the corpus"])
    assert smaller.get_vocab_size() <= 600
    assert smaller.token_to_id("<turn|>") == 106
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer(vocab_size=200)


def test_chat_text_round_trip(tok: ChatTokenizer) -> None:
    ids = tok.encode(CHAT)
    assert tok.decode(ids) == CHAT
    assert ids[0] == 2 and ids.count(105) == 3 and ids.count(52) == 4
    assert max(ids) < tok.vocab_size
    # Special tokens never split: each literal occurrence is exactly one id.
    for token, token_id in REAL_IDS.items():
        assert ids.count(token_id) == CHAT.count(token)


def test_no_automatic_bos(tok: ChatTokenizer) -> None:
    assert tok.encode("hello")[0] != tok.bos_id
    assert tok.encode("") == []


def test_stop_ids_from_generation_config(ckpt: Path, tmp_path: Path) -> None:
    assert ChatTokenizer.from_dir(ckpt).stop_ids == {1, 106, 50}  # defaults without generation_config
    write_tokenizer_files(tmp_path, build_tokenizer())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 106, 50]}))
    assert ChatTokenizer.from_dir(tmp_path).stop_ids == {1, 106, 50}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 106}))
    assert ChatTokenizer.from_dir(tmp_path).stop_ids == {106}


def test_tokenizer_config_written(ckpt: Path) -> None:
    config = json.loads((ckpt / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == ("<bos>", "<eos>", "<pad>")


def test_missing_or_corrupt_tokenizer(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no tokenizer.json"):
        ChatTokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot load"):
        ChatTokenizer.from_dir(tmp_path)


def test_render_without_template_uses_our_renderer(tok: ChatTokenizer) -> None:
    assert tok.chat_template is None
    prompt = tok.render([{"role": "user", "content": "What is the capital of France?"}])
    assert (
        prompt
        == "<bos><|turn>user\nWhat is the capital of France?<turn|>\n<|turn>model\n<|channel>thought\n<channel|>"
    )
    ids = tok.encode(prompt)
    assert ids[:4] == [2, 105, tok.token_to_id("user"), 107]
    assert ids[-5:] == [107, 100, tok.token_to_id("thought"), 107, 101]


def test_render_rejects_unknown_role_and_parses_string_arguments(tok: ChatTokenizer) -> None:
    with pytest.raises(ValueError, match="'robot'"):
        tok.render([{"role": "robot", "content": "beep"}])
    call = {
        "id": "c",
        "type": "function",
        "function": {"name": "f", "arguments": '{"b": [1, null], "a": "x"}'},
    }
    prompt = tok.render([{"role": "user", "content": "go"}, {"role": "assistant", "tool_calls": [call]}])
    assert prompt.endswith('<|tool_call>call:f{a:<|"|>x<|"|>,b:[1,None]}<tool_call|><|tool_response>')
