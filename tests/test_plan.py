"""The plan step on its own: policy, reasoning, prefill, tool_choice and the context check."""

from __future__ import annotations

import pytest

from turbospark.backend import ReasoningEffort
from turbospark.errors import ApiError
from turbospark.plan import THINKING_BUDGETS, Plan, make_plan
from turbospark.registry import ModelRegistry, ServedModel
from turbospark.request import ChatRequest, Message, Tool, ToolChoice, ToolChoiceMode
from turbospark.scripted import ScriptedChatModel

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
    assert p.config.max_new_tokens == CONTEXT - len(p.prompt_ids)
    assert plan(max_tokens=5).config.max_new_tokens == 5
    too_long = refusal(messages=[Message("user", "x" * CONTEXT)])
    assert "does not fit" in too_long.message and str(CONTEXT) in too_long.message
    assert "does not fit" in refusal(prefill="y" * CONTEXT).message


def test_served_model_names_include_the_claude_code_alias() -> None:
    reg = registry()
    assert reg.resolve("claude-turbospark-scripted") is reg.resolve("scripted:latest")
