"""The plan step on its own: policy, reasoning, prefill, tool_choice, sampling defaults and the
context check."""

from __future__ import annotations

import pytest

from turbospark.api import anthropic as anthropic_api
from turbospark.api import ollama as ollama_api
from turbospark.api import openai as openai_api
from turbospark.api import responses as responses_api
from turbospark.backend import (
    BUILTIN_SAMPLING,
    NEVER_CANCEL,
    NO_SAMPLING_DEFAULTS,
    FinishReason,
    GenerationConfig,
    ModelDetails,
    ReasoningEffort,
    SamplingDefaults,
)
from turbospark.cli import brief_tools, focus_tools
from turbospark.errors import ApiError
from turbospark.plan import (
    AGENT_CORE_TOOLS,
    FOCUS_TEMPERATURE,
    REPEAT_WINDOW,
    THINKING_BUDGETS,
    Plan,
    brief_text,
    make_plan,
    repeated_calls,
    tool_guide,
)
from turbospark.registry import ModelRegistry, ServedModel
from turbospark.request import (
    ChatRequest,
    Message,
    SamplingParams,
    Tool,
    ToolCall,
    ToolChoice,
    ToolChoiceMode,
)
from turbospark.scripted import ScriptedChatModel
from turbospark.toolcalls.guardrails import GuardrailConfig

WEATHER = Tool("get_weather", "Weather for a city")
CONTEXT = 2048


def registry(**policy: object) -> ModelRegistry:
    reg = ModelRegistry()
    reg.add(ServedModel(ScriptedChatModel(max_context=CONTEXT), **policy))  # type: ignore[arg-type]
    return reg


def plan(reg: ModelRegistry | None = None, **fields: object) -> Plan:
    messages = fields.pop("messages", [Message("user", "hi")])
    request = ChatRequest(model="scripted", messages=messages, **fields)  # type: ignore[arg-type]
    return make_plan(request, reg or registry())


def refusal(reg: ModelRegistry | None = None, **fields: object) -> ApiError:
    with pytest.raises(ApiError) as info:
        plan(reg, **fields)
    assert info.value.status == 400
    return info.value


def test_default_system_prompt_only_when_the_request_has_none() -> None:
    reg = registry(default_system="Be brief.")
    assert "Be brief." in plan(reg).prompt_text
    own = plan(reg, messages=[Message("developer", "Be long."), Message("user", "hi")]).prompt_text
    assert "Be long." in own and "Be brief." not in own


def test_tool_prompt_follows_the_system_prompt_only_when_tools_are_declared() -> None:
    reg = registry(tool_prompt="Call one tool at a time.", default_system="Be brief.")
    with_tools = plan(reg, tools=[WEATHER]).prompt_text
    assert "Be brief.\n\nCall one tool at a time." in with_tools
    assert with_tools.index("Call one tool at a time.") < with_tools.index("get_weather")
    assert "Call one tool at a time." not in plan(reg).prompt_text
    own = plan(reg, tools=[WEATHER], messages=[Message("system", "Be long."), Message("user", "hi")])
    assert "Be long.\n\nCall one tool at a time." in own.prompt_text and "Be brief." not in own.prompt_text
    none = ToolChoice(mode=ToolChoiceMode.NONE)
    assert "Call one tool at a time." not in plan(reg, tools=[WEATHER], tool_choice=none).prompt_text


LONG_TOOL = Tool(
    "run_shell",
    "# run_shell\n\nRuns a shell command and returns its output. The working directory persists "
    "between calls.\n\nUsage notes:\n- Quote paths that contain spaces.\n- Never run interactive "
    "commands.",
    {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "properties": {
            "command": {"type": "string", "description": "The command to run. It runs in bash.\n\nMore."},
            "description": {"type": "string", "description": "What the command does, in five words."},
        },
        "required": ["command"],
    },
)


