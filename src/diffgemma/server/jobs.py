"""What runs on the engine worker for one request: generate, parse, validate, stream, finalize the turn.

The job turns committed blocks into `Delta` events for the request's `Channel` and ends with `Done` or
`JobFailed`. Chat replies are parsed by the chat StreamParser (thought channel -> reasoning, tool-call grammar
-> tool calls); stop strings cut the content and cancel the generation between denoise steps.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

from diffgemma.chat import questions as Q
from diffgemma.chat.parser import (
    BadCall,
    Content,
    Event,
    Reasoning,
    StreamParser,
    ToolCall,
    _IncrementalText,
    coalesce,
)
from diffgemma.chat.tokenizer import ChatTokenizer
from diffgemma.config import SamplerConfig
from diffgemma.engine.engine import ContextOverflow
from diffgemma.engine.generate import CancelToken, GenerateOutput, StepInfo, TokenLogprob
from diffgemma.server.errors import APIError, invalid
from diffgemma.server.events import CanvasFrames, Delta, Done, JobFailed
from diffgemma.server.metrics import Metrics
from diffgemma.server.schema import COMPLETION_MAX_TOKENS, ChatRequest, CompletionRequest
from diffgemma.server.toolturns import ToolRound, ToolRounds
from diffgemma.server.worker import Channel, Run, Steps
from diffgemma.session import ops as O
from diffgemma.session import scoring
from diffgemma.session.pipeline import sampler_fields

log = logging.getLogger("diffgemma.server")

VALIDATION_ATTEMPTS = 3  # json_object / required tool call / a tool call that parses: tries, each a new seed


class LinkedCancel(CancelToken):
    """Cancelled by its own `cancel()` (a stop string matched) or by the client's token."""

    def __init__(self, parent: CancelToken) -> None:
        super().__init__()
        self.parent = parent

    @property
    def cancelled(self) -> bool:
        return self._event.is_set() or self.parent.cancelled


class StopFilter:
    """Cuts streamed text at the first stop string, holding back a tail that may start one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.held = ""
        self.hit = False

    def push(self, text: str) -> str:
        if self.hit:
            return ""
        if not self.stops:
            return text
        s = self.held + text
        cut = min((i for i in (s.find(stop) for stop in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.hit, self.held = True, ""
            return s[:cut]
        keep = max((k for stop in self.stops for k in range(1, len(stop)) if s.endswith(stop[:k])), default=0)
        self.held = s[len(s) - keep :] if keep else ""
        return s[: len(s) - keep]

    def flush(self) -> str:
        out, self.held = ("" if self.hit else self.held), ""
        return out


# The reply grammar's control tokens (`chat.parser`): they frame the reasoning and the tool calls, which chat logprobs
# cover as documented, so they are listed although no text spells them.
GRAMMAR_TOKENS = ("<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", '<|"|>', "<|tool_response>")


def listed_logprobs(
    logprobs: list[TokenLogprob], keep: Callable[[int], bool], cut: int | None = None
) -> list[TokenLogprob]:
    """The logprobs of the reply's text: its first `cut` tokens (all without), less those `keep` refuses."""
    return [t for t in logprobs[:cut] if keep(t.token_id)]


def text_cut(ids: list[int], pieces: Callable[[int], str], limit: int) -> int:
    """How many of `ids` reach into the first `limit` characters of the text `pieces` (each token's new text, in
    order) spell: a stop string cut the text there, and the tokens after it are no part of the reply."""
    seen = 0
    for i, t in enumerate(ids):
        before, seen = seen, seen + len(pieces(t))
        if seen > limit:
            return i + 1 if before < limit else i
    return len(ids)


def refuse_beyond_context(max_tokens: int | None, prompt: int, budget: int) -> None:
    """vLLM's rule: a `max_tokens` that the context cannot hold after the prompt is a 400 (`budget`, what the routes
    capped it at, is what is left), not a silently shorter reply. A client that sends a large max_tokens by default
    (opencode's 32,000) then learns the context is too small, and a compaction that cannot fit fails at once.
    Checked where the job is made, before a streamed reply's 200 is sent."""
    if max_tokens is not None and max_tokens > budget:
        raise invalid(
            f"max_tokens is {max_tokens} and the prompt {prompt} tokens: {prompt + max_tokens} is more than this "
            f"server's context of {prompt + budget} tokens; ask for at most {budget}",
            param="max_tokens",
            code="context_length_exceeded",
        )


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def strip_json(text: str) -> str | None:
    """The JSON object in `text` (a ```json fence allowed), or None if there is none."""
    s = text.strip()
    if s.startswith("```"):
        s = s.split("\n", 1)[1] if "\n" in s else ""
        s = s.rsplit("```", 1)[0].strip()
    try:
        value = json.loads(s)
    except ValueError:
        return None
    return s if isinstance(value, dict) else None


