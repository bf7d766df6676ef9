"""Guardrails one step at a time, the family choice, their switches, and the /metrics text."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from corpus.support import TEMPLATES, family_tokenizer
from turbospark.api.common import ServerState
from turbospark.events import TextDelta, ToolCallArgs, ToolCallStart
from turbospark.metrics import sample
from turbospark.registry import ModelRegistry, ServedModel
from turbospark.request import Tool
from turbospark.scripted import ScriptedChatModel
from turbospark.testing import LiveServer
from turbospark.toolcalls import ToolFamily, detect_family, make_tool_parser
from turbospark.toolcalls.guardrails import (
    CheckedCall,
    GuardrailConfig,
    JsonRepairError,
    Rejected,
    check_arguments,
    finalize_call,
    loads_tolerant,
    match_tool_name,
)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ('{"a": 1}', {"a": 1}),
        ('{"a": 1,}', {"a": 1}),
        ("{'a': 'it\\'s'}", {"a": "it's"}),
        ("{a: True, b: None, c: False}", {"a": True, "b": None, "c": False}),
        ('```json\n{"a": [1, 2,]}\n```', {"a": [1, 2]}),
        ('{"a": {"b": "unclosed', {"a": {"b": "unclosed"}}),
        ('{"a": 1 "b": 2}', {"a": 1, "b": 2}),
        ('Here you go: {"x": null} -- done', {"x": None}),
        ('{"a": 1, // a comment\n "b": /* inline */ 2}', {"a": 1, "b": 2}),
        ('{"s": "line\nbreak"}', {"s": "line\nbreak"}),
        ("[1, 2, 3", [1, 2, 3]),
    ],
)
def test_tolerant_json(text: str, value: Any) -> None:
    got, repaired = loads_tolerant(text)
    assert got == value
    assert repaired == (text != json.dumps(value) and text not in ('{"a": 1}',))


def test_tolerant_json_gives_up_on_prose() -> None:
    with pytest.raises(JsonRepairError):
        loads_tolerant("no json here at all")


def test_name_matching() -> None:
    names = ["get_weather", "get_time", "search_files"]
    assert match_tool_name("get_weather", names) == "get_weather"
    assert match_tool_name("GetWeather", names) == "get_weather"
    assert match_tool_name("get-time", names) == "get_time"
    assert match_tool_name("functions.search_files", names) == "search_files"
    assert match_tool_name("get_wether", names) == "get_weather"
    assert match_tool_name("send_email", names) is None
    assert match_tool_name("get_weathr", ["get_weather", "get_weathers"]) is None  # ambiguous: no guess


def test_schema_coercion_and_errors() -> None:
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "integer"},
            "x": {"type": "number"},
            "flag": {"type": "boolean"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "opt": {"type": "object", "properties": {"k": {"type": "string"}}},
            "mode": {"type": "string", "enum": ["fast", "slow"], "default": "fast"},
            "ref": {"$ref": "#/$defs/point"},
            "either": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
        },
        "required": ["n", "mode"],
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}},
    }
    ok = check_arguments(
        {
            "n": "7",
            "x": "2.5",
            "flag": "false",
            "tags": "a",
            "opt": '{"k": "v"}',
            "ref": {"x": 1.0},
            "either": "s",
        },
        schema,
    )
    assert ok.errors == [] and ok.coerced
    assert ok.value == {
        "n": 7,
        "x": 2.5,
        "flag": False,
        "tags": ["a"],
        "opt": {"k": "v"},
        "ref": {"x": 1},
        "either": "s",
        "mode": "fast",
    }
    untouched = check_arguments({"n": 1, "mode": "slow", "either": 3}, schema)
    assert untouched.errors == [] and not untouched.coerced
    bad = check_arguments({"n": "seven", "mode": "medium", "ref": {}}, schema)
    assert len(bad.errors) == 3


def test_finalize_call_steps_and_switches() -> None:
    tools = {
        "get_weather": Tool(
            "get_weather", parameters={"type": "object", "properties": {"days": {"type": "integer"}}}
        )
    }
    on = GuardrailConfig()
    result = finalize_call("getWeather", '{"days": "2",}', tools, on)
    assert isinstance(result, CheckedCall)
    assert (result.name, json.loads(result.arguments)) == ("get_weather", {"days": 2})
    assert set(result.repairs) == {"json", "arguments_string", "name", "schema"}
    off = GuardrailConfig(enabled=False)
    assert isinstance(finalize_call("getWeather", '{"days": "2",}', tools, off), Rejected)
    passthrough = finalize_call("getWeather", {"days": "2"}, tools, off)
    assert (
        isinstance(passthrough, CheckedCall) and passthrough.name == "getWeather" and not passthrough.repairs
    )
    no_names = GuardrailConfig(match_names=False)
    assert isinstance(finalize_call("getWeather", {}, tools, no_names), CheckedCall)
    assert isinstance(finalize_call("get_weather", [1], tools, on), Rejected)


def _run(family: ToolFamily, text: str, guardrails: GuardrailConfig) -> tuple[str, list[tuple[str, Any]]]:
    tools = [Tool("get_weather", parameters={"type": "object", "properties": {"city": {"type": "string"}}})]
    parser = make_tool_parser(TEMPLATES[family.value], tools, guardrails)
    assert parser is not None
    events = parser.feed(text) + parser.finish()
    names = [e.name for e in events if isinstance(e, ToolCallStart)]
    args = [json.loads(e.delta) for e in events if isinstance(e, ToolCallArgs)]
    return "".join(e.text for e in events if isinstance(e, TextDelta)), list(zip(names, args, strict=True))


def test_guardrails_off_returns_malformed_calls_as_text() -> None:
    broken = "<tool_call>\n{'name': 'get_weather', 'arguments': {'city': 'Paris'}}\n</tool_call>"
    assert _run(ToolFamily.HERMES, broken, GuardrailConfig()) == ("", [("get_weather", {"city": "Paris"})])
    assert _run(ToolFamily.HERMES, broken, GuardrailConfig(enabled=False)) == (broken, [])
    fenced = '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```'
    assert _run(ToolFamily.HERMES, fenced, GuardrailConfig(enabled=False)) == (fenced, [])
    unclosed = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
    assert _run(ToolFamily.HERMES, unclosed, GuardrailConfig(enabled=False)) == (unclosed, [])


def _run_streamed(family: ToolFamily, text: str) -> tuple[str, list[tuple[str, Any]]]:
    """`_run` with the text fed one character at a time, as a stream may cut it."""
    tools = [Tool("get_weather", parameters={"type": "object", "properties": {"city": {"type": "string"}}})]
    parser = make_tool_parser(TEMPLATES[family.value], tools, GuardrailConfig())
    assert parser is not None
    events = [e for ch in text for e in parser.feed(ch)] + parser.finish()
    names = [e.name for e in events if isinstance(e, ToolCallStart)]
    args = [json.loads(e.delta) for e in events if isinstance(e, ToolCallArgs)]
    return "".join(e.text for e in events if isinstance(e, TextDelta)), list(zip(names, args, strict=True))


JUNK_CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


@pytest.mark.parametrize("family", [ToolFamily.HERMES, ToolFamily.LLAMA3])
@pytest.mark.parametrize("prefix", [">", "> ", "\n>\n", "- * ", "`", "``", ":", "#"])
def test_a_junk_prefix_before_a_bare_call_is_dropped(family: ToolFamily, prefix: str) -> None:
    call = ("", [("get_weather", {"city": "Paris"})])
    assert _run(family, prefix + JUNK_CALL, GuardrailConfig()) == call
    assert _run_streamed(family, prefix + JUNK_CALL) == call


@pytest.mark.parametrize("family", [ToolFamily.HERMES, ToolFamily.LLAMA3])
@pytest.mark.parametrize(
    "text",
    [
        "Sure: " + JUNK_CALL,  # a word before the JSON: prose with an example
        "a>" + JUNK_CALL,
        ">>>> " + JUNK_CALL,  # more junk than a stray token or two
        ">" + " " * 9 + JUNK_CALL,  # a long gap
        "```" + JUNK_CALL,  # a fence's first line is not junk
        '> {"answer": 42}',  # JSON after junk that is not a call
        "- [ ] a task",
        "> quoted",
        ">",
    ],
)
def test_a_longer_or_wordy_prefix_stays_text(family: ToolFamily, text: str) -> None:
    assert _run(family, text, GuardrailConfig()) == (text, [])
    assert _run_streamed(family, text) == (text, [])


FENCED_CALL = "```json\n" + JUNK_CALL + "\n```"


@pytest.mark.parametrize(
    "text",
    [
        "To check the weather, call the tool:\n\n" + FENCED_CALL,
        "Sure.\n```\n" + JUNK_CALL + "\n```\n",
    ],
)
def test_a_fenced_call_after_text_is_a_call(text: str) -> None:
    """Small Qwen models write a sentence, then the call in a code fence: the Hermes parser reads
    it as a call to a declared tool; the sentence stays text."""
    prose = text[: text.index("```")].strip()
    call = (prose, [("get_weather", {"city": "Paris"})])
    assert _run(ToolFamily.HERMES, text, GuardrailConfig()) == call
    assert _run_streamed(ToolFamily.HERMES, text) == call


@pytest.mark.parametrize(
    "text",
    [
        "Use this:\n\n```python\nprint('```')\n```\n\nIt prints three backticks.",
        'The config:\n```json\n{"city": "Paris"}\n```',  # JSON that is not a call
        'Like so:\n```json\n{"name": "my-app", "version": "1.0.0"}\n```',  # a package.json
        'Call:\n```json\n{"name": "send_mail", "arguments": {"to": "x"}}\n```',  # not declared
        "An unclosed fence: ```json\n{",
        "Inline `code` and ``two`` and a lone ``` here.",
    ],
)
def test_code_fences_after_text_that_hold_no_declared_call_stay_text(text: str) -> None:
    tools = [Tool("get_weather", parameters={"type": "object", "properties": {"city": {"type": "string"}}})]
    parser = make_tool_parser(TEMPLATES[ToolFamily.HERMES.value], tools, GuardrailConfig())
    assert parser is not None
    events = parser.feed(text) + parser.finish()
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == text
    assert parser.stats.num_as_text == 0  # not counted as a call gone wrong
    assert _run_streamed(ToolFamily.HERMES, text) == (text, [])


def test_a_fenced_call_after_text_is_read_by_the_hermes_family_with_the_guardrails_only() -> None:
    text = "Here it is:\n" + FENCED_CALL
    assert _run(ToolFamily.HERMES, text, GuardrailConfig(enabled=False)) == (text, [])
    assert _run(ToolFamily.LLAMA3, text, GuardrailConfig()) == (text, [])


def test_a_junk_prefix_is_read_only_with_the_guardrails_on() -> None:
    text = ">" + JUNK_CALL
    assert _run(ToolFamily.HERMES, text, GuardrailConfig(enabled=False)) == (text, [])


def test_no_parser_without_tools() -> None:
    assert make_tool_parser(TEMPLATES["hermes"], [], GuardrailConfig()) is None


@pytest.mark.parametrize("family", list(ToolFamily))
def test_family_from_template(family: ToolFamily) -> None:
    assert detect_family(TEMPLATES[family.value]) is family
    assert detect_family(None) is ToolFamily.HERMES


@pytest.mark.parametrize("marker", ["[TOOL_CALLS]", "<|python_tag|>"])
def test_special_markers_are_single_special_tokens(marker: str) -> None:
    """The corpus pipeline test relies on these being skipped-by-default special tokens."""
    tokenizer = family_tokenizer("mistral")
    ids = tokenizer.encode(marker + "x")
    assert len(ids) == 2 and ids[0] in tokenizer.special_ids
    assert tokenizer.decode(ids) == "x"


def _scrape(url: str) -> dict[str, Any]:
    """/metrics over HTTP, parsed by prometheus_client's own parser: {family name: family}."""
    response = httpx.get(f"{url}/metrics", timeout=30)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    return {f.name: f for f in text_string_to_metric_families(response.text)}


