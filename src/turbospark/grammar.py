"""Token-level constraints for a plan: the processors the decode loop applies before sampling.

`processors_for_plan` returns, in order, the thinking budget (`turbospark.reasoning`) and a
grammar mask when the request needs one:

- `tool_choice` required / named (OpenAI required or a function, Anthropic any or tool): the
  answer must be one or more calls (several only with `parallel_tool_calls`) in the model
  family's own call syntax, each naming a declared tool with arguments that fit its schema;
- `response_format` json_object / json_schema (Ollama `format`, Anthropic
  `output_config.format` arrive as the same `ResponseFormat`): the answer is that JSON; with
  tools on auto it may be calls instead.

The grammar engine is llguidance (Earley parser + lexer over the tokenizer's token trie; a mask
over a 150k vocabulary costs tens of microseconds, see `benchmarks/bench_grammar.py`). The mask
runs inside the decode loop: each step the processor advances its matcher on the new tokens and
sets every token the grammar forbids to -inf; once the grammar is complete only EOS is left.
A think block is left alone: the mask starts after `</think>` (or right away when the model
may open `<think>` as its first token), so reasoning models reason first and answer in grammar.

Each processor holds one sequence's state; `fork()` gives a fresh copy for another choice
(`Plan.config_for_choice`), so a batched engine keeps one per sequence.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from turbospark.backend import ChatModel, GenerationConfig, LogitsProcessor, ReasoningEffort
from turbospark.errors import invalid
from turbospark.metrics import GRAMMAR_REQUESTS, LAZY_TRIGGERS
from turbospark.reasoning import ThinkingBudget
from turbospark.request import ChatRequest, ResponseFormat, Tool, ToolChoiceMode
from turbospark.toolcalls import ToolFamily, detect_family
from turbospark.toolcalls.guardrails import GuardrailConfig
from turbospark.toolcalls.stream import JUNK_CHARS, MAX_JUNK, MAX_JUNK_GAP, Scan, junk_prefix_end

if TYPE_CHECKING:
    import llguidance

    from turbospark.tokenizer import Tokenizer


class PlanFacts(Protocol):
    """What the processors are built from: the fields of `turbospark.plan.Plan` read here
    (a protocol, so this module does not import the plan step that calls it)."""

    @property
    def backend(self) -> ChatModel: ...
    @property
    def request(self) -> ChatRequest: ...
    @property
    def config(self) -> GenerationConfig: ...
    @property
    def chat_template(self) -> str | None: ...
    @property
    def tools(self) -> list[Tool]: ...
    @property
    def call_tools(self) -> list[Tool]: ...
    @property
    def reasoning(self) -> ReasoningEffort: ...
    @property
    def start_in_reasoning(self) -> bool: ...
    @property
    def has_reasoning_markup(self) -> bool: ...
    @property
    def thinking_budget(self) -> int | None: ...
    @property
    def guardrails(self) -> GuardrailConfig: ...


# JSON inside a grammar: flexible but bounded whitespace, so a model cannot spin on spaces, and
# lenient about schema keywords llguidance does not enforce (format, $schema, ...).
JSON_OPTIONS: dict[str, Any] = {
    "whitespace_pattern": r"[\x20\x0A\x09]{0,24}",
    "lenient": True,
}

_ll_lock = threading.Lock()
_ll_tokenizers: dict[tuple[int, int], tuple[Tokenizer, llguidance.LLTokenizer]] = {}


def ll_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """llguidance's view of a tokenizer (its token trie), built once per tokenizer (~1 s for 150k)."""
    import llguidance

    key = (id(tokenizer), vocab_size)
    with _ll_lock:
        found = _ll_tokenizers.get(key)
        if found is not None and found[0] is tokenizer:
            return found[1]
        n_vocab = max(vocab_size, tokenizer.vocab_size)
        built = llguidance.LLTokenizer(
            tokenizer.hf.to_str(), n_vocab=n_vocab, eos_token=sorted(tokenizer.eos_token_ids)
        )
        _ll_tokenizers[key] = (tokenizer, built)
        return built


# ---------------------------------------------------------------- grammars (Lark, llguidance dialect)


def _lit(text: str) -> str:
    return json.dumps(text)


def closed_schema(schema: Any) -> Any:
    """The schema with `additionalProperties: false` wherever properties are declared and it is
    unset: under a grammar, an open object lets a model invent keys forever (xgrammar's strict
    mode makes the same choice; OpenAI's strict mode requires it)."""
    if isinstance(schema, list):
        return [closed_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed_schema(v) if k in _SUBSCHEMA_KEYS else v for k, v in schema.items()}
    for key in ("properties", "$defs", "definitions", "patternProperties"):
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_schema(sub) for name, sub in out[key].items()}
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