class _Base:
    """Fields and bookkeeping common to chat and raw completion jobs."""

    def __init__(
        self, ids: list[int], max_new: int, metrics: Metrics, channel: Channel, cancel: CancelToken
    ) -> None:
        self.ids = ids
        self.max_new = max_new  # the reply's token budget (`max_tokens` within the context)
        self.metrics = metrics
        self.channel = channel
        self.cancel = cancel
        self.enqueued_at = time.perf_counter()
        self.started_at = 0.0
        self._first = True

    def fail(self, error: APIError) -> None:
        self.channel.put(JobFailed(error))

    def _begin(self) -> None:
        self.started_at = time.perf_counter()
        self.metrics.queue_wait.observe(self.started_at - self.enqueued_at)

    def _first_block(self) -> None:
        if self._first:
            self._first = False
            self.metrics.first_token.observe(time.perf_counter() - self.enqueued_at)

    def _generate(
        self,
        ids: list[int],
        max_tokens: int,
        seed: int,
        on_block,
        cancel: CancelToken,
        logprobs: int | None = None,
        sampler: SamplerConfig | None = None,
        on_step: Callable[[StepInfo], None] | None = None,
    ) -> Generator[Run, list[O.Event], GenerateOutput]:
        """Route the prompt to its conversation, cut that to the common prefix, and generate: ops for the worker."""
        # Without sampler fields in the request, the op is exactly the engine's default one.
        fields = None if sampler is None else sampler_fields(sampler)
        on_event = lambda ev: on_block(ev.ids) if isinstance(ev, O.Committed) else None  # noqa: E731
        try:
            yield Run(O.Route(ids))
            (aligned,) = yield Run(O.AlignTo(ids))
            op = O.Generate(ids[aligned.reused :], seed, max_tokens, fields, logprobs)
            gen = Run(op, on_event, cancel, on_step=on_step)
            yield gen
        except ContextOverflow as exc:  # the engine's context checks after the server's; the rest: a 500
            raise APIError(400, str(exc), code="context_length_exceeded") from None
        out = gen.output
        assert out is not None
        out.reused_tokens = aligned.reused
        m = self.metrics
        m.prompt_tokens.inc(len(ids))
        m.cached_tokens.inc(out.reused_tokens)
        m.generated_tokens.inc(len(out.token_ids))
        m.denoise_steps.inc(out.steps)
        m.prefill_seconds.observe(out.prefill_seconds)
        m.denoise_seconds.observe(out.denoise_seconds)
        return out


@dataclass
class _Attempt:
    out: GenerateOutput
    events: list[Delta]
    finish: str
    content: str
    calls: list[dict[str, Any]]
    bad_calls: int  # tool calls that did not parse (or that tool_choice "none" did not allow): never content
    streamed: bool  # some event already reached the client, so a retry would repeat it
    stop_at: int | None = None  # where a stop string cut the content (characters), None if none did


