"""The output pipeline on its own: token ids in, API-neutral events out."""

from __future__ import annotations

import dataclasses

from turbospark.backend import CompletionResult, FinishReason, TokenEvent
from turbospark.events import Event, Finish, ReasoningDelta, TextDelta, ToolCallArgs, ToolCallStart
from turbospark.output import OutputPipeline
from turbospark.plan import Plan, make_plan
from turbospark.registry import ModelRegistry
from turbospark.request import ChatRequest, Message, Tool
from turbospark.scripted import ScriptedChatModel


def plan(**fields: object) -> Plan:
    registry = ModelRegistry()
    registry.add(ScriptedChatModel())
    request = ChatRequest(model="scripted", messages=[Message("user", "hi")], **fields)  # type: ignore[arg-type]
    return make_plan(request, registry)


def run(p: Plan, text: str) -> tuple[list[Event], bool]:
    """Feeds `text` token by token, as the engine would; True when a stop string cancelled it."""
    pipeline = OutputPipeline(p)
    ids = p.backend.tokenizer.encode(text, add_special_tokens=False)
    events: list[Event] = []
    for token_id in ids:
        events += pipeline.feed(TokenEvent(token_id))
        if pipeline.stopped:
            break
    result = CompletionResult(ids, FinishReason.STOP, num_prompt_tokens=len(p.prompt_ids))
    return events + pipeline.finish(result), pipeline.stopped


def joined(events: list[Event], kind: type) -> str:
    return "".join(e.text for e in events if isinstance(e, kind))  # type: ignore[attr-defined]


def test_text_and_finish_with_usage() -> None:
    events, stopped = run(plan(), "héllo wörld")
    assert joined(events, TextDelta) == "héllo wörld" and not stopped
    finish = events[-1]
    assert isinstance(finish, Finish) and finish.reason == "stop"
    assert finish.usage.completion_tokens == len("héllo wörld".encode())


def test_stop_string_ends_the_text_and_sets_the_cancel_signal() -> None:
    events, stopped = run(plan(stop=["STOP"]), "one two STOP three")
    assert stopped and joined(events, TextDelta) == "one two "
    finish = events[-1]
    assert isinstance(finish, Finish) and (finish.reason, finish.stop_sequence) == ("stop", "STOP")


def test_a_reply_that_echoes_the_servers_reminder_ends_there_as_a_plain_end() -> None:
    """`focused_messages` repeats the request after a tool result; a reply that starts to repeat
    that line ends before it, and the client hears of no stop sequence it did not send."""
    p = dataclasses.replace(plan(), echo_stops=("(The user asked:",))
    events, stopped = run(p, "No matches found\n\n(The user asked: what does greet return?)")
    assert stopped and joined(events, TextDelta) == "No matches found\n\n"
    finish = events[-1]
    assert isinstance(finish, Finish) and (finish.reason, finish.stop_sequence) == ("stop", None)
    # the client's own stop string is still reported as such
    both = dataclasses.replace(plan(stop=["found"]), echo_stops=("(The user asked:",))
    events, stopped = run(both, "No matches found")
    assert stopped and events[-1].stop_sequence == "found"  # type: ignore[attr-defined]


def test_reasoning_is_split_from_the_answer() -> None:
    events, _ = run(plan(), "<think>step one</think>the answer")
    assert joined(events, ReasoningDelta) == "step one"
    assert joined(events, TextDelta) == "the answer"
    finish = events[-1]
    assert isinstance(finish, Finish) and finish.usage.reasoning_tokens > 0


def test_a_tool_call_is_emitted_whole_and_checked() -> None:
    tools = [Tool("get_weather", parameters={"type": "object", "properties": {"city": {"type": "string"}}})]
    events, _ = run(
        plan(tools=tools), '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    )
    starts = [e for e in events if isinstance(e, ToolCallStart)]
    assert [(s.index, s.name) for s in starts] == [(0, "get_weather")]
    assert (
        "".join(e.delta for e in events if isinstance(e, ToolCallArgs)).replace(" ", "") == '{"city":"Paris"}'
    )
    finish = events[-1]
    assert isinstance(finish, Finish) and finish.reason == "tool_calls"


def test_an_unparseable_call_comes_back_as_text() -> None:
    tools = [Tool("get_weather")]
    text = "<tool_call>not json at all</tool_call>"
    events, _ = run(plan(tools=tools), text)
    assert not any(isinstance(e, ToolCallStart) for e in events)
    assert joined(events, TextDelta) == text