_SUBSCHEMA_KEYS = frozenset(
    ("items", "prefixItems", "anyOf", "oneOf", "allOf", "additionalProperties", "not", "if", "then", "else")
)


def _json_rule(schema: dict[str, Any]) -> str:
    schema = closed_schema(schema)
    body = {**schema, "x-guidance": {**JSON_OPTIONS, **schema.get("x-guidance", {})}}
    return "%json " + json.dumps(body)


class _Lark:
    """Builds a Lark grammar; markup that is one token in the vocabulary is matched as that token."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.rules: list[str] = []
        self.count = 0

    def rule(self, body: str, name: str | None = None) -> str:
        name = name or f"r{self.count}"
        self.count += 1
        self.rules.append(f"{name}: {body}")
        return name

    def markup(self, text: str) -> str:
        token_id = self.tokenizer.token_to_id(text)
        return f"<[{token_id}]>" if token_id is not None else _lit(text)

    def json(self, schema: dict[str, Any]) -> str:
        return self.rule(_json_rule(schema))

    def text(self) -> str:
        return "\n".join(self.rules) + "\n"


def _params_schema(tool: Tool) -> dict[str, Any]:
    schema = dict(tool.parameters) if tool.parameters else {}
    if not schema or ("type" not in schema and "properties" in schema):
        schema["type"] = "object"
    return schema


def _json_call(g: _Lark, tool: Tool, args_key: str) -> str:
    head = _lit('{"name": ' + json.dumps(tool.name) + f', "{args_key}": ')
    return g.rule(f'{head} {g.json(_params_schema(tool))} "}}"')


def _xml_call(g: _Lark, tool: Tool) -> str:
    """Qwen3-coder: `<function=name>` then one `<parameter=key>` block per property."""
    schema = _params_schema(tool)
    props = schema.get("properties") or {}
    required = [k for k in schema.get("required", []) if k in props]
    optional = [k for k in props if k not in required]
    parts = [_lit(f"<function={tool.name}>\n")]
    for key in required + optional:
        sub = props[key] if isinstance(props[key], dict) else {}
        # A string is free text that cannot close the parameter early; other types are JSON.
        value = g.rule(_xml_string(sub)) if sub.get("type") == "string" else g.json(sub)
        opener, closer = _lit(f"<parameter={key}>\n"), _lit("\n</parameter>\n")
        block = g.rule(f"{opener} {value} {closer}")
        parts.append(block if key in required else f"{block}?")
    parts.append(_lit("</function>"))
    return g.rule(" ".join(parts))


def _xml_string(schema: dict[str, Any]) -> str:
    """Raw text of a string parameter: never `</` (which would close the parameter early), an
    enum's values, and the length bounds."""
    enum = [v for v in schema.get("enum", []) if isinstance(v, str)]
    if enum:
        return " | ".join(_lit(v) for v in enum)
    low, high = schema.get("minLength"), schema.get("maxLength")
    low = low if isinstance(low, int) and low >= 0 else 0
    if isinstance(high, int) and high >= low:
        return f"/[^<]{{{low},{high}}}/"  # bounded: no "<" at all, so the count is exact
    return f"/([^<]|<[^\\/]){{{low},}}/"


def tool_call_grammar(
    g: _Lark, family: ToolFamily, tools: Sequence[Tool], parallel: bool, chat_template: str | None
) -> str:
    """A rule for one or more calls of `tools` in `family`'s syntax; returns its name."""
    many = "+" if parallel else ""
    if family is ToolFamily.MISTRAL:
        opener = g.markup("[TOOL_CALLS]")
        if chat_template is not None and "[ARGS]" in chat_template:
            args_marker = g.markup("[ARGS]")
            calls = [
                g.rule(f"{opener} {_lit(t.name)} {args_marker} {g.json(_params_schema(t))}") for t in tools
            ]
            return g.rule(f"({' | '.join(calls)}){many}")
        body = g.rule(" | ".join(_json_call(g, t, "arguments") for t in tools))
        rest = f'(", " {body})*' if parallel else ""
        return g.rule(f'{opener} "[" {body} {rest} "]"')
    if family is ToolFamily.LLAMA3:
        body = g.rule(" | ".join(_json_call(g, t, "parameters") for t in tools))
        return g.rule(f'{body} ("; " {body})*' if parallel else body)
    open_tag, close_tag = g.markup("<tool_call>"), g.markup("</tool_call>")
    if family is ToolFamily.QWEN3_CODER:
        body = g.rule(" | ".join(_xml_call(g, t) for t in tools))
    else:
        body = g.rule(" | ".join(_json_call(g, t, "arguments") for t in tools))
    call = g.rule(f'{open_tag} "\\n" {body} "\\n" {close_tag}')
    sequence = f'{call} ("\\n" {call})*' if parallel else call
    # Qwen2.5 ends its last call with "\n" before the end of turn; without the optional newline
    # that "\n" would commit a parallel grammar to another call (a 0.5B model then repeats its
    # call until max_tokens).
    return g.rule(f'{sequence} "\\n"?')


