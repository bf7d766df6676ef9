"""tool_choice auto with the lazy call constraint: text stays free until the model starts a call
(`<tool_call>`, or a bare / fenced `{"name"` at the answer's start); from there the call is held to
a declared tool's name and schema. The scripted model "wants" to write a call to a tool that does
not exist (what Qwen2.5-Coder-0.5B does under Claude Code); the mask leaves it no such path."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from corpus.support import family_tokenizer, summarize, trained_bpe_tokenizer
from turbospark.generate import run_choice
from turbospark.grammar import LazyToolCallProcessor, NoCallProcessor, bare_trigger_state
from turbospark.metrics import LAZY_TRIGGERS, TOOL_STEERING
from turbospark.plan import make_plan
from turbospark.registry import ModelRegistry, ServedModel
from turbospark.request import ChatRequest, Message, Tool, ToolCall, ToolChoice, ToolChoiceMode
from turbospark.scripted import ScriptedChatModel
from turbospark.tokenizer import Tokenizer
from turbospark.toolcalls.guardrails import GuardrailConfig, check_arguments

BASH = Tool(
    "Bash",
    parameters={
        "type": "object",
        "properties": {
            "command": {"type": "string", "maxLength": 40},
            "timeout": {"type": "integer", "minimum": 1, "maximum": 600},
        },
        "required": ["command"],
    },
)
READ = Tool(
    "Read",
    parameters={
        "type": "object",
        "properties": {"file_path": {"type": "string", "maxLength": 40}},
        "required": ["file_path"],
    },
)
TOOLS = {t.name: t for t in (BASH, READ)}
WRONG_FENCED = '```json\n{"name": "deep-research", "arguments": {"prompt": "cat notes.txt"}}\n```'
WRONG_AFTER_JUNK = '>{"name": "deep-research", "arguments": {"prompt": "cat notes.txt"}}'
WRONG_TAGGED = (
    'Let me look.\n<tool_call>\n{"name": "Agent", "arguments": {"prompt": "cat notes.txt"}}\n</tool_call>'
)


def _tokenizers() -> list[Tokenizer]:
    return [family_tokenizer("hermes"), trained_bpe_tokenizer()]


def _run(
    reply: str,
    tokenizer: Tokenizer,
    seed: int,
    guardrails: GuardrailConfig | None = None,
    history: list[Message] | None = None,
) -> dict[str, Any]:
    registry = ModelRegistry()
    registry.add(
        ServedModel(
            ScriptedChatModel([reply], tokenizer=tokenizer), guardrails=guardrails or GuardrailConfig()
        )
    )
    request = ChatRequest(
        model="scripted",
        messages=[Message(role="user", content="Run the shell command: cat notes.txt"), *(history or [])],
        max_tokens=300,
        tools=list(TOOLS.values()),
        tool_choice=ToolChoice(ToolChoiceMode.AUTO),
    )
    request.sampling.temperature = 1.0
    request.sampling.seed = seed
    plan = make_plan(request, registry)
    lazy = [p for p in plan.config.processors if isinstance(p, LazyToolCallProcessor | NoCallProcessor)]
    if guardrails is None or guardrails.constrain_calls:
        assert len(lazy) == 1
    else:
        assert not lazy
    return summarize(asyncio.run(run_choice(plan)))


def _assert_valid_calls(result: dict[str, Any]) -> None:
    assert result["calls"], result
    for call in result["calls"]:
        assert call["name"] in TOOLS, call
        check = check_arguments(call["arguments"], TOOLS[call["name"]].parameters)
        assert not check.errors and not check.coerced, call


@pytest.mark.parametrize("tokenizer", _tokenizers(), ids=["bytes", "bpe"])
def test_a_started_call_to_an_undeclared_tool_becomes_a_valid_call(tokenizer: Tokenizer) -> None:
    before = LAZY_TRIGGERS.labels(form="bare")._value.get()
    for seed in range(8):
        result = _run(WRONG_FENCED, tokenizer, seed)
        _assert_valid_calls(result)
        assert result["text"] == ""
    assert LAZY_TRIGGERS.labels(form="bare")._value.get() - before == 8


@pytest.mark.parametrize("tokenizer", _tokenizers(), ids=["bytes", "bpe"])
def test_a_call_after_a_junk_prefix_becomes_a_valid_call(tokenizer: Tokenizer) -> None:
    """`>{"name": ...}` (what Qwen2.5-Coder-0.5B writes under Codex at times): the constraint
    triggers after the junk, and the parser drops the junk with the call."""
    before = LAZY_TRIGGERS.labels(form="bare")._value.get()
    for seed in range(4):
        result = _run(WRONG_AFTER_JUNK, tokenizer, seed)
        _assert_valid_calls(result)
        assert result["text"] == ""
    assert LAZY_TRIGGERS.labels(form="bare")._value.get() - before == 4


@pytest.mark.parametrize("tokenizer", _tokenizers(), ids=["bytes", "bpe"])
def test_json_after_prose_or_a_long_prefix_stays_text(tokenizer: Tokenizer) -> None:
    before = LAZY_TRIGGERS.labels(form="bare")._value.get()
    good = '{"name": "Bash", "arguments": {"command": "ls"}}'
    for prefix in ("Sure: ", "e.g. ", "a>", ">>>> ", ">" + " " * 9):
        assert _run(prefix + good, tokenizer, 0) == {"text": prefix + good, "reasoning": "", "calls": []}
    assert LAZY_TRIGGERS.labels(form="bare")._value.get() == before


@pytest.mark.parametrize("tokenizer", _tokenizers(), ids=["bytes", "bpe"])
def test_a_fenced_call_after_text_becomes_a_valid_call(tokenizer: Tokenizer) -> None:
    """What qwen2.5-coder:1.5b writes under Claude Code at times: a sentence, then the call in a
    JSON code fence. The fence starts the call grammar; the sentence stays text."""
    before = LAZY_TRIGGERS.labels(form="fence")._value.get()
    wrong_args = '```json\n{"name": "Read", "arguments": {"path": "notes.txt", "lines": "all"}}\n```'
    for seed in range(4):
        result = _run("To read it, use this tool:\n\n" + wrong_args, tokenizer, seed)
        _assert_valid_calls(result)
        assert result["text"] == "To read it, use this tool:"
    assert LAZY_TRIGGERS.labels(form="fence")._value.get() - before == 4


@pytest.mark.parametrize("tokenizer", _tokenizers(), ids=["bytes", "bpe"])
def test_code_fences_after_text_that_open_no_call_stay_free(tokenizer: Tokenizer) -> None:
    before = LAZY_TRIGGERS.labels(form="fence")._value.get()
    for reply in (
        "Run this:\n\n```python\nprint('hi')\n```\n\nIt prints hi.",
        'The file holds:\n\n```json\n{"port": 8080}\n```',
        'A package.json:\n\n```json\n{"name": "my-app", "version": "1.0.0"}\n```',
        "Call it so:\n\n" + WRONG_FENCED,  # after text, only a declared tool's name starts a call
        "Here: ```bash\nls\n``` and more `code`.",
    ):
        assert _run(reply, tokenizer, 0) == {"text": reply, "reasoning": "", "calls": []}
    assert LAZY_TRIGGERS.labels(form="fence")._value.get() == before


@pytest.mark.parametrize("tokenizer", _tokenizers(), ids=["bytes", "bpe"])
def test_text_before_a_tagged_call_stays_free(tokenizer: Tokenizer) -> None:
    for seed in range(8):
        result = _run(WRONG_TAGGED, tokenizer, seed)
        assert result["text"] == "Let me look."
        _assert_valid_calls(result)


@pytest.mark.parametrize("tokenizer", _tokenizers(), ids=["bytes", "bpe"])
def test_free_text_and_valid_calls_come_out_as_written(tokenizer: Tokenizer) -> None:
    prose = "The file says hello. {not a call} and ```code``` stay text."
    assert _run(prose, tokenizer, 0) == {"text": prose, "reasoning": "", "calls": []}
    fenced_python = "```python\nprint({'name': 1})\n```"
    assert _run(fenced_python, tokenizer, 0)["text"] == fenced_python
    good = '{"name": "Bash", "arguments": {"command": "cat notes.txt"}}'
    result = _run(good, tokenizer, 0)
    assert result["text"] == ""
    assert [(c["name"], c["arguments"]) for c in result["calls"]] == [("Bash", {"command": "cat notes.txt"})]


def _tagged(name: str, arguments: dict[str, Any]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


@pytest.mark.parametrize("tokenizer", _tokenizers(), ids=["bytes", "bpe"])
def test_a_call_written_again_ends_the_answer(tokenizer: Tokenizer) -> None:
    """The scripted model repeats its call (what a 0.5B model can do under parallel calls until
    max_tokens): the answer ends once a call closes as an earlier one did; different calls in one
    answer all come through."""
    cat = _tagged("Bash", {"command": "cat notes.txt"})
    result = _run("\n".join([cat] * 5), tokenizer, 0)
    assert [(c["name"], c["arguments"]) for c in result["calls"]] == [
        ("Bash", {"command": "cat notes.txt"})
    ] * 2
    two = "\n".join([cat, _tagged("Read", {"file_path": "notes.txt"}), _tagged("Bash", {"command": "ls"})])
    result = _run(two, tokenizer, 0)
    assert [c["name"] for c in result["calls"]] == ["Bash", "Read", "Bash"]
    _assert_valid_calls(result)


def test_off_leaves_the_call_to_the_guardrails() -> None:
    """`--no-constrained-calls`: the undeclared tool's call comes back as text, as before."""
    result = _run(WRONG_FENCED, family_tokenizer("hermes"), 0, GuardrailConfig(constrain_calls=False))
    assert result["calls"] == [] and "deep-research" in result["text"]


