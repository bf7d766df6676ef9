"""Shared fixtures for the tool-call tests: the corpus, family templates, and a byte tokenizer
that has each family's special marker tokens (so the detokenizer's handling of them is real)."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from turbospark.chat_template import CHATML_TEMPLATE
from turbospark.events import Event, ReasoningDelta, TextDelta, ToolCallArgs, ToolCallStart
from turbospark.request import Tool
from turbospark.scripted import MARKUP_TOKENS, SPECIAL_TOKENS, _byte_alphabet
from turbospark.tokenizer import Tokenizer

CORPUS = Path(__file__).parent / "toolcalls.json"

# Control tokens of the Llama 3 and Mistral tokenizers: special, so skipped when detokenizing.
FAMILY_SPECIALS = ["<|python_tag|>", "<|eot_id|>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"]

QWEN3_CODER_TEMPLATE = CHATML_TEMPLATE.replace(
    "return a json object with function name and arguments",
    "return <tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>\\n"
    "value_1\\n</parameter>\\n</function>\\n</tool_call>, not a json object with function name and arguments",
)

LLAMA3_TEMPLATE = """\
{{- bos_token }}
{%- if tools %}<|start_header_id|>system<|end_header_id|>

Respond with a JSON for a function call in the form {"name": function name, "parameters": dictionary \
of argument name and its value}, or start it with <|python_tag|>.
{%- for t in tools %}
{{ t | tojson }}
{%- endfor %}<|eot_id|>
{%- endif %}
{%- for message in messages %}<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

MISTRAL_TEMPLATE = """\
{{- bos_token }}
{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' %}[INST]{{ message.content }}[/INST]
{%- elif message.role == 'assistant' and message.tool_calls %}[TOOL_CALLS]{{ message.tool_calls | tojson }}
{%- else %}{{ message.content }}
{%- endif %}
{%- endfor %}"""

TEMPLATES = {
    "hermes": CHATML_TEMPLATE,
    "qwen3_coder": QWEN3_CODER_TEMPLATE,
    "llama3": LLAMA3_TEMPLATE,
    "mistral": MISTRAL_TEMPLATE,
}


@lru_cache(maxsize=1)
def corpus() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(CORPUS.read_text(encoding="utf-8"))
    return data


def corpus_tools() -> list[Tool]:
    return [Tool(t["name"], parameters=t["parameters"]) for t in corpus()["tools"]]


@lru_cache(maxsize=8)
def family_tokenizer(family: str) -> Tokenizer:
    """One token per byte plus ChatML, `<think>`/`<tool_call>` and the families' control tokens."""
    vocab = {ch: i for i, ch in enumerate(_byte_alphabet())}
    hf = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    specials = SPECIAL_TOKENS + FAMILY_SPECIALS
    hf.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in specials])
    hf.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    config = {
        "chat_template": TEMPLATES[family],
        "eos_token": "<|im_end|>",
        "bos_token": None,
        "eos_token_ids": [hf.token_to_id("<|endoftext|>")],
    }
    return Tokenizer(hf, config)


def summarize(events: list[Event]) -> dict[str, Any]:
    """Events of one choice as {text, reasoning, calls}, calls with parsed arguments."""
    text, reasoning = [], []
    calls: list[dict[str, Any]] = []
    args: list[str] = []
    for ev in events:
        if isinstance(ev, TextDelta):
            text.append(ev.text)
        elif isinstance(ev, ReasoningDelta):
            reasoning.append(ev.text)
        elif isinstance(ev, ToolCallStart):
            assert ev.index == len(calls)
            calls.append({"name": ev.name, "id": ev.id})
            args.append("")
        elif isinstance(ev, ToolCallArgs):
            args[ev.index] += ev.delta
    for call, a in zip(calls, args, strict=True):
        call["arguments"] = json.loads(a)
    return {"text": "".join(text), "reasoning": "".join(reasoning), "calls": calls}


BPE_TEXT = [
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3, "unit": "celsius"}}',
    '{"name": "get_time", "arguments": {"timezone": "Europe/Berlin"}}',
    '{"title": "Standup", "attendees": ["alice", "bob"], "when": {"date": "2024-05-01", "hour": 9}}',
    "The weather in Paris is sunny today, with a high of 24 degrees and a light breeze.",
    "def main():\n    print('hello world')\n    return 0\n",
    '[{"id": 1, "ok": true, "score": 0.5}, {"id": 2, "ok": false, "score": null}]',
]


@lru_cache(maxsize=1)
def trained_bpe_tokenizer() -> Tokenizer:
    """A real byte-level BPE with merges (multi-character tokens such as `"name` or ` Paris`),
    trained in a fraction of a second, plus ChatML and markup tokens."""
    hf = tokenizers.Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=700,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
    )
    hf.train_from_iterator(BPE_TEXT * 20, trainer=trainer)
    hf.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    config = {
        "chat_template": CHATML_TEMPLATE,
        "eos_token": "<|im_end|>",
        "eos_token_ids": [hf.token_to_id("<|endoftext|>")],
    }
    return Tokenizer(hf, config)