def response_schema(fmt: ResponseFormat) -> dict[str, Any] | None:
    if fmt.type == "json_object":
        return {"type": "object"}
    if fmt.type == "json_schema":
        return dict(fmt.schema) if fmt.schema else {"type": "object"}
    return None


def grammar_for_plan(plan: PlanFacts) -> tuple[str, str] | None:
    """(Lark grammar, kind) the answer must follow, or None when it is free text."""
    request = plan.request
    tokenizer = plan.backend.tokenizer
    g = _Lark(tokenizer)
    mode = request.tool_choice.mode
    if plan.tools and mode in (ToolChoiceMode.REQUIRED, ToolChoiceMode.NAMED):
        tools = plan.tools
        if mode is ToolChoiceMode.NAMED:  # the plan checked that the named tool is declared
            tools = [t for t in tools if t.name == request.tool_choice.name]
        family = detect_family(plan.chat_template)
        calls = tool_call_grammar(g, family, tools, request.parallel_tool_calls, plan.chat_template)
        g.rule(calls, "start")
        return g.text(), "tool_call"
    schema = response_schema(request.response_format) if request.response_format else None
    if schema is None:
        return None
    answer = g.json(schema)
    if plan.tools and mode is ToolChoiceMode.AUTO:
        family = detect_family(plan.chat_template)
        calls = tool_call_grammar(g, family, plan.tools, request.parallel_tool_calls, plan.chat_template)
        g.rule(f"{answer} | {calls}", "start")
    else:
        g.rule(answer, "start")
    assert request.response_format is not None
    return g.text(), request.response_format.type


# ---------------------------------------------------------------- the processor


def allowed_from_bitmask(bits: bytes, vocab_size: int) -> np.ndarray:
    """llguidance's bitmask (bit i of little-endian words = token i allowed) as a bool array."""
    return np.unpackbits(np.frombuffer(bits, dtype=np.uint8), bitorder="little")[:vocab_size].view(np.bool_)


def apply_bitmask(logits: torch.Tensor, bits: bytes, vocab_size: int) -> None:
    """Sets every token the bitmask forbids to -inf. `logits` is (vocab,) on any device; tokens
    past the grammar's vocabulary (padding rows of the embedding) are always forbidden."""
    n = min(vocab_size, logits.shape[0])
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        # In numpy, on one thread: torch splits an op over 150k elements across its intra-op
        # threads, and on a busy 2-core machine each such op then waits ~10 ms for a
        # descheduled thread (20 ms a token for the two ops below, against ~1 ms here).
        view = logits.numpy()
        np.copyto(view[:n], -np.inf, where=~allowed_from_bitmask(bits, vocab_size)[:n])
        view[n:] = -np.inf
        return
    allowed = torch.from_numpy(allowed_from_bitmask(bits, vocab_size))
    if logits.device.type != "cpu":
        allowed = allowed.to(logits.device, non_blocking=True)
    logits[:n].masked_fill_(~allowed[:n], float("-inf"))
    if logits.shape[0] > n:
        logits[n:] = float("-inf")


def force_tokens(logits: torch.Tensor, token_ids: Iterable[int]) -> None:
    """Only `token_ids` stay possible; they keep their relative logits."""
    ids = torch.tensor(sorted(token_ids), dtype=torch.long, device=logits.device)
    keep = logits.index_select(0, ids)
    keep = torch.where(torch.isfinite(keep), keep, torch.zeros_like(keep))
    logits.fill_(float("-inf"))
    logits.index_copy_(0, ids, keep)


