"""The two-hop lookup attention loss (`--lookup-weight`): where it points for retrieval and for a schema's choice
questions, that it is the layers' own attention, and that training on it moves that attention."""

from __future__ import annotations

import contextlib
import random

import torch
from tokenizers import Tokenizer

from diffgemma.kernels import torch_ref
from diffgemma.train import batches, data, forward, trainer
from diffgemma.train import checkpoint as ckpt
from diffgemma.train.tokenizer import WORDS, with_words
from diffgemma.train.trainer import TrainConfig
from diffgemma.weights.download import bundled_model


def _tok() -> Tokenizer:
    """The bundled tokenizer with the demo tasks' words, as a fine-tune from the bundled model has it."""
    return with_words(Tokenizer.from_file(str(bundled_model() / "tokenizer.json")), WORDS)


def _batch(
    tok: Tokenizer, n: int, seed: int, schema: float = 0.0
) -> tuple[list[data.Example], batches.Batch]:
    exs = data.generate(n, seed=seed, tasks={"retrieval_short": 1.0, "arith": 0.5, "schema": schema})
    return exs, batches.collate(
        batches.make_batch(tok, exs, random.Random(seed), 32, 0.25, lookups=True), 320
    )


def test_lookup_points_from_the_answer_slot_to_the_asked_lines_code_word():
    tok = _tok()
    exs, b = _batch(tok, 60, seed=2)
    pointed = 0
    for i, ex in enumerate(exs):
        slot, key, head, state = b.lookup[i].tolist()
        if ex.task != "retrieval" or slot < 0:  # other tasks; or a split moved the code word into the context
            assert (slot, key, head, state) == batches.NO_LOOKUP
            continue
        assert head == batches.LOOKUP_HEADS["retrieval"] and state == -1
        value = tok.token_to_id("Ġ" + ex.meta["value"])
        assert b.target[i, slot] == value and b.prompt[i, key] == value and b.mask[i, key]
        assert tok.id_to_token(int(b.prompt[i, key - 2])) == "Ġ" + ex.meta["key"]  # "- KEY: WORD"
        pointed += 1
    assert pointed >= 20 and (b.lookup[[e.task != "retrieval" for e in exs]] == -1).all()
    # every list line's code word is marked, with its key two tokens back, and nothing else
    for i, ex in enumerate(exs):
        marked = b.lines[i].nonzero()[:, 0].tolist()
        assert len(marked) == (ex.meta["n"] if ex.task == "retrieval" else 0)
        for j in marked:
            assert tok.id_to_token(int(b.prompt[i, j]))[1:] in data.CODE_WORDS
            assert tok.id_to_token(int(b.prompt[i, j - 1])) == ":"
            assert tok.id_to_token(int(b.prompt[i, j - 2]))[1:] in data.ANIMALS + data.OBJECTS


def test_a_choice_question_looks_up_its_correct_options_name_which_reads_its_letter():
    tok = _tok()
    exs, b = _batch(tok, 80, seed=3, schema=4.0)
    pointed = 0
    for i, ex in enumerate(exs):
        if ex.task != "schema":
            continue
        choices = [q for q in ex.meta["schema"]["questions"] if q["type"] == "choice"]
        # every option name of every choice question is marked, its letter two tokens back: the label token itself
        marked = b.lines[i].nonzero()[:, 0].tolist()
        assert len(marked) == sum(len(q["options"]) for q in choices)
        for j in marked:
            assert tok.id_to_token(int(b.prompt[i, j - 1])) == ")"
            assert tok.id_to_token(int(b.prompt[i, j - 2])) in ("A", "B", "C", "D")
        slot, key, head, state = b.lookup[i].tolist()
        if slot < 0 or key < 0:  # no choice question, or a split moved its label into the context
            continue
        # the first choice question whose label is on the canvas: its label, its right option's name, and the
        # state's value that the label depends on
        label = tok.id_to_token(int(b.target[i, slot]))
        q = next(q for q in choices if ex.meta["labels"][q["id"]] == label)
        name = q["options"]["ABCD".index(label)]["name"]
        assert head == batches.LOOKUP_HEADS["schema"]
        assert tok.id_to_token(int(b.prompt[i, key])) == "Ġ" + name
        assert int(b.prompt[i, key - 2]) == int(b.target[i, slot])
        value = ex.meta["state"][batches.STATE_FIELDS[q["id"]]]
        assert tok.id_to_token(int(b.prompt[i, state])) == value and b.mask[i, state]
        pointed += 1
    assert pointed >= 12


