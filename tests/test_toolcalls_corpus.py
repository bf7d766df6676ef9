"""The tool-call corpus: raw outputs of every family, well-formed and malformed.

Each case is checked three ways: the text fed whole, split in two at every character boundary,
and fed one character at a time (the splitter and parser level); and through the real output
pipeline token by token (a byte tokenizer: every byte boundary is a token boundary), streaming
and non-streaming, with the family chosen from its chat template.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from corpus.support import corpus, corpus_tools, family_tokenizer, summarize
from turbospark.events import Event, Finish, TextDelta
from turbospark.generate import run_choice, stream_choice
from turbospark.metrics import sample
from turbospark.plan import make_plan
from turbospark.reasoning import ReasoningSplitter
from turbospark.registry import ModelRegistry, ServedModel
from turbospark.request import ChatRequest, Message
from turbospark.scripted import ScriptedChatModel
from turbospark.toolcalls import ToolFamily, detect_family, parser_class
from turbospark.toolcalls.guardrails import GuardrailConfig
from turbospark.toolcalls.stream import CallStats

CASES = corpus()["cases"]


def run_text(case: dict[str, Any], pieces: list[str]) -> tuple[dict[str, Any], CallStats]:
    """Splitter then parser, as `turbospark.output` chains them."""
    parser = parser_class(ToolFamily(case["family"]))(corpus_tools(), GuardrailConfig())
    splitter = ReasoningSplitter(case["start_in_reasoning"])
    events: list[Event] = []

    def route(parts: list[Any]) -> None:
        for part in parts:
            events.extend(parser.feed(part.text) if isinstance(part, TextDelta) else [part])

    for piece in pieces:
        route(splitter.feed(piece))
    route(splitter.finish())
    events.extend(parser.finish())
    return summarize(events), parser.stats


def expected(case: dict[str, Any]) -> dict[str, Any]:
    return {"text": case["text"], "reasoning": case["reasoning"], "calls": case["calls"]}


def without_ids(result: dict[str, Any]) -> dict[str, Any]:
    calls = [{"name": c["name"], "arguments": c["arguments"]} for c in result["calls"]]
    return {**result, "calls": calls}


def test_corpus_size_and_coverage() -> None:
    assert len(CASES) >= 60
    families = {c["family"] for c in CASES}
    assert families == {f.value for f in ToolFamily}
    assert sum(c["outcomes"]["repaired"] for c in CASES) > 0
    assert sum(c["outcomes"]["returned_as_text"] for c in CASES) > 0


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_corpus_case_at_every_split(case: dict[str, Any]) -> None:
    output = case["output"]
    whole, stats = run_text(case, [output])
    assert without_ids(whole) == expected(case)
    outcomes = {"ok": stats.num_ok, "repaired": stats.num_repaired, "returned_as_text": stats.num_as_text}
    assert outcomes == case["outcomes"], stats.rejections
    for cut in range(1, len(output)):
        split, _ = run_text(case, [output[:cut], output[cut:]])
        assert without_ids(split) == without_ids(whole), f"split at {cut}: {output[:cut]!r}"
    by_char, _ = run_text(case, list(output))
    assert without_ids(by_char) == without_ids(whole)
    ids = [c["id"] for c in whole["calls"]]
    assert len(set(ids)) == len(ids)


def _plan(case: dict[str, Any], stream: bool) -> Any:
    tokenizer = family_tokenizer(case["family"])
    assert detect_family(tokenizer.chat_template) is ToolFamily(case["family"])
    # The scripted backend replays the raw output as tokens; a template-opened think block is
    # replayed by starting the reply inside it (the tokenizer has no thinking switch to render).
    backend = ScriptedChatModel([case["output"]], tokenizer=tokenizer)
    registry = ModelRegistry()
    # The corpus is what models write when nothing holds them to the schema (the server's
    # `--no-constrained-calls`, or no grammar engine installed). With the constraint on, the
    # malformed outputs could not be written at all: the mask would push the scripted model off
    # its script. These cases check the parse-and-repair path that is left then.
    registry.add(ServedModel(backend, guardrails=GuardrailConfig(constrain_calls=False)))
    request = ChatRequest(
        model="scripted",
        messages=[Message(role="user", content="What is the weather in Paris?")],
        tools=corpus_tools(),
        stream=stream,
    )
    plan = make_plan(request, registry)
    plan.start_in_reasoning = case["start_in_reasoning"]
    plan.has_reasoning_markup = True
    return plan


async def _collect_stream(plan: Any) -> list[Event]:
    return [ev async for ev in stream_choice(plan, 0)]


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_corpus_case_through_the_pipeline(case: dict[str, Any]) -> None:
    streamed = asyncio.run(_collect_stream(_plan(case, stream=True)))
    whole = asyncio.run(run_choice(_plan(case, stream=False)))
    assert without_ids(summarize(streamed)) == expected(case)
    assert without_ids(summarize(whole)) == expected(case)
    finish = whole[-1]
    assert isinstance(finish, Finish)
    assert finish.reason == ("tool_calls" if case["calls"] else "stop")


def test_corpus_report(capsys: pytest.CaptureFixture[str]) -> None:
    """Totals over the corpus, as /metrics counts them."""
    before = {
        o: sample("turbospark_tool_calls_total", outcome=o) for o in ("ok", "repaired", "returned_as_text")
    }
    for case in CASES:
        run_text(case, [case["output"]])
    counted = {o: sample("turbospark_tool_calls_total", outcome=o) - before[o] for o in before}
    wanted = {o: sum(c["outcomes"][o] for c in CASES) for o in before}
    assert counted == wanted
    with capsys.disabled():
        print(
            f"\ntool-call corpus: {len(CASES)} outputs, {sum(len(c['calls']) for c in CASES)} calls; "
            f"ok {counted['ok']:.0f}, repaired {counted['repaired']:.0f}, "
            f"returned as text {counted['returned_as_text']:.0f}"
        )