class GrammarProcessor:
    """Constrains one sequence to a grammar; see the module docstring."""

    def __init__(
        self,
        matcher: llguidance.LLMatcher,
        vocab_size: int,
        eos_ids: frozenset[int],
        *,
        think_ids: tuple[int, int] | None = None,
        start_in_reasoning: bool = False,
        may_open_think: bool = False,
    ) -> None:
        self.pristine = matcher  # never advanced: fork() copies it
        self.matcher = matcher.deep_copy()
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self.think_ids = think_ids
        self.start_in_reasoning = start_in_reasoning
        self.may_open_think = may_open_think and think_ids is not None
        self.allow_think = self.may_open_think  # as configured, for fork()
        self.in_reasoning = start_in_reasoning and think_ids is not None
        self.started = False  # the grammar has seen its first token
        self.num_seen = 0

    def fork(self) -> GrammarProcessor:
        return GrammarProcessor(
            self.pristine,
            self.vocab_size,
            self.eos_ids,
            think_ids=self.think_ids,
            start_in_reasoning=self.start_in_reasoning,
            may_open_think=self.allow_think,
        )

    @property
    def is_done(self) -> bool:
        return self.matcher.is_stopped() or self.matcher.is_error()

    def _advance(self, token_id: int) -> None:
        if self.think_ids is not None:
            open_id, close_id = self.think_ids
            if self.in_reasoning:
                if token_id == close_id:
                    self.in_reasoning = False
                    self.may_open_think = False  # one think block, then the grammar
                return
            if not self.started and self.may_open_think and token_id == open_id:
                self.in_reasoning = True
                return
        self.started = True
        self.matcher.consume_token(token_id)

    def __call__(self, generated_ids: Sequence[int], logits: torch.Tensor) -> None:
        for token_id in generated_ids[self.num_seen :]:
            self._advance(token_id)
        self.num_seen = len(generated_ids)
        if self.in_reasoning:
            return
        if self.is_done:
            if self.eos_ids:
                force_tokens(logits, self.eos_ids)
            return
        bits = self.matcher.compute_bitmask()
        if not self.started and self.may_open_think and self.think_ids is not None:
            open_id = self.think_ids[0]
            keep = logits[open_id].clone()
            apply_bitmask(logits, bits, self.vocab_size)
            logits[open_id] = keep
        else:
            apply_bitmask(logits, bits, self.vocab_size)


def make_matcher(grammar: str, tokenizer: Tokenizer, vocab_size: int, param: str) -> llguidance.LLMatcher:
    try:
        import llguidance
    except ImportError as exc:  # a dependency, imported late: only constrained requests need it
        raise invalid(
            "this server cannot enforce output formats: llguidance is missing (reinstall turbospark)", param
        ) from exc

    ll = ll_tokenizer(tokenizer, vocab_size)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, ll)
    if is_error:
        raise invalid(
            f"the requested output format cannot be enforced: {messages[0] if messages else grammar}", param
        )
    matcher = llguidance.LLMatcher(ll, grammar, log_level=0)
    if matcher.is_error():
        raise invalid(f"the requested output format cannot be enforced: {matcher.get_error()}", param)
    return matcher


# ---------------------------------------------------------------- lazy tool calls (tool_choice auto)
#
# Under tool_choice auto the answer is free text until the model starts a call in a form the
# parsers know; from there on the rest of the call is held to a declared tool's name and that
# tool's schema. Two triggers:
#
# - the family's call-opening special token (`<tool_call>`, `[TOOL_CALLS]`): the grammar is the
#   family's call syntax (`tool_call_grammar`), which starts with that token;
# - at the very start of the answer, a bare JSON object whose first key is "name", maybe in a
#   code fence or after a short junk prefix such as `>` (what small Qwen models write instead of
#   tags; the Hermes parser reads it as a call when its guardrails are on, Llama 3 writes calls
#   that way; the junk rule is the parsers', `toolcalls.stream.junk_prefix_end`): once
#   `{"name"` is written, the answer from its first token is re-read under a grammar for such a
#   call.
#
# Our own switch, not a grammar with a lazy free-text prefix: the free part costs no mask at
# all (a token-id check, and a short decode while the answer's first characters could still
# open a bare call), and the call grammar is compiled once per tool set and copied per request.

_BARE_TRIGGER = re.compile(r'(?:```[\w-]{0,16}[ \t]*\n\s*)?\{\s*"name"')
_FENCE_HEADERS = ("", "json", "json5", "tool_call", "tool_code", "javascript")


def bare_trigger_state(text: str) -> bool | None:
    """For the answer's text so far: True once it opens a bare JSON call (`{"name"`, maybe
    fenced or after a junk prefix), None while it still could, False once it cannot."""
    s = text.lstrip()
    if _BARE_TRIGGER.match(s):
        return True
    if "```".startswith(s):
        return None
    if s.startswith("```"):
        newline = s.find("\n")
        if newline < 0:
            return None if len(s) < 24 and "`" not in s[3:] else False
        if s[3:newline].strip().lower() not in _FENCE_HEADERS:
            return False
        s = s[newline + 1 :].lstrip()
    else:
        start = junk_prefix_end(s)
        if not isinstance(start, int):
            return None if start is Scan.MORE else False
        s = s[start:]
        if _BARE_TRIGGER.match(s):
            return True
    if not s:
        return None
    if not s.startswith("{"):
        return False
    rest = s[1:].lstrip()
    return None if '"name"'.startswith(rest) else False


