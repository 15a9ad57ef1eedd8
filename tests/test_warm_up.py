"""`Engine.warm_up`: the fast kernels compiled before the first request (by `serve`, and by `chat` while the first
message is typed), with every later request's shapes covered and no reply changed. The regions compile for the
CPU here, as in test_fast_kernels.py; on CUDA the same code also captures graphs (tests/gpu)."""

from __future__ import annotations

import torch

import diffgemma
from diffgemma.cli import talk as cli
from diffgemma.config import RuntimeConfig
from diffgemma.session.client import Session

# The regions a reply runs on the CPU's fast kernels: the prefill's set, and the denoise's (route and gelu_mul are
# the fallbacks of Triton kernels that the CPU runs as torch ops outside the regions; the final softcap is the
# sampler's, on the raw logits).
DENOISE_REGIONS = ("norm", "qkv_post", "pre_ffn", "dense_mlp", "post_ffn")


def _fused(path, compile: bool = True):
    runtime = RuntimeConfig(kernels="fast", compile=compile)
    return diffgemma.load(path, device="cpu", dtype="float32", runtime=runtime, max_denoising_steps=3)


def _chat() -> None:
    """`diffgemma chat --json` in-process, on whatever `load_engine` and `_read_line` are patched to give."""
    cli.chat(
        json_out=True,
        model=None,
        seed=1,
        ctx=2048,
        max_tokens=8,
        think=False,
        device=None,
        dtype=None,
        threads=None,
        log=None,
        tool_validate=False,
        tool_repair=False,
    )


def _variants(model) -> dict[str, int]:
    if not model.steps.fast:
        return {}
    regions = {f"prefill.{n}": r for n, r in model.steps.prefill_regions.items()}
    regions.update({f"denoise.{n}": r for n, r in model.steps.regions.items()})
    return {name: len(r._seen) for name, r in regions.items()}


@torch.no_grad()
def test_warm_up_compiles_what_a_reply_needs_and_changes_no_reply(tiny_a):
    warm, cold = _fused(tiny_a), _fused(tiny_a)
    assert warm.warm_up() > 0
    seen = _variants(warm.model)
    assert all(seen[f"prefill.{n}"] for n in ("norm", "qkv_post", "pre_ffn", "dense_mlp", "post_ffn")), seen
    assert all(seen[f"denoise.{n}"] for n in DENOISE_REGIONS), seen
    assert not len(warm.runner.graphs) and not warm.runner.graphs._io
    assert warm._oneshot is None  # its caches were its own, not the engine's

    # Requests of other lengths (a prompt, then a follow-up turn on the same cache) compile nothing more: a
    # recompile raises, which `Fused` would turn into `failed`.
    prompt = list(range(5, 42))
    s_warm, s_cold = Session(warm, ctx=512), Session(cold, ctx=512)
    with torch._dynamo.config.patch(error_on_recompile=True):
        a = s_warm.generate(prompt, max_new_tokens=20, seed=3)
        a2 = s_warm.generate(s_warm.log + list(range(60, 70)), max_new_tokens=12, seed=4)
    assert (
        a2.reused_tokens == len(prompt) + a.cached_tokens
    )  # a follow-up turn: only its own tokens prefilled
    assert _variants(warm.model) == seen
    assert not any(
        r.failed for r in [*warm.model.steps.prefill_regions.values(), *warm.model.steps.regions.values()]
    )
    b = s_cold.generate(prompt, max_new_tokens=20, seed=3)
    b2 = s_cold.generate(s_cold.log + list(range(60, 70)), max_new_tokens=12, seed=4)
    assert (a.token_ids, a2.token_ids) == (b.token_ids, b2.token_ids)


def test_warm_up_is_a_no_op_on_the_reference_kernels(tiny_a):
    eng = diffgemma.load(tiny_a, device="cpu", dtype="float32")
    assert not eng.runner.fast
    assert eng.warm_up() == 0.0
    assert not any(_variants(eng.model).values())


