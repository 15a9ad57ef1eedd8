"""The op log: a stage that journals every op and event as JSONL, and `replay`, which re-executes a log on a model
and diffs every event (a field session as an executable repro).

A log is one or more sessions, each a `{"header": ...}` line (what replay needs: the model's identity, the engine's
sampler config, device, dtype, context and conversations, the platform) followed by `{"op": ...}` and `{"event": ...}`
lines in the order the pipeline ran and answered them. Timings are not logged: every logged field must replay
identically, except that a KV fingerprint is compared only on the platform that recorded it (`platform_of`): elsewhere
the tokens are still compared and the line says how many fingerprints were not. The file holds prompts' token ids, so
it is readable by its owner only (as the request log).

A process killed mid-op (`kill -9`, a crash) leaves its session cut off: a partial last line, and ops without their
last event (a Generate's `Replied` or `Failed`, any other op's one event). Replay checks such an op's logged events as
far as they go, ends that session there, says so, and goes on to the sessions after the restart."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from diffgemma.engine.batch import Request
from diffgemma.engine.engine import EngineCore
from diffgemma.engine.generate import CancelToken, StepInfo
from diffgemma.session import ops as O
from diffgemma.session import pipeline as pipeline_module
from diffgemma.session.journal import JournalFile
from diffgemma.session.pipeline import Pipeline, sampler_fields
from diffgemma.session.stage import Around, Emit, OnStep, Stage
from diffgemma.version import __version__


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


def platform_of(engine: EngineCore) -> str:
    """What a KV cache's bytes depend on beyond the ops: torch's build and the processor its kernels were chosen
    for (the same fp32 prefill on an AVX-512 and an AVX2 kernel path rounds differently; the tokens agreed)."""
    if engine.model.device.type == "cuda":
        where = torch.cuda.get_device_name(engine.model.device)
    else:
        where = f"{platform.machine()} {torch.backends.cpu.get_cpu_capability()} {_cpu_model()}"
    return f"torch {torch.__version__}, {where}"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown cpu"


def header(pipeline: Stage) -> dict[str, Any]:
    engine = pipeline.engine
    return {
        "diffgemma": __version__,
        "platform": platform_of(engine),
        "model": str(engine.path) if engine.path is not None else None,
        "model_id": model_identity(engine.path),
        "device": str(engine.model.device),
        "dtype": str(engine.model.dtype).removeprefix("torch."),
        "fast_kernels": bool(engine.runner.fast),
        # replay runs the kernels of the log: the batch-invariant mode's solo bits are not the default mode's
        **({"batch_invariant": True} if engine.runner.config.batch_invariant else {}),
        "ctx": pipeline.registry.ctx,
        "max_conversations": pipeline.registry.max_conversations,
        "sampler": sampler_fields(engine.sampler),
    }


def _ends_mid_line(path: Path) -> bool:
    """Whether the journal at `path` ends inside a line (its writer died mid-record)."""
    try:
        with path.open("rb") as f:
            if f.seek(0, os.SEEK_END) == 0:
                return False
            f.seek(-1, os.SEEK_END)
            return f.read(1) != b"\n"
    except OSError:
        return False


class OpLog(Around):
    """A stage around `inner`: each op with its sequence number, and each event with its op's number, one JSON object
    a line in the order they happened, flushed as written. Ops of a batching worker interleave: a Generate's events
    come as its blocks commit, between other requests' ops."""

    def __init__(self, inner: Stage, path: str | Path, label: str | None = None) -> None:
        super().__init__(inner)
        self.path = Path(path)
        cut = _ends_mid_line(self.path)
        # whole lines, each one write; one that fails (a full disk) is dropped with a warning, never the request's
        self._file = JournalFile(self.path, "op log")
        self._lock = threading.Lock()
        self._seq = 0
        if cut:  # the last session was cut off mid-line (a crash): the header must not extend that line
            self._file.write("")
        self._write({"header": {**header(inner), **({"label": label} if label else {})}})

    def _write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, separators=(",", ":")))

    def _op(self, op: O.Op, emit: Emit) -> Emit:
        """Log op with the next sequence number; the emit that logs its events under that number."""
        with self._lock:
            self._seq += 1
            seq = self._seq
        self._write({"op": op.to_json(), "seq": seq})

        def logged(event: O.Event) -> None:
            self._write({"event": event.to_json(), "of": seq})
            emit(event)

        return logged

    def run(
        self, op: O.Op, emit: Emit, on_step: OnStep | None = None, cancel: CancelToken | None = None
    ) -> None:
        self.inner.run(op, self._op(op, emit), on_step=on_step, cancel=cancel)

    def begin_generate(
        self, op: O.Generate, emit: Emit, on_step: OnStep | None = None, cancel: CancelToken | None = None
    ) -> Request | None:
        """The inner stage's `begin_generate`, logged: its events are logged as they come, up to `end_generate`."""
        return self.inner.begin_generate(op, self._op(op, emit), on_step=on_step, cancel=cancel)

    def cancel(self) -> None:
        self._op(O.Cancel(), lambda event: None)
        self.inner.cancel()

    def close(self) -> None:
        self._file.close()
        self.inner.close()