def _ws(g: _Lark) -> str:
    if "ws" not in {r.split(":", 1)[0] for r in g.rules}:
        g.rule(r"/[ \t\n]{1,8}/", "ws")
    return "ws?"


_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~")


def _junk(g: _Lark) -> str:
    """The junk prefix a bare call may follow (`junk_prefix_end`): up to MAX_JUNK of
    JUNK_CHARS, each followed by at most MAX_JUNK_GAP spaces, tabs or newlines. The regex
    metacharacters among them are escaped, so none reads as a class operator (`-`, `~~`).

    Two backticks are also one junk lexeme: the lexer does not back up, so after "``" it must
    have a finished lexeme to fall back on when the fence's opening "```" does not come. The
    grammar may so allow a little more junk than the trigger; it only re-reads what the trigger
    accepted, and what it forces after that is the call."""
    char = g.rule("/[" + "".join("\\" + c if c in _REGEX_META else c for c in JUNK_CHARS) + "]|``/")
    gap = g.rule(f"/[ \\t\\n]{{1,{MAX_JUNK_GAP}}}/") + "?"
    body = f"{char} {gap}"
    for _ in range(MAX_JUNK - 1):
        body = f"{char} {gap} ({body})?"
    return g.rule(body)


def bare_call_grammar(g: _Lark, tools: Sequence[Tool]) -> str:
    """A bare JSON call from the answer's start, maybe in a code fence or after a junk prefix:
    `{"name": <declared tool>, "arguments": <its schema>}` ("parameters" for Llama 3's key)."""
    ws = _ws(g)
    arg_key = '("\\"arguments\\"" | "\\"parameters\\"")'
    bodies = [
        g.rule(
            f'{_lit(json.dumps(t.name))} {ws} "," {ws} {arg_key} {ws} ":" {ws} {g.json(_params_schema(t))}'
        )
        for t in tools
    ]
    obj = g.rule(f'"{{" {ws} "\\"name\\"" {ws} ":" {ws} ({" | ".join(bodies)}) {ws} "}}"')
    fence = g.rule(r"/```[\w-]{0,16}[ \t]*\n/ " + f'{ws} {obj} {ws} "```"')
    return g.rule(f"{ws} ({fence} | {_junk(g)}? {obj}) {ws}")


@dataclass(frozen=True, slots=True)
class LazyCallGrammars:
    """The compiled grammars of one tool set (pristine matchers, copied per sequence)."""

    by_token: dict[int, llguidance.LLMatcher]  # opening special token -> the family's call grammar
    bare: llguidance.LLMatcher | None  # a bare / fenced JSON call at the answer's start
    closer_id: int | None = None  # the token that closes a tagged call (`</tool_call>`), if one
    # a fenced call after text to one of these tools starts `bare` too (the Hermes parser reads
    # one as a call); empty: none does
    fenced_names: frozenset[str] = frozenset()


_lazy_cache: OrderedDict[tuple[int, int, str], LazyCallGrammars] = OrderedDict()
_LAZY_CACHE_SIZE = 8


def lazy_call_grammars(
    tokenizer: Tokenizer,
    vocab_size: int,
    family: ToolFamily,
    tools: Sequence[Tool],
    parallel: bool,
    chat_template: str | None,
    bare: bool,
) -> LazyCallGrammars | None:
    """The lazy grammars for `tools`, cached by tool set: an agent sends the same ~25 tools on
    every turn, and compiling their schemas costs far more than copying a matcher."""
    openers = {
        ToolFamily.HERMES: "<tool_call>",
        ToolFamily.QWEN3_CODER: "<tool_call>",
        ToolFamily.MISTRAL: "[TOOL_CALLS]",
    }
    opener = openers.get(family)
    opener_id = tokenizer.token_to_id(opener) if opener is not None else None
    closer_id = tokenizer.token_to_id("</tool_call>") if opener == "<tool_call>" else None
    with_bare = bare and family in (ToolFamily.HERMES, ToolFamily.LLAMA3)
    if opener_id is None and not with_bare:
        return None
    g_call, g_bare = _Lark(tokenizer), _Lark(tokenizer)
    if opener_id is not None:
        g_call.rule(tool_call_grammar(g_call, family, tools, parallel, chat_template), "start")
    if with_bare:
        g_bare.rule(bare_call_grammar(g_bare, tools), "start")
    key = (id(tokenizer), vocab_size, g_call.text() + "\x00" + g_bare.text())
    with _ll_lock:
        found = _lazy_cache.get(key)
        if found is not None:
            _lazy_cache.move_to_end(key)
            return found
    by_token = {}
    if opener_id is not None:
        by_token[opener_id] = make_matcher(g_call.text(), tokenizer, vocab_size, "tools")
    built = LazyCallGrammars(
        by_token,
        make_matcher(g_bare.text(), tokenizer, vocab_size, "tools") if with_bare else None,
        closer_id,
        fenced_names=frozenset(t.name for t in tools)
        if with_bare and family is ToolFamily.HERMES
        else frozenset(),
    )
    with _ll_lock:
        _lazy_cache[key] = built
        while len(_lazy_cache) > _LAZY_CACHE_SIZE:
            _lazy_cache.popitem(last=False)
    return built


