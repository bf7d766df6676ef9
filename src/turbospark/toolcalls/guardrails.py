"""Tool-call guardrails: turn what a model wrote into a call the client can run, or say why not.

Server policy per served model (`GuardrailConfig`, held by `turbospark.registry.ServedModel`),
on by default, and only consulted when a request carries tools. Three steps, each switchable:

- `repair_json`: a tolerant JSON reader for what small models write (code fences, trailing
  commas, single quotes, bare keys, Python literals, comments, missing commas, unclosed strings,
  brackets and braces at the end of the output).
- `match_names`: a near-miss tool name (case, separators, a `functions.` prefix, a typo) maps to
  the one declared tool it is closest to; an ambiguous or distant name does not.
- `validate_schema`: arguments are checked against the tool's JSON schema, and obvious type
  slips are coerced (`"3"` for an integer, `"true"` for a boolean, an object sent as a JSON
  string, one value where an array is wanted, a missing property that has a default).

`finalize_call` runs the steps on one parsed call and returns either a `CheckedCall` (with the
list of repairs it needed) or a `Rejected` with the reason; the parser then returns the raw text.
Nothing here raises on model output.
"""

from __future__ import annotations

import difflib
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from turbospark.request import Tool


@dataclass(slots=True, frozen=True)
class GuardrailConfig:
    """Which guardrail steps run (see the module docstring); `enabled=False` turns all off."""

    enabled: bool = True
    repair_json: bool = True
    match_names: bool = True
    validate_schema: bool = True
    # tool_choice auto: once the model starts a call, hold the rest of it to a declared tool's
    # name and schema with a grammar (`turbospark.grammar.LazyToolCallProcessor`)
    constrain_calls: bool = True


# ---------------------------------------------------------------- tolerant JSON


class JsonRepairError(ValueError):
    pass


_FENCE = re.compile(r"^\s*```[\w+-]*[ \t]*\n?(.*?)\n?[ \t]*(?:```\s*)?$", re.DOTALL)
_LITERALS = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}
_IDENT = re.compile(r"[A-Za-z_$][\w$-]*")
_NUMBER = re.compile(r"-?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")


def strip_code_fence(text: str) -> tuple[str, bool]:
    """The body of a Markdown code fence (an unclosed one too), and whether there was one."""
    if "```" not in text:
        return text, False
    found = _FENCE.match(text)
    if found is None:
        return text, False
    return found.group(1), True


