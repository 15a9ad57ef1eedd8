"""The op log: a stage that journals every op and event as JSONL, and `replay`, which re-executes a log on a model
and diffs every event (a field session as an executable repro).

A log is one or more sessions, each a `{"header": ...}` line (what replay needs: the model's identity, the engine's
sampler config, device, dtype, context and conversations) followed by `{"op": ...}` and `{"event": ...}` lines in the
order the pipeline ran and answered them. Timings are not logged: every logged field must replay identically. The
file holds prompts' token ids, so it is readable by its owner only (as the request log)."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import diffgemma
from diffgemma.engine.engine import Engine
from diffgemma.engine.generate import CancelToken, StepInfo
from diffgemma.session import ops as O
from diffgemma.session.pipeline import Emit, Pipeline, sampler_fields

FILE_MODE = 0o600


def model_identity(path: Path | None) -> str:
    """SHA-256 of a checkpoint's config.json and its safetensors headers (names, dtypes, shapes, offsets): which
    weights a log ran on, read without reading them."""
    if path is None:
        return "unknown"
    h = hashlib.sha256()
    for f in sorted(Path(path).glob("*.json")) + sorted(Path(path).glob("*.safetensors")):
        if f.name.startswith("."):
            continue
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            if f.suffix == ".safetensors":
                n = int.from_bytes(fh.read(8), "little")
                h.update(fh.read(n))
            elif f.name in ("config.json", "generation_config.json"):
                h.update(fh.read())
    return h.hexdigest()


def header(pipeline: Pipeline) -> dict[str, Any]:
    engine = pipeline.engine
    return {
        "diffgemma": diffgemma.__version__,
        "model": str(engine.path) if engine.path is not None else None,
        "model_id": model_identity(engine.path),
        "device": str(engine.model.device),
        "dtype": str(engine.model.dtype).removeprefix("torch."),
        "fast_kernels": bool(engine.runner.fast),
        "ctx": pipeline.registry.ctx,
        "max_conversations": pipeline.registry.max_conversations,
        "sampler": sampler_fields(engine.sampler),
    }


class OpLog:
    """A stage around `inner`: each op, then each of its events, one JSON object a line, flushed as written."""

    def __init__(self, inner: Pipeline, path: str | Path, label: str | None = None) -> None:
        self.inner = inner
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, FILE_MODE)
        if stat.S_IMODE(os.fstat(fd).st_mode) != FILE_MODE:
            os.fchmod(fd, FILE_MODE)
        self._file = os.fdopen(fd, "a", encoding="utf-8")
        self._lock = threading.Lock()
        self._write({"header": {**header(inner), **({"label": label} if label else {})}})

    def _write(self, record: dict[str, Any]) -> None:
        with self._lock:
            self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
            self._file.flush()

    def run(self, op: O.Op, emit: Emit, **kwargs: Any) -> None:
        self._write({"op": op.to_json()})

        def logged(event: O.Event) -> None:
            self._write({"event": event.to_json()})
            emit(event)

        self.inner.run(op, logged, **kwargs)

    def cancel(self) -> None:
        self._write({"op": O.Cancel().to_json()})
        self.inner.cancel()

    def close(self) -> None:
        with self._lock:
            self._file.close()

    def __getattr__(self, name: str) -> Any:  # the pipeline's state (active, last_output, registry, ...)
        return getattr(self.inner, name)


@dataclass
class Step:
    line: int
    op: O.Op
    events: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Session:
    line: int
    header: dict[str, Any]
    steps: list[Step] = field(default_factory=list)


def read_log(path: str | Path) -> list[Session]:
    """The sessions of a log file; ValueError naming the line for anything that is not one."""
    sessions: list[Session] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e})") from None
            if not isinstance(record, dict) or len(record) != 1:
                raise ValueError(f"{path}:{n}: expected one of header, op, event")
            ((kind, body),) = record.items()
            if kind == "header":
                sessions.append(Session(n, body))
            elif not sessions:
                raise ValueError(f"{path}:{n}: {kind} before any header")
            elif kind == "op":
                try:
                    sessions[-1].steps.append(Step(n, O.from_json(body, O.OPS)))
                except ValueError as e:
                    raise ValueError(f"{path}:{n}: {e}") from None
            elif kind == "event":
                if not sessions[-1].steps:
                    raise ValueError(f"{path}:{n}: event before any op")
                sessions[-1].steps[-1].events.append(body)
            else:
                raise ValueError(f"{path}:{n}: unknown record {kind!r}")
    if not sessions:
        raise ValueError(f"{path}: no session in it (an empty log)")
    return sessions


class AfterSteps(CancelToken):
    """Fires after n denoise steps: a logged cancel, replayed where it struck."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n, self.seen = n, 0

    def step(self, info: StepInfo) -> None:
        self.seen += 1

    @property
    def cancelled(self) -> bool:
        return self.seen >= self.n