class ChatJob(_Base):
    def __init__(
        self,
        request: ChatRequest,
        ids: list[int],
        forced: list[int],
        max_new: int,
        tokenizer: ChatTokenizer,
        render_tools: list[dict[str, Any]] | None,
        metrics: Metrics,
        channel: Channel,
        cancel: CancelToken,
        tool_rounds: ToolRounds | None = None,
    ) -> None:
        refuse_beyond_context(request.max_tokens, len(ids) + len(forced), max_new)
        super().__init__(ids, max_new, metrics, channel, cancel)
        self.req = request
        self.forced = forced  # reply tokens the prompt forces (tool_choice required / named)
        self.tok = tokenizer
        self.render_tools = render_tools
        # tool-turn continuation (server.toolturns): the prompt opened the thought channel; a round that ends in tool
        # calls keeps its raw log and is remembered for the next round
        self.tool_rounds = tool_rounds

    def steps(self) -> Steps:
        """Generate, retrying with a new seed (up to VALIDATION_ATTEMPTS) a reply that fails validation
        (json_object, a required tool call) or holds a tool call that does not parse. A validated or
        non-streaming reply is sent once it passes; a streaming one as it commits, and retried only if nothing
        of it has been sent yet. A reply whose tool call never parses is answered without it, as plain text."""
        self._begin()
        req = self.req
        validated = req.json_mode or req.tool_choice.mode == "required"
        live = req.stream and not validated
        problem = None
        for i in range(VALIDATION_ATTEMPTS):
            last = i + 1 == VALIDATION_ATTEMPTS
            att = yield from self._attempt(req.seed + i, self._emit if live else None, hold_bad=not last)
            if self.cancel.cancelled:
                break
            problem = self._problem(att)
            if problem is None or (att.streamed and not validated):
                break
            if not last:
                self.metrics.retries.inc()
        if problem is not None and validated:
            self.metrics.finished.inc(reason="invalid")
            seeds = f"seeds {req.seed}..{req.seed + i}"
            self.fail(
                APIError(
                    422,
                    f"{problem} after {i + 1} attempts ({seeds})",
                    type="invalid_response_error",
                    code="invalid_model_output",
                )
            )
            return
        if problem is not None:
            log.warning("%s after %d attempts; answering without it", problem, i + 1)
        if not live:
            for delta in att.events:
                self._emit(delta)
        out = att.out
        self.metrics.finished.inc(reason=att.finish)
        self.channel.put(
            Done(
                finish_reason=att.finish,
                prompt_tokens=len(self.ids),
                completion_tokens=len(self.forced) + len(out.token_ids),
                cached_tokens=min(out.reused_tokens, len(self.ids)),
                steps=out.steps,
                attempts=i + 1,
                logprobs=self._listed(att) if req.logprobs is not None else None,
            )
        )
        if not self.cancel.cancelled:
            yield from self._finalize(att)

    def _emit(self, delta: Delta) -> None:
        self._first_block()
        self.channel.put(delta)

    def _listed(self, att: _Attempt) -> list[TokenLogprob]:
        """The logprobs of the reply's tokens that make its text (its content, reasoning and tool calls, grammar
        included): not pad, filler or another control token that no text spells, nor a token after a stop string."""
        tok, ids = self.tok, att.out.token_ids
        grammar = {tok.token_to_id(t) for t in GRAMMAR_TOKENS}
        cut = None
        if att.stop_at is not None:  # where the content reached the stop string, through a parser of its own
            parser = StreamParser(tok, thinking_open=self.tool_rounds is not None)
            parser.feed(self.forced)

            def content(t: int) -> str:
                return "".join(e.text for e in parser.feed([t]) if isinstance(e, Content))

            cut = text_cut(ids, content, att.stop_at)
        return listed_logprobs(
            att.out.logprobs, lambda t: t in grammar or tok.decode([t], skip_special=True) != "", cut
        )

    def _canvas_frames(self) -> CanvasFrames:
        return CanvasFrames(self.tok, self.req.canvas_ms, self.channel.put)

    def _attempt(
        self, seed: int, emit: Callable[[Delta], None] | None, hold_bad: bool
    ) -> Generator[Run, list[O.Event], _Attempt]:
        """One generation. With `emit` (streaming) events go out as blocks commit; a bad tool call before any
        of them did stops the attempt (when `hold_bad`, so that a retry repeats nothing)."""
        events: list[Delta] = []
        parser = StreamParser(self.tok, thinking_open=self.tool_rounds is not None)
        parser.feed(self.forced)  # puts the parser inside the forced tool call: no events yet
        stops = StopFilter(self.req.stop)
        cancel = LinkedCancel(self.cancel)
        calls: list[dict[str, Any]] = []
        content: list[str] = []
        state = {"bad": 0, "held": False}

        def send(delta: Delta) -> None:
            if state["held"]:
                return
            events.append(delta)
            if emit is not None:
                emit(delta)

        def handle(batch: list[Event]) -> None:
            for ev in coalesce(batch):
                if isinstance(ev, BadCall) or (
                    isinstance(ev, ToolCall) and self.req.tool_choice.mode == "none"
                ):
                    state["bad"] += 1
                    if hold_bad and not (emit is not None and events):
                        state["held"] = True  # retried: the rest of this reply is not wanted
                        cancel.cancel()
                elif isinstance(ev, Reasoning) and ev.text:
                    send(Delta("reasoning", ev.text))
                elif isinstance(ev, Content):
                    text = stops.push(ev.text)
                    if text:
                        content.append(text)
                        send(Delta("content", text))
                    if stops.hit:
                        cancel.cancel()  # the rest of the reply is not wanted
                elif isinstance(ev, ToolCall) and not stops.hit:
                    call = {
                        "index": len(calls),
                        "id": new_call_id(),
                        "type": "function",
                        "function": {"name": ev.name, "arguments": ev.arguments_json},
                    }
                    calls.append(call)
                    send(Delta("tool_call", call=call))

        out = yield from self._generate(
            self.ids + self.forced,
            self.max_new,
            seed,
            lambda ids: handle(parser.feed(ids)),
            cancel,
            self.req.logprobs,
            self.req.sampler,
            None if self.req.canvas_ms is None or emit is None else self._canvas_frames(),
        )
        handle(parser.finish(out.finish_reason))
        tail = stops.flush()
        if tail:
            content.append(tail)
            send(Delta("content", tail))
        if stops.hit:
            finish = "stop"
        elif self.cancel.cancelled:
            finish = "cancelled"
        elif calls:
            finish = "tool_calls"
        else:
            finish = "stop" if out.finish_reason == "cancelled" else out.finish_reason
        streamed = emit is not None and bool(events)
        text = "".join(content)
        stop_at = len(text) if stops.hit else None
        return _Attempt(out, events, finish, text, calls, state["bad"], streamed, stop_at)

    def _problem(self, att: _Attempt) -> str | None:
        choice = self.req.tool_choice
        if choice.mode == "required":
            if not att.calls:
                return "the model did not produce a valid tool call"
            if choice.name and any(c["function"]["name"] != choice.name for c in att.calls):
                return f"the model did not call {choice.name!r}"
        if self.req.json_mode and not att.calls:
            cleaned = strip_json(att.content)
            if cleaned is None:
                return "the model did not produce a valid JSON object"
            att.content = cleaned
            att.events = [d for d in att.events if d.kind != "content"] + [Delta("content", cleaned)]
        if att.bad_calls:
            return "the model produced a tool call that does not parse"
        return None

    def _finalize(self, att: _Attempt) -> Steps:
        """Re-render the finished turn as the client will send it back and make the KV hold exactly that.
        A tool-calling turn is rendered with empty content, so it ends at the `<|tool_response>` opener
        and the client's next request (which adds the results) extends it. Under tool-turn continuation a round
        that ends in tool calls keeps its raw log instead (reasoning included), which the next round extends."""
        if self.tool_rounds is not None and att.finish == "tool_calls":
            # the reply's own tokens, then the response opener the canonical form of a call ends with
            raw = self.ids + self.forced + att.out.token_ids + [self.tok.token_to_id("<|tool_response>")]
            yield Run(O.Finalize(raw))
            self.tool_rounds.remember(ToolRound(self.req.messages, att.calls, raw, self.render_tools))
            return
        calls = [
            {
                "id": c["id"],
                "type": "function",
                "function": {
                    "name": c["function"]["name"],
                    "arguments": json.loads(c["function"]["arguments"]),
                },
            }
            for c in att.calls
        ]
        reply: dict[str, Any] = {"role": "assistant", "content": "" if calls else att.content}
        if calls:
            reply["tool_calls"] = calls
        ids = self.tok.encode_chat(
            [*self.req.messages, reply],
            tools=self.render_tools,
            add_generation_prompt=False,
            enable_thinking=self.req.think,
        )
        yield Run(O.Finalize(ids))