class _Reader:
    """Recursive descent over almost-JSON; only called once strict `json.loads` has failed."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def skip(self) -> None:
        text, n = self.text, len(self.text)
        while self.pos < n:
            ch = text[self.pos]
            if ch in " \t\r\n":
                self.pos += 1
            elif text.startswith("//", self.pos):
                end = text.find("\n", self.pos)
                self.pos = n if end < 0 else end + 1
            elif text.startswith("/*", self.pos):
                end = text.find("*/", self.pos + 2)
                self.pos = n if end < 0 else end + 2
            else:
                break

    def peek(self) -> str:
        self.skip()
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def value(self) -> Any:
        ch = self.peek()
        if not ch:  # first: "" is `in` every string, so the quote test below would take it
            raise JsonRepairError("unexpected end of input")
        if ch == "{":
            return self.obj()
        if ch == "[":
            return self.array()
        if ch in "\"'":
            return self.string()
        found = _NUMBER.match(self.text, self.pos)
        if found is not None and (ch.isdigit() or ch in "-."):
            self.pos = found.end()
            return _number(found.group())
        ident = _IDENT.match(self.text, self.pos)
        if ident is not None:
            word = ident.group()
            self.pos = ident.end()
            if word in _LITERALS:
                return _LITERALS[word]
            if word in ("undefined", "NaN", "Infinity"):
                return None
            raise JsonRepairError(f"unexpected word {word!r}")
        raise JsonRepairError(f"unexpected character {ch!r} at {self.pos}")

    def obj(self) -> dict[str, Any]:
        self.pos += 1
        out: dict[str, Any] = {}
        while True:
            ch = self.peek()
            if not ch:
                return out  # unclosed at the end of the output
            if ch == "}":
                self.pos += 1
                return out
            if ch == ",":  # trailing, leading or doubled commas; a missing one is not needed
                self.pos += 1
                continue
            key = self.key()
            if self.peek() not in (":", "="):
                raise JsonRepairError(f"expected ':' after key {key!r}")
            self.pos += 1
            if not self.peek():
                out[key] = None
                return out
            out[key] = self.value()

    def key(self) -> str:
        if self.peek() in "\"'":
            return self.string()
        ident = _IDENT.match(self.text, self.pos)
        if ident is None:
            raise JsonRepairError(f"expected a key at {self.pos}")
        self.pos = ident.end()
        return ident.group()

    def array(self) -> list[Any]:
        self.pos += 1
        out: list[Any] = []
        while True:
            ch = self.peek()
            if not ch:
                return out
            if ch == "]":
                self.pos += 1
                return out
            if ch == ",":
                self.pos += 1
                continue
            out.append(self.value())

    def string(self) -> str:
        quote = self.text[self.pos]
        self.pos += 1
        text, n = self.text, len(self.text)
        parts: list[str] = []
        while self.pos < n:
            ch = text[self.pos]
            if ch == quote:
                self.pos += 1
                return "".join(parts)
            if ch == "\\" and self.pos + 1 < n:
                parts.append(self._escape())
                continue
            parts.append(ch)
            self.pos += 1
        return "".join(parts)  # unclosed at the end of the output

    def _escape(self) -> str:
        nxt = self.text[self.pos + 1]
        simple = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
        if nxt in simple:
            self.pos += 2
            return simple[nxt]
        if nxt == "u":
            digits = self.text[self.pos + 2 : self.pos + 6]
            if len(digits) == 4 and all(c in "0123456789abcdefABCDEF" for c in digits):
                self.pos += 6
                code = int(digits, 16)
                low = self.text[self.pos : self.pos + 6]
                if 0xD800 <= code < 0xDC00 and re.fullmatch(r"\\u[dD][c-fC-F][0-9a-fA-F]{2}", low):
                    self.pos += 6
                    return chr(0x10000 + ((code - 0xD800) << 10) + (int(low[2:], 16) - 0xDC00))
                return chr(code)
        self.pos += 2  # an unknown escape such as \' keeps its character
        return nxt


def _number(text: str) -> int | float:
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    value = float(text)
    return value if math.isfinite(value) else 0.0


def _first_value_start(text: str) -> int:
    starts = [i for i in (text.find("{"), text.find("[")) if i >= 0]
    return min(starts) if starts else -1


def loads_tolerant(text: str) -> tuple[Any, bool]:
    """Parses almost-JSON. Returns (value, repaired). Raises `JsonRepairError` if hopeless.

    Strict JSON comes back unchanged with repaired False. Anything after the first complete
    value is ignored (and counts as a repair), so is prose before an object or array.
    """
    try:
        return json.loads(text), False
    except ValueError:
        pass
    body, fenced = strip_code_fence(text)
    if fenced:
        try:
            return json.loads(body), True
        except ValueError:
            pass
    stripped = body.strip()
    start = 0
    if stripped and stripped[0] not in "{[\"'" and not stripped[0].isdigit() and stripped[0] != "-":
        start = _first_value_start(stripped)
        if start < 0:
            raise JsonRepairError("no JSON value found")
    return _Reader(stripped[start:]).value(), True


# ---------------------------------------------------------------- tool names


def _norm_name(name: str) -> str:
    name = name.strip().strip("`'\"")
    for prefix in ("functions.", "function.", "tools.", "tool.", "default_api."):
        if name.lower().startswith(prefix):
            name = name[len(prefix) :]
    return re.sub(r"[^0-9a-z]", "", name.lower())


def match_tool_name(name: str, declared: Sequence[str]) -> str | None:
    """The declared tool `name` refers to: itself, a normalized equal, or one close typo."""
    if name in declared:
        return name
    norm = _norm_name(name)
    if not norm:
        return None
    by_norm: dict[str, list[str]] = {}
    for d in declared:
        by_norm.setdefault(_norm_name(d), []).append(d)
    exact = by_norm.get(norm)
    if exact is not None:
        return exact[0] if len(exact) == 1 else None
    close = difflib.get_close_matches(norm, list(by_norm), n=2, cutoff=0.8)
    if not close:
        return None
    if len(close) == 2:
        best = difflib.SequenceMatcher(None, norm, close[0]).ratio()
        second = difflib.SequenceMatcher(None, norm, close[1]).ratio()
        if best - second < 0.05:
            return None  # two declared tools are about as close: do not guess
    matches = by_norm[close[0]]
    return matches[0] if len(matches) == 1 else None


# ---------------------------------------------------------------- JSON schema


@dataclass(slots=True)
class SchemaCheck:
    value: Any
    errors: list[str] = field(default_factory=list)
    coerced: bool = False


_TYPE_CHECKS: dict[str, Any] = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}


class _Checker:
    """Validates and coerces against a JSON schema (the subset tool schemas use)."""

    def __init__(self, root: Mapping[str, Any]) -> None:
        self.root = root
        self.coerced = False

    def resolve(self, schema: Any, depth: int = 0) -> Mapping[str, Any]:
        if not isinstance(schema, Mapping):
            return {} if schema is not False else {"not": {}}
        ref = schema.get("$ref")
        if isinstance(ref, str) and ref.startswith("#") and depth < 32:
            node: Any = self.root
            for part in ref.lstrip("#").strip("/").split("/"):
                if not part:
                    continue
                part = part.replace("~1", "/").replace("~0", "~")
                node = node.get(part) if isinstance(node, Mapping) else None
            if isinstance(node, Mapping):
                merged = {**node, **{k: v for k, v in schema.items() if k != "$ref"}}
                return self.resolve(merged, depth + 1)
        return schema

    def check(self, value: Any, schema: Any, path: str) -> tuple[Any, list[str]]:
        schema = self.resolve(schema)
        if not schema:
            return value, []
        if "not" in schema and not schema["not"]:
            return value, [f"{path}: no value is allowed here"]
        for combo in ("anyOf", "oneOf"):
            options = schema.get(combo)
            if isinstance(options, list) and options:
                return self._any_of(value, schema, options, path)
        errors: list[str] = []
        all_of = schema.get("allOf")
        if isinstance(all_of, list):
            for part in all_of:
                value, errs = self.check(value, part, path)
                errors += errs
        value, errs = self._typed(value, schema, path)
        return value, errors + errs

    def _any_of(
        self, value: Any, schema: Mapping[str, Any], options: list[Any], path: str
    ) -> tuple[Any, list[str]]:
        base = {k: v for k, v in schema.items() if k not in ("anyOf", "oneOf")}
        saved = self.coerced
        first_errors: list[str] = []
        # Try each option without coercion first, so a value that already fits is left alone.
        for allow_coerce in (False, True):
            for option in options:
                merged = {**base, **self.resolve(option)}
                self.coerced = False
                trial, errs = self.check(value, merged, path)
                if not errs and (allow_coerce or not self.coerced):
                    self.coerced = saved or self.coerced
                    return trial, []
                if not first_errors:
                    first_errors = errs or [f"{path}: does not match any allowed form"]
        self.coerced = saved
        return value, first_errors

    def _typed(self, value: Any, schema: Mapping[str, Any], path: str) -> tuple[Any, list[str]]:
        types = schema.get("type")
        allowed = [types] if isinstance(types, str) else list(types) if isinstance(types, list) else []
        if schema.get("nullable") is True and allowed:
            allowed.append("null")
        if allowed and not any(_TYPE_CHECKS.get(t, lambda v: True)(value) for t in allowed):
            coerced = _coerce(value, allowed)
            if coerced is _NO:
                return value, [f"{path}: expected {' or '.join(allowed)}, got {_kind(value)}"]
            value = coerced
            self.coerced = True
        errors: list[str] = []
        if "enum" in schema and isinstance(schema["enum"], list) and value not in schema["enum"]:
            fixed = _enum_near_miss(value, schema["enum"])
            if fixed is _NO:
                errors.append(f"{path}: {value!r} is not one of {schema['enum']!r}")
            else:
                value = fixed
                self.coerced = True
        if "const" in schema and value != schema["const"]:
            errors.append(f"{path}: must be {schema['const']!r}")
        if isinstance(value, dict):
            value, errs = self._object(value, schema, path)
            errors += errs
        elif isinstance(value, list):
            value, errs = self._array(value, schema, path)
            errors += errs
        elif isinstance(value, str):
            errors += _string_limits(value, schema, path)
        elif isinstance(value, int | float) and not isinstance(value, bool):
            errors += _number_limits(value, schema, path)
        return value, errors

    def _object(
        self, value: dict[str, Any], schema: Mapping[str, Any], path: str
    ) -> tuple[dict[str, Any], list[str]]:
        props = schema.get("properties")
        props = props if isinstance(props, Mapping) else {}
        required = [r for r in schema.get("required", []) if isinstance(r, str)]
        extra = schema.get("additionalProperties", True)
        out: dict[str, Any] = {}
        errors: list[str] = []
        unclaimed = [p for p in props if p not in value]
        for key, item in value.items():
            target = key
            if key not in props and unclaimed:
                # A property named with the wrong case or separators is the declared one.
                near = match_tool_name(key, unclaimed)
                if near is not None:
                    target = near
                    unclaimed.remove(near)
                    self.coerced = True
            if target in props:
                out[target], errs = self.check(item, props[target], f"{path}.{target}")
                errors += errs
            elif extra is False:
                self.coerced = True  # an undeclared key on a closed object: dropped
            elif isinstance(extra, Mapping):
                out[key], errs = self.check(item, extra, f"{path}.{key}")
                errors += errs
            else:
                out[key] = item
        for key in required:
            if key not in out:
                sub = self.resolve(props.get(key, {}))
                if "default" in sub:
                    out[key] = sub["default"]
                    self.coerced = True
                else:
                    errors.append(f"{path}: missing required property {key!r}")
        return out, errors

    def _array(self, value: list[Any], schema: Mapping[str, Any], path: str) -> tuple[list[Any], list[str]]:
        errors: list[str] = []
        prefix = schema.get("prefixItems")
        items = schema.get("items")
        out = list(value)
        for i, item in enumerate(out):
            sub: Any = None
            if isinstance(prefix, list) and i < len(prefix):
                sub = prefix[i]
            elif isinstance(items, list):
                sub = items[i] if i < len(items) else None
            elif isinstance(items, Mapping):
                sub = items
            if sub is not None:
                out[i], errs = self.check(item, sub, f"{path}[{i}]")
                errors += errs
        low, high = schema.get("minItems"), schema.get("maxItems")
        if isinstance(low, int) and len(out) < low:
            errors.append(f"{path}: needs at least {low} items")
        if isinstance(high, int) and len(out) > high:
            errors.append(f"{path}: allows at most {high} items")
        return out, errors


class _NoValue:
    pass


_NO: Any = _NoValue()


def _kind(value: Any) -> str:
    for name in ("boolean", "integer", "number", "string", "array", "object", "null"):
        if _TYPE_CHECKS[name](value):
            return name
    return type(value).__name__


def _coerce(value: Any, allowed: list[str]) -> Any:
    """One obvious conversion into an allowed type, or `_NO`."""
    for target in allowed:
        got = _coerce_one(value, target)
        if got is not _NO:
            return got
    return _NO


def _coerce_one(value: Any, target: str) -> Any:
    if isinstance(value, str):
        text = value.strip()
        if target == "integer" and re.fullmatch(r"[+-]?\d+(\.0*)?", text):
            return int(float(text)) if "." in text else int(text)
        if target == "number" and _NUMBER.fullmatch(text.lstrip("+")):
            return _number(text.lstrip("+"))
        if target == "boolean" and text.lower() in ("true", "false"):
            return text.lower() == "true"
        if target == "null" and text.lower() in ("null", "none", ""):
            return None
        if target in ("object", "array") and text[:1] in "{[":
            try:
                parsed, _ = loads_tolerant(text)
            except JsonRepairError:
                return _NO
            if _TYPE_CHECKS[target](parsed):
                return parsed
        if target == "array" and text:
            return [value]
        return _NO
    if isinstance(value, bool):
        return str(value).lower() if target == "string" else _NO
    if isinstance(value, int | float):
        if target == "integer" and float(value).is_integer():
            return int(value)
        if target == "string":
            return json.dumps(value)
        if target == "array":
            return [value]
        return _NO
    if target == "array" and isinstance(value, dict):
        return [value]
    if target == "string" and isinstance(value, dict | list):
        return json.dumps(value, ensure_ascii=False)
    return _NO


def _enum_near_miss(value: Any, options: list[Any]) -> Any:
    if isinstance(value, str):
        lowered = [o for o in options if isinstance(o, str) and o.lower() == value.strip().lower()]
        if len(lowered) == 1:
            return lowered[0]
    for option in options:
        if not isinstance(option, str) and isinstance(value, str):
            coerced = _coerce_one(value, _kind(option))
            if coerced is not _NO and coerced == option:
                return option
        is_number = isinstance(value, int | float) and not isinstance(value, bool)
        if isinstance(option, str) and is_number and option == json.dumps(value):
            return option
    return _NO


def _string_limits(value: str, schema: Mapping[str, Any], path: str) -> list[str]:
    errors = []
    low, high = schema.get("minLength"), schema.get("maxLength")
    if isinstance(low, int) and len(value) < low:
        errors.append(f"{path}: shorter than {low} characters")
    if isinstance(high, int) and len(value) > high:
        errors.append(f"{path}: longer than {high} characters")
    pattern = schema.get("pattern")
    if isinstance(pattern, str):
        try:
            if re.search(pattern, value) is None:
                errors.append(f"{path}: does not match pattern {pattern!r}")
        except re.error:
            pass  # a pattern Python cannot read is not the model's fault
    return errors


def _number_limits(value: float, schema: Mapping[str, Any], path: str) -> list[str]:
    errors = []
    for key, words in (
        ("minimum", "below"),
        ("maximum", "above"),
        ("exclusiveMinimum", "not above"),
        ("exclusiveMaximum", "not below"),
    ):
        bound = schema.get(key)
        if not isinstance(bound, int | float) or isinstance(bound, bool):
            continue
        fails = {
            "minimum": value < bound,
            "maximum": value > bound,
            "exclusiveMinimum": value <= bound,
            "exclusiveMaximum": value >= bound,
        }[key]
        if fails:
            errors.append(f"{path}: {value} is {words} {key} {bound}")
    return errors


def check_arguments(arguments: Any, schema: Mapping[str, Any] | None) -> SchemaCheck:
    """Validates `arguments` against a tool's parameter schema, coercing obvious slips."""
    if not schema:
        schema = {"type": "object"}
    checker = _Checker(schema)
    if "type" not in schema and "properties" in schema:
        schema = {**schema, "type": "object"}
    value, errors = checker.check(arguments, schema, "arguments")
    return SchemaCheck(value, errors, checker.coerced)


