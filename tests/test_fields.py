"""The body field readers of api/fields.py: each failure is a 400 naming the field."""

from __future__ import annotations

import base64

import pytest

from turbospark.api import fields as f
from turbospark.errors import ApiError


def fails(call: object, *args: object, **kwargs: object) -> ApiError:
    with pytest.raises(ApiError) as info:
        call(*args, **kwargs)  # type: ignore[operator]
    assert info.value.status == 400
    return info.value


def test_json_object_body() -> None:
    assert f.parse_json_object(b'{"a": 1}') == {"a": 1}
    assert "empty" in fails(f.parse_json_object, b"  ").message
    assert "not valid JSON" in fails(f.parse_json_object, b"{").message
    assert "not an array" in fails(f.parse_json_object, b"[]").message


def test_scalars_name_the_dotted_path() -> None:
    body = {"n": 3, "x": 0.5, "s": "t", "b": True, "big": 20_000_000}
    assert (f.integer(body, "n"), f.number(body, "x"), f.string(body, "s"), f.boolean(body, "b", False)) == (
        3,
        0.5,
        "t",
        True,
    )
    assert f.integer({"n": 2.0}, "n") == 2 and f.integer({}, "n") is None
    error = fails(f.integer, body, "s", "options.s")
    assert (error.message, error.param) == ("'options.s' must be an integer, not a string", "options.s")
    assert fails(f.integer, body, "big", maximum=16).message == "'big' must be at most 16, got 20000000"
    assert fails(f.number, body, "x", minimum=1.0).message == "'x' must be at least 1, got 0.5"
    assert "NaN" in fails(f.number, {"x": float("nan")}, "x").message
    assert "boolean" in fails(f.boolean, {"b": 1}, "b", False).message
    assert "required" in fails(f.string, {}, "s", required=True).message


def test_arrays_of_objects() -> None:
    assert f.objects(None, "tools") == []
    assert f.objects([{"a": 1}], "tools") == [("tools[0]", {"a": 1})]
    assert fails(f.objects, "x", "tools").message == "'tools' must be an array, not a string"
    assert fails(f.objects, [{}, 3], "tools").param == "tools[1]"
    assert fails(f.required_objects, None, "messages", "message").message == "'messages' is required"
    assert "at least one message" in fails(f.required_objects, [], "messages", "message").message


def test_stop_list() -> None:
    assert f.stop_list({"stop": "END"}, "stop") == ["END"]
    assert f.stop_list({}, "stop") == []
    assert fails(f.stop_list, {"stop": [1]}, "stop").param == "stop"


def test_images_are_decoded_never_fetched() -> None:
    png = b"\x89PNG\r\n\x1a\n" + b"\0" * 8
    data = base64.b64encode(png).decode()
    assert f.decode_base64_image(data, "img").media_type == "image/png"
    uri = f.decode_base64_image(f"data:image/webp;base64,{data}", "img")
    assert (uri.media_type, uri.data) == ("image/webp", png)
    assert "does not fetch" in fails(f.decode_base64_image, "https://example.com/a.png", "img").message
    assert "empty" in fails(f.decode_base64_image, "", "img").message
