"""Reasoning never reaches the answer: every split point, streaming and not, through HTTP too."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
import torch

from turbospark.backend import ReasoningEffort
from turbospark.events import ReasoningDelta, TextDelta
from turbospark.generate import run_choice
from turbospark.plan import make_plan
from turbospark.reasoning import ReasoningSplitter, ThinkingBudget
from turbospark.registry import ModelRegistry
from turbospark.request import ChatRequest, Message
from turbospark.scripted import ScriptedChatModel
from turbospark.testing import LiveServer

# (output, start_in_reasoning, expected reasoning, expected answer)
CASES: list[tuple[str, bool, str, str]] = [
    ("<think>\nI add 2 and 2.\n</think>\n\nThe answer is 4.", False, "I add 2 and 2.", "The answer is 4."),
    ("I add 2 and 2.\n</think>\n\n4", True, "I add 2 and 2.", "4"),
    ("<think>still going when the tokens ran out", False, "still going when the tokens ran out", ""),
    ("unclosed from the template's own <think>", True, "unclosed from the template's own <think>", ""),
    ("Sure. <think>secret plan</think> Done.", False, "secret plan", "Sure. Done."),
    ("A<think>one</think>B<think>two</think>C", False, "onetwo", "ABC"),
    # A close tag nothing opened is dropped, with the whitespace after it (as after any </think>).
    ("stray close</think> answer", False, "", "stray closeanswer"),
    ("No thinking at all.", False, "", "No thinking at all."),
    ("  <think>x</think>y", False, "x", "y"),
    ("  plain with leading spaces", False, "", "  plain with leading spaces"),
    ("<thinking is not a tag> text <thin", False, "", "<thinking is not a tag> text <thin"),
    ("<think>a < b and </thin> is not the end</think>ok", False, "a < b and </thin> is not the end", "ok"),
    ("<think>\n\n</think>\n\nEmpty thoughts.", False, "", "Empty thoughts."),
    (
        "<think>multi\nline\n\n  reasoning  \n</think>answer\nwith lines\n",
        False,
        "multi\nline\n\n  reasoning",
        "answer\nwith lines\n",
    ),
]


def split_run(pieces: list[str], start: bool) -> tuple[str, str]:
    splitter = ReasoningSplitter(start)
    out = []
    for piece in pieces:
        out += splitter.feed(piece)
    out += splitter.finish()
    reasoning = "".join(p.text for p in out if isinstance(p, ReasoningDelta))
    answer = "".join(p.text for p in out if isinstance(p, TextDelta))
    assert all(p.text for p in out), "no empty pieces"
    return reasoning, answer


@pytest.mark.parametrize(("output", "start", "reasoning", "answer"), CASES)
def test_split_at_every_boundary(output: str, start: bool, reasoning: str, answer: str) -> None:
    assert split_run([output], start) == (reasoning, answer)
    for cut in range(1, len(output)):
        assert split_run([output[:cut], output[cut:]], start) == (reasoning, answer), cut
    for a in range(1, len(output)):
        for b in range(a + 1, len(output), 3):
            assert split_run([output[:a], output[a:b], output[b:]], start) == (reasoning, answer), (a, b)
    assert split_run(list(output), start) == (reasoning, answer)


def _registry(reply: str) -> ModelRegistry:
    registry = ModelRegistry()
    registry.add(ScriptedChatModel([reply]))
    return registry


@pytest.mark.parametrize(("output", "start", "reasoning", "answer"), CASES)
def test_pipeline_token_by_token(output: str, start: bool, reasoning: str, answer: str) -> None:
    request = ChatRequest(model="scripted", messages=[Message(role="user", content="2+2?")])
    plan = make_plan(request, _registry(output))
    plan.start_in_reasoning = start
    events = asyncio.run(run_choice(plan))
    got_reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    got_answer = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert (got_reasoning, got_answer) == (reasoning, answer)


def test_template_opened_think_starts_in_reasoning() -> None:
    template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "<|im_start|>assistant\n<think>\n"
    )
    backend = ScriptedChatModel(["weighing options</think>Pick B."])
    backend.tokenizer.chat_template = template
    try:
        registry = ModelRegistry()
        registry.add(backend)
        request = ChatRequest(model="scripted", messages=[Message(role="user", content="A or B?")])
        plan = make_plan(request, registry)
        assert plan.start_in_reasoning
        events = asyncio.run(run_choice(plan))
    finally:
        backend.tokenizer.chat_template = backend.tokenizer.config["chat_template"]
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "Pick B."
    assert "".join(e.text for e in events if isinstance(e, ReasoningDelta)) == "weighing options"


def _chat(url: str, stream: bool, effort: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "scripted",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": stream,
    }
    if effort:
        body["reasoning_effort"] = effort
    if not stream:
        message = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30).json()["choices"][0][
            "message"
        ]
        return {"content": message["content"] or "", "reasoning": message.get("reasoning_content") or ""}
    content, reasoning = [], []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            import json

            for choice in json.loads(line[6:])["choices"]:
                delta = choice["delta"]
                content.append(delta.get("content") or "")
                reasoning.append(delta.get("reasoning_content") or "")
    return {"content": "".join(content), "reasoning": "".join(reasoning)}


def test_openai_api_streaming_and_not_agree() -> None:
    replies = [out for out, start, _, _ in CASES if not start]
    expected = [(r, a) for _, start, r, a in CASES if not start]
    with LiveServer([ScriptedChatModel(replies)]) as srv:
        for stream in (False, True):
            for reasoning, answer in expected:
                got = _chat(srv.url, stream)
                assert got == {"content": answer, "reasoning": reasoning}


def test_thinking_budget_closes_the_block() -> None:
    open_id, close_id = 5, 6
    budget = ThinkingBudget(3, open_id, close_id, start_in_reasoning=False)
    generated: list[int] = []
    for step in range(8):
        logits = torch.zeros(10)
        logits[7] = 5.0  # the model would think forever
        budget(generated, logits)
        token = int(torch.argmax(logits))
        generated.append(open_id if step == 0 else token)
    # <think>, three reasoning tokens, then </think> forced, then the model is free again.
    assert generated[:6] == [open_id, 7, 7, 7, close_id, 7]
    fresh = budget.fork()
    assert fresh.num_reasoning == 0 and fresh.num_seen == 0


def test_budget_tokens_honored_end_to_end() -> None:
    reply = "<think>" + "thinking " * 40 + "</think>The answer."
    request = ChatRequest(
        model="scripted",
        messages=[Message(role="user", content="q")],
        reasoning_effort=ReasoningEffort.HIGH,
        thinking_budget=10,
    )
    events = asyncio.run(run_choice(make_plan(request, _registry(reply))))
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    assert reasoning == "thinking t"  # 10 byte tokens, then </think> was forced
    # The scripted model replays the rest of its script as the answer; the budget only decides
    # where reasoning ends, and the script's own late </think> is dropped, never shown.
    answer = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert answer.startswith("inking") and answer.endswith("The answer.") and "think>" not in answer
