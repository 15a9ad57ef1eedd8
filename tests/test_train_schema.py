"""The demo corpus's question-schema task: its prompt is the one the schema API builds, its reply the API's answer
template with the labels filled in, and the tokenizer holds every label as one token after a newline and every
state's word as one token in a JSON string; a fine-tune grows an older checkpoint's vocabulary for them; every task
of the corpus is in a training bucket."""

from __future__ import annotations

import random

import pytest
import torch
from tokenizers import Tokenizer

from diffgemma.chat import questions
from diffgemma.chat.tokenizer import ChatTokenizer
from diffgemma.train import batches, data
from diffgemma.train import tokenizer as demo_tokenizer_module
from diffgemma.train.tokenizer import LABEL_WORDS, WORDS, with_words
from diffgemma.train.trainer import TrainConfig, train
from diffgemma.weights.download import bundled_model
from diffgemma.weights.loader import load_model


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """The bundled tokenizer with the demo tasks' words (as a fine-tune from it has them)."""
    d = tmp_path_factory.mktemp("tok")
    src = bundled_model()
    fixed = with_words(Tokenizer.from_file(str(src / "tokenizer.json")), WORDS)
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


def test_with_words_makes_each_state_word_one_token_in_a_json_string():
    before = Tokenizer.from_file(str(bundled_model() / "tokenizer.json"))
    after = with_words(before, WORDS)
    assert all(after.token_to_id(t) == i for t, i in before.get_vocab().items())
    for word in data.SCHEMA_WORDS:
        if word.startswith(" "):  # an option's name
            assert after.encode(f"A){word},", add_special_tokens=False).tokens == [
                "A",
                ")",
                "Ġ" + word[1:],
                ",",
            ]
        else:  # a state's value
            assert after.encode(f'{{"city": "{word}"}}', add_special_tokens=False).tokens[4] == word
    assert with_words(after, WORDS).to_str() == after.to_str()


def test_a_fine_tune_grows_the_vocabulary_with_each_new_word_at_its_spaced_twin(tmp_path, monkeypatch):
    # the bundled model has every word already (its last fine-tunes added them): the source here is a tiny
    # model whose tokenizer was built before the schema's words, as the bundled one's was
    bundled = Tokenizer.from_file(str(bundled_model() / "tokenizer.json"))
    assert with_words(bundled, WORDS).to_str() == bundled.to_str()
    src = tmp_path / "src"
    with monkeypatch.context() as m:
        m.setattr(demo_tokenizer_module, "WORDS", LABEL_WORDS)
        train(TrainConfig(out=str(src), steps=1, preset="tiny", vocab_size=1024, device="cpu", batch=4))
    before = Tokenizer.from_file(str(src / "tokenizer.json"))
    train(TrainConfig(out=str(tmp_path / "run"), steps=1, init=str(src), device="cpu", batch=4, lr=1e-12))
    after = Tokenizer.from_file(str(tmp_path / "run" / "tokenizer.json"))
    old, new = load_model(src, "cpu", torch.float32), load_model(tmp_path / "run", "cpu", torch.float32)
    assert after.to_str() == with_words(before, WORDS).to_str()
    assert new.cfg.vocab_size % 64 == 0 and new.cfg.vocab_size >= after.get_vocab_size() > old.cfg.vocab_size
    # one step at lr 1e-12: the old tokens' rows as they were, each new word's row its spaced twin's
    ids = sorted(before.get_vocab().values())
    assert torch.equal(new.embed[ids], old.embed[ids])
    new_ids = {t: i for t, i in after.get_vocab().items() if before.token_to_id(t) is None}
    twins = {t: before.token_to_id("Ġ" + t) for t in new_ids}
    for text, i in new_ids.items():  # the schema's words and the pieces on their way
        parts = (
            [twins[text]]
            if twins[text] is not None
            else before.encode(after.decode([i]), add_special_tokens=False).ids
        )
        assert torch.allclose(new.embed[i], old.embed[parts].mean(0), atol=1e-2), text  # bf16 on disk
    assert {"Madrid", "banana", "kettle"} <= set(new_ids) and None in twins.values()
    # the rows no token uses at the trained rows' scale (the trainer's noise draws them; a zero row's norm blew
    # a fine-tune's gradient up to 1e8)
    unused = new.embed[max(after.get_vocab().values()) + 1 :]
    assert len(unused) > 0 and unused.norm(dim=1).min() > 0.5 * old.embed.norm(dim=1).mean()


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