def _value(families: dict[str, Any], family: str, **labels: str) -> float:
    """A counter's value (0 while the label set has not appeared)."""
    for s in families[family].samples:
        if s.name == family + "_total" and s.labels == labels:
            return float(s.value)
    return 0.0


def test_metrics_route_is_prometheus_text() -> None:
    """The tool-call families keep their names, types and label sets, and show every outcome
    at 0 before it happens; an OpenMetrics scraper gets OpenMetrics."""
    with LiveServer([ScriptedChatModel()]) as srv:
        families = _scrape(srv.url)
        openmetrics = httpx.get(
            f"{srv.url}/metrics",
            headers={"accept": "application/openmetrics-text; version=1.0.0"},
            timeout=30,
        )
    for name, label in (
        ("turbospark_tool_calls", "outcome"),
        ("turbospark_tool_call_repairs", "kind"),
        ("turbospark_tool_call_rejects", "reason"),
        ("turbospark_grammar_constrained", "kind"),
    ):
        assert families[name].type == "counter"
        assert all(set(s.labels) == {label} for s in families[name].samples)
    outcomes = {s.labels["outcome"] for s in families["turbospark_tool_calls"].samples}
    assert outcomes == {"ok", "repaired", "returned_as_text"}
    assert openmetrics.status_code == 200
    assert openmetrics.headers["content-type"].startswith("application/openmetrics-text")
    assert openmetrics.text.rstrip().endswith("# EOF")


