"""The question-schema API (the upstream README's): a chat request of exactly two messages, a system message that
is a JSON object with `questions` and a user message that is the state as JSON, is answered by a few scored
forwards instead of generated text. The answer template is seeded into the canvas with each question's label slot
as a hole (noise by default); each question's distribution is the softmax of the label tokens' logits at its slot.
All questions share each forward. This module holds the schema, the prompt and template, and the reply."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from diffgemma.chat.tokenizer import ChatTokenizer

TYPES = ("noul", "choice", "score")
HOLES = ("noise", "pad", "label")
CLIMB_MODES = ("sweep", "steepest")
CLIMB_ROUNDS = 4  # `climb: true`
CANVAS_ROWS = 64  # `active` is a multiple of this


class SchemaError(ValueError):
    """An invalid question schema: the message names the question (a 400 on the server)."""


@dataclass(frozen=True)
class Question:
    id: str
    type: str
    instructions: str
    names: list[str]  # what the probabilities are keyed by: yes/no, the option names, the levels
    labels: list[str]  # the single-token labels: yes/no, A/B/..., 1/2/...
    descriptions: list[str | None]


@dataclass
class Schema:
    questions: list[Question]
    instructions: str | None = None
    samples: str | int = "auto"
    auto_max: int = 4
    auto_threshold: float = 0.1  # nats
    fix_definite: bool = False
    steps: int = 1
    active: int | None = None
    hole: str = "noise"
    climb: int = 0  # rounds of the diagnostic hill climb (0: off)
    climb_mode: str = "sweep"
    seed: int = 0


def recognize(messages: list[dict[str, Any]]) -> tuple[dict[str, Any], Any] | None:
    """(schema object, state) when the request is a question schema: exactly a system message whose content is a JSON
    object with `questions`, then a user message whose content is JSON; None for anything else (ordinary chat)."""
    if len(messages) != 2 or [m.get("role") for m in messages] != ["system", "user"]:
        return None
    system, user = (m.get("content") for m in messages)
    if not isinstance(system, str) or not isinstance(user, str):
        return None
    try:
        schema = json.loads(system)
        state = json.loads(user)
    except json.JSONDecodeError:
        return None
    if not isinstance(schema, dict) or "questions" not in schema:
        return None
    return schema, state


def parse(obj: dict[str, Any], seed: int = 0) -> Schema:
    """The schema, validated; SchemaError naming the question or field otherwise."""
    qs = obj.get("questions")
    if not isinstance(qs, list) or not qs:
        raise SchemaError("questions must be a non-empty list")
    questions, seen = [], set()
    for i, q in enumerate(qs):
        if not isinstance(q, dict):
            raise SchemaError(f"question {i} is not an object")
        qid = q.get("id")
        if not isinstance(qid, str) or not qid.strip() or "\n" in qid:
            raise SchemaError(f"question {i} needs an id (a one-line string)")
        if qid in seen:
            raise SchemaError(f"question {qid!r}: duplicate id")
        seen.add(qid)
        kind = q.get("type")
        if kind not in TYPES:
            raise SchemaError(f"question {qid!r}: unknown type {kind!r} (one of {', '.join(TYPES)})")
        text = q.get("instructions", "")
        if not isinstance(text, str):
            raise SchemaError(f"question {qid!r}: instructions must be a string")
        if kind == "noul":
            names, labels, descs = ["yes", "no"], ["yes", "no"], [None, None]
        elif kind == "choice":
            opts = q.get("options")
            if not isinstance(opts, list) or len(opts) < 2:
                raise SchemaError(f"question {qid!r}: a choice needs at least two options")
            if len(opts) > 26:
                raise SchemaError(f"question {qid!r}: at most 26 options (labels A to Z)")
            names, descs = [], []
            for o in opts:
                if not isinstance(o, dict) or not isinstance(o.get("name"), str) or not o["name"]:
                    raise SchemaError(f"question {qid!r}: each option needs a name")
                names.append(o["name"])
                descs.append(o.get("description") if isinstance(o.get("description"), str) else None)
            if len(set(names)) != len(names):
                raise SchemaError(f"question {qid!r}: duplicate option names")
            labels = [chr(ord("A") + j) for j in range(len(names))]
        else:
            levels = q.get("levels")
            if (
                not isinstance(levels, list)
                or len(levels) < 2
                or not all(isinstance(x, str) and x for x in levels)
            ):
                raise SchemaError(f"question {qid!r}: a score needs at least two levels (strings)")
            if len(levels) > 9:
                raise SchemaError(f"question {qid!r}: at most 9 levels (labels 1 to 9)")
            if len(set(levels)) != len(levels):
                raise SchemaError(f"question {qid!r}: duplicate levels")
            names, labels, descs = (
                list(levels),
                [str(j + 1) for j in range(len(levels))],
                [None] * len(levels),
            )
        questions.append(Question(qid, kind, text, names, labels, descs))
    schema = Schema(questions, seed=seed)
    if "instructions" in obj:
        if not isinstance(obj["instructions"], str):
            raise SchemaError("instructions must be a string")
        schema.instructions = obj["instructions"]
    samples = obj.get("samples", "auto")
    if samples != "auto" and not (
        isinstance(samples, int) and not isinstance(samples, bool) and 1 <= samples <= 64
    ):
        raise SchemaError('samples must be "auto" or a count from 1 to 64')
    schema.samples = samples
    for name, kind, low, high in (("auto_max", int, 1, 64), ("steps", int, 1, 16)):
        v = obj.get(name, getattr(schema, name))
        if not isinstance(v, kind) or isinstance(v, bool) or not low <= v <= high:
            raise SchemaError(f"{name} must be an integer from {low} to {high}")
        setattr(schema, name, v)
    t = obj.get("auto_threshold", schema.auto_threshold)
    if not isinstance(t, int | float) or isinstance(t, bool) or t < 0:
        raise SchemaError("auto_threshold must be a number >= 0 (nats)")
    schema.auto_threshold = float(t)
    fd = obj.get("fix_definite", False)
    if not isinstance(fd, bool):
        raise SchemaError("fix_definite must be true or false")
    schema.fix_definite = fd
    hole = obj.get("hole", "noise")
    if hole not in HOLES:
        raise SchemaError(f"hole must be one of {', '.join(HOLES)}")
    schema.hole = hole
    active = obj.get("active")
    if active is not None and (
        not isinstance(active, int) or isinstance(active, bool) or active <= 0 or active % CANVAS_ROWS
    ):
        raise SchemaError(f"active must be a positive multiple of {CANVAS_ROWS}")
    schema.active = active
    climb = obj.get("climb", False)
    if isinstance(climb, bool):
        schema.climb = CLIMB_ROUNDS if climb else 0
    elif isinstance(climb, int) and 0 <= climb <= 16:
        schema.climb = climb
    else:
        raise SchemaError("climb must be true, false or a count of rounds from 0 to 16")
    mode = obj.get("climb_mode", "sweep")
    if mode not in CLIMB_MODES:
        raise SchemaError(f"climb_mode must be one of {', '.join(CLIMB_MODES)}")
    schema.climb_mode = mode
    return schema


def system_text(schema: Schema) -> str:
    """The system message the model reads: the instructions, each question with its labels, the answer form."""
    parts = [schema.instructions.strip()] if schema.instructions else []
    parts.append("Answer the questions about the state the user sends.")
    for q in schema.questions:
        line = f"Question {q.id}: {q.instructions}".rstrip()
        if q.type == "noul":
            line += " Answer yes or no."
        else:
            # One option a line: each letter or number starts its line, the token the answer's slot holds
            line += (
                " Answer with the letter of one option:"
                if q.type == "choice"
                else " Answer with the number of one level:"
            )
            for label, name, desc in zip(q.labels, q.names, q.descriptions, strict=True):
                line += f"\n{label}) {name}" + (f" ({desc})" if desc else "")
        parts.append(line)
    parts.append(
        "Answer in this form, one label a question:\n"
        + "".join(f"{q.id}:\n<label>\n" for q in schema.questions)
    )
    return "\n".join(parts)


def messages(schema: Schema, state: Any) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": system_text(schema)},
        {"role": "user", "content": json.dumps(state, ensure_ascii=False)},
    ]


@dataclass
class Template:
    """The answer canvas: ids with a hole at each question's slot, and each question's label token ids."""

    ids: list[int]
    slots: list[int]
    labels: list[list[int]]


def template(schema: Schema, tok: ChatTokenizer, canvas_length: int) -> Template:
    """`{id}:\\n<label>\\n` a question, then the end of the turn and pad rows to `active` (default: the smallest
    multiple of 64 that holds it, the model's canvas at most). SchemaError when a label is not one token there."""
    ids: list[int] = []
    slots, labels = [], []
    for q in schema.questions:
        head = tok.encode_text(f"{q.id}:\n")
        qlabels = []
        for label in q.labels:
            with_label = tok.encode_text(f"{q.id}:\n{label}")
            if with_label[: len(head)] != head or len(with_label) != len(head) + 1:
                raise SchemaError(f"question {q.id!r}: label {label!r} is not one token for this model")
            qlabels.append(with_label[-1])
        if len(set(qlabels)) != len(qlabels):
            raise SchemaError(f"question {q.id!r}: two labels share a token")
        ids += head
        slots.append(len(ids))
        ids.append(qlabels[0])  # a placeholder: the hole policy fills the slot
        ids += tok.encode_text("\n")
        labels.append(qlabels)
    end = tok.token_to_id("<turn|>")
    if end is not None:
        ids.append(end)
    rows = schema.active or max(CANVAS_ROWS, -(-len(ids) // CANVAS_ROWS) * CANVAS_ROWS)
    rows = min(rows, canvas_length) if schema.active is None else rows
    if rows > canvas_length:
        raise SchemaError(f"active {rows} is more than the model's canvas of {canvas_length} rows")
    if len(ids) > rows:
        raise SchemaError(f"the answer template is {len(ids)} tokens, more than the canvas's {rows} rows")
    pad = tok.pad_id if tok.pad_id is not None else 0
    return Template(ids + [pad] * (rows - len(ids)), slots, labels)


@dataclass
class ReadResult:
    """One read: each question's probabilities over its labels, and the slot's diagnostics."""

    probs: list[list[float]]
    entropy: list[float]  # of the full distribution at the slot (nats)
    label_mass: list[float]
    argmax_is_label: list[bool]


def argmax(p: list[float]) -> int:
    return max(range(len(p)), key=p.__getitem__)


def label_entropy(p: list[float]) -> float:
    return -sum(x * math.log(x) for x in p if x > 0)


@dataclass
class Answers:
    reads: list[ReadResult] = field(default_factory=list)

    def reply(self, schema: Schema, diagnostics: dict[str, Any]) -> dict[str, Any]:
        """The reply's JSON object: answers by id, and diagnostics."""
        n = len(self.reads)
        answers, per_q, tops = {}, {}, [[] for _ in range(n)]
        for qi, q in enumerate(schema.questions):
            reads = [r.probs[qi] for r in self.reads]
            mean = [sum(r[j] for r in reads) / n for j in range(len(q.labels))]
            top = argmax(mean)
            picked = [argmax(r) for r in reads]
            for ri, j in enumerate(picked):
                tops[ri].append(q.labels[j])
            std = math.sqrt(sum((r[top] - mean[top]) ** 2 for r in reads) / (n - 1)) if n > 1 else 0.0
            a: dict[str, Any] = {"type": q.type}
            if q.type == "noul":
                a["noul"] = mean[0]
            elif q.type == "choice":
                a["choice"] = q.names[top]
            else:
                a["score"] = sum((j + 1) * p for j, p in enumerate(mean))
                a["level"] = q.names[top]
            a.update(
                label=q.labels[top],
                confidence=mean[top],
                stderr=std / math.sqrt(n) if n > 1 else 0.0,
                agreement=sum(j == top for j in picked) / n,
                probabilities=dict(zip(q.names, mean, strict=True)),
            )
            answers[q.id] = a
            per_q[q.id] = {
                "argmax_is_label": all(r.argmax_is_label[qi] for r in self.reads),
                "entropy": sum(r.entropy[qi] for r in self.reads) / n,
                "label_mass": sum(r.label_mass[qi] for r in self.reads) / n,
            }
        return {
            "answers": answers,
            "diagnostics": {**diagnostics, "samples": {"n": n, "tops": tops}, "questions": per_q},
        }
