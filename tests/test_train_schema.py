"""The demo corpus's question-schema task: its prompt is the one the schema API builds, its reply the API's answer
template with the labels filled in, and the tokenizer holds every label as one token after a newline; every task
of the corpus is in a training bucket."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer

from diffgemma.chat import questions
from diffgemma.chat.tokenizer import ChatTokenizer
from diffgemma.train import batches, data
from diffgemma.train.tokenizer import LABEL_WORDS, with_words
from diffgemma.weights.download import bundled_model


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """The bundled tokenizer with the label words (as a fine-tune from it has them)."""
    d = tmp_path_factory.mktemp("tok")
    src = bundled_model()
    fixed = with_words(Tokenizer.from_file(str(src / "tokenizer.json")), LABEL_WORDS)
    fixed.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text((src / "tokenizer_config.json").read_text())
    return ChatTokenizer.from_dir(d), fixed


def test_with_words_makes_each_label_one_token_and_keeps_every_id():
    before = Tokenizer.from_file(str(bundled_model() / "tokenizer.json"))
    after = with_words(before, LABEL_WORDS)
    for word in LABEL_WORDS:
        assert len(after.encode("x:\n" + word, add_special_tokens=False).ids) == 4
    assert all(after.token_to_id(t) == i for t, i in before.get_vocab().items())
    assert with_words(after, LABEL_WORDS).to_str() == after.to_str()  # nothing left to add


def test_a_schema_example_is_what_the_api_prompts_and_answers(tok):
    tok, raw = tok  # the chat tokenizer, and the plain one the trainer encodes rendered prompts with
    rng = random.Random(5)
    kinds = set()
    for _ in range(40):
        ex = data.make_example("schema", rng)
        schema = questions.parse(ex.meta["schema"])
        kinds |= {q.type for q in schema.questions}
        msgs = questions.messages(schema, ex.meta["state"])
        prompt = tok.encode_chat(msgs, add_generation_prompt=True, enable_thinking=False)
        assert prompt == raw.encode(ex.prompt, add_special_tokens=False).ids
        tpl = questions.template(schema, tok, 32)
        filled = list(tpl.ids)
        for q, slot, labels in zip(schema.questions, tpl.slots, tpl.labels, strict=True):
            filled[slot] = labels[q.labels.index(ex.meta["labels"][q.id])]
        reply = raw.encode(ex.target, add_special_tokens=False).ids
        assert filled[: len(reply)] == reply
    assert kinds == set(questions.TYPES)


def test_every_corpus_task_is_in_a_training_bucket():
    bucketed = {t for tasks, _ in batches.BUCKETS for t in tasks}
    assert set(data.TASK_WEIGHTS) <= bucketed