# ---------------------------------------------------------------- one call


@dataclass(slots=True)
class CheckedCall:
    name: str
    arguments: str  # JSON text of an object
    repairs: list[str]


@dataclass(slots=True)
class Rejected:
    reason: str  # "json" | "name" | "schema" | "shape"
    detail: str


def finalize_call(
    name: Any,
    arguments: Any,
    tools: Mapping[str, Tool],
    config: GuardrailConfig,
    repairs: Sequence[str] = (),
) -> CheckedCall | Rejected:
    """Applies the configured guardrails to one parsed call.

    `arguments` is what the model gave: a dict, a JSON string (`"arguments": "{...}"`), or None.
    `repairs` are what the parser already had to fix (e.g. "json" for a tolerant parse).
    """
    fixes = list(repairs)
    active = config.enabled
    if not isinstance(name, str) or not name.strip():
        return Rejected("shape", "the call has no function name")
    if isinstance(arguments, str):
        text = arguments.strip()
        if not text:
            arguments = {}
        else:
            try:
                arguments = json.loads(text)
            except ValueError:
                if not (active and config.repair_json):
                    return Rejected("json", "arguments are not valid JSON")
                try:
                    arguments, _ = loads_tolerant(text)
                except JsonRepairError as exc:
                    return Rejected("json", f"arguments are not JSON: {exc}")
                fixes.append("json")
            if active:
                fixes.append("arguments_string")
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return Rejected("shape", f"arguments must be an object, got {_kind(arguments)}")
    if active and config.match_names and tools:
        matched = match_tool_name(name, list(tools))
        if matched is None:
            return Rejected("name", f"no declared tool is called {name!r}")
        if matched != name:
            fixes.append("name")
            name = matched
    if active and config.validate_schema and name in tools:
        result = check_arguments(arguments, tools[name].parameters)
        if result.errors:
            return Rejected("schema", "; ".join(result.errors[:4]))
        if result.coerced:
            fixes.append("schema")
        arguments = result.value
    return CheckedCall(name, json.dumps(arguments, ensure_ascii=False), list(dict.fromkeys(fixes)))
