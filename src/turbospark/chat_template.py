"""Chat templates rendered the way Hugging Face's `apply_chat_template` renders them.

Same Jinja settings (trim_blocks, lstrip_blocks, loop controls), same `tojson` filter, same
globals (`raise_exception`, `strftime_now`), the `{% generation %}` tag, and the same
variables (messages, tools, add_generation_prompt, bos/eos tokens, extra kwargs such as
enable_thinking). Rendering happens in an immutable sandbox: a template is data from a
checkpoint, and must not reach attributes, files or the network. It is also bounded: a render
that runs past `MAX_RENDER_SECONDS` (checked at every call, attribute or item access, operator
and output chunk) or writes more than `MAX_RENDER_CHARS` fails with `ChatTemplateError`.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

from jinja2 import TemplateError, nodes
from jinja2.exceptions import SecurityError
from jinja2.ext import Extension
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace


class ChatTemplateError(ValueError):
    """The template raised (raise_exception) or could not be parsed or rendered."""


MAX_RENDER_SECONDS = 2.0
MAX_RENDER_CHARS = 16 * 1024 * 1024

_render = threading.local()  # the deadline of the render running on this thread


def _check_deadline() -> None:
    deadline: float | None = getattr(_render, "deadline", None)
    if deadline is not None and time.monotonic() > deadline:
        raise ChatTemplateError(f"chat template ran past its time limit of {MAX_RENDER_SECONDS:g} s")


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, with a time check on every hook it has and bounded `*` / `**`."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _check_deadline()
        if operator == "**" and isinstance(right, int) and abs(right) > 64:
            raise SecurityError("chat templates may not raise to powers above 64")
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                sized = isinstance(seq, str | list | tuple) and isinstance(times, int)
                if sized and len(seq) * times > MAX_RENDER_CHARS:
                    raise SecurityError("chat template tried to build a sequence over the output limit")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        _check_deadline()
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj: Any, attribute: str) -> Any:
        _check_deadline()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _check_deadline()
        return super().getitem(obj, argument)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Same defaults as transformers: non-ASCII stays as is, unlike Jinja's own tojson.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text; for rendering it is a no-op."""

    tags = {"generation"}  # noqa: RUF012

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


class _SafeNamespace(Namespace):
    """`namespace()` that refuses underscore names, so a template cannot reach interpreter internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # (self, ...) taken from args, as Namespace does
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _SafeNamespace._check(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _SafeNamespace._check(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"chat templates may not set underscore names on a namespace: {name!r}")


def _make_dict(*args: Any, **kwargs: Any) -> dict[Any, Any]:
    return dict(*args, **kwargs)


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = _BoundedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", _GenerationTag]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _SafeNamespace
    env.globals["dict"] = _make_dict
    return env


@lru_cache(maxsize=32)
def _compile(source: str) -> Any:
    try:
        return _environment().from_string(source)
    except TemplateError as exc:
        raise ChatTemplateError(f"chat template does not parse: {exc}") from exc


def render_chat_template(
    source: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
    **kwargs: Any,
) -> str:
    """Renders `messages` (OpenAI-shaped dicts) to the prompt text the model was trained on."""
    template = _compile(source)
    chunks: list[str] = []
    size = 0
    _render.deadline = time.monotonic() + MAX_RENDER_SECONDS
    try:
        for chunk in template.generate(
            messages=[_alias_reasoning(m) for m in messages],
            tools=list(tools) if tools else None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token or "",
            eos_token=eos_token or "",
            **kwargs,
        ):
            size += len(chunk)
            if size > MAX_RENDER_CHARS:
                raise ChatTemplateError(f"chat template wrote more than {MAX_RENDER_CHARS} characters")
            _check_deadline()
            chunks.append(chunk)
    except ChatTemplateError:
        raise
    except TemplateError as exc:
        raise ChatTemplateError(f"chat template failed: {exc}") from exc
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
        # the template met a message shape it was not written for (content parts, a missing key)
        raise ChatTemplateError(
            f"chat template failed on these messages: {type(exc).__name__}: {exc}"
        ) from exc
    except (ArithmeticError, RecursionError, MemoryError) as exc:
        # a template is data: whatever it computes wrong fails this request, not the server
        raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc
    finally:
        _render.deadline = None
    return "".join(chunks)


def _alias_reasoning(message: Mapping[str, Any]) -> Mapping[str, Any]:
    """Earlier reasoning under every name templates read it by (reasoning_content, thinking)."""
    reasoning = next(
        (message[k] for k in ("reasoning_content", "thinking", "reasoning") if message.get(k)), None
    )
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


# A ChatML template with Hermes-style tools and <think> reasoning, used for backends whose
# checkpoint ships no template (the scripted backend, bare GGUF files).
CHATML_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n'
    '{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' }}
{%- if message.reasoning_content %}{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}
{%- if message.content %}{{- message.content }}{%- endif %}
{%- for tc in message.tool_calls or [] %}
{%- if message.content or not loop.first %}{{- '\\n' }}{%- endif %}
{%- set fn = tc.function if tc.function is defined else tc %}
{{- '<tool_call>\\n{\"name\": \"' + fn.name + '\", \"arguments\": ' }}
{%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""
