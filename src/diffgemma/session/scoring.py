"""The question-schema API's reads as ops (`chat.questions` has the schema, the template and the reply): route and
prefill the prompt (the schema's prefix stays cached for the next state), then `Read`s of the seeded answer canvas.
A generator of ops, so that the server's worker and `Session.score` run the same steps."""

from __future__ import annotations

import math
import time
from collections.abc import Generator
from typing import Any

from diffgemma.chat import questions as Q
from diffgemma.engine.rng import Rng, block_seed
from diffgemma.session import ops as O


def fill(
    schema: Q.Schema, t: Q.Template, read: int, vocab: int, pad: int, pinned: dict[int, int]
) -> list[int]:
    """The canvas of one read: each hole filled by the schema's policy (noise: the LCG of the read's block seed;
    pad; label: the first label), a pinned slot by its label."""
    canvas = list(t.ids)
    noise = Rng(block_seed(schema.seed, 0, read)).tokens(len(t.slots), vocab).tolist()
    for qi, slot in enumerate(t.slots):
        if qi in pinned:
            canvas[slot] = pinned[qi]
        elif schema.hole == "noise":
            canvas[slot] = noise[qi]
        elif schema.hole == "pad":
            canvas[slot] = pad
        else:
            canvas[slot] = t.labels[qi][0]
    return canvas


def score(
    schema: Q.Schema, t: Q.Template, ids: list[int], vocab: int, pad: int
) -> Generator[O.Op, list[O.Event], dict[str, Any]]:
    """Ops for a schema request whose prompt is `ids`; returns the reply object (`Answers.reply`). The auto rule: a
    read, then up to auto_max when a slot's label entropy is above auto_threshold (with fix_definite, the settled
    slots pinned to their label for the later reads)."""
    t0 = time.perf_counter()
    yield O.Route(ids)
    (aligned,) = yield O.AlignTo(ids)
    if ids[aligned.reused :]:
        yield O.Extend(ids[aligned.reused :])
    t1 = time.perf_counter()
    answers, pinned = Q.Answers(), {}
    n = schema.samples if isinstance(schema.samples, int) else 1
    i = 0
    while i < n:
        (out,) = yield O.Read(fill(schema, t, i, vocab, pad, pinned), t.slots, t.labels, schema.steps)
        answers.reads.append(Q.ReadResult(out.probs, out.entropy, out.label_mass, out.argmax_is_label))
        if i == 0 and schema.samples == "auto":
            settled = [Q.label_entropy(p) <= schema.auto_threshold for p in out.probs]
            if not all(settled):
                n = schema.auto_max
                if schema.fix_definite:  # the later reads condition on the settled answers
                    pinned = {
                        qi: t.labels[qi][Q.argmax(p)]
                        for qi, (p, ok) in enumerate(zip(out.probs, settled, strict=True))
                        if ok
                    }
        i += 1
    timing = {
        "prefill_ms": round((t1 - t0) * 1e3, 3),
        "denoise_ms": round((time.perf_counter() - t1) * 1e3, 3),
        "reused_tokens": aligned.reused,
    }
    diagnostics = {"steps": schema.steps, "hole": schema.hole, "timing": timing}
    if schema.climb:
        diagnostics["climb"] = yield from climb(schema, t, answers.reads[0].probs, vocab, pad)
    return answers.reply(schema, diagnostics)


def climb(
    schema: Q.Schema, t: Q.Template, first: list[list[float]], vocab: int, pad: int
) -> Generator[O.Op, list[O.Event], dict[str, Any]]:
    """The diagnostic hill climb from the first read's labels: re-read one question's slot (the first read's hole)
    with every other slot pinned to its current label and move it to that read's argmax. "sweep" moves each
    question in turn, each seeing the moves before it; "steepest" reads every question from one assignment and
    moves only the one of largest log-probability gain. It stops when no label moves (`converged`) or after `climb`
    rounds; `ratified` says whether it ended on the first read's labels. The answers stay those of the reads."""
    start = [Q.argmax(p) for p in first]
    labels, reads, rounds, moved = list(start), 0, 0, True
    while moved and rounds < schema.climb:
        rounds, moved, gains = rounds + 1, False, []
        for qi in range(len(t.slots)):
            pinned = {k: t.labels[k][j] for k, j in enumerate(labels) if k != qi}
            (out,) = yield O.Read(fill(schema, t, 0, vocab, pad, pinned), t.slots, t.labels, schema.steps)
            reads += 1
            p, best = out.probs[qi], Q.argmax(out.probs[qi])
            if best == labels[qi]:
                continue
            if schema.climb_mode == "sweep":
                labels[qi], moved = best, True
            else:
                gains.append((math.log(p[best]) - math.log(max(p[labels[qi]], 1e-30)), qi, best))
        if gains:
            _, qi, best = max(gains)
            labels[qi], moved = best, True
    qs = schema.questions
    return {
        "mode": schema.climb_mode,
        "rounds": rounds,
        "reads": reads,
        "labels": {q.id: q.labels[j] for q, j in zip(qs, labels, strict=True)},
        "moved": [q.id for q, a, b in zip(qs, start, labels, strict=True) if a != b],
        "converged": not moved,
        "ratified": labels == start,
    }


def prepare(
    tok, canvas_length: int, obj: dict[str, Any], state: Any, seed: int = 0
) -> tuple[Q.Schema, Q.Template, list[int]]:
    """The schema, its template and the prompt ids of a request (SchemaError for a bad schema)."""
    schema = Q.parse(obj, seed=seed)
    t = Q.template(schema, tok, canvas_length)
    ids = tok.encode_chat(Q.messages(schema, state), add_generation_prompt=True, enable_thinking=False)
    return schema, t, ids