def test_chat_warms_up_while_the_first_message_is_typed(tiny_a, monkeypatch):
    eng = _fused(tiny_a)
    events: list[str] = []
    real_warm_up, real_generate = eng.warm_up, Session.generate

    def warm_up():
        events.append("warm-up")
        seconds = real_warm_up()
        events.append("warm")
        return seconds

    def generate(self, ids, **kwargs):
        events.append("reply")
        return real_generate(self, ids, **kwargs)

    lines = iter(["hello", "/quit"])
    monkeypatch.setattr(eng, "warm_up", warm_up)
    monkeypatch.setattr(Session, "generate", generate)
    monkeypatch.setattr(cli, "load_engine", lambda *a: eng)
    monkeypatch.setattr(cli.sys.stdin, "isatty", lambda: True)
    monkeypatch.setattr(cli, "_read_line", lambda tty: next(lines))
    _chat()
    assert events == ["warm-up", "warm", "reply"]

    # quit before any message: the warm-up is waited for, no reply
    events.clear()
    lines = iter(["/quit"])
    _chat()
    assert events == ["warm-up", "warm"]

    # piped input: the first message is there at once, nothing to overlap, no warm-up
    events.clear()
    lines = iter(["hello", "/quit"])
    monkeypatch.setattr(cli.sys.stdin, "isatty", lambda: False)
    _chat()
    assert events == ["reply"]


def test_chat_reports_a_failed_warm_up_and_replies_anyway(tiny_a, monkeypatch, capsys):
    eng = _fused(tiny_a)

    def broken():
        raise RuntimeError("no compiler")

    lines = iter(["hello", "/quit"])
    monkeypatch.setattr(eng, "warm_up", broken)
    monkeypatch.setattr(cli, "load_engine", lambda *a: eng)
    monkeypatch.setattr(cli.sys.stdin, "isatty", lambda: True)
    monkeypatch.setattr(cli, "_read_line", lambda tty: next(lines))
    _chat()
    out, err = capsys.readouterr()
    assert "warm-up failed (RuntimeError: no compiler); the first reply compiles instead" in err
    assert '"turn": 1' in out


def test_serve_warms_up_before_it_listens(tiny_a, monkeypatch):
    from diffgemma.server import run

    eng = _fused(tiny_a)
    events: list[str] = []

    class Listening:  # the uvicorn server serve builds (`graceful_server`), listening only in the events
        started = True

        def __init__(self, app, grace, host, port, **options):
            self.where = f"listen {host}:{port}"

        def run(self) -> None:
            events.append(self.where)

    monkeypatch.setattr(eng, "warm_up", lambda: events.append("warm-up") or 1.0)
    monkeypatch.setattr(run.EngineCore, "load", lambda *a, **k: eng)
    monkeypatch.setattr(run, "graceful_server", Listening)
    run.serve(tiny_a, port=8123, ctx=2048)
    assert events == ["warm-up", "listen 127.0.0.1:8123"]


def test_ask_runs_the_regions_eagerly(tiny_a, monkeypatch, capsys):
    # one short reply: torch.compile would cost more than it saves (docs/performance.md, "torch.compile and warm-up")
    asked = {}

    def load_engine(*args, compile=True):
        asked["compile"] = compile
        return _fused(tiny_a, compile=compile)

    monkeypatch.setattr(cli, "load_engine", load_engine)
    cli.ask(
        prompt="hello",
        json_out=True,
        model=None,
        seed=1,
        ctx=2048,
        max_tokens=8,
        raw=False,
        think=False,
        device=None,
        dtype=None,
        threads=None,
        log=None,
        tool_validate=False,
        tool_repair=False,
    )
    assert '"completion_tokens": 8' in capsys.readouterr().out
    assert asked == {"compile": False}  # the fast kernels (and on CUDA their graphs), without torch.compile
