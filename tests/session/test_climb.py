"""The question schema's diagnostic hill climb, driven op by op against a scripted reader: each question's
distribution depends on the label the other question's slot is pinned to, so every move is known in advance."""

from __future__ import annotations

import pytest

from diffgemma.chat import questions as Q
from diffgemma.session import ops as O
from diffgemma.session import scoring

# question -> the other question's pinned label (None: a hole) -> its distribution over (yes, no)
TABLE = {
    0: {None: [0.6, 0.4], "yes": [0.4, 0.6], "no": [0.7, 0.3]},
    1: {None: [0.6, 0.4], "yes": [0.1, 0.9], "no": [0.2, 0.8]},
}
LABELS = [[10, 11], [20, 21]]  # yes, no of each question
NAMES = {10: "yes", 11: "no", 20: "yes", 21: "no"}


def _run(obj: dict, table: dict) -> tuple[dict, list[O.Read]]:
    schema = Q.parse({"questions": [{"id": "a", "type": "noul"}, {"id": "b", "type": "noul"}], **obj})
    t = Q.Template(ids=[5, 0, 6, 0], slots=[1, 3], labels=LABELS)
    reads: list[O.Read] = []
    gen = scoring.score(schema, t, [1, 2, 3], vocab=64, pad=0)
    op = next(gen)
    try:
        while True:
            if isinstance(op, O.AlignTo):
                op = gen.send([O.Aligned(kv=None, reused=0)])
            elif isinstance(op, O.Read):
                reads.append(op)
                probs = []
                for qi in (0, 1):
                    other = op.canvas[t.slots[1 - qi]]
                    probs.append(table[qi][NAMES.get(other)])
                op = gen.send([O.ReadOut(probs, [0.5, 0.5], [1.0, 1.0], [True, True])])
            else:
                op = gen.send([])
    except StopIteration as stop:
        return stop.value, reads


@pytest.mark.parametrize(
    ("mode", "rounds"),
    [
        ("sweep", 3),
        ("steepest", 2),
    ],  # sweep: (no,yes) (no,no) | (yes,no) | stays; steepest: moves b only | stays
)
def test_the_climb_moves_to_a_fixed_point_of_the_conditional_reads(mode, rounds):
    reply, reads = _run({"samples": 1, "hole": "pad", "climb": True, "climb_mode": mode}, TABLE)
    climb = reply["diagnostics"]["climb"]
    assert climb == {
        "mode": mode,
        "rounds": rounds,
        "reads": 2 * rounds,
        "labels": {"a": "yes", "b": "no"},
        "moved": ["b"],
        "converged": True,
        "ratified": False,
    }
    assert len(reads) == 1 + 2 * rounds
    # each climb read holes one slot and pins the other to a label
    for r in reads[1:]:
        assert sorted(r.canvas[s] in (10, 11, 20, 21) for s in (1, 3)) == [False, True]
    # the answers are the reads', not the climb's
    assert reply["answers"]["b"]["label"] == "yes"


def test_a_first_read_that_every_conditional_keeps_is_ratified_in_one_round():
    stable = {qi: {k: [0.9, 0.1] for k in (None, "yes", "no")} for qi in (0, 1)}
    reply, reads = _run({"samples": 1, "climb": 3}, stable)
    climb = reply["diagnostics"]["climb"]
    assert (climb["rounds"], climb["reads"], climb["ratified"], climb["converged"]) == (1, 2, True, True)
    assert climb["moved"] == [] and len(reads) == 3


def test_a_climb_that_cycles_stops_at_its_round_limit_unconverged():
    cycle = {0: {None: [0.6, 0.4], "yes": [0.1, 0.9], "no": [0.9, 0.1]},
             1: {None: [0.6, 0.4], "yes": [0.9, 0.1], "no": [0.1, 0.9]}}  # fmt: skip
    reply, reads = _run({"samples": 1, "climb": 2}, cycle)
    climb = reply["diagnostics"]["climb"]
    assert (climb["rounds"], climb["reads"], climb["converged"]) == (2, 4, False)
    assert len(reads) == 5


def test_no_climb_unless_asked():
    reply, reads = _run({"samples": 2}, TABLE)
    assert "climb" not in reply["diagnostics"] and len(reads) == 2
