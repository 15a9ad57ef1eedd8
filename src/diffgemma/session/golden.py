"""The golden gate: paths through the production session on the bundled demo model (CPU, fp32), recorded as one op
log (`diffgemma golden --bless`) and replayed by `diffgemma golden` and the tests. Any byte of a token id or a KV
fingerprint that changes fails it, naming the path, the op and the event: the refactor gate of the token pipeline.

Each path is a script of ops against a fresh pipeline; what a later op needs from an earlier event (a reply's
tokens, a mark) is read from the events as the script records them, so the log holds the concrete ops."""

from __future__ import annotations

from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

from diffgemma.engine.engine import EngineCore
from diffgemma.session import ops as O
from diffgemma.session.oplog import AfterSteps, OpLog
from diffgemma.session.pipeline import Pipeline, call

FIXTURE = Path(str(resources.files("diffgemma"))) / "assets" / "golden_demo.jsonl"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def _chat(engine: EngineCore, text: str, **kw: Any) -> list[int]:
    return engine.prompt_ids([{"role": "user", "content": text}], **kw)


def _fingerprint(p: Any) -> None:
    call(p, O.KvFingerprint())


def short_prompt(p: Any, engine: EngineCore) -> None:
    ids = _chat(engine, "What is 17 + 25?")
    call(p, O.Route(ids))
    call(p, O.Generate(ids, seed=1))
    _fingerprint(p)


def long_prompt(p: Any, engine: EngineCore) -> None:
    lines = "\n".join(f"The code word for item {i} is word{i * 7 % 97}." for i in range(40))
    ids = _chat(engine, f"{lines}\nWhat is the code word for item 3?")
    call(p, O.Route(ids))
    call(p, O.Generate(ids, seed=2))
    _fingerprint(p)


def several_blocks(p: Any, engine: EngineCore) -> None:
    ids = _chat(engine, "Count from 37 to 55.")  # the demo's multi-block task
    call(p, O.Route(ids))
    call(p, O.Generate(ids, seed=3, max_new_tokens=200))
    _fingerprint(p)


def ring_wrap(p: Any, engine: EngineCore) -> None:
    # past the sliding layers' ring (window + rewind slack): positions wrap around their slots
    call(p, O.Activate(0))
    ring = p.active.kv.ring_size + engine.config.canvas_length
    call(p, O.SyntheticFill(ring + 100, seed=4))
    _fingerprint(p)
    mark = call(p, O.Mark())[0].kv
    call(p, O.Generate(_chat(engine, "What is 2 + 3?")[1:], seed=4))
    call(p, O.Rewind(mark))
    _fingerprint(p)  # the first fingerprint again
    call(p, O.Generate(_chat(engine, "What is 2 + 3?")[1:], seed=4))
    _fingerprint(p)


def rewind_regenerate(p: Any, engine: EngineCore) -> None:
    ids = _chat(engine, "What is 9 + 9?")
    call(p, O.Activate(0))
    call(p, O.Extend(ids))
    _fingerprint(p)
    mark = call(p, O.Mark())[0].kv
    call(p, O.Generate([], seed=5))
    call(p, O.Rewind(mark))
    _fingerprint(p)  # the bytes before the reply, exactly
    call(p, O.Generate([], seed=5))  # and the same reply again
    _fingerprint(p)


def tool_turn(p: Any, engine: EngineCore) -> None:
    question = [{"role": "user", "content": "What is the weather in Oslo?"}]
    ids = engine.prompt_ids(question, tools=[WEATHER])
    call(p, O.Route(ids))
    reply = call(p, O.Generate(ids, seed=6))[-1]
    out = engine.parse(engine_output(reply))
    calls = [
        {"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in out.tool_calls
    ]
    calls = calls or [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    ]
    turn = [*question, {"role": "assistant", "content": "", "tool_calls": calls}]
    call(p, O.Finalize(engine.tokenizer.encode_chat(turn, tools=[WEATHER], add_generation_prompt=False)))
    history = [*turn, {"role": "tool", "content": "Snow, -3 C"}]
    ids = engine.prompt_ids(history, tools=[WEATHER])
    call(p, O.Route(ids))
    (aligned,) = call(p, O.AlignTo(ids))
    call(p, O.Generate(ids[aligned.reused :], seed=6))
    _fingerprint(p)


def cancel_resume(p: Any, engine: EngineCore) -> None:
    ids = _chat(engine, "Count from 1 to 30, separated by commas.")
    call(p, O.Route(ids))
    token = AfterSteps(5)
    call(p, O.Generate(ids, seed=7, max_new_tokens=120), on_step=token.step, cancel=token)
    _fingerprint(p)
    call(p, O.Generate([], seed=7, max_new_tokens=120))
    _fingerprint(p)


def reroll(p: Any, engine: EngineCore) -> None:
    ids = _chat(engine, "Is 7 larger than 3? Answer yes or no.")
    call(p, O.Activate(0))
    call(p, O.Extend(ids))
    _fingerprint(p)
    mark = call(p, O.Mark())[0].kv
    call(p, O.BeginTurn(seed=8))
    call(p, O.ProposeBlock())
    call(p, O.DiscardBlock())  # the empty-reply re-roll, by hand
    prop = call(p, O.ProposeBlock())[0]
    call(p, O.CommitBlock(prop.stop_at if prop.stop_at is not None else len(prop.tokens)))
    call(p, O.EndTurn())
    call(p, O.Rewind(mark))
    _fingerprint(p)  # the first fingerprint again


def splice(p: Any, engine: EngineCore) -> None:
    ids = _chat(engine, "What is 4 + 4?")
    call(p, O.Activate(0))
    call(p, O.Extend(ids))
    call(p, O.Splice(5, 7, _chat(engine, "What is 5 + 5?")[5:7]))
    call(p, O.Generate([], seed=9))
    _fingerprint(p)


PATHS: dict[str, Callable[[Any, EngineCore], None]] = {
    f.__name__: f
    for f in (
        short_prompt, long_prompt, several_blocks, ring_wrap, rewind_regenerate, tool_turn, cancel_resume,
        reroll, splice,
    )
}  # fmt: skip


def engine_output(reply: O.Replied):
    from diffgemma.engine.generate import GenerateOutput

    return GenerateOutput(token_ids=list(reply.token_ids), finish_reason=reply.finish_reason)


def bless(engine: EngineCore, path: Path = FIXTURE) -> Path:
    """Record every path into the fixture, replacing it."""
    path.unlink(missing_ok=True)
    for name, script in PATHS.items():
        log = OpLog(Pipeline(engine), path, label=name)
        try:
            script(log, engine)
        finally:
            log.close()
    return path


def check(engine: EngineCore, path: Path = FIXTURE) -> tuple[bool, str]:
    """Replay the fixture on `engine`: (identical, one line)."""
    from diffgemma.session.oplog import replay

    if not path.is_file():
        raise FileNotFoundError(f"no golden fixture at {path}: record it with diffgemma golden --bless")
    return replay(path, engine)
