"""The plan step: the one place every request passes through between wire format and engine.

Here, and nowhere else, a `ChatRequest` meets the served model's policy (`registry.ServedModel`):

- the model is resolved; one that cannot generate (an embedding model: no `ChatModel`) is a 400
  naming it, and images are refused by name when it has no vision tower;
- the tool_choice policy holds: `none` drops the tools, `required` needs tools, a named tool must
  be declared;
- the reasoning effort is resolved: a level the caller named, else one picked from the caller's
  thinking budget, else the model's default (thinking asked for without a level: the default,
  or medium when the default is off); an assistant prefill turns thinking off, and a prefill
  together with thinking asked for is a 400;
- the default system prompt is added (only when the request has no system or developer message);
- the chat template is rendered (or a raw prompt taken), the prefill appended, the prompt
  encoded once and counted against the context (too long is a 400, never a truncation; a
  max_tokens beyond what the context leaves is capped where the tokens are made, see
  `GenerationConfig.budget`);
- the sampler settings are resolved (`resolve_sampling`): a value the request sets is used as
  set; one it leaves unset takes the served model's default (`ServedModel.sampling`: the model's
  generation_config.json or GGUF `general.sampling.*`, else the built-in llama.cpp-like
  truncation, or none under `--sampling-defaults none`);
- the token-level `GenerationConfig` is built, with the logits processors of `grammar.py`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from typing import Any

from turbospark.backend import (
    NO_SAMPLING_DEFAULTS,
    ChatModel,
    GenerationConfig,
    ReasoningEffort,
    SamplingDefaults,
)
from turbospark.chat_template import CHATML_TEMPLATE, ChatTemplateError, render_chat_template
from turbospark.errors import invalid
from turbospark.grammar import processors_for_plan
from turbospark.limits import check_images, check_prompt_tokens, check_request
from turbospark.metrics import TOOL_STEERING
from turbospark.registry import ModelRegistry
from turbospark.request import ChatRequest, Message, SamplingParams, Tool, ToolChoiceMode
from turbospark.toolcalls.guardrails import GuardrailConfig

# Reasoning tokens allowed per effort level when the caller gives no explicit budget.
THINKING_BUDGETS = {ReasoningEffort.LOW: 512, ReasoningEffort.MEDIUM: 2048, ReasoningEffort.HIGH: 8192}


@dataclass(slots=True)
class Plan:
    backend: ChatModel
    request: ChatRequest
    prompt_text: str
    prompt_ids: list[int]
    config: GenerationConfig
    reasoning: ReasoningEffort
    chat_template: str | None
    tools: list[Tool]  # the tools the reply may call (none under tool_choice "none")
    guardrails: GuardrailConfig
    # what a call started under tool_choice auto is held to (`grammar.lazy_processor_for_plan`):
    # the tools the model read (`focus_tools`), less those it called twice alike with the same
    # error (`repeated_calls`); none (while tools are declared: the reply may open no call) once
    # it repeated a call whose good result it already has
    call_tools: list[Tool] = field(default_factory=list)
    start_in_reasoning: bool = False  # the generation prompt opened a think block
    has_reasoning_markup: bool = False  # the model can emit <think> at all
    thinking_budget: int | None = None
    # text the server added to the prompt that the reply must not repeat (`focused_messages`'
    # reminder): the reply ends where it starts, as a plain end, not the client's stop sequence
    echo_stops: tuple[str, ...] = ()

    @property
    def calls_closed(self) -> bool:
        """Tools are declared but none may be called now: the reply is read as text only."""
        return bool(self.tools) and not self.call_tools

    def config_for_choice(self, index: int) -> GenerationConfig:
        """A fresh config per choice: choices of one seeded request differ but reproduce."""
        seed = None if self.config.seed is None else self.config.seed + index
        # Processors hold one sequence's state: each choice gets fresh copies of them.
        processors = [getattr(p, "fork", lambda p=p: p)() for p in self.config.processors]
        return replace(self.config, seed=seed, processors=processors)


def template_messages(messages: list[Message], *, as_parts: bool = False) -> list[dict[str, Any]]:
    """Internal messages as the OpenAI-shaped dicts Hugging Face chat templates expect; with
    `as_parts` (a vision model, whose template reads `content[0].type`) every content is a list of
    parts, images first."""
    out: list[dict[str, Any]] = []
    for m in messages:
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.content}
        if m.images or as_parts:
            parts: list[dict[str, Any]] = [{"type": "image"} for _ in m.images]
            parts.append({"type": "text", "text": m.content})
            d["content"] = parts
        if m.tool_calls:
            d["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": _args_obj(c.arguments)},
                }
                for c in m.tool_calls
            ]
        if m.role == "tool":
            if m.tool_call_id:
                d["tool_call_id"] = m.tool_call_id
            if m.name:
                d["name"] = m.name
        if m.reasoning:
            d["reasoning_content"] = m.reasoning
        out.append(d)
    return out


_PART_TYPE = re.compile(r"""\[\s*['"]type['"]\s*\]|\.type\b""")


def reads_parts(template: str) -> bool:
    """Whether a chat template reads content parts (`line['type']`): a vision model's, such as
    SmolVLM's, which reads `content[0]['type']` of every message, text-only ones too."""
    return _PART_TYPE.search(template) is not None


def _args_obj(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def template_tools(tools: list[Tool], *, brief: bool = False) -> list[dict[str, Any]]:
    """The tools as chat templates take them; `brief` (`serve --tool-descriptions brief`) cuts every
    description to its lead (`brief_text`), the tool's and its parameters'."""
    return [
        {
            "type": "function",
            "function": {
                "name": t.name,
                "description": brief_text(t.description, BRIEF_TOOL_CHARS) if brief else t.description,
                "parameters": _brief_schema(t.parameters) if brief else t.parameters,
            },
        }
        for t in tools
    ]


BRIEF_TOOL_CHARS = 300  # a tool's description, brief
BRIEF_PARAMETER_CHARS = 120  # a parameter's
_SENTENCE_END = re.compile(r"[.!?:](?=\s)")


def brief_text(text: str, limit: int) -> str:
    """The lead of a description: its first paragraph that is not a heading (of a list, the first
    item), cut after the last sentence that ends within `limit` characters (or at a word
    boundary, with an ellipsis, when none does)."""
    paragraphs = (p.strip() for p in text.strip().split("\n\n"))
    lead = next((p for p in paragraphs if p and not p.startswith("#")), "")
    lines = [line.strip() for line in lead.splitlines() if line.strip()]
    # of a list its first item, of a wrapped paragraph all of it
    lead = lines[0].lstrip("-* ") if any(line[0] in "-*" for line in lines) else " ".join(lines)
    if len(lead) <= limit:
        return lead
    ends = [m.end() for m in _SENTENCE_END.finditer(lead, 0, limit)]
    if ends and lead[ends[-1] - 1] != ":":
        return lead[: ends[-1]]
    cut = lead.rfind(" ", 0, limit)
    return lead[: cut if cut > 0 else limit].rstrip(" ,;:") + "..."


def _brief_schema(schema: Any) -> Any:
    """A copy of a JSON schema whose `description` strings are cut to their lead; the structure
    (types, enums, required) is unchanged."""
    if isinstance(schema, list):
        return [_brief_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$schema":  # which draft: nothing the model acts on
            continue
        if key == "description" and isinstance(value, str):
            out[key] = brief_text(value, BRIEF_PARAMETER_CHARS)
        elif key == "properties" and isinstance(value, dict):
            # property names are data, not schema keywords: a parameter called "description" stays
            out[key] = {name: _brief_schema(sub) for name, sub in value.items()}
        else:
            out[key] = _brief_schema(value)
    return out


def callable_tools(request: ChatRequest) -> list[Tool]:
    """The tools the reply may call, after the tool_choice policy (see the module docstring)."""
    choice = request.tool_choice
    if choice.mode is ToolChoiceMode.NONE:
        return []
    if choice.mode in (ToolChoiceMode.REQUIRED, ToolChoiceMode.NAMED) and not request.tools:
        written = choice.as_written or choice.name or choice.mode.value
        raise invalid(f"'{choice.where}' is {written!r} but the request has no tools", "tool_choice")
    if choice.mode is ToolChoiceMode.NAMED and choice.name not in {t.name for t in request.tools}:
        raise invalid(f"'{choice.where}' {choice.name!r} is not one of the declared tools", choice.where)
    return request.tools


def effort_for_budget(budget: int) -> ReasoningEffort:
    """The level a thinking budget asks for (Anthropic's `budget_tokens` scale)."""
    if budget <= 1024:
        return ReasoningEffort.LOW
    return ReasoningEffort.MEDIUM if budget <= 4096 else ReasoningEffort.HIGH


def reasoning_effort(request: ChatRequest, default: ReasoningEffort) -> ReasoningEffort:
    """The effort a request runs at, given the served model's default (see the module docstring)."""
    if request.prefill is not None:
        if request.thinking_on or request.thinking_budget is not None:
            raise invalid(
                "a final assistant message (prefill) cannot be combined with thinking; disable thinking "
                "or end with a user message",
                "messages",
            )
        return ReasoningEffort.OFF  # a prefill must not land inside a think block
    if request.reasoning_effort is not None:
        return request.reasoning_effort
    if request.thinking_budget is not None:
        return effort_for_budget(request.thinking_budget)
    if request.thinking_on and default is ReasoningEffort.OFF:
        return ReasoningEffort.MEDIUM
    return default


@dataclass(frozen=True, slots=True)
class ResolvedSampling:
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float


def resolve_sampling(sp: SamplingParams, defaults: SamplingDefaults) -> ResolvedSampling:
    """Each sampler setting: the request's value when it set one (explicit 0 or 1.0 included),
    else the served model's default, else off (a partial `defaults` may leave some unset)."""

    def pick(requested: float | None, default: float | None, off: float | None) -> float:
        for value in (requested, default, off):
            if value is not None:
                return value
        raise AssertionError("NO_SAMPLING_DEFAULTS sets every field")

    off = NO_SAMPLING_DEFAULTS
    return ResolvedSampling(
        temperature=pick(sp.temperature, defaults.temperature, off.temperature),
        top_p=pick(sp.top_p, defaults.top_p, off.top_p),
        top_k=int(pick(sp.top_k, defaults.top_k, off.top_k)),
        min_p=pick(sp.min_p, defaults.min_p, off.min_p),
        repetition_penalty=pick(sp.repetition_penalty, defaults.repetition_penalty, off.repetition_penalty),
    )


# `serve --tool-focus`: a request declaring more tools than this is narrowed for a small model
FOCUS_ABOVE = 8
# `--tool-focus auto` for small models: the shell and file tools of the coding agents in
# CLIENTS.md (Claude Code, Codex, OpenCode). Claude Code declares 24 tools; small models pick
# among them by name and pick wrong (Agent, Skill, TaskCreate, CronCreate: benchmarks/RESULTS.md).
AGENT_CORE_TOOLS = (
    "Bash", "Read", "Write", "Edit", "MultiEdit", "Glob", "Grep", "LS",
    "shell", "exec_command", "apply_patch",
    "bash", "read", "write", "edit", "glob", "grep", "list",
)  # fmt: skip
# What each of those is for, in the order the tool guide names them (`tool_guide`)
_CORE_PURPOSES = {
    "read a file": ("Read", "read"),
    "run a command": ("Bash", "bash", "shell", "exec_command"),
    "find files by name": ("Glob", "glob"),
    "search inside files": ("Grep", "grep"),
    "list a folder": ("LS", "list"),
    "create a file": ("Write", "write"),
    "change a file": ("Edit", "edit", "apply_patch"),
    "make several changes to one file": ("MultiEdit",),
}


def tool_guide(tools: list[Tool]) -> str | None:
    """The line a small model reads after the system prompt when its tools were focused and the
    server has no `--tool-prompt`: which of them does what, and to answer from a result. With it
    qwen2.5-coder:1.5b read config.ini with Read instead of searching it with Grep
    (benchmarks/RESULTS.md); None when fewer than two of the tools are known here."""
    names = {t.name for t in tools}
    uses = [
        f"{name} to {purpose}" for purpose, known in _CORE_PURPOSES.items() for name in known if name in names
    ]
    if len(uses) < 2:
        return None
    listed = ", ".join(uses[:-1]) + " and " + uses[-1]
    return f"Use {listed}. When a tool result arrives, answer the user with what it says."


def focus_tools(tools: list[Tool], names: tuple[str, ...]) -> list[Tool]:
    """The tools a model reads and may start a call to (`serve --tool-focus`): of a request that
    declares more than `FOCUS_ABOVE` tools, those named in `names`, in the request's order, when
    at least two of them are declared; else all. The others stay declared: a call to one that
    the model writes anyway is still read and validated as a call."""
    if not names or len(tools) <= FOCUS_ABOVE:
        return tools
    kept = [t for t in tools if t.name in names]
    return kept if len(kept) >= 2 else tools


def _canonical_call(name: str, arguments: str) -> tuple[str, str]:
    try:
        return name, json.dumps(json.loads(arguments), sort_keys=True)
    except ValueError:
        return name, arguments.strip()


# `repeated_calls` looks this many assistant turns back
REPEAT_WINDOW = 8


def repeated_calls(messages: list[Message]) -> dict[str, bool]:
    """Tools the model has called twice alike to no new end, in its last `REPEAT_WINDOW` turns:
    the same arguments, and the same result came back both times; each name maps to whether that
    result was an error (a tool message starting "Error:", as Anthropic's `is_error` arrives).
    Small models do this until the client's turn limit (the same Agent call nine times after nine
    errors, an Edit of a file that does not exist a dozen times, a Glob whose answer was already
    in view: benchmarks/RESULTS.md); a call whose result changed (a test run again after an edit)
    is no repeat. What `make_plan` does with them: see `Plan.call_tools`."""
    results = {m.tool_call_id: m.content for m in messages if m.role == "tool" and m.tool_call_id}
    turns = [m for m in messages if m.role == "assistant"][-REPEAT_WINDOW:]
    seen: set[tuple[str, str, str]] = set()
    out: dict[str, bool] = {}
    for turn in turns:
        for call in turn.tool_calls:
            result = results.get(call.id)
            if result is None:
                continue
            key = (*_canonical_call(call.name, call.arguments), result)
            if key in seen:
                out[call.name] = result.startswith("Error:")
            seen.add(key)
    return out


def _with_default_system(messages: list[Message], system: str | None) -> list[Message]:
    if system is None or any(m.role in ("system", "developer") for m in messages):
        return messages
    return [Message(role="system", content=system), *messages]


def _with_tool_prompt(messages: list[Message], text: str) -> list[Message]:
    """`serve --tool-prompt`: the text after the first system message's (templates render the
    tool list after it), or as the system message where there is none."""
    if messages and messages[0].role in ("system", "developer"):
        first = messages[0]
        joined = f"{first.content.rstrip()}\n\n{text}" if first.content.strip() else text
        return [replace(first, content=joined), *messages[1:]]
    return [Message(role="system", content=text), *messages]


# A focused request that gives no temperature samples at this (`focused_messages` says why)
FOCUS_TEMPERATURE = 0.2
# how `focused_messages` repeats the request after a tool result; a reply that starts to echo
# it ends there (`Plan.echo_stops`: the 1.5B model once answered with the result and this line)
ASKED = "(The user asked: "
_LINE_NUMBERS = re.compile(r"^ *\d+\t", re.M)
_REMINDERS = re.compile(r"<system-reminder>.*?</system-reminder>\s*", re.S)


def focused_messages(messages: list[Message], shown: list[Tool], tools: list[Tool]) -> list[Message]:
    """An agent's conversation as a small model reads it when its tools were focused
    (`focus_tools`), from replays of the requests where qwen2.5-coder:1.5b went wrong in Claude
    Code's tasks (benchmarks/RESULTS.md):

    - a system message after the first that speaks of a tool the model no longer sees (Claude
      Code's agent list "for the Agent tool", its skill list for the Skill tool) is left out: the
      model answered those lists, or refused ("I can't assist") after reading them (putting the
      tool guide in their place made it call Read for every task, `cat notes.txt` included);
    - `<system-reminder>` blocks in user messages (the date, and context the client attaches) are
      left out: the model echoed them instead of answering;
    - a tool result in `cat -n` form (every line a line number and a tab: Claude Code's Read) loses
      the numbers, which the model copied into files it wrote;
    - when the conversation ends with a tool result, the user's request follows it once more,
      "(The user asked: ...)": the model re-ran the call instead of answering from its result
      (a reply that starts to repeat this line ends there: `Plan.echo_stops`).

    The client's messages are not changed; `serve --tool-focus off` renders them as sent."""
    seen = {t.name for t in shown}
    hidden = [t.name for t in tools if t.name not in seen]
    out: list[Message] = []
    for i, m in enumerate(messages):
        if i > 0 and m.role == "system" and any(f"{name} tool" in m.content for name in hidden):
            continue
        if m.role == "user" and "<system-reminder>" in m.content:
            m = replace(m, content=_REMINDERS.sub("", m.content))
        elif m.role == "tool":
            lines = [line for line in m.content.split("\n") if line.strip()]
            if lines and all(_LINE_NUMBERS.match(line) for line in lines):
                m = replace(m, content=_LINE_NUMBERS.sub("", m.content))
        out.append(m)
    if out and out[-1].role == "tool":
        asked = next((m.content.strip() for m in reversed(out) if m.role == "user" and m.content.strip()), "")
        if asked:
            out[-1] = replace(out[-1], content=f"{out[-1].content}\n\n{ASKED}{asked})")
    return out


def make_plan(request: ChatRequest, registry: ModelRegistry) -> Plan:
    check_request(request, registry.limits)
    tools = callable_tools(request)  # the request alone decides this: refused before any lookup
    if not request.model:
        # Clients written for one-model servers (llama.cpp's) send no model: the fallback's.
        if registry.fallback is None:
            raise invalid("'model' is required (this server has no --fallback-model)", "model")
        request.model = registry.fallback
    # the model stays loaded while the request (and so its plan and generation) lives
    served = registry.resolve(request.model, holder=request)
    backend = served.backend
    if not isinstance(backend, ChatModel):  # an `Embedder`, the one other kind served
        raise invalid(f"model {backend.model_id!r} is an embedding model and cannot chat", "model")
    if backend.vision() is None and request.images():
        # Refused here, by name: a text-only template cannot even render image parts.
        raise invalid(
            f"model {backend.model_id!r} cannot read images: it has no vision tower; send text only "
            "or choose a vision model",
            "messages",
        )
    check_images(request, registry.limits)
    tokenizer = backend.tokenizer
    effort = reasoning_effort(request, served.default_reasoning)
    template = tokenizer.chat_template or CHATML_TEMPLATE
    think_id = tokenizer.token_to_id("<think>")
    has_reasoning = think_id is not None or "<think>" in template

    shown = focus_tools(tools, served.focus_tools)
    echo_stops: tuple[str, ...] = ()
    focused = shown is not tools  # `focus_tools` returns the list itself when it keeps all
    # the guard narrows what a started call is held to: tool_choice auto under the call grammar
    # only (required and named tools must still end in a call, and the parser must read it)
    guarded = request.tool_choice.mode is ToolChoiceMode.AUTO and served.guardrails.constrain_calls
    again = repeated_calls(request.messages) if tools and guarded else {}
    # a repeated call's good result is in view: the reply answers with it; errors: another tool
    call_tools = [t for t in shown if t.name not in again] if all(again.values()) else []
    if again:
        TOOL_STEERING.labels(kind="repeat").inc()
    if focused:
        TOOL_STEERING.labels(kind="focus").inc()

    if request.prompt is not None:
        prompt_text = request.prompt
        prompt_ids = tokenizer.encode(prompt_text, add_special_tokens=request.add_special_tokens)
    else:
        messages = _with_default_system(request.messages, served.default_system)
        guide = served.tool_prompt or (tool_guide(shown) if focused else None)
        if focused:
            messages = focused_messages(messages, shown, tools)
            if messages and messages[-1].role == "tool" and ASKED in messages[-1].content:
                echo_stops = (ASKED.rstrip(),)
        if tools and guide:
            messages = _with_tool_prompt(messages, guide)
        try:
            prompt_text = render_chat_template(
                template,
                template_messages(messages, as_parts=backend.vision() is not None and reads_parts(template)),
                tools=template_tools(shown, brief=served.brief_tools) if shown else None,
                add_generation_prompt=True,
                bos_token=tokenizer.bos_token,
                eos_token=tokenizer.eos_token,
                enable_thinking=effort is not ReasoningEffort.OFF,
                reasoning_effort=effort.value,
            )
        except ChatTemplateError as exc:
            raise invalid(f"the model's chat template rejected these messages: {exc}", "messages") from exc
        prompt_text += request.prefill or ""
        prompt_ids = tokenizer.encode(prompt_text, add_special_tokens=False)

    if not prompt_ids:
        raise invalid("the prompt is empty after rendering", "messages")
    num_prompt = len(prompt_ids)
    check_prompt_tokens(num_prompt, registry.limits)
    if num_prompt >= backend.max_context:
        raise invalid(
            f"the prompt is {num_prompt} tokens, which does not fit model {backend.model_id!r}'s context of "
            f"{backend.max_context} tokens (at least one token must be left for the reply)",
            "messages",
            code="context_length_exceeded",  # OpenAI's code for it, which clients match on
        )
    # A max_tokens beyond the context is passed as asked: the engine caps it to the room the
    # prompt leaves (`GenerationConfig.budget`) and reports running into it as finish reason
    # "length". No max_tokens: as many tokens as the context holds.
    max_new = backend.max_context - num_prompt if request.max_tokens is None else request.max_tokens

    sp = request.sampling
    for token_id in sp.logit_bias:
        if not 0 <= token_id < backend.vocab_size:
            raise invalid(
                f"logit_bias token id {token_id} is outside the vocabulary (0..{backend.vocab_size - 1})",
                "logit_bias",
            )
    sampling = resolve_sampling(sp, served.sampling_defaults)
    if focused and sp.temperature is None:
        # a small model picking and filling tool calls: its card's 0.7 made it wander off a
        # result it had (the same replays as `focused_messages`)
        sampling = replace(sampling, temperature=FOCUS_TEMPERATURE)
    config = GenerationConfig(
        max_new_tokens=max_new,
        stop_token_ids=tokenizer.eos_token_ids,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        min_p=sampling.min_p,
        repetition_penalty=sampling.repetition_penalty,
        presence_penalty=sp.presence_penalty,
        frequency_penalty=sp.frequency_penalty,
        logit_bias=dict(sp.logit_bias),
        seed=sp.seed if sp.seed is not None else served.default_seed,
        loop_window=served.loop_guard,
        num_top_logprobs=(sp.top_logprobs if sp.logprobs else None),
        cache_salt=request.cache_salt,
    )
    # A prefill follows the generation prompt, so the reply never starts inside a think block.
    start_in_reasoning = (
        has_reasoning and request.prefill is None and prompt_text.rstrip().endswith("<think>")
    )
    budget = request.thinking_budget
    if budget is None and effort is not ReasoningEffort.OFF:
        budget = THINKING_BUDGETS.get(effort)
    plan = Plan(
        backend=backend,
        request=request,
        prompt_text=prompt_text,
        prompt_ids=prompt_ids,
        config=config,
        reasoning=effort,
        chat_template=template,
        tools=tools,
        guardrails=served.guardrails,
        call_tools=call_tools,
        start_in_reasoning=start_in_reasoning,
        has_reasoning_markup=has_reasoning,
        thinking_budget=budget if has_reasoning else None,
        echo_stops=echo_stops,
    )
    plan.config.processors.extend(processors_for_plan(plan))
    return plan