def test_brief_tool_descriptions_cut_what_the_model_reads_not_what_calls_are_held_to() -> None:
    full = plan(registry(), tools=[LONG_TOOL])
    brief = plan(registry(brief_tools=True), tools=[LONG_TOOL])
    assert "Usage notes" in full.prompt_text and "Usage notes" not in brief.prompt_text
    assert "Runs a shell command and returns its output. The working directory persists" in brief.prompt_text
    assert "More." not in brief.prompt_text and "draft/2020-12" not in brief.prompt_text
    # the parameter named "description" is kept as a parameter; its own description is cut to its lead
    assert '"description": {"type": "string", "description": "What the command does, in five words."}' in (
        brief.prompt_text
    )
    assert '"required": ["command"]' in brief.prompt_text
    # the grammar and the validation see the tool as declared
    assert brief.tools == [LONG_TOOL]
    assert len(brief.prompt_text) < len(full.prompt_text)


class SizedModel(ScriptedChatModel):
    def __init__(self, num_parameters: int) -> None:
        super().__init__(max_context=CONTEXT)
        self.num_parameters = num_parameters

    def details(self) -> ModelDetails:
        return ModelDetails(num_parameters=self.num_parameters)


def test_auto_tool_descriptions_are_brief_for_small_models_only() -> None:
    small, large, unknown = SizedModel(494_000_000), SizedModel(7_600_000_000), SizedModel(0)
    assert [brief_tools("auto", m) for m in (small, large, unknown)] == [True, False, False]
    assert brief_tools("brief", large) and not brief_tools("full", small)


AGENT_TOOLS = [
    Tool(name, f"The {name} tool.") for name in ("Agent", "Bash", "CronCreate", "Edit", "Read")
] + [Tool(f"Extra{i}", f"Extra tool {i}.") for i in range(6)]


def test_tool_focus_narrows_what_the_model_reads_and_may_start() -> None:
    focused = plan(registry(focus_tools=AGENT_CORE_TOOLS), tools=AGENT_TOOLS)
    names = [t.name for t in focused.call_tools]
    assert names == ["Bash", "Edit", "Read"]
    assert "The Read tool." in focused.prompt_text and "The Agent tool." not in focused.prompt_text
    assert "Extra tool 0." not in focused.prompt_text
    assert focused.tools == AGENT_TOOLS  # a call to any declared tool is still read and validated
    # off, few tools, or fewer than two of the named ones declared: the model reads them all
    assert plan(registry(), tools=AGENT_TOOLS).call_tools == AGENT_TOOLS
    few = AGENT_TOOLS[:5]
    assert plan(registry(focus_tools=AGENT_CORE_TOOLS), tools=few).call_tools == few
    one = [AGENT_TOOLS[1], *AGENT_TOOLS[5:], Tool("Other", "x"), Tool("More", "y")]
    assert plan(registry(focus_tools=AGENT_CORE_TOOLS), tools=one).call_tools == one


def test_a_focused_tool_list_comes_with_a_guide_unless_the_server_has_a_tool_prompt() -> None:
    guide = "Use Read to read a file, Bash to run a command and Edit to change a file."
    focused = plan(registry(focus_tools=AGENT_CORE_TOOLS), tools=AGENT_TOOLS).prompt_text
    assert guide in focused and focused.index(guide) < focused.index("The Bash tool.")
    assert "Use Read" not in plan(registry(), tools=AGENT_TOOLS).prompt_text  # not focused: no guide
    own = plan(
        registry(focus_tools=AGENT_CORE_TOOLS, tool_prompt="Be careful."), tools=AGENT_TOOLS
    ).prompt_text
    assert "Be careful." in own and "Use Read" not in own
    assert tool_guide([Tool("shell", ""), Tool("apply_patch", ""), Tool("update_plan", "")]) == (
        "Use shell to run a command and apply_patch to change a file. "
        "When a tool result arrives, answer the user with what it says."
    )
    assert tool_guide([Tool("Bash", ""), Tool("Agent", "")]) is None


