"""A 3-question schema scored through `Engine.score`: a first request and a repeat."""

from __future__ import annotations

import time
from typing import Any

from diffgemma.bench.report import log
from diffgemma.bench.timing import _median, _sync
from diffgemma.config import SamplerConfig
from diffgemma.runner.runner import ModelRunner


def demo_schema(i: int) -> dict[str, Any]:
    """A 3-question schema of the demo model's kinds (choice, yes/no, score); `i` makes its prefix its own."""
    return {
        "instructions": f"Order desk {i}.",
        "questions": [
            {"id": "kind", "type": "choice", "instructions": "What kind of thing is the item?",
             "options": [{"name": "fruit"}, {"name": "animal"}, {"name": "object"}]},
            {"id": "late", "type": "noul", "instructions": "Has the order waited more than 5 days?"},
            {"id": "wait", "type": "score", "instructions": "How long has the order waited?",
             "levels": ["1 to 3 days", "4 to 6 days", "7 days or more"]},
        ],
    }  # fmt: skip


def schema_timing(runner: ModelRunner, reps: int) -> dict[str, Any]:
    """`demo_schema` answered through `Engine.score` with the demo tokenizer on the runner's model: a schema's first
    request (its prefix not cached) and a repeat with another state (the prefix reused), wall ms each, the median
    over `reps` schemas after one warm-up pair, with the reply's own prefill and denoise times."""
    from diffgemma.chat.tokenizer import ChatTokenizer
    from diffgemma.session.client import Engine
    from diffgemma.train.tokenizer import LABEL_WORDS, with_words
    from diffgemma.weights.download import bundled_model

    demo = bundled_model()
    if demo is None:
        raise RuntimeError("--schema needs the bundled demo model's tokenizer, and this build has none")
    tok = ChatTokenizer.from_dir(demo)
    # yes and no one token each, as the demo trainer makes them (a no-op on a tokenizer that has them)
    tok = ChatTokenizer(with_words(tok.tokenizer, LABEL_WORDS), chat_template=tok.chat_template)
    if tok.tokenizer.get_vocab_size() > runner.model.cfg.vocab_size:
        raise ValueError(
            f"--schema needs a vocabulary that holds the demo tokenizer's {tok.tokenizer.get_vocab_size()} ids; "
            f"this model has {runner.model.cfg.vocab_size}"
        )
    engine = Engine(runner, SamplerConfig(), tokenizer=tok, max_tokens=4096)
    states = [
        {"item": "apple", "city": "Paris", "days": 9, "count": 12},
        {"item": "lamp", "city": "Berlin", "days": 2, "count": 7},
    ]
    rows: dict[str, list[dict[str, Any]]] = {"first": [], "repeat": []}
    for i in range(-1, reps):  # -1: the warm-up pair (compiles, captures)
        for state, kind in zip(states, rows, strict=True):
            _sync(runner.device)
            t0 = time.perf_counter()
            reply = engine.score(demo_schema(i), state, seed=i)
            wall = (time.perf_counter() - t0) * 1e3
            if i >= 0:
                d = reply["diagnostics"]
                rows[kind].append({"wall_ms": wall, "reads": d["samples"]["n"], **d["timing"]})
    res = {kind: {key: _median([r[key] for r in rs]) for key in rs[0]} for kind, rs in rows.items()}
    for kind, r in res.items():
        log(
            f"diffgemma: 3-question schema, {kind} request: {r['wall_ms']:.1f} ms ({r['prefill_ms']:.1f} ms prefill, "
            f"{r['denoise_ms']:.1f} ms for {r['reads']:.0f} reads, {r['reused_tokens']:.0f} tokens reused)"
        )
    return res