@dataclass
class Step:
    line: int
    op: O.Op
    events: list[dict[str, Any]] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)  # each event's line


@dataclass
class LoggedSession:
    line: int
    header: dict[str, Any]
    steps: list[Step] = field(default_factory=list)
    last: int = 0  # the line of its last record
    partial: int | None = None  # its partial last line (a crash cut it), if any


# A line that is not JSON, with the header of the session that followed a crash appended to it.
_HEADER = '{"header":'


def _records(line: str) -> tuple[bool, list[Any]]:
    """The records of one line: (whether it starts with a cut-off record, the whole records). JSONDecodeError when it
    is not a line of the log, nor a cut-off record followed by a session's header."""
    try:
        return False, [json.loads(line)]
    except json.JSONDecodeError:
        at = line.rfind(_HEADER)  # json.dumps escapes quotes in strings: only a record starts with it
        if at <= 0:
            raise
        tail = json.loads(line[at:])
    try:
        return False, [json.loads(line[:at]), tail]  # cut just before its newline: whole
    except json.JSONDecodeError:
        return True, [tail]


def read_log(path: str | Path) -> list[LoggedSession]:
    """The sessions of a log file; ValueError naming the line for anything that is not one. A line that is not JSON
    is a session's partial last line (a crash) when a session's header or the end of the file follows it."""
    sessions: list[LoggedSession] = []
    by_seq: dict[int, Step] = {}
    pending: tuple[int, str] | None = None  # a line that is not JSON, until what follows says it was cut off

    def not_json(n: int, why: str) -> ValueError:
        return ValueError(f"{path}:{n}: not JSON ({why})")

    def add(n: int, record: Any) -> None:
        nonlocal by_seq
        kind = next((k for k in ("header", "op", "event") if isinstance(record, dict) and k in record), None)
        if kind is None:
            raise ValueError(f"{path}:{n}: expected one of header, op, event")
        if kind == "header":
            sessions.append(LoggedSession(n, record["header"], last=n))
            by_seq = {}
            return
        if not sessions:
            raise ValueError(f"{path}:{n}: {kind} before any header")
        sessions[-1].last = n
        if kind == "op":
            try:
                step = Step(n, O.from_json(record["op"], O.OPS))
            except ValueError as e:
                raise ValueError(f"{path}:{n}: {e}") from None
            sessions[-1].steps.append(step)
            by_seq[record.get("seq", len(sessions[-1].steps))] = step
            return
        step = by_seq.get(record.get("of")) if "of" in record else (sessions[-1].steps or [None])[-1]
        if step is None:
            raise ValueError(f"{path}:{n}: event of no op before it")
        step.events.append(record["event"])
        step.lines.append(n)

    def cut_at(n: int, why: str) -> None:
        if not sessions:
            raise not_json(n, why)
        sessions[-1].partial = sessions[-1].last = n

    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                cut, records = _records(line)
            except json.JSONDecodeError as e:
                if pending is not None:
                    raise not_json(*pending) from None
                pending = (n, str(e))
                continue
            if pending is not None:  # cut off only if a session starts after it
                if cut or not (isinstance(records[0], dict) and "header" in records[0]):
                    raise not_json(*pending)
                cut_at(*pending)
                pending = None
            if cut:
                cut_at(n, "a cut-off record")
            for record in records:
                add(n, record)
    if pending is not None:
        cut_at(*pending)
    if not sessions:
        raise ValueError(f"{path}: no session in it (an empty log)")
    return sessions


def finished(step: Step) -> bool:
    """Whether an op's last event was logged: a Generate's `Replied` or `Failed`, any other op's one event (a Cancel
    has none)."""
    if isinstance(step.op, O.Cancel):
        return True
    if isinstance(step.op, O.Generate):
        return any(ev.get("type") in ("Replied", "Failed") for ev in step.events)
    return bool(step.events)


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


def check_identity(session: LoggedSession, engine: EngineCore, path: str | Path) -> None:
    """ValueError (one line) when the log was recorded on other weights than `engine`'s."""
    want, have = session.header.get("model_id"), model_identity(engine.path)
    if want != have:
        raise ValueError(
            f"{path} was recorded on model {session.header.get('model')} (id {str(want)[:12]}), not on "
            f"{engine.path} (id {have[:12]}): replay it with -m pointing at that model"
        )


