"""The tool stages (seed Part III): around a pipeline (or its op log), each takes a client's `Generate` and runs it
as ops of its own, so the log holds exactly what ran and replays without the stage.

`ToolValidator` (--tool-validate): a reply whose tool-call grammar does not parse is rewound and generated again
with the next seed, up to `attempts` times; the last attempt stands either way.

`ToolRepair` (--tool-repair), the evaporating draft: Mark at the prompt's end, generate; on an invalid tool call,
feed one error tool-response per invalid call and regenerate to a natural end (the response opener removed from the
stops, since a forced early cut breeds degenerate text), trim any response the model hallucinates after its reply,
and Rewind to the mark. The corrupt exchange and the feedback never enter the conversation's cache: it pays only for
the clean reply, which the client's next prompt (or `Finalize`) brings in.

Each attempt is a Generate begun on the inner stage: `begin_generate` answers the first one's scheduler `Request`,
and `end_generate` inspects the reply and answers either the stage's output or the next attempt's `Request` (the
ops between attempts run there, on the worker's thread between forwards), so a batching worker steps every attempt
beside other requests. The client sees the events of the reply that stands, when it stands."""

from __future__ import annotations

import re
from abc import abstractmethod
from dataclasses import dataclass, field

from diffgemma.chat.parser import BadCall, StreamParser
from diffgemma.chat.tokenizer import ChatTokenizer
from diffgemma.chat.toolcall import QUOTE
from diffgemma.engine.batch import Request
from diffgemma.engine.generate import CancelToken, GenerateOutput
from diffgemma.session import ops as O
from diffgemma.session.conversation import Conversation
from diffgemma.session.pipeline import call, collector, failed, run_generate, sampler_fields
from diffgemma.session.stage import Around, Emit, Ended, OnStep, Stage

RESPONSE_OPEN = "<|tool_response>"
RESPONSE_CLOSE = "<tool_response|>"
_CALL_NAME = re.compile(r"call:([A-Za-z0-9_.\-]+)")


def bad_calls(tok: ChatTokenizer, ids: list[int], finish_reason: str) -> list[BadCall]:
    """The tool calls of a reply that do not parse."""
    parser = StreamParser(tok)
    return [e for e in parser.feed(ids) + parser.finish(finish_reason) if isinstance(e, BadCall)]


@dataclass
class Flight:
    """A client's Generate under a tool stage, between its begin and its end: where its attempts start, and the
    events of the attempt that runs (held back from the client until its reply stands)."""

    op: O.Generate
    emit: Emit  # the client's
    conv: Conversation
    mark: O.KvId  # the prompt's end
    on_step: OnStep | None
    cancel: CancelToken | None
    attempt: int = 0
    events: list[O.Event] = field(default_factory=list)


class ToolStage(Around):
    """Passes every op but Generate through to `inner`; a Generate is the stage's own attempts (`_ended` decides
    after each whether another runs)."""

    def __init__(self, inner: Stage, tokenizer: ChatTokenizer) -> None:
        super().__init__(inner)
        self.tok = tokenizer
        self._flight: dict[int, Flight] = {}  # id(the running attempt's Request) -> its client Generate

    def run(
        self, op: O.Op, emit: Emit, on_step: OnStep | None = None, cancel: CancelToken | None = None
    ) -> None:
        if not isinstance(op, O.Generate):
            self.inner.run(op, emit, on_step=on_step, cancel=cancel)
            return
        try:
            run_generate(self, op, emit, on_step, cancel)
        except (
            ValueError,
            RuntimeError,
        ) as e:  # a failed forward: the pipeline's own `run` answers `Failed` too
            emit(failed(e))

    def begin_generate(
        self, op: O.Generate, emit: Emit, on_step: OnStep | None = None, cancel: CancelToken | None = None
    ) -> Request | None:
        """Extend by the op's prompt, mark its end (where every attempt starts) and begin the first attempt."""
        try:
            if op.ids:
                call(self.inner, O.Extend(list(op.ids)))
            mark = call(self.inner, O.Mark())[0].kv
        except ValueError as e:
            emit(failed(e))
            return None
        assert self.inner.active is not None  # Mark answered: a conversation is active
        return self._attempt(Flight(op, emit, self.inner.active, mark, on_step, cancel), op.seed)

    def _attempt(self, flight: Flight, seed: int, sampler: dict | None = None) -> Request | None:
        """Begin an attempt from the active cache's end (None, the client told `Failed`, if it is refused)."""
        op = flight.op
        gen = O.Generate(
            [], seed, op.max_new_tokens, sampler if sampler is not None else op.sampler, op.logprobs
        )
        flight.events = []
        request = self.inner.begin_generate(
            gen, collector(flight.events, None), on_step=flight.on_step, cancel=flight.cancel
        )
        if request is None:
            flight.emit(flight.events[-1])
            return None
        self._flight[id(request)] = flight
        return request

    def end_generate(self, request: Request) -> Ended:
        flight = self._flight.pop(id(request))
        ended = self.inner.end_generate(request)
        if isinstance(ended, Request):  # an inner stage's next attempt runs in its place
            self._flight[id(ended)] = flight
            return ended
        if ended is None:
            flight.emit(flight.events[-1])
            return None
        try:
            ended = self._ended(flight, ended)
        except ValueError as e:
            flight.emit(failed(e))
            return None
        if isinstance(ended, GenerateOutput):
            ended.prompt_tokens = len(flight.op.ids)  # the stage prefilled them before its Generate ops
        return ended

    def abort_generate(self, request: Request) -> None:
        self._flight.pop(id(request), None)
        self.inner.abort_generate(request)

    @abstractmethod
    def _ended(self, flight: Flight, out: GenerateOutput) -> Ended:
        """After an attempt's `Replied` (the last of `flight.events`): the output that stands (its events emitted)
        or the next attempt's Request."""

    def _activate(self, conv: Conversation) -> None:
        """Make conv active again for the ops between attempts (another request's ops may have moved it)."""
        if self.inner.active is not conv:
            call(self.inner, O.Activate(self.inner.conv_id(conv)))

    @staticmethod
    def _stand(flight: Flight, out: GenerateOutput) -> GenerateOutput:
        """The attempt's reply stands: the client gets its events."""
        for event in flight.events:
            flight.emit(event)
        return out


