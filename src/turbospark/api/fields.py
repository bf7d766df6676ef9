"""Typed field readers for request bodies: each failure is a 400 that names the field.

Every API module validates its body once, on arrival, with these; nothing downstream
re-checks. `path` is the field's dotted location as the caller wrote it (`messages[2].content`).
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Mapping
from typing import Any

import orjson

from turbospark.backend import RequestImage
from turbospark.errors import ApiError, ErrorKind, invalid

MAX_IMAGE_BYTES = 20 * 1024 * 1024


def parse_json_object(raw: bytes) -> dict[str, Any]:
    if not raw.strip():
        raise invalid("request body is empty; expected a JSON object")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise invalid(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise invalid(f"request body must be a JSON object, not {_kind(body)}")
    return body


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def req(body: Mapping[str, Any], key: str, path: str | None = None) -> Any:
    value = body.get(key)
    if value is None:
        raise invalid(f"'{path or key}' is required", path or key)
    return value


def string(
    body: Mapping[str, Any], key: str, path: str | None = None, *, required: bool = False
) -> str | None:
    value = body.get(key)
    where = path or key
    if value is None:
        if required:
            raise invalid(f"'{where}' is required", where)
        return None
    if not isinstance(value, str):
        raise invalid(f"'{where}' must be a string, not {_kind(value)}", where)
    return value


def boolean(body: Mapping[str, Any], key: str, default: bool, path: str | None = None) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(f"'{path or key}' must be a boolean, not {_kind(value)}", path or key)
    return value


def integer(
    body: Mapping[str, Any],
    key: str,
    path: str | None = None,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
) -> int | None:
    value = body.get(key)
    where = path or key
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        if abs(value) > 2**53:
            # The JSON parser keeps integers exactly only up to 64 bits; past that a number
            # arrives as a float whose low digits are gone (2**64 + 5 reads as 2**64), so no range
            # check on it could be trusted.
            raise invalid(f"'{where}' must be an exact integer; {value:.17g} is too large", where)
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"'{where}' must be an integer, not {_kind(value)}", where)
    _check_range(value, where, minimum, maximum)
    return value


def _check_range(value: float, where: str, minimum: float | None, maximum: float | None) -> None:
    def show(v: float) -> str:
        return f"{v:g}" if isinstance(v, float) else str(v)

    if minimum is not None and value < minimum:
        raise invalid(f"'{where}' must be at least {show(minimum)}, got {show(value)}", where)
    if maximum is not None and value > maximum:
        raise invalid(f"'{where}' must be at most {show(maximum)}, got {show(value)}", where)


def number(
    body: Mapping[str, Any],
    key: str,
    path: str | None = None,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
) -> float | None:
    value = body.get(key)
    where = path or key
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise invalid(f"'{where}' must be a number, not {_kind(value)}", where)
    value = float(value)
    if value != value:
        raise invalid(f"'{where}' must be a number, not NaN", where)
    _check_range(value, where, minimum, maximum)
    return value


def array(
    body: Mapping[str, Any], key: str, path: str | None = None, *, required: bool = False
) -> list[Any] | None:
    value = body.get(key)
    where = path or key
    if value is None:
        if required:
            raise invalid(f"'{where}' is required", where)
        return None
    if not isinstance(value, list):
        raise invalid(f"'{where}' must be an array, not {_kind(value)}", where)
    return value


def obj(
    body: Mapping[str, Any], key: str, path: str | None = None, *, required: bool = False
) -> dict[str, Any] | None:
    value = body.get(key)
    where = path or key
    if value is None:
        if required:
            raise invalid(f"'{where}' is required", where)
        return None
    if not isinstance(value, dict):
        raise invalid(f"'{where}' must be an object, not {_kind(value)}", where)
    return value


def objects(value: Any, where: str) -> list[tuple[str, dict[str, Any]]]:
    """An array of objects, each with its path (`tools[2]`); an absent array is empty."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise invalid(f"'{where}' must be an array, not {_kind(value)}", where)
    return [(f"{where}[{i}]", as_object(item, f"{where}[{i}]")) for i, item in enumerate(value)]


def required_objects(value: Any, where: str, what: str) -> list[tuple[str, dict[str, Any]]]:
    """`objects` for an array that must be there and hold at least one `what`."""
    if value is None:
        raise invalid(f"'{where}' is required", where)
    items = objects(value, where)
    if not items:
        raise invalid(f"'{where}' must contain at least one {what}", where)
    return items


def as_object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise invalid(f"'{where}' must be an object, not {_kind(value)}", where)
    return value


def stop_list(body: Mapping[str, Any], key: str) -> list[str]:
    value = body.get(key)
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return list(value)
    raise invalid(f"'{key}' must be a string or an array of strings", key)


_DATA_URI = re.compile(r"^data:(?P<type>[\w.+-]+/[\w.+-]+)?(?:;[^,;]*)*;base64,(?P<data>.*)$", re.DOTALL)


def decode_base64_image(data: str, where: str, media_type: str | None = None) -> RequestImage:
    """A base64 string or a data URI; never a URL (no fetches driven by request content)."""
    match = _DATA_URI.match(data)
    if match:
        media_type = match.group("type") or media_type
        data = match.group("data")
    elif data.startswith(("http://", "https://", "file:")):
        raise invalid(
            f"'{where}' is a URL; this server does not fetch images: send the image as base64 or a data URI",
            where,
        )
    if len(data) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise ApiError(ErrorKind.TOO_LARGE, f"'{where}' is larger than {MAX_IMAGE_BYTES} bytes", param=where)
    try:
        raw = base64.b64decode(data, validate=False)
    except (binascii.Error, ValueError) as exc:
        raise invalid(f"'{where}' is not valid base64: {exc}", where) from exc
    if not raw:
        raise invalid(f"'{where}' is empty", where)
    return RequestImage(data=raw, media_type=media_type or _sniff(raw), where=where)


def _sniff(raw: bytes) -> str:
    if raw.startswith(b"\x89PNG"):
        return "image/png"
    if raw.startswith(b"\xff\xd8"):
        return "image/jpeg"
    if raw.startswith((b"GIF87a", b"GIF89a")):
        return "image/gif"
    if raw[:4] == b"RIFF" and raw[8:12] == b"WEBP":
        return "image/webp"
    return "application/octet-stream"