def test_a_schema_label_reads_the_state_value_it_depends_on():
    tok = _tok()
    exs, b = _batch(tok, 120, seed=5, schema=4.0)
    seen = {"choice": 0, "noul": 0}
    for i, ex in enumerate(exs):
        slot, key, head, state = b.lookup[i].tolist()
        if (
            ex.task != "schema" or slot < 0
        ):  # other tasks (retrieval's is tested above); a label in the context
            continue
        ids = [q["id"] for q in ex.meta["schema"]["questions"]]
        choices = [q["id"] for q in ex.meta["schema"]["questions"] if q["type"] == "choice"]
        # the label's slot sits after its question's "id:\n" line (in the context when a split put it there)
        ids_before = b.prompt[i][b.mask[i]].tolist() + b.target[i, : slot + 1].tolist()
        line = tok.decode(ids_before, skip_special_tokens=False).split("\n")
        asked = line[-2].removeprefix("<channel|>").rstrip(":")
        assert asked in batches.STATE_FIELDS and ex.meta["labels"][asked] == line[-1]
        if key < 0:  # no choice question: the first question that depends on a state field
            assert not choices and asked == next(q for q in ids if q in batches.STATE_FIELDS)
        field = batches.STATE_FIELDS[asked]
        value = str(ex.meta["state"][field])
        word = value if isinstance(ex.meta["state"][field], str) else value[-1]
        assert tok.id_to_token(int(b.prompt[i, state])) == word
        # the state's token is in the user's JSON: its field name is a few tokens back
        before = tok.decode(b.prompt[i, state - 6 : state + 1].tolist())
        quote = '"' if isinstance(ex.meta["state"][field], str) else ""
        assert before.endswith(f'"{field}": {quote}{value}'), before
        seen["choice" if key >= 0 else "noul"] += 1
    assert seen["choice"] >= 10 and seen["noul"] >= 5, seen


def test_lookup_nll_is_minus_log_of_the_layers_own_attention(monkeypatch):
    tok = _tok()
    cfg = TrainConfig(out="", preset="tiny")
    model = ckpt.build_model(trainer.model_config(cfg, tok.get_vocab_size()), 0, "cpu")
    _, b = _batch(tok, 16, seed=4, schema=1.0)
    assert set(b.lookup[:, 2].tolist()) == {-1, *batches.LOOKUP_HEADS.values()}
    probs = []

    def recording(q, k, v, mask):
        k_full = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
        probs.append(torch.softmax((q @ k_full.transpose(-1, -2)).masked_fill(~mask, float("-inf")), -1))
        return torch.nn.functional.scaled_dot_product_attention(
            q, k_full, v.repeat_interleave(q.shape[1] // v.shape[1], 1), attn_mask=mask, scale=1.0
        )

    monkeypatch.setattr(torch_ref, "attention", recording)
    with torch.no_grad():
        logits, nll = forward.train_forward(model, b.prompt, b.mask, b.target, lookup=b.lookup, lines=b.lines)
    # hop 2: the last full layer's head of the row's task, from the answer's slot to the token it reads
    p_full = probs[forward.lookup_layer(model)]  # [B, H, T, T]
    has = (b.lookup[:, 0] >= 0) & (b.lookup[:, 1] >= 0)
    rows = torch.arange(len(b.lookup))[has]
    hop2 = -torch.log(p_full[rows, b.lookup[has, 2], 320 + b.lookup[has, 0], b.lookup[has, 1]]).mean()
    # the state read: the first full layer, from a schema label's slot to the state's value
    p_state = probs[forward.state_layer(model)]
    st = (b.lookup[:, 0] >= 0) & (b.lookup[:, 3] >= 0)
    srows = torch.arange(len(b.lookup))[st]
    hop_state = -torch.log(p_state[srows, b.lookup[st, 2], 320 + b.lookup[st, 0], b.lookup[st, 3]]).mean()
    # hop 1: layer 0's head 1, from every list code word or option name to its key or letter two tokens back
    bi, ji = b.lines.nonzero(as_tuple=True)
    hop1 = -torch.log(probs[0][bi, 1, ji, ji - 2]).mean()
    assert logits.shape == b.target.shape + (model.cfg.vocab_size,)
    assert has.sum() >= 4 and st.sum() >= 2 and len(bi) >= 40
    assert torch.allclose(nll, hop1 + hop2 + hop_state, rtol=1e-4, atol=1e-5)


def test_training_on_the_lookup_loss_moves_the_attention():
    torch.manual_seed(0)  # the canvas noise
    tok = _tok()
    cfg = TrainConfig(out="", preset="tiny", batch=8, lookup_weight=1.0, sc_prob=0.0)
    cfg.mix = ",".join(f"{t}=0" for t in data.TASK_WEIGHTS if t != "retrieval_short")
    model = ckpt.build_model(trainer.model_config(cfg, tok.get_vocab_size()), 0, "cpu")
    opt = torch.optim.AdamW(trainer.param_groups(model, 0.0), lr=3e-3)
    micro = batches.batches_for_step(cfg, tok, 0)  # one batch, seen again and again
    nll = []
    for _ in range(30):
        stats = trainer.step_body(model, opt, micro, False, False, 1.0, cfg, contextlib.nullcontext)
        nll.append(stats[3].item())
    first, last = sum(nll[:5]) / 5, sum(nll[-5:]) / 5
    assert first > 5.0 and last < 0.5 * first, nll  # at init the head's attention on the code word is ~e^-10