class ToolValidator(ToolStage):
    def __init__(self, inner: Stage, tokenizer: ChatTokenizer, attempts: int = 3) -> None:
        super().__init__(inner, tokenizer)
        if attempts < 1:
            raise ValueError("attempts must be at least 1")
        self.attempts = attempts

    def _ended(self, flight: Flight, out: GenerateOutput) -> Ended:
        reply = flight.events[-1]
        assert isinstance(reply, O.Replied)
        if (
            reply.finish_reason == "cancelled"
            or flight.attempt + 1 == self.attempts
            or not bad_calls(self.tok, reply.token_ids, reply.finish_reason)
        ):
            return self._stand(flight, out)
        self._activate(flight.conv)
        call(self.inner, O.Rewind(flight.mark))
        flight.attempt += 1
        return self._attempt(flight, flight.op.seed + flight.attempt)


class ToolRepair(ToolStage):
    def _ended(self, flight: Flight, out: GenerateOutput) -> Ended:
        return self._repair(flight, out) if flight.attempt == 0 else self._repaired(flight, out)

    def _repair(self, flight: Flight, out: GenerateOutput) -> Ended:
        """After the first reply: it stands, or the draft (reply and feedback) is fed and the regeneration begun."""
        reply = flight.events[-1]
        assert isinstance(reply, O.Replied)
        bad = (
            []
            if reply.finish_reason == "cancelled"
            else bad_calls(self.tok, reply.token_ids, reply.finish_reason)
        )
        if not bad:
            return self._stand(flight, out)
        self._activate(flight.conv)
        prompt = list(flight.conv.log[: flight.mark[1]])
        draft = prompt + list(reply.token_ids) + self.feedback(bad)
        (aligned,) = call(self.inner, O.AlignTo(draft))
        call(self.inner, O.Extend(draft[aligned.reused :]))
        opener = self.tok.token_to_id(RESPONSE_OPEN)
        cfg = self.inner.sampler(flight.op.sampler)
        stops = [t for t in cfg.stop_token_ids if t != opener]
        flight.attempt = 1
        return self._attempt(flight, flight.op.seed, sampler_fields(cfg.replace(stop_token_ids=tuple(stops))))

    def _repaired(self, flight: Flight, out: GenerateOutput) -> Ended:
        """After the regeneration: its reply trimmed at a self-written tool response, the draft rewound."""
        final = flight.events[-1]
        assert isinstance(final, O.Replied)
        opener = self.tok.token_to_id(RESPONSE_OPEN)
        ids = list(final.token_ids)
        if opener in ids:  # a tool response the model wrote itself: not its reply
            ids = ids[: ids.index(opener)]
        self._activate(flight.conv)
        call(self.inner, O.Rewind(flight.mark))
        out.token_ids = ids
        out.logprobs = out.logprobs[: len(ids)]
        kept = 0
        for event in flight.events[:-1]:
            if isinstance(event, O.Committed) and kept < len(ids):
                chunk = event.ids[: len(ids) - kept]
                kept += len(chunk)
                flight.emit(O.Committed(event.block, chunk, kept >= len(ids)))
        lps = final.logprobs[: len(ids)] if final.logprobs is not None else None
        finish, stop = final.finish_reason, final.stop_token
        if len(ids) < len(final.token_ids):  # trimmed: it ends where the opener would have stopped it
            finish, stop = "stop", opener
        out.finish_reason, out.stop_token = finish, stop
        kv = call(self.inner, O.Mark())[0].kv
        flight.emit(
            O.Replied(
                ids, finish, stop, final.steps, final.blocks, final.retries, 0, kv, lps, final.cancel_after
            )
        )
        return out

    def feedback(self, bad: list[BadCall]) -> list[int]:
        """One error tool-response per invalid call, in the template's tool-response form."""
        tok = self.tok
        ids: list[int] = []
        for b in bad:
            m = _CALL_NAME.search(b.raw)
            name = m.group(1) if m else "unknown"
            message = "the tool call did not parse: write it again in the tool-call grammar"
            ids += [tok.token_to_id(RESPONSE_OPEN)] + tok.encode_text(f"response:{name}{{error:")
            ids += [tok.token_to_id(QUOTE)] + tok.encode_text(message) + [tok.token_to_id(QUOTE)]
            ids += tok.encode_text("}") + [tok.token_to_id(RESPONSE_CLOSE)]
        return ids