@pytest.mark.parametrize(
    ("text", "state"),
    [
        ("", None),
        ("  \n", None),
        ("`", None),
        ("```js", None),
        ("```json\n", None),
        ("```json\n{", None),
        ('```json\n{ "na', None),
        ('```json\n{"name"', True),
        ('{"name"', True),
        ('\n{\n  "name": "Bash"', True),
        ("```python\n", False),
        ('{"command"', False),
        ("Sure", False),
        ("[", False),
        (">", None),
        ("- * ", None),
        ("``", None),
        ('>{"name"', True),
        ('> {\n "na', None),
        ('>\n{"name"', True),
        ('- * {"name"', True),
        ('``{"name"', True),
        ('` ``{"name"', True),
        ('>{"command"', False),
        ('>>>>{"name"', False),
        ('a>{"name"', False),
        ("> Note", False),
        (">" + " " * 9 + "{", False),
        ("```{", None),  # a fence's first line, still open: the fence rule decides
    ],
)
def test_bare_trigger_state(text: str, state: bool | None) -> None:
    assert bare_trigger_state(text) is state


def test_default_seed_applies_only_when_the_request_sets_none() -> None:
    """`--seed`: Claude Code sends no seed; the served model's default makes its turns repeatable."""
    registry = ModelRegistry()
    registry.add(ServedModel(ScriptedChatModel(["hi"]), default_seed=7))
    request = ChatRequest(model="scripted", messages=[Message(role="user", content="hi")], max_tokens=5)
    assert make_plan(request, registry).config.seed == 7
    request.sampling.seed = 3
    assert make_plan(request, registry).config.seed == 3


