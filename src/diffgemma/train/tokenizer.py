"""The demo model's tokenizer: `build_tokenizer` trained on the synthetic corpus, with digit merges removed.

Numbers are the core of several demo tasks (arithmetic, codes, counting). Byte-level BPE would learn merges
such as "42" or " 17", turning addition into a lookup table over thousands of number tokens that never
generalises to unseen operands. Dropping every merge whose result holds a digit makes every number a sequence
of single-digit tokens (the ids of the unused merged tokens stay reserved, so nothing else moves). The Gemma 4
special tokens keep their real ids (`build_tokenizer` guarantees that; `check_special_ids` verifies it).
"""

from __future__ import annotations

import json

from tokenizers import Tokenizer

from diffgemma.testing.tokenizer import NEWLINE_ID, SPECIAL_TOKENS, build_tokenizer
from diffgemma.train import data


def _strip_digit_merges(tok: Tokenizer) -> Tokenizer:
    data = json.loads(tok.to_str())
    merges = data["model"]["merges"]

    def keep(m) -> bool:
        a, b = m if isinstance(m, list) else m.split(" ")
        return not any(c.isdigit() for c in a + b)

    data["model"]["merges"] = [m for m in merges if keep(m)]
    return Tokenizer.from_str(json.dumps(data))


# Words the question-schema API needs as one token each after a newline (`chat.questions.template`: a yes/no
# question's labels); the corpus's BPE may merge them only after a space.
LABEL_WORDS = ("yes", "no")
# And the schema task's words (a state's `"Madrid"`, where the corpus's BPE has ` Madrid` only after a space), so
# that a state's value and an option's name are one token each (docs/train/README.md).
WORDS = LABEL_WORDS + data.SCHEMA_WORDS


def demo_tokenizer(corpus: list[str], vocab_size: int = 4096) -> Tokenizer:
    tok = with_words(_strip_digit_merges(build_tokenizer(vocab_size=vocab_size, corpus=corpus)), WORDS)
    check_special_ids(tok)
    return tok


def with_words(tok: Tokenizer, words: tuple[str, ...]) -> Tokenizer:
    """`tok` with each word one token after a newline (or a quote, as in a JSON string; a word may start with a
    space): the merges that join its current pieces, left to right, and their tokens at the next free ids (an
    existing tokenizer keeps every id it had). Each word's pieces are read with the merges of the words before it,
    so every word ends as one token."""
    data = json.loads(tok.to_str())
    vocab, merges = data["model"]["vocab"], data["model"]["merges"]
    as_lists = bool(merges) and isinstance(merges[0], list)
    taken = set(vocab.values()) | {t["id"] for t in data.get("added_tokens", [])}
    for word in words:
        pieces = tok.encode("\n" + word, add_special_tokens=False).tokens[1:]
        if len(pieces) < 2:
            continue
        while len(pieces) > 1:
            joined = pieces[0] + pieces[1]
            if joined not in vocab:
                vocab[joined] = next(i for i in range(len(taken) + 1) if i not in taken)
                taken.add(vocab[joined])
            merges.append([pieces[0], pieces[1]] if as_lists else f"{pieces[0]} {pieces[1]}")
            pieces = [joined, *pieces[2:]]
        tok = Tokenizer.from_str(json.dumps(data))
    return tok


def check_special_ids(tok: Tokenizer) -> None:
    """Every Gemma 4 special token, and "\n", at its real id."""
    for i, text in [*SPECIAL_TOKENS.items(), (NEWLINE_ID, "\n")]:
        got = tok.token_to_id(text)
        if got != i:
            raise ValueError(f"tokenizer maps {text!r} to {got}, expected {i}")
