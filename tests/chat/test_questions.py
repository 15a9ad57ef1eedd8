"""The question schema: recognition, validation (each refusal names its question), the answer template and its
single-token labels, and the reply's arithmetic over reads."""

from __future__ import annotations

import json

import pytest

from diffgemma.chat import questions as Q
from diffgemma.chat.tokenizer import ChatTokenizer

TICKET = {"ticket": "The dashboard is blank after login."}
CHOICE = {
    "id": "bucket",
    "type": "choice",
    "instructions": "Which team owns it?",
    "options": [{"name": "billing"}, {"name": "support"}, {"name": "engineering", "description": "a defect"}],
}
SCORE = {
    "id": "tone",
    "type": "score",
    "instructions": "How angry?",
    "levels": ["calm", "annoyed", "furious"],
}


def _msgs(schema, state=TICKET):
    return [{"role": "system", "content": json.dumps(schema)}, {"role": "user", "content": json.dumps(state)}]


def test_only_two_messages_of_a_schema_and_a_json_state_are_recognized():
    schema = {"questions": [CHOICE]}
    assert Q.recognize(_msgs(schema)) == (schema, TICKET)
    assert Q.recognize(_msgs(schema) + [{"role": "user", "content": "{}"}]) is None
    assert Q.recognize([{"role": "system", "content": "You are helpful."}, _msgs(schema)[1]]) is None
    assert Q.recognize([_msgs(schema)[0], {"role": "user", "content": "not json"}]) is None
    assert Q.recognize(_msgs({"rules": []})) is None  # a JSON system message without questions is chat


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"questions": []}, "non-empty list"),
        ({"questions": [{"id": "x", "type": "maybe"}]}, "question 'x': unknown type 'maybe'"),
        (
            {"questions": [{"id": "x", "type": "choice", "options": [{"name": "a"}]}]},
            "question 'x': a choice",
        ),
        ({"questions": [{"id": "x", "type": "score"}]}, "question 'x': a score needs at least two levels"),
        ({"questions": [SCORE, SCORE]}, "question 'tone': duplicate id"),
        ({"questions": [{"type": "noul"}]}, "question 0 needs an id"),
        ({"questions": [SCORE], "samples": 0}, "samples must be"),
        ({"questions": [SCORE], "active": 100}, "active must be a positive multiple of 64"),
        ({"questions": [SCORE], "hole": "zero"}, "hole must be one of"),
        ({"questions": [SCORE], "climb": "yes"}, "climb must be true, false or a count"),
        ({"questions": [SCORE], "climb": 17}, "climb must be true, false or a count"),
        (
            {"questions": [SCORE], "climb": True, "climb_mode": "up"},
            "climb_mode must be one of sweep, steepest",
        ),
    ],
)
def test_invalid_schemas_are_refused_naming_the_question(schema, message):
    with pytest.raises(Q.SchemaError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Q.parse(schema)


def test_the_template_holds_one_single_token_slot_a_question(tiny_a):
    tok = ChatTokenizer.from_dir(tiny_a)
    schema = Q.parse({"questions": [CHOICE, SCORE]})
    t = Q.template(schema, tok, canvas_length=256)
    assert len(t.ids) == 64 and len(t.slots) == 2 and [len(x) for x in t.labels] == [3, 3]
    for slot, labels, q in zip(t.slots, t.labels, schema.questions, strict=True):
        assert tok.decode(labels) == "".join(q.labels)  # A, B, C and 1, 2, 3: one token each
        assert tok.decode(t.ids[:slot]).endswith(f"{q.id}:\n")
    assert Q.template(schema, tok, canvas_length=32).ids.__len__() == 32  # a smaller canvas holds it
    many = Q.parse({"questions": [dict(SCORE, id=f"q{i}") for i in range(30)]})
    with pytest.raises(Q.SchemaError, match="more than the canvas"):
        Q.template(many, tok, canvas_length=64)
    text = Q.system_text(schema)
    assert "\nA) billing\nB) support\nC) engineering (a defect)\n" in text
    assert "\n1) calm\n2) annoyed\n3) furious\n" in text
    # each option's line starts with the very token its question's slot is scored on
    ids = tok.encode_text(text)
    assert all(label in ids for labels in t.labels for label in labels)


def test_the_reply_averages_reads_and_reports_their_spread():
    schema = Q.parse({"questions": [{"id": "u", "type": "noul"}, SCORE]})
    reads = Q.Answers(
        [
            Q.ReadResult([[0.9, 0.1], [0.2, 0.8, 0.0]], [0.3, 0.5], [0.9, 0.99], [True, True]),
            Q.ReadResult([[0.1, 0.9], [0.2, 0.6, 0.2]], [0.3, 0.7], [0.7, 0.97], [True, False]),
        ]
    )
    out = reads.reply(schema, {"steps": 1})
    u, tone = out["answers"]["u"], out["answers"]["tone"]
    assert u["noul"] == pytest.approx(0.5) and u["agreement"] == 0.5  # two confident reads that disagree
    assert u["stderr"] == pytest.approx(0.4)  # std 0.566 over two reads, / sqrt(2)
    assert tone["level"] == "annoyed" and tone["label"] == "2" and tone["score"] == pytest.approx(1.9)
    assert tone["probabilities"] == pytest.approx({"calm": 0.2, "annoyed": 0.7, "furious": 0.1})
    assert out["diagnostics"]["samples"] == {"n": 2, "tops": [["yes", "2"], ["no", "2"]]}
    assert out["diagnostics"]["questions"]["tone"]["argmax_is_label"] is False