class CompletionJob(_Base):
    def __init__(
        self,
        request: CompletionRequest,
        ids: list[int],
        max_new: int,
        tokenizer: ChatTokenizer | None,
        metrics: Metrics,
        channel: Channel,
        cancel: CancelToken,
    ) -> None:
        refuse_beyond_context(request.max_tokens, len(ids), max_new)
        # OpenAI's legacy API and vLLM: 16 without max_tokens (capped as any budget, never refused)
        if request.max_tokens is None:
            max_new = min(max_new, COMPLETION_MAX_TOKENS)
        super().__init__(ids, max_new, metrics, channel, cancel)
        self.req = request
        self.tok = tokenizer

    def steps(self) -> Steps:
        self._begin()
        stops = StopFilter(self.req.stop)
        cancel = LinkedCancel(self.cancel)
        generated: list[int] = []
        sent = 0  # characters of the decoded reply already sent
        returned: list[str] = []  # the text sent (cut at a stop string)

        def on_block(ids: list[int]) -> None:
            nonlocal sent
            self._first_block()
            generated.extend(ids)
            text = self._decode(generated)
            if text.endswith("\ufffd"):  # an incomplete character: wait for the next block
                return
            piece = stops.push(text[sent:])
            sent = len(text)
            if piece:
                returned.append(piece)
                self.channel.put(Delta("content", piece))
            if stops.hit:
                cancel.cancel()

        out = yield from self._generate(
            self.ids,
            self.max_new,
            self.req.seed,
            on_block,
            cancel,
            self.req.logprobs,
            self.req.sampler,
        )
        text = self._decode(generated)
        piece = stops.push(text[sent:]) + stops.flush()
        if piece:
            returned.append(piece)
            self.channel.put(Delta("content", piece))
        finish = "stop" if stops.hit else ("cancelled" if self.cancel.cancelled else out.finish_reason)
        self.metrics.finished.inc(reason=finish)
        self.channel.put(
            Done(
                finish_reason=finish,
                prompt_tokens=len(self.ids),
                completion_tokens=len(out.token_ids),
                cached_tokens=min(out.reused_tokens, len(self.ids)),
                steps=out.steps,
                logprobs=self._listed(out, stops.hit, len("".join(returned)))
                if self.req.logprobs is not None
                else None,
            )
        )

    def _listed(self, out: GenerateOutput, stopped: bool, returned: int) -> list[TokenLogprob]:
        """The logprobs of the tokens `text` is decoded from: not pad, filler or a control token (they decode to
        nothing), nor a token after a stop string. Without a tokenizer there is no text: every token."""
        tok = self.tok
        if tok is None:
            return out.logprobs
        cut = None
        if stopped:  # `returned` characters of the text were sent
            text = _IncrementalText(lambda ids: tok.decode(ids, skip_special=True))
            cut = text_cut(out.token_ids, text.push, returned)
        return listed_logprobs(out.logprobs, lambda t: tok.decode([t], skip_special=True) != "", cut)

    def _decode(self, ids: list[int]) -> str:
        if self.tok is None:
            return ""
        return self.tok.decode(ids, skip_special=True)  # control tokens never reach `text`


