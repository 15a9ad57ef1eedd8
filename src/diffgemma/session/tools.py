"""The tool stages (seed Part III): around a pipeline (or its op log), each takes a client's `Generate` and runs it
as ops of its own, so the log holds exactly what ran and replays without the stage.

`ToolValidator` (--tool-validate): a reply whose tool-call grammar does not parse is rewound and generated again
with the next seed, up to `attempts` times; the last attempt stands either way.

`ToolRepair` (--tool-repair), the evaporating draft: Mark at the prompt's end, generate; on an invalid tool call,
feed one error tool-response per invalid call and regenerate to a natural end (the response opener removed from the
stops, since a forced early cut breeds degenerate text), trim any response the model hallucinates after its reply,
and Rewind to the mark. The corrupt exchange and the feedback never enter the conversation's cache: it pays only for
the clean reply, which the client's next prompt (or `Finalize`) brings in."""

from __future__ import annotations

import re
from typing import Any

from diffgemma.chat.parser import BadCall, StreamParser
from diffgemma.chat.tokenizer import ChatTokenizer
from diffgemma.chat.toolcall import QUOTE
from diffgemma.session import ops as O
from diffgemma.session.pipeline import Emit, call, failed, sampler_fields

RESPONSE_OPEN = "<|tool_response>"
RESPONSE_CLOSE = "<tool_response|>"
_CALL_NAME = re.compile(r"call:([A-Za-z0-9_.\-]+)")


def bad_calls(tok: ChatTokenizer, ids: list[int], finish_reason: str) -> list[BadCall]:
    """The tool calls of a reply that do not parse."""
    parser = StreamParser(tok)
    return [e for e in parser.feed(ids) + parser.finish(finish_reason) if isinstance(e, BadCall)]


class _Stage:
    """Passes every op but Generate through to `inner`."""

    begin_generate = None  # its Generates are ops of its own: a batching worker runs them one at a time

    def __init__(self, inner: Any, tokenizer: ChatTokenizer) -> None:
        self.inner = inner
        self.tok = tokenizer

    def run(self, op: O.Op, emit: Emit, **kwargs: Any) -> None:
        if not isinstance(op, O.Generate):
            self.inner.run(op, emit, **kwargs)
            return
        try:
            self._generate(op, emit, **kwargs)
        except ValueError as e:
            emit(failed(e))
            return
        self.inner.last_output.prompt_tokens = len(op.ids)  # the stage prefilled them before its Generate ops

    def _start(self, op: O.Generate) -> O.KvId:
        """Extend by the op's prompt and mark its end: where every attempt starts."""
        if op.ids:
            call(self.inner, O.Extend(list(op.ids)))
        return call(self.inner, O.Mark())[0].kv

    def _attempt(
        self, op: O.Generate, seed: int, sampler: dict | None = None, **kwargs: Any
    ) -> list[O.Event]:
        gen = O.Generate(
            [], seed, op.max_new_tokens, sampler if sampler is not None else op.sampler, op.logprobs
        )
        return call(self.inner, gen, **kwargs)

    def _generate(self, op: O.Generate, emit: Emit, **kwargs: Any) -> None:
        raise NotImplementedError

    def cancel(self) -> None:
        self.inner.cancel()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class ToolValidator(_Stage):
    def __init__(self, inner: Any, tokenizer: ChatTokenizer, attempts: int = 3) -> None:
        super().__init__(inner, tokenizer)
        if attempts < 1:
            raise ValueError("attempts must be at least 1")
        self.attempts = attempts

    def _generate(self, op: O.Generate, emit: Emit, **kwargs: Any) -> None:
        mark = self._start(op)
        for i in range(self.attempts):
            events = self._attempt(op, op.seed + i, **kwargs)
            reply = events[-1]
            last = i + 1 == self.attempts
            if (
                reply.finish_reason == "cancelled"
                or last
                or not bad_calls(self.tok, reply.token_ids, reply.finish_reason)
            ):
                break
            call(self.inner, O.Rewind(mark))
        for event in events:
            emit(event)


class ToolRepair(_Stage):
    def _generate(self, op: O.Generate, emit: Emit, **kwargs: Any) -> None:
        mark = self._start(op)
        events = self._attempt(op, op.seed, **kwargs)
        reply = events[-1]
        bad = (
            []
            if reply.finish_reason == "cancelled"
            else bad_calls(self.tok, reply.token_ids, reply.finish_reason)
        )
        if not bad:
            for event in events:
                emit(event)
            return
        prompt = list(self.inner.active.log[: mark[1]])
        draft = prompt + list(reply.token_ids) + self.feedback(bad)
        (aligned,) = call(self.inner, O.AlignTo(draft))
        call(self.inner, O.Extend(draft[aligned.reused :]))
        opener = self.tok.token_to_id(RESPONSE_OPEN)
        cfg = self.inner.sampler(op.sampler)
        stops = [t for t in cfg.stop_token_ids if t != opener]
        again = self._attempt(op, op.seed, sampler_fields(cfg.replace(stop_token_ids=tuple(stops))), **kwargs)
        final = again[-1]
        ids = list(final.token_ids)
        if opener in ids:  # a tool response the model wrote itself: not its reply
            ids = ids[: ids.index(opener)]
        call(self.inner, O.Rewind(mark))
        out = self.inner.last_output
        out.token_ids = ids
        out.logprobs = out.logprobs[: len(ids)]
        kept = 0
        for event in again[:-1]:
            if isinstance(event, O.Committed) and kept < len(ids):
                chunk = event.ids[: len(ids) - kept]
                kept += len(chunk)
                emit(O.Committed(event.block, chunk, kept >= len(ids)))
        lps = final.logprobs[: len(ids)] if final.logprobs is not None else None
        finish, stop = final.finish_reason, final.stop_token
        if len(ids) < len(
            final.token_ids
        ):  # trimmed: it ends where the response opener would have stopped it
            finish, stop = "stop", opener
        out.finish_reason, out.stop_token = finish, stop
        kv = call(self.inner, O.Mark())[0].kv
        emit(
            O.Replied(
                ids, finish, stop, final.steps, final.blocks, final.retries, 0, kv, lps, final.cancel_after
            )
        )

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