def test_a_focused_conversation_is_rendered_for_a_small_model() -> None:
    reminder = "<system-reminder>\nToday's date is 2026-12-07.\n</system-reminder>\n\n"
    messages = [
        Message("system", "You are an agent."),
        Message("user", reminder + "What port does config.ini set?"),
        Message("system", "Available agent types for the Agent tool: Explore, Plan."),
        Message("system", "Keep answers short."),
        Message("assistant", tool_calls=[ToolCall("1", "Read", '{"file_path": "config.ini"}')]),
        Message("tool", "1\t[server]\n2\tport = 48213\n3\t", tool_call_id="1", name="Read"),
    ]
    focused = plan(registry(focus_tools=AGENT_CORE_TOOLS), tools=AGENT_TOOLS, messages=messages)
    text = focused.prompt_text
    assert "Available agent types" not in text and "Keep answers short." in text
    assert "system-reminder" not in text and "Today's date" not in text
    assert "[server]\nport = 48213\n" in text and "1\t[server]" not in text
    assert text.index("port = 48213") < text.index("(The user asked: What port does config.ini set?)")
    assert focused.config.temperature == FOCUS_TEMPERATURE
    assert focused.echo_stops == ("(The user asked:",)  # a reply that repeats the line ends there
    assert messages[1].content.startswith("<system-reminder>")  # the request itself is untouched
    # a request's own temperature stands; so does everything when the tools are not focused (few)
    sent = plan(
        registry(focus_tools=AGENT_CORE_TOOLS),
        tools=AGENT_TOOLS,
        messages=messages,
        sampling=SamplingParams(temperature=0.9),
    )
    assert sent.config.temperature == 0.9
    whole = plan(registry(focus_tools=AGENT_CORE_TOOLS), tools=AGENT_TOOLS[:5], messages=messages)
    assert "Available agent types" in whole.prompt_text and "1\t[server]" in whole.prompt_text
    assert "system-reminder" in whole.prompt_text and "(The user asked" not in whole.prompt_text
    assert whole.echo_stops == ()
    assert whole.config.temperature != FOCUS_TEMPERATURE
    # a result that is not cat -n shaped keeps its digits; a later turn is not reminded again
    later = [*messages, Message("assistant", "48213"), Message("user", "Thanks")]
    ls = Message("tool", "12 files\nsrc", tool_call_id="1", name="Bash")
    kept = plan(
        registry(focus_tools=AGENT_CORE_TOOLS), tools=AGENT_TOOLS, messages=[*later[:5], ls, *later[6:]]
    ).prompt_text
    assert "12 files\nsrc" in kept and "(The user asked" not in kept


def test_tool_focus_is_the_agent_core_for_small_models_by_default() -> None:
    small, large = SizedModel(494_000_000), SizedModel(7_600_000_000)
    assert focus_tools("auto", small) == AGENT_CORE_TOOLS and focus_tools("auto", large) == ()
    assert focus_tools("off", small) == () and focus_tools("Bash, Read", large) == ("Bash", "Read")


def _turn(name: str, arguments: str, result: str = "result", call_id: str = "c") -> list[Message]:
    return [
        Message("assistant", tool_calls=[ToolCall(call_id, name, arguments)]),
        Message("tool", result, tool_call_id=call_id, name=name),
    ]


def test_repeated_calls_are_the_same_call_with_the_same_result() -> None:
    user = [Message("user", "go")]
    ls = _turn("Bash", '{"command": "ls"}', call_id="1")
    pwd = _turn("Bash", '{"command": "pwd"}', call_id="2")
    ls_again = _turn("Bash", '{ "command" : "ls" }', call_id="3")
    assert repeated_calls(user + ls + ls_again) == {"Bash": False}
    assert repeated_calls(user + ls + pwd + [Message("assistant", "It lists files.")] + ls_again) == {
        "Bash": False
    }
    failed = _turn("Read", '{"file_path": "/x"}', "Error: no such file", call_id="4")
    assert repeated_calls(user + failed + ls + failed) == {"Read": True}
    assert repeated_calls(user + ls) == {}
    assert repeated_calls(user + ls + pwd) == {}
    assert repeated_calls(user + _turn("Read", '{"a": 1}', call_id="1") + _turn("Bash", '{"a": 1}')) == {}
    # the same command with another result (a test run again after an edit) is no repeat
    assert repeated_calls(user + ls + _turn("Bash", '{"command": "ls"}', "changed", call_id="3")) == {}
    # a call whose result has not come back (the last turn is a prefill) is not counted
    assert repeated_calls([*user, *ls, *ls_again[:1]]) == {}
    # only the last REPEAT_WINDOW assistant turns are looked at
    far = user + ls + [Message("assistant", f"step {i}") for i in range(REPEAT_WINDOW)] + ls_again
    assert repeated_calls(far) == {}


