"""A tiny, deterministic byte-level BPE tokenizer with the Gemma 4 special tokens at their real ids.

Ids 0..106 are special tokens (the Gemma 4 control tokens where the real tokenizer has them, `<unused_N>`
fillers elsewhere) and id 107 is "\\n" as a plain added token, as in the real tokenizer, so that decoding keeps
it. BPE merges are learned with HF `tokenizers` from a small built-in English / chat / JSON corpus and take the
ids from 108 up. Special tokens are matched before pre-tokenization, so they are never split and decode back
verbatim unless specials are skipped.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS: dict[int, str] = {
    0: "<pad>",
    1: "<eos>",
    2: "<bos>",
    3: "<unk>",
    4: "<mask>",
    46: "<|tool>",
    47: "<tool|>",
    48: "<|tool_call>",
    49: "<tool_call|>",
    50: "<|tool_response>",
    51: "<tool_response|>",
    52: '<|"|>',
    98: "<|think|>",
    100: "<|channel>",
    101: "<channel|>",
    105: "<|turn>",
    106: "<turn|>",
}
NEWLINE_ID = 107
FIRST_BPE_ID = NEWLINE_ID + 1

_SENTENCES = """\
The quick brown fox jumps over the lazy dog.
What is the capital of France? The capital of France is Paris.
Hello! How can I help you today? Please answer the question in one short sentence.
I think the answer is forty two, but let me check the numbers again.
The weather in London is cloudy with light rain and a temperature of 14 degrees.
Machine learning models learn patterns from data, and language models predict text.
A diffusion model starts from noise and removes it step by step until the text is clear.
Write a function that returns the sum of a list of numbers.
Sure, here is a simple example written in Python with a short explanation.
Thank you very much for your help, that was exactly what I needed.
The user wants to know the time, so I should call the clock tool first.
Let me search the documentation for the right configuration option.
Error: the file could not be found. Please check the path and try again.
Once upon a time there was a small village near a large forest by the river.
Numbers like 1, 2, 3, 10, 100, 2024 and 3.14 appear often in text.
Café, naïve, résumé, Zürich, München, 東京, 日本語, emoji 🙂 and symbols like € or ≥.
"""

_WORDS = (
    "system user model assistant tool tools function functions call response declaration description "
    "parameters properties required type string number integer boolean object array enum items nullable "
    "value values name names query result results search weather city country location unit celsius "
    "fahrenheit days time date today tomorrow answer question reason reasoning thought think thinking "
    "channel content message messages token tokens text prompt reply request server client model models "
    "json true false null none error errors check checking return returns list dict key keys data file "
    "path config option options default limit offset count total first second third last next previous "
    "hello world please thanks sorry yes okay great good bad small large fast slow hot cold rain snow sun"
)

_JSON_SAMPLES = [
    {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "days": 3}},
    {"query": "tool calls", "limit": 10, "exact": False, "tags": ["api", "guide"], "cursor": None},
    {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": "{}"}},
    {"temperature": 21.5, "humidity": 0.63, "conditions": "sunny", "ok": True},
    {"role": "user", "content": [{"type": "text", "text": "Hello there"}]},
]


def _builtin_corpus() -> list[str]:
    lines = _SENTENCES.splitlines()
    words = _WORDS.split()
    # Deterministic word pairs and chat-format snippets so the merges cover the prompt format too.
    lines += [" ".join(pair) for pair in itertools.islice(itertools.combinations(words, 2), 0, None, 7)]
    lines += [json.dumps(obj) for obj in _JSON_SAMPLES]
    lines += [json.dumps(obj, indent=2) for obj in _JSON_SAMPLES]
    for i, line in enumerate(_SENTENCES.splitlines()):
        role = ("user", "model", "system")[i % 3]
        lines.append(f"<|turn>{role}\n{line}<turn|>\n")
    lines.append('<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>')
    return lines


def _reserved_tokens() -> list[str]:
    return [SPECIAL_TOKENS.get(i, f"<unused_{i}>") for i in range(NEWLINE_ID)] + ["\n"]


def _without_specials(text: str) -> str:
    # Specials are matched before BPE, so they must not also be learned as merges (`<|"|>` would be).
    for token in SPECIAL_TOKENS.values():
        text = text.replace(token, " ")
    return text


def build_tokenizer(vocab_size: int = 1024, corpus: list[str] | None = None) -> Tokenizer:
    """Train the test tokenizer (deterministic for a given corpus); `vocab_size` caps the vocabulary."""
    min_size = FIRST_BPE_ID + len(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < min_size:
        raise ValueError(
            f"vocab_size must be at least {min_size} (reserved ids + byte alphabet), got {vocab_size}"
        )
    reserved = _reserved_tokens()
    texts = [_without_specials(t) for t in _builtin_corpus() + list(corpus or [])]

    # Learn merges on a scratch tokenizer, then rebuild the vocabulary with the reserved ids in front.
    scratch = Tokenizer(models.BPE())
    scratch.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - FIRST_BPE_ID,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    scratch.train_from_iterator(texts, trainer)
    learned = json.loads(scratch.to_str())["model"]
    vocab = {token: i for i, token in enumerate(reserved)}
    for token, i in learned["vocab"].items():
        if token in vocab:
            raise ValueError(f"learned token {token!r} collides with a reserved token")
        vocab[token] = FIRST_BPE_ID + i
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in learned["merges"]]

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # Added tokens whose text is already in the vocabulary keep that id, which pins them to their real ids.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in reserved[:NEWLINE_ID]])
    tok.add_tokens([AddedToken("\n", special=False, normalized=False)])
    return tok


def write_tokenizer_files(dir: str | Path, tokenizer: Tokenizer) -> None:
    """Write `tokenizer.json` and a minimal `tokenizer_config.json` into `dir`."""
    path = Path(dir)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "mask_token": "<mask>",
        "add_bos_token": False,
        "add_eos_token": False,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
