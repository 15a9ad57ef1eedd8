"""The walk of a prompt from `diffgemma ask` through its blocks (issue #58, "Must show"): traced in-process with
`sys.setprofile` on the bundled demo model, it enters the engine, the runner and the model once per block.

"Enters" is precise here: a call enters a package when no frame of that package is on the stack (the packages of
`src/diffgemma`, as tests/test_layers.py names them). A callback up (the engine calling the session's `on_step`,
its cancel check, its commit event; the session calling the CLI's display) runs with every layer below it still on
the stack, so nothing it calls there is an entry. A block is its prefill (the prompt for the first block, the
previous block's committed tokens for the others), its denoise steps and its commit: from `Turn.prefill_pending`
to the return of the `Turn.commit` that keeps its tokens. Once per block then means:

- engine: the session enters the engine for the reply's blocks once, through `drive`; every block lies inside that
  one entry, and the session's other entries are around it, none of them running a forward: `prompt_ids` (the
  template), `EngineCore.turn` (opens the turn, prefills nothing) and `parse` (the reply's text), besides the
  `CancelToken`s the pipeline builds for each op (a value it hands the engine to check, not the engine's work);
- runner: the engine enters the runner once per forward group of the block and for nothing else: one
  `ModelRunner.prefill`, then one `ModelRunner.denoise` per denoise step;
- model: entered only from the runner, inside one of those forwards; a denoise step enters it once
  (`DiffusionGemma.denoise`), a prefill once per aligned chunk (`DiffusionGemma.prefill`) beside the runner's
  bookkeeping on the cache (its ids check, the cache's token log).

No forward of the runner or the model runs outside a block."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from typer.testing import CliRunner

from diffgemma import cli
from tests.test_layers import LAYER

SRC = Path(__file__).resolve().parents[1] / "src" / "diffgemma"
BELOW_ENGINE = {unit for unit, layer in LAYER.items() if layer < LAYER["engine"]}
FORWARDS = {"ModelRunner.prefill", "ModelRunner.denoise", "DiffusionGemma.prefill", "DiffusionGemma.denoise"}


@dataclass
class Entry:
    """A call into a package with none of its frames on the stack."""

    caller: str  # the package of the innermost diffgemma frame below it ("" for none)
    callee: str
    name: str  # the callee's qualified name
    under: Entry | None  # the runner entry it happened inside, if any


class Walk:
    """The entries of one traced call, with the block markers (`Turn.prefill_pending` calls, `Turn.commit`
    returns) in order among them."""

    def __init__(self) -> None:
        self.events: list[Entry | str] = []
        self._pkg: dict[str, str] = {}
        self._stack: list[
            tuple[FrameType, str, Entry | None]
        ] = []  # diffgemma frames: (frame, package, entry)
        self._depth: dict[str, int] = {}
        self._runner: Entry | None = None

    def package(self, filename: str) -> str:
        pkg = self._pkg.get(filename)
        if pkg is None:
            try:
                rel = Path(filename).resolve().relative_to(SRC)
                pkg = rel.parts[0] if len(rel.parts) > 1 else rel.stem
            except (ValueError, OSError):
                pkg = ""
            self._pkg[filename] = pkg
        return pkg

    def profile(self, frame: FrameType, event: str, _arg: Any) -> None:
        if event == "call":
            pkg = self.package(frame.f_code.co_filename)
            if not pkg:
                return
            name = frame.f_code.co_qualname
            if name == "Turn.prefill_pending":
                self.events.append("block")
            entry = None
            if not self._depth.get(pkg):
                caller = self._stack[-1][1] if self._stack else ""
                entry = Entry(caller, pkg, name, self._runner)
                self.events.append(entry)
                if pkg == "runner":
                    self._runner = entry
            self._depth[pkg] = self._depth.get(pkg, 0) + 1
            self._stack.append((frame, pkg, entry))
        elif event == "return" and self._stack and self._stack[-1][0] is frame:
            _, pkg, entry = self._stack.pop()
            self._depth[pkg] -= 1
            if entry is not None and entry is self._runner:
                self._runner = None
            if frame.f_code.co_qualname == "Turn.commit":
                self.events.append("committed")


def _ask(args: list[str]) -> tuple[Walk, str]:
    walk = Walk()
    sys.setprofile(walk.profile)
    try:
        result = CliRunner().invoke(cli.app, ["ask", *args])
    finally:
        sys.setprofile(None)
    assert result.exit_code == 0, result.output
    return walk, result.output


def _blocks(events: list[Entry | str]) -> tuple[list[list[Entry]], list[Entry]]:
    """The entries of each block (a re-rolled proposal's belong to its block), and those outside every block."""
    blocks: list[list[Entry]] = []
    outside: list[Entry] = []
    current: list[Entry] | None = None
    for ev in events:
        if ev == "block":
            current = current if current is not None else []
        elif ev == "committed":
            if current is not None:
                blocks.append(current)
            current = None
        elif current is not None:
            current.append(ev)
        else:
            outside.append(ev)
    assert current is None, "a block that never committed"
    return blocks, outside


def test_ask_enters_engine_runner_and_model_once_per_block(monkeypatch):
    # several blocks, few steps: no stop token ends the reply before its budget
    for name, value in {"MAX_DENOISING_STEPS": "3", "STOP_TOKEN_IDS": "", "PAD_BLOCK_STOP": "0"}.items():
        monkeypatch.setenv(f"DIFFGEMMA_{name}", value)
    walk, output = _ask(["-p", "What is 17 + 25?", "--max-tokens", "300", "--json", "--device", "cpu"])
    out = json.loads(output.strip().splitlines()[-1])
    start = next(
        i for i, e in enumerate(walk.events) if isinstance(e, Entry) and e.name == "Session.generate"
    )
    events = walk.events[start:]
    blocks, outside = _blocks(events)
    assert len(blocks) == out["blocks"] >= 2

    # engine: one entry runs every block; the others are around it and run no forward
    into_engine = [
        (i, e)
        for i, e in enumerate(events)
        if isinstance(e, Entry) and e.callee == "engine" and e.name != "CancelToken.__init__"
    ]
    assert {e.caller for _, e in into_engine} == {"session"}, into_engine
    assert [e.name for _, e in into_engine] == [
        "EngineCore.prompt_ids",
        "EngineCore.turn",
        "drive",
        "EngineCore.parse",
    ], into_engine
    drive_at, parse_at = into_engine[2][0], into_engine[3][0]
    markers = [i for i, e in enumerate(events) if isinstance(e, str)]
    assert drive_at < markers[0] and markers[-1] < parse_at  # every block inside the one `drive`

    steps = 0
    for k, block in enumerate(blocks):
        # runner: the block's prefill, then a denoise per step, each from the engine, and nothing else
        runner = [e for e in block if e.callee == "runner"]
        names = [e.name for e in runner]
        assert {e.caller for e in runner} == {"engine"}, (k, runner)
        assert names[0] == "ModelRunner.prefill" and set(names[1:]) == {"ModelRunner.denoise"}, (k, names)
        steps += len(names) - 1
        # model: only from the runner, inside one of its forwards; one entry a denoise step
        model = [e for e in block if e.callee == "model"]
        assert {e.caller for e in model} == {"runner"} and all(e.under is not None for e in model), (k, model)
        for e in runner:
            if e.name == "ModelRunner.denoise":
                assert [m.name for m in model if m.under is e] == ["DiffusionGemma.denoise"], k
            else:
                chunks = [m.name for m in model if m.under is e and m.name in FORWARDS]
                assert chunks and set(chunks) == {"DiffusionGemma.prefill"}, (k, chunks)
        # nothing but the layers below the engine is entered during a block: the session's callbacks run above
        # what is on the stack
        assert {e.callee for e in block} <= BELOW_ENGINE, (k, block)
    assert steps == out["steps"]
    assert not [e for e in outside if e.name in FORWARDS]  # no forward outside a block
