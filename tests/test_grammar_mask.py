"""Grammar-constrained decoding: the mask runs inside the decode loop and holds against logits
that prefer invalid tokens, over a byte tokenizer and a trained BPE with multi-character tokens."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from corpus.support import family_tokenizer, summarize, trained_bpe_tokenizer
from turbospark.backend import NEVER_CANCEL, CancelFlag, GenerationConfig, ReasoningEffort
from turbospark.decode import run_decode_loop
from turbospark.errors import ApiError
from turbospark.generate import run_choice
from turbospark.grammar import (
    GrammarProcessor,
    _json_rule,
    apply_bitmask,
    make_matcher,
    processors_for_plan,
)
from turbospark.plan import make_plan
from turbospark.registry import ModelRegistry
from turbospark.request import ChatRequest, Message, ResponseFormat, Tool, ToolChoice, ToolChoiceMode
from turbospark.scripted import ScriptedChatModel, byte_tokenizer
from turbospark.tokenizer import Tokenizer
from turbospark.toolcalls.guardrails import check_arguments

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "alerts": {"type": "boolean"},
    },
    "required": ["city", "days", "unit"],
    "additionalProperties": False,
}
WEATHER = Tool("get_weather", parameters=SCHEMA)
TIME = Tool(
    "get_time",
    parameters={"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 20}}},
)


class Adversary:
    """Seeded random logits with a large bonus on tokens that break JSON: EOS, closing
    brackets, markup. Unconstrained, it almost never produces valid output."""

    def __init__(self, tokenizer: Tokenizer, seed: int) -> None:
        self.vocab_size = tokenizer.vocab_size
        self.gen = torch.Generator().manual_seed(seed)
        bad = set(tokenizer.eos_token_ids)
        for text in ("}", "]", "<|im_end|>", "</tool_call>", ">", "x"):
            bad.update(tokenizer.encode(text)[:1])
        self.bad = torch.tensor(sorted(bad))

    def _logits(self) -> torch.Tensor:
        logits = torch.randn(self.vocab_size, generator=self.gen)
        logits[self.bad] += 8.0
        return logits

    def prefill(self, prompt_ids: Sequence[int], cancel: CancelFlag) -> torch.Tensor:
        return self._logits()

    def step(self, token_id: int) -> torch.Tensor:
        return self._logits()


def _decode(tokenizer: Tokenizer, seed: int, processor: GrammarProcessor | None) -> tuple[str, str]:
    config = GenerationConfig(
        max_new_tokens=400,
        stop_token_ids=tokenizer.eos_token_ids,
        temperature=1.0,
        seed=seed,
        processors=[processor] if processor is not None else [],
    )
    prompt = tokenizer.encode("<|im_start|>user\nweather?<|im_end|>\n<|im_start|>assistant\n")
    result = run_decode_loop(Adversary(tokenizer, seed), prompt, config, 4096, NEVER_CANCEL, lambda _: None)
    return tokenizer.decode(result.token_ids), result.finish_reason.value


def _valid(text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    check = check_arguments(value, SCHEMA)
    return not check.errors and not check.coerced


@pytest.mark.parametrize("which", ["bytes", "bpe"])
def test_mask_holds_against_adversarial_logits(which: str) -> None:
    tokenizer = byte_tokenizer() if which == "bytes" else trained_bpe_tokenizer()
    grammar = f"start: r\nr: {_json_rule(SCHEMA)}\n"
    matcher = make_matcher(grammar, tokenizer, tokenizer.vocab_size, "response_format")
    template = GrammarProcessor(matcher, tokenizer.vocab_size, tokenizer.eos_token_ids)
    num_valid_free = 0
    for seed in range(20):
        text, finish = _decode(tokenizer, seed, template.fork())
        assert finish == "stop", text  # the grammar ended and forced EOS
        assert _valid(text), text
        value = json.loads(text)
        assert set(value) <= set(SCHEMA["properties"])
        assert 1 <= value["days"] <= 14 and value["unit"] in ("celsius", "fahrenheit")
        assert len(value["city"]) <= 12
        free, _ = _decode(tokenizer, seed, None)
        num_valid_free += _valid(free)
    assert num_valid_free == 0  # the same logits unconstrained: never valid


def test_bitmask_on_padded_vocab_and_torch_path() -> None:
    tokenizer = trained_bpe_tokenizer()
    grammar = 'start: "{"\n'
    padded = tokenizer.vocab_size + 50  # embedding rows past the tokenizer, as real models have
    matcher = make_matcher(grammar, tokenizer, padded, "response_format")
    logits = torch.zeros(padded)
    apply_bitmask(logits, matcher.compute_bitmask(), padded)
    allowed = torch.isfinite(logits).nonzero().flatten().tolist()
    assert allowed and all(tokenizer.decode([i]).startswith("{") for i in allowed)
    assert all(i < tokenizer.vocab_size for i in allowed)


def test_bitmask_numpy_and_torch_paths_agree() -> None:
    """float32 CPU logits are masked in numpy (one thread); other dtypes and devices in torch."""
    tokenizer = trained_bpe_tokenizer()
    padded = tokenizer.vocab_size + 50
    matcher = make_matcher(f"start: r\nr: {_json_rule(SCHEMA)}\n", tokenizer, padded, "response_format")
    matcher.consume_tokens(tokenizer.encode('{"city": "Pa'))
    bits = matcher.compute_bitmask()
    masked = {}
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(padded, generator=torch.Generator().manual_seed(0)).to(dtype)
        apply_bitmask(logits, bits, padded)
        masked[dtype] = torch.isfinite(logits)
    assert torch.equal(masked[torch.float32], masked[torch.bfloat16])
    assert 0 < int(masked[torch.float32].sum()) < tokenizer.vocab_size


def _backend(reply: str, tokenizer: Tokenizer | None = None) -> tuple[ScriptedChatModel, ModelRegistry]:
    backend = ScriptedChatModel([reply], tokenizer=tokenizer)
    registry = ModelRegistry()
    registry.add(backend)
    return backend, registry


def _request(**kw: Any) -> ChatRequest:
    base: dict[str, Any] = {
        "model": "scripted",
        "messages": [Message(role="user", content="What is the weather in Paris?")],
        "max_tokens": 300,
    }
    base.update(kw)
    request = ChatRequest(**base)
    request.sampling.temperature = 1.0
    return request


@pytest.mark.parametrize("family", ["hermes", "qwen3_coder", "llama3", "mistral"])
def test_tool_choice_required_20_of_20(family: str) -> None:
    """A model that wants to chat is held to one call of a declared tool, whatever the seed."""
    _, registry = _backend("I'd rather just chat about the weather, honestly.", family_tokenizer(family))
    for seed in range(20):
        request = _request(
            tools=[WEATHER, TIME],
            tool_choice=ToolChoice(ToolChoiceMode.REQUIRED),
            parallel_tool_calls=False,
        )
        request.sampling.seed = seed
        events = asyncio.run(run_choice(make_plan(request, registry)))
        result = summarize(events)
        assert events[-1].reason == "tool_calls", result  # type: ignore[union-attr]
        assert len(result["calls"]) == 1 and result["text"] == ""
        call = result["calls"][0]
        tool = WEATHER if call["name"] == "get_weather" else TIME
        assert call["name"] in ("get_weather", "get_time")
        check = check_arguments(call["arguments"], tool.parameters)
        assert not check.errors and not check.coerced, call


def test_named_tool_and_parallel_calls() -> None:
    _, registry = _backend("Nope.")
    for seed in range(5):
        request = _request(tools=[WEATHER, TIME], tool_choice=ToolChoice(ToolChoiceMode.NAMED, "get_time"))
        request.sampling.seed = seed
        result = summarize(asyncio.run(run_choice(make_plan(request, registry))))
        assert result["calls"] and {c["name"] for c in result["calls"]} == {"get_time"}


def test_newline_after_the_last_parallel_call_ends_the_turn() -> None:
    """Qwen2.5 writes "\\n" after its last `</tool_call>`, then EOS: under parallel calls that
    newline must not commit the grammar to another call."""
    call = '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "UTC"}}\n</tool_call>\n'
    _, registry = _backend(call)
    request = _request(tools=[WEATHER, TIME], tool_choice=ToolChoice(ToolChoiceMode.REQUIRED))
    request.sampling.temperature = 0.0
    events = asyncio.run(run_choice(make_plan(request, registry)))
    result = summarize(events)
    assert result["calls"] == [
        {"name": "get_time", "id": result["calls"][0]["id"], "arguments": {"timezone": "UTC"}}
    ]
    assert result["text"] == "" and events[-1].reason == "tool_calls"  # type: ignore[union-attr]


def test_json_schema_response_format_20_of_20() -> None:
    _, registry = _backend("It is sunny and warm in Paris today!")
    fmt = ResponseFormat("json_schema", schema=SCHEMA, name="weather", strict=True)
    for seed in range(20):
        request = _request(response_format=fmt)
        request.sampling.seed = seed
        events = asyncio.run(run_choice(make_plan(request, registry)))
        text = summarize(events)["text"]
        assert _valid(text), text
        assert events[-1].reason == "stop"  # type: ignore[union-attr]


def test_json_object_response_format() -> None:
    _, registry = _backend('{"fine": true}')
    request = _request(response_format=ResponseFormat("json_object"))
    request.sampling.temperature = 0.0
    text = summarize(asyncio.run(run_choice(make_plan(request, registry))))["text"]
    assert json.loads(text) == {"fine": True}  # a reply that already fits passes untouched


def test_thinking_finishes_before_the_grammar() -> None:
    _, registry = _backend("<think>The user wants weather; call the tool.</think>Sure thing!")
    request = _request(
        tools=[WEATHER],
        tool_choice=ToolChoice(ToolChoiceMode.REQUIRED),
        reasoning_effort=ReasoningEffort.HIGH,
        parallel_tool_calls=False,
    )
    request.sampling.seed = 1
    result = summarize(asyncio.run(run_choice(make_plan(request, registry))))
    assert result["reasoning"] == "The user wants weather; call the tool."
    assert len(result["calls"]) == 1 and result["text"] == ""


def test_each_choice_gets_its_own_processor_state() -> None:
    _, registry = _backend("Nope.")
    request = _request(tools=[WEATHER], tool_choice=ToolChoice(ToolChoiceMode.REQUIRED), n=2)
    plan = make_plan(request, registry)
    a, b = plan.config_for_choice(0), plan.config_for_choice(1)
    assert a.processors[-1] is not b.processors[-1]
    assert isinstance(a.processors[-1], GrammarProcessor)


def test_no_grammar_without_constraints() -> None:
    _, registry = _backend("hi")
    plan = make_plan(_request(tools=[WEATHER]), registry)
    assert not any(isinstance(p, GrammarProcessor) for p in processors_for_plan(plan))


def test_unenforceable_schema_is_a_400() -> None:
    _, registry = _backend("hi")
    fmt = ResponseFormat("json_schema", schema={"$ref": "#/$defs/missing"})
    with pytest.raises(ApiError) as err:
        make_plan(_request(response_format=fmt), registry)
    assert err.value.status == 400 and err.value.param == "response_format"