def test_tools_called_twice_alike_leave_the_calls_the_model_may_start() -> None:
    def twice(result: str) -> list[Message]:
        return [
            Message("user", "go"),
            *_turn("Bash", '{"command": "ls"}', result, call_id="1"),
            *_turn("Bash", '{"command": "ls"}', result, call_id="2"),
        ]

    reg = registry(focus_tools=AGENT_CORE_TOOLS)
    failing = plan(reg, tools=AGENT_TOOLS, messages=twice("Error: exit 2"))
    assert [t.name for t in failing.call_tools] == ["Edit", "Read"] and failing.tools == AGENT_TOOLS
    assert "The Bash tool." in failing.prompt_text  # the model still reads it: the prompt's prefix is kept
    # the same good result twice: the model has what it needs, and answers
    assert plan(reg, tools=AGENT_TOOLS, messages=twice("a.txt")).call_tools == []
    answers = plan(reg, tools=AGENT_TOOLS, messages=twice("a.txt"))
    assert answers.calls_closed and not failing.calls_closed
    # tool_choice required must still end in a call the parser reads, and with the call grammar
    # off (--no-constrained-calls) nothing is narrowed: the guard is the grammar's
    required = ToolChoice(ToolChoiceMode.REQUIRED)
    for p in (
        plan(reg, tools=AGENT_TOOLS, messages=twice("a.txt"), tool_choice=required),
        plan(
            registry(focus_tools=AGENT_CORE_TOOLS, guardrails=GuardrailConfig(constrain_calls=False)),
            tools=AGENT_TOOLS,
            messages=twice("a.txt"),
        ),
    ):
        assert [t.name for t in p.call_tools] == ["Bash", "Edit", "Read"] and not p.calls_closed


@pytest.mark.parametrize(
    ("text", "limit", "lead"),
    [
        ("Reads a file.\n\nDetails follow.", 100, "Reads a file."),
        ("# Heading\n\nSends a message.", 100, "Sends a message."),
        ("- Stops a task by its ID\n- Takes a task_id", 100, "Stops a task by its ID"),
        ("A wrapped\nparagraph.", 100, "A wrapped paragraph."),
        ("First sentence. Second sentence is long.", 20, "First sentence."),
        ("Usage: call it with care and nothing else", 20, "Usage: call it with..."),
        ("", 10, ""),
    ],
)
def test_brief_text_takes_a_descriptions_lead(text: str, limit: int, lead: str) -> None:
    assert brief_text(text, limit) == lead


def test_reasoning_effort_resolution() -> None:
    high = registry(default_reasoning=ReasoningEffort.HIGH)
    assert plan().reasoning is ReasoningEffort.OFF
    assert plan(high).reasoning is ReasoningEffort.HIGH
    assert plan(high, reasoning_effort=ReasoningEffort.LOW).reasoning is ReasoningEffort.LOW
    # thinking asked for without a level: the model's default, or medium when that is off
    assert plan(thinking_on=True).reasoning is ReasoningEffort.MEDIUM
    assert plan(high, thinking_on=True).reasoning is ReasoningEffort.HIGH
    # a budget picks the level when none is named, and is kept as the budget
    assert (plan(thinking_budget=1024).reasoning, plan(thinking_budget=5000).reasoning) == (
        ReasoningEffort.LOW,
        ReasoningEffort.HIGH,
    )
    assert plan(thinking_budget=5000).thinking_budget == 5000
    assert (
        plan(reasoning_effort=ReasoningEffort.MEDIUM).thinking_budget
        == THINKING_BUDGETS[ReasoningEffort.MEDIUM]
    )