class LazyToolCallProcessor:
    """Free text until a call starts, then the call's grammar (see the section comment above).

    After the call grammar completes only EOS is left (a reply that calls tools ends there, as
    the families' templates teach). A tagged call that closes exactly as an earlier call of the
    same answer did (same tokens) also leaves only EOS: a small model that starts repeating its
    call (Qwen2.5-Coder-0.5B under an agent's parallel tool calls) would otherwise write the
    same call until max_tokens or the context ran out; the two calls written stay as written.
    `mask_seconds` / `num_masked` total the mask's cost for benchmarks; `trigger` says which
    form started the constraint (None: it never did).
    """

    def __init__(
        self,
        grammars: LazyCallGrammars,
        tokenizer: Tokenizer,
        vocab_size: int,
        eos_ids: frozenset[int],
        *,
        think_ids: tuple[int, int] | None = None,
        start_in_reasoning: bool = False,
    ) -> None:
        self.grammars = grammars
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self.think_ids = think_ids
        self.start_in_reasoning = start_in_reasoning and think_ids is not None
        self.in_reasoning = self.start_in_reasoning
        self.answer: list[int] = []  # answer tokens while a bare call may still open
        self.watch_bare = grammars.bare is not None
        # after text: the tokens from one holding a backtick, while they may open a fenced call
        self.ticks = backtick_ids(tokenizer) if grammars.fenced_names else frozenset()
        self.fence: list[int] | None = None
        self.matcher: llguidance.LLMatcher | None = None
        self.trigger: str | None = None
        self.failed = False  # the written prefix did not fit the grammar: left free
        self.call: list[int] | None = None  # the tagged call being written, from its opener
        self.calls: set[tuple[int, ...]] = set()  # the answer's closed tagged calls
        self.repeated = False  # a call closed as an earlier one did: only EOS is left
        self.num_seen = 0
        self.num_masked = 0
        self.mask_seconds = 0.0

    def fork(self) -> LazyToolCallProcessor:
        return LazyToolCallProcessor(
            self.grammars,
            self.tokenizer,
            self.vocab_size,
            self.eos_ids,
            think_ids=self.think_ids,
            start_in_reasoning=self.start_in_reasoning,
        )

    def _start(self, pristine: llguidance.LLMatcher, tokens: list[int], form: str) -> None:
        matcher = pristine.deep_copy()
        if matcher.consume_tokens(tokens) and not matcher.is_error():
            self.matcher, self.trigger = matcher, form
            LAZY_TRIGGERS.labels(form=form).inc()
        else:
            self.failed = True
            LAZY_TRIGGERS.labels(form="missed").inc()
        self.watch_bare = False
        self.answer = []

    def _advance(self, token_id: int) -> None:
        if self.matcher is not None:
            self.matcher.consume_token(token_id)
            self._track_call(token_id)
            return
        if self.failed:
            return
        if self.think_ids is not None:
            open_id, close_id = self.think_ids
            if self.in_reasoning:
                self.in_reasoning = token_id != close_id
                return
            if token_id == open_id and not self.answer:
                self.in_reasoning = True
                return
        opener = self.grammars.by_token.get(token_id)
        if opener is not None:
            self._start(opener, [token_id], "tag")
            self.call = [token_id]
            return
        if not self.watch_bare:
            if self.ticks:
                self._watch_fence(token_id)
            return
        self.answer.append(token_id)
        state = bare_trigger_state(self.tokenizer.decode(self.answer, skip_special_tokens=False))
        if state is None:
            return
        if state and self.grammars.bare is not None:
            self._start(self.grammars.bare, self.answer, "bare")
        self.watch_bare = False
        self.answer = []

    def _watch_fence(self, token_id: int) -> None:
        """After text: a JSON code fence whose object names a declared tool (`{"name": "Read"`)
        starts the bare call grammar from the token that holds the backticks, when nothing but
        whitespace comes before them in that token; else the fence stays free (the parser still
        reads a call in it). Unlike a call at the answer's start, the name must already be a
        declared tool's: after text a fenced JSON object is as likely a file's content (a
        package.json has a "name" too). Text is only decoded from a backtick on, for the few
        tokens that decide."""
        if self.fence is None:
            if token_id not in self.ticks:
                return
            self.fence = []
        self.fence.append(token_id)
        text = self.tokenizer.decode(self.fence, skip_special_tokens=False)
        at = text.find("```")
        if at < 0:
            if len(self.fence) >= _FENCE_TOKENS:
                self.fence = [token_id] if token_id in self.ticks else None
            return
        state = bare_trigger_state(text[at:])
        named = _FENCED_NAME.match(text, at) if state else None
        if (state is None or (state and named is None)) and len(self.fence) < _FENCE_TOKENS + 32:
            return  # the fence's header, the object's start or its name is still coming
        tokens, self.fence = self.fence, None
        if named is None or named.group(1) not in self.grammars.fenced_names:
            return
        if text[:at].strip():
            LAZY_TRIGGERS.labels(form="missed").inc()
            return
        assert self.grammars.bare is not None
        self._start(self.grammars.bare, tokens, "fence")

    def _track_call(self, token_id: int) -> None:
        """Follows the tagged calls of a constrained answer, to spot one written again."""
        if token_id in self.grammars.by_token:
            self.call = [token_id]
            return
        if self.call is None:
            return
        self.call.append(token_id)
        if token_id == self.grammars.closer_id:
            closed = tuple(self.call)
            self.repeated = self.repeated or closed in self.calls
            self.calls.add(closed)
            self.call = None

    def __call__(self, generated_ids: Sequence[int], logits: torch.Tensor) -> None:
        for token_id in generated_ids[self.num_seen :]:
            self._advance(token_id)
        self.num_seen = len(generated_ids)
        matcher = self.matcher
        if matcher is None:
            return
        if matcher.is_stopped() or matcher.is_error() or self.repeated:
            if self.eos_ids:
                force_tokens(logits, self.eos_ids)
            return
        started = time.perf_counter()
        bits = matcher.compute_bitmask()
        apply_bitmask(logits, bits, self.vocab_size)
        self.mask_seconds += time.perf_counter() - started
        self.num_masked += 1


