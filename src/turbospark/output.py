"""Token ids in, API-neutral events out: detokenize, stop strings, reasoning, tool calls.

One `OutputPipeline` per choice. It runs on the engine's worker thread inside the progress
callback, so every decoded token becomes events as soon as it is sampled. The order is fixed:
incremental UTF-8-safe detokenizing -> stop strings (over the whole generated text, as the OpenAI
API defines them) -> reasoning split (`<think>`) -> tool-call parsing of the answer. A matched stop
string sets `stopped`, which the caller turns into the engine's cancel flag.

Special tokens are skipped when detokenizing, except the markers the reasoning splitter and the
tool parser read (`<think>` where a tokenizer marks it special, Mistral's `[TOOL_CALLS]`, Llama's
`<|python_tag|>`): those come through as their text, or reasoning would leak into the answer and
calls would be lost.
"""

from __future__ import annotations

from turbospark.backend import CompletionResult, FinishReason, TokenEvent
from turbospark.events import (
    Event,
    Finish,
    FinishKind,
    ReasoningDelta,
    TextDelta,
    TokenLogprob,
    Usage,
)
from turbospark.plan import Plan
from turbospark.reasoning import ReasoningSplitter
from turbospark.tokenizer import IncrementalDecoder, StopMatcher
from turbospark.toolcalls import ToolParser, make_tool_parser


class OutputPipeline:
    def __init__(self, plan: Plan) -> None:
        tokenizer = plan.backend.tokenizer
        self.tokenizer = tokenizer
        self.decoder = IncrementalDecoder(tokenizer)
        self.stops = StopMatcher([*plan.request.stop, *plan.echo_stops])
        self.echo_stops = set(plan.echo_stops) - set(plan.request.stop)
        self.echoed = False  # the reply began to repeat the server's own prompt text: ended there
        self.splitter = ReasoningSplitter(plan.start_in_reasoning) if plan.has_reasoning_markup else None
        tools = [] if plan.calls_closed else plan.tools
        self.tools: ToolParser | None = make_tool_parser(plan.chat_template, tools, plan.guardrails)
        markers = list(self.tools.special_markers) if self.tools is not None else []
        if self.splitter is not None:
            markers += self.splitter.tags
        self.kept_specials: dict[int, str] = {}
        for marker in markers:
            token_id = tokenizer.token_to_id(marker)
            if token_id is not None and token_id in tokenizer.special_ids:
                self.kept_specials[token_id] = marker
        self.want_logprobs = plan.config.num_top_logprobs is not None
        self.pending_logprobs: list[TokenLogprob] = []
        self.stop_sequence: str | None = None
        self.num_tokens = 0
        self.num_reasoning_tokens = 0

    @property
    def stopped(self) -> bool:
        return self.stop_sequence is not None or self.echoed

    def _matched(self, matched: str | None) -> None:
        if matched in self.echo_stops:
            self.echoed = True
        elif matched is not None:
            self.stop_sequence = matched

    def feed(self, token: TokenEvent) -> list[Event]:
        if self.stopped:
            return []  # tokens the engine made before it saw the cancel flag
        self.num_tokens += 1
        if self.splitter is not None and self.splitter.in_reasoning:
            self.num_reasoning_tokens += 1
        if self.want_logprobs:
            self.pending_logprobs.append(self._logprob(token))
        text, matched = self.stops.push(self._detokenize(token.token_id))
        self._matched(matched)
        return self._route(text)

    def finish(self, result: CompletionResult) -> list[Event]:
        events: list[Event] = []
        if not self.stopped:
            text, matched = self.stops.push(self.decoder.flush())
            self._matched(matched)
            events += self._route(text + ("" if self.stopped else self.stops.flush()))
        if self.splitter is not None:
            events += self._answer(self.splitter.finish())
        if self.tools is not None:
            events += self.tools.finish()
        if self.pending_logprobs:
            events.append(TextDelta("", self.pending_logprobs))
            self.pending_logprobs = []
        reason: FinishKind
        if self.stopped:
            reason = "stop"
        elif self.tools is not None and self.tools.num_calls:
            reason = "tool_calls"
        elif result.finish_reason is FinishReason.LENGTH:
            reason = "length"
        elif result.finish_reason is FinishReason.CANCELLED:
            reason = "cancelled"
        else:
            reason = "stop"
        usage = Usage(
            prompt_tokens=result.num_prompt_tokens,
            completion_tokens=len(result.token_ids),
            reasoning_tokens=self.num_reasoning_tokens,
            cached_tokens=result.num_cached_tokens,
        )
        events.append(
            Finish(reason, usage, self.stop_sequence, result.prefill_seconds, result.decode_seconds)
        )
        return events

    def _detokenize(self, token_id: int) -> str:
        marker = self.kept_specials.get(token_id)
        if marker is None:
            return self.decoder.push(token_id)
        held = self.decoder.flush()  # bytes before a special token can never complete
        self.decoder = IncrementalDecoder(self.tokenizer)
        return held + marker

    def _route(self, text: str) -> list[Event]:
        if not text:
            return []
        if self.splitter is None:
            return self._answer([TextDelta(text)])
        return self._answer(self.splitter.feed(text))

    def _answer(self, pieces: list[ReasoningDelta | TextDelta]) -> list[Event]:
        out: list[Event] = []
        for piece in pieces:
            if isinstance(piece, ReasoningDelta) or self.tools is None:
                out.append(piece)
            else:
                out.extend(self.tools.feed(piece.text))
        if self.pending_logprobs:
            for i, ev in enumerate(out):
                if isinstance(ev, TextDelta):
                    out[i] = TextDelta(ev.text, self.pending_logprobs)
                    self.pending_logprobs = []
                    break
        return out

    def _logprob(self, token: TokenEvent) -> TokenLogprob:
        text = self.tokenizer.token_bytes_text
        top = [(text(i), i, lp) for i, lp in (token.top_logprobs or [])]
        return TokenLogprob(text(token.token_id), token.token_id, token.logprob or 0.0, top)