def replay(
    path: str | Path, engine: EngineCore, on_op: Callable[[Step], None] | None = None
) -> tuple[bool, str]:
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
    sessions: list[LoggedSession], engine: EngineCore, on_op: Callable[[Step], None] | None
) -> tuple[bool, str]:
    ops = events = unchecked = 0
    here = platform_of(engine)
    elsewhere = ""
    cuts: list[str] = []
    for k, session in enumerate(sessions, 1):
        hdr = session.header
        foreign = hdr.get("platform", here) != here  # a log from before the platform was recorded: this one's
        if foreign:
            elsewhere = hdr["platform"]
        pipeline = Pipeline(engine, hdr.get("ctx"), hdr.get("max_conversations", 4))
        if hdr.get("sampler") is not None:  # the engine's defaults as they were when the log was written
            engine.sampler = pipeline.sampler(hdr["sampler"])
        # A Generate runs at its op's line and ends (its conversation free again, its Replied emitted) at its last
        # event's line, as under the batching worker; everything else runs and answers at its op's line.
        # An op cut off by a crash never ended: its logged events are checked as far as they go, a Generate's
        # conversation stays busy to the session's end as it did, and any other op (the worker's last) is not run.
        unfinished = [step for step in session.steps if not finished(step)]
        cut = {id(step) for step in unfinished}
        timeline: list[tuple[int, int, Step]] = []
        for step in session.steps:
            if not isinstance(step.op, O.Generate) and id(step) in cut:
                continue
            timeline.append((step.line, 0, step))
            if isinstance(step.op, O.Generate) and step.lines and id(step) not in cut:
                timeline.append((step.lines[-1], 1, step))
        flight: dict[int, tuple[Request, list[dict[str, Any]]]] = {}
        for _, phase, step in sorted(timeline, key=lambda t: (t[0], t[1])):
            if isinstance(step.op, O.Cancel):  # where it struck is in the events of the op it stopped
                continue
            if phase == 1:
                if id(step) not in flight:
                    continue  # refused at its begin: compared there
                request, got = flight.pop(id(step))
                pipeline.end_generate(request)
            else:
                ops += 1
                if on_op is not None:
                    on_op(step)
                got = []
                struck = _struck(step.events)
                token = AfterSteps(struck) if struck is not None else None
                emit = lambda ev, got=got: got.append(ev.to_json())  # noqa: E731
                kw = dict(on_step=token.step if token is not None else None, cancel=token)
                if isinstance(step.op, O.Generate):
                    request = pipeline.begin_generate(step.op, emit, **kw)
                    if request is not None:
                        _run_alone(pipeline, request)
                        if id(step) not in cut:
                            flight[id(step)] = (request, got)
                            continue
                else:
                    pipeline.run(step.op, emit, **kw)
            if id(step) in cut:  # what a crash left of it: more replayed than logged is no difference
                got = got[: len(step.events)]
            same, line, skipped = _compare(step, got, hdr, foreign)
            if not same:
                return False, line
            events += len(got) - skipped
            unchecked += skipped
        if unfinished or session.partial is not None:
            cuts.append(_cut(k, session, unfinished))
    line = f"identical: {len(sessions)} session(s), {ops} ops, {events} events"
    if unchecked:
        line += f"; {unchecked} KV fingerprints not compared (recorded on {elsewhere}, this is {here})"
    return True, "".join([line, *(f"; {c}" for c in cuts)])


def _cut(k: int, session: LoggedSession, unfinished: list[Step]) -> str:
    """What a crash left of session k: where it ends, its partial line, its ops checked only as far as logged."""
    what = [f"a partial line {session.partial}"] if session.partial is not None else []
    what += [
        f"{type(s.op).__name__} at line {s.line} unfinished, checked as far as logged" for s in unfinished
    ]
    where = f"session {k} (line {session.line}{_label(session.header)})"
    return f"{where} cut off at line {session.last} (a crash: {', '.join(what)})"


def _run_alone(pipeline: Pipeline, request: Request) -> None:
    """A begun Generate run to its end on its own (its tokens are those of any batch it ran in)."""
    pipeline_module.drive(request.turn, request.on_step, request.cancel, request.on_commit)


def _compare(
    step: Step, got: list[dict[str, Any]], hdr: dict[str, Any], foreign: bool
) -> tuple[bool, str, int]:
    """(identical, the first difference, fingerprints left uncompared because the log is `foreign`)."""
    name = type(step.op).__name__
    skipped = 0
    for i, (a, b) in enumerate(zip(step.events, got, strict=False)):
        if foreign and a.get("type") == b.get("type") == "Fingerprint":
            skipped += 1
            continue
        if a != b:
            return (
                False,
                f"line {step.lines[i]}{_label(hdr)}: event {i + 1} of op {name} differs: {_diff(a, b)}",
                skipped,
            )
    if len(step.events) != len(got):
        n = len(step.events)
        return (
            False,
            f"line {step.line}{_label(hdr)}: op {name} logged {n} events, replayed {len(got)}",
            skipped,
        )
    return True, "", skipped
