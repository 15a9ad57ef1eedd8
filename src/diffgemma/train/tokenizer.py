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


def _strip_digit_merges(tok: Tokenizer) -> Tokenizer:
    data = json.loads(tok.to_str())
    merges = data["model"]["merges"]

    def keep(m) -> bool:
        a, b = m if isinstance(m, list) else m.split(" ")
        return not any(c.isdigit() for c in a + b)

    data["model"]["merges"] = [m for m in merges if keep(m)]
    return Tokenizer.from_str(json.dumps(data))


def demo_tokenizer(corpus: list[str], vocab_size: int = 4096) -> Tokenizer:
    tok = _strip_digit_merges(build_tokenizer(vocab_size=vocab_size, corpus=corpus))
    check_special_ids(tok)
    return tok


def check_special_ids(tok: Tokenizer) -> None:
    """Every Gemma 4 special token, and "\n", at its real id."""
    for i, text in [*SPECIAL_TOKENS.items(), (NEWLINE_ID, "\n")]:
        got = tok.token_to_id(text)
        if got != i:
            raise ValueError(f"tokenizer maps {text!r} to {got}, expected {i}")