def test_prefill_is_continued_outside_any_think_block() -> None:
    p = plan(registry(default_reasoning=ReasoningEffort.HIGH), prefill='{"a": ')
    assert p.prompt_text.endswith('<|im_start|>assistant\n<think>\n\n</think>\n\n{"a": ')
    assert p.reasoning is ReasoningEffort.OFF and not p.start_in_reasoning
    assert p.prompt_ids == p.backend.tokenizer.encode(p.prompt_text, add_special_tokens=False)
    assert p.config.max_new_tokens == CONTEXT - len(p.prompt_ids)
    assert "prefill" in refusal(prefill="x", thinking_on=True).message


def test_tool_choice_policy() -> None:
    assert plan(tools=[WEATHER], tool_choice=ToolChoice(ToolChoiceMode.NONE)).tools == []
    assert "get_weather" not in plan(tools=[WEATHER], tool_choice=ToolChoice(ToolChoiceMode.NONE)).prompt_text
    assert plan(tools=[WEATHER]).tools == [WEATHER]
    required = ToolChoice(ToolChoiceMode.REQUIRED, where="tool_choice.type", as_written="any")
    assert refusal(tool_choice=required).message == "'tool_choice.type' is 'any' but the request has no tools"
    unknown = refusal(tools=[WEATHER], tool_choice=ToolChoice(ToolChoiceMode.NAMED, "nope"))
    assert "'nope' is not one of the declared tools" in unknown.message
    # the request alone decides this: refused before the model is looked up
    assert "no tools" in refusal(ModelRegistry(), tool_choice=ToolChoice(ToolChoiceMode.REQUIRED)).message


def test_context_is_checked_once_and_max_tokens_capped() -> None:
    p = plan(max_tokens=10_000)
    # the plan passes max_tokens as asked; the one cap is `GenerationConfig.budget`, applied
    # where the tokens are made
    assert p.config.max_new_tokens == 10_000
    assert p.config.budget(len(p.prompt_ids), CONTEXT) == CONTEXT - len(p.prompt_ids)
    assert plan(max_tokens=5).config.max_new_tokens == 5
    assert plan().config.max_new_tokens == CONTEXT - len(plan().prompt_ids)  # none asked: the room left
    too_long = refusal(messages=[Message("user", "x" * CONTEXT)])
    assert "does not fit" in too_long.message and str(CONTEXT) in too_long.message
    assert "does not fit" in refusal(prefill="y" * CONTEXT).message


def test_a_max_tokens_beyond_the_context_runs_to_the_context_and_says_length() -> None:
    reg = ModelRegistry()
    backend = ScriptedChatModel(["z" * 200], max_context=64)
    reg.add(backend)
    p = make_plan(ChatRequest(model="scripted", messages=[Message("user", "hi")], max_tokens=10_000), reg)
    result = backend.run_completion(p.prompt_ids, p.config, None, NEVER_CANCEL, lambda e: None)
    assert len(result.token_ids) == 64 - len(p.prompt_ids) > 0
    assert result.finish_reason is FinishReason.LENGTH


def test_served_model_names_include_the_claude_code_alias() -> None:
    reg = registry()
    assert reg.resolve("claude-turbospark-scripted") is reg.resolve("scripted:latest")


# ---------------------------------------------------------------- sampling defaults

QWEN_LIKE = SamplingDefaults(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05, source="model")


def sampled(config: GenerationConfig) -> tuple[float, float, int, float, float]:
    return (config.temperature, config.top_p, config.top_k, config.min_p, config.repetition_penalty)


