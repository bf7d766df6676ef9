"""Property-based fuzzing of every route from the server's own OpenAPI description.

schemathesis generates schema-valid and schema-invalid requests for each operation in
`/openapi.json` and sends them to the app in-process (scripted backend). Every reply must be
a non-5xx, conform to the described statuses and content types, and (for errors) be in the
route's own API envelope. The budget is fixed: `EXAMPLES` per operation and mode, at least 1,000
requests in all, asserted at the end.
"""

from __future__ import annotations

from typing import Any

import orjson
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from turbospark.api.common import ServerState
from turbospark.registry import ModelRegistry
from turbospark.scripted import ScriptedChatModel
from turbospark.server import create_app

EXAMPLES = 48  # per operation and generation mode; hypothesis stops early where a space is small
MIN_REQUESTS = 1000
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
]


def envelope_of(path: str) -> str:
    if path.startswith("/api/") or path == "/":
        return "ollama"
    if path.startswith("/v1/messages"):
        return "anthropic"
    return "openai"


def assert_error_envelope(path: str, status: int, content_type: str, body: bytes) -> None:
    assert content_type.startswith("application/json"), (path, status, content_type, body[:200])
    data: Any = orjson.loads(body)
    kind = envelope_of(path)
    if kind == "openai":
        assert isinstance(data["error"]["message"], str) and data["error"]["type"], data
    elif kind == "anthropic":
        assert data["type"] == "error" and data["error"]["message"], data
    else:
        assert isinstance(data["error"], str) and data["error"], data


def fuzz(operation: schemathesis.APIOperation, mode: GenerationMode) -> int:
    """Runs `EXAMPLES` generated requests against one operation; returns how many were sent."""
    sent = 0

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,  # the same requests every run: CI never fails on a new draw
        suppress_health_check=list(HealthCheck),
    )
    def run(case: schemathesis.Case) -> None:
        nonlocal sent
        sent += 1
        response = case.call_and_validate(checks=CHECKS)
        if response.status_code >= 400:
            content_type = response.headers.get("content-type", [""])[0]
            assert_error_envelope(operation.path, response.status_code, content_type, response.content)

    run()
    return sent


def test_fuzz_every_route_from_the_openapi_description() -> None:
    registry = ModelRegistry()
    registry.add(ScriptedChatModel(['Hi! <tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>']))
    app = create_app(ServerState(registry=registry))
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    total = 0
    operations = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        operations += 1
        total += fuzz(operation, GenerationMode.POSITIVE)
        # Only bodies can be made invalid: a GET has none, and any path segment is a valid string.
        if operation.method.upper() == "POST":
            total += fuzz(operation, GenerationMode.NEGATIVE)
    print(f"{total} generated requests over {operations} operations")
    assert operations >= 20
    assert total >= MIN_REQUESTS, f"only {total} requests were generated"