class QuestionJob(_Base):
    """A question-schema request: `session.scoring`'s ops run by the worker, no generated text; the reply's content
    is the answers as JSON."""

    def __init__(
        self,
        schema: Q.Schema,
        template: Q.Template,
        ids: list[int],
        vocab: int,
        pad_id: int,
        metrics: Metrics,
        channel: Channel,
        cancel: CancelToken,
    ) -> None:
        super().__init__(ids, 0, metrics, channel, cancel)
        self.schema, self.template, self.vocab, self.pad_id = schema, template, vocab, pad_id

    def steps(self) -> Steps:
        self._begin()
        ops = scoring.score(self.schema, self.template, self.ids, self.vocab, self.pad_id)
        events = None
        while True:
            if self.cancel.cancelled:
                self.metrics.finished.inc(reason="cancelled")
                return
            try:
                op = ops.send(events)
            except StopIteration as done:
                reply = done.value
                break
            try:
                events = yield Run(op)
            except ContextOverflow as exc:  # the context's checks after the server's; anything else is a 500
                raise APIError(400, str(exc), code="context_length_exceeded") from None
        self._first_block()
        self.channel.put(Delta("content", json.dumps(reply, ensure_ascii=False)))
        self.metrics.finished.inc(reason="stop")
        reused = reply["diagnostics"]["timing"]["reused_tokens"]
        self.channel.put(
            Done(
                finish_reason="stop",
                prompt_tokens=len(self.ids),
                completion_tokens=0,
                cached_tokens=min(reused, len(self.ids)),
                steps=reply["diagnostics"]["samples"]["n"] * self.schema.steps,
            )
        )