def test_unset_sampling_takes_the_builtin_defaults() -> None:
    # the scripted model recommends nothing: llama.cpp's truncation, temperature 1.0
    assert ScriptedChatModel().sampling_defaults().is_empty()
    assert sampled(plan().config) == (1.0, 0.95, 40, 0.05, 1.0)


def test_no_defaults_is_plain_temperature_sampling() -> None:
    reg = registry(sampling=NO_SAMPLING_DEFAULTS)
    assert sampled(plan(reg).config) == (1.0, 1.0, 0, 0.0, 1.0)


def test_the_models_values_lie_over_the_builtin_ones() -> None:
    layered = QWEN_LIKE.over(BUILTIN_SAMPLING)
    assert (layered.temperature, layered.top_p, layered.top_k, layered.min_p) == (0.7, 0.8, 20, 0.05)
    assert layered.repetition_penalty == 1.05 and layered.source == "model over built-in"
    assert sampled(plan(registry(sampling=layered)).config) == (0.7, 0.8, 20, 0.05, 1.05)


def test_a_partial_default_leaves_the_rest_off() -> None:
    reg = registry(sampling=SamplingDefaults(top_k=20))
    assert sampled(plan(reg).config) == (1.0, 1.0, 20, 0.0, 1.0)


def test_request_values_are_used_as_sent_including_off_values() -> None:
    reg = registry(sampling=QWEN_LIKE.over(BUILTIN_SAMPLING))
    off = SamplingParams(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0)
    config = plan(reg, sampling=off).config
    assert sampled(config) == (0.0, 1.0, 0, 0.0, 1.0) and config.is_greedy
    some = SamplingParams(temperature=1.0, top_k=5)
    assert sampled(plan(reg, sampling=some).config) == (1.0, 0.8, 5, 0.05, 1.05)


def test_each_api_leaves_absent_and_null_fields_to_the_model() -> None:
    """The real parsers: absent and null are unset; explicit values (off ones too) are kept."""
    reg = registry(sampling=QWEN_LIKE.over(BUILTIN_SAMPLING))
    model = QWEN_LIKE.over(BUILTIN_SAMPLING)
    defaults = (model.temperature, model.top_p, model.top_k, model.min_p, model.repetition_penalty)
    messages = [{"role": "user", "content": "hi"}]

    def openai_config(**fields: object) -> GenerationConfig:
        request, _ = openai_api.parse_chat_request({"model": "scripted", "messages": messages, **fields})
        return make_plan(request, reg).config

    assert sampled(openai_config()) == defaults
    nulls = dict.fromkeys(("temperature", "top_p", "top_k", "min_p", "repetition_penalty"))
    assert sampled(openai_config(**nulls)) == defaults
    sent = openai_config(temperature=1, top_p=1, top_k=-1, min_p=0, repetition_penalty=1)
    assert sampled(sent) == (1.0, 1.0, 0, 0.0, 1.0)

    anthropic_body = {"model": "scripted", "max_tokens": 5, "messages": messages}
    request = anthropic_api.parse_messages_request(anthropic_body)
    assert sampled(make_plan(request, reg).config) == defaults
    request = anthropic_api.parse_messages_request({**anthropic_body, "top_k": 0, "temperature": 0})
    assert sampled(make_plan(request, reg).config) == (0.0, 0.8, 0, 0.05, 1.05)

    request, _ = ollama_api.parse_chat_request({"model": "scripted", "messages": messages})
    assert sampled(make_plan(request, reg).config) == defaults
    options = {"top_k": -1, "repeat_penalty": 0, "min_p": 0, "top_p": 1, "temperature": 0.2}
    request, _ = ollama_api.parse_chat_request(
        {"model": "scripted", "messages": messages, "options": options}
    )
    assert sampled(make_plan(request, reg).config) == (0.2, 1.0, 0, 0.0, 1.0)

    request = responses_api.parse_request({"model": "scripted", "input": "hi", "top_p": None})
    assert sampled(make_plan(request, reg).config) == defaults