def _called(
    name: str, arguments: str, call_id: str, result: str = "Error: notes.txt: denied"
) -> list[Message]:
    """An assistant turn that called `name`, and the tool result that came back."""
    return [
        Message(role="assistant", tool_calls=[ToolCall(call_id, name, arguments)]),
        Message(role="tool", content=result, tool_call_id=call_id, name=name),
    ]


@pytest.mark.parametrize("tokenizer", _tokenizers(), ids=["bytes", "bpe"])
def test_a_call_made_twice_alike_cannot_start_a_third_time(tokenizer: Tokenizer) -> None:
    """The model called Bash with the same command twice, and the same error came back; it writes
    that call again: the call grammar no longer offers Bash, so the call it starts becomes one to
    another declared tool (here Read, the only other). With Read failing twice alike too, or once
    a repeated call's good result is in view, no call may start at all: the reply is text."""
    cat = '{"command": "cat notes.txt"}'
    same = _called("Bash", cat, "a") + _called("Bash", cat.replace(": ", ":"), "b")
    again = '<tool_call>\n{"name": "Bash", "arguments": {"command": "cat notes.txt"}}\n</tool_call>'
    before = TOOL_STEERING.labels(kind="repeat")._value.get()
    for seed in range(4):
        result = _run(again, tokenizer, seed, history=same)
        _assert_valid_calls(result)
        assert [c["name"] for c in result["calls"]] == ["Read"], result
    assert TOOL_STEERING.labels(kind="repeat")._value.get() - before == 4
    # two different commands, or the same one with another result: Bash stays callable
    for history in (
        _called("Bash", '{"command": "ls"}', "a") + _called("Bash", cat, "b"),
        same[:2] + _called("Bash", cat, "c", result="notes: changed"),
    ):
        result = _run(again, tokenizer, 0, history=history)
        assert [c["name"] for c in result["calls"]] == ["Bash"], result
    read = '{"file_path": "notes.txt"}'
    stuck = same + _called("Read", read, "c") + _called("Read", read, "d")
    answered = _called("Bash", cat, "e", "notes: hello") + _called("Bash", cat, "f", "notes: hello")
    for history in (stuck, answered):
        result = _run(again, tokenizer, 0, history=history)
        assert not result["calls"] and not result["text"].lstrip().startswith(("<", "{", "`")), result
