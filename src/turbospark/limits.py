"""Bounds on what one request may ask of the server, each refused with a 4xx that names it.

One `Limits` per server (CLI flags for the ones an operator tunes), held by the registry and
checked in `plan.py` for every API: message count, max_tokens, n, stop strings, tool count, the
size and nesting of JSON schemas (tool parameters and structured output, which also drive the
grammar compiler), image bytes and pixels, and prompt tokens. The body size is checked earlier,
while the body is read (`api/common.read_json`).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import imagesize
import orjson

from turbospark.errors import ApiError, ErrorKind, invalid
from turbospark.request import ChatRequest


@dataclass(frozen=True, slots=True)
class Limits:
    max_body_bytes: int = 64 * 1024 * 1024
    max_messages: int = 4096
    max_prompt_tokens: int | None = None  # None: the model's context is the bound
    max_output_tokens: int = 1 << 20  # a max_tokens above the context (but below this) is capped
    max_n: int = 16
    max_stop: int = 16
    max_stop_chars: int = 1000
    max_tools: int = 256
    max_schema_bytes: int = 256 * 1024
    max_schema_depth: int = 64
    max_images: int = 64
    max_image_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 50_000_000


def _too_large(message: str, param: str) -> ApiError:
    return ApiError(ErrorKind.TOO_LARGE, message, param=param)


def schema_depth(value: Any, limit: int) -> int:
    """Nesting depth of a JSON value, counting no further than `limit + 1` (no recursion)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > deepest:
            deepest = depth
            if deepest > limit:
                return deepest
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
    return deepest


def check_schema(schema: dict[str, Any], where: str, limits: Limits) -> None:
    # Depth first: serializing a very deep value to measure it would itself recurse.
    depth = schema_depth(schema, limits.max_schema_depth)
    if depth > limits.max_schema_depth:
        raise invalid(
            f"'{where}' nests deeper than the limit of {limits.max_schema_depth} levels (max_schema_depth)",
            where,
        )
    size = len(orjson.dumps(schema))
    if size > limits.max_schema_bytes:
        raise _too_large(
            f"'{where}' is a {size}-byte JSON schema; the limit (max_schema_bytes) is "
            f"{limits.max_schema_bytes}",
            where,
        )


def check_request(request: ChatRequest, limits: Limits) -> None:
    """Everything countable before the prompt is rendered."""
    if len(request.messages) > limits.max_messages:
        raise _too_large(
            f"the request has {len(request.messages)} messages; the limit (--max-messages) is "
            f"{limits.max_messages}",
            "messages",
        )
    if request.max_tokens is not None and request.max_tokens > limits.max_output_tokens:
        raise invalid(
            f"max_tokens is {request.max_tokens}; the limit (--max-output-tokens) is "
            f"{limits.max_output_tokens}",
            "max_tokens",
        )
    if request.n > limits.max_n:
        raise invalid(f"n is {request.n}; the limit is {limits.max_n}", "n")
    if len(request.stop) > limits.max_stop:
        raise invalid(f"{len(request.stop)} stop strings; the limit is {limits.max_stop}", "stop")
    for stop in request.stop:
        if len(stop) > limits.max_stop_chars:
            raise invalid(
                f"a stop string is {len(stop)} characters long; the limit is {limits.max_stop_chars}", "stop"
            )
    if len(request.tools) > limits.max_tools:
        raise _too_large(
            f"the request declares {len(request.tools)} tools; the limit (--max-tools) is {limits.max_tools}",
            "tools",
        )
    for i, tool in enumerate(request.tools):
        check_schema(tool.parameters, f"tools[{i}].parameters", limits)
    if request.response_format is not None and request.response_format.schema is not None:
        check_schema(request.response_format.schema, "response_format.schema", limits)


def check_images(request: ChatRequest, limits: Limits) -> None:
    """Image count, bytes and pixels (once the model is known to read images at all)."""
    images = request.images()
    if len(images) > limits.max_images:
        raise _too_large(f"the request has {len(images)} images; the limit is {limits.max_images}", "images")
    for i, image in enumerate(images):
        check_image(image.data, image.where or f"images[{i}]", limits)


def check_image(data: bytes, where: str, limits: Limits) -> None:
    if len(data) > limits.max_image_bytes:
        raise _too_large(
            f"image {where} is {len(data)} bytes; the limit (--max-image-bytes) is {limits.max_image_bytes}",
            where,
        )
    # Header only: a decompression bomb is refused before anything decodes it.
    width, height = imagesize.get(io.BytesIO(data))
    if width < 0 or height < 0:
        raise invalid(f"image {where} is not a PNG, JPEG, GIF, WebP or other known image format", where)
    if width * height > limits.max_image_pixels:
        raise _too_large(
            f"image {where} is {width}x{height} = {width * height} pixels; the limit (--max-image-pixels) is "
            f"{limits.max_image_pixels}",
            where,
        )


def check_prompt_tokens(num_prompt_tokens: int, limits: Limits) -> None:
    if limits.max_prompt_tokens is not None and num_prompt_tokens > limits.max_prompt_tokens:
        raise invalid(
            f"the prompt is {num_prompt_tokens} tokens; the limit (--max-prompt-tokens) is "
            f"{limits.max_prompt_tokens}",
            "messages",
        )