def _struck(events: list[dict[str, Any]]) -> int | None:
    for ev in events:
        if ev.get("type") in ("Replied", "Cancelled") and ev.get("cancel_after") is not None:
            return int(ev["cancel_after"])
    return None


def _diff(logged: dict[str, Any], got: dict[str, Any]) -> str:
    if logged.get("type") != got.get("type"):
        return f"logged {logged.get('type')}, replayed {got.get('type')}"
    keys = [k for k in logged.keys() | got.keys() if logged.get(k) != got.get(k)]
    parts = []
    for k in sorted(keys):
        a, b = logged.get(k), got.get(k)
        if isinstance(a, list) and isinstance(b, list):
            i = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            parts.append(f"{k} first differs at [{i}] (logged {a[i : i + 3]}..., replayed {b[i : i + 3]}...)")
        else:
            parts.append(f"{k}: logged {a!r}, replayed {b!r}")
    return "; ".join(parts)


def _label(hdr: dict[str, Any]) -> str:
    return f" ({hdr['label']})" if hdr.get("label") else ""


def check_identity(session: Session, engine: Engine, path: str | Path) -> None:
    """ValueError (one line) when the log was recorded on other weights than `engine`'s."""
    want, have = session.header.get("model_id"), model_identity(engine.path)
    if want != have:
        raise ValueError(
            f"{path} was recorded on model {session.header.get('model')} (id {str(want)[:12]}), not on "
            f"{engine.path} (id {have[:12]}): replay it with -m pointing at that model"
        )


def replay(path: str | Path, engine: Engine, on_op: Callable[[Step], None] | None = None) -> tuple[bool, str]:
    """Re-execute every session of the log at `path` on `engine` and compare each event: (identical, one line)."""
    sessions = read_log(path)
    for session in sessions:
        check_identity(session, engine, path)
    default = engine.sampler
    try:
        return _replay(sessions, engine, on_op)
    finally:
        engine.sampler = default


def _replay(
    sessions: list[Session], engine: Engine, on_op: Callable[[Step], None] | None
) -> tuple[bool, str]:
    ops = events = 0
    for session in sessions:
        hdr = session.header
        pipeline = Pipeline(engine, hdr.get("ctx"), hdr.get("max_conversations", 4))
        if hdr.get("sampler") is not None:  # the engine's defaults as they were when the log was written
            engine.sampler = pipeline.sampler(hdr["sampler"])
        for step in session.steps:
            if isinstance(step.op, O.Cancel):  # where it struck is in the events of the op it stopped
                continue
            got: list[dict[str, Any]] = []
            struck = _struck(step.events)
            token = AfterSteps(struck) if struck is not None else None
            pipeline.run(
                step.op,
                lambda ev, got=got: got.append(ev.to_json()),
                on_step=token.step if token is not None else None,
                cancel=token,
            )
            ops += 1
            if on_op is not None:
                on_op(step)
            for i, (a, b) in enumerate(zip(step.events, got, strict=False)):
                if a != b:
                    where = f"line {step.line + 1 + i}{_label(hdr)}"
                    return (
                        False,
                        f"{where}: event {i + 1} of op {type(step.op).__name__} differs: {_diff(a, b)}",
                    )
            if len(step.events) != len(got):
                where = f"line {step.line}{_label(hdr)}"
                n = len(step.events)
                return False, f"{where}: op {type(step.op).__name__} logged {n} events, replayed {len(got)}"
            events += len(got)
    return True, f"identical: {len(sessions)} session(s), {ops} ops, {events} events"