def repairing_server(raw: str) -> LiveServer:
    """A server replaying `raw`, a call no schema-held decode could write: the repair path, as it
    runs where the call constraint is off (`--no-constrained-calls`). With the constraint on, the
    mask would push the scripted model off its script."""
    registry = ModelRegistry()
    registry.add(ServedModel(ScriptedChatModel([raw]), guardrails=GuardrailConfig(constrain_calls=False)))
    return LiveServer(state=ServerState(registry=registry))


def test_metrics_route_counts_tool_calls() -> None:
    """A repaired call (trailing comma, misspelt name) moves repaired and its repair kinds."""
    raw = '<tool_call>\n{"name": "get_wether", "arguments": {"city": "Paris",},}\n</tool_call>'
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    with repairing_server(raw) as srv:
        before = _scrape(srv.url)
        body = {"model": "scripted", "messages": [{"role": "user", "content": "go"}], "tools": tools}
        reply = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=30).json()
        after = _scrape(srv.url)
    assert reply["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"

    def moved(family: str, **labels: str) -> float:
        return _value(after, family, **labels) - _value(before, family, **labels)

    assert moved("turbospark_tool_calls", outcome="repaired") == 1
    assert moved("turbospark_tool_calls", outcome="ok") == 0
    assert moved("turbospark_tool_call_repairs", kind="json") == 1
    assert moved("turbospark_tool_call_repairs", kind="name") == 1


def test_unrepairable_call_over_http_is_text_and_counted() -> None:
    raw = '<tool_call>\n{"name": "launch_rocket", "arguments": {}}\n</tool_call>'
    before = sample("turbospark_tool_calls_total", outcome="returned_as_text")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    with repairing_server(raw) as srv:
        body = {"model": "scripted", "messages": [{"role": "user", "content": "go"}], "tools": tools}
        choice = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=30).json()["choices"][0]
    assert choice["message"]["content"] == raw and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "stop"
    assert sample("turbospark_tool_calls_total", outcome="returned_as_text") == before + 1