_CALL_STARTS = ("<", "{", "`", "[")
_call_start_ids: dict[int, tuple[Tokenizer, torch.Tensor]] = {}
# a fence's three backticks come within this many tokens of the first
_FENCE_TOKENS = 3
_FENCED_NAME = re.compile(r'```[\w-]{0,16}[ \t]*\n\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_backtick_ids: dict[int, tuple[Tokenizer, frozenset[int]]] = {}


def backtick_ids(tokenizer: Tokenizer) -> frozenset[int]:
    """Ids of the tokens whose text holds a backtick (where a code fence can start). Built once
    per tokenizer, like `call_start_ids`."""
    with _ll_lock:
        found = _backtick_ids.get(id(tokenizer))
        if found is not None and found[0] is tokenizer:
            return found[1]
    texts = tokenizer.hf.decode_batch([[i] for i in range(tokenizer.vocab_size)], skip_special_tokens=False)
    ids = frozenset(i for i, t in enumerate(texts) if "`" in t)
    with _ll_lock:
        _backtick_ids[id(tokenizer)] = (tokenizer, ids)
    return ids


def call_start_ids(tokenizer: Tokenizer) -> torch.Tensor:
    """Ids of the tokens whose text, leading space aside, opens with what a call written as text
    would (`<tool_call>` spelled in pieces, a bare or fenced JSON object, a list, a special token
    such as `<tool_response>`). Built once per tokenizer (one batched decode of the vocabulary)."""
    with _ll_lock:
        found = _call_start_ids.get(id(tokenizer))
        if found is not None and found[0] is tokenizer:
            return found[1]
    texts = tokenizer.hf.decode_batch([[i] for i in range(tokenizer.vocab_size)], skip_special_tokens=False)
    starts = [i for i, t in enumerate(texts) if t.lstrip().startswith(_CALL_STARTS)]
    ids = torch.tensor(starts, dtype=torch.long)
    with _ll_lock:
        _call_start_ids[id(tokenizer)] = (tokenizer, ids)
    return ids


class NoCallProcessor:
    """The reply may open no call: what tool_choice auto leaves once the model repeated a call
    whose result it already has, or every tool it reads failed twice alike (`plan.repeated_calls`).
    The call-opening special token (`<tool_call>`) is masked at every step, and the answer's first
    token may not open what a call written as text would (`call_start_ids`); the plan's parser
    reads no calls either (`Plan.calls_closed`), so anything call-shaped stays text."""

    def __init__(self, opener_ids: Sequence[int], first_banned: torch.Tensor) -> None:
        self.opener_ids = list(opener_ids)
        self.first_banned = first_banned

    def fork(self) -> NoCallProcessor:
        return self

    def __call__(self, generated_ids: Sequence[int], logits: torch.Tensor) -> None:
        if self.opener_ids:
            logits[self.opener_ids] = float("-inf")
        if not generated_ids:
            banned = self.first_banned[self.first_banned < logits.shape[-1]].to(logits.device)
            logits.index_fill_(-1, banned, float("-inf"))


def lazy_processor_for_plan(
    plan: PlanFacts, vocab_size: int
) -> LazyToolCallProcessor | NoCallProcessor | None:
    """The lazy call constraint for a tool_choice auto request, or None (off, no tools, or no
    grammar engine: auto never needs one, so its absence is no error)."""
    request = plan.request
    guardrails = plan.guardrails
    if (
        not plan.tools
        or request.tool_choice.mode is not ToolChoiceMode.AUTO
        or not guardrails.constrain_calls
    ):
        return None
    tokenizer = plan.backend.tokenizer
    if not plan.call_tools:
        found = (tokenizer.token_to_id(t) for t in ("<tool_call>", "[TOOL_CALLS]"))
        # the end of the turn and an opening think block stay possible first tokens
        free = [*plan.config.stop_token_ids, *tokenizer.eos_token_ids, tokenizer.token_to_id("<think>")]
        starts = call_start_ids(tokenizer)
        kept = torch.tensor([i for i in free if i is not None], dtype=torch.long)
        first = starts[~torch.isin(starts, kept)]
        return NoCallProcessor([i for i in found if i is not None], first)
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return None
    family = detect_family(plan.chat_template)
    grammars = lazy_call_grammars(
        tokenizer,
        vocab_size,
        family,
        plan.call_tools,
        request.parallel_tool_calls,
        plan.chat_template,
        bare=guardrails.enabled,  # a bare call is only read as a call by the guardrails
    )
    if grammars is None:
        return None
    open_id, close_id = tokenizer.token_to_id("<think>"), tokenizer.token_to_id("</think>")
    return LazyToolCallProcessor(
        grammars,
        tokenizer,
        vocab_size,
        frozenset(plan.config.stop_token_ids) or tokenizer.eos_token_ids,
        think_ids=(open_id, close_id) if open_id is not None and close_id is not None else None,
        start_in_reasoning=plan.start_in_reasoning,
    )


def processors_for_plan(plan: PlanFacts) -> list[LogitsProcessor]:
    out: list[LogitsProcessor] = []
    tokenizer = plan.backend.tokenizer
    open_id, close_id = tokenizer.token_to_id("<think>"), tokenizer.token_to_id("</think>")
    think_ids = (open_id, close_id) if open_id is not None and close_id is not None else None
    if plan.thinking_budget is not None and think_ids is not None:
        out.append(ThinkingBudget(plan.thinking_budget, *think_ids, plan.start_in_reasoning))
    found = grammar_for_plan(plan)
    if found is not None:
        grammar, kind = found
        param = "tool_choice" if kind == "tool_call" else "response_format"
        vocab_size = max(plan.backend.vocab_size, tokenizer.vocab_size)
        matcher = make_matcher(grammar, tokenizer, vocab_size, param)
        eos_ids = frozenset(plan.config.stop_token_ids) or tokenizer.eos_token_ids
        may_think = plan.has_reasoning_markup and plan.reasoning is not ReasoningEffort.OFF
        out.append(
            GrammarProcessor(
                matcher,
                vocab_size,
                eos_ids,
                think_ids=think_ids,
                start_in_reasoning=plan.start_in_reasoning,
                may_open_think=may_think and not plan.start_in_reasoning,
            )
        )
        GRAMMAR_REQUESTS.labels(kind=kind).inc()
    else:
        lazy = lazy_processor_for_plan(plan, max(plan.backend.vocab_size, tokenizer.vocab_size))
        if lazy is not None:
            out.append(lazy)
            GRAMMAR_REQUESTS.labels(kind="tool_call_lazy").inc()
    return out
